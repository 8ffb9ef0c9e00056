"""The host-memory tier: a second pool of KV blocks in host memory, owned by the manager, off by default.

Why: a block the device pool reuses is lost, and the next request that needs it recomputes the prefix; a
copy in host memory turns that recompute into a load. For hybrid models only what a hit needs is moved.

**What is stored, and when.** A cached block is stored when its last device reference goes, if a hit can
still need it and its hash is on host neither stored nor being stored:

- a finished request's tables: the cached blocks a hit at its end (a follow-up turn), at its prompt's end
  or within its last message (a resend, another question on the same document), or below a fork of its
  chain needs (``needed_at_release``). Full attention: all of them; a sliding or chunked group: the last
  window (or chunk) below each such end (a request released right after its prefill still holds its
  whole prompt in every group: the rest is not stored). Not a preempted request's: the scheduler preempts
  because it needs the room now; its blocks wait in the free queue as proven ones;
- a block a running request's window drops: only if a hit below a fork of its chain or in the window
  below its prompt end (its last message) needs it, the free queue's own classes (``below_fork``,
  ``below_end``); a dropped block of the unreachable class is stored only speculatively (below).

Speculatively (``speculative``, on by default; off, only what a known hit needs moves) the other cached blocks
(the unreachable class, windows below no known hit end) are stored too, only into free host units, never
evicting anything, and first to go when room is needed: a fork is learnt only when a second request leaves
the chain, so "no hit can need it" is a guess, and free host memory costs nothing but the copies (the
retention cell measured the hits it saves, docs/performance.md). A full host stores none of them.

Other groups: when a sliding block is dropped, the same request still holds on device every block a full
(or longer-reaching) group needs for a hit at those ends, and stores them when it releases them; so a
sliding block is stored only for hits the other groups can serve too (while the host keeps them).
Not under pressure: while an allocation relies on what its own drop frees (the pool is short), that drop
stores nothing. Pinned blocks are not free: ``num_pinned_units`` tells a scheduler how much a fence will
give back soon.
Why at release and not when the pool reuses the block: a copy is asynchronous and the block must not be
reused before it is fenced, so a store at reuse time would stall the allocation or lose the block; at
release the copy has until the block reaches the front of the eviction order. The cost: the block waits
outside the free queue until its copy is fenced (usually one step), and host memory is inclusive (it may
hold what the device still holds).

**What is loaded.** A lookup runs the hit rule (``HitRule``) over device and host together: each group's
needed blocks (full attention: all before ``h``; sliding: the last window; chunked: the current chunk),
each on either tier; device copies are preferred. When the hit is allocated (alone: no new tokens, whose
blocks would be cached before they are computed), each needed block found only on host gets a fresh
device block and one load; nothing else moves.

**Fences** (correct by construction). A device block with a copy in flight is *pinned*: it is not in the
free queue, so nothing can reuse it; a release that would free it leaves it where it is, and the copy's
completion (``transfers_done``) hands it to the free queue, once. A load's target is not cached before its
copy is done, so no other request can hit it. A request is *loading* while any load of its is in flight;
the engine must not compute it. A failed load preempts its request (it recomputes through the prefix
cache), forgets the host copy, and frees nothing early: the request's other targets stay pinned until
their own copies report. A host block a load reads, or a store writes, is never evicted from the host.

**Events** (``BlockPool.events``, when set). A store's copy, once fenced, is announced as
``copied(group, hash, "CPU")``: its source block is still cached then (it was pinned), so the sink tells
the copy with the device block's chain and tokens; a host block leaving lookups (evicted, its load failed,
the host memory lost) as ``removed(group, hash, "CPU")``. A load's target is cached on device like any
computed block (``stored``, the tokens included). A prefix-cache reset is the pool's ``cleared``, which
covers both tiers.

**Host eviction.** LRU over whole host blocks (a hit or a repeated store refreshes an entry), skipping
those with a copy in flight: the order an operator expects, and cheap. Its known worst case is cyclic
reuse of more than the host holds (sessions coming back in turn): there it keeps nothing useful, which
the retention bench cell shows (docs/performance.md); the free queue's adaptive order is the remedy, not
reused here yet.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial

STORE, LOAD = 0, 1
HOST_MEDIUM = "CPU"     # the KV events' ``medium`` of this tier (vLLM's name for host memory)


@dataclass
class KVTransfers:
    """Copies the workers must run, in order, before the step that follows. Host blocks are tuples of host
    units (a width-k block is k units, as a device composite), device blocks their id (its units are those
    ``pop_compositions`` announced). Each reports back by its device block id (``transfers_done``)."""

    stores: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)   # (group, device, host)
    loads: list[tuple[int, tuple[int, ...], int]] = field(default_factory=list)    # (group, host, device)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)


class HostBlock:
    __slots__ = ("group", "block_hash", "units", "valid", "pins", "speculative")

    def __init__(self, group: int, block_hash: bytes, units: tuple[int, ...]):
        self.group, self.block_hash, self.units = group, block_hash, units
        self.valid = False      # its store is done: lookups may use it
        self.pins = 0           # copies in flight reading or writing it: never evicted meanwhile
        self.speculative = False    # stored into free units though no known hit needs it: evicted first


class HostRef:
    """A hit's table entry that lies on host only: ``allocate_slots`` replaces it with a fresh device block
    and a load. Shaped like a free ``Block`` to the capacity check (it needs one block); ``touch`` knows
    it by its id, -1, and takes it from no queue."""

    __slots__ = ("host", "block_id", "shared", "pinned", "group", "block_hash")

    def __init__(self, host: HostBlock):
        self.host = host
        self.block_id, self.shared, self.pinned = -1, False, False
        self.group, self.block_hash = host.group, host.block_hash

    @property
    def ref_cnt(self) -> int:
        """Always 0: the table gets a fresh block of its own, so the same hit may be offered again."""
        return 0

    @ref_cnt.setter
    def ref_cnt(self, value: int) -> None:
        pass

    def __repr__(self) -> str:
        return f"HostRef(group={self.group}, units={list(self.host.units)})"


class _Transfer:
    __slots__ = ("kind", "block", "host", "request", "release")

    def __init__(self, kind, block, host, request=None, release=None):
        self.kind, self.block, self.host, self.request, self.release = kind, block, host, request, release


class _Either:
    """Hashes of one group on device or (stored) on host: what the union lookup searches."""

    __slots__ = ("device", "host")

    def __init__(self, device: dict, host: dict):
        self.device, self.host = device, host

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.device or block_hash in self.host


def _group_hit(group, request, cached, bound: int) -> int:
    return group.longest_hit(request, bound, cached=cached)


def _whole_prefix(group, request, cached, bound: int) -> int:
    """``as_full``: the longest run of cached blocks from the first (every layer treated as full attention)."""
    bs = group.block_size
    hashes = request.block_hashes(bs, min(bound, request.num_tokens) // bs)[:bound // bs]
    n = 0
    while n < len(hashes) and hashes[n] in cached:
        n += 1
    return n * bs


class HostTier:
    """``num_units`` host units for the pool's groups (a block of a width-k group takes k units)."""

    def __init__(self, coordinator, num_units: int, speculative: bool = True):
        self.coordinator = coordinator
        self.pool = coordinator.pool
        self.widths = self.pool.widths
        self.num_units = num_units
        self.speculative = speculative   # also store what no known hit needs, into free host units only
        self._free = list(range(num_units - 1, -1, -1))       # a stack: unit 0 is handed out first
        n = len(self.widths)
        self.entries: list[dict[bytes, HostBlock]] = [{} for _ in range(n)]   # stored, valid ones
        self._writing: dict[tuple[int, bytes], HostBlock] = {}                # stores in flight
        self._lru: OrderedDict[tuple[int, bytes], HostBlock] = OrderedDict()
        self._inflight: dict[int, _Transfer] = {}             # device block id -> its copy
        self.loading: dict[str, tuple[object, set[int]]] = {}  # request id -> (request, device ids)
        self._out = KVTransfers()
        self.skip_stores = False   # set by the coordinator while a drop must free what its capacity check
        #                            counted on (the pool is short): those blocks go to the free queue
        self.blocks_stored = [0] * n
        self.blocks_loaded = [0] * n
        # The baseline the hit-rate bench compares against (``bench/host_tier.py``), never set by the
        # product: store every cached block a release or a drop lets go, and take a hit from host only
        # where every group holds the whole prefix (device or host), as a tier that treats every layer as
        # full attention does. Loads stay those of the window-aware table: it models what is stored and
        # what a hit requires; the bytes of its loads are the as-full layout's (the bytes table).
        self.as_full = False

    # -- stores: where a released block goes -----------------------------------------------------
    def add_dropped(self, blocks, first: int, below_fork, below_end, at_end: int = -1) -> None:
        """``FreeQueue.add_dropped``'s arguments: blocks a hit can still need are stored (pinned until the
        copy is fenced), then the others into free host units only; pinned ones stay out, the rest go to
        the free queue as runs keeping their index."""
        for needed_pass in (True, False):
            for i, block in enumerate(blocks, first):
                if block.ref_cnt == 0 and not block.pinned and block.block_hash is not None:
                    fork, end = i in below_fork, i in below_end or i == at_end
                    needed = self.as_full or fork or end
                    if needed is needed_pass:
                        self._store(block, (i, fork, end), not needed)
        free = self.pool.free
        run, start = [], first
        for i, block in enumerate(blocks, first):
            if block.ref_cnt == 0 and block.pinned:
                if run:
                    free.add_dropped(run, start, below_fork, below_end, at_end)
                run, start = [], i + 1
            else:
                run.append(block)
        if run:
            free.add_dropped(run, start, below_fork, below_end, at_end)

    def add_released(self, request, pairs, preempted: bool, ends=(), gap: int = 0) -> None:
        """``FreeQueue.add_released``'s arguments and the request: the cached blocks a hit can still need
        (``needed_at_release``) are stored, pinned ones stay out, the rest go to the free queue."""
        if not preempted:       # a preempted request's blocks: the room is needed now; they wait as proven
            needed = self.needed_at_release(request)
            cached = [(b, proven) for b, proven in pairs if b.block_hash is not None and not b.pinned]
            for needed_pass in (True, False):
                for b, proven in cached:
                    if (proven or b.block_hash in needed[b.group]) is needed_pass:
                        self._store(b, (proven, preempted), not needed_pass)
        out = [(b, proven) for b, proven in pairs if not b.pinned]
        if out or ends:
            self.pool.free.add_released(out, preempted, ends, gap)

    def needed_at_release(self, request) -> list[set[bytes]]:
        """Per group, the hashes of the request's blocks a plausible hit needs: a hit at its end (the blocks
        its computed tokens fill: a follow-up turn) and at its prompt's end or within its last message (a
        resend, another question), the drop's ``below_end`` class. Full attention: every block; a window:
        the last window below each such end. Blocks below a fork of the chain come marked ``proven``."""
        out = []
        last_message = self.pool.free.last_message_tokens
        for g in self.coordinator.groups:
            bs, first = g.block_size, g.spec.first_needed_token
            end = request.num_computed_tokens // bs
            hashes = request.block_hashes(bs, end)
            end = min(end, len(hashes))
            prompt_end = min((len(request.prompt_token_ids) - 1) // bs, end)
            lowest = max(0, prompt_end * bs - last_message)
            if self.as_full:
                idx = range(end)
            else:
                idx = set(range(first(end * bs) // bs, end)) | set(range(first(lowest) // bs, prompt_end))
            out.append({hashes[i] for i in idx})
        return out

    def _store(self, block, release, speculative: bool = False) -> bool:
        """Store ``block`` unless its hash is on host (refreshed then) or being stored. ``speculative``: no
        known hit needs it; only into free host units, and first to be evicted."""
        if self.skip_stores:
            return False
        key = (block.group, block.block_hash)
        held = self.entries[key[0]].get(key[1])
        if held is not None:
            if not speculative:             # needed now: a full member of the LRU order
                held.speculative = False
                self._lru.move_to_end(key)
            return False
        if key in self._writing:
            return False
        if speculative and (not self.speculative or len(self._free) < self.widths[key[0]]):
            return False
        units = self._alloc(self.widths[key[0]])
        if units is None:
            return False                       # every host block has a copy in flight: not stored
        host = HostBlock(key[0], key[1], units)
        host.pins = 1
        host.speculative = speculative
        self._writing[key] = host
        block.pinned = True
        self._inflight[block.block_id] = _Transfer(STORE, block, host, release=release)
        self._out.stores.append((key[0], block.block_id, units))
        self.blocks_stored[key[0]] += 1
        return True

    def _alloc(self, k: int) -> tuple[int, ...] | None:
        """``k`` host units, evicting least recently used host blocks no copy is reading."""
        while len(self._free) < k:
            victim = next((key for key, hb in self._lru.items() if not hb.pins), None)
            if victim is None:
                return None
            self._forget(self._lru[victim])
        return tuple(self._free.pop() for _ in range(k))

    def _forget(self, hb: HostBlock) -> None:
        """Drop a valid host block from lookups; its units go back once no copy reads them."""
        key = (hb.group, hb.block_hash)
        if self.entries[hb.group].get(hb.block_hash) is hb:
            del self.entries[hb.group][hb.block_hash]
            del self._lru[key]
            if self.pool.events is not None:
                self.pool.events.removed(hb.group, hb.block_hash, HOST_MEDIUM)
        hb.valid = False
        if not hb.pins:
            self._free.extend(reversed(hb.units))

    # -- loads: lookups across both tiers --------------------------------------------------------
    def extend_hit(self, request, max_tokens: int, hit, h: int):
        """The longest hit over device and host (at least the device's ``h``), with ``HostRef`` entries
        for the needed blocks found on host only."""
        co = self.coordinator
        views = [_Either(self.pool._cached[g.group_id], self.entries[g.group_id]) for g in co.groups]
        search = _whole_prefix if self.as_full else _group_hit
        h2 = co.rule.longest([partial(search, g, request, v) for g, v in zip(co.groups, views)], max_tokens)
        if h2 <= h:
            return hit, h
        request.lru_hit = max(request.lru_hit, h2)   # the floor compares device policies: LRU with this
        if request.sparse_hit >= 0:                  # host tier would have had it too
            request.sparse_hit = max(request.sparse_hit, h2)
        out = []
        get, null = self.pool.get_cached, self.pool.null_block
        for g in co.groups:
            bs, gid = g.block_size, g.group_id
            end = h2 // bs
            first = g.spec.first_needed_token(h2) // bs
            hashes = request.block_hashes(bs, end)
            blocks = [null] * first
            for x in hashes[first:end]:
                b = get(gid, x)
                blocks.append(b if b is not None else HostRef(self.entries[gid][x]))
            out.append(blocks)
        return tuple(out), h2

    def holds(self, ref: HostRef) -> bool:
        return self.entries[ref.group].get(ref.block_hash) is ref.host

    def materialize(self, request, hit):
        """Called by the coordinator once capacity is checked and the hit touched: each ``HostRef`` becomes
        a fresh, pinned device block with a load scheduled into it."""
        if not any(type(b) is HostRef for blocks in hit for b in blocks):
            return hit
        take = self.pool.take
        ids = self.loading.setdefault(request.request_id, (request, set()))[1]
        out = []
        for gid, blocks in enumerate(hit):
            blocks = list(blocks)
            for j, b in enumerate(blocks):
                if type(b) is HostRef:
                    dev = take(1, gid)[0]
                    dev.pinned = True
                    hb = b.host
                    hb.pins += 1
                    hb.speculative = False
                    self._lru.move_to_end((hb.group, hb.block_hash))
                    self._inflight[dev.block_id] = _Transfer(LOAD, dev, hb, request=request, release=j)
                    self._out.loads.append((gid, hb.units, dev.block_id))
                    self.blocks_loaded[gid] += 1
                    ids.add(dev.block_id)
                    blocks[j] = dev
            out.append(blocks)
        if self.as_full:                 # its hit used the whole prefix: a full member of the LRU order too
            for g, blocks in zip(self.coordinator.groups, hit):
                for x in request.block_hashes(g.block_size, len(blocks))[:len(blocks)]:
                    if (g.group_id, x) in self._lru:
                        self._lru.move_to_end((g.group_id, x))
        return tuple(out)

    # -- the engine's side -------------------------------------------------------------------------
    def take_transfers(self) -> KVTransfers:
        out, self._out = self._out, KVTransfers()
        return out

    def in_flight(self) -> dict[int, _Transfer]:
        return self._inflight

    def transfers_done(self, done, failed) -> list:
        """Fence the copies into these device blocks; return the requests a failed load preempts (the
        caller preempts them). Checks every id before changing anything."""
        done, failed = list(done), list(failed)
        ids = done + failed
        if len(set(ids)) != len(ids) or any(i not in self._inflight for i in ids):
            bad = sorted({i for i in ids if i not in self._inflight or ids.count(i) > 1}, key=str)
            raise ValueError(f"transfers_done: {bad!r} are not device blocks with one copy in flight each")
        lost = []
        released = []       # store sources a finished request released: back to the free queue as one batch
        for i, ok in [(i, True) for i in done] + [(i, False) for i in failed]:
            t = self._inflight.pop(i)
            block, hb = t.block, t.host
            block.pinned = False
            hb.pins -= 1
            if t.kind == STORE:
                del self._writing[(hb.group, hb.block_hash)]
                if ok:
                    hb.valid = True
                    self.entries[hb.group][hb.block_hash] = hb
                    self._lru[(hb.group, hb.block_hash)] = hb
                    if hb.speculative:          # first to go
                        self._lru.move_to_end((hb.group, hb.block_hash), last=False)
                    if self.pool.events is not None:    # the source is still cached (pinned till now)
                        self.pool.events.copied(hb.group, hb.block_hash, HOST_MEDIUM)
                else:
                    self._free.extend(reversed(hb.units))
                if block.ref_cnt == 0:          # nobody took it back meanwhile: it is free now
                    if len(t.release) == 3:     # dropped at index i, below a fork / the prompt's end
                        j, fork, end = t.release
                        self.pool.free.add_dropped([block], j, (j,) if fork else (), (j,) if end else ())
                    else:
                        released.append((block, t.release[0]))
                continue
            rid = t.request.request_id
            entry = self.loading.get(rid)
            mine = entry is not None and entry[0] is t.request
            if mine:
                entry[1].discard(i)
            if ok and block.ref_cnt:
                bs, j = self.coordinator.groups[hb.group].block_size, t.release
                parent = t.request.block_hashes(bs, j)[j - 1] if j else None
                tokens = t.request.all_token_ids[j * bs:(j + 1) * bs] if self.pool.events is not None else None
                self.pool.cache(block, hb.group, hb.block_hash, parent, j, token_ids=tokens)
            if not ok and mine and all(r is not t.request for r in lost):
                lost.append(t.request)
            if not ok and hb.valid:
                self._forget(hb)                # its host memory may be gone (a worker restart)
            elif not hb.valid and not hb.pins:  # forgotten while this copy read it: its units go now
                self._free.extend(reversed(hb.units))
            if mine and not entry[1] and entry[0] not in lost:
                del self.loading[rid]
            if block.ref_cnt == 0:
                self.pool.free.add_released([(block, False)], False)
        if released:
            self.pool.free.add_released(released, False)
        return lost

    def forget_request(self, request_id: str) -> None:
        """The request released its blocks (finished, preempted): it waits on nothing; its targets stay
        pinned until their copies report."""
        self.loading.pop(request_id, None)

    def clear(self) -> None:
        """The prefix cache was reset: every host copy is invalid (no copy is in flight then)."""
        for hb in list(self._lru.values()):
            self._forget(hb)

    @property
    def num_pinned_units(self) -> int:
        """Device units out of the free queue until a copy is fenced (a store's source, or a load's target
        its request released)."""
        return sum(len(t.block.units) for t in self._inflight.values() if t.block.ref_cnt == 0)

    @property
    def num_free_units(self) -> int:
        return len(self._free)
