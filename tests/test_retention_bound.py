"""The retention bench's upper bound on full-attention hits (``bench/retention_bound.py``).

Sound means: no run of the serving loop, whatever its eviction choices, hits more than the bound computed
on that run's own schedule. Checked against the exhaustive search of every eviction choice on the tiny
instances (every complete run of the search, not only the best), and the interval solver against a brute
force over every subset.
"""
from __future__ import annotations

import itertools
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import retention as bench  # noqa: E402
from retention_bound import Timeline, hit_token_bound, max_intervals  # noqa: E402


def brute_force(intervals, capacity, held):
    points = sorted({x for iv in intervals for x in iv} | {x for x, _ in held})
    room = {x: capacity - sum(n for y, n in held if y == x) for x in points}
    for k in range(len(intervals), -1, -1):
        for chosen in itertools.combinations(intervals, k):
            if all(sum(s <= x <= e for s, e in chosen) <= max(0, room.get(x, capacity)) for x in points):
                return k
    return 0


@pytest.mark.parametrize("seed", range(40))
def test_interval_solver_keeps_as_many_as_a_brute_force_over_every_subset(seed):
    rng = random.Random(seed)
    intervals = []
    for _ in range(rng.randint(1, 9)):
        s = rng.randint(0, 8)
        intervals.append((s, s + rng.randint(0, 4)))
    held = [(rng.randint(0, 10) + 0.5, rng.randint(0, 3)) for _ in range(rng.randint(0, 3))]
    capacity = rng.randint(1, 4)
    assert max_intervals(intervals, capacity, held) == brute_force(intervals, capacity, held)


A = (list(range(9)), (90, 91, 92))            # 9 prompt tokens, 3 answer tokens: 3 blocks of 4
B = (list(range(8)) + [50], (60,))             # a's first 8 tokens (2 blocks) and one more
D = (list(range(200, 216)), (217,))            # 16 unrelated prompt tokens: 4 blocks


def test_a_follow_up_hits_at_most_what_the_pool_can_keep_from_the_first_finish_to_its_admission():
    t = Timeline()
    t.admit("a", *A)            # 1
    t.finish("a")               # 2: a holds its 2 computed blocks at 1.5
    t.admit("b", *B)            # 3: b's two blocks must stay from 2 to 3
    t.finish("b")
    assert hit_token_bound(t, 2, 4) == 8
    assert hit_token_bound(t, 1, 4) == 4


def test_requests_still_running_take_the_room_of_the_blocks_a_later_hit_needs():
    t = Timeline()
    t.admit("a", *A)                        # 1
    t.admit("d", *D, running=["a"])         # 2
    t.finish("a", ahead=[])                 # 3: a ahead of d, so d's prompt is not counted at 2.5
    t.admit("b", *B, running=["d"])         # 4: d holds its prompt's 4 blocks while b's [3, 4] are open
    t.finish("d", ahead=[])
    t.finish("b", ahead=[])
    assert hit_token_bound(t, 6, 4) == 8
    assert hit_token_bound(t, 5, 4) == 4
    assert hit_token_bound(t, 4, 4) == 0
    # hybrid, W 8: d's sliding group also holds the full blocks of its last 8 tokens (2 more blocks)
    assert hit_token_bound(t, 8, 4, windows=[8]) == 8
    assert hit_token_bound(t, 7, 4, windows=[8]) == 4


def test_a_request_admitted_while_the_first_still_runs_may_hit_the_blocks_that_one_holds():
    t = Timeline()
    t.admit("a", *A)                        # 1
    t.admit("b", *B, running=["a"])         # 2: b's intervals [2, 2]; a's held blocks are b's prefix
    t.finish("a")
    t.finish("b", ahead=[])
    assert hit_token_bound(t, 2, 4) == 8
    assert hit_token_bound(t, 1, 4) == 4


SEARCHABLE = {   # (workload, layout): (seed, pool blocks per group) the exhaustive search finishes
    ("agent", "full"): [(0, 6), (2, 6)],
    ("agent", "hybrid"): [(0, 5), (0, 6), (1, 6), (2, 5), (2, 6)],
    ("chat", "full"): [(0, 5), (0, 6), (1, 5), (1, 6), (2, 6)],
    ("chat", "hybrid"): [(1, 6)],
    ("siblings", "full"): [(s, p) for s in range(3) for p in (4, 5, 6)],
    ("siblings", "hybrid"): [(0, 4), (0, 5), (0, 6), (1, 5), (1, 6), (2, 4), (2, 5), (2, 6)],
}


@pytest.mark.parametrize("workload,layout,seed,pool",
                         [(w, lay, s, p) for (w, lay), cases in SEARCHABLE.items() for s, p in cases])
def test_no_run_of_the_exhaustive_search_hits_more_than_the_bound_on_its_own_schedule(workload, layout, seed, pool):
    # hybrid: its full group's hits, with every block of the pool as room
    windows = bench.windows_of(layout, bench.TINY_WINDOW)
    best = bench.exhaustive_best(bench.TINY[workload](seed), windows, pool * len(windows) + 1)
    assert best["over_bound"] <= 0


def test_the_bound_is_reached_where_nothing_needs_evicting():
    # siblings, full, seed 1, 6 blocks: the only run's hits equal the bound (24 tokens)
    best = bench.exhaustive_best(bench.TINY["siblings"](1), (None,), 7)
    assert best["hit_tokens"] == 24 and best["over_bound"] == 0
