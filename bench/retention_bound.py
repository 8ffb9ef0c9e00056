"""An upper bound on the prefix-cache hits of full attention, for one run's schedule (a bench helper).

Why a bound needs a relaxation: a hit needs a whole prefix of blocks, the pool also holds the running
requests' blocks, and when a block is computed depends on the schedule. What holds for *every* eviction
policy, given the schedule of a run of ``retention.serve``: the order of first admissions (``A``), last
finishes (``F``) and which requests ran at each (``Timeline``):

1. A request ``c`` hits ``h`` tokens of full attention only if the ``h / B`` blocks below ``h`` are in the
   pool at ``A_c``; so its hit blocks are at most the blocks of its first ``(P_c - 1) // B`` whose copy is
   in the pool then, and only blocks some earlier request contains count. (Dropping the prefix
   constraint costs nothing: the blocks of one request have nested intervals, deeper ones longer, so an
   optimum can always keep a prefix.)
2. The copy of block ``p`` in the pool at ``A_c`` was computed at some time ``t <= A_c`` by a request ``r``
   whose tokens contain ``p``, while ``r`` ran: ``A_r <= t <= F_r`` (a preempted request recomputes within
   the same span: first admission to last finish). It stayed since, so ``p`` was in the pool throughout
   ``[min(F_r, A_c), A_c]``, which contains ``[T, A_c]`` with ``T = min(max F_r over the earlier
   requests containing p, A_c)``.
3. The pool holds at most ``N`` blocks. At some points running requests provably hold blocks that are in
   no interval open there: a request ``r'`` running at ``x`` (``A_r' < x < F_r'``) is in the max of 2. for
   every later request, so intervals of its blocks open only after ``F_r'``. The serving loop gives the
   points: just before ``r`` finishes, ``r`` holds every token it computed, and every request ahead of it in
   the running list was given its whole remaining prefill in that step (the budget reached ``r``), so holds
   its prompt's full blocks; at an admission, the budget reached the waiting queue, so every running
   request holds its prompt's full blocks (less those ``c`` itself may hit: their intervals end there).
   Distinct hashes count (two copies of one block are at least one block).

So the hit blocks of a run are at most the largest set of such intervals (one per (request, block)) that
no point covers more than its room: intervals packed under consecutive-ones constraints, which the greedy
below solves exactly (sweep; where a point is over its room, drop the intervals that end last: Belady's
rule, Carlson & Nemhauser 1966). Intervals of one block never overlap (each starts after the block's
previous reference), so a block's copies never share room.

What it does not bound: another schedule. A policy with other hits computes other tokens, so its
requests finish, and the next ones are admitted, at other times and in another order; the bound is for
the run whose schedule it is given. Sliding windows: a hit of ``h`` needs only the window below ``h``, so
its worth is not a sum over blocks and this relaxation does not apply (not built). Hybrid layouts: the
full group's bound, with the whole pool (every group's blocks) as its room, less the sliding group's
window that each request of 3. holds (the blocks of its last ``W`` tokens computed); the sliding blocks a
hit needs besides are left out (that only loosens the bound).
"""
from __future__ import annotations

import heapq

from retention_sim import chain_hashes


class Timeline:
    """A run's schedule, in event order: first admissions, last finishes, who ran at each."""

    def __init__(self):
        self.clock = 0
        self.requests: dict[str, list] = {}     # rid -> [A, F, tokens (prompt + answer), prompt length]
        self.holds: list = []                   # (point, rid finishing or None, rids that hold their prompt)

    def admit(self, rid: str, prompt, output, running=()) -> None:
        """``running``: the requests running at this admission (each given its whole remaining prefill)."""
        self.clock += 1
        self.requests[rid] = [self.clock, None, list(prompt) + list(output), len(prompt)]
        self.holds.append((self.clock, rid, tuple(running), False))

    def finish(self, rid: str, ahead=()) -> None:
        """``ahead``: the running requests scheduled before ``rid`` in its last step."""
        self.clock += 1
        self.requests[rid][1] = self.clock
        self.holds.append((self.clock - 0.5, rid, tuple(ahead), True))


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


def held(timeline: Timeline, block_size: int, windows=()) -> list[tuple[float, int]]:
    """Per point of 3. above, the distinct blocks running requests hold that no interval open there is;
    ``windows``: the layout's sliding groups, whose blocks (the window below what each computed) are other
    blocks of the same pool."""
    keys: dict = {}

    def chain(rid):
        if rid not in keys:
            keys[rid] = chain_hashes(timeline.requests[rid][2], block_size)
        return keys[rid]

    def window(rid, lo, hi, w):
        """Full blocks below ``lo`` within the window of every computed length in ``[lo, hi]``: held by the
        sliding group whichever it is (a running request may be decoding past its prompt)."""
        return chain(rid)[max(0, hi - w + 1) // block_size:lo // block_size]
    out = []
    for x, rid, running, finishing in timeline.holds:
        blocks: set = set()
        spans = [(r, timeline.requests[r][3], len(timeline.requests[r][2]) - 1) for r in running]
        for r, lo, _ in spans:
            blocks.update(chain(r)[:lo // block_size])
        if finishing:      # every token it computed: all but the last answer token
            n = len(timeline.requests[rid][2]) - 1
            spans.append((rid, n, n))
            blocks.update(chain(rid)[:n // block_size])
        else:              # the admitted request's own hittable prefix may be what they hold
            blocks.difference_update(chain(rid)[:(timeline.requests[rid][3] - 1) // block_size])
        count = len(blocks)
        for w in windows:
            count += len({h for r, lo, hi in spans for h in window(r, lo, hi, w)})
        if count:
            out.append((x, count))
    return out


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


def hit_token_bound(timeline: Timeline, capacity: int, block_size: int, windows=()) -> int:
    """At most this many full-attention hit tokens at first admissions, for any policy with this schedule
    and a pool of ``capacity`` blocks (``windows``: a hybrid layout's sliding groups in the same pool)."""
    return block_size * max_intervals(full_attention_intervals(timeline, block_size), capacity,
                                      held(timeline, block_size, windows))
