"""Retention, maximality: on tiny traces, swakv's hits against the best any eviction policy reaches.

The bench's exhaustive oracle (``bench/retention.py``, ``exhaustive_best``) serves the retention bench's
three workloads scaled down (block 4, W 8, 2 running, 16 tokens a step, pools of 4..6 blocks per group)
through the same serving loop and tries every choice of which cached block to evict (pruning only
choices that cannot do better). On each instance it finishes (55 of 81; the others have a request that
fits nowhere or too many choices), swakv's real manager must reach at most that best (the oracle is
sound) and at least what vLLM 0.33 dense's order reaches (plain LRU, simulated by
``bench/retention_sim.py``): the adaptive tier may leave LRU only on evidence, and tiny traces give too
little of it, so it must never lose to LRU here.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import retention as bench  # noqa: E402

SEARCHABLE = {   # (workload, layout): (seed, pool blocks per group) the exhaustive search finishes
    ("agent", "full"): [(0, 6), (2, 6)],
    ("agent", "hybrid"): [(0, 5), (0, 6), (1, 6), (2, 5), (2, 6)],
    ("agent", "sliding"): [(0, 4), (0, 5), (0, 6), (1, 5), (1, 6), (2, 4), (2, 5), (2, 6)],
    ("chat", "full"): [(0, 5), (0, 6), (1, 5), (1, 6), (2, 6)],
    ("chat", "hybrid"): [(1, 6)],
    ("chat", "sliding"): [(0, 4), (0, 5), (0, 6), (1, 4), (1, 5), (1, 6), (2, 4), (2, 6)],
    ("siblings", "full"): [(s, p) for s in range(3) for p in (4, 5, 6)],
    ("siblings", "hybrid"): [(0, 4), (0, 5), (0, 6), (1, 5), (1, 6), (2, 4), (2, 5), (2, 6)],
    ("siblings", "sliding"): [(s, p) for s in range(3) for p in (4, 5, 6)],
}
INSTANCES = [(w, lay, seed, pool) for (w, lay), cases in SEARCHABLE.items() for seed, pool in cases]


def hit_tokens(adapter, sessions) -> int:
    return bench.serve(sessions, adapter, step_tokens=bench.TINY_STEP, max_running=bench.TINY_RUNNING)["hit_tokens"]


@pytest.mark.parametrize("workload,layout,seed,pool", INSTANCES)
def test_swakv_reaches_at_least_lru_and_at_most_the_exhaustive_best(workload, layout, seed, pool):
    windows = tuple(None if w is None else bench.TINY_WINDOW for w in bench.LAYOUTS[layout])
    num_blocks = pool * len(windows) + 1
    sessions = bench.TINY[workload](seed)
    best = bench.exhaustive_best(sessions, windows, num_blocks)["hit_tokens"]
    swakv = hit_tokens(bench.SwakvAdapter(windows, num_blocks, block_size=bench.TINY_BLOCK), sessions)
    lru = hit_tokens(bench.SimAdapter(windows, num_blocks, "lru", block_size=bench.TINY_BLOCK), sessions)
    assert lru <= swakv <= best
