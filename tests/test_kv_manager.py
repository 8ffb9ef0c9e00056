"""KVCacheManager behaviour beyond the bare rules: eviction order, hashing, look-ahead, hybrid steps,
preemption, accounting. Block ids are traced by hand from the free queue's tiers (kvmanager/free_queue.py:
ids 1.. in order at start, in the empty tier; a new block comes from the lowest non-empty tier, front
first; blocks holding nothing go to the empty tier, dropped blocks below no fork and no prompt end to the
unreachable one, a finished request's cached blocks to the back of the reusable tier, tail first).
Scenarios for each tier are in tests/test_kv_retention.py."""
import os
import subprocess
import sys
from pathlib import Path

from kvmanager import NULL_BLOCK_ID, FullAttention, KVCacheManager, Request, SlidingWindow

from drivers import decode, ids, run_step

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------
# Eviction policy
# ---------------------------------------------------------------------------------------------------------
def test_running_requests_dropped_blocks_are_reused_before_a_finished_requests_trailing_window():
    mgr = KVCacheManager([SlidingWindow(block_size=1, window=2)], num_blocks=7,    # ids 1..6; tiers of the
                         last_message_tokens=0)                                   # prompt end alone
    a = Request("a", [10, 11, 12])
    assert run_step(mgr, a, 3) == ([1, 2, 3],)
    # n=3: first needed 2 -> ids 1, 2 dropped: 1 unreachable, 2 (the window below a's prompt end, 2)
    # speculative. The new token takes a never-used block, 4
    assert decode(mgr, a, 13) == ([4],)
    assert mgr.get_block_ids("a") == ([0, 0, 3, 4],)
    mgr.free(a)                        # trailing window 4, 3: a chain, in the reusable tier
    assert mgr.pool.free.ids() == [5, 6, 1, 2, 4, 3]

    b = Request("b", [20, 21, 22])
    assert run_step(mgr, b, 3) == ([5, 6, 1],)        # queue [2, 4, 3]
    # n=3 drops ids 5 (unreachable), 6 (speculative): the new block is b's own dropped 5, not a's window
    assert decode(mgr, b, 23) == ([5],)
    # n=4 drops id 1 (unreachable), n=5 drops id 5 (unreachable): each is reused at once
    assert decode(mgr, b, 24) == ([1],)
    assert decode(mgr, b, 25) == ([5],)
    assert mgr.get_block_ids("b") == ([0, 0, 0, 0, 1, 5],)
    assert mgr.pool.free.ids() == [2, 6, 4, 3]
    # (plain LRU would have handed b ids 2, 4, 3: a's window would be gone)

    c = Request("c", [10, 11, 12, 13, 99])
    hit, h = mgr.get_computed_blocks(c)
    # h=4 needs the last ceil(1/1) = 1 block before 4: a's block 3, id 4, still cached
    assert (ids(hit), h) == ([[0, 0, 0, 4]], 4)


def test_finished_full_attention_request_is_evicted_tail_first():
    mgr = KVCacheManager([FullAttention(block_size=1)], num_blocks=5)             # ids 1..4
    a = Request("a", [1, 2, 3, 4])
    assert run_step(mgr, a, 4) == ([1, 2, 3, 4],)
    mgr.free(a)                                        # queue [4, 3, 2, 1]
    assert run_step(mgr, Request("x", [9]), 1) == ([4],)
    hit, h = mgr.get_computed_blocks(Request("p", [1, 2, 3, 4, 5]))
    assert (ids(hit), h) == ([[1, 2, 3]], 3)           # block 3 evicted, 0..2 left
    assert run_step(mgr, Request("y", [8]), 1) == ([3],)
    hit, h = mgr.get_computed_blocks(Request("q", [1, 2, 3, 4, 5]))
    assert (ids(hit), h) == ([[1, 2]], 2)


def test_a_dropped_block_another_request_still_holds_frees_nothing():
    mgr = KVCacheManager([SlidingWindow(block_size=1, window=2)], num_blocks=6)   # ids 1..5
    r1 = Request("r1", [1, 2, 3, 4])
    assert run_step(mgr, r1, 4) == ([1, 2, 3, 4],)   # r1 keeps running, holding them
    r2 = Request("r2", [1, 2, 3, 4, 5])
    hit, h = mgr.get_computed_blocks(r2)
    assert (ids(hit), h) == ([[0, 0, 0, 4]], 4)
    assert mgr.allocate_slots(r2, 1, num_new_computed_tokens=4, new_computed_blocks=hit) == ([0, 0, 0, 4, 5],)
    r2.num_computed_tokens = 5
    assert mgr.num_free_blocks == 0
    # n=5 drops block 3 (id 4), which r1 still holds: nothing is freed and the new token does not fit
    r2.append_output_token_ids([6])
    assert mgr.allocate_slots(r2, 1) is None
    assert mgr.get_block_ids("r2") == ([0, 0, 0, 4, 5],)
    assert mgr.pool.blocks[4].ref_cnt == 2


def test_two_copies_of_a_prefix_either_one_serves_a_hit():
    mgr = KVCacheManager([FullAttention(block_size=2)], num_blocks=7)             # ids 1..6
    r1, r2 = Request("r1", [1, 2, 3, 4, 5]), Request("r2", [1, 2, 3, 4, 5])
    assert run_step(mgr, r1, 5) == ([1, 2, 3],)
    assert run_step(mgr, r2, 5) == ([4, 5, 6],)        # no lookup: computes its own copy
    mgr.free(r1)
    mgr.free(r2)               # partial blocks 3, 6 hold nothing: first; then r1's chain 2, 1, r2's 5, 4
    assert run_step(mgr, Request("x", [7] * 6), 6) == ([3, 6, 2],)   # r1's block 1 evicted
    hit, h = mgr.get_computed_blocks(Request("p", [1, 2, 3, 4, 5]))
    assert (ids(hit), h) == ([[1, 5]], 4)              # r1's block 0, r2's block 1


def test_a_hit_shares_the_copy_a_running_request_holds_and_leaves_the_free_copy_free():
    mgr = KVCacheManager([FullAttention(block_size=2)], num_blocks=9)             # ids 1..8
    r1, r2 = Request("r1", [1, 2, 3, 4, 5]), Request("r2", [1, 2, 3, 4, 5])
    assert run_step(mgr, r1, 5) == ([1, 2, 3],)
    assert run_step(mgr, r2, 5) == ([4, 5, 6],)        # no lookup: computes its own copy
    mgr.free(r1)                                       # r1's copy (1, 2) waits free; r2 holds 4, 5
    assert mgr.num_free_blocks == 5
    p = Request("p", [1, 2, 3, 4, 9])
    hit, h = mgr.get_computed_blocks(p)
    assert (ids(hit), h) == ([[4, 5]], 4)              # r2's held copy, not r1's older free one
    assert mgr.allocate_slots(p, 1, h, hit) is not None
    assert mgr.num_free_blocks == 4                    # only p's own last block came from the free pool
    assert mgr.get_block_ids("p") == ([4, 5, 7],)      # (taking r1's copy left 2 free)


# ---------------------------------------------------------------------------------------------------------
# Hybrid steps: several groups in one pool
# ---------------------------------------------------------------------------------------------------------
def test_hit_blocks_of_one_group_are_never_handed_out_as_new_blocks_of_another():
    """Full B=1 + sliding W=2 B=1, 8 blocks. After r1 (ABCD) is freed the queue is full's 4, 3, 2, 1 then
    sliding's 8, 7, 6, 5. r2 (ABCDE) hits 4 tokens: full 1..4, sliding [0, 0, 0, 8]. Its one new block per
    group must come from 7, 6, 5, never 8, which the sliding group is about to reuse as D."""
    mgr = KVCacheManager([FullAttention(block_size=1), SlidingWindow(block_size=1, window=2)], num_blocks=9)
    r1 = Request("r1", [1, 2, 3, 4])
    assert run_step(mgr, r1, 4) == ([1, 2, 3, 4], [5, 6, 7, 8])
    mgr.free(r1)
    r2 = Request("r2", [1, 2, 3, 4, 5])
    hit, h = mgr.get_computed_blocks(r2)
    assert (ids(hit), h) == ([[1, 2, 3, 4], [0, 0, 0, 8]], 4)
    new = mgr.allocate_slots(r2, 1, num_new_computed_tokens=4, new_computed_blocks=hit)
    assert new is not None
    full, sliding = mgr.get_block_ids("r2")
    assert full[:4] == [1, 2, 3, 4] and sliding[:4] == [0, 0, 0, 8]
    assert full[4] in (5, 6, 7) and sliding[4] in (5, 6, 7) and full[4] != sliding[4]
    assert mgr.pool.blocks[8].ref_cnt == 1
    # 8 allocatable, 7 held (1..4, 8 and one new block per group) -> 1 free
    assert mgr.num_free_blocks == 1


def test_a_full_groups_new_block_may_come_from_the_sliding_groups_drop_in_the_same_step():
    mgr = KVCacheManager([FullAttention(block_size=1), SlidingWindow(block_size=1, window=1)], num_blocks=5)
    r = Request("r", [1, 2])
    assert run_step(mgr, r, 2) == ([1, 2], [3, 4])     # pool now empty
    # n=2, W=1: sliding drops blocks 0, 1 (ids 3, 4); the step needs one block in each group
    new = decode(mgr, r, 3)
    assert sorted(new[0] + new[1]) == [3, 4]
    full, sliding = mgr.get_block_ids("r")
    assert full[:2] == [1, 2] and sliding[:2] == [0, 0]
    assert mgr.num_free_blocks == 0


def test_no_fixed_split_full_layers_take_the_blocks_sliding_layers_do_not_need():
    mgr = KVCacheManager([FullAttention(block_size=4), SlidingWindow(block_size=4, window=4)], num_blocks=13)
    a = Request("a", list(range(40)))
    for _ in range(10):                                 # chunks of 4 at n = 0, 4, ..., 36
        assert mgr.allocate_slots(a, 4) is not None
        a.num_computed_tokens += 4
    full, sliding = mgr.get_block_ids("a")
    # full: 40/4 = 10 blocks; sliding at n=36: first needed 33 -> 33//4 = 8 nulls of 10 -> 2 real
    assert NULL_BLOCK_ID not in full and len(full) == 10
    assert sliding[:8] == [NULL_BLOCK_ID] * 8 and NULL_BLOCK_ID not in sliding[8:]
    assert mgr.num_free_blocks == 0                     # 10 + 2 = all 12
    # n=40: the sliding drop frees 1 (first needed 37 -> block 8), but full and sliding each need one
    a.append_output_token_ids([1])
    assert mgr.allocate_slots(a, 1) is None


# ---------------------------------------------------------------------------------------------------------
# Look-ahead, preemption, reset, accounting
# ---------------------------------------------------------------------------------------------------------
def test_lookahead_slots_are_reserved_but_not_cached_until_their_tokens_are_known():
    mgr = KVCacheManager([FullAttention(block_size=2)], num_blocks=10)
    r = Request("r", [1, 2, 3, 4])
    # 4 tokens + 3 look-ahead = 7 slots -> ceil(7/2) = 4 blocks
    assert mgr.allocate_slots(r, 4, num_lookahead_tokens=3) == ([1, 2, 3, 4],)
    r.num_computed_tokens = 4
    assert [mgr.pool.blocks[i].block_hash is not None for i in (1, 2, 3, 4)] == [True, True, False, False]
    # two tokens verified: no new block needed, block 2 (tokens 4, 5) now full and cached
    r.append_output_token_ids([5, 6])
    assert mgr.allocate_slots(r, 2) == ([],)
    assert [mgr.pool.blocks[i].block_hash is not None for i in (1, 2, 3, 4)] == [True, True, True, False]
    hit, h = mgr.get_computed_blocks(Request("p", [1, 2, 3, 4, 5, 6, 7]))
    assert (ids(hit), h) == ([[1, 2, 3]], 6)


def test_slots_over_known_prompt_tokens_are_not_cached_before_those_tokens_are_computed():
    mgr = KVCacheManager([FullAttention(block_size=2)], num_blocks=10)
    r = Request("r", list(range(8)))
    # a 4-token chunk with 4 look-ahead slots: tokens 4..7 are known but not computed by this step
    assert mgr.allocate_slots(r, 4, num_lookahead_tokens=4) == ([1, 2, 3, 4],)
    assert [mgr.pool.blocks[i].block_hash is not None for i in (1, 2, 3, 4)] == [True, True, False, False]
    hit, h = mgr.get_computed_blocks(Request("p", list(range(8))))
    assert (ids(hit), h) == ([[1, 2]], 4)


def test_lookahead_is_capped_at_max_model_len():
    mgr = KVCacheManager([FullAttention(block_size=2)], num_blocks=10, max_model_len=6)
    r = Request("r", [1, 2, 3, 4, 5])
    # 5 tokens + 4 look-ahead = 9 slots, capped at 6 -> 3 blocks
    assert mgr.allocate_slots(r, 5, num_lookahead_tokens=4) == ([1, 2, 3],)


def test_preempted_request_resumes_through_its_own_cached_blocks():
    mgr = KVCacheManager([FullAttention(block_size=2), SlidingWindow(block_size=2, window=3)], num_blocks=20)
    r = Request("r", list(range(9)))
    assert run_step(mgr, r, 9) == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    decode(mgr, r, 50)      # n=9: sliding first needed 7 -> blocks 0..2 dropped; no new block (10 slots)
    mgr.preempt(r)
    assert r.num_computed_tokens == 0 and not r.finished
    assert mgr.num_free_blocks == 19 and mgr.stats.preemptions == 1
    hit, h = mgr.get_computed_blocks(r)
    # 10 tokens known, at most 9 reusable -> 8; full blocks 0..3; sliding needs the last ceil(2/2) = 1
    # block before 8 (block 3, id 9)
    assert (ids(hit), h) == ([[1, 2, 3, 4], [0, 0, 0, 9]], 8)
    # queue after the preemption: never-used 11..19; sliding's dropped 6, 7, 8 (unreachable); the
    # preempted tables tail first, proven reusable: 5, 4, 3, 2, 1, 10, 9.
    # Tokens 8, 9 need one new block per group: 11 (full), 12 (sliding); block 4 is recomputed
    assert mgr.pool.free.ids() == list(range(11, 20)) + [6, 7, 8, 5, 4, 3, 2, 1, 10, 9]
    assert mgr.allocate_slots(r, 2, num_new_computed_tokens=8, new_computed_blocks=hit) == ([1, 2, 3, 4, 11],
                                                                                            [0, 0, 0, 9, 12])


def test_reset_prefix_cache_refuses_while_a_request_runs_then_forgets_every_hash():
    mgr = KVCacheManager([FullAttention(block_size=2)], num_blocks=10)
    r1 = Request("r1", [1, 2, 3, 4, 5])
    run_step(mgr, r1, 5)
    assert mgr.get_computed_blocks(Request("p", [1, 2, 3, 4, 5]))[1] == 4
    assert mgr.reset_prefix_cache() is False          # r1 holds blocks: nothing changes
    assert mgr.get_computed_blocks(Request("q", [1, 2, 3, 4, 5]))[1] == 4
    assert mgr.get_block_ids("r1") == ([1, 2, 3],) and mgr.num_free_blocks == 9 - 3
    mgr.free(r1)
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(Request("s", [1, 2, 3, 4, 5]))[1] == 0
    assert mgr.num_free_blocks == 9
    assert mgr.pool.free.ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1]     # every block in the empty tier, in order


def test_free_everything_restores_the_pool_and_usage():
    mgr = KVCacheManager([FullAttention(block_size=2), SlidingWindow(block_size=4, window=5)], num_blocks=33)
    reqs = [Request(f"r{i}", [i] * (3 + 4 * i)) for i in range(4)]
    for r in reqs:
        run_step(mgr, r, r.num_tokens)
    # blocks: full ceil(n/2) + sliding ceil(n/4) for n = 3, 7, 11, 15 -> 2+1, 4+2, 6+3, 8+4 = 30
    assert mgr.num_free_blocks == 32 - 30
    assert mgr.usage == 30 / 32
    for r in reqs:
        mgr.free(r)
    assert mgr.num_free_blocks == 32 and mgr.usage == 0.0


def test_stats_count_lookups_queried_and_hit_tokens():
    mgr = KVCacheManager([FullAttention(block_size=2)], num_blocks=10)
    run_step(mgr, Request("r1", [1, 2, 3, 4, 5]), 5)
    mgr.get_computed_blocks(Request("a", [1, 2, 3, 4, 5, 6]))     # hit 4 of 6
    mgr.get_computed_blocks(Request("b", [9, 9, 9]))              # hit 0 of 3
    assert (mgr.stats.lookups, mgr.stats.queried_tokens, mgr.stats.hit_tokens) == (2, 9, 4)
    assert mgr.stats.hit_rate == 4 / 9


def test_prefix_caching_off_means_no_hits_and_nothing_cached():
    mgr = KVCacheManager([FullAttention(block_size=2)], num_blocks=10, enable_prefix_caching=False)
    run_step(mgr, Request("r1", [1, 2, 3, 4, 5]), 5)
    assert mgr.get_computed_blocks(Request("a", [1, 2, 3, 4, 5])) == (([],), 0)
    assert all(b.block_hash is None for b in mgr.pool.blocks)


# ---------------------------------------------------------------------------------------------------------
# Hashing
# ---------------------------------------------------------------------------------------------------------
HASH_SNIPPET = ("from kvmanager import Request;"
                "r = Request('x', list(range(1000, 1013)), extra_keys=('salt', 7, b'k', None, ('lora', 2)));"
                "print(','.join(h.hex() for h in r.block_hashes(4)))")


def test_block_hashes_are_equal_across_processes_with_different_hash_seeds():
    outs = []
    for seed in ("1", "987654"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
        proc = subprocess.run([sys.executable, "-c", HASH_SNIPPET], capture_output=True, text=True, env=env,
                              cwd=REPO, check=True)
        outs.append(proc.stdout.strip())
    here = Request("x", list(range(1000, 1013)), extra_keys=("salt", 7, b"k", None, ("lora", 2)))
    expected = ",".join(h.hex() for h in here.block_hashes(4))
    assert outs == [expected, expected]
    assert len(expected.split(",")) == 3               # 13 tokens -> 3 full blocks of 4


def test_hashes_chain_equal_prefixes_and_differ_after_a_difference():
    a = Request("a", [1, 2, 3, 4, 5, 6]).block_hashes(2)
    b = Request("b", [1, 2, 3, 9, 5, 6]).block_hashes(2)
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]               # block 2 has equal tokens but a different parent
    assert len(set(a)) == 3


def test_extra_keys_separate_otherwise_equal_requests():
    toks = [1, 2, 3, 4]
    plain = Request("p", toks).block_hashes(2)
    assert Request("q", toks, extra_keys=()).block_hashes(2) == plain
    salted = Request("s", toks, extra_keys=("salt",)).block_hashes(2)
    assert salted[0] != plain[0] and salted[1] != plain[1]
    # a self-delimiting encoding: ("a", 1) and ("a1",) and (("a", 1),) are all different
    keys = [("a", 1), ("a1",), (("a", 1),), ("1",), (b"1",), (None,)]
    assert len({Request("k", toks, extra_keys=k).block_hashes(2)[0] for k in keys}) == len(keys)

    mgr = KVCacheManager([FullAttention(block_size=2)], num_blocks=10)
    run_step(mgr, Request("r1", toks + [5], extra_keys=("tenant-a",)), 5)
    assert mgr.get_computed_blocks(Request("r2", toks + [5], extra_keys=("tenant-b",)))[1] == 0
    assert mgr.get_computed_blocks(Request("r3", toks + [5]))[1] == 0
    assert mgr.get_computed_blocks(Request("r4", toks + [5], extra_keys=("tenant-a",)))[1] == 4


def test_extra_keys_true_and_1_are_different_keys_whichever_is_hashed_first():
    # bool and int encode differently (b"T" vs b"i1:1"); a cache keyed by equality must not merge them
    toks = [1, 2]
    as_int_first = [Request("a", toks, extra_keys=(1,)).block_hashes(2)[0],
                    Request("b", toks, extra_keys=(True,)).block_hashes(2)[0]]
    as_bool_first = [Request("c", toks, extra_keys=(False, "x")).block_hashes(2)[0],
                     Request("d", toks, extra_keys=(0, "x")).block_hashes(2)[0]]
    assert as_int_first[0] != as_int_first[1]
    assert as_bool_first[0] != as_bool_first[1]


def test_block_hashes_are_computed_once_and_extended_in_place():
    r = Request("r", [1, 2, 3, 4, 5])
    first = r.block_hashes(2)
    assert len(first) == 2                             # 5 tokens -> 2 full blocks
    kept = list(first)
    r.append_output_token_ids([6])
    again = r.block_hashes(2)
    assert again is first and len(again) == 3
    assert all(x is y for x, y in zip(again, kept))    # old entries are the same objects, not recomputed
    # per block size, independent lists
    by4 = r.block_hashes(4)
    assert by4 is not first and len(by4) == 1
    assert r.block_hashes(4) is by4


def test_equal_tokens_in_different_groups_are_cached_separately():
    # two sliding groups of equal block size: the hit must find each group's own blocks
    mgr = KVCacheManager([SlidingWindow(block_size=2, window=3), SlidingWindow(block_size=2, window=5)],
                         num_blocks=20)
    run_step(mgr, Request("r1", [1, 2, 3, 4, 5]), 5)                 # group 0: 1, 2, 3; group 1: 4, 5, 6
    hit, h = mgr.get_computed_blocks(Request("r2", [1, 2, 3, 4, 5]))
    # h=4: W=3 needs ceil(2/2) = 1 block (1), W=5 needs ceil(4/2) = 2 blocks (0, 1)
    assert (ids(hit), h) == ([[0, 2], [4, 5]], 4)
    assert NULL_BLOCK_ID not in hit[1]
