"""One KV-cache group: the block tables of every request for every layer of one attention kind.

The spec's rule (``first_needed_token``) decides what to drop and which cached blocks a hit needs;
this class keeps the tables consistent with it. Dropped entries become the null block, so a table
always has the length full attention would have and a worker's append-only mirror stays valid.
A block of a group of ``width`` k is a composite of k pool units (``block_pool``): one id per entry.
"""
from __future__ import annotations

from .block_pool import NULL_BLOCK_ID, Block, BlockPool
from .request import Request
from .specs import NEVER, AttentionSpec


class KVCacheGroup:
    def __init__(self, group_id: int, spec: AttentionSpec, pool: BlockPool, enable_caching: bool, width: int = 1):
        self.group_id = group_id
        self.spec = spec
        self.width = width          # pool units per block
        self.block_size = spec.block_size
        self.pool = pool
        self.enable_caching = enable_caching
        self.drops = spec.first_needed_token(NEVER) > 0
        # a window (or chunk) not a whole number of blocks: a hit at a block boundary can need a block the
        # last token no longer saw (``_drop``'s ``at_end``); with whole blocks the two always coincide
        self.ragged = any(b is not None and b % spec.block_size for b in spec.kernel_bounds().values())
        self.tables: dict[str, list[Block]] = {}
        self._num_cached: dict[str, int] = {}   # leading blocks of each table already in the cache
        self._num_dropped: dict[str, int] = {}  # leading null entries of each table (nulls are a prefix)
        # the dropped block a hit at the request's end still needs: (block, its hash, below the prompt's end)
        self._at_end: dict[str, tuple[Block, bytes, bool]] = {}
        self.num_held = 0   # distinct blocks this group's tables hold (a block serves one group at a time)
        self.learns_chains = True   # tells the free queue each cached block's parent (one group per block size)

    # -- prefix hits ---------------------------------------------------------------------------
    def longest_hit(self, request: Request, max_tokens: int, cached=None) -> int:
        """Longest hit in tokens, at most ``max_tokens``, that this group alone accepts, given the hashes
        ``cached`` (default: the pool's cache of this group)."""
        if cached is None:
            cached = self.pool._cached[self.group_id]
        bs = self.block_size
        hashes = request.block_hashes(bs, 0)

        def is_cached(i: int) -> bool:
            if i >= len(hashes):   # hash lazily, a stretch at a time: the chain makes block i cost 0..i
                request.block_hashes(bs, max(i + 1, 2 * len(hashes)))
            return hashes[i] in cached

        max_blocks = min(max_tokens, request.num_tokens) // bs
        return self.spec.longest_hit(is_cached, max_blocks) * bs

    def hit_blocks(self, request: Request, num_tokens: int) -> list[Block]:
        """The table of a hit of ``num_tokens``: nulls before the first needed block, cached blocks after."""
        end = num_tokens // self.block_size
        first = self.spec.first_needed_token(num_tokens) // self.block_size
        hashes = request.block_hashes(self.block_size, end)
        get = self.pool.get_cached
        return [self.pool.null_block] * first + [get(self.group_id, h) for h in hashes[first:end]]

    # -- dropping ------------------------------------------------------------------------------
    def _droppable(self, request_id: str, table: list[Block], num_computed: int) -> range:
        """Indices of real blocks lying wholly before what the next token can see."""
        stop = min(self.spec.first_needed_token(num_computed) // self.block_size, len(table))
        start = self._num_dropped[request_id]
        return range(start, max(start, stop))

    def num_freed_by_drop(self, request_id: str, num_computed: int) -> int:
        table = self.tables.get(request_id)
        if not self.drops or not table:
            return 0
        return sum(1 for i in self._droppable(request_id, table, num_computed)
                   if table[i].ref_cnt == 1 and not table[i].pinned)    # pinned: freed by its copy's fence

    def _drop(self, request: Request, table: list[Block], stop: int, num_computed: int) -> None:
        """Drop the table's real entries below index ``stop`` (the first block the next token needs)."""
        rid = request.request_id
        start = self._num_dropped[rid]
        if stop > len(table):
            stop = len(table)
        if stop <= start:
            return
        pool = self.pool
        dropped = table[start:stop]
        table[start:stop] = [pool.null_block] * (stop - start)
        self._num_dropped[rid] = stop
        freed = pool.unref(dropped)
        if freed:          # the free queue decides where they wait, from where a hit could still end:
            self.num_held -= len(freed)
            free = pool.free
            bs = self.block_size
            end = (len(request.prompt_token_ids) - 1) // bs    # a resend's hit (in blocks)
            lowest = max(0, end * bs - free.last_message_tokens)   # or a fork in its last message
            below_end = range(self.spec.first_needed_token(lowest) // bs if start < end else end, end)
            # or its own end, while decoding: a hit there ends at a block boundary and sees further back than
            # the next token does, by up to a block when the window is not a whole number of blocks (Phi-3's
            # 2047); that block is what a follow-up needs if the request finishes before its next drop
            at_end = stop - 1 if self.ragged and num_computed >= len(request.prompt_token_ids) and \
                self.spec.first_needed_token((num_computed + 1) // bs * bs) // bs < stop else -1
            below_fork = self._below_forks(request, range(start, stop)) if free.forks else ()
            tier = pool.tier           # the host tier stores what a hit can still need first
            (free if tier is None else tier).add_dropped(dropped, start, below_fork, below_end, at_end)
            if self.ragged:
                passed = self._at_end.pop(rid, None)     # this drop moved the request's end past it
                if passed is not None:
                    free.passed_end(*passed)
                last = dropped[-1]
                if at_end >= 0 and last.ref_cnt == 0 and last.block_hash is not None:
                    self._at_end[rid] = (last, last.block_hash, at_end in below_end and not last.shared)

    def _below_forks(self, request: Request, span: range) -> set[int]:
        """Indices in ``span`` that a hit ending at a fork of the request's chain needs (a lookup or a
        cached block left the fork there)."""
        bs = self.block_size
        first = self.spec.first_needed_token
        forks = self.pool.free.forks
        hashes = request.block_hashes(bs, 0)
        out: set[int] = set()
        # hit ends e whose needed blocks [first(e * bs) // bs, e) meet the span
        last = min(len(hashes), -(-self.spec.computed_to_reach(span.stop * bs) // bs) - 1)
        for e in range(span.start + 1, last + 1):
            if hashes[e - 1] in forks:
                out.update(range(first(e * bs) // bs, e))
        return out

    # -- allocation ----------------------------------------------------------------------------
    def num_new_blocks(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> int:
        table = self.tables.get(request_id)
        have = (len(table) if table else 0) + num_hit_blocks
        return max(0, -(-num_tokens // self.block_size) - have)

    def drop(self, request: Request, num_computed: int) -> None:
        """Free what the request no longer needs (cheap when, as on most decode steps, nothing is)."""
        rid = request.request_id
        table = self.tables.get(rid)
        if table:
            stop = self.spec.first_needed_token(num_computed) // self.block_size
            if stop > self._num_dropped[rid]:
                self._drop(request, table, stop, num_computed)

    def append(self, request: Request, hit: list[Block], num_new: int, num_cacheable: int) -> list[int]:
        """Append the (already referenced) hit blocks and ``num_new`` fresh ones, cache what is full;
        return the ids appended. Capacity was checked by the caller; most decode steps append nothing."""
        rid = request.request_id
        table = self.tables.get(rid)
        if table is None:
            table = self.tables[rid] = []
            self._num_cached[rid] = len(hit)
            null = self.pool.null_block
            self._num_dropped[rid] = next((i for i, b in enumerate(hit) if b is not null), len(hit))
        if num_new:
            blocks = self.pool.take(num_new, self.group_id)
            if hit:
                blocks = hit + blocks
            self.num_held += num_new
            table.extend(blocks)
            added = [b.block_id for b in blocks]
        elif hit:
            table.extend(hit)
            added = [b.block_id for b in hit]
        else:
            added = []
        if self.enable_caching:
            end = (num_cacheable if num_cacheable < request.num_tokens else request.num_tokens) // self.block_size
            if end > self._num_cached[rid]:
                self._cache_full_blocks(request, table, end)
        return added

    def step(self, request: Request, num_new: int, num_cacheable: int) -> tuple[list[int], tuple[int, int, int]]:
        """``append`` without a hit for a running request, then ``quiet_until``: the decode path's work in
        one call (the ids appended, the new thresholds)."""
        rid = request.request_id
        table = self.tables[rid]
        if num_new:
            blocks = self.pool.take(num_new, self.group_id)
            self.num_held += num_new
            table.extend(blocks)
            added = [blocks[0].block_id] if num_new == 1 else [b.block_id for b in blocks]
        else:
            added = []
        bs = self.block_size
        if self.enable_caching:
            n = len(request.all_token_ids)
            end = (num_cacheable if num_cacheable < n else n) // bs
            cached = self._num_cached[rid]
            if end > cached:
                self._cache_full_blocks(request, table, end)
                cached = end
            cache_at = (cached + 1) * bs
        else:
            cache_at = NEVER
        drop_at = self.spec.computed_to_reach((self._num_dropped[rid] + 1) * bs) if self.drops else NEVER
        return added, (len(table) * bs, cache_at, drop_at)

    def _cache_full_blocks(self, request: Request, table: list[Block], end: int) -> None:
        """Enter blocks ``[num_cached, end)``, full of known tokens once this step runs, into the cache."""
        rid = request.request_id
        bs = self.block_size
        hashes = request.block_hashes(bs)
        pool = self.pool
        cache, gid, null, learns = pool.cache, self.group_id, pool.null_block, self.learns_chains
        tokens = request.all_token_ids if pool.events is not None else None   # events carry the block's tokens
        for i in range(self._num_cached[rid], end):
            block = table[i]
            if block is not null and block.block_hash is None:
                cache(block, gid, hashes[i], hashes[i - 1] if i else None, i, learns,
                      tokens[i * bs:(i + 1) * bs] if tokens is not None else None)
        self._num_cached[rid] = end

    def uncache_from(self, request: Request, first: int) -> None:
        """Forget the hashes of the request's blocks from index ``first`` on, entered at allocation for tokens
        that will now never be computed into them (``KVCacheManager.withdraw``)."""
        table = self.tables.get(request.request_id, [])
        null, pool = self.pool.null_block, self.pool
        for block in table[first:]:
            if block is not null and block.block_hash is not None:
                pool.uncache(block)
        if request.request_id in self._num_cached:
            self._num_cached[request.request_id] = min(first, self._num_cached[request.request_id])

    def quiet_until(self, request: Request) -> tuple[int, int, int]:
        """Below these (slots, cacheable tokens, computed tokens) a step changes nothing in this group:
        no new block, no block to cache, nothing to drop."""
        rid = request.request_id
        bs = self.block_size
        cache_at = (self._num_cached[rid] + 1) * bs if self.enable_caching else NEVER
        drop_at = self.spec.computed_to_reach((self._num_dropped[rid] + 1) * bs) if self.drops else NEVER
        return len(self.tables[rid]) * bs, cache_at, drop_at

    def end_block(self, request: Request) -> tuple[Block, bytes, bool] | None:
        """The block the request dropped last if a hit at its end needs it (``_drop``'s ``at_end``), with its
        hash: it belongs with the chain ``release`` is about to free. Call before ``release``."""
        return self._at_end.pop(request.request_id, None)

    def release(self, request: Request, fork_ends: list[int],
                answer_from: int = NEVER) -> list[tuple[Block, bool | None]]:
        """Release a request's table; return the blocks no one holds any more, tail first, each with
        whether a hit at one of the chain's forks (``fork_ends``, in blocks) needs it: True, or, from block
        ``answer_from`` on (the block the answer starts in and after: only a follow-up hits them), None, else
        False."""
        rid = request.request_id
        table = self.tables.pop(rid, None)
        self._num_cached.pop(rid, None)
        dropped = self._num_dropped.pop(rid, 0)
        if not table:
            return []
        bs = self.block_size
        needed = [range(self.spec.first_needed_token(e * bs) // bs, e) for e in fork_ends if e <= len(table)]
        out = []
        for i in range(len(table) - 1, dropped - 1, -1):
            block = table[i]
            if block.block_id == NULL_BLOCK_ID:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                below = any(i in r for r in needed)
                out.append((block, None if i >= answer_from and not below else below))
        self.num_held -= len(out)
        return out

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables[request_id]]
