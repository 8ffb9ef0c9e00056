"""An upper bound on the prefix-cache hits of full attention, for one run's schedule (a bench helper).

Why a bound needs a relaxation: a hit needs a whole prefix of blocks, the pool also holds the running
requests' blocks, and when a block is computed depends on the schedule. What holds for *every* eviction
policy, given the times at which requests are first admitted (``A``) and finish (``F``):

1. A request ``c`` hits ``h`` tokens of full attention only if the ``h / B`` blocks below ``h`` are in the
   pool at ``A_c``; so its hit blocks are at most the blocks of its first ``(P_c - 1) // B`` whose copy is
   in the pool then (the prefix constraint dropped), and only blocks some earlier request contains count.
2. The copy of block ``p`` in the pool at ``A_c`` was computed at some time ``t <= A_c`` by a request ``r``
   whose tokens contain ``p``, while ``r`` ran: ``A_r <= t <= F_r`` (a preempted request recomputes within
   the same span: first admission to last finish). It stayed since, so ``p`` was in the pool throughout
   ``[min(F_r, A_c), A_c]``, which contains ``[T, A_c]`` with ``T = min(max F_r over the earlier
   requests containing p, A_c)``.
3. The pool holds at most ``N`` distinct blocks at any time; just before ``r`` finishes, ``r`` itself holds
   the full blocks of every token it computed, none of them a block of an interval open then (below), so
   those intervals share what is left. What the other running requests hold depends on how far each got,
   which the schedule's times do not say: left out (that only loosens the bound).

So the hit blocks of a run are at most the largest set of such intervals (one per (request, block)) that
no point of time is covered by more than ``N`` of: a maximum ``N``-colourable subgraph of an interval
graph, which the greedy below finds exactly (sweep by start; when more than ``N`` are open, drop the one
that ends last: Belady's rule; Carlson & Nemhauser 1966). Intervals of one block never overlap (each
starts after the block's previous reference), so a block's copies never share room.

What it does not bound: another schedule. A policy with other hits computes other tokens, so its
requests finish, and the next ones are admitted, at other times; the bound is for the run whose times it
is given (``Timeline``). Sliding windows: a hit of ``h`` needs only the window below ``h``, so its worth
is not a sum over blocks and this relaxation does not apply (not built).
"""
from __future__ import annotations

import heapq

from retention_sim import chain_hashes


class Timeline:
    """What a serving loop's run did, in event order: first admissions and last finishes."""

    def __init__(self):
        self.clock = 0
        self.requests: dict[str, list] = {}     # rid -> [A, F, tokens (prompt + answer), prompt length]

    def admit(self, rid: str, prompt, output) -> None:
        self.clock += 1
        self.requests[rid] = [self.clock, None, list(prompt) + list(output), len(prompt)]

    def finish(self, rid: str) -> None:
        self.clock += 1
        self.requests[rid][1] = self.clock


def max_intervals(intervals, capacity: int, held=()) -> int:
    """Most closed intervals ``(start, end)`` one can keep with no point in more than ``capacity`` of them,
    and no point ``x`` of ``held`` (``(x, n)``) in more than ``capacity - n``.

    The greedy sweeps the points left to right and, where too many kept intervals cover one, drops those
    that end last; with consecutive-ones constraints that is optimal (an exchange argument: any kept
    interval ending later can be swapped for the one the greedy kept, covering no new point to the right)."""
    at: dict = {}
    for x, n in held:
        at[x] = at.get(x, 0) + n
    events = sorted([(s, 0, e) for s, e in intervals] + [(x, 1, n) for x, n in at.items()])
    kept = alive = 0
    by_end: list = []       # max-heap (-end) of the kept intervals; closed entries stay (never the max)
    closing: list = []      # min-heap of every kept interval's end, dropped ones included
    dropped: dict = {}      # end -> how many intervals with that end were dropped
    for x, kind, v in events:
        while closing and closing[0] < x:
            e = heapq.heappop(closing)
            if dropped.get(e):
                dropped[e] -= 1
            else:
                alive -= 1
        if kind == 0:
            heapq.heappush(by_end, -v)
            heapq.heappush(closing, v)
            kept += 1
            alive += 1
            room = capacity
        else:
            room = capacity - v
        while alive > max(0, room):     # the open intervals that end last go (every end >= x: none closed)
            e = -heapq.heappop(by_end)
            dropped[e] = dropped.get(e, 0) + 1
            kept -= 1
            alive -= 1
    return kept


def held_at_finish(timeline: Timeline, block_size: int) -> list[tuple[float, int]]:
    """Just before request ``r`` finishes, it holds its computed tokens' full blocks (its own chain): none
    of them is in an interval open then (a later request's interval of a block of ``r`` starts at ``F_r``
    or later, an earlier request's ended before ``A_r``), so the intervals there share ``N`` minus those."""
    return [(finish - 0.5, (len(tokens) - 1) // block_size) for _, finish, tokens, _ in timeline.requests.values()]


def full_attention_intervals(timeline: Timeline, block_size: int) -> list[tuple[int, int]]:
    """The intervals of 2. above: one per (request, block of its hittable prefix some earlier request has)."""
    last_finish: dict[bytes, int] = {}       # block -> max F of the requests admitted so far containing it
    out = []
    for admit, finish, tokens, prompt_len in sorted(timeline.requests.values(), key=lambda r: r[0]):
        keys = chain_hashes(tokens, block_size)
        for p in keys[:(prompt_len - 1) // block_size]:
            f = last_finish.get(p)
            if f is None:        # nobody before holds this block, so no later one of the prefix is a hit
                break
            out.append((min(f, admit), admit))
        for p in keys:
            if last_finish.get(p, 0) < finish:
                last_finish[p] = finish
    return out


def hit_token_bound(timeline: Timeline, capacity: int, block_size: int) -> int:
    """At most this many full-attention hit tokens at first admissions, for any policy with this schedule
    and a pool of ``capacity`` blocks."""
    return block_size * max_intervals(full_attention_intervals(timeline, block_size), capacity,
                                      held_at_finish(timeline, block_size))
