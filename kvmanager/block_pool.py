"""One pool of KV units shared by every group: composites, reference counts, the prefix cache.

The pool counts **units**: a unit is one block's worth of pages (``block_size`` tokens) of ``S`` layers.
A group of width ``k`` (layers of its kind on a stage / ``S``) holds a block as a **composite** of ``k``
units, named by its first unit's id; a width-1 group's block is a unit. Composites are sticky: a freed
composite stays whole (and cached) and a later block of the same kind reuses it as is. Only when another
kind needs the room is it dissolved into loose units and its content forgotten. So a table entry is one id
whatever the number of layers, and only compositions name ``k`` units: they are recorded, in order, for
the engine to ship to workers before any table that uses them (``pop_compositions``).

Unit 0 is the null block: it stands in tables for dropped entries and is never allocated, freed or cached.
A block whose count reaches zero joins the free queue but keeps its hash (lazy eviction): a later prefix
hit takes it back out, and only reuse for new content forgets its hash. Which free block is reused first
is the eviction policy, all of it in ``free_queue``; the callers that release blocks tell it where a hit
could still land on them. A block's hash is entered in ``cache`` and forgotten in ``uncache`` (and by
``reset_prefix_cache``): the only two places the prefix cache changes.
``events`` (optional, None by default) is told when a hash enters a group's cache (``stored``), when the
last block holding it is reused (``removed``) and when the cache is reset (``cleared``): a data-parallel
router learns each replica's cache from it. A block a request's window has left stays cached, so it
makes no event until it is reused.
"""
from __future__ import annotations

from .checks import check_int
from .free_queue import LAST_MESSAGE_TOKENS, FreeQueue

NULL_BLOCK_ID = 0


class Block:
    __slots__ = ("block_id", "ref_cnt", "group", "block_hash", "shared", "kind", "units", "order", "bin", "lru",
                 "lru_sparse", "pinned", "due", "quick", "claim", "depth")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.group = -1            # group whose cache holds it, with block_hash; -1 when not cached
        self.block_hash: bytes | None = None
        self.shared = False        # handed out by a prefix hit since it was last filled
        self.kind = -1             # the width > 1 group it is composed for; -1: a loose unit
        self.units: tuple[int, ...] = (block_id,)   # the units it spans, itself first
        self.order = 0             # its place in its free-queue bin
        self.bin = None            # the free-queue bin it waits in (meaningless while held)
        self.lru = None            # the free queue's LRU bin it waits in too (it holds a hash), or None
        self.lru_sparse = None     # the same for the sparse LRU (``floor``), where a group drops blocks
        self.due = 0               # tiers 1 and 2: cached units evicted by the time their order reaches it
        self.quick = False         # its last hit from tier 3 came within tier 3's volume (``free_queue``)
        self.claim = 0             # the free queue's claim that covers it while free (tier 1, 2, ANSWER, LEFT); 0: none
        self.depth = 0             # its index in the table it was filled for: deeper blocks of a chain need those above
        self.pinned = False        # a host-tier copy of it is in flight: outside the free queue (``host_tier``)

    def __repr__(self) -> str:
        return (f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None}"
                + (f", kind={self.kind}, units={list(self.units)})" if self.kind >= 0 else ")"))


class BlockPool:
    """``num_blocks`` units (the null unit included) drawn by groups of the given ``widths``."""

    def __init__(self, num_blocks: int, num_groups: int, widths: tuple[int, ...] | None = None,
                 last_message_tokens: int = LAST_MESSAGE_TOKENS):
        check_int("num_blocks", num_blocks, 2, "block 0 is the null block")
        self.num_blocks = num_blocks
        self.widths = tuple(widths) if widths is not None else (1,) * num_groups
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        # Per group: block hash -> {block_id: block}. Two blocks may hold equal content.
        self._cached: list[dict[bytes, dict[int, Block]]] = [{} for _ in range(num_groups)]
        self.free = FreeQueue(self.blocks[1:], self.widths, last_message_tokens, self._cached)
        self._compositions: list[tuple[int, int, tuple[int, ...]]] = []
        # Optional sink: stored(group, hash, parent hash, block index, tokens), removed(group, hash), cleared();
        # the host tier adds copied(group, hash, medium) and removed(group, hash, medium) (``host_tier``).
        self.events = None
        self.tier = None           # the host tier (``host_tier.HostTier``), which releases go through; None: off

    @property
    def num_free_blocks(self) -> int:
        """Free units (cached ones waiting in the queue included)."""
        return self.free.num_free_units

    def is_cached(self, group: int, block_hash: bytes) -> bool:
        return block_hash in self._cached[group]

    def get_cached(self, group: int, block_hash: bytes) -> Block | None:
        """A block holding ``block_hash``: one a request holds if any (a hit on it takes no free block), else
        the oldest cached."""
        blocks = self._cached[group].get(block_hash)
        if not blocks:
            return None
        first = None
        for block in blocks.values():
            if block.ref_cnt:
                return block
            if first is None:
                first = block
        return first

    def take(self, n: int, group: int) -> list[Block]:
        """``n`` blocks for ``group``, each forgetting what it cached (callers checked the units suffice)."""
        width = self.widths[group]
        free = self.free
        if n == 1:                         # the decode path, while never-used units are left: no loop
            if width == 1:
                block = free.pop_empty_unit()
                if block is not None and block.block_hash is not None:
                    self.uncache(block)
            else:
                units = free.pop_empty_run(group)
                block = None if units is None else self._fresh(group, units)
            if block is not None:
                block.ref_cnt = 1
                block.shared = False
                return [block]
        if n * width > free.num_free_units:
            raise RuntimeError(f"asked for {n} blocks of {width} units, {free.num_free_units} units free")
        out = []
        for _ in range(n):
            units = free.pop_empty_run(group) if width > 1 else None
            if units is not None:
                block = self._fresh(group, units)
            else:
                entries = free.take(group)
                first = entries[0]
                if len(entries) == 1 and (first.kind == group or (width == 1 and first.kind < 0)):
                    block = first          # a same-kind composite (or a loose unit for a width-1 group) as is
                    if block.block_hash is not None:
                        self.uncache(block)
                elif free.fresh:           # k loose units that hold nothing: nothing to forget or dissolve
                    block = first
                    block.kind, block.units = group, tuple([e.block_id for e in entries])
                    self._compositions.append((group, block.block_id, block.units))
                else:
                    block = self._compose(entries, group, width)
            block.ref_cnt = 1
            block.shared = False
            out.append(block)
        return out

    def _fresh(self, group: int, units: tuple[int, ...]) -> Block:
        """A block of never-used units (``free.pop_empty_run``): nothing to forget or dissolve."""
        block = self.blocks[units[0]]
        block.kind, block.units = group, units
        self._compositions.append((group, block.block_id, units))
        return block

    def _compose(self, entries: list[Block], group: int, width: int) -> Block:
        """A block of ``width`` units from the entries' units (in order); the rest go back as loose units."""
        units: list[int] = []
        for entry in entries:
            if entry.block_hash is not None:
                self.uncache(entry)
            if entry.kind < 0:
                units.append(entry.block_id)
            else:                        # dissolved: every unit is loose again
                units.extend(entry.units)
                entry.kind, entry.units = -1, (entry.block_id,)
        blocks = self.blocks
        if len(units) > width:
            self.free.add_leftover([blocks[u] for u in units[width:]])
        head = blocks[units[0]]
        if width > 1:
            head.kind, head.units = group, tuple(units[:width])
            self._compositions.append((group, head.block_id, head.units))
        return head

    def touch(self, blocks, shadows: bool = True) -> int:
        """Take references on prefix-hit blocks, pulling free ones out of the queue; how many were free.
        ``shadows``: also out of the floor's LRU shadows (False: the coordinator told them LRU's own hit)."""
        revived = 0
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID:
                continue
            if block.ref_cnt == 0:
                if not block.pinned and block.block_id > 0:   # pinned (a copy in flight) or on host only
                    # (``host_tier.HostRef``, id -1): not in the free queue
                    self.free.remove(block, shadows)
                revived += 1
            block.ref_cnt += 1
            block.shared = True
        return revived

    def unref(self, blocks) -> list[Block]:
        """Drop one reference on each block; those no one holds any more, in order, for the caller to
        hand to the free queue (``free.add_dropped`` / ``free.add_released``) with what it knows of them."""
        freed = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        return freed

    def cache(self, block: Block, group: int, block_hash: bytes, parent: bytes | None = None, index: int = -1,
              learn: bool = False, token_ids: list[int] | None = None) -> None:
        """Enter ``block`` (holding block ``index`` of a request, whose predecessor hashes to ``parent``, None
        for the first block) into the prefix cache; ``learn``: tell the eviction policy how the chain goes
        on, so it learns where chains fork. ``token_ids``: the block's tokens, for ``events``."""
        if learn:
            if parent is not None:
                self.free.learn(parent, block_hash)
            self.free.recomputed(block_hash)
        block.group = group
        block.block_hash = block_hash
        block.depth = index
        if self.free.frequency:
            self.free.seen(block_hash)
        cached = self._cached[group]
        entry = cached.get(block_hash)
        if entry is None:
            cached[block_hash] = {block.block_id: block}
            if self.events is not None:
                self.events.stored(group, block_hash, parent, index, token_ids or [])
        else:
            entry[block.block_id] = block

    def uncache(self, block: Block) -> None:
        """Forget a block's hash: reused for new content, or (held) it will never be what the hash says."""
        entry = self._cached[block.group][block.block_hash]
        del entry[block.block_id]
        if not entry:
            del self._cached[block.group][block.block_hash]
            if self.events is not None:
                self.events.removed(block.group, block.block_hash)
        block.group = -1
        block.block_hash = None
        block.quick = False

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, only when no block is held (else False, nothing changes): a reset
        means cached content became invalid, and held blocks belong to running requests."""
        if self.free.num_free_units != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.group, block.block_hash, block.shared, block.quick = -1, None, False, False
        for cache in self._cached:
            cache.clear()
        self.free.forget()
        if self.events is not None:
            self.events.cleared()
        return True

    # -- compositions, for the workers ---------------------------------------------------------
    def pop_compositions(self) -> list[tuple[int, int, tuple[int, ...]]]:
        out, self._compositions = self._compositions, []
        return out

    def unpop_compositions(self, compositions) -> None:
        """Pending again, ahead of any made since (a later entry for the same id still wins)."""
        self._compositions[:0] = compositions

    def replay_compositions(self) -> None:
        """Queue every composite that exists now as pending (restarted workers know none of them)."""
        self._compositions = [(b.kind, b.block_id, b.units) for b in self.blocks
                              if b.kind >= 0 and b.units[0] == b.block_id]
