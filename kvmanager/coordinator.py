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


class _LruView:
    """The hashes of one group plain LRU would hold (``floor``): those running requests hold, and the
    shadow's free ones."""

    __slots__ = ("group", "cached", "shadow")

    def __init__(self, group: int, cached: dict, shadow):
        self.group, self.cached, self.shadow = group, cached, shadow

    def __contains__(self, block_hash: bytes) -> bool:
        if (self.group, block_hash) in self.shadow:
            return True
        blocks = self.cached.get(block_hash)
        return blocks is not None and any(b.ref_cnt for b in blocks.values())


class GroupCoordinator:
    def __init__(self, specs: list[AttentionSpec], pool: BlockPool, enable_caching: bool):
        self.pool = pool
        self.groups = [KVCacheGroup(i, s, pool, enable_caching, w) for i, (s, w) in enumerate(zip(specs, pool.widths))]
        # The frequency order (``free_queue``) ranks blocks by depth, which is a hit's cost where every group
        # needs the whole prefix: with windows, while requests' chains fit them (``free``)
        pool.free.frequency = set(pool.widths) == {1}
        self._dropping = [g for g in self.groups if g.drops]
        pool.free.windows = bool(self._dropping)
        if self._dropping:
            pool.free.watch_sparse()
        self.rule = HitRule(specs)
        self.alignment = self.rule.alignment
        self._block_sizes = sorted({s.block_size for s in specs})
        seen: set[int] = set()
        for g in self.rule.order:       # one group per block size (one dropping nothing, if any) tells the
            group = self.groups[g]      # free queue how chains go on
            group.learns_chains = group.block_size not in seen
            seen.add(group.block_size)
        # The floor's cap: a pool's worth of tokens (what the pool holds of one request's tables), the most the
        # credit banks (with ``SURPLUS`` of the tokens looked up), the lead's clamp and the evidence's floor.
        pool.free.floor.cap = (pool.num_blocks - 1) // sum(pool.widths) * self._block_sizes[0]
        pool.free.floor.block = self._block_sizes[0]
        self.no_hit: tuple[list[Block], ...] = tuple([] for _ in specs)
        n = len(specs)    # what a step that changes nothing returns: fresh empty lists, built without a loop
        self.nothing = ((lambda: ([],)) if n == 1 else (lambda: ([], [])) if n == 2
                        else (lambda: tuple([] for _ in range(n))))
        # Per running request: itself, below which (slots, cacheable, computed) a step changes nothing, and
        # the same per group.
        self.quiet: dict[str, tuple] = {}
        self.token_cap = NEVER    # the manager's max_model_len + 1: the cacheable threshold never exceeds it

    def hit_length(self, request: Request, max_tokens: int) -> int:
        """The largest hit every group accepts (``HitRule``), a multiple of ``alignment``, at most
        ``max_tokens``; only searches (the free queue learns nothing, no block is taken)."""
        return self.rule.longest([partial(g.longest_hit, request) for g in self.groups], max_tokens)

    def find_hit(self, request: Request, max_tokens: int) -> tuple[tuple[list[Block], ...], int]:
        """``hit_length``'s blocks; the free queue notes the lookup (where hits land, forks)."""
        h = self.hit_length(request, max_tokens)
        floor = self.pool.free.floor
        if floor.evicted:         # else both pools still hold every hash: LRU's hit is this one
            request.lru_hit = self._lru_hit(request, floor.dense, max_tokens)
            request.sparse_hit = -1 if floor.sparse is None else self._lru_hit(request, floor.sparse, max_tokens)
        else:
            request.lru_hit = request.sparse_hit = h
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

    def _lru_hit(self, request: Request, shadow, max_tokens: int) -> int:
        views = [_LruView(g.group_id, self.pool._cached[g.group_id], shadow) for g in self.groups]
        return self.rule.longest([partial(g.longest_hit, request, cached=v) for g, v in zip(self.groups, views)],
                                 max_tokens)

    def allocate(self, request: Request, num_computed: int, num_slots: int, num_cacheable: int,
                 hit: tuple[list[Block], ...]) -> tuple[list[int], ...] | None:
        """Drop, check capacity, allocate; ``None`` (and no change at all) when the pool is short.

        Most decode steps change nothing (no new block, none to cache or drop): a request's thresholds
        for that (``quiet``), kept since its last change, let the manager answer them with three
        comparisons before calling this. Otherwise: blocks the drop would free count as free, hit blocks
        waiting in the free queue count as taken; a step that needs no new block skips the capacity
        check, since dropping only frees.
        """
        rid = request.request_id
        quiet = self.quiet.get(rid)
        groups = self.groups
        # Per group, below these (slots, cacheable, computed) it has nothing to do (None: a new request)
        limits = quiet[4] if quiet is not None else None
        if limits is None:
            new = [g.num_new_blocks(rid, num_slots, len(h)) for g, h in zip(groups, hit)]
        else:
            new = [0 if num_slots <= lim[0] else g.num_new_blocks(rid, num_slots, 0) for g, lim in zip(groups, limits)]
        has_hit = hit is not self.no_hit and any(hit)
        pressed = False
        if has_hit or any(new):
            need = 0                                   # in pool units: a block of a width-k group is k
            for g, blocks, n in zip(groups, hit, new):
                if blocks:                             # hit blocks waiting in the free queue are taken too
                    n += sum(1 for b in blocks if b.ref_cnt == 0 and b.block_id and not b.pinned)
                need += n * g.width
            if need > self.pool.num_free_blocks:       # short unless the drop frees enough
                need -= sum(g.num_freed_by_drop(rid, num_computed) * g.width for g in self._dropping)
                if need > self.pool.num_free_blocks:
                    return None
                pressed = self.pool.tier is not None   # the drop must free what it counted on: no stores
            admitted = quiet is None and request.lru_hit >= 0
            if admitted:                # the shadows learn what each LRU's own hit takes
                self._admitted(request, num_computed - request.num_computed_tokens, hit)
            if has_hit:
                free = self.pool.free
                free.last_reuse = 0
                for g, blocks in zip(groups, hit):
                    g.num_held += self.pool.touch(blocks, shadows=not admitted)
                if free.last_reuse:     # its session's gap: its own chain's keep-time (``ended`` claim)
                    request.reuse_gap = free.last_reuse
                if self.pool.tier is not None:     # host-only entries: fresh device blocks, loads
                    hit = self.pool.tier.materialize(request, hit)
        if pressed:
            self.pool.tier.skip_stores = True
        for g in self._dropping:        # all drops first: their blocks may be what the appends take
            if limits is None or num_computed >= limits[g.group_id][2]:
                g.drop(request, num_computed)
        if pressed:
            self.pool.tier.skip_stores = False
        out = []
        changed = []
        for g, h, n in zip(groups, hit, new):
            lim = limits[g.group_id] if limits is not None else None
            if lim is not None and not n and num_cacheable < lim[1] and num_computed < lim[2]:
                out.append([])
                changed.append(lim)
            else:
                out.append(g.append(request, h, n, num_cacheable))
                changed.append(g.quiet_until(request))
        slots = cacheable = computed = NEVER
        for a, b, c in changed:
            if a < slots:
                slots = a
            if b < cacheable:
                cacheable = b
            if c < computed:
                computed = c
        cap = self.token_cap
        self.quiet[rid] = (request, slots, cacheable if cacheable < cap else cap, computed, changed)
        return tuple(out)

    def step(self, request: Request, num_computed: int, num_slots: int, num_cacheable: int,
             quiet: tuple) -> tuple[list[int], ...] | None:
        """``allocate`` for a running request's step without a hit (the decode path) whose thresholds
        (``quiet``) say some group has work: the same checks and changes, done per group in one pass."""
        limits = quiet[4]
        groups = self.groups
        rid = request.request_id
        new = None
        need = 0
        for g, lim in zip(groups, limits):
            if num_slots > lim[0]:              # blocks past the table's end (``num_new_blocks``)
                n = -(-num_slots // g.block_size) - len(g.tables[rid])
                if n > 0:
                    if new is None:
                        new = [0] * len(groups)
                    new[g.group_id] = n
                    need += n * g.width
        free = self.pool.free
        pressed = False
        if need > free.num_free_units:       # short unless the drop frees enough
            need -= sum(g.num_freed_by_drop(rid, num_computed) * g.width for g in self._dropping)
            if need > free.num_free_units:
                return None
            pressed = self.pool.tier is not None   # the drop must free what it counted on: no stores
            if pressed:
                self.pool.tier.skip_stores = True
        for g in self._dropping:
            if num_computed >= limits[g.group_id][2]:
                g.drop(request, num_computed)
        if pressed:
            self.pool.tier.skip_stores = False
        out = []
        changed = []
        slots = cacheable = computed = NEVER
        for g, lim in zip(groups, limits):
            n = new[g.group_id] if new is not None else 0
            if not n and num_cacheable < lim[1] and num_computed < lim[2]:
                out.append([])
            else:
                added, lim = g.step(request, n, num_cacheable)
                out.append(added)
            changed.append(lim)
            a, b, c = lim
            if a < slots:
                slots = a
            if b < cacheable:
                cacheable = b
            if c < computed:
                computed = c
        cap = self.token_cap
        self.quiet[rid] = (request, slots, cacheable if cacheable < cap else cap, computed, changed)
        return tuple(out)

    def _admitted(self, request: Request, hit: int, blocks: tuple[list[Block], ...]) -> None:
        """Tell the floor what this admission got and what each LRU would have, and keep each shadow what
        that LRU's pool holds after it. LRU's hit takes its own blocks back (the oldest free copy of each);
        blocks the real hit took and LRU's did not stay where they wait in LRU's order, and the real pool's
        later free of those below LRU's window, and of those it computes there, is not LRU's (``skip``).
        With a shorter hit, LRU computes what the real hit took, and its window drops the blocks below the
        real hit's window as it goes, from the window's edge backwards (into the dense LRU; the sparse one
        keeps no such interior). Until the thirty-third round the shadows took whatever the real hit took,
        and LRU's free copies of an edit's window vanished from them (docs/retention-rounds.md)."""
        free = self.pool.free
        floor = free.floor
        lru_hit, sparse_hit, request.lru_hit, request.sparse_hit = request.lru_hit, request.sparse_hit, -1, -1
        if free.frequency:
            for bs in self._block_sizes:
                free.referenced(request.block_hashes(bs))
        floor.admitted(hit, lru_hit, request.num_tokens, sparse_hit)
        if lru_hit > hit:       # dense LRU's only (the sparse one's too held the floor on dense LRU where it
            free.lost_to_lru()  # thrashes: docs/retention-rounds.md, eighteenth round)
        for shadow, other in ((floor.dense, lru_hit), (floor.sparse, sparse_hit)):
            if shadow is None:
                continue
            for g in self.groups:
                bs, first = g.block_size, g.spec.first_needed_token
                hashes = request.block_hashes(bs, max(hit, other) // bs)
                gid = g.group_id
                for x in hashes[first(other) // bs:other // bs]:
                    shadow.taken((gid, x))
                if other > hit:
                    if shadow is floor.dense:
                        for x in hashes[max(hit, first(other)) // bs:other // bs]:
                            free.lost_block((gid, x))
                    held = blocks[gid]
                    for i in range(first(hit) // bs, first(other) // bs):
                        if i >= len(held) or not held[i].ref_cnt:     # shared ones are freed for LRU too
                            shadow.skip((gid, hashes[i]), free.num_free_units + 16)
                elif other < hit and shadow is floor.dense:     # the sparse LRU keeps no dropped interiors
                    for x in reversed(hashes[first(other) // bs:first(hit) // bs]):
                        shadow.freed((gid, x), g.width)
        floor.trim(free.lru_units)

    def free(self, request: Request, preempted: bool = False) -> None:
        """Release every table of the request in one batch, group by group, each tail first, with the
        blocks a hit at a fork of its chain needs marked (full attention: every block below the deepest
        fork; a window: the blocks below each fork), and those of its answer. With windows, a finished
        request tells the free queue whether its chain fitted them (a hit at its end needs its first block);
        a preemption or a withdrawal is no evidence of how long chains run."""
        self.quiet.pop(request.request_id, None)
        forks = self.pool.free.forks
        fork_ends: dict[int, list[int]] = {}
        freed, ends = [], []
        if self._dropping and self.pool.free.frequency and not preempted:
            n = request.num_computed_tokens
            self.pool.free.note_fit(all(g.spec.first_needed_token(n) < g.block_size for g in self._dropping))
        for g in self.groups:
            bs = g.block_size
            if forks and bs not in fork_ends:
                hashes = request.block_hashes(bs, 0)
                fork_ends[bs] = [e for e, h in enumerate(hashes, 1) if h in forks]
            answer_from = NEVER if preempted else len(request.prompt_token_ids) // bs
            end = g.end_block(request) if g.ragged else None
            if end is not None:
                ends.append(end[:2])
            freed += g.release(request, fork_ends.get(bs, ()), answer_from)
        gap, request.reuse_gap = (0 if preempted else request.reuse_gap), 0
        if freed or ends:
            tier = self.pool.tier      # the host tier stores what a hit can still need first
            if tier is None:
                self.pool.free.add_released(freed, preempted, ends, gap)
            else:
                tier.add_released(request, freed, preempted, ends, gap)
