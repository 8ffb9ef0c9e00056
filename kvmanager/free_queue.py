"""The eviction policy, in one place: where a freed block waits, and which free blocks a new one is made of.

Free blocks keep their cached content until reused (lazy eviction), so the order in which they are reused
is the eviction order. Today's policy:

- a finished (or preempted) request's blocks join the back, **tail first**, so the head of a shared
  prefix is evicted last;
- a block a sliding group **drops** mid-request that no prefix hit ever shared joins the **front**: it
  is the least likely to be hit again (plain LRU would let a long request's stream of dropped blocks push
  finished requests' trailing windows out first); a dropped block that was shared keeps LRU order;
- new blocks come from the front.

Pool units and composites (see ``block_pool``): a block of a group of width ``k > 1`` is a composite of
``k`` units. Free entries are loose units (never used, left over, or width-1 groups' blocks) and free
composites, which stay whole per kind. For a block of kind ``g``: (1) the frontmost free composite of
``g``, when no ``k`` loose units wait in front of it, is reused as is (no composition, so deltas stay one
id per entry); (2) else ``k`` loose units, front first; (3) else loose units plus dissolved composites of
other kinds, frontmost first. A width-1 kind takes the front loose unit, else dissolves. In a layout of
width-1 groups only, this is one queue and exactly the policy above.

Every entry carries an order key (back pushes count up, front pushes count down), so each queue stays
sorted and fronts of different queues compare in O(1).
"""
from __future__ import annotations

from collections import OrderedDict


class FreeQueue:
    """Free loose units and free composites (per kind), with their common eviction order."""

    def __init__(self, units: list, widths: tuple[int, ...]):
        self.widths = widths
        self._loose: OrderedDict[int, object] = OrderedDict()
        self._composites: list[OrderedDict | None] = [OrderedDict() if w > 1 else None for w in widths]
        self._back = 0
        self._front = 0
        for unit in units:
            unit.order = self._back
            self._back += 1
            self._loose[unit.block_id] = unit
        self.num_free_units = len(units)

    def __len__(self) -> int:
        return self.num_free_units

    # -- where freed blocks go -----------------------------------------------------------------
    def add_dropped(self, block) -> None:
        """A running request no longer needs ``block`` (out of its window) and no one else holds it."""
        self._push(block, front=not block.shared)

    def add_released(self, blocks) -> None:
        """A finished or preempted request's table (in table order): it joins the back, tail first."""
        for block in reversed(blocks):
            self._push(block, front=False)

    def add_leftover(self, units) -> None:
        """Units of a dissolved composite that a composition did not use: they hold nothing, so front."""
        for unit in reversed(units):
            self._push(unit, front=True)

    def remove(self, block) -> None:
        """A prefix hit takes a free block back."""
        queue = self._loose if block.kind < 0 else self._composites[block.kind]
        del queue[block.block_id]
        self.num_free_units -= len(block.units)

    # -- which free entries a new block is made of ---------------------------------------------
    def take(self, kind: int) -> list:
        """Free entries to make one block of ``kind`` from (the caller checked that enough units are free):
        ``[composite of kind]`` to reuse as is, or entries whose units, in order, compose it."""
        k = self.widths[kind]
        loose = self._loose
        if k > 1:
            same = self._composites[kind]
            if same:
                block = same[next(iter(same))]
                if len(loose) < k or block.order < loose[next(iter(loose))].order:
                    del same[block.block_id]
                    self.num_free_units -= k
                    return [block]
            if len(loose) >= k:
                return self._pop_loose(k)
        elif loose:
            return self._pop_loose(1)
        out = self._pop_loose(len(loose))
        have = len(out)
        while have < k:
            queue = min((q for q in self._composites if q), key=lambda q: q[next(iter(q))].order)
            block = queue.popitem(last=False)[1]
            self.num_free_units -= len(block.units)
            have += len(block.units)
            out.append(block)
        return out

    def _pop_loose(self, n: int) -> list:
        popitem = self._loose.popitem
        self.num_free_units -= n
        return [popitem(last=False)[1] for _ in range(n)]

    def _push(self, block, front: bool) -> None:
        queue = self._loose if block.kind < 0 else self._composites[block.kind]
        queue[block.block_id] = block
        if front:
            self._front -= 1
            block.order = self._front
            queue.move_to_end(block.block_id, last=False)
        else:
            block.order = self._back
            self._back += 1
        self.num_free_units += len(block.units)

    def entries(self) -> list:
        """Every free entry (loose unit or composite) in eviction order, front first (tests, checks)."""
        out = list(self._loose.values())
        for queue in self._composites:
            if queue:
                out += queue.values()
        return sorted(out, key=lambda b: b.order)

    def ids(self) -> list[int]:
        return [b.block_id for b in self.entries()]
