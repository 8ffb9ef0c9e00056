"""Several KV-cache groups drawing from one pool: one hit length all agree on, one capacity check (in units)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from math import lcm

from .block_pool import Block, BlockPool
from .group import KVCacheGroup
from .request import Request
from .specs import NEVER, AttentionSpec


class HitRule:
    """The hit length every group agrees on, given each group's own search: the manager's rule, also run
    by a router on the hashes it knows a replica caches (``cluster/routing/policies.py``)."""

    def __init__(self, specs: Sequence[AttentionSpec]):
        self.specs = tuple(specs)
        self.alignment = lcm(*(s.block_size for s in self.specs))
        # Groups that drop nothing have downward-closed hits: asking them first caps the others' search.
        self.order = tuple(sorted(range(len(self.specs)), key=lambda g: self.specs[g].first_needed_token(NEVER) > 0))

    def longest(self, searches: Sequence[Callable[[int], int]], max_tokens: int) -> int:
        """The largest hit every group accepts, a multiple of ``alignment``, at most ``max_tokens``;
        ``searches[g](bound)``: group ``g``'s own longest hit in tokens, at most ``bound``.

        Each group returns its own longest hit at or below the current bound; the bound falls to the
        smallest answer (aligned) until one full round leaves it unchanged. It only ever falls, so this
        ends, and the result is the largest length valid for all groups.
        """
        align = self.alignment
        h = max_tokens // align * align
        settled = 0
        while h > 0 and settled < len(self.order):
            settled = 0
            for g in self.order:
                hg = searches[g](h) // align * align
                if hg == h:
                    settled += 1
                else:
                    h, settled = hg, 0
                    if h == 0:
                        break
        return h


class GroupCoordinator:
    def __init__(self, specs: list[AttentionSpec], pool: BlockPool, enable_caching: bool):
        self.pool = pool
        self.groups = [KVCacheGroup(i, s, pool, enable_caching, w) for i, (s, w) in enumerate(zip(specs, pool.widths))]
        self._dropping = [g for g in self.groups if g.drops]
        self.rule = HitRule(specs)
        self.alignment = self.rule.alignment
        self._block_sizes = sorted({s.block_size for s in specs})
        seen: set[int] = set()
        for g in self.rule.order:       # one group per block size (one dropping nothing, if any) tells the
            group = self.groups[g]      # free queue how chains go on
            group.learns_chains = group.block_size not in seen
            seen.add(group.block_size)
        self.no_hit: tuple[list[Block], ...] = tuple([] for _ in specs)
        # Per running request: below these (slots, cacheable, computed) a step changes nothing at all.
        self._quiet: dict[str, tuple[int, int, int]] = {}

    def hit_length(self, request: Request, max_tokens: int) -> int:
        """The largest hit every group accepts (``HitRule``), a multiple of ``alignment``, at most
        ``max_tokens``; only searches (the free queue learns nothing, no block is taken)."""
        return self.rule.longest([partial(g.longest_hit, request) for g in self.groups], max_tokens)

    def find_hit(self, request: Request, max_tokens: int) -> tuple[tuple[list[Block], ...], int]:
        """``hit_length``'s blocks; the free queue notes the lookup (where hits land, forks)."""
        h = self.hit_length(request, max_tokens)
        for bs in self._block_sizes:
            hashes = request.block_hashes(bs, 0)

            def hash_at(i: int, bs=bs, hashes=hashes) -> bytes:
                if i >= len(hashes):   # lazily, as the hit search does
                    request.block_hashes(bs, max(i + 1, 2 * len(hashes)))
                return hashes[i]
            self.pool.free.note_lookup(hash_at, h // bs, max_tokens // bs)
        if h == 0:
            return tuple([] for _ in self.groups), 0
        return tuple(g.hit_blocks(request, h) for g in self.groups), h

    def allocate(self, request: Request, num_computed: int, num_slots: int, num_cacheable: int,
                 hit: tuple[list[Block], ...]) -> tuple[list[int], ...] | None:
        """Drop, check capacity, allocate; ``None`` (and no change at all) when the pool is short.

        Most decode steps change nothing (no new block, none to cache or drop): a request's thresholds
        for that, kept since its last change, answer them with three comparisons. Otherwise: blocks the
        drop would free count as free, hit blocks waiting in the free queue count as taken; a step that
        needs no new block skips the capacity check, since dropping only frees.
        """
        rid = request.request_id
        quiet = self._quiet.get(rid)
        if quiet is not None and num_slots <= quiet[0] and num_cacheable < quiet[1] and num_computed < quiet[2]:
            return tuple([] for _ in self.groups)
        groups = self.groups
        new = [g.num_new_blocks(rid, num_slots, len(h)) for g, h in zip(groups, hit)]
        has_hit = hit is not self.no_hit and any(hit)
        if has_hit or any(new):
            need = -self.pool.num_free_blocks          # in pool units: a block of a width-k group is k
            for g, blocks, n in zip(groups, hit, new):
                freed = g.num_freed_by_drop(rid, num_computed)
                revived = sum(1 for b in blocks if b.ref_cnt == 0 and b.block_id)
                need += (n - freed + revived) * g.width
            if need > 0:
                return None
            if has_hit:
                for g, blocks in zip(groups, hit):
                    g.num_held += self.pool.touch(blocks)
        for g in self._dropping:        # all drops first: their blocks may be what the appends take
            g.drop(request, num_computed)
        out = tuple([g.append(request, h, n, num_cacheable) for g, h, n in zip(groups, hit, new)])
        limits = [g.quiet_until(request) for g in groups]
        self._quiet[rid] = (min(q[0] for q in limits), min(q[1] for q in limits), min(q[2] for q in limits))
        return out

    def free(self, request: Request, preempted: bool = False) -> None:
        """Release every table of the request in one batch, group by group, each tail first, with the
        blocks a hit at a fork of its chain needs marked (full attention: every block below the deepest
        fork; a window: the blocks below each fork)."""
        self._quiet.pop(request.request_id, None)
        forks = self.pool.free.forks
        fork_ends: dict[int, list[int]] = {}
        freed = []
        for g in self.groups:
            bs = g.block_size
            if forks and bs not in fork_ends:
                hashes = request.block_hashes(bs, 0)
                fork_ends[bs] = [e for e, h in enumerate(hashes, 1) if h in forks]
            freed += g.release(request, fork_ends.get(bs, ()))
        if freed:
            self.pool.free.add_released(freed, preempted)
