"""A worker without a model: it executes the step protocol, checks it, and reports how long it would take.

Load tests and capacity studies need the whole cluster (scheduler, manager, deltas, actors) at scale on
machines without GPUs. ``SimulatedWorker`` keeps the same append-only block-table mirrors (and composite
members) a real worker keeps and checks every step against them more strictly than a real worker can
afford to: positions must continue where the request's last step ended, every block a step reads or
writes must be real, no block may be written by two requests or hold two places of one window, no pool
unit may lie in two blocks that live windows read, and no composite may be recomposed while one is read.
The checks are incremental: each request's live window (the entries its last step read) is kept with
the blocks in it, so a step costs what it changes (entries entering or leaving windows, blocks written,
compositions), not the tables' length. It keeps each request's sampling spec with its mirror, as a real
last stage does, and samples tokens from a hash of (seed, request seed, position) for a seeded
request, so a replay after a fault yields the same tokens and a client can recompute them (the engine
names requests itself, so the id is no part of it); an unseeded request's hash takes its engine id
instead. Asked for logprobs (or prompt logprobs), it reports those of a uniform distribution (its tokens
are not drawn from any model's). It takes the step's time from the roofline
cost model (optionally sleeping it, scaled, so load tests feel real).

Host-tier copies (``num_host_blocks``) are checked (well formed, a wide block a named composite, no load
into a block or unit a live window reads) and charged at the GPU's host link rate: ``host_unit_bytes[g]``
bytes per unit of group ``g`` on the most loaded device (every device copies its share at once). They run
on a side stream beside the compute, and the next step waits for both, so the step takes the longer of
the two. A load from host units no store filled since this worker started is reported failed.
"""
from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from typing import Any

from kvmanager import NULL_BLOCK_ID
from kvmanager.checks import is_int, is_number
from kvmanager.planning import as_full_attention, kv_layout
from kvmanager.specs import AttentionSpec

from workers.protocol import (GREEDY, RequestError, SamplingSpec, ScheduledChunk, StepInput, StepOutput,
                              check_chunk_fields, check_compositions, check_transfers)

from .cost_model import StepCostModel
from .presets import get_model_preset


class SimulatedWorker:
    """Mirrors and checks of one worker (or a whole TP x PP replica), with modelled step times.

    ``group_specs``: the KV-cache groups in the engine's order (``kv_layout(...).group_specs``);
    ``widths``: pool units per block of each group (``kv_layout(...).group_widths``; 1 each by default).
    ``pipeline_stage``: None sleeps the whole replica's step time; an index, that stage's share. Either
    way the step reports the whole replica's time (``StepOutput.simulated_time_s``).
    """

    def __init__(self, group_specs: Sequence[AttentionSpec], num_blocks: int, *, vocab_size: int,
                 widths: Sequence[int] | None = None, seed: int = 0, cost_model: StepCostModel | None = None,
                 pipeline_stage: int | None = None, sleep_factor: float = 0.0, num_host_blocks: int = 0,
                 host_unit_bytes: Sequence[int] | None = None):
        self.groups = list(group_specs)
        if not self.groups or not all(isinstance(s, AttentionSpec) for s in self.groups):
            raise ValueError(f"group_specs must be a non-empty list of attention specs, got {group_specs!r}")
        self.widths = tuple(widths) if widths is not None else (1,) * len(self.groups)
        if len(self.widths) != len(self.groups) or not all(is_int(w) and w >= 1 for w in self.widths):
            raise ValueError(f"widths must hold one integer >= 1 per group, got {widths!r}")
        for name, value, low in (("num_blocks", num_blocks, 2), ("vocab_size", vocab_size, 1)):
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not is_int(seed):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if not is_int(num_host_blocks) or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an integer >= 0, got {num_host_blocks!r}")
        self.num_host_blocks = num_host_blocks
        self.host_unit_bytes = tuple(host_unit_bytes) if host_unit_bytes is not None else (0,) * len(self.groups)
        self._host_filled: set[int] = set()          # host units a store of this worker wrote
        if not is_number(sleep_factor) or sleep_factor < 0:
            raise ValueError(f"sleep_factor must be a finite number >= 0, got {sleep_factor!r}")
        if pipeline_stage is not None and (cost_model is None or not is_int(pipeline_stage)
                                           or not 0 <= pipeline_stage < cost_model.pp):
            raise ValueError(f"pipeline_stage must be None or a stage index of the cost model's pipeline, "
                             f"got {pipeline_stage!r}")
        self.num_blocks, self.vocab_size, self.seed = num_blocks, vocab_size, seed
        self.cost_model, self.pipeline_stage, self.sleep_factor = cost_model, pipeline_stage, sleep_factor
        self._tables: dict[str, list[list[int]]] = {}
        self._computed: dict[str, int] = {}          # tokens computed through the request's last step
        self._windows: dict[str, list[range]] = {}   # per group: table entries the last step read
        self._live: dict[str, list[set[int]]] = {}   # per group: the blocks in that window
        self._quiet: dict[str, tuple[int, int]] = {}   # a chunk ending by [0], starting before [1], moves nothing
        self._readers: list[dict[int, int]] = [{} for _ in self.groups]   # block -> windows holding it
        self._members: list[dict[int, tuple[int, ...]]] = [{} for _ in self.groups]   # composites' units
        self._holder: dict[int, tuple[int, int]] = {}  # unit -> (group, block) of its latest composition
        self._unit_groups = [g for g, w in enumerate(self.widths) if w == 1]   # whose blocks are units
        self._specs: dict[str, SamplingSpec] = {}   # how each request samples (from its first chunk)
        self._prompt_lens: dict[str, int] = {}      # its prompt's length (from its first chunk)

    @classmethod
    def for_model(cls, model: Any, gpu: Any, *, num_blocks: int, block_size: int = 16,
                  tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, sliding_as_full: bool = False,
                  **kwargs) -> "SimulatedWorker":
        """A worker for a preset name or config.json path, with the groups the engine builds for it.

        ``sliding_as_full``: the engine's manager treats every layer as full attention; the cost model
        keeps the real windows (attention still reads only the window, the memory is what changes)."""
        preset = get_model_preset(model)
        specs = preset.layer_specs(block_size)
        layout = kv_layout(as_full_attention(specs) if sliding_as_full else specs, pipeline_parallel_size,
                           tensor_parallel_size)
        cost = StepCostModel(preset, gpu, tensor_parallel_size, pipeline_parallel_size)
        unit_bytes = [max(s.layers_per_group for s in layout.stages) * spec.page_size_bytes
                      for spec in layout.group_specs]
        return cls(layout.group_specs, num_blocks, vocab_size=preset.vocab_size, widths=layout.group_widths,
                   cost_model=cost, host_unit_bytes=unit_bytes, **kwargs)

    # -- queries -------------------------------------------------------------------------------
    @property
    def request_ids(self) -> list[str]:
        return list(self._tables)

    def block_table(self, request_id: str) -> list[list[int]]:
        """The append-only mirror of one request's tables, one list per group (a copy; stale ids included)."""
        return [list(t) for t in self._tables[request_id]]

    def blocks_in_use(self, request_id: str) -> list[list[int]]:
        """Per group, the real blocks the request's last step read or wrote: what the manager must hold."""
        return [t[w.start:w.stop] for t, w in zip(self._tables[request_id], self._windows[request_id])]

    def units(self, group: int, block_id: int) -> tuple[int, ...]:
        """The pool units block ``block_id`` of ``group`` spans, as the compositions so far say."""
        return (block_id,) if self.widths[group] == 1 else self._members[group][block_id]

    # -- the step ------------------------------------------------------------------------------
    def execute(self, step: StepInput, hidden_states: Any = None, on_checked=None) -> StepOutput:
        """Check and apply one step; sample for chunks that ask. ``hidden_states`` (from an earlier
        pipeline stage, when executors chain stages) carries nothing here and is ignored. ``on_checked``:
        called once the step passed every check (a refused step changed nothing and never calls it)."""
        undo: list = []
        try:
            self._apply(step, undo)
        except Exception:
            _rollback(undo)
            raise
        if on_checked is not None:
            on_checked()
        sampled = {c.request_id: self.sample(c) for c in step.chunks if c.sample}
        logprobs = {}
        for rid, token in sampled.items():
            k = self._specs.get(rid, GREEDY).logprobs
            if k is not None:
                uniform = -math.log(self.vocab_size)
                logprobs[rid] = (uniform, [(token + j) % self.vocab_size for j in range(min(k, self.vocab_size))],
                                 [uniform] * min(k, self.vocab_size))
        prompt_logprobs = {}
        uniform = -math.log(self.vocab_size)
        for c in step.chunks:   # every prompt token the chunk scores: from its first (the row before it) on
            k = self._specs.get(c.request_id, GREEDY).prompt_logprobs
            first, end = max(c.start_pos, 1), min(c.start_pos + len(c.token_ids), self._prompt_lens.get(c.request_id, 0))
            if k is not None and end > first:
                tokens = c.token_ids[first - c.start_pos:end - c.start_pos]
                top = min(k, self.vocab_size)
                prompt_logprobs[c.request_id] = (first, [uniform] * len(tokens),
                                                 [[(t + j) % self.vocab_size for j in range(top)] for t in tokens],
                                                 [[uniform] * top for _ in tokens], [1] * len(tokens))
        done, failed = self._copy(step)
        seconds = own = self.copy_time_s(step)
        if self.cost_model is not None and step.chunks:
            cost = self.cost_model.step([(c.start_pos, len(c.token_ids)) for c in step.chunks])
            seconds = max(seconds, cost.time_s)
            own = max(own, cost.time_s if self.pipeline_stage is None else cost.stage_time_s(self.pipeline_stage))
        if self.sleep_factor and own:
            time.sleep(own * self.sleep_factor)
        return StepOutput(step_id=step.step_id, sampled=sampled, logprobs=logprobs, simulated_time_s=seconds,
                          prompt_logprobs=prompt_logprobs, transfers_done=done, transfers_failed=failed)

    def copy_time_s(self, step: StepInput) -> float:
        """The step's host-tier copies at the GPU's host link rate (0 without a cost model)."""
        if self.cost_model is None or not (step.kv_stores or step.kv_loads):
            return 0.0
        rate = self.cost_model.gpu.host_link_bytes_per_s
        if not rate:
            raise ValueError(f"GPU preset {self.cost_model.gpu.name} has no host link rate to time host-tier copies")
        units = [(g, len(host)) for g, _, host in step.kv_stores] + [(g, len(host)) for g, host, _ in step.kv_loads]
        return sum(n * self.host_unit_bytes[g] for g, n in units) / rate

    def _copy(self, step: StepInput) -> tuple[list[int], list[int]]:
        """The (checked) copies' device blocks, done and failed; stores fill their host units."""
        done, failed = [], []
        for _, block, host in step.kv_stores:
            self._host_filled.update(host)
            done.append(block)
        for _, host, block in step.kv_loads:
            (done if self._host_filled.issuperset(host) else failed).append(block)
        return done, failed

    def sample(self, chunk: ScheduledChunk) -> int:
        """The token after the chunk: a function of (seed, request seed, its position) only; unseeded, of
        (seed, request id, position)."""
        position = chunk.start_pos + len(chunk.token_ids)
        spec = chunk.start.sampling if chunk.start is not None else self._specs.get(chunk.request_id, GREEDY)
        who = spec.seed if spec.seed is not None else f"id:{chunk.request_id}"
        key = f"{self.seed}\x00{who}\x00{position}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % self.vocab_size

    def check(self, step: StepInput) -> None:
        """Validate a step against the mirrors without changing anything (raises ValueError/TypeError)."""
        undo: list = []
        try:
            self._apply(step, undo)
        finally:
            _rollback(undo)

    # -- checks and bookkeeping, one journal of undo actions -----------------------------------
    def _apply(self, step: StepInput, undo: list) -> None:
        """Apply a step to the mirrors, checking as it goes; ``undo`` collects what reverts it."""
        if not isinstance(step, StepInput):
            raise TypeError(f"step must be a StepInput, got {type(step).__name__}")
        forget = list(step.forget)
        unknown = [r for r in forget if r not in self._tables]
        if unknown:
            raise ValueError(f"step {step.step_id}: forget names request ids this worker does not hold: {unknown}")
        if len(set(forget)) != len(forget):
            raise ValueError(f"step {step.step_id}: forget holds duplicate request ids: {forget}")
        check_compositions(step.compositions, self.widths, self.num_blocks)
        for rid in forget:
            for g, live in enumerate(self._live[rid]):
                for block in live:
                    self._leave(g, block, undo)
            for d in (self._tables, self._computed, self._windows, self._live, self._quiet):
                undo.append((d.__setitem__, rid, d.pop(rid)))
            if rid in self._specs:
                undo.append((self._specs.__setitem__, rid, self._specs.pop(rid)))
                undo.append((_restore, self._prompt_lens, rid, self._prompt_lens.pop(rid, None)))
        # Windows move forward: first what leaves them, then compositions, then what enters.
        moves, seen = [], set()
        tables, computed, quiets = self._tables, self._computed, self._quiet
        num_groups, num_blocks, vocab = len(self.groups), self.num_blocks, self.vocab_size
        for chunk in step.chunks:
            check_chunk_fields(chunk, step.step_id, seen, num_groups, num_blocks, vocab)
            rid = chunk.request_id
            start = chunk.start_pos
            end = start + len(chunk.token_ids)
            known = rid in tables
            if known and chunk.start is not None:
                raise RequestError(rid, f"request {rid!r}: start sent for a request this worker already holds (only a "
                                 "request's first chunk on the workers carries one)")
            if chunk.start is not None:
                undo.append((_restore, self._specs, rid, self._specs.get(rid)))
                undo.append((_restore, self._prompt_lens, rid, self._prompt_lens.get(rid)))
                self._specs[rid] = chunk.start.sampling
                self._prompt_lens[rid] = chunk.start.num_prompt_tokens
            if known:
                if start != computed[rid]:
                    raise RequestError(rid, f"request {rid!r}: start_pos={start} does not continue its previous steps, "
                                     f"which computed positions 0..{computed[rid] - 1}")
                undo.append((computed.__setitem__, rid, start))
            else:
                for d, v in ((tables, [[] for _ in self.groups]), (self._windows, [range(0)] * num_groups),
                             (self._live, [set() for _ in self.groups]), (quiets, (0, 0))):
                    d[rid] = v
                    undo.append((d.__delitem__, rid))
                undo.append((computed.pop, rid))
            computed[rid] = end
            quiet = quiets[rid]
            if end <= quiet[0] and start < quiet[1] and not any(chunk.new_block_ids):
                moves.append((chunk, None))            # most decode steps: no window moves
            else:
                moves.append((chunk, self._move_out(chunk, known, undo)))
        for g, block, units in step.compositions:      # in order: a unit goes to its latest composite
            self._compose(g, block, units, undo)
        writers: dict[int, tuple[str, int]] = {}    # block id (its first unit) -> (request, group) writing it
        sizes = [spec.block_size for spec in self.groups]
        windows_of = self._windows
        for chunk, windows in moves:
            rid, start = chunk.request_id, chunk.start_pos
            for g, (table, window, bs) in enumerate(zip(tables[rid], windows or windows_of[rid], sizes)):
                for b in table[start // bs:window.stop]:
                    other = writers.setdefault(b, (rid, g))
                    if other != (rid, g):
                        raise ValueError(f"step writes block {b} for request {rid!r} group {g} and for request "
                                         f"{other[0]!r} group {other[1]}")
        for chunk, windows in moves:
            if windows is not None:
                self._move_in(chunk, windows, undo)
        self._check_copies(step)

    def _check_copies(self, step: StepInput) -> None:
        """Well formed, on named composites, and no load into what a live window reads."""
        check_transfers(step.kv_stores, step.kv_loads, self.widths, self.num_blocks, self.num_host_blocks)
        for g, block in [(g, b) for g, b, _ in step.kv_stores] + [(g, b) for g, _, b in step.kv_loads]:
            if self.widths[g] > 1 and block not in self._members[g]:
                raise ValueError(f"host-tier copy of group {g} block {block}: no composition has named it")
        for g, _, block in step.kv_loads:
            if self._readers[g].get(block):
                raise ValueError(f"load into group {g} block {block}, which a live window reads")
            for unit in self.units(g, block):
                self._check_unit_free(unit, f"load into group {g} block {block}", g)

    def _move_out(self, chunk: ScheduledChunk, known: bool, undo: list) -> list[range]:
        """Append the chunk's ids to its mirror; release the entries its window leaves; return the new windows."""
        rid, start = chunk.request_id, chunk.start_pos
        end = start + len(chunk.token_ids)
        tables, old_windows, lives = self._tables[rid], self._windows[rid], self._live[rid]
        windows = []
        for g, (spec, table, new) in enumerate(zip(self.groups, tables, chunk.new_block_ids)):
            bs = spec.block_size
            if new:
                undo.append((_truncate, table, len(table)))
                table.extend(new)
            need = -(-end // bs)
            if len(table) < need:
                hint = "" if known else " (its first chunk on this worker must carry a table covering its tokens)"
                raise RequestError(rid, f"request {rid!r}: group {g} table has {len(table)} blocks ({len(table) * bs} "
                                 f"tokens) but the step reaches position {end - 1}{hint}")
            old = old_windows[g]
            window = range(spec.first_needed_token(start) // bs, need)
            for j in range(old.start, min(window.start, old.stop)):
                lives[g].discard(table[j])
                undo.append((lives[g].add, table[j]))
                self._leave(g, table[j], undo)
            windows.append(window)
        return windows

    def _move_in(self, chunk: ScheduledChunk, windows: list[range], undo: list) -> None:
        """Take the entries the chunk's windows reach for the first time: real, distinct, their units free."""
        rid, start = chunk.request_id, chunk.start_pos
        end = start + len(chunk.token_ids)
        old_windows, lives = self._windows[rid], self._live[rid]
        for g, (spec, table, window) in enumerate(zip(self.groups, self._tables[rid], windows)):
            entering = range(max(window.start, old_windows[g].stop), window.stop)
            nulls = [j for j in entering if table[j] == NULL_BLOCK_ID]
            if nulls:
                raise RequestError(rid, f"request {rid!r}: group {g} ({spec.kind}) has the null block at logical blocks "
                                 f"{nulls}, which positions {start}..{end - 1} read or write")
            live = lives[g]
            for j in entering:
                block = table[j]
                if block in live:
                    twice = sorted({b for b in table[window.start:window.stop]
                                    if table[window.start:window.stop].count(b) > 1})
                    raise RequestError(rid, f"request {rid!r}: group {g} holds blocks {twice} at two places of the window "
                                     f"positions {start}..{end - 1} read")
                live.add(block)
                undo.append((live.discard, block))
                self._enter(g, block, rid, undo)
        undo.append((self._windows.__setitem__, rid, old_windows))
        self._windows[rid] = windows
        undo.append((_restore, self._quiet, rid, self._quiet.get(rid)))
        self._quiet[rid] = (min(w.stop * spec.block_size for spec, w in zip(self.groups, windows)),
                            min(spec.computed_to_reach((w.start + 1) * spec.block_size)
                                for spec, w in zip(self.groups, windows)))

    def _enter(self, g: int, block: int, rid: str, undo: list) -> None:
        """A window reaches ``block``; the first one checks that its units lie in no other live block."""
        readers = self._readers[g]
        n = readers.get(block, 0)
        readers[block] = n + 1
        undo.append((_restore, readers, block, n))
        if n:
            return
        if self.widths[g] > 1:
            units = self._members[g].get(block)
            if units is None:
                raise ValueError(f"request {rid!r}: group {g} reads block {block}, which no composition has named")
            for unit in units:
                if self._holder[unit] != (g, block):
                    raise ValueError(f"request {rid!r}: group {g} block {block} spans unit {unit}, which a later "
                                     f"composition gave to group {self._holder[unit][0]} block "
                                     f"{self._holder[unit][1]}")
                self._check_unit_free(unit, f"request {rid!r}: group {g} block {block}", g)
        else:
            self._check_unit_free(block, f"request {rid!r}: group {g} block {block}", g)

    def _check_unit_free(self, unit: int, what: str, group: int) -> None:
        """No other block a live window reads spans ``unit`` (a width-1 group's block is its unit)."""
        for g in self._unit_groups:
            if g != group and self._readers[g].get(unit):
                raise ValueError(f"{what} spans unit {unit}, which group {g} block {unit} (read by a live "
                                 "window) spans too")
        holder = self._holder.get(unit)
        if holder is not None and holder[0] != group and self._readers[holder[0]].get(holder[1]) \
                and unit in self._members[holder[0]][holder[1]]:
            raise ValueError(f"{what} spans unit {unit}, which group {holder[0]} block {holder[1]} (read by a live "
                             "window) spans too")

    def _leave(self, g: int, block: int, undo: list) -> None:
        readers = self._readers[g]
        n = readers[block]
        undo.append((readers.__setitem__, block, n))
        if n > 1:
            readers[block] = n - 1
        else:
            del readers[block]

    def _compose(self, g: int, block: int, units: list[int], undo: list) -> None:
        """Block ``block`` of ``g`` now spans ``units``: neither it nor any of them may be read by a live window."""
        if block in self._readers[g]:
            raise ValueError(f"composition of group {g} block {block}: a live window still reads it")
        for unit in units:
            self._check_unit_free(unit, f"composition of group {g} block {block}", -1)
        members = self._members[g]
        undo.append((_restore, members, block, members.get(block)))
        members[block] = tuple(units)
        for unit in units:
            undo.append((_restore, self._holder, unit, self._holder.get(unit)))
            self._holder[unit] = (g, block)


def _truncate(items: list, length: int) -> None:
    del items[length:]


def _restore(d: dict, key, value) -> None:
    """Put back ``d[key]`` as it was: ``value``, or absent when that was None or 0."""
    if value:
        d[key] = value
    else:
        d.pop(key, None)


def _rollback(undo: list) -> None:
    for action, *args in reversed(undo):
        action(*args)
