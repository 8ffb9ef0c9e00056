"""The step protocol between the engine and its workers: plain dataclasses that msgpack can carry.

The engine owns every block table; a worker keeps an append-only mirror per request and KV-cache group,
fed by ``new_block_ids``. Dropped entries are never sent back to a worker: attention never reads
outside the window, so a stale id in the mirror is harmless. A table entry is one block id whatever the
number of layers: a block of a group of width ``k > 1`` is a composite of ``k`` pool units, and the step
carries each composite made since the last step (``compositions``), to apply before reading any table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class ScheduledChunk:
    """The tokens one request computes in one step."""

    request_id: str
    token_ids: list[int]                 # inputs of this step: a prefill chunk or the last sampled token
    start_pos: int                       # tokens already computed; these take positions start_pos..
    new_block_ids: list[list[int]]       # per KV-cache group: ids appended to the request's table (0 = null)
    sample: bool = True                  # this chunk reaches the last known token: produce the next one
    temperature: float = 0.0             # 0 = greedy
    seed: int = 0                        # sampling at position p is seeded by (seed, p): replays are identical


@dataclass
class StepInput:
    step_id: int
    chunks: list[ScheduledChunk]
    forget: list[str] = field(default_factory=list)   # drop these mirrors before the step (freed, preempted)
    # (group, block_id, units) per composite made since the last step, in order: block ``block_id`` of
    # ``group`` now spans ``units`` (block_id first). Applied before the step; later entries win.
    compositions: list = field(default_factory=list)


@dataclass
class StepOutput:
    step_id: int
    sampled: dict[str, int]              # request_id -> next token, for chunks with sample=True
    simulated_time_s: float = 0.0        # simulated workers: the step's time on the modelled GPU


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def ints_in(values: list, end: int) -> bool:
    """A non-empty list of ints (no bools) in [0, end), checked at C speed: this runs for every chunk."""
    return set(map(type, values)) == {int} and min(values) >= 0 and max(values) < end


def check_compositions(compositions, widths, num_blocks: int) -> dict[int, dict[int, list[int]]]:
    """Every composition well formed; returns, per group, block id -> units (the last entry for an id wins)."""
    if not isinstance(compositions, list):
        raise ValueError(f"compositions must be a list, got {type(compositions).__name__}")
    out: dict[int, dict[int, list[int]]] = {}
    for item in compositions:
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise ValueError(f"a composition must be (group, block_id, units), got {item!r}")
        g, block_id, units = item
        if not is_int(g) or not 0 <= g < len(widths) or widths[g] == 1:
            groups = [i for i, w in enumerate(widths) if w > 1]
            raise ValueError(f"composition {item!r}: group must be one of the groups wider than one unit {groups}")
        if not isinstance(units, (list, tuple)) or len(units) != widths[g] \
                or not all(is_int(u) and 0 < u < num_blocks for u in units) or len(set(units)) != len(units):
            raise ValueError(f"composition {item!r}: group {g} needs {widths[g]} distinct units in [1, {num_blocks})")
        if block_id != units[0]:
            raise ValueError(f"composition {item!r}: a composite is named by its first unit, {units[0]}")
        out.setdefault(g, {})[block_id] = list(units)
    return out


def check_chunk_fields(chunk: ScheduledChunk, num_groups: int, num_blocks: int, vocab_size: int) -> None:
    """Every field of a chunk has the right type and range (tables are each worker's own check)."""
    rid = chunk.request_id
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"request_id must be a non-empty str, got {rid!r}")
    if not isinstance(chunk.token_ids, list) or not chunk.token_ids:
        raise ValueError(f"request {rid!r}: token_ids must be a non-empty list")
    if not ints_in(chunk.token_ids, vocab_size):
        raise ValueError(f"request {rid!r}: token_ids must be integers in [0, {vocab_size})")
    if not is_int(chunk.start_pos) or chunk.start_pos < 0:
        raise ValueError(f"request {rid!r}: start_pos must be an integer >= 0, got {chunk.start_pos!r}")
    if isinstance(chunk.temperature, bool) or not isinstance(chunk.temperature, (int, float)) \
            or not math.isfinite(chunk.temperature) or chunk.temperature < 0:
        raise ValueError(f"request {rid!r}: temperature must be a finite number >= 0, got {chunk.temperature!r}")
    if not is_int(chunk.seed):
        raise ValueError(f"request {rid!r}: seed must be an integer, got {chunk.seed!r}")
    ids = chunk.new_block_ids
    if not isinstance(ids, list) or len(ids) != num_groups or not all(isinstance(g, list) for g in ids):
        raise ValueError(f"request {rid!r}: new_block_ids must be {num_groups} lists, one per KV-cache group, "
                         f"got {ids!r}")
    for g, group_ids in enumerate(ids):
        if group_ids and not ints_in(group_ids, num_blocks):
            bad = [b for b in group_ids if not is_int(b) or not 0 <= b < num_blocks]
            raise ValueError(f"request {rid!r}: new_block_ids[{g}] holds ids outside [0, {num_blocks}): {bad}")
