"""Groups wider than one pool unit: a block is a composite of k units, named by its first unit.

Figures are traced by hand from the free queue (kvmanager/free_queue.py): units 1.. start loose, in id
order, in the empty tier; free entries wait in tiers (empty, unreachable, speculative, reusable) and a
block of a width-k kind comes from the lowest tier that can serve it: there it reuses the front free
composite of its kind unless k loose units wait in front of it, else composes k loose units (the lower
tiers' first), else dissolves the frontmost composites of another kind; finished tables join the reusable
tier tail first, dropped blocks the unreachable tier, leftover units the front of the empty tier.
"""
import msgpack
import pytest

from workers.wire import decode_step, encode_step
from kvmanager import FullAttention, KVCacheManager, Request, SlidingWindow
from kvmanager.block_pool import BlockPool
from kvmanager.planning import kv_layout
from workers.sim.presets import layer_specs
from workers.protocol import StepInput

from drivers import decode, ids, run_step


def test_freed_composites_are_reused_whole_by_their_kind_and_hit_whole():
    mgr = KVCacheManager([FullAttention(block_size=1)], num_blocks=10, widths=(3,))    # units 1..9
    a = Request("a", [1, 2])
    assert run_step(mgr, a, 2) == ([1, 4],)
    assert mgr.pop_compositions() == [(0, 1, (1, 2, 3)), (0, 4, (4, 5, 6))]
    assert (mgr.num_free_blocks, mgr.blocks_held_per_group()) == (3, [2])        # units 7, 8, 9 loose
    mgr.free(a)                                   # composites 4, 1 join the back, behind loose 7, 8, 9
    assert mgr.num_free_blocks == 9

    b = Request("b", [1, 2, 3])
    hit, h = mgr.get_computed_blocks(b)
    assert (ids(hit), h) == ([[1, 4]], 2)         # one id per cached block, whatever its width
    # the hit revives 1 and 4 whole; the new block takes the 3 loose units in front
    assert mgr.allocate_slots(b, 1, num_new_computed_tokens=2, new_computed_blocks=hit) == ([1, 4, 7],)
    assert mgr.pop_compositions() == [(0, 7, (7, 8, 9))]
    b.num_computed_tokens = 3
    mgr.free(b)                                   # queue of composites: 7, 4, 1; nothing loose

    assert run_step(mgr, Request("c", [5]), 1) == ([7],)     # reused as is: no composition
    assert mgr.pop_compositions() == []
    hit, h = mgr.get_computed_blocks(Request("d", [1, 2, 3, 4]))
    assert (ids(hit), h) == ([[1, 4]], 2)         # block 2 (composite 7) was evicted, blocks 0-1 kept


def test_another_kind_dissolves_a_free_composite_and_accounting_stays_in_units():
    mgr = KVCacheManager([FullAttention(block_size=1), SlidingWindow(block_size=1, window=1)], num_blocks=8,
                         widths=(1, 2), last_message_tokens=0)     # units 1..7; tiers of the prompt end alone
    a = Request("a", [1, 2])
    assert run_step(mgr, a, 2) == ([1, 2], [3, 5])
    assert mgr.pop_compositions() == [(1, 3, (3, 4)), (1, 5, (5, 6))]
    assert mgr.num_free_blocks == 1                                                       # unit 7
    # n=2: the window (W=1) drops composites 3, 5, in that order, to the unreachable tier; full takes
    # loose 7 (the empty tier), sliding reuses its front composite 3
    assert decode(mgr, a, 3) == ([7], [3])
    assert mgr.pop_compositions() == []
    hashes = a.block_hashes(1)
    # sliding cache: composite 5 still holds block 1; 3 forgot block 0 and holds block 2 (full, known)
    assert {b.block_id: b.block_hash for b in mgr.pool.blocks if b.group == 1} == {3: hashes[2], 5: hashes[1]}
    # n=3: the window drops composite 3 (unreachable, behind 5); full needs a unit, none is loose:
    # composite 5 is dissolved, unit 5 serves full attention, unit 6 waits loose in the empty tier; sliding
    # finds one unit there, fewer than 2, and reuses composite 3
    assert decode(mgr, a, 4) == ([5], [3])
    assert mgr.pop_compositions() == []           # width-1 blocks are units: nothing to tell workers
    assert mgr.get_block_ids("a") == ([1, 2, 7, 5], [0, 0, 0, 3])
    assert {b.block_id: b.block_hash for b in mgr.pool.blocks if b.group == 1} == {3: hashes[3]}
    assert mgr.blocks_held_per_group() == [4, 1]
    assert mgr.num_free_blocks == 1 and mgr.usage == pytest.approx(6 / 7)     # 4 x 1 + 1 x 2 units held
    # one unit free: a new request needs 1 + 2: refused, nothing changes
    before = (mgr.pool.free.ids(), mgr.get_block_ids("a"))
    assert mgr.allocate_slots(Request("b", [9]), 1) is None
    assert (mgr.pool.free.ids(), mgr.get_block_ids("a")) == before

    mgr.free(a)          # loose at the back, tail first: 5, 7, 2, 1; then composite 3
    assert mgr.pool.free.ids() == [6, 5, 7, 2, 1, 3] and mgr.num_free_blocks == 7
    # full takes loose 6; sliding: the loose units 5, 7 wait in front of composite 3: composed, 3 kept
    assert run_step(mgr, Request("b", [9]), 1) == ([6], [5])
    assert mgr.pop_compositions() == [(1, 5, (5, 7))]
    assert mgr.pool.free.ids() == [2, 1, 3]


def test_a_wide_kind_composes_loose_units_in_front_else_reuses_its_own_else_dissolves_another_kind():
    mgr = KVCacheManager([SlidingWindow(block_size=1, window=1), FullAttention(block_size=1)], num_blocks=13,
                         widths=(3, 2))                                                   # units 1..12
    x, y = Request("x", [1]), Request("y", [2])
    assert run_step(mgr, x, 1) == ([1], [4])
    assert run_step(mgr, y, 1) == ([6], [9])
    assert mgr.pop_compositions() == [(0, 1, (1, 2, 3)), (1, 4, (4, 5)), (0, 6, (6, 7, 8)), (1, 9, (9, 10))]
    mgr.free(x)                                   # loose 11, 12, then composites 1 (sliding), 4 (full)
    assert mgr.pool.free.ids() == [11, 12, 1, 4]
    # n=1: y's sliding composite 6 drops to the front and is reused; for full, two loose units wait in
    # front of composite 4 (x's cached block): they are composed and 4 is kept
    assert decode(mgr, y, 3) == ([6], [11])
    assert mgr.pop_compositions() == [(1, 11, (11, 12))]
    # n=2: nothing loose: full reuses its own composite 4 as is
    assert decode(mgr, y, 4) == ([6], [4])
    assert mgr.pop_compositions() == []
    # n=3: no free full composite, no loose unit: the front composite of the other kind (sliding 1) is
    # dissolved; units 1, 2 become full block 1, unit 3 waits loose at the front
    assert decode(mgr, y, 5) == ([6], [1])
    assert mgr.pop_compositions() == [(1, 1, (1, 2))]
    assert mgr.get_block_ids("y") == ([0, 0, 0, 6], [9, 11, 4, 1])
    assert mgr.pool.free.ids() == [3] and mgr.num_free_blocks == 1
    assert mgr.blocks_held_per_group() == [1, 4]                  # 1 x 3 + 4 x 2 = 11 units of 12


def test_one_group_per_kind_keeps_a_hit_where_one_group_per_layer_pair_keeps_none():
    """A block of a kind is cached and evicted whole (all its layers' units at once). With one group per
    S layers instead, the same eviction takes one group's blocks and kills the hit for every group."""
    # a window of 3: a's chain of 3 outgrows it (a hit at its end needs blocks 1-2 only), so tier 3 waits in
    # release order (a chain that fits its windows is ranked by the frequency order: free_queue)
    specs = [SlidingWindow(block_size=1, window=3), FullAttention(block_size=1)]
    per_kind = KVCacheManager(specs, num_blocks=13, widths=(3, 1))                        # units 1..12
    split = KVCacheManager([specs[0]] * 3 + [specs[1]], num_blocks=13)
    for mgr, tables in ((per_kind, ([1, 4, 7], [10, 11, 12])),
                        (split, ([1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]))):
        a = Request("a", [1, 2, 3])
        assert run_step(mgr, a, 3) == tables
        mgr.free(a)                               # every block cached; the pool is all free again
        assert mgr.num_free_blocks == 12
        hit, h = mgr.get_computed_blocks(Request("b", [1, 2, 3, 4]))
        assert h == 3
    # per kind: the new request takes a's sliding composite 7 (block 2, tail first) and full unit 12
    assert run_step(per_kind, Request("c", [9]), 1) == ([7], [12])
    # split: free queue 3, 2, 1, 6, 5, 4, 9, 8, 7, 12, 11, 10: the four groups take 3, 2, 1, 6 - all of
    # the first sliding group's blocks
    assert run_step(split, Request("c", [9]), 1) == ([3], [2], [1], [6])
    assert per_kind.get_computed_blocks(Request("d", [1, 2, 3, 4]))[1] == 2       # blocks 0-1 of both kinds
    assert split.get_computed_blocks(Request("d", [1, 2, 3, 4]))[1] == 0


def test_gemma_3_27b_layout_two_groups_one_id_per_entry_capacity_in_units():
    layout = kv_layout(layer_specs("gemma-3-27b"))
    mgr = KVCacheManager.from_layout(layout, num_blocks=11931, max_model_len=32768)
    assert mgr.widths == (26, 5) and [s.kind for s in mgr.specs] == ["sliding", "full"]
    r = Request("r", list(range(1, 4097)))
    # a 1024-token chunk: 64 blocks of each kind, one id each; 64 x 26 + 64 x 5 = 1984 units
    new = mgr.allocate_slots(r, 1024)
    assert [len(t) for t in new] == [64, 64]
    assert mgr.num_free_blocks == 11930 - 1984
    comps = mgr.pop_compositions()
    assert [len(c[2]) for c in comps] == [26] * 64 + [5] * 64
    # loose units are taken in id order: sliding block j is units 26j+1 .. 26j+26, named 26j+1
    assert new[0] == [26 * j + 1 for j in range(64)] and new[1][0] == 64 * 26 + 1
    r.num_computed_tokens = 1024
    # n = 1024: the window starts at 1, inside block 0: nothing drops; 64 + 64 new composites
    assert [len(t) for t in mgr.allocate_slots(r, 1024)] == [64, 64]
    assert len(mgr.pop_compositions()) == 128
    r.num_computed_tokens = 2048
    # n = 2048: the window starts at 1025: blocks 0..63 drop, cached, to the unreachable tier. 7962 units
    # were never used: the new blocks are made of them (no cached block goes while they last), from unit
    # 2 x 1984 + 1 on; the dropped composites wait whole, to be reused as they are once those run out
    new = mgr.allocate_slots(r, 1024)
    assert new[0] == [3969 + 26 * j for j in range(64)] and new[1][0] == 3969 + 64 * 26
    assert [len(c[2]) for c in mgr.pop_compositions()] == [26] * 64 + [5] * 64
    assert mgr.num_free_blocks == 11930 - 2 * 1984 - 64 * 5
    assert mgr.pool.free.ids()[-64:] == [26 * j + 1 for j in range(64)]


def test_compositions_travel_to_workers_as_runs_of_consecutive_units_whatever_the_width():
    """The wire form of a step (``workers.wire``): a composite of consecutive units is two integers, so
    what a step sends does not grow with the layers of a kind; the workers get the units back as they were."""
    mgr = KVCacheManager([SlidingWindow(block_size=1, window=2), FullAttention(block_size=1)], num_blocks=64,
                         widths=(26, 5))
    a = Request("a", [1, 2])
    run_step(mgr, a, 2)
    made = mgr.pop_compositions()
    assert made == [(0, 1, tuple(range(1, 27))), (0, 27, tuple(range(27, 53))),
                    (1, 53, (53, 54, 55, 56, 57)), (1, 58, (58, 59, 60, 61, 62))]
    step = StepInput(7, [], [], made + [(1, 3, (3, 9, 10, 11, 2))])     # one scattered composite too
    _, _, _, wired, _, _ = msgpack.unpackb(encode_step(step))   # then stores, loads
    assert wired == [[0, 1, [1, 26]], [0, 27, [27, 26]], [1, 53, [53, 5]], [1, 58, [58, 5]],
                     [1, 3, [3, 1, 9, 3, 2, 1]]]
    assert decode_step(encode_step(step)).compositions == step.compositions


def test_the_empty_tier_keeps_its_order_while_never_used_units_remain():
    """Never-used units wait outside the empty tier's dict (``free_queue._never``) but in their place: after
    leftovers pushed to its front, before empty blocks freed to its back; a wide block takes them in order."""
    pool = BlockPool(12, 2, widths=(1, 3))                                    # units 1..11, never used
    a, b, c = pool.take(1, 1)[0], pool.take(1, 0)[0], pool.take(1, 0)[0]
    assert [a.units, b.block_id, c.block_id] == [(1, 2, 3), 4, 5]
    pool.free.add_released([(x, False) for x in pool.unref([a, b])])          # nothing cached: the back
    pool.free.add_leftover(pool.unref([c]))                                   # a leftover: the front
    assert pool.free.ids() == [5, 6, 7, 8, 9, 10, 11, 1, 4] and pool.num_free_blocks == 11
    pool.pop_compositions()
    assert [pool.take(1, 1)[0].units for _ in range(2)] == [(5, 6, 7), (8, 9, 10)]   # loose in front of 1
    assert pool.take(1, 1) == [a]                     # two loose left (11, 4): the free composite, as is
    assert pool.pop_compositions() == [(1, 5, (5, 6, 7)), (1, 8, (8, 9, 10))]
    assert [pool.take(1, 0)[0].block_id for _ in range(2)] == [11, 4]
    assert pool.free.ids() == [] and pool.num_free_blocks == 0
