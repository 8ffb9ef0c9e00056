"""The step protocol between the engine and its workers: plain dataclasses that msgpack can carry.

The engine owns every block table; a worker keeps an append-only mirror per request and KV-cache group,
fed by ``new_block_ids``. Dropped entries are never sent back to a worker: attention never reads
outside the window, so a stale id in the mirror is harmless.
"""
from __future__ import annotations

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


@dataclass
class StepOutput:
    step_id: int
    sampled: dict[str, int]              # request_id -> next token, for chunks with sample=True
    simulated_time_s: float = 0.0        # simulated workers: the step's time on the modelled GPU
