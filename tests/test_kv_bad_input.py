"""BRIEF §5 for what reaches the manager: each bad input raises a clear error naming the field, before any
state changes; an allocation that does not fit returns None and changes nothing, not even the drop."""
import pytest

from kvmanager import (NULL_BLOCK_ID, ChunkedLocalAttention, FullAttention, KVCacheManager, Request,
                       SlidingWindow)

BAD_INTS = [0, -1, 1.5, 2.0, True, "4", None]


def snapshot(mgr, *requests):
    """Everything an error must leave alone: free queue (in order), every block's count and cache entry,
    every table, the stats, and the requests' own counters."""
    pool = mgr.pool
    return (pool.free.ids(),
            [(b.ref_cnt, b.block_hash, b.group) for b in pool.blocks],
            [{rid: [b.block_id for b in t] for rid, t in g.tables.items()} for g in mgr.coordinator.groups],
            (mgr.stats.lookups, mgr.stats.queried_tokens, mgr.stats.hit_tokens, mgr.stats.preemptions),
            [(r.num_computed_tokens, list(r.all_token_ids), r.finished) for r in requests])


def busy():
    """A manager with a running request r0 (prefix hit, then decoding) and a finished one in the cache."""
    mgr = KVCacheManager([FullAttention(block_size=2), SlidingWindow(block_size=2, window=3)], num_blocks=24,
                         max_model_len=16)
    done = Request("done", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert mgr.allocate_slots(done, 9) is not None
    done.num_computed_tokens = 9
    mgr.free(done)
    r0 = Request("r0", [1, 2, 3, 4, 5, 6, 7, 30])
    hit, h = mgr.get_computed_blocks(r0)
    assert h == 6
    assert mgr.allocate_slots(r0, 2, num_new_computed_tokens=6, new_computed_blocks=hit) is not None
    r0.num_computed_tokens = 8
    r0.append_output_token_ids([31])
    assert mgr.allocate_slots(r0, 1) is not None
    r0.num_computed_tokens = 9
    return mgr, r0, done


def still_serves(mgr, r0, *others):
    """Other requests keep being served and accounting stays exact."""
    r0.append_output_token_ids([32])
    assert mgr.allocate_slots(r0, 1) is not None
    for r in (r0, *others):
        mgr.free(r)
    assert mgr.num_free_blocks == mgr.num_blocks - 1


# ---------------------------------------------------------------------------------------------------------
# Specs and construction
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", BAD_INTS)
def test_window_below_1_or_not_an_int_is_refused(window):
    with pytest.raises(ValueError, match="window"):
        SlidingWindow(block_size=4, window=window)


@pytest.mark.parametrize("block_size", BAD_INTS)
@pytest.mark.parametrize("make", [lambda b: FullAttention(block_size=b),
                                  lambda b: SlidingWindow(block_size=b, window=4),
                                  lambda b: ChunkedLocalAttention(block_size=b, chunk_size=8)])
def test_block_size_below_1_or_not_an_int_is_refused(make, block_size):
    with pytest.raises(ValueError, match="block_size"):
        make(block_size)


@pytest.mark.parametrize("chunk", BAD_INTS)
def test_chunk_size_below_1_or_not_an_int_is_refused(chunk):
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkedLocalAttention(block_size=4, chunk_size=chunk)


def test_manager_construction_refuses_bad_groups_pool_and_max_model_len():
    with pytest.raises(ValueError, match="group"):
        KVCacheManager([], num_blocks=8)
    with pytest.raises(TypeError, match="FullAttention"):
        KVCacheManager([FullAttention(block_size=2), "sliding"], num_blocks=8)
    for n in (1, 0, -3, 8.0, "8"):
        with pytest.raises(ValueError, match="num_blocks"):
            KVCacheManager([FullAttention(block_size=2)], num_blocks=n)
    for m in (0, -1, 2.5):
        with pytest.raises(ValueError, match="max_model_len"):
            KVCacheManager([FullAttention(block_size=2)], num_blocks=8, max_model_len=m)


@pytest.mark.parametrize("widths, match", [
    ((1,), r"one integer >= 1 per group \(2\)"), ((1, 0), "integer >= 1"), ((1, True), "integer >= 1"),
    ((1, 2.0), "integer >= 1"), ((1, 8), r"num_blocks=8 cannot hold one block of 8 units"),
])
def test_manager_construction_refuses_bad_widths(widths, match):
    with pytest.raises(ValueError, match=match):
        KVCacheManager([FullAttention(block_size=2), SlidingWindow(block_size=2, window=4)], num_blocks=8,
                       widths=widths)
    # seven units hold one block of 7
    assert KVCacheManager([FullAttention(block_size=2)], num_blocks=8, widths=(7,)).num_free_blocks == 7


# ---------------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------------
def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="empty"):
        Request("x", [])


@pytest.mark.parametrize("tokens", [[1, -2, 3], [1, 2.0], [True, 2], [1, "2"], [None]])
def test_prompt_token_ids_must_be_non_negative_ints(tokens):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("x", tokens)


def test_token_ids_that_do_not_fit_the_int64_hash_encoding_are_refused_before_any_allocation():
    # tokens are hashed as int64: 2**63 cannot be, and must not get as far as an allocation, where the
    # hash is first computed (after blocks were taken)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("x", [1, 2 ** 63])
    r = Request("y", [1, 2 ** 63 - 1])                  # the largest int64 is a valid token id
    assert len(r.block_hashes(1)) == 2
    with pytest.raises(ValueError, match="output token ids"):
        r.append_output_token_ids([2 ** 63])
    with pytest.raises(ValueError, match="output token ids"):
        r.append_output_token_ids([3, 2 ** 64])
    assert r.all_token_ids == [1, 2 ** 63 - 1]


@pytest.mark.parametrize("rid", ["", None, 3, b"r"])
def test_request_id_must_be_a_non_empty_string(rid):
    with pytest.raises(ValueError, match="request_id"):
        Request(rid, [1, 2])


@pytest.mark.parametrize("keys, phrase", [
    (["salt"], "extra_keys must be a tuple"),
    ("salt", "extra_keys must be a tuple"),
    ((1.5,), "extra keys"),
    (({"a": 1},), "extra keys"),
    (("ok", ["no"]), "extra keys"),
])
def test_bad_extra_keys_are_refused_at_construction(keys, phrase):
    with pytest.raises(TypeError, match=phrase):
        Request("x", [1, 2], extra_keys=keys)


def test_negative_output_token_leaves_request_and_pool_unchanged():
    mgr, r0, _ = busy()
    before = snapshot(mgr, r0)
    with pytest.raises(ValueError, match="output token ids"):
        r0.append_output_token_ids([5, -1])
    assert snapshot(mgr, r0) == before
    still_serves(mgr, r0)


def test_not_a_request_is_a_type_error():
    mgr, r0, _ = busy()
    before = snapshot(mgr, r0)
    for call in (lambda: mgr.allocate_slots("r0", 1), lambda: mgr.free("r0"),
                 lambda: mgr.get_computed_blocks("r0"), lambda: mgr.preempt("r0")):
        with pytest.raises(TypeError, match="kvmanager.Request"):
            call()
    assert snapshot(mgr, r0) == before


# ---------------------------------------------------------------------------------------------------------
# Ids and lifecycle
# ---------------------------------------------------------------------------------------------------------
def test_unknown_request_id_in_get_block_ids():
    mgr, r0, done = busy()
    before = snapshot(mgr, r0)
    for rid in ("nope", "done"):                        # never seen; finished
        with pytest.raises(KeyError, match="unknown request id"):
            mgr.get_block_ids(rid)
    assert snapshot(mgr, r0) == before


def test_duplicate_request_id_is_refused_everywhere_and_the_original_keeps_running():
    mgr, r0, _ = busy()
    twin = Request("r0", [9, 9, 9])
    before = snapshot(mgr, r0, twin)
    with pytest.raises(ValueError, match="duplicate request id"):
        mgr.allocate_slots(twin, 3)
    with pytest.raises(ValueError, match="already holds blocks"):
        mgr.get_computed_blocks(twin)
    with pytest.raises(ValueError, match="holds no blocks"):
        mgr.free(twin)
    with pytest.raises(ValueError, match="holds no blocks"):
        mgr.preempt(twin)
    assert snapshot(mgr, r0, twin) == before
    still_serves(mgr, r0)


def test_token_count_beyond_max_model_len_is_refused():
    mgr, r0, _ = busy()                                 # max_model_len 16, r0 has 9 computed
    long = Request("long", list(range(17)))
    before = snapshot(mgr, r0, long)
    with pytest.raises(ValueError, match="max_model_len"):
        mgr.allocate_slots(r0, 8)                       # 9 + 8 = 17 > 16
    with pytest.raises(ValueError, match="max_model_len"):
        mgr.allocate_slots(long, 17)
    assert snapshot(mgr, r0, long) == before
    assert mgr.allocate_slots(r0, 7) is not None        # exactly 16 is fine


def test_allocating_for_or_freeing_a_freed_request_is_refused():
    mgr, r0, done = busy()
    before = snapshot(mgr, r0, done)
    with pytest.raises(ValueError, match="was freed"):
        mgr.allocate_slots(done, 1)
    with pytest.raises(ValueError, match="was freed"):
        mgr.get_computed_blocks(done)
    with pytest.raises(ValueError, match="was freed"):
        mgr.free(done)                                  # freeing twice
    with pytest.raises(ValueError, match="was freed"):
        mgr.preempt(done)
    assert snapshot(mgr, r0, done) == before
    still_serves(mgr, r0)


def test_preempting_a_request_that_holds_nothing_is_refused():
    mgr, r0, _ = busy()
    waiting = Request("w", [1, 2])
    before = snapshot(mgr, r0, waiting)
    with pytest.raises(ValueError, match="holds no blocks"):
        mgr.preempt(waiting)
    assert snapshot(mgr, r0, waiting) == before


# ---------------------------------------------------------------------------------------------------------
# Counts
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["num_new_tokens", "num_new_computed_tokens", "num_lookahead_tokens"])
@pytest.mark.parametrize("value", [-1, -100, 1.5, 1.0, "2", None, True])
def test_counts_must_be_non_negative_ints(field, value):
    mgr, r0, _ = busy()
    before = snapshot(mgr, r0)
    kwargs = {"num_new_tokens": 1, field: value}
    with pytest.raises((ValueError, TypeError), match=field):
        mgr.allocate_slots(r0, **kwargs)
    assert snapshot(mgr, r0) == before
    still_serves(mgr, r0)


# ---------------------------------------------------------------------------------------------------------
# Prefix-hit arguments
# ---------------------------------------------------------------------------------------------------------
def lookup():
    mgr, r0, done = busy()
    rq = Request("rq", [1, 2, 3, 4, 5, 6, 7, 8, 9, 40])
    hit, h = mgr.get_computed_blocks(rq)
    # at most 9 -> 8: full blocks 0..3 are done's (ids 1..4), sliding needs block 3 (tokens 6, 7)
    assert h == 8 and [len(g) for g in hit] == [4, 4] and hit[1][0].block_id == NULL_BLOCK_ID
    return mgr, r0, rq, hit


@pytest.mark.parametrize("num, blocks, phrase", [
    (6, "hit", "do not cover"),                    # 4 blocks of 2 are 8 tokens, not 6
    (10, "hit", "nothing to compute"),             # the whole prompt
    (4, "hit", "do not cover"),
    (0, "hit", "do not cover"),                    # blocks but no tokens
    (8, None, "one list per group"),               # tokens but no blocks
    (8, "one group", "one list per group"),
    (8, "short", "do not cover"),                  # a list one block short
])
def test_hit_blocks_that_do_not_match_num_new_computed_tokens(num, blocks, phrase):
    mgr, r0, rq, hit = lookup()
    arg = {"hit": hit, None: None, "one group": hit[:1], "short": (hit[0], hit[1][:3])}[blocks]
    before = snapshot(mgr, r0, rq)
    with pytest.raises(ValueError, match=phrase):
        mgr.allocate_slots(rq, 1, num_new_computed_tokens=num, new_computed_blocks=arg)
    assert snapshot(mgr, r0, rq) == before
    assert mgr.allocate_slots(rq, 2, num_new_computed_tokens=8, new_computed_blocks=hit) is not None
    still_serves(mgr, r0, rq)


def test_hit_for_a_running_request_is_refused():
    mgr, r0, rq, hit = lookup()
    assert mgr.allocate_slots(rq, 2, num_new_computed_tokens=8, new_computed_blocks=hit) is not None
    rq.num_computed_tokens = 10
    before = snapshot(mgr, r0, rq)
    with pytest.raises(ValueError, match="before its first computed token"):
        mgr.allocate_slots(rq, 0, num_new_computed_tokens=8, new_computed_blocks=hit)
    assert snapshot(mgr, r0, rq) == before


def test_hit_lists_of_block_ids_instead_of_blocks_are_refused_naming_the_field():
    mgr, r0, rq, hit = lookup()
    as_ids = tuple([b.block_id for b in g] for g in hit)
    before = snapshot(mgr, r0, rq)
    with pytest.raises((ValueError, TypeError), match="new_computed_blocks"):
        mgr.allocate_slots(rq, 2, num_new_computed_tokens=8, new_computed_blocks=as_ids)
    assert snapshot(mgr, r0, rq) == before


def test_a_hit_whose_blocks_were_reused_since_the_lookup_is_refused():
    """Between lookup and allocation another request takes the hit's free blocks for new content; using
    them would read that request's KV as this prompt's."""
    mgr = KVCacheManager([FullAttention(block_size=2)], num_blocks=5)             # ids 1..4
    a = Request("a", [1, 2, 3, 4, 5])
    assert mgr.allocate_slots(a, 5) == ([1, 2, 3],)
    a.num_computed_tokens = 5
    mgr.free(a)                                        # queue [4, 3, 2, 1]
    rq = Request("rq", [1, 2, 3, 4, 5])
    hit, h = mgr.get_computed_blocks(rq)
    assert h == 4 and [b.block_id for b in hit[0]] == [1, 2]
    other = Request("other", [7] * 8)
    assert mgr.allocate_slots(other, 8) == ([4, 3, 2, 1],)   # 1, 2 now hold other's tokens
    before = snapshot(mgr, other, rq)
    with pytest.raises(ValueError, match="new_computed_blocks"):
        mgr.allocate_slots(rq, 1, num_new_computed_tokens=4, new_computed_blocks=hit)
    assert snapshot(mgr, other, rq) == before


# ---------------------------------------------------------------------------------------------------------
# Allocation that does not fit
# ---------------------------------------------------------------------------------------------------------
def test_allocation_that_does_not_fit_returns_none_without_dropping():
    mgr = KVCacheManager([SlidingWindow(block_size=1, window=2)], num_blocks=5)   # ids 1..4
    r = Request("r", list(range(8)))
    assert mgr.allocate_slots(r, 4) == ([1, 2, 3, 4],)
    r.num_computed_tokens = 4
    before = snapshot(mgr, r)
    # n=4: the drop would free blocks 0..2 (first needed 3): 3 free, but 4 new tokens need 4
    assert mgr.allocate_slots(r, 4) is None
    assert snapshot(mgr, r) == before
    assert mgr.get_block_ids("r") == ([1, 2, 3, 4],)
    # 3 fit: 1, 2, 3 dropped (below no fork, not below the prompt end: unreachable), reused in order
    assert mgr.allocate_slots(r, 3) == ([1, 2, 3],)
    assert mgr.get_block_ids("r") == ([0, 0, 0, 4, 1, 2, 3],)


def test_hit_that_does_not_fit_returns_none_and_leaves_its_blocks_cached_in_the_queue():
    mgr = KVCacheManager([FullAttention(block_size=2), SlidingWindow(block_size=2, window=3)], num_blocks=11)
    a = Request("a", [1, 2, 3, 4, 5])
    assert mgr.allocate_slots(a, 5) == ([1, 2, 3], [4, 5, 6])
    a.num_computed_tokens = 5
    hog = Request("hog", [9, 9, 9])
    assert mgr.allocate_slots(hog, 3) == ([7, 8], [9, 10])
    mgr.free(a)                                        # queue [3, 2, 1, 6, 5, 4]
    rq = Request("rq", [1, 2, 3, 4, 10, 11, 12, 13, 14, 15])
    hit, h = mgr.get_computed_blocks(rq)
    # full blocks 0, 1 cached (block 2 of a held only token 5); sliding h=4 needs block 1 (id 5)
    assert h == 4 and [[b.block_id for b in g] for g in hit] == [[1, 2], [0, 5]]
    before = snapshot(mgr, hog, rq)
    # 6 more tokens: full ceil(10/2) - 2 = 3 new, sliding 3 new, and the 3 hit blocks leave the queue:
    # 9 > 6 free
    assert mgr.allocate_slots(rq, 6, num_new_computed_tokens=4, new_computed_blocks=hit) is None
    assert snapshot(mgr, hog, rq) == before
    # 2 more tokens: 1 + 1 + 3 = 5 <= 6; the queue without the hit blocks is [3, 6, 4]
    assert mgr.allocate_slots(rq, 2, num_new_computed_tokens=4, new_computed_blocks=hit) == ([1, 2, 3],
                                                                                            [0, 5, 6])
    assert mgr.num_free_blocks == 1


def test_decode_that_does_not_fit_in_a_hybrid_pool_changes_nothing():
    mgr = KVCacheManager([FullAttention(block_size=1), SlidingWindow(block_size=1, window=4)], num_blocks=9)
    r = Request("r", [1, 2, 3, 4])
    assert mgr.allocate_slots(r, 4) == ([1, 2, 3, 4], [5, 6, 7, 8])
    r.num_computed_tokens = 4
    r.append_output_token_ids([5])
    before = snapshot(mgr, r)
    # n=4, W=4: first needed 1 -> sliding drops block 0 (id 5): 1 freed; the step needs 2 (one per group)
    assert mgr.allocate_slots(r, 1) is None
    assert snapshot(mgr, r) == before
    assert mgr.get_block_ids("r") == ([1, 2, 3, 4], [5, 6, 7, 8])
