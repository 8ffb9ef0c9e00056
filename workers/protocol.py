"""The step protocol between the engine and its workers: plain dataclasses that msgpack can carry.

The engine owns every block table; a worker keeps an append-only mirror per request and KV-cache group,
fed by ``new_block_ids``. Dropped entries are never sent back to a worker: attention never reads
outside the window, so a stale id in the mirror is harmless.

Faults are reported per request where they can be: a chunk a worker refuses raises ``RequestError``
naming its request before anything changes (the engine fails that request and runs the rest of the step
again); a row that cannot be sampled (NaN logits) lands in ``StepOutput.failed`` and the step stands.
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
    temperature: float = 0.0             # 0 = greedy (as is anything below GREEDY_BELOW)
    seed: int = 0                        # sampling at position p is seeded by (seed, p): replays are identical


@dataclass
class StepInput:
    step_id: int
    chunks: list[ScheduledChunk]
    forget: list[str] = field(default_factory=list)   # drop these mirrors before the step (freed, preempted)


@dataclass
class StepOutput:
    step_id: int
    sampled: dict[str, int]              # request_id -> next token, for chunks with sample=True
    simulated_time_s: float = 0.0        # simulated workers: the step's time on the modelled GPU
    failed: dict[str, str] = field(default_factory=dict)   # request_id -> why its row could not be sampled


# Temperatures below this sample greedily: dividing logits by less overflows float32 (1e-39 -> inf -> NaN),
# and long before that the distribution is one-hot anyway (vLLM uses the same threshold).
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(1 << 63), 1 << 63)     # int64: what msgpack, torch generators and every client carry


class RequestError(ValueError):
    """A step cannot run because of one request's chunk; raised before anything changed.

    Pickles as itself (its args are its fields), so the engine finds ``request_id`` through Ray's
    exception wrapping (``find_request_error``)."""

    def __init__(self, request_id: str, message: str):
        super().__init__(request_id, message)
        self.request_id, self.message = request_id, message

    def __str__(self) -> str:
        return self.message


def find_request_error(exc: BaseException) -> RequestError | None:
    """The ``RequestError`` inside ``exc``: itself, a Ray task error's ``cause``, or a ``__cause__``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RequestError) and isinstance(getattr(exc, "request_id", None), str):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_chunk_fields(chunk: ScheduledChunk, num_groups: int, num_blocks: int, vocab_size: int) -> None:
    """Every field of a chunk has the right type and range (tables are each worker's own check)."""
    rid = chunk.request_id
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"request_id must be a non-empty str, got {rid!r}")

    def fail(message: str):
        raise RequestError(rid, message)
    if not isinstance(chunk.token_ids, list) or not chunk.token_ids:
        fail(f"request {rid!r}: token_ids must be a non-empty list")
    if not all(is_int(t) and 0 <= t < vocab_size for t in chunk.token_ids):
        fail(f"request {rid!r}: token_ids must be integers in [0, {vocab_size})")
    if not is_int(chunk.start_pos) or chunk.start_pos < 0:
        fail(f"request {rid!r}: start_pos must be an integer >= 0, got {chunk.start_pos!r}")
    if isinstance(chunk.temperature, bool) or not isinstance(chunk.temperature, (int, float)) \
            or not math.isfinite(chunk.temperature) or chunk.temperature < 0:
        fail(f"request {rid!r}: temperature must be a finite number >= 0, got {chunk.temperature!r}")
    if not is_int(chunk.seed) or not SEED_RANGE[0] <= chunk.seed < SEED_RANGE[1]:
        fail(f"request {rid!r}: seed must be an integer in [-2**63, 2**63), got {chunk.seed!r}")
    ids = chunk.new_block_ids
    if not isinstance(ids, list) or len(ids) != num_groups or not all(isinstance(g, list) for g in ids):
        fail(f"request {rid!r}: new_block_ids must be {num_groups} lists, one per KV-cache group, got {ids!r}")
    for g, group_ids in enumerate(ids):
        bad = [b for b in group_ids if not is_int(b) or not 0 <= b < num_blocks]
        if bad:
            fail(f"request {rid!r}: new_block_ids[{g}] holds ids outside [0, {num_blocks}): {bad}")
