"""BRIEF §2 as tables: the drop rule, the hit rule and the worked examples, with figures worked out by hand.

Every expected value below is written out literally (the arithmetic in the comment next to it); nothing
is computed by the code under test.
"""
import pytest

from kvmanager import (NULL_BLOCK_ID, ChunkedLocalAttention, FullAttention, KVCacheManager, Request,
                       SlidingWindow)


def decode_walk(spec, steps):
    """One request, prompt of one token, then ``steps`` decode steps, one group.

    Returns, per allocation (n = tokens computed before it = 0, 1, ..., steps), the table length and
    how many leading entries are null.
    """
    mgr = KVCacheManager([spec], num_blocks=64)
    req = Request("r", [100])
    out = []
    for n in range(steps + 1):
        if n:
            req.append_output_token_ids([100 + n])
        assert mgr.allocate_slots(req, 1) is not None
        (table,) = mgr.get_block_ids("r")
        nulls = 0
        while nulls < len(table) and table[nulls] == NULL_BLOCK_ID:
            nulls += 1
        assert all(b != NULL_BLOCK_ID for b in table[nulls:]), table
        out.append((len(table), nulls))
        req.num_computed_tokens += 1
    return out


# ---------------------------------------------------------------------------------------------------------
# first_needed_token: the one rule every kind states
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, expected", [
    # W=5: max(0, n - 4) for n = 0..10
    (SlidingWindow(block_size=2, window=5), [0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6]),
    # W=1: a token sees only itself, max(0, n - 0) = n
    (SlidingWindow(block_size=2, window=1), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
    # W=100 longer than any n here: always 0
    (SlidingWindow(block_size=2, window=100), [0] * 11),
    # C=3: (n // 3) * 3
    (ChunkedLocalAttention(block_size=2, chunk_size=3), [0, 0, 0, 3, 3, 3, 6, 6, 6, 9, 9]),
    # C=1: every token is its own chunk
    (ChunkedLocalAttention(block_size=4, chunk_size=1), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
    (FullAttention(block_size=4), [0] * 11),
])
def test_first_needed_token_for_n_computed_0_to_10(spec, expected):
    assert [spec.first_needed_token(n) for n in range(11)] == expected


# ---------------------------------------------------------------------------------------------------------
# Drop rule, through the manager's tables (decode one token at a time)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, lengths, nulls", [
    # W=5, B=2 (window not a multiple of the block): len = n//2 + 1, nulls = max(0, n-4)//2, n = 0..12
    (SlidingWindow(block_size=2, window=5),
     [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7],
     [0, 0, 0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4]),
    # W=6, B=4: len = n//4 + 1, nulls = max(0, n-5)//4 -> first null at n=9 (4//4 = 1)
    (SlidingWindow(block_size=4, window=6),
     [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4],
     [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]),
    # W=1, B=2: nulls = n//2, exactly one real block at every step
    (SlidingWindow(block_size=2, window=1),
     [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7],
     [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]),
    # W=50 longer than the sequence: nothing dropped
    (SlidingWindow(block_size=2, window=50),
     [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7],
     [0] * 13),
    # chunked C=3, B=2: nulls = ((n//3)*3)//2: n=3..5 -> 1, n=6..8 -> 3, n=9..11 -> 4, n=12 -> 6
    (ChunkedLocalAttention(block_size=2, chunk_size=3),
     [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7],
     [0, 0, 0, 1, 1, 1, 3, 3, 3, 4, 4, 4, 6]),
    # chunked C=4, B=2: nulls = ((n//4)*4)//2: 0 for n<4, 2 for 4..7, 4 for 8..11, 6 at 12
    (ChunkedLocalAttention(block_size=2, chunk_size=4),
     [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7],
     [0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6]),
    # full attention drops nothing
    (FullAttention(block_size=2),
     [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7],
     [0] * 13),
])
def test_decode_walk_table_lengths_and_null_prefix(spec, lengths, nulls):
    assert decode_walk(spec, 12) == list(zip(lengths, nulls))


def test_full_attention_drops_nothing_over_a_long_chunked_run():
    mgr = KVCacheManager([FullAttention(block_size=4), SlidingWindow(block_size=4, window=4)], num_blocks=80)
    req = Request("r", list(range(100)))
    for _ in range(10):                      # 10 chunks of 10 tokens
        assert mgr.allocate_slots(req, 10) is not None
        req.num_computed_tokens += 10
    req.append_output_token_ids([7])
    assert mgr.allocate_slots(req, 1) is not None
    full, sliding = mgr.get_block_ids("r")
    # 101 tokens -> ceil(101/4) = 26 entries in each table
    assert len(full) == len(sliding) == 26
    assert NULL_BLOCK_ID not in full
    # sliding at n=100: first needed max(0, 100-4+1) = 97 -> 97//4 = 24 null entries, blocks 24 and 25 real
    assert sliding[:24] == [NULL_BLOCK_ID] * 24 and NULL_BLOCK_ID not in sliding[24:]


def test_chunked_local_nulls_after_each_prefill_chunk():
    # C=8, B=2, prompt 20 in chunks of 6: allocations at n = 0, 6, 12, 18
    mgr = KVCacheManager([ChunkedLocalAttention(block_size=2, chunk_size=8)], num_blocks=20)
    req = Request("r", list(range(20)))
    seen = []
    for chunk in (6, 6, 6, 2):
        assert mgr.allocate_slots(req, chunk) is not None
        (table,) = mgr.get_block_ids("r")
        seen.append((len(table), table.count(NULL_BLOCK_ID)))
        req.num_computed_tokens += chunk
    # n=0: len 6/2=3, first needed 0 -> 0 nulls
    # n=6: len 12/2=6, first needed (6//8)*8=0 -> 0 nulls
    # n=12: len 18/2=9, first needed 8 -> 8//2=4 nulls
    # n=18: len 20/2=10, first needed 16 -> 8 nulls
    assert seen == [(3, 0), (6, 0), (9, 4), (10, 8)]


# ---------------------------------------------------------------------------------------------------------
# BRIEF's worked example and the steady-decode bound
# ---------------------------------------------------------------------------------------------------------
def test_brief_worked_example_window_1000_prompt_4000_chunk_2000():
    mgr = KVCacheManager([SlidingWindow(block_size=1, window=1000)], num_blocks=4096)
    req = Request("r", list(range(4000)))

    def counts():
        (table,) = mgr.get_block_ids("r")
        return len(table), table.count(NULL_BLOCK_ID), sum(1 for b in table if b != NULL_BLOCK_ID)

    # step 1: blocks for 0..1999
    new = mgr.allocate_slots(req, 2000)
    assert len(new[0]) == 2000
    assert counts() == (2000, 0, 2000)
    assert mgr.num_free_blocks == 4095 - 2000
    req.num_computed_tokens += 2000
    # step 2 (n=2000): first needed 2000-1000+1 = 1001 -> 0..1000 dropped (1001 nulls); 2000 added
    new = mgr.allocate_slots(req, 2000)
    assert len(new[0]) == 2000
    assert counts() == (4000, 1001, 2999)
    assert mgr.num_free_blocks == 4095 - 2999
    req.num_computed_tokens += 2000
    # first decode (n=4000): first needed 3001 -> 3001 nulls, one block added: 4001 - 3001 = 1000 real
    req.append_output_token_ids([1])
    new = mgr.allocate_slots(req, 1)
    assert len(new[0]) == 1
    assert counts() == (4001, 3001, 1000)
    assert mgr.num_free_blocks == 4095 - 1000


@pytest.mark.parametrize("window, block_size, bound", [
    (1, 1, 1),     # ceil(0/1) + 1
    (2, 1, 2),     # ceil(1/1) + 1
    (5, 2, 3),     # ceil(4/2) + 1
    (4, 4, 2),     # ceil(3/4) + 1
    (7, 3, 3),     # ceil(6/3) + 1
    (10, 3, 4),    # ceil(9/3) + 1
    (16, 4, 5),    # ceil(15/4) + 1
    (9, 16, 2),    # ceil(8/16) + 1
])
def test_steady_decode_holds_at_most_ceil_w_minus_1_over_b_plus_1_real_blocks(window, block_size, bound):
    mgr = KVCacheManager([SlidingWindow(block_size=block_size, window=window)], num_blocks=64)
    req = Request("r", [1] * 5)
    assert mgr.allocate_slots(req, 5) is not None
    req.num_computed_tokens = 5
    held = []
    for n in range(5, 5 + 120):
        req.append_output_token_ids([n % 50])
        assert mgr.allocate_slots(req, 1) is not None
        (table,) = mgr.get_block_ids("r")
        real = sum(1 for b in table if b != NULL_BLOCK_ID)
        # independent count: distinct blocks of the positions the token at n sees, max(0, n-W+1) .. n
        assert real == len({p // block_size for p in range(max(0, n - window + 1), n + 1)})
        held.append(real)
        req.num_computed_tokens += 1
    assert max(held) == bound          # reached, never exceeded
    assert mgr.num_free_blocks == 63 - held[-1]


# ---------------------------------------------------------------------------------------------------------
# Hit rule, per kind, on explicit cached patterns ("X" cached, "." not)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, pattern, max_blocks, expected", [
    # W=5, B=2: a hit of e blocks needs the last ceil(4/2) = 2 blocks before it (all, if fewer)
    (SlidingWindow(block_size=2, window=5), "XXXXXX", 6, 6),
    (SlidingWindow(block_size=2, window=5), "XX.XX.", 6, 5),   # e=6 needs {4,5}: 5 missing; e=5 {3,4}
    (SlidingWindow(block_size=2, window=5), "X.X.X.", 6, 1),   # no adjacent pair; e=1 needs {0}
    (SlidingWindow(block_size=2, window=5), "....XX", 6, 6),
    (SlidingWindow(block_size=2, window=5), "....XX", 5, 0),   # e=5 needs {3,4}; 3 missing, so do all
    (SlidingWindow(block_size=2, window=5), ".X", 2, 0),       # e=2 needs {0,1}, e=1 needs {0}
    # W=4, B=3: ceil(3/3) = 1 block: e needs {e-1}
    (SlidingWindow(block_size=3, window=4), "X.X.", 4, 3),
    (SlidingWindow(block_size=3, window=4), "...X", 4, 4),
    (SlidingWindow(block_size=3, window=4), ".X..", 4, 2),
    # W=5, B=3: ceil(4/3) = 2 blocks: e needs {e-2, e-1}
    (SlidingWindow(block_size=3, window=5), "X.XX", 4, 4),
    (SlidingWindow(block_size=3, window=5), "XX.X", 4, 2),
    # W=1 needs no earlier block at all: the whole allowed length, nothing cached
    (SlidingWindow(block_size=2, window=1), "....", 4, 4),
    (SlidingWindow(block_size=2, window=1), "....", 0, 0),
    # W=100 longer than the sequence: every block before h, like full attention
    (SlidingWindow(block_size=2, window=100), "XXX.X", 5, 3),
    (SlidingWindow(block_size=2, window=100), "XXXXX", 5, 5),
    (FullAttention(block_size=4), "XX.XX", 5, 2),
    (FullAttention(block_size=4), ".XXXX", 5, 0),
    # chunked C=4, B=2: e needs blocks [(e//2)*2, e): nothing for even e, {e-1} for odd e
    (ChunkedLocalAttention(block_size=2, chunk_size=4), ".....", 5, 4),
    (ChunkedLocalAttention(block_size=2, chunk_size=4), "....X", 5, 5),
    (ChunkedLocalAttention(block_size=2, chunk_size=4), ".....", 1, 0),
    # chunked C=3, B=2: e=1 {0}, e=2 {1} (chunk starts at 3), e=3 {} (starts at 6), e=4 {3}, e=5 {4}
    (ChunkedLocalAttention(block_size=2, chunk_size=3), ".....", 5, 3),
    (ChunkedLocalAttention(block_size=2, chunk_size=3), ".X...", 2, 2),
    (ChunkedLocalAttention(block_size=2, chunk_size=3), "X....", 2, 1),
    (ChunkedLocalAttention(block_size=2, chunk_size=3), "...XX", 5, 5),
])
def test_longest_hit_on_explicit_cached_pattern(spec, pattern, max_blocks, expected):
    assert spec.longest_hit(lambda i: pattern[i] == "X", max_blocks) == expected


def test_longest_hit_tests_each_block_at_most_once():
    # W=5, B=1 needs 4 blocks per candidate; nothing cached among 40: a miss at i skips to candidate i,
    # so the cold search tests 40/4 = 10 blocks, never one twice
    asked = []
    spec = SlidingWindow(block_size=1, window=5)
    assert spec.longest_hit(lambda i: asked.append(i) or False, 40) == 0
    assert len(asked) == len(set(asked)) == 10
    # warm: 34..37 cached, 38 not. Candidate 40 tests 36, 37, 38 (miss); candidate 38 needs 34..37 and
    # tests only 34, 35: 36, 37 are known cached
    asked = []
    assert spec.longest_hit(lambda i: asked.append(i) or 34 <= i <= 37, 40) == 38
    assert asked == [36, 37, 38, 34, 35]


# ---------------------------------------------------------------------------------------------------------
# Hit rule through the manager and the real pool
# ---------------------------------------------------------------------------------------------------------
def test_brief_abcde_window_2_only_d_cached_hits_4_tokens():
    """W=2, B=1. "Only D cached" is produced by the pool itself: r1 computes ABCD; its decode drops A, B
    (no hit can end above them: unreachable) and C (the window below its prompt end: speculative); r2 then
    takes the never-used blocks, then A's, B's and C's, in that order."""
    A, B, C, D, E, X = 10, 11, 12, 13, 14, 99
    mgr = KVCacheManager([SlidingWindow(block_size=1, window=2)], num_blocks=9)   # ids 1..8
    r1 = Request("r1", [A, B, C, D])
    assert mgr.allocate_slots(r1, 4) == ([1, 2, 3, 4],)          # A=1 B=2 C=3 D=4
    r1.num_computed_tokens = 4
    r1.append_output_token_ids([X])
    # n=4: first needed 4-2+1 = 3 -> blocks 0..2 (ids 1, 2, 3) dropped; never-used 5 serves X
    assert mgr.allocate_slots(r1, 1) == ([5],)
    assert mgr.get_block_ids("r1") == ([0, 0, 0, 4, 5],)
    assert mgr.pool.free.ids() == [6, 7, 8, 1, 2, 3]              # empty, unreachable, speculative
    r2 = Request("r2", [50, 51, 52, 53, 54, 55])
    assert mgr.allocate_slots(r2, 6) == ([6, 7, 8, 1, 2, 3],)

    probe = Request("probe", [A, B, C, D, E])
    hashes = probe.block_hashes(1)
    assert [mgr.pool.is_cached(0, h) for h in hashes] == [False, False, False, True, False]
    r2.num_computed_tokens = 6
    mgr.free(r2)                                                  # r2's chain, tail first: 3, 2, 1, 8, 7, 6

    req = Request("r3", [A, B, C, D, E])
    hit, h = mgr.get_computed_blocks(req)
    # h=4 needs the last ceil((2-1)/1) = 1 block before 4: block 3 (D), which is cached
    assert h == 4
    assert [b.block_id for b in hit[0]] == [0, 0, 0, 4]
    assert mgr.allocate_slots(req, 1, num_new_computed_tokens=4, new_computed_blocks=hit) == ([0, 0, 0, 4, 3],)
    assert mgr.pool.blocks[4].ref_cnt == 2                        # D shared by r1 and r3


def test_hit_never_covers_the_last_prompt_token():
    mgr = KVCacheManager([FullAttention(block_size=4)], num_blocks=16)
    r1 = Request("r1", list(range(8)))
    assert mgr.allocate_slots(r1, 8) == ([1, 2],)
    # both blocks cached; the same 8-token prompt may reuse at most 7 tokens -> 4 (one block)
    assert mgr.get_computed_blocks(Request("r2", list(range(8))))[1] == 4
    # a 9-token prompt with the same first 8 can reuse 8
    hit, h = mgr.get_computed_blocks(Request("r3", list(range(9))))
    assert h == 8 and [b.block_id for b in hit[0]] == [1, 2]


def test_hybrid_hit_is_a_multiple_of_the_lcm_of_block_sizes():
    # Full B=2 and sliding W=5 B=4: lcm 4
    mgr = KVCacheManager([FullAttention(block_size=2), SlidingWindow(block_size=4, window=5)], num_blocks=20)
    r1 = Request("r1", list(range(11)))
    # full: ceil(11/2) = 6 blocks (ids 1..6); sliding: ceil(11/4) = 3 blocks (ids 7..9)
    assert mgr.allocate_slots(r1, 11) == ([1, 2, 3, 4, 5, 6], [7, 8, 9])
    hit, h = mgr.get_computed_blocks(Request("r2", list(range(11))))
    # at most 10 tokens, aligned down to 4 -> 8; full needs blocks 0..3, sliding needs the last
    # ceil(4/4) = 1 block before 8 (block 1); block 0 of sliding is null in the hit
    assert h == 8
    assert [[b.block_id for b in g] for g in hit] == [[1, 2, 3, 4], [0, 8]]


def test_hybrid_hit_limited_by_the_group_with_the_shortest_hit():
    # full B=1 + sliding W=3 B=1; r1 finishes, then a new request evicts the tail of its full-attention chain
    mgr = KVCacheManager([FullAttention(block_size=1), SlidingWindow(block_size=1, window=3)], num_blocks=13)
    r1 = Request("r1", list(range(6)))
    # 6 tokens: full takes ids 1..6, sliding 7..12; all 12 blocks full of known tokens, so all cached
    assert mgr.allocate_slots(r1, 6) == ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
    r1.num_computed_tokens = 6
    mgr.free(r1)      # one chain, group by group, each tail first: 6, 5, 4, 3, 2, 1, 12, 11, 10, 9, 8, 7
    assert mgr.allocate_slots(Request("x", [77]), 1) == ([6], [5])     # full blocks 5 and 4 evicted
    hit, h = mgr.get_computed_blocks(Request("r2", list(range(6)) + [55]))
    # at most 6 tokens. Sliding alone: h=6 needs blocks 4, 5 (ids 11, 12), cached. Full: blocks 0..3 only,
    # so 4; at 4 sliding needs blocks 2, 3 (ids 9, 10): cached -> 4
    assert h == 4
    assert [[b.block_id for b in g] for g in hit] == [[1, 2, 3, 4], [0, 0, 9, 10]]
