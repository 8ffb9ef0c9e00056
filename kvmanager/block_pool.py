"""One pool of KV blocks shared by every group: reference counts, an eviction queue, the prefix cache.

Block 0 is the null block: it stands in tables for dropped entries and is never allocated, freed or
cached. A block whose count reaches zero joins the free queue but keeps its hash (lazy eviction): a
later prefix hit takes it back out, and only reuse for new content forgets its hash.
"""
from __future__ import annotations

from collections import OrderedDict

NULL_BLOCK_ID = 0


class Block:
    __slots__ = ("block_id", "ref_cnt", "group", "block_hash", "shared")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.group = -1            # group whose cache holds it, with block_hash; -1 when not cached
        self.block_hash: bytes | None = None
        self.shared = False        # handed out by a prefix hit since it was last filled

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Free queue: an OrderedDict (C-implemented), front evicted first, O(1) removal of any block."""

    def __init__(self, num_blocks: int, num_groups: int):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an integer >= 2 (block 0 is the null block), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        # Per group: block hash -> {block_id: block}. Two blocks may hold equal content.
        self._cached: list[dict[bytes, dict[int, Block]]] = [{} for _ in range(num_groups)]

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def is_cached(self, group: int, block_hash: bytes) -> bool:
        return block_hash in self._cached[group]

    def get_cached(self, group: int, block_hash: bytes) -> Block | None:
        blocks = self._cached[group].get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def take(self, n: int) -> list[Block]:
        """``n`` blocks from the front of the free queue, each forgetting what it cached."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")  # callers check first
        popitem = self._free.popitem
        out = []
        for _ in range(n):
            block = popitem(last=False)[1]
            if block.block_hash is not None:
                self._uncache(block)
            block.ref_cnt = 1
            block.shared = False
            out.append(block)
        return out

    def touch(self, blocks) -> int:
        """Take references on prefix-hit blocks, pulling free ones out of the queue; how many were free."""
        revived = 0
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID:
                continue
            if block.ref_cnt == 0:
                del self._free[block.block_id]
                revived += 1
            block.ref_cnt += 1
            block.shared = True
        return revived

    def release(self, blocks, evict_first: bool = False) -> int:
        """Drop references; blocks no one holds join the free queue at the back, or the front.
        Returns how many became free."""
        free = self._free
        freed = 0
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = block
                freed += 1
                if evict_first:
                    free.move_to_end(block.block_id, last=False)
        return freed

    def cache(self, block: Block, group: int, block_hash: bytes) -> None:
        block.group = group
        block.block_hash = block_hash
        entry = self._cached[group].get(block_hash)
        if entry is None:
            self._cached[group][block_hash] = {block.block_id: block}
        else:
            entry[block.block_id] = block

    def _uncache(self, block: Block) -> None:
        entry = self._cached[block.group][block.block_hash]
        del entry[block.block_id]
        if not entry:
            del self._cached[block.group][block.block_hash]
        block.group = -1
        block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.group, block.block_hash, block.shared = -1, None, False
        for cache in self._cached:
            cache.clear()
