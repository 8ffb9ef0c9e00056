"""The host-memory tier (``kvmanager/host_tier.py``), as a specification: what is stored and when, what a
hit across both tiers loads (the window only), the fences (no reuse with a copy in flight, no compute with
a load pending, a failed load recomputes), and a state machine with copies completing late, out of order
or never, checking the accounting of every device and host unit after every step.

Every figure is worked out by hand in the test from BRIEF §2's rules (block size 1, window 3: a hit at
``h`` needs the sliding group's blocks ``h-2, h-1``; full attention all ``0 .. h-1``)."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvmanager import (NULL_BLOCK_ID, ChunkedLocalAttention, FullAttention, KVCacheManager, Request,
                       SlidingWindow)
from kvmanager.host_tier import HostRef
from drivers import run_step

FULL, SLIDING = 0, 1
A = list(range(1, 9))                      # 8 tokens


def hybrid(num_blocks=21, host=40, speculative=False):
    """Full attention + sliding window 3, block 1: 20 device units, ``host`` host units. No last-message
    class (``last_message_tokens=0``): a resend's hit ends at the prompt end only. Without ``speculative``
    only what a known hit needs is stored (the rules under test)."""
    return KVCacheManager([FullAttention(1), SlidingWindow(1, window=3)], num_blocks=num_blocks,
                          num_host_blocks=host, last_message_tokens=0, host_speculative_stores=speculative)


def units_accounted(mgr, running):
    """Every device unit is in exactly one place: a running request's table, the free queue, or pinned
    by a copy in flight; every host unit is free or in exactly one host block."""
    pool, tier = mgr.pool, mgr.host_tier
    where = Counter()
    held = Counter()
    for req in running:
        for table in mgr.get_block_ids(req.request_id):
            held.update(b for b in table if b != NULL_BLOCK_ID)
    for bid in held:
        where.update(pool.blocks[bid].units)
        assert pool.blocks[bid].ref_cnt == held[bid]
    for e in pool.free.entries():
        assert e.ref_cnt == 0 and not e.pinned
        where.update(e.units)
    pinned = {t.block.block_id for t in tier.in_flight().values()}
    assert pinned == {b.block_id for b in pool.blocks if b.pinned}
    for bid in pinned - set(held):
        where.update(pool.blocks[bid].units)
    assert sorted(where) == list(range(1, mgr.num_blocks)) and set(where.values()) == {1}
    host = Counter(tier._free)
    for hb in {id(hb): hb for hb in list(tier._lru.values()) + list(tier._writing.values())
               + [t.host for t in tier.in_flight().values()]}.values():
        if hb.valid or hb.pins:
            host.update(hb.units)
    assert sorted(host) == list(range(tier.num_units)) and set(host.values()) <= {1}


def prefill_and_free(mgr, rid, tokens):
    req = Request(rid, tokens)
    run_step(mgr, req, len(tokens))
    mgr.free(req)
    return req


def store_ids(t):
    return [d for _, d, _ in t.stores]


def test_release_stores_full_blocks_and_only_the_windows_a_hit_can_need():
    mgr = hybrid(host=11)
    a = prefill_and_free(mgr, "a", A)
    t = mgr.take_transfers()
    # full: blocks 0..7. sliding: a follow-up's hit at 8 needs 6, 7; a resend's at 7 (the last prompt
    # token is recomputed) needs 5, 6: {5, 6, 7}
    assert Counter(g for g, _, _ in t.stores) == {FULL: 8, SLIDING: 3}
    stored = {(g, mgr.pool.blocks[d].block_hash) for g, d, _ in t.stores}
    assert stored == {(FULL, x) for x in a.block_hashes(1)} | {(SLIDING, x) for x in a.block_hashes(1)[5:8]}
    assert not t.loads
    assert mgr.num_free_blocks == 20 - 11          # the 11 sources wait, pinned, for their copies
    units_accounted(mgr, [])
    mgr.transfers_done(store_ids(t))
    assert mgr.num_free_blocks == 20
    units_accounted(mgr, [])


def test_by_default_blocks_no_known_hit_needs_go_only_into_free_host_memory_and_first_out():
    # hybrid()'s layout with the manager's default stores (speculative ones on)
    mgr = KVCacheManager([FullAttention(1), SlidingWindow(1, window=3)], num_blocks=21, num_host_blocks=24,
                         last_message_tokens=0)
    a = prefill_and_free(mgr, "a", A)
    t = mgr.take_transfers()
    # the 11 a hit needs, then sliding 0..4 (below no known hit end) into the 13 free units
    assert Counter(g for g, _, _ in t.stores) == {FULL: 8, SLIDING: 8}
    mgr.transfers_done(store_ids(t))
    assert list(mgr.host_tier._lru)[:5] == [(SLIDING, x) for x in a.block_hashes(1)[:5]]
    prefill_and_free(mgr, "b", list(range(100, 110)))
    t = mgr.take_transfers()
    # b needs 13 (full 0..9, sliding 7..9): 8 free units, then a's 5 speculative ones go; b's other
    # sliding blocks find no free unit and are not stored
    assert Counter(g for g, _, _ in t.stores) == {FULL: 10, SLIDING: 3}
    on_host = mgr.host_tier.entries
    assert [x in on_host[SLIDING] for x in a.block_hashes(1)] == [False] * 5 + [True] * 3
    assert all(x in on_host[FULL] for x in a.block_hashes(1))
    mgr.transfers_done(store_ids(t))
    units_accounted(mgr, [])


def test_hit_from_host_after_the_device_copy_is_gone_loads_the_window_only():
    mgr = hybrid(host=24)
    a = prefill_and_free(mgr, "a", A)
    mgr.transfers_done(store_ids(mgr.take_transfers()))
    prefill_and_free(mgr, "b", list(range(100, 110)))   # 10 tokens x 2 groups: every device unit reused
    mgr.transfers_done(store_ids(mgr.take_transfers()))
    assert not any(mgr.pool.is_cached(g, x) for g in (FULL, SLIDING) for x in a.block_hashes(1))
    c = Request("c", A + [9])
    hit, h = mgr.get_computed_blocks(c)
    assert h == 8
    assert all(type(b) is HostRef for b in hit[FULL]) and len(hit[FULL]) == 8
    assert [b.block_id for b in hit[SLIDING][:6]] == [NULL_BLOCK_ID] * 6
    assert all(type(b) is HostRef for b in hit[SLIDING][6:]) and len(hit[SLIDING]) == 8
    with pytest.raises(ValueError, match="allocated alone"):     # its new token's block would be cached
        mgr.allocate_slots(c, 1, num_new_computed_tokens=8, new_computed_blocks=hit)   # before computed
    new = mgr.allocate_slots(c, 0, num_new_computed_tokens=8, new_computed_blocks=hit)
    c.num_computed_tokens += 8
    t = mgr.take_transfers()
    assert Counter(g for g, _, _ in t.loads) == {FULL: 8, SLIDING: 2}          # 10 blocks, not 16
    assert not t.stores
    table = mgr.get_block_ids("c")
    assert [d for g, _, d in t.loads if g == FULL] == table[FULL][:8] == new[FULL][:8]
    assert [d for g, _, d in t.loads if g == SLIDING] == table[SLIDING][6:8]
    assert mgr.is_loading("c") and mgr.requests_loading == {"c"}
    units_accounted(mgr, [c])
    mgr.transfers_done([d for _, _, d in t.loads])
    assert not mgr.is_loading("c")
    # the loaded blocks are device hits again
    assert all(mgr.pool.is_cached(FULL, x) for x in a.block_hashes(1))
    assert all(mgr.pool.is_cached(SLIDING, x) for x in a.block_hashes(1)[6:8])
    units_accounted(mgr, [c])


def test_a_hit_with_loads_that_does_not_fit_changes_nothing_and_can_be_offered_again():
    mgr = hybrid(host=24)
    prefill_and_free(mgr, "a", A)
    mgr.transfers_done(store_ids(mgr.take_transfers()))
    b = Request("b", list(range(100, 110)))
    run_step(mgr, b, 10)                                   # b holds all 20 units
    c = Request("c", A + [9])
    hit, h = mgr.get_computed_blocks(c)
    assert h == 8
    assert mgr.allocate_slots(c, 0, num_new_computed_tokens=h, new_computed_blocks=hit) is None
    assert not mgr.take_transfers() and not mgr.is_loading("c") and mgr.num_free_blocks == 0
    mgr.preempt(b)                                         # preempted: stores nothing, frees all 20
    assert not mgr.take_transfers() and mgr.num_free_blocks == 20
    assert mgr.allocate_slots(c, 0, num_new_computed_tokens=h, new_computed_blocks=hit) is not None
    assert len(mgr.take_transfers().loads) == 10
    assert mgr.num_free_blocks == 10
    units_accounted(mgr, [c])


def test_hybrid_hit_agreed_across_groups_mixes_device_and_host_blocks():
    mgr = hybrid(host=24)      # b's stores push a's speculative sliding 0..4 out (see above)
    prefill_and_free(mgr, "a", A)
    mgr.transfers_done(store_ids(mgr.take_transfers()))
    prefill_and_free(mgr, "b", list(range(100, 110)))
    mgr.transfers_done(store_ids(mgr.take_transfers()))
    # r: A's first 5 tokens. Host has full 0..7 but sliding only 5..7: at h <= 5 the sliding group would
    # need block h-1 <= 4 (not stored): no hit, r computes 0..4 on device and keeps them.
    r = Request("r", A[:5] + [77])
    assert mgr.get_computed_blocks(r)[1] == 0
    run_step(mgr, r, 6)
    c = Request("c", A + [9])
    hit, h = mgr.get_computed_blocks(c)
    assert h == 8
    r_full = mgr.get_block_ids("r")[FULL]
    assert [b.block_id for b in hit[FULL][:5]] == r_full[:5]             # on device, shared with r
    assert all(type(b) is HostRef for b in hit[FULL][5:])                  # 5, 6, 7 from host
    assert all(type(b) is HostRef for b in hit[SLIDING][6:])               # 6, 7 from host
    mgr.allocate_slots(c, 0, num_new_computed_tokens=8, new_computed_blocks=hit)
    t = mgr.take_transfers()
    assert sorted((g, mgr.get_block_ids("c")[g].index(d)) for g, _, d in t.loads) == [
        (FULL, 5), (FULL, 6), (FULL, 7), (SLIDING, 6), (SLIDING, 7)]
    units_accounted(mgr, [r, c])


def test_a_block_with_a_store_in_flight_is_not_reused_until_fenced():
    mgr = hybrid(host=11)
    prefill_and_free(mgr, "a", A)
    t = mgr.take_transfers()
    pinned = set(store_ids(t))
    assert len(pinned) == 11 and mgr.num_free_blocks == 9
    assert not pinned & set(mgr.pool.free.ids())
    big = Request("big", list(range(200, 205)))          # 5 tokens x 2 groups = 10 units > 9 free
    assert mgr.allocate_slots(big, 5) is None
    fits = Request("fits", list(range(300, 304)))        # 8 units: taken from the 9 unpinned ones
    new = mgr.allocate_slots(fits, 4)
    assert not pinned & set(new[FULL] + new[SLIDING])
    units_accounted(mgr, [fits])
    mgr.transfers_done(store_ids(t)[:4])                   # out of order, partly: those 4 are free again
    assert mgr.num_free_blocks == 1 + 4
    assert mgr.allocate_slots(big, 5) is None and mgr.num_free_blocks == 5
    mgr.transfers_done(store_ids(t)[4:])
    assert mgr.allocate_slots(big, 5) is not None
    units_accounted(mgr, [fits, big])


def test_a_hit_on_a_block_being_stored_shares_it_and_the_fence_frees_it_once():
    mgr = hybrid(host=13)
    a = prefill_and_free(mgr, "a", A)
    t = mgr.take_transfers()
    c = Request("c", A + [9])
    hit, h = mgr.get_computed_blocks(c)                    # on device still (pinned): no load
    assert h == 8 and not any(type(b) is HostRef for g in hit for b in g)
    assert mgr.allocate_slots(c, 1, num_new_computed_tokens=8, new_computed_blocks=hit) is not None
    assert not mgr.take_transfers()
    assert mgr.num_free_blocks == 20 - 11 - 2              # 11 pinned (c shares 10 of them), 2 new
    mgr.transfers_done(store_ids(t))     # c's 10 stay held; sliding block 5 (held by none) is free now
    assert mgr.num_free_blocks == 20 - 12                  # c: full 0..8, sliding 6, 7, 8
    c.num_computed_tokens = 9
    mgr.free(c)     # 0..7 are on host already: only block 8 (full; sliding, in both windows) goes
    t = mgr.take_transfers()
    assert sorted((g, mgr.pool.blocks[d].block_hash) for g, d, _ in t.stores) == sorted(
        [(FULL, c.block_hashes(1)[8]), (SLIDING, c.block_hashes(1)[8])])
    assert mgr.num_free_blocks == 18
    mgr.transfers_done(store_ids(t))
    assert mgr.num_free_blocks == 20
    assert a.block_hashes(1)[0] in mgr.host_tier.entries[FULL]
    units_accounted(mgr, [])


def c_hits_a_from_host() -> tuple:
    """A's blocks stored, then pushed off the device by b's; c (a's prompt and one more token) gets its hit
    allocated from the host: (manager, a, c)."""
    mgr = hybrid(host=24)
    a = prefill_and_free(mgr, "a", A)
    mgr.transfers_done(store_ids(mgr.take_transfers()))
    prefill_and_free(mgr, "b", list(range(100, 110)))
    mgr.transfers_done(store_ids(mgr.take_transfers()))
    c = Request("c", A + [9])
    hit, h = mgr.get_computed_blocks(c)
    mgr.allocate_slots(c, 0, num_new_computed_tokens=h, new_computed_blocks=hit)
    return mgr, a, c


def test_pending_loads_keep_the_request_from_computing_and_complete_out_of_order():
    mgr, _, c = c_hits_a_from_host()
    loads = [d for _, _, d in mgr.take_transfers().loads]
    assert len(loads) == 10
    for d in reversed(loads[1:]):
        mgr.transfers_done([d])
        assert mgr.is_loading("c")
    mgr.transfers_done([loads[0]])
    assert not mgr.is_loading("c") and mgr.requests_loading == frozenset()


def test_a_failed_load_preempts_the_request_which_recomputes_and_nothing_is_lost():
    mgr, a, c = c_hits_a_from_host()
    c.num_computed_tokens = 8
    t = mgr.take_transfers()
    first_full = t.loads[0][2]
    assert mgr.transfers_done(failed=[first_full]) == ["c"]
    assert c.num_computed_tokens == 0 and not mgr.is_loading("c")
    with pytest.raises(KeyError):
        mgr.get_block_ids("c")
    # the other 9 targets are still being written: pinned, not free, until their copies report
    assert mgr.num_free_blocks == 20 - 9 and mgr.host_tier.num_pinned_units == 9
    units_accounted(mgr, [])
    rest = [d for _, _, d in t.loads if d != first_full]
    mgr.transfers_done(rest[:4], failed=rest[4:])
    assert mgr.num_free_blocks == 20
    units_accounted(mgr, [])
    # the failed host copies are forgotten: block 0 (full) went first, so nothing hits from host now
    assert a.block_hashes(1)[0] not in mgr.host_tier.entries[FULL]
    hit, h = mgr.get_computed_blocks(c)
    assert h == 0
    run_step(mgr, c, 9)                                      # recompute: the request is served
    units_accounted(mgr, [c])


def test_losing_the_host_memory_fails_every_copy_and_forgets_every_host_block():
    mgr = hybrid(host=24)
    prefill_and_free(mgr, "a", A)
    mgr.transfers_done(store_ids(mgr.take_transfers()))
    prefill_and_free(mgr, "b", list(range(100, 110)))       # 3 of b's 13 stores stay in flight
    mgr.transfers_done(store_ids(mgr.take_transfers())[3:])
    c = Request("c", A + [9])
    hit, h = mgr.get_computed_blocks(c)
    assert h == 8
    assert mgr.allocate_slots(c, 0, num_new_computed_tokens=h, new_computed_blocks=hit) is not None
    assert len(mgr.take_transfers().loads) == 10             # and 10 loads in flight
    assert mgr.host_tier_lost() == ["c"]
    assert mgr.num_free_blocks == 20 and mgr.host_tier.num_free_units == 24
    assert mgr.host_tier.entries == [{}, {}] and not mgr.host_tier.in_flight()
    assert mgr.get_computed_blocks(c)[1] == 0
    units_accounted(mgr, [])


def test_transfers_done_rejects_unknown_or_repeated_ids_before_any_change():
    mgr = hybrid(host=11)
    prefill_and_free(mgr, "a", A)
    ids = store_ids(mgr.take_transfers())
    with pytest.raises(ValueError, match="one copy in flight"):
        mgr.transfers_done([ids[0], 999])
    with pytest.raises(ValueError, match="one copy in flight"):
        mgr.transfers_done([ids[0]], failed=[ids[0]])
    assert mgr.num_free_blocks == 9                          # nothing was fenced
    mgr.transfers_done(ids)
    with pytest.raises(ValueError, match="one copy in flight"):
        mgr.transfers_done([ids[0]])                         # already fenced
    assert KVCacheManager([FullAttention(1)], 8).take_transfers().stores == []
    with pytest.raises(ValueError, match="num_host_blocks"):
        KVCacheManager([FullAttention(1)], 8, num_host_blocks=-1)


def test_host_eviction_is_lru():
    # full attention only, host of 4 units: a (4 blocks) fills it; d's 2 evict a's 2 least recently used.
    # A release goes tail first, so a's blocks were stored 3, 2, 1, 0: 3 and 2 go (the chain's head stays)
    mgr = KVCacheManager([FullAttention(1)], num_blocks=9, num_host_blocks=4, last_message_tokens=0)
    a = prefill_and_free(mgr, "a", [1, 2, 3, 4])
    mgr.transfers_done(store_ids(mgr.take_transfers()))
    prefill_and_free(mgr, "d", [5, 6])
    t = mgr.take_transfers()
    mgr.transfers_done(store_ids(t))
    on_host = mgr.host_tier.entries[0]
    assert [x in on_host for x in a.block_hashes(1)] == [True, True, False, False]
    assert mgr.host_tier.num_free_units == 0


def test_reset_prefix_cache_is_refused_with_a_copy_in_flight_and_clears_the_host_after():
    mgr = hybrid()
    prefill_and_free(mgr, "a", A)
    ids = store_ids(mgr.take_transfers())
    assert mgr.reset_prefix_cache() is False
    mgr.transfers_done(ids)
    assert mgr.reset_prefix_cache() is True
    assert mgr.host_tier.entries == [{}, {}] and mgr.host_tier.num_free_units == 40


# ---------------------------------------------------------------------------------------------------------
# State machine: random traces, copies completing late, out of order, or never (then failed)
# ---------------------------------------------------------------------------------------------------------
STEMS = [[(s * 13 + i * 5) % 11 + 1 for i in range(30)] for s in range(3)]
B = 2


class HostTierMachine(RuleBasedStateMachine):
    """A simulated worker executes each copy when it completes: a store copies the device block's content
    to host then (so a source reused before its fence would copy the wrong content), a load writes the
    host content into the device block then. Computing a request writes its new blocks' content."""

    def __init__(self):
        super().__init__()
        self.mgr = None

    @initialize(window=st.integers(1, 7), num_blocks=st.integers(10, 24), host=st.integers(3, 40),
                full=st.booleans(), chunked=st.booleans(), widths=st.lists(st.integers(1, 3), min_size=2, max_size=2),
                speculative=st.booleans())
    def setup(self, window, num_blocks, host, full, chunked, widths, speculative):
        local = ChunkedLocalAttention(B, chunk_size=window + 1) if chunked else SlidingWindow(B, window=window)
        specs = ([FullAttention(B)] if full else []) + [local]
        widths = tuple(widths[:len(specs)])
        num_blocks = max(num_blocks, 3 * sum(widths) + 1)
        self.mgr = KVCacheManager(specs, num_blocks=num_blocks, num_host_blocks=host, max_model_len=40,
                                  widths=widths, host_speculative_stores=speculative)
        self.specs = specs
        self.count = 0
        self.running: dict[str, Request] = {}
        self.device: dict[int, tuple] = {}     # block id -> (group, prefix of tokens) it holds
        self.host: dict[int, tuple] = {}       # host unit -> content (a width-k block: k units, one content)
        self.copies: dict[int, tuple] = {}     # device id -> (kind, group, host units, content expected)

    def collect(self):
        t = self.mgr.take_transfers()
        for g, d, units in t.stores:
            assert d not in self.copies
            self.copies[d] = ("store", g, units, self.device[d])
        for g, units, d in t.loads:
            assert d not in self.copies
            self.copies[d] = ("load", g, units, self.read_host(units))   # what it must read at completion

    def read_host(self, units):
        contents = {self.host.get(u) for u in units}
        assert len(contents) == 1, "a host block's units hold different contents"
        return contents.pop()

    def write(self, req, new_from):
        """The request's step computed its blocks from ``new_from`` (token index) on."""
        for g, (spec, table) in enumerate(zip(self.specs, self.mgr.get_block_ids(req.request_id))):
            for j, bid in enumerate(table):
                if bid != NULL_BLOCK_ID and (j + 1) * B > new_from:
                    assert bid not in self.copies, "a block with a copy in flight was written"
                    self.device[bid] = (g, tuple(req.all_token_ids[:(j + 1) * B]))

    @rule(stem=st.integers(0, 2), length=st.integers(2, 20), tail=st.lists(st.integers(20, 22), max_size=2))
    def admit(self, stem, length, tail):
        req = Request(f"r{self.count}", STEMS[stem][:length] + tail)
        self.count += 1
        hit, h = self.mgr.get_computed_blocks(req)
        n = 0 if any(type(b) is HostRef for g in hit for b in g) else req.num_tokens - h   # loads: hit alone
        if self.mgr.allocate_slots(req, n, num_new_computed_tokens=h, new_computed_blocks=hit if h else None) is None:
            return
        self.collect()
        for g, table in enumerate(self.mgr.get_block_ids(req.request_id)):
            for j, bid in enumerate(table[:h // B]):     # the hit's blocks hold this prefix (or will)
                if bid != NULL_BLOCK_ID and bid not in self.copies:
                    assert self.device[bid] == (g, tuple(req.all_token_ids[:(j + 1) * B]))
        self.running[req.request_id] = req
        if self.mgr.is_loading(req.request_id):
            req.num_computed_tokens = h      # it computes the rest once its loads are fenced
            return
        self.write(req, h)
        req.num_computed_tokens += h + n

    @rule(length=st.integers(4, 24))
    def churn(self, length):
        """A one-off request (tokens no other shares) passes through: it pushes cached blocks off the device."""
        req = Request(f"x{self.count}", [100 + self.count] * length)
        self.count += 1
        if self.mgr.allocate_slots(req, length) is not None:
            self.collect()
            self.write(req, 0)
            req.num_computed_tokens = length
            self.mgr.preempt(req)        # preempted: stores nothing, its blocks wait as proven ones

    @rule(idx=st.integers(0, 99), token=st.integers(0, 3))
    def decode(self, idx, token):
        ready = sorted(r for r in self.running if not self.mgr.is_loading(r))
        if not ready:
            return
        req = self.running[ready[idx % len(ready)]]
        if req.num_tokens >= 40:
            return
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids([token])
        n = req.num_tokens - req.num_computed_tokens
        if self.mgr.allocate_slots(req, n) is None:
            return
        self.collect()
        self.write(req, req.num_computed_tokens)
        req.num_computed_tokens += n

    @rule(idx=st.integers(0, 99), preempt=st.booleans())
    def release(self, idx, preempt):
        if not self.running:
            return
        req = self.running.pop(sorted(self.running)[idx % len(self.running)])
        (self.mgr.preempt if preempt else self.mgr.free)(req)
        self.collect()

    @rule(data=st.data())
    def complete(self, data):
        if not self.copies:
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.copies)), unique=True, max_size=12))
        fail = data.draw(st.lists(st.sampled_from([False, False, False, True]), min_size=len(ids), max_size=len(ids)))
        self.finish([i for i, f in zip(ids, fail) if not f], [i for i, f in zip(ids, fail) if f])

    def finish(self, done, failed):
        for d in done:
            kind, g, units, content = self.copies[d]
            if kind == "store":
                assert self.device[d] == content, "a store's source was overwritten before its fence"
                self.host.update((u, content) for u in units)
            else:
                assert self.read_host(units) == content, "a host block was overwritten while a load read it"
                self.device[d] = content
        for d in failed:
            if self.copies[d][0] == "load":
                self.device.pop(d, None)        # garbage: must never be read or hit
        for d in done + failed:
            del self.copies[d]
        lost = self.mgr.transfers_done(done, failed)
        for rid in lost:
            self.running.pop(rid, None)
        self.collect()

    @invariant()
    def accounting_is_exact(self):
        if self.mgr is None:
            return
        units_accounted(self.mgr, list(self.running.values()))
        assert set(self.copies) == set(self.mgr.host_tier.in_flight())
        for rid, req in self.running.items():      # every readable block holds the reader's prefix
            if self.mgr.is_loading(rid):
                continue
            for g, table in enumerate(self.mgr.get_block_ids(rid)):
                for j, bid in enumerate(table[:req.num_computed_tokens // B]):
                    if bid != NULL_BLOCK_ID:
                        assert self.device[bid] == (g, tuple(req.all_token_ids[:(j + 1) * B]))

    def teardown(self):
        if self.mgr is None:
            return
        self.finish([], sorted(self.copies))           # copies that never completed: failed
        for req in list(self.running.values()):
            self.mgr.free(req)
        self.running.clear()
        self.collect()
        assert all(c[0] == "store" for c in self.copies.values())
        self.finish(sorted(self.copies), [])
        assert not self.copies and not self.mgr.host_tier.in_flight()
        assert self.mgr.num_free_blocks == self.mgr.num_blocks - 1
        assert all(b.ref_cnt == 0 and not b.pinned for b in self.mgr.pool.blocks)
        units_accounted(self.mgr, [])


HostTierMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                             phases=[Phase.explicit, Phase.reuse, Phase.generate],
                                             suppress_health_check=[HealthCheck.too_slow])
TestHostTierMachine = HostTierMachine.TestCase
