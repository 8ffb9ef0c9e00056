"""The frequency order for tier 3: how many later prompts contained each cached hash, and tier 3's free blocks
ranked by it.

Where every group needs the whole prefix (full attention; windows that requests' chains fit), a block is worth
the later prompts that contain its chain (a retrieved document's, a shared prompt's; not a one-off question's),
and a deeper block of a chain never more than one above it. So each admission adds one to every hash of its
prompt seen before (a chain is a prefix: the walk stops at the first hash never seen), and the rank of a free
block is the order of magnitude of its count (0, 1, 2-3, 4-7, ...), then the deepest first, then the oldest.
Magnitudes, not raw counts: raw counts sent the freshest of cyclic sessions, counted least, first although
every session comes back (LFU's failure on new content); classes "none, one, two or more" tied a document
twenty prompts contained with one two did (docs/retention-rounds.md, twenty-third round).

*When* tier 3 follows this order, and the duel that decides it, is ``FreeQueue``'s; this class only keeps
the counts and the heap. Both are bounded: ``bound`` hashes counted (the oldest referenced forgotten), and
the heap rebuilt from its live items once it holds more than ``bound``.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict


class FrequencyOrder:
    __slots__ = ("counts", "heap")

    def __init__(self):
        self.counts: OrderedDict[bytes, int] = OrderedDict()
        self.heap: list = []       # (magnitude, -depth, order, entry), lazily cleaned

    def seen(self, block_hash: bytes, bound: int) -> None:
        """A block of this hash was cached: counted from now on, at 0."""
        counts = self.counts
        if block_hash not in counts:
            counts[block_hash] = 0
            if len(counts) > bound:
                counts.popitem(last=False)

    def referenced(self, hashes) -> None:
        """An admission's prompt (its block hashes, in order): each hash seen before counts once more."""
        counts = self.counts
        for h in hashes:
            c = counts.get(h)
            if c is None:
                break
            counts[h] = c + 1
            counts.move_to_end(h)

    def key(self, entry) -> int:
        """The count's order of magnitude: 0, 1, 2-3, 4-7, ..."""
        return self.counts.get(entry.block_hash, 0).bit_length()

    def rank(self, entry) -> tuple[int, int, int]:
        """Its place: the count's magnitude, then the deepest, then the oldest."""
        return self.key(entry), -entry.depth, entry.order

    def push(self, entry, live, bound: int) -> None:
        """``entry`` now waits in tier 3; ``live(item)``: whether a heap item still stands for its entry (stale
        items, of entries taken since, are dropped once the heap holds more than ``bound``)."""
        heap = self.heap
        heapq.heappush(heap, (*self.rank(entry), entry))
        if len(heap) > bound:
            self.heap = [x for x in heap if live(x)]
            heapq.heapify(self.heap)

    def front(self, live):
        """Tier 3's front in this order, or None: stale items above it are dropped, and one whose magnitude
        changed since it was pushed goes back in its place."""
        heap = self.heap
        while heap:
            key, depth, order, entry = heap[0]
            if not live(heap[0]):
                heapq.heappop(heap)
            elif (now := self.key(entry)) != key:
                heapq.heapreplace(heap, (now, depth, order, entry))
            else:
                return entry
        return None
