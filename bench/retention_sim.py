"""A block-pool trace simulator with pluggable eviction orders (a bench helper, never product code).

The retention bench (``bench/retention.py``) drives real managers; this module gives what they cannot:
the unbounded-pool ceiling, plain LRU without vLLM installed, a clairvoyant policy, and the scripted
choices of the exhaustive search on tiny instances. swakv's own policy is never re-implemented here: the
bench runs the real ``kvmanager``.

``SimManager`` keeps the manager contract the bench's serving loop uses (lookup, allocate, free, preempt)
with the semantics of docs/design.md: drop before allocating, capacity counts what the drop frees and the
hit blocks waiting in the free queue, only blocks full of known tokens are cached, a hit is the largest
``h`` every group accepts (``kvmanager.coordinator.HitRule``). Policies differ only in which free block
is handed out next:

- ``Lru``: vLLM 0.33 dense retention (released cached blocks at the back in release order, a drop
  releasing from the window's edge backwards, a finished request tail first; blocks without a hash at the
  front).
- ``Belady``: clairvoyant: hands out a block holding nothing, else the cached block whose next use is
  furthest; a block's uses are the requests whose hit in the unbounded-pool run needed it (all blocks
  below the hit for full attention, only the window below it for a sliding group), in that run's order.
  A strong offline reference on single-group layouts, not a proven optimum: a hit needs a whole run of
  blocks, which per-block next use ignores, and the bounded run admits requests in a different order.
- ``Scripted``: every eviction choice from a script, for the exhaustive search on tiny instances.
- ``num_blocks=None``: an unbounded pool that never evicts: the ceiling.
"""
from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from hashlib import blake2b

from kvmanager.coordinator import HitRule


def chain_hashes(tokens, block_size: int, parent: bytes = b"root", start: int = 0) -> list[bytes]:
    """Chained 128-bit hashes of the full blocks of ``tokens[start*B:]`` after ``parent``."""
    data = array("q", tokens[start * block_size:]).tobytes()
    step = 8 * block_size
    out = []
    for off in range(0, len(data) - step + 1, step):
        parent = blake2b(parent + data[off:off + step], digest_size=16).digest()
        out.append(parent)
    return out


class Spec:
    """An attention kind for the simulator: full (``window=None``) or sliding window ``window``."""

    def __init__(self, block_size: int, window: int | None = None):
        self.block_size = block_size
        self.window = window
        self.drops = window is not None
        # Blocks a hit needs just below its end (the whole prefix for full attention).
        self.run = -(-(window - 1) // block_size) if window else None

    def first_needed_token(self, n: int) -> int:
        return max(0, n - self.window + 1) if self.window else 0

    def needed_blocks(self, h: int) -> range:
        """Block indices a hit of ``h`` tokens needs cached."""
        return range(self.first_needed_token(h) // self.block_size, h // self.block_size)

    def longest_hit(self, is_cached, max_blocks: int) -> int:
        """Largest ``e <= max_blocks`` whose needed blocks are all cached (right-to-left scan)."""
        if not self.window:
            e = 0
            while e < max_blocks and is_cached(e):
                e += 1
            return e
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            if is_cached(i):
                run += 1
                if run >= self.run:
                    return i + self.run
            else:
                run = 0
        return run


class SimRequest:
    __slots__ = ("request_id", "tokens", "num_computed_tokens", "hashes")

    def __init__(self, request_id: str, prompt):
        self.request_id = request_id
        self.tokens = list(prompt)
        self.num_computed_tokens = 0
        self.hashes: list[bytes] = []

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def append_output_token_ids(self, token_ids) -> None:
        self.tokens.extend(token_ids)

    def block_hashes(self, block_size: int) -> list[bytes]:
        n = len(self.tokens) // block_size
        if len(self.hashes) < n:
            parent = self.hashes[-1] if self.hashes else b"root"
            self.hashes.extend(chain_hashes(self.tokens[:n * block_size], block_size, parent, len(self.hashes)))
        return self.hashes


class Block:
    __slots__ = ("block_id", "ref", "key", "version", "pos", "parent")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref = 0
        self.key: tuple[int, bytes] | None = None   # (group, hash) while cached
        self.version = 0
        self.pos = 0          # block index in its request's table when cached
        self.parent: bytes | None = None   # hash of the block before it in its chain


# -- free-queue policies ----------------------------------------------------------------------------
class Lru:
    """vLLM 0.33 dense: cached blocks join the back in release order (a drop releases from the window's
    edge backwards), blocks without a hash join the front."""

    def __init__(self):
        self.queue: OrderedDict[int, Block] = OrderedDict()

    def __len__(self) -> int:
        return len(self.queue)

    def release(self, blocks, reason: str) -> None:
        if reason == "drop":
            blocks = list(reversed(blocks))
        for b in reversed([b for b in blocks if b.key is None]):
            self.queue[b.block_id] = b
            self.queue.move_to_end(b.block_id, last=False)
        for b in blocks:
            if b.key is not None:
                self.queue[b.block_id] = b

    def remove(self, block: Block) -> None:
        del self.queue[block.block_id]

    def pop(self) -> Block:
        return self.queue.popitem(last=False)[1]

    def advance(self, rid: str) -> None:   # only the clairvoyant policy looks ahead
        pass


class Belady:
    """Clairvoyant: hands out a block that holds nothing, else the cached block whose next use is furthest.

    ``needs[key]``: ``(index, rid)`` of the requests whose hit in the unbounded run needed that block, in
    that run's first-admission order; ``need_sets[rid]``: the keys it needed. A block's next use is the
    first of its requests not yet admitted here (``advance(rid)`` at each first admission)."""

    def __init__(self, needs: dict, need_sets: dict):
        self.needs = needs
        self.need_sets = need_sets
        self.admitted: set[str] = set()
        self.cursor: dict = {}
        self.empty: OrderedDict[int, Block] = OrderedDict()
        self.heap: list = []
        self.free: dict[int, Block] = {}
        self.by_key: dict = {}
        self.seq = 0

    def __len__(self) -> int:
        return len(self.free)

    def _next_use(self, key) -> float:
        uses = self.needs.get(key)
        if not uses:
            return float("inf")
        i = self.cursor.get(key, 0)
        while i < len(uses) and uses[i][1] in self.admitted:
            i += 1
        self.cursor[key] = i
        return uses[i][0] if i < len(uses) else float("inf")

    def _push(self, b: Block) -> None:
        b.version += 1
        self.seq += 1
        # Equal next use (one chain): the deepest block first, so the survivors stay a usable prefix.
        heapq.heappush(self.heap, (-self._next_use(b.key), -b.pos, self.seq, b.version, b))

    def release(self, blocks, reason: str) -> None:
        for b in blocks:
            self.free[b.block_id] = b
            if b.key is None:
                self.empty[b.block_id] = b
            else:
                self.by_key.setdefault(b.key, {})[b.block_id] = b
                self._push(b)

    def remove(self, b: Block) -> None:
        del self.free[b.block_id]
        if b.key is None:
            del self.empty[b.block_id]
        else:
            b.version += 1
            self._drop_key(b)

    def _drop_key(self, b: Block) -> None:
        entry = self.by_key[b.key]
        del entry[b.block_id]
        if not entry:
            del self.by_key[b.key]

    def pop(self) -> Block:
        if self.empty:
            b = self.empty.popitem(last=False)[1]
            del self.free[b.block_id]
            return b
        while True:
            _, _, _, version, b = heapq.heappop(self.heap)
            if version == b.version and b.block_id in self.free:
                del self.free[b.block_id]
                b.version += 1
                self._drop_key(b)
                return b

    def advance(self, rid: str) -> None:
        """Request ``rid`` was admitted: the blocks it needed now have a later next use."""
        self.admitted.add(rid)
        for key in self.need_sets.get(rid, ()):
            for b in list(self.by_key.get(key, {}).values()):
                self._push(b)


class Branch(Exception):
    """A scripted run reached an eviction choice it has no instruction for: ``n`` options."""

    def __init__(self, n: int):
        super().__init__(n)
        self.n = n


class Scripted(Lru):
    """Every eviction choice made by a script, for the exhaustive search of the best policy.

    Choices that cannot be better than another are skipped: a free block holding nothing is handed out
    first, then a cached block whose content no unfinished request contains (``live()``: the hashes still
    wanted); a full-attention block whose child in its chain is also free and cached is never chosen
    before that child (a full-attention hit needs every block before it, so keeping the child alone serves
    nothing the parent does not). Among the rest, ``choices[k]`` picks one content (LRU order); it raises
    ``Branch(n)`` when the script runs out. ``full_groups``: the groups that never drop."""

    def __init__(self, choices: list[int], live, full_groups=frozenset()):
        super().__init__()
        self.choices = choices
        self.pos = 0
        self.live = live
        self.full_groups = full_groups

    def pop(self) -> Block:
        front = next(iter(self.queue.values()))
        if front.key is None:
            return super().pop()
        live = self.live()
        options, seen = [], set()
        free_parents = {(b.key[0], b.parent) for b in self.queue.values()
                        if b.key is not None and b.key[0] in self.full_groups}
        for b in self.queue.values():
            if b.key[1] not in live:
                options = [b]
                break
            if b.key in free_parents:
                continue
            if b.key not in seen:
                seen.add(b.key)
                options.append(b)
        if len(options) > 1:
            if self.pos == len(self.choices):
                raise Branch(len(options))
            options = [options[self.choices[self.pos]]]
            self.pos += 1
        b = options[0]
        del self.queue[b.block_id]
        return b


POLICIES = {"lru": Lru}


# -- the simulated manager -------------------------------------------------------------------------
class SimManager:
    """A block pool of ``num_blocks`` (``None``: unbounded) shared by groups of ``specs``."""

    def __init__(self, specs: list[Spec], num_blocks: int | None, policy="lru"):
        self.specs = specs
        self.rule = HitRule(specs)
        self.bs = specs[0].block_size
        self.unbounded = num_blocks is None
        self.blocks = [Block(0)]
        if not self.unbounded:
            self.blocks += [Block(i) for i in range(1, num_blocks)]
        self.policy = policy if not isinstance(policy, str) else POLICIES[policy]()
        if not self.unbounded:
            self.policy.release(self.blocks[1:], "init")
        self.cached: list[dict[bytes, dict[int, Block]]] = [{} for _ in specs]
        self.tables: list[dict[str, list]] = [{} for _ in specs]
        self.num_cached: list[dict[str, int]] = [{} for _ in specs]
        self.num_dropped: list[dict[str, int]] = [{} for _ in specs]

    # -- hits --------------------------------------------------------------------------------------
    def get_computed_blocks(self, req: SimRequest):
        max_tokens = req.num_tokens - 1
        hashes = req.block_hashes(self.bs)
        bs = self.bs
        searches = [lambda bound, spec=spec, s=s: spec.longest_hit(lambda i: hashes[i] in s, bound // bs) * bs
                    for spec, s in zip(self.specs, self.cached)]
        h = self.rule.longest(searches, max_tokens)
        hit = []
        for g, spec in enumerate(self.specs):
            first = spec.first_needed_token(h) // self.bs
            cache = self.cached[g]
            hit.append([None] * first + [next(iter(cache[x].values())) for x in hashes[first:h // self.bs]])
        return hit, h

    # -- allocation --------------------------------------------------------------------------------
    def _droppable(self, g: int, rid: str, table, num_computed: int) -> range:
        stop = min(self.specs[g].first_needed_token(num_computed) // self.bs, len(table))
        start = self.num_dropped[g][rid]
        return range(start, max(start, stop))

    def allocate_slots(self, req: SimRequest, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks=None):
        rid = req.request_id
        hit = new_computed_blocks or [[] for _ in self.specs]
        num_computed = req.num_computed_tokens + num_new_computed_tokens
        num_tokens = num_computed + num_new_tokens
        new = []
        for g in range(len(self.specs)):
            table = self.tables[g].get(rid)
            have = (len(table) if table else 0) + len(hit[g])
            new.append(max(0, -(-num_tokens // self.bs) - have))
        has_hit = any(hit)
        if not self.unbounded and (has_hit or any(new)):
            need = sum(new) - len(self.policy)
            for g, blocks in enumerate(hit):
                table = self.tables[g].get(rid)
                if self.specs[g].drops and table:
                    need -= sum(1 for i in self._droppable(g, rid, table, num_computed) if table[i].ref == 1)
                need += sum(1 for b in blocks if b is not None and b.ref == 0)
            if need > 0:
                return None
        if has_hit:
            for blocks in hit:
                for b in blocks:
                    if b is None:
                        continue
                    if b.ref == 0 and not self.unbounded:
                        self.policy.remove(b)
                    b.ref += 1
        for g, spec in enumerate(self.specs):
            table = self.tables[g].get(rid)
            if spec.drops and table:
                self._drop(g, req, table, num_computed)
        for g in range(len(self.specs)):
            self._append(g, req, hit[g], new[g], num_tokens)
        return True

    def _drop(self, g: int, req: SimRequest, table, num_computed: int) -> None:
        rid = req.request_id
        span = self._droppable(g, rid, table, num_computed)
        if not span:
            return
        dropped = table[span.start:span.stop]      # real blocks: a table's nulls are a prefix
        table[span.start:span.stop] = [None] * len(span)
        self.num_dropped[g][rid] = span.stop
        self._to_policy(self._unref(dropped), "drop")

    @staticmethod
    def _unref(blocks) -> list[Block]:
        freed = []
        for b in blocks:
            b.ref -= 1
            if b.ref == 0:
                freed.append(b)
        return freed

    def _to_policy(self, freed: list[Block], reason: str) -> None:
        if freed and not self.unbounded:
            self.policy.release(freed, reason)

    def _take(self, n: int) -> list[Block]:
        if self.unbounded:
            out = []
            for _ in range(n):
                b = Block(len(self.blocks))
                self.blocks.append(b)
                out.append(b)
        else:
            out = [self.policy.pop() for _ in range(n)]
        for b in out:
            if b.key is not None:
                g, x = b.key
                entry = self.cached[g][x]
                del entry[b.block_id]
                if not entry:
                    del self.cached[g][x]
                b.key = None
            b.ref = 1
        return out

    def _append(self, g: int, req: SimRequest, hit, num_new: int, num_tokens: int) -> None:
        rid = req.request_id
        tables = self.tables[g]
        table = tables.get(rid)
        if table is None:
            table = tables[rid] = []
            self.num_cached[g][rid] = len(hit)
            self.num_dropped[g][rid] = next((i for i, b in enumerate(hit) if b is not None), len(hit))
        table.extend(hit)
        if num_new:
            table.extend(self._take(num_new))
        end = min(num_tokens, req.num_tokens) // self.bs
        start = self.num_cached[g][rid]
        if end > start:
            hashes = req.block_hashes(self.bs)
            cache = self.cached[g]
            for i in range(start, end):
                b = table[i]
                if b is not None and b.key is None:
                    b.key = (g, hashes[i])
                    b.pos = i
                    b.parent = hashes[i - 1] if i else None
                    cache.setdefault(hashes[i], {})[b.block_id] = b
            self.num_cached[g][rid] = end

    def _release_request(self, req: SimRequest, reason: str) -> None:
        rid = req.request_id
        freed = []          # one release for the whole request: group by group, each tail first
        for g in range(len(self.specs)):
            table = self.tables[g].pop(rid, None)
            self.num_cached[g].pop(rid, None)
            self.num_dropped[g].pop(rid, None)
            if table:
                freed += self._unref([table[i] for i in range(len(table) - 1, -1, -1) if table[i] is not None])
        self._to_policy(freed, reason)

    def free(self, req: SimRequest) -> None:
        self._release_request(req, "finish")

    def admitted(self, rid: str) -> None:
        """The serving loop admitted request ``rid`` for the first time."""
        if not self.unbounded:
            self.policy.advance(rid)

    def preempt(self, req: SimRequest) -> None:
        self._release_request(req, "preempt")
        req.num_computed_tokens = 0
