"""A block-pool trace simulator with pluggable retention policies (a bench helper, never product code).

The retention bench (``bench/retention.py``) drives real managers; this module answers what they cannot:
*which* evictions cost hits, what another free-queue order would score, and what no policy can beat.
``SimManager`` keeps the manager contract the bench's serving loop uses (lookup, allocate, free, preempt)
with the semantics of docs/design.md: drop before allocating, capacity counts what the drop frees and the
hit blocks waiting in the free queue, only blocks full of known tokens are cached, a hit is the largest
``h`` every group accepts. Policies differ only in where a released block waits and which free block is
handed out next:

- ``adaptive``: kvmanager's policy (``kvmanager/free_queue.py``): tiers by where a hit can land, the
  reusable tier LRU until ghost hits show LRU thrashing. The bench checks that it reproduces the real
  manager exactly (hit tokens, computed tokens, preemptions), cell by cell.
- ``drop-front``: kvmanager before issue 8 (dropped blocks no hit has shared go to the front, the rest to
  the back).
- ``lru``: vLLM 0.33 dense retention (released cached blocks at the back in release order, blocks
  without a hash at the front).
- ``tiered``, ``reuse``: the first proposal: tiers by where a hit can land, the reusable one LRU; ``reuse``
  orders finished requests' chains youngest first within a reuse horizon (it lost to LRU on 5 of 55 tiny
  instances of the exhaustive oracle, which led to ``adaptive``).
- ``Belady``: clairvoyant: hands out the free block whose next use (in the unbounded-pool run) is
  furthest away. A feasible policy, so a lower bound on the best possible, not an upper bound (a hit needs
  a whole run of blocks, which per-block next use ignores).
- ``Scripted``: every eviction choice from a script, for the exhaustive search on tiny instances.
- ``num_blocks=None``: an unbounded pool that never evicts: the ceiling.

A block released from a request gets a class (``_classify``: where a hit could still use it). Every
eviction of a cached block is counted under that class; a first admission that gets less than it would
with every block ever filled still cached (its *shortfall*) is charged to the class of the rightmost
block it missed; ``violations`` counts cached blocks evicted while a never-filled block was free.
"""
from __future__ import annotations

import heapq
from array import array
from bisect import bisect_left
from collections import Counter, OrderedDict, deque
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
    __slots__ = ("request_id", "tokens", "num_prompt_tokens", "num_computed_tokens", "hashes", "admissions",
                 "shortfall")

    def __init__(self, request_id: str, prompt):
        self.request_id = request_id
        self.tokens = list(prompt)
        self.num_prompt_tokens = len(self.tokens)
        self.num_computed_tokens = 0
        self.hashes: list[bytes] = []
        self.admissions = 0
        self.shortfall: tuple[int, int] | None = None   # (hit, ceiling) of the last lookup, if short

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
    __slots__ = ("block_id", "ref", "key", "shared", "cls", "version", "pos", "parent")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref = 0
        self.key: tuple[int, bytes] | None = None   # (group, hash) while cached
        self.shared = False
        self.cls = "never-filled"
        self.version = 0
        self.pos = 0          # block index in its request's table when cached
        self.parent: bytes | None = None   # hash of the block before it in its chain


# -- free-queue policies ----------------------------------------------------------------------------
class OrderedPolicy:
    """Free blocks in ordered tiers; the lowest non-empty tier's front is handed out first."""

    def __init__(self, num_tiers: int = 1):
        self.tiers = [OrderedDict() for _ in range(num_tiers)]
        self.where: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.where)

    def put(self, block: Block, tier: int, front: bool = False) -> None:
        t = self.tiers[tier]
        t[block.block_id] = block
        if front:
            t.move_to_end(block.block_id, last=False)
        self.where[block.block_id] = tier

    def remove(self, block: Block) -> None:
        del self.tiers[self.where.pop(block.block_id)][block.block_id]

    def pop(self) -> Block:
        for t in self.tiers:
            if t:
                block = t.popitem(last=False)[1]
                del self.where[block.block_id]
                return block
        raise RuntimeError("no free block")

    def advance(self, request_index: int) -> None:   # only the clairvoyant policy looks ahead
        pass

    def attach(self, num_blocks: int) -> None:        # only policies with bounded memories need the pool size
        pass

    def is_ghost(self, h: bytes) -> bool:              # only the swakv policy learns from evicted blocks
        return False

    def ghost_hit(self, passed: list[bytes]) -> None:
        pass


class DropFront(OrderedPolicy):
    """kvmanager before issue 8: a dropped block no prefix hit shared goes to the front; all else to the back."""

    def release(self, blocks, reason: str) -> None:
        if reason == "drop":
            for b in blocks:
                if not b.shared:
                    self.put(b, 0, front=True)
            for b in blocks:
                if b.shared:
                    self.put(b, 0)
        else:
            for b in blocks:
                self.put(b, 0)


class Lru(OrderedPolicy):
    """vLLM 0.33 dense: cached blocks join the back in release order (a drop releases from the window's
    edge backwards), blocks without a hash join the front."""

    def release(self, blocks, reason: str) -> None:
        if reason == "drop":
            blocks = list(reversed(blocks))
        front = [b for b in blocks if b.key is None]
        for b in reversed(front):
            self.put(b, 0, front=True)
        for b in blocks:
            if b.key is not None:
                self.put(b, 0)


class Tiered(OrderedPolicy):
    """The proposal's tiers, each in LRU order; the lowest non-empty tier is evicted first.

    Tier 0 holds nothing (never filled, or never cacheable: a partial block); tier 1 the cached blocks no
    plausible hit reaches (dropped mid-request and not below a fork of its chain, the prompt end or a
    checkpoint; or a window a follow-up already consumed); tier 2 the speculative ones (below a prompt end
    or a checkpoint: a resend could use them); tier 3 everything a follow-up or a sibling is expected to
    hit (a finished request's trailing window and full-attention chain, windows below a fork, a preempted
    request's blocks)."""

    TIERS = {"dropped-interior": 1, "dropped-shared": 1, "dropped-prompt-end": 2, "dropped-checkpoint": 2}

    def __init__(self, tiers: dict | None = None):
        super().__init__(num_tiers=4)
        self.tier_of = self.TIERS if tiers is None else tiers

    def release(self, blocks, reason: str) -> None:
        for b in blocks:
            self.put(b, 0 if b.key is None else self.tier_of.get(b.cls, 3))


class ReuseAware(Tiered):
    """Tiered, but the finished requests' single chains (full-attention blocks past the last fork, trailing
    windows) are evicted youngest first unless they are older than the reuse horizon (then oldest first):
    a session's follow-up comes after the others', so under pressure LRU evicts exactly the chain needed
    next. The horizon is twice the longest of the last 64 observed reuse distances (in released
    requests), so chains nobody came back for still age out."""

    TIERS = {"dropped-interior": 1, "dropped-shared": 1, "dropped-prompt-end": 2, "dropped-checkpoint": 2,
             "full": 3, "finished-window": 3}
    CHAIN = 3

    def __init__(self, horizon_factor: float = 2.0):
        super().__init__(tiers=self.TIERS)
        self.tiers.append(OrderedDict())          # tier 4: everything else, LRU
        self.batches: OrderedDict[int, OrderedDict] = OrderedDict()   # release stamp -> blocks (tail first)
        self.batch_of: dict[int, int] = {}
        self.stamp = 0
        self.distances: deque = deque(maxlen=64)
        self.factor = horizon_factor

    def __len__(self) -> int:
        return len(self.where) + len(self.batch_of)

    def release(self, blocks, reason: str) -> None:
        self.stamp += 1
        chain = OrderedDict()
        for b in blocks:
            tier = 0 if b.key is None else self.tier_of.get(b.cls, 4)
            if tier == self.CHAIN:
                chain[b.block_id] = b
                self.batch_of[b.block_id] = self.stamp
            else:
                self.put(b, tier)
        if chain:
            self.batches[self.stamp] = chain

    def remove(self, block: Block) -> None:
        stamp = self.batch_of.pop(block.block_id, None)
        if stamp is None:
            return super().remove(block)
        self.distances.append(self.stamp - stamp)
        batch = self.batches[stamp]
        del batch[block.block_id]
        if not batch:
            del self.batches[stamp]

    def pop(self) -> Block:
        for t in self.tiers[:self.CHAIN]:
            if t:
                block = t.popitem(last=False)[1]
                del self.where[block.block_id]
                return block
        if self.batches:
            oldest = next(iter(self.batches))
            horizon = self.factor * max(self.distances) if self.distances else float("inf")
            stamp = oldest if self.stamp - oldest > horizon else next(reversed(self.batches))
            batch = self.batches[stamp]
            block = batch.popitem(last=False)[1]
            del self.batch_of[block.block_id]
            if not batch:
                del self.batches[stamp]
            return block
        block = self.tiers[4].popitem(last=False)[1]
        del self.where[block.block_id]
        return block


class Belady:
    """Clairvoyant: hands out a block that holds nothing, else the cached block whose next use is furthest.

    ``needs[key]``: sorted indices (in first-admission order of the unbounded-pool run) of the requests
    whose ceiling hit needed that block; ``advance(t)`` is called when request ``t`` is admitted."""

    def __init__(self, needs: dict, need_sets: dict):
        self.needs = needs
        self.need_sets = need_sets
        self.empty: OrderedDict[int, Block] = OrderedDict()
        self.heap: list = []
        self.free: dict[int, Block] = {}
        self.by_key: dict = {}
        self.t = 0
        self.seq = 0

    def __len__(self) -> int:
        return len(self.free)

    def _next_use(self, key) -> float:
        uses = self.needs.get(key)
        if not uses:
            return float("inf")
        i = bisect_left(uses, self.t)
        return uses[i] if i < len(uses) else float("inf")

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

    def attach(self, num_blocks: int) -> None:
        pass

    def is_ghost(self, h: bytes) -> bool:
        return False

    def ghost_hit(self, passed: list[bytes]) -> None:
        pass

    def advance(self, request_index: int) -> None:
        """Request ``request_index`` was admitted: the blocks it needed now have a later next use."""
        self.t = max(self.t, request_index + 1)
        for key in self.need_sets.get(request_index, ()):
            for b in list(self.by_key.get(key, {}).values()):
                self._push(b)


class Branch(Exception):
    """A scripted run reached an eviction choice it has no instruction for: ``n`` options."""

    def __init__(self, n: int):
        super().__init__(n)
        self.n = n


class Scripted(OrderedPolicy):
    """Every eviction choice made by a script, for the exhaustive search of the best policy.

    Choices that cannot be better than another are skipped: a free block holding nothing is handed out
    first, then a cached block whose content no unfinished request contains (``live()``: the hashes still
    wanted); a full-attention block whose child in its chain is also free and cached is never chosen
    before that child (a full-attention hit needs every block before it, so keeping the child alone serves
    nothing the parent does not). Among the rest, ``choices[k]`` picks one content (LRU order); it raises
    ``Branch(n)`` when the script runs out. ``full_groups``: the groups that never drop."""

    def __init__(self, choices: list[int], live, full_groups=frozenset()):
        super().__init__(num_tiers=2)
        self.choices = choices
        self.pos = 0
        self.live = live
        self.full_groups = full_groups

    def release(self, blocks, reason: str) -> None:
        for b in blocks:
            self.put(b, 0 if b.key is None else 1)

    def pop(self) -> Block:
        if not self.tiers[0]:
            live = self.live()
            options, seen = [], set()
            free_parents = {(b.key[0], b.parent) for b in self.tiers[1].values() if b.key[0] in self.full_groups}
            for b in self.tiers[1].values():
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
            del self.tiers[1][b.block_id]
            del self.where[b.block_id]
            return b
        return super().pop()


class Adaptive(OrderedPolicy):
    """kvmanager's policy (kvmanager/free_queue.py), block for block: tiers 0-2 as ``Tiered``; tier 3 holds
    release batches of chains (``full``, ``finished-window``) and, apart, of blocks proven shared
    (``PROVEN``). LRU (the older front first) until ghost votes reach ``THRESHOLD``; then what is older than
    the horizon first, then the youngest chain, then the proven batches. The bench checks that it equals
    the swakv column cell by cell."""

    TIERS = {"dropped-interior": 1, "dropped-shared": 1, "dropped-prompt-end": 2, "dropped-checkpoint": 2}
    PROVEN = {"preempted", "dropped-junction", "full-shared", "finished-junction"}
    THRESHOLD, VOTE_CAP, PENALTY, DISTANCES = 4, 16, 2, 64

    def __init__(self):
        super().__init__(num_tiers=3)
        self.chains: OrderedDict[int, OrderedDict] = OrderedDict()   # release -> blocks, oldest first
        self.proven: OrderedDict[int, OrderedDict] = OrderedDict()
        self.stamp_of: dict[int, int] = {}      # release -> tier-3 blocks ever released when it was
        self.batch_of: dict[int, tuple[OrderedDict, int]] = {}      # block id -> (its batches, release)
        self.counted: set[int] = set()
        self.releases = self.clock = self.reusable = self.votes = 0
        self.distances: deque = deque(maxlen=self.DISTANCES)
        self.ghosts: OrderedDict[bytes, tuple[int, bool]] = OrderedDict()
        self.cap = 16

    def attach(self, num_blocks: int) -> None:
        self.cap = max(16, 2 * (num_blocks - 1))

    def __len__(self) -> int:
        return len(self.where) + len(self.batch_of)

    def release(self, blocks, reason: str) -> None:
        chain, proven = OrderedDict(), OrderedDict()
        for b in blocks:
            if b.key is None:
                self.put(b, 0)
            elif b.cls in self.PROVEN:
                proven[b.block_id] = b
            elif b.cls in self.TIERS:
                self.put(b, self.TIERS[b.cls])
            else:
                chain[b.block_id] = b
        if not (chain or proven):
            return
        self.releases += 1
        self.clock += len(chain) + len(proven)
        self.reusable += len(chain) + len(proven)
        self.stamp_of[self.releases] = self.clock
        for batch, batches in ((chain, self.chains), (proven, self.proven)):
            if batch:
                batches[self.releases] = batch
                for bid in batch:
                    self.batch_of[bid] = (batches, self.releases)

    def _vote(self, v: int) -> None:
        self.votes = max(-self.VOTE_CAP, min(self.VOTE_CAP, self.votes + v))

    def _unlink(self, block: Block) -> None:
        batches, r = self.batch_of.pop(block.block_id)
        batch = batches[r]
        del batch[block.block_id]
        if not batch:
            del batches[r]
        self.reusable -= 1

    def remove(self, block: Block) -> None:
        at = self.batch_of.get(block.block_id)
        if at is None:
            return super().remove(block)
        batches, r = at
        key = (id(batches), r)
        if key not in self.counted:
            self.counted.add(key)
            age = self.clock - self.stamp_of[r]
            if age > self.reusable:
                self._vote(1)
            if batches is self.chains:
                self.distances.append(age)
        self._unlink(block)

    def is_ghost(self, h: bytes) -> bool:
        return h in self.ghosts

    def ghost_hit(self, passed: list[bytes]) -> None:
        """The lookup passed these ghosts of one evicted chain: the deepest votes, all are forgotten."""
        stamp, youngest = self.ghosts[passed[-1]]
        for h in passed:
            del self.ghosts[h]
        distance = self.clock - stamp
        self.distances.append(distance)
        if not youngest:
            self._vote(1)
        elif distance <= self.reusable:
            self._vote(-self.PENALTY)

    def pop(self) -> Block:
        for t in self.tiers:
            if t:
                block = t.popitem(last=False)[1]
                del self.where[block.block_id]
                return block
        c = next(iter(self.chains), None)
        p = next(iter(self.proven), None)
        young = self.votes >= self.THRESHOLD
        if young:
            cut = self.clock - (max(self.distances) if self.distances else 0)
            if (c is not None and self.stamp_of[c] < cut) or (p is not None and self.stamp_of[p] < cut):
                young = False
        if young:
            batches, r = (self.chains, next(reversed(self.chains))) if self.chains else (self.proven, p)
        elif p is None or (c is not None and self.stamp_of[c] <= self.stamp_of[p]):
            batches, r = self.chains, c
        else:
            batches, r = self.proven, p
        block = next(iter(batches[r].values()))
        self._unlink(block)
        self.ghosts[block.key[1]] = (self.stamp_of[r], young)
        self.ghosts.move_to_end(block.key[1])
        if len(self.ghosts) > self.cap:
            self.ghosts.popitem(last=False)
        return block


POLICIES = {"drop-front": DropFront, "lru": Lru, "tiered": Tiered, "reuse": ReuseAware, "adaptive": Adaptive}


# -- the simulated manager -------------------------------------------------------------------------
class SimManager:
    """A block pool of ``num_blocks`` (``None``: unbounded) shared by groups of ``specs``.

    ``checkpoint``: also protect (as ``dropped-checkpoint``) the window below every multiple of this many
    tokens. ``junctions``: learn forks as kvmanager does (the first child of every parent hash cached, and
    where a lookup's chain leaves the remembered one; both memories bounded by twice the pool's size) and
    protect the windows below them.
    """

    def __init__(self, specs: list[Spec], num_blocks: int | None, policy="drop-front", *,
                 checkpoint: int = 0, junctions: bool = True):
        self.specs = specs
        self.rule = HitRule(specs)
        self.bs = specs[0].block_size
        self.unbounded = num_blocks is None
        self.blocks = [Block(0)]
        if not self.unbounded:
            self.blocks += [Block(i) for i in range(1, num_blocks)]
        self.policy = policy if not isinstance(policy, str) else POLICIES[policy]()
        if not self.unbounded:
            self.policy.attach(num_blocks)
            self.policy.release(self.blocks[1:], "init")
        self.cached: list[dict[bytes, dict[int, Block]]] = [{} for _ in specs]
        self.ever: list[set[bytes]] = [set() for _ in specs]   # every hash each group ever cached
        self.first_child: OrderedDict[bytes, bytes] = OrderedDict()  # parent hash -> its first child seen
        self.forks: OrderedDict[bytes, None] = OrderedDict()  # parents known to have two children or more
        self.memory_cap = max(16, 2 * ((num_blocks or 0) - 1))
        # as kvmanager: one group tells how chains go on, one that drops nothing if any
        self.registrar = min(range(len(specs)), key=lambda g: specs[g].drops)
        self.checkpoint = checkpoint
        self.junctions = junctions
        self.tables: list[dict[str, list]] = [{} for _ in specs]
        self.num_cached: list[dict[str, int]] = [{} for _ in specs]
        self.num_dropped: list[dict[str, int]] = [{} for _ in specs]
        self.requests: dict[str, SimRequest] = {}
        # analysis
        self.evictions: Counter = Counter()
        self.harmful: Counter = Counter()          # evictions of blocks a later lookup needed
        self.lost_tokens: Counter = Counter()      # shortfall tokens, charged per class
        self.violations = 0                        # cached block evicted while an empty block was free
        self.num_empty_free = 0 if self.unbounded else num_blocks - 1
        self._evicted: dict[tuple[int, bytes], tuple[str, int]] = {}
        self._harm_seen: set[int] = set()
        self._eviction_id = 0
        self._fork_needs: list[range] = []

    # -- hits --------------------------------------------------------------------------------------
    def _hit_length(self, req: SimRequest, max_tokens: int, sets) -> int:
        """The manager's own agreement rule (``HitRule``) over each group's search in ``sets``."""
        hashes = req.block_hashes(self.bs)
        bs = self.bs
        searches = [lambda bound, spec=spec, s=s: spec.longest_hit(lambda i: hashes[i] in s, bound // bs) * bs
                    for spec, s in zip(self.specs, sets)]
        return self.rule.longest(searches, max_tokens)

    def get_computed_blocks(self, req: SimRequest):
        max_tokens = req.num_tokens - 1
        h = self._hit_length(req, max_tokens, self.cached)
        hashes = req.block_hashes(self.bs)
        req.shortfall = None
        if not self.unbounded:
            ceiling = self._hit_length(req, max_tokens, self.ever)
            if ceiling > h and req.admissions == 0:      # charged if this lookup admits it the first time
                req.shortfall = (h, ceiling)
            if self.junctions:
                self._walk(hashes, h // self.bs, max_tokens // self.bs)
        hit = []
        for g, spec in enumerate(self.specs):
            first = spec.first_needed_token(h) // self.bs
            cache = self.cached[g]
            hit.append([None] * first + [next(iter(cache[x].values())) for x in hashes[first:h // self.bs]])
        return hit, h

    def _walk(self, hashes, start: int, limit: int) -> None:
        """Follow the remembered chain past the hit: where this request's chain leaves it, the parent is
        a fork (a later sibling will want the window below it); the deepest ghost passed teaches the policy."""
        j = max(start, 1)
        if j >= limit:
            return
        passed = []
        while j < limit:
            child = self.first_child.get(hashes[j - 1])
            if child is None:
                break
            if child != hashes[j]:
                if hashes[j - 1] not in self.forks:
                    self._remember(self.forks, hashes[j - 1], None)
                break
            if self.policy.is_ghost(hashes[j]):
                passed.append(hashes[j])
            j += 1
        if passed:
            self.policy.ghost_hit(passed)

    def _learn(self, parent: bytes, child: bytes) -> None:
        first = self.first_child.get(parent)
        if first is None:
            self._remember(self.first_child, parent, child)
        elif first == child:
            self.first_child.move_to_end(parent)
        elif parent not in self.forks:
            self._remember(self.forks, parent, None)

    def _fork_ends(self, hashes, n: int) -> list[int]:
        """Hit ends (in blocks, at most ``n``) at a fork of this chain."""
        return [e for e in range(1, min(n, len(hashes)) + 1) if hashes[e - 1] in self.forks]

    def _charge_shortfall(self, req, h, ceiling, hashes) -> None:
        rightmost, cls = (-1, False), None     # at equal positions a sliding group's block is named
        for g, spec in enumerate(self.specs):
            cache = self.cached[g]
            for i in spec.needed_blocks(ceiling):
                if hashes[i] not in cache:
                    rec = self._evicted.get((g, hashes[i]))
                    if rec is not None:
                        if rec[1] not in self._harm_seen:
                            self._harm_seen.add(rec[1])
                            self.harmful[rec[0]] += 1
                        if (i, spec.drops) > rightmost:
                            rightmost, cls = (i, spec.drops), rec[0]
        self.lost_tokens[cls or "unknown"] += ceiling - h

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
                    b.shared = True
        if rid not in self.requests:
            self.requests[rid] = req
            if req.shortfall is not None:
                self._charge_shortfall(req, *req.shortfall, req.block_hashes(self.bs))
                req.shortfall = None
            req.admissions += 1
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
        # hit ends at a fork whose needed blocks meet the span (at most span.stop + run - 1)
        spec = self.specs[g]
        self._fork_needs = [spec.needed_blocks(e * self.bs) for e in
                            self._fork_ends(req.block_hashes(self.bs), span.stop + spec.run - 1)
                            if e > span.start] if self.junctions else []
        self._to_policy(self._release_blocks(g, req, dropped, list(span), "drop"), "drop")

    def _classify(self, g: int, req: SimRequest, i: int, reason: str, block: Block) -> str:
        spec = self.specs[g]
        if reason == "preempt":
            return "preempted"
        below_fork = any(i in r for r in self._fork_needs)
        if not spec.drops:
            return "full-shared" if below_fork else "full"
        if reason == "finish":
            return "finished-junction" if below_fork else "finished-window"
        if below_fork:
            return "dropped-junction"
        if block.shared:
            return "dropped-shared"
        if self._below(i, (req.num_prompt_tokens - 1), spec):
            return "dropped-prompt-end"
        if self.checkpoint:
            c = (i // (self.checkpoint // self.bs) + 1) * self.checkpoint   # the next checkpoint above block i
            if self._below(i, c, spec):
                return "dropped-checkpoint"
        return "dropped-interior"

    def _below(self, i: int, pos: int, spec: Spec) -> bool:
        end = pos // self.bs
        return end - spec.run <= i < end

    def _release_blocks(self, g: int, req: SimRequest, blocks, indices, reason: str) -> list[Block]:
        """Drop one reference on each block; classify those no one holds any more and return them."""
        freed = []
        for b, i in zip(blocks, indices):
            b.ref -= 1
            if b.ref == 0:
                b.cls = self._classify(g, req, i, reason, b) if b.key is not None else "never-filled"
                if b.key is None:
                    self.num_empty_free += 1
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
                self._evict(b)
            elif not self.unbounded:
                self.num_empty_free -= 1
            b.ref = 1
            b.shared = False
        return out

    def _evict(self, b: Block) -> None:
        if self.num_empty_free > 0:
            self.violations += 1
        g, x = b.key
        self.evictions[b.cls] += 1
        self._eviction_id += 1
        self._evicted[b.key] = (b.cls, self._eviction_id)
        entry = self.cached[g][x]
        del entry[b.block_id]
        if not entry:
            del self.cached[g][x]
        b.key = None

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
            cache, ever = self.cached[g], self.ever[g]
            for i in range(start, end):
                b = table[i]
                if b is not None and b.key is None:
                    b.key = (g, hashes[i])
                    b.pos = i
                    b.parent = hashes[i - 1] if i else None
                    cache.setdefault(hashes[i], {})[b.block_id] = b
                    ever.add(hashes[i])
                    if i and not self.unbounded and g == self.registrar:
                        self._learn(hashes[i - 1], hashes[i])
            self.num_cached[g][rid] = end

    def _remember(self, memory: OrderedDict, x: bytes, value) -> None:
        memory[x] = value
        memory.move_to_end(x)
        if len(memory) > self.memory_cap:
            memory.popitem(last=False)

    def _release_request(self, req: SimRequest, reason: str) -> None:
        rid = req.request_id
        hashes = req.block_hashes(self.bs)
        freed = []          # one release for the whole request: group by group, each tail first
        for g in range(len(self.specs)):
            table = self.tables[g].pop(rid, None)
            self.num_cached[g].pop(rid, None)
            self.num_dropped[g].pop(rid, None)
            if table:
                # blocks a hit at a fork of this chain needs serve siblings, not just a follow-up
                self._fork_needs = [self.specs[g].needed_blocks(e * self.bs)
                                    for e in self._fork_ends(hashes, len(table))] if self.junctions else []
                idx = [i for i in range(len(table) - 1, -1, -1) if table[i] is not None]
                freed += self._release_blocks(g, req, [table[i] for i in idx], idx, reason)
        self._to_policy(freed, reason)
        del self.requests[rid]

    def free(self, req: SimRequest) -> None:
        self._release_request(req, "finish")

    def admitted(self, request_index: int) -> None:
        """The serving loop admitted request ``request_index`` (first-admission order) for the first time."""
        if not self.unbounded:
            self.policy.advance(request_index)

    def preempt(self, req: SimRequest) -> None:
        self._release_request(req, "preempt")
        req.num_computed_tokens = 0

    def report(self) -> dict:
        return {"evictions": dict(self.evictions), "harmful_evictions": dict(self.harmful),
                "lost_tokens": dict(self.lost_tokens), "violations": self.violations}
