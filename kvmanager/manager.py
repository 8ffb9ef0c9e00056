"""``KVCacheManager``: the facade an engine calls. It checks every argument before touching state."""
from __future__ import annotations

from dataclasses import dataclass

from .block_pool import Block, BlockPool
from .checks import check_int, is_int
from .coordinator import GroupCoordinator
from .free_queue import LAST_MESSAGE_TOKENS
from .host_tier import HostRef, HostTier, KVTransfers
from .request import Request
from .specs import AttentionSpec


@dataclass
class CacheStats:
    """Prefix-cache and preemption counters since the manager started."""

    lookups: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    preemptions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    """Block tables for every running request, one per KV-cache group, all from one pool.

    ``groups``: one attention spec per group, e.g. ``[FullAttention(16), SlidingWindow(16, window=4096)]``.
    ``num_blocks``: pool units (the null unit included). ``widths``: units per block of each group (default
    1 each), e.g. the layers of each kind on a stage over ``S`` (``planning.kv_layout``, ``from_layout``):
    a block of a width-k group is a composite of k units; workers learn its units from
    ``pop_compositions()``, before any table that uses it. ``last_message_tokens``: how far below a
    prompt's end the free queue expects a later prompt to fork (``free_queue.LAST_MESSAGE_TOKENS``).
    ``num_host_blocks``: host-memory units of the host tier (``host_tier``; 0, the default: no tier, and
    no cost); ``host_speculative_stores`` (default on): also store blocks no known hit needs, into free host
    units only, first to be evicted (``host_tier``); off, only what a known hit needs moves. With a tier
    the engine ships ``take_transfers()`` every step, reports copies with ``transfers_done``, and does not
    compute a request while ``is_loading`` says so.
    """

    def __init__(self, groups, num_blocks: int, enable_prefix_caching: bool = True,
                 max_model_len: int = 1 << 20, *, widths=None, last_message_tokens: int = LAST_MESSAGE_TOKENS,
                 num_host_blocks: int = 0, host_speculative_stores: bool = True):
        groups = list(groups)
        if not groups:
            raise ValueError("at least one KV-cache group spec is needed")
        for spec in groups:
            if not isinstance(spec, AttentionSpec):
                raise TypeError(f"group specs must be FullAttention, SlidingWindow or ChunkedLocalAttention, "
                                f"got {spec!r}")
        check_int("max_model_len", max_model_len, 0)
        if max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        widths = (1,) * len(groups) if widths is None else tuple(widths)
        if len(widths) != len(groups) or any(type(w) is not int or w < 1 for w in widths):  # noqa: E721
            raise ValueError(f"widths must hold one integer >= 1 per group ({len(groups)}), got {widths!r}")
        if is_int(num_blocks) and max(widths) > num_blocks - 1:
            raise ValueError(f"num_blocks={num_blocks} cannot hold one block of {max(widths)} units "
                             f"(unit 0 is the null block)")
        self.specs = tuple(groups)
        self.widths = widths
        self.max_model_len = max_model_len
        self.enable_prefix_caching = bool(enable_prefix_caching)
        check_int("last_message_tokens", last_message_tokens, 0)
        check_int("num_host_blocks", num_host_blocks, 0)
        if 0 < num_host_blocks < max(widths):
            raise ValueError(f"num_host_blocks={num_host_blocks} cannot hold one block of {max(widths)} units")
        self.pool = BlockPool(num_blocks, len(groups), widths, last_message_tokens)
        self.coordinator = GroupCoordinator(groups, self.pool, self.enable_prefix_caching)
        self._no_hit = self.coordinator.no_hit
        self._quiet = self.coordinator.quiet
        self._nothing = self.coordinator.nothing
        self.coordinator.token_cap = max_model_len + 1
        self.stats = CacheStats()
        self._running: dict[str, Request] = {}
        self.host_tier = (HostTier(self.coordinator, num_host_blocks, bool(host_speculative_stores))
                          if num_host_blocks else None)
        self.pool.tier = self.host_tier

    @classmethod
    def from_layout(cls, layout, num_blocks: int, enable_prefix_caching: bool = True,
                    max_model_len: int = 1 << 20, num_host_blocks: int = 0,
                    host_speculative_stores: bool = True) -> "KVCacheManager":
        """A manager for ``planning.kv_layout(...)``: one group per attention kind, its width in units."""
        return cls(layout.group_specs, num_blocks, enable_prefix_caching, max_model_len, widths=layout.group_widths,
                   num_host_blocks=num_host_blocks, host_speculative_stores=host_speculative_stores)

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free pool units (cached ones waiting in the free queue included)."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of allocatable units in use (cached blocks waiting in the free queue are free)."""
        return 1.0 - self.pool.num_free_blocks / (self.pool.num_blocks - 1)

    def blocks_held_per_group(self) -> list[int]:
        """Distinct real blocks each group's tables hold now (kept as blocks move: /metrics polls it).
        Each takes its group's width in pool units."""
        return [g.num_held for g in self.coordinator.groups]

    def pop_compositions(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """Composites made since the last call, in order: ``(group, block_id, units)``. Workers must apply
        them before the step whose tables use them (a later entry for the same id replaces an earlier)."""
        return self.pool.pop_compositions()

    def replay_compositions(self) -> None:
        """After a worker restart: the next ``pop_compositions`` lists every composite that exists."""
        self.pool.replay_compositions()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        if request_id not in self._running:
            raise KeyError(f"unknown request id {request_id!r}: it holds no blocks")
        return tuple(g.block_ids(request_id) for g in self.coordinator.groups)

    # -- prefix cache --------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request):
        """Cached blocks for the longest usable prefix of ``request`` and its length in tokens.

        The last known token is always recomputed, so the hit is below ``request.num_tokens``.
        Changes nothing: the blocks are taken by the ``allocate_slots`` call that receives them.
        """
        self._check_request(request)
        if request.request_id in self._running:
            raise ValueError(f"request {request.request_id!r} already holds blocks; look up before its "
                             f"first allocation (or after preempt)")
        if not self.enable_prefix_caching:
            return self._no_hit, 0
        max_tokens = request.num_tokens - 1
        hit, h = self.coordinator.find_hit(request, max_tokens)
        if self.host_tier is not None:
            hit, h = self.host_tier.extend_hit(request, max_tokens, hit, h)
        self.stats.lookups += 1
        self.stats.queried_tokens += request.num_tokens
        self.stats.hit_tokens += h
        return hit, h

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (cached content became invalid, e.g. new weights). Only when no request
        holds blocks: otherwise returns False and changes nothing (preempt or free them first)."""
        done = self.pool.reset_prefix_cache()      # refused while a copy is in flight (a pinned block)
        if done and self.host_tier is not None:
            self.host_tier.clear()
        return done

    # -- host tier -----------------------------------------------------------------------------
    def take_transfers(self) -> KVTransfers:
        """Stores and loads scheduled since the last call, for the next step's input (empty without a tier)."""
        return self.host_tier.take_transfers() if self.host_tier is not None else KVTransfers()

    def transfers_done(self, done=(), failed=()) -> list[str]:
        """The workers finished (``done``) or lost (``failed``) the copies into / out of these device block
        ids. Fences them: their blocks may be reused or freed now. A request whose load failed is preempted
        (it recomputes through the prefix cache); their ids are returned for the scheduler to requeue.
        Unknown ids raise ValueError before anything changes."""
        if self.host_tier is None:
            if list(done) or list(failed):
                raise ValueError("transfers_done: this manager has no host tier (num_host_blocks=0)")
            return []
        lost = self.host_tier.transfers_done(done, failed)
        for request in lost:
            if self._running.get(request.request_id) is request:
                self.preempt(request)
        return [r.request_id for r in lost]

    def host_tier_lost(self) -> list[str]:
        """The host memory is gone (the process holding it restarted): every copy in flight failed and every
        host copy is forgotten. Returns the ids of the requests preempted (their loads failed)."""
        if self.host_tier is None:
            return []
        lost = self.transfers_done(failed=list(self.host_tier.in_flight()))
        self.host_tier.clear()
        return lost

    def is_loading(self, request_id: str) -> bool:
        """A load of this request's hit is in flight: the engine must not compute it yet."""
        return self.host_tier is not None and request_id in self.host_tier.loading

    @property
    def requests_loading(self) -> frozenset[str]:
        return frozenset(self.host_tier.loading) if self.host_tier is not None else frozenset()

    # -- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks=None, num_lookahead_tokens: int = 0):
        """Make room for ``num_new_tokens`` (+ look-ahead) after the computed ones.

        First drops what the request no longer needs, then checks capacity, then allocates.
        Returns the block ids appended to each group's table (a hit's nulls included), or ``None`` when
        the pool cannot hold it; then nothing has changed, not even the drop.
        """
        # Most decode steps change nothing (no block to add, cache or drop): a running request's thresholds
        # (``coordinator.quiet``) answer them in a few comparisons, once the arguments are plain ints.
        quiet = self._quiet.get(request.request_id) if type(request) is Request else None  # noqa: E721
        if (quiet is not None and quiet[0] is request and new_computed_blocks is None
                and type(num_new_tokens) is int and type(num_lookahead_tokens) is int  # noqa: E721 (no bools)
                and type(num_new_computed_tokens) is int and num_new_computed_tokens == 0  # noqa: E721
                and num_new_tokens >= 0 and num_lookahead_tokens >= 0):
            num_computed = request.num_computed_tokens
            num_tokens = num_computed + num_new_tokens
            num_slots = num_tokens + num_lookahead_tokens
            # quiet[2] is at most max_model_len + 1: below it, num_tokens is within the limit too
            if num_tokens < quiet[2] and num_slots <= quiet[1] and num_computed < quiet[3]:
                return self._nothing()
            limit = self.max_model_len
            if num_tokens <= limit:            # a running request, checked: straight to the coordinator
                return self.coordinator.step(request, num_computed, num_slots if num_slots < limit else limit,
                                             num_tokens, quiet)
        if type(request) is not Request or request.finished:  # noqa: E721 (the per-step path, checked cheaply)
            self._check_request(request)
        rid = request.request_id
        if not (type(num_new_tokens) is int and type(num_new_computed_tokens) is int  # noqa: E721 (no bools)
                and type(num_lookahead_tokens) is int
                and num_new_tokens >= 0 and num_new_computed_tokens >= 0 and num_lookahead_tokens >= 0):
            check_int("num_new_tokens", num_new_tokens, 0)
            check_int("num_new_computed_tokens", num_new_computed_tokens, 0)
            check_int("num_lookahead_tokens", num_lookahead_tokens, 0)
        running = self._running.get(rid)
        if running is not None and running is not request:
            raise ValueError(f"duplicate request id {rid!r}: another request with this id holds blocks")
        hit = self._no_hit
        if num_new_computed_tokens or new_computed_blocks:
            hit = self._check_hit(request, running is not None, num_new_computed_tokens, new_computed_blocks)
            if (self.host_tier is not None and (num_new_tokens or num_lookahead_tokens)
                    and any(type(b) is HostRef for blocks in hit for b in blocks)):
                raise ValueError(f"request {rid!r}: a hit with blocks to load from host is allocated alone "
                                 f"(num_new_tokens=0, no look-ahead): its new tokens' blocks would be cached "
                                 f"before they are computed; allocate them once is_loading({rid!r}) is False")
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = num_computed + num_new_tokens
        limit = self.max_model_len
        if num_tokens > limit:
            raise ValueError(f"request {rid!r}: {num_tokens} tokens exceed max_model_len={limit}")
        # Look-ahead slots past max_model_len could never be used: reserve up to the limit only.
        num_slots = num_tokens + num_lookahead_tokens
        if num_slots > limit:
            num_slots = limit
        new = self.coordinator.allocate(request, num_computed, num_slots, num_tokens, hit)
        if new is not None and running is None:
            self._running[rid] = request
        return new

    def free(self, request: Request) -> None:
        """The request is finished: release its blocks. It can never allocate again."""
        self._check_request(request)
        self._release(request, preempted=False)
        request.finished = True

    def preempt(self, request: Request) -> None:
        """Release a running request's blocks; it starts over (through the prefix cache) when resumed."""
        self._check_request(request)
        self._release(request, preempted=True)
        request.num_computed_tokens = 0
        self.stats.preemptions += 1

    def withdraw(self, request: Request) -> None:
        """Undo an admission that never ran (the engine's late joiner the workers did not take): forget the
        hashes its new blocks were given at allocation (they will never be computed), release its blocks as
        a preemption's, and take its lookup out of the statistics; it is admitted again later. Only right
        after its first allocation (``num_computed_tokens`` is its hit), before any later request could hit
        its new blocks, or after those were withdrawn too."""
        self._check_request(request)
        self.uncache_from(request, request.num_computed_tokens)
        self._release(request, preempted=True)
        self.stats.lookups -= 1
        self.stats.queried_tokens -= request.num_tokens
        self.stats.hit_tokens -= request.num_computed_tokens
        request.num_computed_tokens = 0

    def uncache_from(self, request: Request, num_tokens: int) -> None:
        """The request's blocks holding positions from ``num_tokens`` on will not be computed as scheduled
        (the workers refused the step, or it was withdrawn): forget the hashes they were given at allocation,
        so that no later lookup hits them."""
        self._check_request(request)
        for g in self.coordinator.groups:
            g.uncache_from(request, num_tokens // g.block_size)

    def unpop_compositions(self, compositions) -> None:
        """Put back what ``pop_compositions`` returned for a step that was never sent, ahead of newer ones."""
        self.pool.unpop_compositions(compositions)

    # -- checks --------------------------------------------------------------------------------
    def _release(self, request: Request, preempted: bool) -> None:
        rid = request.request_id
        if self._running.get(rid) is not request:
            raise ValueError(f"request {rid!r} holds no blocks (never allocated, already freed or preempted)")
        del self._running[rid]
        if self.host_tier is not None:
            self.host_tier.forget_request(rid)
        self.coordinator.free(request, preempted)

    def _check_request(self, request) -> None:
        if not isinstance(request, Request):
            raise TypeError(f"expected a kvmanager.Request, got {type(request).__name__}")
        if request.finished:
            raise ValueError(f"request {request.request_id!r} was freed; it cannot be used again")

    def _check_hit(self, request: Request, running: bool, num_hit_tokens: int, hit):
        if not num_hit_tokens and not hit:
            return self._no_hit
        if hit is None or len(hit) != len(self.specs):
            raise ValueError(f"new_computed_blocks must hold one list per group ({len(self.specs)}), got {hit!r}")
        if running or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r}: prefix-cache blocks can only be added "
                             f"before its first computed token")
        if num_hit_tokens >= request.num_tokens:
            raise ValueError(f"request {request.request_id!r}: a hit of {num_hit_tokens} tokens leaves "
                             f"nothing to compute of {request.num_tokens}")
        null = self.pool.null_block
        for gid, (spec, blocks) in enumerate(zip(self.specs, hit)):
            if len(blocks) * spec.block_size != num_hit_tokens:
                raise ValueError(f"new_computed_blocks do not cover num_new_computed_tokens={num_hit_tokens} "
                                 f"(a group of block size {spec.block_size} got {len(blocks)} blocks)")
            hashes = request.block_hashes(spec.block_size)
            for j, block in enumerate(blocks):
                if block is null:
                    continue
                if type(block) is HostRef:
                    if self.host_tier is None or not self.host_tier.holds(block) or block.block_hash != hashes[j]:
                        raise ValueError(f"new_computed_blocks: the host copy of block {j} is gone since the "
                                         f"lookup; look up again")
                    continue
                if not isinstance(block, Block) or block is not self.pool.blocks[block.block_id]:
                    raise TypeError(f"new_computed_blocks must hold the blocks get_computed_blocks returned, "
                                    f"got {block!r}")
                if block.group != gid or block.block_hash != hashes[j]:
                    raise ValueError(f"new_computed_blocks: block {block.block_id} no longer holds this "
                                     f"request's tokens {j * spec.block_size}..{(j + 1) * spec.block_size - 1} "
                                     f"(reused since the lookup); look up again")
        return hit
