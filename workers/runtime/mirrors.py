"""The worker's append-only mirrors of the engine's block tables, one int32 array per KV-cache group.

A request owns one row of every group's array while the worker holds it (a forgotten request's row is
zeroed and reused), so a step's tables are one fancy-indexing gather of its rows: no per-request list,
no per-request tensor. Entries past a row's length are 0, the null block, which is what a batch wider
than a short table holds there.

Checks are incremental. The entries a step reads or writes must be real blocks (and, for a group wider
than one unit, composites some composition named). A request's read range only moves forward (its window
start never decreases) and mirror entries never change, and the set of named composites only grows; so
each entry is checked once, the first time a step reaches it, with the same outcome as checking the
whole range every step. A decode step inside its last block checks nothing. Errors (the rare path) scan
the whole range again, so they name every offending entry.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmanager import NULL_BLOCK_ID
from kvmanager.specs import AttentionSpec
from workers.protocol import RequestError, ScheduledChunk


@dataclass(slots=True)
class ChunkUpdate:
    """What a checked chunk will change: its request's row (None: a new row) and new entries per group."""

    request_id: str
    row: int | None
    new_ids: list[list[int]]
    checked: list[int]           # per group: entries below this are verified after the step


class BlockTableMirrors:
    def __init__(self, specs: list[AttentionSpec], block_size: int, widths: tuple[int, ...],
                 rows: int = 16, cols: int = 16):
        self.specs, self.block_size, self.widths = specs, block_size, widths
        self.tables = [np.zeros((rows, cols), dtype=np.int32) for _ in specs]
        self.rows: dict[str, int] = {}                        # request -> its row
        self._lengths: list[list[int]] = [[0] * len(specs) for _ in range(rows)]
        self._checked: list[list[int]] = [[0] * len(specs) for _ in range(rows)]
        self._free = list(range(rows - 1, -1, -1))
        self.composed: dict[int, set[int]] = {g: set() for g, k in enumerate(widths) if k > 1}

    # -- queries ----------------------------------------------------------------------------------
    def table(self, request_id: str) -> list[list[int]]:
        row = self.rows[request_id]
        return [t[row, :n].tolist() for t, n in zip(self.tables, self._lengths[row])]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.rows

    # -- checking a chunk (changes nothing) -------------------------------------------------------
    def check(self, chunk: ScheduledChunk, known: bool, compositions: dict[int, dict]) -> ChunkUpdate:
        """The chunk's table must reach its last token and hold real (and named) blocks wherever it reads
        or writes; ``known``: the worker holds the request and keeps its mirror through this step."""
        bs, rid = self.block_size, chunk.request_id
        row = self.rows[rid] if known else None
        end = chunk.start_pos + len(chunk.token_ids)
        need = -(-end // bs)
        if known:   # the common decode step: no new entry, nothing read that was not checked before
            verified = self._checked[row]
            if need <= min(verified) and not any(chunk.new_block_ids):
                return ChunkUpdate(rid, row, chunk.new_block_ids, verified)
        checked = []
        for g, spec in enumerate(self.specs):
            new = chunk.new_block_ids[g]
            old_len = self._lengths[row][g] if known else 0
            if old_len + len(new) < need:
                hint = "" if known else " (the request is new to this worker, so its chunk must carry its whole table)"
                raise RequestError(rid, f"request {rid!r}: group {g} table has {old_len + len(new)} blocks "
                                        f"({(old_len + len(new)) * bs} tokens) but the step reaches {end} tokens{hint}")
            first = spec.first_needed_token(chunk.start_pos) // bs
            lo = max(first, self._checked[row][g] if known else 0)
            if lo < need:
                part = self._entries(row, g, new, old_len, lo, need)
                composed = self.composed.get(g)
                bad = NULL_BLOCK_ID in part
                if not bad and composed is not None and not composed.issuperset(part):
                    named = compositions.get(g, {})
                    bad = any(b not in composed and b not in named for b in part)
                if bad:
                    self._fail(rid, g, self._entries(row, g, new, old_len, first, need), first, chunk, end,
                               compositions)
            checked.append(max(need, self._checked[row][g] if known else 0))
        return ChunkUpdate(rid, row, chunk.new_block_ids, checked)

    def _entries(self, row, g, new, old_len, lo, hi) -> list[int]:
        """Entries ``[lo, hi)`` of the table as it will be: the mirror's, then the chunk's new ids."""
        part = self.tables[g][row, lo:min(hi, old_len)].tolist() if row is not None and lo < old_len else []
        return part + new[max(lo - old_len, 0):max(hi - old_len, 0)]

    def _fail(self, rid, g, read, first, chunk, end, compositions):
        if NULL_BLOCK_ID in read:
            nulls = [first + j for j, b in enumerate(read) if b == NULL_BLOCK_ID]
            raise RequestError(rid, f"request {rid!r}: group {g} has the null block at logical blocks {nulls}, "
                                    f"which positions {chunk.start_pos}..{end - 1} read or write")
        unknown = [b for b in read if b not in self.composed[g] and b not in compositions.get(g, ())]
        raise ValueError(f"request {rid!r}: group {g} reads blocks {unknown}, which no composition has named")

    # -- changing -----------------------------------------------------------------------------------
    def forget(self, request_id: str) -> None:
        row = self.rows.pop(request_id)
        for t, n in zip(self.tables, self._lengths[row]):
            t[row, :n] = 0
        self._lengths[row] = [0] * len(self.specs)
        self._checked[row] = [0] * len(self.specs)
        self._free.append(row)

    def apply(self, updates: list[ChunkUpdate], compositions: dict[int, dict]) -> None:
        """Append a checked step's entries: one vectorised write per group."""
        for g, composed in compositions.items():
            self.composed[g].update(composed)
        writes = [([], [], []) for _ in self.specs]           # per group: rows, columns, ids
        for u in updates:
            row = u.row
            if row is None:
                row = self.rows[u.request_id] = self._take_row()
            lengths = self._lengths[row]
            for g, new in enumerate(u.new_ids):
                if new:
                    rows, cols, ids = writes[g]
                    rows.extend([row] * len(new))
                    cols.extend(range(lengths[g], lengths[g] + len(new)))
                    ids.extend(new)
                    lengths[g] += len(new)
            self._checked[row] = list(u.checked)
        for g, (rows, cols, ids) in enumerate(writes):
            if ids:
                if max(cols) >= self.tables[g].shape[1]:
                    self._grow_cols(g, max(cols) + 1)
                self.tables[g][rows, cols] = ids

    def _take_row(self) -> int:
        if not self._free:
            n = len(self._lengths)
            for g, t in enumerate(self.tables):
                self.tables[g] = np.concatenate([t, np.zeros_like(t)])
            self._lengths += [[0] * len(self.specs) for _ in range(n)]
            self._checked += [[0] * len(self.specs) for _ in range(n)]
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

    def _grow_cols(self, g: int, cols: int) -> None:
        t = self.tables[g]
        grown = np.zeros((t.shape[0], max(cols, 2 * t.shape[1])), dtype=np.int32)
        grown[:, :t.shape[1]] = t
        self.tables[g] = grown

    def gather(self, rows: np.ndarray, width: int) -> list[np.ndarray]:
        """Per group, the scheduled rows' first ``width`` entries ``[len(rows), width]`` (zeros past a row)."""
        out = []
        for g, t in enumerate(self.tables):
            if t.shape[1] < width:
                self._grow_cols(g, width)
                t = self.tables[g]
            out.append(t[rows, :width])
        return out
