"""Property tests: the longest hit against a brute-force oracle written from BRIEF §2, and a state machine
that drives a small pool through admissions, chunked prefill, decode, look-ahead, preemption, frees and
cache resets, checking the pool's accounting and the drop rule after every step and the content of every
prefix hit against a shadow record of what each block was filled with."""
from collections import Counter
from math import lcm

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvmanager import (NULL_BLOCK_ID, ChunkedLocalAttention, FullAttention, KVCacheManager, Request,
                       SlidingWindow)
from kvmanager.block_pool import BlockPool
from kvmanager.coordinator import GroupCoordinator

BLOCK_SIZES = st.sampled_from([1, 2, 4])
SPEC = st.one_of(
    st.builds(FullAttention, block_size=BLOCK_SIZES),
    st.builds(SlidingWindow, block_size=BLOCK_SIZES, window=st.integers(1, 9)),
    st.builds(ChunkedLocalAttention, block_size=BLOCK_SIZES, chunk_size=st.integers(1, 9)),
)
SPECS = st.lists(SPEC, min_size=1, max_size=3)
WIDTHS = st.lists(st.integers(1, 3), min_size=3, max_size=3)    # pool units per block, per group


# ---------------------------------------------------------------------------------------------------------
# The oracle, from BRIEF §2's wording
# ---------------------------------------------------------------------------------------------------------
def required_blocks(spec, h):
    """Blocks a hit of ``h`` tokens needs cached in this group."""
    b = spec.block_size
    end = h // b
    if isinstance(spec, SlidingWindow):
        last = -(-(spec.window - 1) // b)                  # the last ceil((W-1)/B) blocks before h ...
        return range(max(0, end - last), end)              # ... or all of them, if fewer
    if isinstance(spec, ChunkedLocalAttention):
        return range((h // spec.chunk_size) * spec.chunk_size // b, end)   # from (h//C)*C to h
    return range(0, end)                                   # full attention: 0 .. h/B - 1


def needed_from(spec, n):
    """First position the token at ``n`` reads (BRIEF §2's dropping paragraph)."""
    if isinstance(spec, SlidingWindow):
        return max(0, n - spec.window + 1)
    if isinstance(spec, ChunkedLocalAttention):
        return (n // spec.chunk_size) * spec.chunk_size
    return 0


def oracle_hit(specs, cached, num_tokens):
    """Largest h < num_tokens, a multiple of every block size, whose required blocks are all cached."""
    align = lcm(*(s.block_size for s in specs))
    for h in range((num_tokens - 1) // align * align, 0, -align):
        if all(set(required_blocks(s, h)) <= cached[g] for g, s in enumerate(specs)):
            return h
    return 0


def check_hit_table(spec, blocks, h, expected_id):
    """A group's hit: h/B entries, null where the hit needs nothing, the cached block elsewhere."""
    b = spec.block_size
    assert len(blocks) == h // b
    need = set(required_blocks(spec, h))
    for j, blk in enumerate(blocks):
        if j in need:
            assert blk.block_id != NULL_BLOCK_ID and blk.block_id == expected_id(j), (j, blk)
        else:
            assert blk.block_id == NULL_BLOCK_ID, (j, blk)


# ---------------------------------------------------------------------------------------------------------
# One group, the spec's search on a pattern
# ---------------------------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(spec=SPEC, pattern=st.lists(st.booleans(), max_size=30), data=st.data())
def test_spec_longest_hit_equals_oracle(spec, pattern, data):
    max_blocks = data.draw(st.integers(0, len(pattern)))
    cached = {i for i, c in enumerate(pattern) if c}
    b = spec.block_size
    # one group: the oracle over h <= max_blocks * B, so num_tokens = max_blocks * B + 1
    assert spec.longest_hit(lambda i: i in cached, max_blocks) * b == oracle_hit([spec], [cached],
                                                                                  max_blocks * b + 1)


# ---------------------------------------------------------------------------------------------------------
# Several groups, the coordinator over real cached blocks in a real pool
# ---------------------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(specs=SPECS, length=st.integers(1, 40), data=st.data())
def test_coordinator_find_hit_equals_oracle_on_real_cached_blocks(specs, length, data):
    req = Request("q", [(7 * i) % 11 for i in range(length)])
    pool = BlockPool(1 + sum(length // s.block_size for s in specs) + 1, len(specs))
    coord = GroupCoordinator(specs, pool, True)
    cached, where = [], []
    for g, spec in enumerate(specs):
        hashes = req.block_hashes(spec.block_size)
        pattern = data.draw(st.lists(st.booleans(), min_size=len(hashes), max_size=len(hashes)))
        ids = {}
        for j, c in enumerate(pattern):
            if c:                                 # fill a block, enter it into the group's cache, free it
                (blk,) = pool.take(1, g)
                pool.cache(blk, g, hashes[j])
                pool.free.add_released([(b, False) for b in pool.unref([blk])])
                ids[j] = blk.block_id
        cached.append(set(ids))
        where.append(ids)
    hit, h = coord.find_hit(req, length - 1)
    assert h == oracle_hit(specs, cached, length)
    assert h % lcm(*(s.block_size for s in specs)) == 0 and h < length
    for g, spec in enumerate(specs):
        check_hit_table(spec, hit[g], h, where[g].get)


# ---------------------------------------------------------------------------------------------------------
# Several groups, the manager: the pattern made by computing a prompt and evicting blocks through the pool
# ---------------------------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(specs=SPECS, length=st.integers(1, 32), data=st.data())
def test_manager_get_computed_blocks_equals_oracle_after_real_eviction(specs, length, data):
    prompt = [(5 * i + 3) % 7 for i in range(length)]
    held = sum(-(-length // s.block_size) for s in specs)
    # a pool the request fills exactly, so that the allocation below evicts exactly the chosen blocks
    mgr = KVCacheManager(specs, num_blocks=1 + held, max_model_len=1000)
    src = Request("src", prompt)
    assert mgr.allocate_slots(src, length) is not None            # one chunk: every full block cached
    tables = mgr.get_block_ids("src")
    mgr.free(src)
    cached, evict = [], []
    for g, spec in enumerate(specs):
        n_full = length // spec.block_size
        keep = data.draw(st.lists(st.booleans(), min_size=n_full, max_size=n_full))
        cached.append({j for j in range(n_full) if keep[j]})
        evict += [tables[g][j] for j in range(n_full) if not keep[j]]
    pool = mgr.pool
    for bid in evict:              # as if a running request had dropped them: below the finished chain ...
        pool.touch([pool.blocks[bid]])
        pool.blocks[bid].shared = False
        pool.free.add_dropped(pool.unref([pool.blocks[bid]]), 0, (), ())
    empty = sum(1 for b in pool.blocks[1:] if b.block_hash is None)   # partial blocks: they go first
    taken = pool.take(empty + len(evict), 0)            # ... where new blocks come from
    assert {b.block_id for b in taken} >= set(evict)
    q = Request("q", prompt)
    hit, h = mgr.get_computed_blocks(q)
    assert h == oracle_hit(specs, cached, length)
    assert h % lcm(*(s.block_size for s in specs)) == 0 and h < length
    for g, spec in enumerate(specs):
        check_hit_table(spec, hit[g], h, lambda j, g=g: tables[g][j])


# ---------------------------------------------------------------------------------------------------------
# The state machine
# ---------------------------------------------------------------------------------------------------------
MAX_LEN = 40
TEMPLATES = [[(k * 7 + i * 3) % 5 for i in range(MAX_LEN)] for k in range(3)]


def snapshot(mgr):
    pool = mgr.pool
    return (pool.free.ids(), [(b.ref_cnt, b.block_hash, b.group, b.kind, b.units) for b in pool.blocks],
            [{rid: [b.block_id for b in t] for rid, t in g.tables.items()} for g in mgr.coordinator.groups])


class KVMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.mgr = None

    @initialize(specs=SPECS, widths=WIDTHS, num_blocks=st.integers(12, 40))
    def setup(self, specs, widths, num_blocks):
        self.specs = specs
        self.widths = tuple(widths[:len(specs)])
        self.mgr = KVCacheManager(specs, num_blocks=num_blocks, max_model_len=MAX_LEN, widths=self.widths)
        self.members = [{} for _ in specs]   # what workers know: (group) block id -> units, from compositions
        self.align = lcm(*(s.block_size for s in specs))
        self.count = 0
        self.running = {}     # rid -> Request
        self.computed_at_alloc = {}   # rid -> tokens computed when its last allocation ran (the drop point)
        self.slots = {}       # rid -> slots its tables cover
        self.waiting = {}     # rid -> Request (new, refused or preempted)
        self.owner = {}       # block id -> (group, request, logical block) it was last filled for

    # -- helpers ---------------------------------------------------------------------------------------
    def pick(self, pool, idx):
        return pool[sorted(pool)[idx % len(pool)]]

    def allocate(self, req, num_new, lookahead, num_hit=0, hit=None):
        mgr, rid = self.mgr, req.request_id
        before_len = [len(t) for t in mgr.get_block_ids(rid)] if rid in self.running else [0] * len(self.specs)
        before = snapshot(mgr)
        out = mgr.allocate_slots(req, num_new, num_new_computed_tokens=num_hit, new_computed_blocks=hit,
                                 num_lookahead_tokens=lookahead)
        if out is None:
            assert snapshot(mgr) == before
            return False
        for g, block_id, units in mgr.pop_compositions():
            assert self.widths[g] > 1 and len(units) == self.widths[g] and units[0] == block_id
            self.members[g][block_id] = units
        for g, ids in enumerate(out):
            n_hit = len(hit[g]) if hit else 0
            if hit:
                assert ids[:n_hit] == [b.block_id for b in hit[g]]
            for k, bid in enumerate(ids[n_hit:]):
                assert bid != NULL_BLOCK_ID
                self.owner[bid] = (g, req, before_len[g] + n_hit + k)
        computed = req.num_computed_tokens + num_hit
        self.computed_at_alloc[rid] = computed
        self.slots[rid] = max(self.slots.get(rid, 0), min(computed + num_new + lookahead, MAX_LEN))
        req.num_computed_tokens = computed + num_new
        return True

    def start(self, req, chunk, lookahead):
        """Prefix lookup, checked against the oracle and the shadow, then the first allocation."""
        mgr = self.mgr
        hit, h = mgr.get_computed_blocks(req)
        assert h % self.align == 0 and 0 <= h < req.num_tokens
        cached = []
        for g, spec in enumerate(self.specs):
            hashes = req.block_hashes(spec.block_size)
            cached.append({j for j, x in enumerate(hashes) if mgr.pool.is_cached(g, x)})
        assert h == oracle_hit(self.specs, cached, req.num_tokens)
        for g, spec in enumerate(self.specs):
            b = spec.block_size
            assert len(hit[g]) == h // b
            for j, blk in enumerate(hit[g]):
                if blk.block_id == NULL_BLOCK_ID:
                    continue
                src_g, src, src_j = self.owner[blk.block_id]
                assert (src_g, src_j) == (g, j)
                assert src.all_token_ids[:(j + 1) * b] == req.all_token_ids[:(j + 1) * b]
        if self.allocate(req, min(chunk, req.num_tokens - h), lookahead, h, hit if h else None):
            del self.waiting[req.request_id]
            self.running[req.request_id] = req

    # -- rules -----------------------------------------------------------------------------------------
    @rule(template=st.integers(0, 2), length=st.integers(1, 24), suffix=st.lists(st.integers(5, 7), max_size=3),
          chunk=st.integers(1, 12), lookahead=st.integers(0, 3))
    def admit(self, template, length, suffix, chunk, lookahead):
        req = Request(f"r{self.count}", TEMPLATES[template][:length] + suffix)
        self.count += 1
        self.waiting[req.request_id] = req
        self.start(req, chunk, lookahead)

    @rule(idx=st.integers(0, 99), chunk=st.integers(1, 12), lookahead=st.integers(0, 3))
    def resume(self, idx, chunk, lookahead):
        if self.waiting:
            self.start(self.pick(self.waiting, idx), chunk, lookahead)

    def advance(self, req, chunk, token, lookahead):
        """One engine step for a running request: the next prefill chunk, or one decoded token."""
        if req.num_computed_tokens < req.num_tokens:
            self.allocate(req, min(chunk, req.num_tokens - req.num_computed_tokens), lookahead)
        elif req.num_tokens < MAX_LEN:
            req.append_output_token_ids([token])
            self.allocate(req, 1, lookahead)      # refused: the token waits, the next step retries it

    @rule(idx=st.integers(0, 99), chunk=st.integers(1, 12), token=st.integers(0, 4),
          lookahead=st.integers(0, 3))
    def step_one(self, idx, chunk, token, lookahead):
        if self.running:
            self.advance(self.pick(self.running, idx), chunk, token, lookahead)

    @rule(chunk=st.integers(1, 12), token=st.integers(0, 4), lookahead=st.integers(0, 3))
    def step_all(self, chunk, token, lookahead):
        for rid in sorted(self.running):
            self.advance(self.running[rid], chunk, token, lookahead)

    @rule(idx=st.integers(0, 99))
    def preempt(self, idx):
        if not self.running:
            return
        req = self.pick(self.running, idx)
        self.mgr.preempt(req)
        assert req.num_computed_tokens == 0
        rid = req.request_id
        del self.running[rid], self.computed_at_alloc[rid], self.slots[rid]
        self.waiting[rid] = req

    @rule(idx=st.integers(0, 99))
    def free(self, idx):
        if not self.running:
            return
        req = self.pick(self.running, idx)
        self.mgr.free(req)
        rid = req.request_id
        del self.running[rid], self.computed_at_alloc[rid], self.slots[rid]

    @rule()
    def reset_prefix_cache(self):
        before = snapshot(self.mgr)
        done = self.mgr.reset_prefix_cache()
        assert done is (not self.running)        # refused while any request holds blocks ...
        if done:
            assert all(b.block_hash is None for b in self.mgr.pool.blocks)
        else:
            assert snapshot(self.mgr) == before  # ... and then nothing changed

    # -- invariants ------------------------------------------------------------------------------------
    @invariant()
    def pool_accounting_is_exact(self):
        if self.mgr is None:
            return
        mgr, pool = self.mgr, self.mgr.pool
        held = Counter()
        for rid in self.running:
            for table in mgr.get_block_ids(rid):
                held.update(b for b in table if b != NULL_BLOCK_ID)
        free = pool.free.ids()
        assert len(free) == len(set(free)) and NULL_BLOCK_ID not in free
        free = set(free)
        for bid in range(1, mgr.num_blocks):
            ref = pool.blocks[bid].ref_cnt
            assert ref == held[bid], (bid, ref, held[bid])
            assert not (ref and bid in free), (bid, ref)     # unheld units are free or inside held composites
        per_group = [set() for _ in self.specs]
        for rid in self.running:
            for g, table in enumerate(mgr.get_block_ids(rid)):
                per_group[g].update(b for b in table if b != NULL_BLOCK_ID)
        assert mgr.blocks_held_per_group() == [len(ids) for ids in per_group]
        # Every unit lies in exactly one place: a held block (as the workers were told) or a free entry.
        where = Counter()
        for g, ids in enumerate(per_group):
            for bid in ids:
                units = self.members[g][bid] if self.widths[g] > 1 else (bid,)
                assert pool.blocks[bid].units == units
                where.update(units)
        for entry in pool.free.entries():
            assert entry.ref_cnt == 0
            where.update(entry.units)
        assert sorted(where) == list(range(1, mgr.num_blocks)) and set(where.values()) == {1}
        held_units = sum(len(ids) * w for ids, w in zip(per_group, self.widths))
        assert mgr.num_free_blocks == mgr.num_blocks - 1 - held_units
        for rid in self.waiting:
            assert rid not in self.running

    @invariant()
    def every_held_block_holds_its_readers_tokens(self):
        """A block serves one group at one position, filled with the same prefix every holder has."""
        if self.mgr is None:
            return
        for req in self.running.values():
            for g, (spec, table) in enumerate(zip(self.specs, self.mgr.get_block_ids(req.request_id))):
                for j, bid in enumerate(table):
                    if bid == NULL_BLOCK_ID:
                        continue
                    src_g, src, src_j = self.owner[bid]
                    assert (src_g, src_j) == (g, j), (req, g, j, bid, self.owner[bid])
                    end = min((j + 1) * spec.block_size, req.num_computed_tokens, src.num_tokens)
                    assert src.all_token_ids[:end] == req.all_token_ids[:end]

    @invariant()
    def tables_follow_the_drop_rule(self):
        if self.mgr is None:
            return
        for rid, req in self.running.items():
            n = self.computed_at_alloc[rid]
            for spec, table in zip(self.specs, self.mgr.get_block_ids(rid)):
                b = spec.block_size
                assert len(table) == -(-self.slots[rid] // b)
                first = needed_from(spec, n) // b
                assert all(x == NULL_BLOCK_ID for x in table[:first]), (spec, n, table)
                assert all(x != NULL_BLOCK_ID for x in table[first:]), (spec, n, table)

    def teardown(self):
        if self.mgr is None:
            return
        for req in self.running.values():
            self.mgr.free(req)
        # freeing everything gives every block back
        assert self.mgr.num_free_blocks == self.mgr.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in self.mgr.pool.blocks[1:])


# No shrink phase: a failing run of at most 50 steps reads well enough, and shrinking one takes minutes.
KVMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                       phases=[Phase.explicit, Phase.reuse, Phase.generate],
                                       suppress_health_check=[HealthCheck.too_slow])
TestKVMachine = KVMachine.TestCase
