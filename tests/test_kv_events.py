"""KV-cache events and the router's index: what a data-parallel router knows of each replica's cache.

The index a consumer builds from a replica's event batches must equal the set of hashes the replica's
manager can hit, per group, after any trace: prefills, decodes whose windows drop blocks (they stay
cached: no event), evictions by reuse, composites dissolved for another kind, preemptions, worker
restarts (cache reset), and consumers that fall behind and load a snapshot. Traces run through the real
engine (scheduler + manager) over a simulated worker, on small versions of the layouts real models have.
"""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.engine.engine import Engine, EngineConfig
from cluster.engine.kv_events import EventPublisher, decode_batch, group_metadata, specs_from_metadata
from cluster.routing.kv_index import Gap, KVIndex
from cluster.engine.types import SamplingParams
from kvmanager import ChunkedLocalAttention, FullAttention, KVCacheManager, Request, SlidingWindow
from kvmanager.hashing import hash_blocks, root_hash
from kvmanager.host_tier import HostRef

from drivers import SimulatedExecutor

VOCAB = 4   # a small alphabet: prompts and outputs share prefixes often

# Small versions of the layouts that matter (kinds, ratios of layers as widths, windows > blocks).
LAYOUTS = {
    "gemma-3": ([SlidingWindow(block_size=4, window=16), FullAttention(block_size=4)], [5, 1]),
    "gpt-oss": ([FullAttention(block_size=4), SlidingWindow(block_size=4, window=8)], [1, 1]),
    "mistral": ([SlidingWindow(block_size=4, window=12)], [1]),
    "llama-4": ([ChunkedLocalAttention(block_size=4, chunk_size=16), FullAttention(block_size=4)], [3, 1]),
}


def make_engine(layout: str, num_blocks: int, budget: int = 16) -> Engine:
    specs, widths = LAYOUTS[layout]
    return Engine(SimulatedExecutor(specs, num_blocks, widths, VOCAB), specs, num_blocks,
                  EngineConfig(max_model_len=200, max_num_batched_tokens=budget, vocab_size=VOCAB),
                  group_widths=widths)


def cached_sets(manager: KVCacheManager) -> list[set[bytes]]:
    """The manager's own answer: per group, the hashes a prefix hit can find."""
    return [set(c) for c in manager.pool._cached]


def known(index: KVIndex, num_groups: int) -> list[set[bytes]]:
    return [set(index.cached(g)) for g in range(num_groups)]


def assert_tokens_give_the_hashes(payload: bytes) -> None:
    """A consumer with only the events can recompute every stored hash from the event's tokens."""
    for e in decode_batch(payload)[1]:
        if e["type"] == "BlockStored":
            assert len(e["token_ids"]) == e["block_size"] * len(e["block_hashes"])
            parent = e["parent_block_hash"] if e["parent_block_hash"] is not None else root_hash()
            assert hash_blocks(parent, e["token_ids"], e["block_size"]) == e["block_hashes"]


def follow(index: KVIndex, pub: EventPublisher) -> None:
    """What ``EngineService.kv_events`` gives a consumer: the batches it lacks, or a snapshot."""
    batches = pub.since(index.seq) if index.synced and index.epoch == pub.epoch else None
    if batches is None:
        seq, payload = pub.snapshot()
        assert_tokens_give_the_hashes(payload)
        index.load(pub.epoch, seq, payload)
    else:
        for seq, payload in batches:
            assert_tokens_give_the_hashes(payload)
            index.apply(seq, payload)


# -- the exact semantics, by hand ----------------------------------------------------------------------
def test_a_block_that_leaves_the_window_stays_cached_and_makes_no_event_until_it_is_reused():
    spec = SlidingWindow(block_size=2, window=4)
    mgr = KVCacheManager([spec], num_blocks=8, max_model_len=100)   # 7 usable blocks
    pub = EventPublisher(mgr.specs)
    pub.attach(mgr)
    index = KVIndex()
    follow(index, pub)                                          # the attach's AllBlocksCleared: empty
    a = Request("a", [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2])         # 11 tokens: 5 full blocks
    hashes = a.block_hashes(2)
    assert mgr.allocate_slots(a, 11) is not None
    a.num_computed_tokens = 11
    assert pub.flush()
    _, events, rank = decode_batch(pub._batches[-1][1])
    assert rank == 0 and [e["type"] for e in events] == ["BlockStored"]
    assert events[0]["block_hashes"] == hashes and events[0]["parent_block_hash"] is None
    assert events[0]["token_ids"] == [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]             # its 5 full blocks' tokens
    assert (events[0]["block_index"], events[0]["block_size"], events[0]["group_idx"]) == (0, 2, 0)
    assert (events[0]["kv_cache_spec_kind"], events[0]["kv_cache_spec_sliding_window"]) == ("sliding_window", 4)
    follow(index, pub)
    assert index.groups == [set(hashes)]

    # decode at position 11: the window needs 8.. so blocks 0-3 are dropped; token 11 fills block 5
    a.append_output_token_ids([3])
    assert mgr.allocate_slots(a, 1) == ([],)
    assert mgr.get_block_ids("a")[0][:4] == [0, 0, 0, 0]
    assert pub.flush()
    _, events, _ = decode_batch(pub._batches[-1][1])            # dropped, still cached: no BlockRemoved
    assert [(e["type"], e["block_index"], e["parent_block_hash"]) for e in events] == [("BlockStored", 5, hashes[4])]
    hashes = a.block_hashes(2)
    follow(index, pub)
    assert index.groups == [set(hashes)] == cached_sets(mgr) and len(hashes) == 6

    # a new request takes two blocks: the never-filled one first (nothing cached goes while an empty block
    # is free), then one dropped block that no plausible hit reaches (below no fork and no prompt end)
    b = Request("b", [0, 0, 0, 0])
    assert mgr.allocate_slots(b, 4) is not None
    assert pub.flush()
    follow(index, pub)
    _, events, _ = decode_batch(pub._batches[-1][1])
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    stored = [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]
    assert len(removed) == 1 and set(removed) <= set(hashes[:2])
    assert stored == b.block_hashes(2)
    assert index.groups == cached_sets(mgr) and len(index.groups[0]) == 6 - 1 + 2

    assert mgr.reset_prefix_cache() is False                    # refused while requests hold blocks: no event
    assert not pub.flush()
    mgr.free(a)
    mgr.free(b)
    assert mgr.reset_prefix_cache() is True
    assert pub.flush()
    assert [e["type"] for e in decode_batch(pub._batches[-1][1])[1]] == ["AllBlocksCleared"]
    follow(index, pub)
    assert index.groups == [set()]


def test_equal_content_in_two_blocks_is_one_hash_stored_once_and_removed_with_the_last_block():
    mgr = KVCacheManager([FullAttention(block_size=2)], num_blocks=3, max_model_len=100)   # 2 usable blocks
    pub = EventPublisher(mgr.specs)
    pub.attach(mgr)
    index = KVIndex()
    for rid in ("x", "y"):   # both compute the same 2-token block at once: no hit, two blocks, one hash
        mgr.allocate_slots(Request(rid, [1, 2, 3]), 3)
    follow(index, pub)
    _, events, _ = decode_batch(pub._batches[-1][1])
    assert sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockStored") == 1
    assert len(index.groups[0]) == 1 and index.groups == cached_sets(mgr)


def test_a_consumer_that_misses_batches_gets_a_snapshot_and_a_gap_is_refused():
    mgr = KVCacheManager([FullAttention(block_size=2), SlidingWindow(block_size=2, window=3)], num_blocks=40,
                         max_model_len=100)
    pub = EventPublisher(mgr.specs, rank=2, keep_batches=2)
    pub.attach(mgr)
    assert pub.flush() and pub.seq == 1                  # batch 1: AllBlocksCleared
    late = KVIndex()
    for i in range(5):
        mgr.allocate_slots(Request(f"r{i}", [i, i, 1, 1, 2]), 5)
        pub.flush()
    assert pub.seq == 6 and pub.since(3) is None and [s for s, _ in pub.since(4)] == [5, 6]
    assert pub.since(7) is None                          # a number it never gave
    with pytest.raises(Gap):
        late.apply(6, pub._batches[-1][1])               # nothing applied before: no base to apply onto
    follow(late, pub)                                    # -> a snapshot numbered like the last batch
    assert (late.seq, late.snapshots, late.groups) == (6, 1, cached_sets(mgr))
    ts, events, rank = decode_batch(pub.snapshot()[1])
    assert rank == 2 and events[0] == {"type": "AllBlocksCleared"}
    # the snapshot keeps each request's chain as one event, with its parent and first index
    assert sorted((e["group_idx"], e["block_index"], len(e["block_hashes"])) for e in events[1:]) == \
        [(0, 0, 2)] * 5 + [(1, 0, 2)] * 5


def test_the_schema_follows_vllm_names_and_the_layout_round_trips():
    specs, _ = LAYOUTS["llama-4"]
    meta = group_metadata(specs + [SlidingWindow(block_size=8, window=100)])
    assert meta[0] == {"group_idx": 0, "kind": "chunked_local_attention", "block_size": 4, "sliding_window": None,
                       "attention_chunk_size": 16}
    assert [m["kind"] for m in meta] == ["chunked_local_attention", "full_attention", "sliding_window"]
    assert specs_from_metadata(meta) == specs + [SlidingWindow(block_size=8, window=100)]
    pub = EventPublisher(specs)
    pub.stored(1, b"h" * 32, None, 0, [5, 6, 7, 8])
    pub.stored(1, b"i" * 32, b"h" * 32, 1, [9, 10, 11, 12])      # the chain goes on: one event
    pub.removed(1, b"h" * 32)
    pub.flush()
    ts, events, rank = msgpack.unpackb(pub._batches[-1][1], raw=False)    # plain msgpack: [ts, events, rank]
    assert isinstance(ts, float) and rank == 0
    assert events == [
        {"type": "BlockStored", "block_hashes": [b"h" * 32, b"i" * 32], "parent_block_hash": None,
         "token_ids": [5, 6, 7, 8, 9, 10, 11, 12],
         "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 1,
         "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": None,
         "kv_cache_spec_attention_chunk_size": None, "block_index": 0},
        {"type": "BlockRemoved", "block_hashes": [b"h" * 32], "medium": "GPU", "group_idx": 1}]


# -- random traces through the engine --------------------------------------------------------------------
SHARED = [[1, 2, 3, 0] * 5, [2, 2, 1] * 7, [3, 1] * 9]      # shared prefixes (system prompts, documents)
OP = st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(SHARED)), st.lists(st.integers(0, VOCAB - 1), max_size=20),
              st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("restart"),),
    st.tuples(st.just("poll"),),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(sorted(LAYOUTS)), num_blocks=st.integers(40, 120), keep=st.integers(1, 4),
       ops=st.lists(OP, min_size=1, max_size=60))
def test_the_index_built_from_events_equals_the_managers_cached_set_after_any_trace(layout, num_blocks, keep, ops):
    engine = make_engine(layout, num_blocks)
    n = len(engine.manager.specs)
    pub = EventPublisher(engine.manager.specs, keep_batches=keep)
    pub.attach(engine.manager)
    eager, lazy = KVIndex(), KVIndex()      # one applies every batch; one polls now and then (snapshots)
    ids = 0
    for op in ops:
        if op[0] == "add":
            _, shared, text, max_tokens = op
            prompt = (SHARED[shared] if shared < len(SHARED) else []) + text
            ids += 1
            try:
                engine.add_request(f"r{ids}", prompt, SamplingParams(max_tokens=max_tokens))
            except ValueError:      # empty, or more than the pool could ever hold: refused, nothing changed
                pass
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
        elif op[0] == "abort":
            running = list(engine.scheduler.sequences)
            if running:
                engine.abort(running[op[1] % len(running)])
        elif op[0] == "restart":    # what a worker failure does: workers replaced, the cache reset
            engine.executor.restart()
            engine.after_restart()
        pub.flush()
        follow(eager, pub)
        assert known(eager, n) == cached_sets(engine.manager)
        if op[0] == "poll":
            follow(lazy, pub)
            assert known(lazy, n) == cached_sets(engine.manager)
    while engine.has_work():                 # the rest of the trace: everything finishes
        engine.step()
        pub.flush()
    follow(eager, pub)
    follow(lazy, pub)
    assert known(eager, n) == known(lazy, n) == cached_sets(engine.manager)


# -- the host tier: medium "CPU" ------------------------------------------------------------------------
def host_sets(manager: KVCacheManager) -> list[set[bytes]]:
    """The host tier's own answer: per group, the hashes whose stored copy a lookup may use."""
    return [set(e) for e in manager.host_tier.entries]


def events_of(pub: EventPublisher) -> list[tuple]:
    """The last batch as (type, medium, group, hashes, block index, tokens) tuples."""
    return [(e["type"], e.get("medium"), e.get("group_idx"), e.get("block_hashes"), e.get("block_index"),
             e.get("token_ids")) for e in decode_batch(pub._batches[-1][1])[1]]


def host_tier_setup():
    """Full attention + sliding window 4, blocks of 2 tokens, 8 device units and 8 host units storing only
    what known hits need; its publisher attached, and an empty index to follow it."""
    mgr = KVCacheManager([FullAttention(block_size=2), SlidingWindow(block_size=2, window=4)], num_blocks=9,
                         num_host_blocks=8, last_message_tokens=0, max_model_len=100,
                         host_speculative_stores=False)
    pub = EventPublisher(mgr.specs)
    pub.attach(mgr)
    return mgr, pub, KVIndex()


def test_a_store_to_host_is_announced_with_medium_cpu_once_fenced_and_a_host_eviction_removes_it():
    mgr, pub, index = host_tier_setup()
    follow(index, pub)
    a = Request("a", [1, 2, 3, 4, 5, 6, 7, 8])                  # 4 blocks per group
    h = a.block_hashes(2)
    mgr.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    assert pub.flush()
    assert events_of(pub) == [("BlockStored", "GPU", g, h, 0, [1, 2, 3, 4, 5, 6, 7, 8]) for g in (0, 1)]
    mgr.free(a)
    stores = mgr.take_transfers().stores
    # stored: every full block; the sliding group's window below the end (tokens 5.. : blocks 2, 3) and
    # below the prompt's end (the hit at 6 needs tokens 3..: blocks 1, 2); block 0 is not stored
    assert sorted((g, dev) for g, dev, _ in stores) == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 6), (1, 7), (1, 8)]
    assert not pub.flush()                                      # nothing is on host until the copy is fenced
    mgr.transfers_done([dev for _, dev, _ in stores])   # fenced as scheduled, tail first: one event per group
    assert pub.flush()
    assert events_of(pub) == [("BlockStored", "CPU", 0, h, 0, [1, 2, 3, 4, 5, 6, 7, 8]),
                              ("BlockStored", "CPU", 1, h[1:], 1, [3, 4, 5, 6, 7, 8])]
    follow(index, pub)
    assert index.groups == [set(h)] * 2 == cached_sets(mgr)     # the device still holds them all
    assert index.host == [set(h), set(h[1:])] == host_sets(mgr)

    # another request of 8 tokens takes every device unit: A is on host only
    b = Request("b", [11, 12, 13, 14, 15, 16, 17, 18])
    mgr.allocate_slots(b, 8)
    b.num_computed_tokens = 8
    pub.flush()
    follow(index, pub)
    assert index.groups == [set(b.block_hashes(2))] * 2 == cached_sets(mgr)
    assert index.host == [set(h), set(h[1:])]
    # B finishes: its 7 blocks a hit needs go to host, which holds 8 units: one is free, and A's 6 least
    # recently used blocks are evicted (stored tail first: (0, h3..h0), (1, h3..h1)); (1, h1) stays
    mgr.free(b)
    stores = mgr.take_transfers().stores
    assert len(stores) == 7
    mgr.transfers_done([dev for _, dev, _ in stores])
    pub.flush()
    hb = b.block_hashes(2)
    assert events_of(pub) == [("BlockRemoved", "CPU", 0, h[::-1], None, None),
                              ("BlockRemoved", "CPU", 1, [h[3], h[2]], None, None),
                              ("BlockStored", "CPU", 0, hb, 0, [11, 12, 13, 14, 15, 16, 17, 18]),
                              ("BlockStored", "CPU", 1, hb[1:], 1, [13, 14, 15, 16, 17, 18])]
    follow(index, pub)
    assert index.host == [set(hb), set(hb[1:]) | {h[1]}] == host_sets(mgr)
    assert index.groups == [set(hb)] * 2 == cached_sets(mgr)

    # the host memory is lost (its process restarted): every host copy is removed, the device keeps its own
    assert mgr.host_tier_lost() == []
    pub.flush()
    assert {e[:2] for e in events_of(pub)} == {("BlockRemoved", "CPU")}
    gone = [sorted(x for e in events_of(pub) if e[2] == g for x in e[3]) for g in (0, 1)]
    assert gone == [sorted(hb), sorted(hb[1:] + [h[1]])]
    follow(index, pub)
    assert index.host == [set(), set()] and index.groups == [set(hb)] * 2 == cached_sets(mgr)


def test_a_restored_block_is_announced_on_the_device_with_its_tokens_and_a_reset_clears_both_media():
    mgr, pub, index = host_tier_setup()
    a = Request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    h = a.block_hashes(2)
    mgr.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    mgr.free(a)
    mgr.transfers_done([dev for _, dev, _ in mgr.take_transfers().stores])
    b = Request("b", [11, 12, 13, 14, 15, 16, 17, 18])
    mgr.allocate_slots(b, 8)                    # evicts A from the device
    b.num_computed_tokens = 8
    mgr.preempt(b)                              # a preempted request stores nothing
    assert not mgr.take_transfers()
    pub.flush()
    follow(index, pub)
    c = Request("c", a.prompt_token_ids + [9])
    hit, got = mgr.get_computed_blocks(c)
    assert got == 8                             # full: blocks 0-3 on host; sliding: the window, blocks 2, 3
    mgr.allocate_slots(c, 0, got, hit)
    loads = mgr.take_transfers().loads
    assert sorted((g, host_units) for g, host_units, _ in loads) == \
        [(0, (0,)), (0, (1,)), (0, (2,)), (0, (3,)), (1, (4,)), (1, (5,))]   # 6 loads: all but sliding 0, 1
    pub.flush()
    assert not [e for e in events_of(pub) if e[0] == "BlockStored"]   # not cached before the copy is fenced
    mgr.transfers_done(sorted(dev for _, _, dev in loads))
    pub.flush()
    assert events_of(pub) == [("BlockStored", "GPU", 0, h, 0, [1, 2, 3, 4, 5, 6, 7, 8]),
                              ("BlockStored", "GPU", 1, h[2:], 2, [5, 6, 7, 8])]
    assert_tokens_give_the_hashes(pub._batches[-1][1])
    follow(index, pub)
    assert index.groups == cached_sets(mgr) and index.host == host_sets(mgr) == [set(h), set(h[1:])]
    mgr.preempt(c)
    assert mgr.reset_prefix_cache() is True
    pub.flush()
    assert events_of(pub) == [("AllBlocksCleared", None, None, None, None, None)]   # covers both media
    follow(index, pub)
    assert index.groups == [set(), set()] == index.host == host_sets(mgr)


HOST_OP = st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(SHARED)), st.lists(st.integers(0, VOCAB - 1), max_size=16)),
    st.tuples(st.just("compute"), st.integers(0, 50)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.integers(0, 50)),
    st.tuples(st.just("fence"), st.lists(st.integers(0, 2), max_size=30)),   # per copy: done, failed, later
    st.tuples(st.just("host_lost"),),
    st.tuples(st.just("reset"),),
    st.tuples(st.just("poll"),),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(sorted(LAYOUTS)), num_blocks=st.integers(30, 90), host=st.integers(6, 60),
       keep=st.integers(1, 4), ops=st.lists(HOST_OP, min_size=1, max_size=50))
def test_with_a_host_tier_the_index_holds_exactly_what_each_tier_can_hit_after_any_trace(layout, num_blocks, host,
                                                                                      keep, ops):
    """Copies fenced late, out of order, failed or lost with the host memory: after every operation the
    index's device sets equal the pool's cached hashes and its host sets the tier's usable copies."""
    specs, widths = LAYOUTS[layout]
    mgr = KVCacheManager(specs, num_blocks, max_model_len=200, widths=widths, num_host_blocks=host * max(widths))
    n = len(specs)
    pub = EventPublisher(mgr.specs, keep_batches=keep)
    pub.attach(mgr)
    eager, lazy = KVIndex(), KVIndex()
    running: list[Request] = []          # admitted: holding blocks, their hit (and loads) allocated
    in_flight: list[int] = []            # device block ids with a copy scheduled and not yet reported
    ids = 0

    def pick(i):
        return running[i % len(running)] if running else None

    for op in ops:
        if op[0] == "add":
            ids += 1
            req = Request(f"r{ids}", (SHARED[op[1]] if op[1] < len(SHARED) else []) + op[2] + [ids % VOCAB])
            hit, h = mgr.get_computed_blocks(req)
            loads = any(type(b) is HostRef for g in hit for b in g)
            if mgr.allocate_slots(req, 0 if loads else req.num_tokens - h, h, hit) is not None:
                req.num_computed_tokens = h if loads else req.num_tokens
                running.append(req)
        elif op[0] == "compute":     # a request whose loads are in computes the rest of its prompt
            req = pick(op[1])
            if req is not None and not mgr.is_loading(req.request_id) and req.num_computed_tokens < req.num_tokens:
                if mgr.allocate_slots(req, req.num_tokens - req.num_computed_tokens) is not None:
                    req.num_computed_tokens = req.num_tokens
        elif op[0] in ("finish", "preempt"):
            req = pick(op[1])
            if req is not None:
                running.remove(req)
                (mgr.free if op[0] == "finish" else mgr.preempt)(req)
        elif op[0] == "fence":
            t = mgr.take_transfers()
            in_flight += [d for _, d, _ in t.stores] + [d for _, _, d in t.loads]
            fate = {d: op[1][i] if i < len(op[1]) else 0 for i, d in enumerate(reversed(in_flight))}
            lost = mgr.transfers_done([d for d in in_flight if fate[d] == 0], [d for d in in_flight if fate[d] == 1])
            in_flight = [d for d in in_flight if fate[d] == 2]
            running = [r for r in running if r.request_id not in lost]
        elif op[0] == "host_lost":
            t = mgr.take_transfers()
            lost = mgr.host_tier_lost()
            in_flight = []
            running = [r for r in running if r.request_id not in lost]
        elif op[0] == "reset":
            mgr.reset_prefix_cache()       # refused while anything is held or a copy is in flight
        pub.flush()
        follow(eager, pub)
        assert known(eager, n) == cached_sets(mgr)
        assert [set(eager.on_host(g)) for g in range(n)] == host_sets(mgr)
        if op[0] == "poll":
            follow(lazy, pub)
            assert known(lazy, n) == cached_sets(mgr) and [set(lazy.on_host(g)) for g in range(n)] == host_sets(mgr)
    follow(lazy, pub)
    assert [set(lazy.on_host(g)) for g in range(n)] == host_sets(mgr) and known(lazy, n) == cached_sets(mgr)


def test_the_index_keeps_each_medium_apart_reads_a_missing_medium_as_gpu_and_skips_other_tiers():
    def batch(*events):
        return msgpack.packb([0.0, list(events), 0], use_bin_type=True)

    index = KVIndex()
    index.load("e", 1, batch({"type": "AllBlocksCleared"}))
    index.apply(2, batch(
        {"type": "BlockStored", "block_hashes": [b"a", b"b"], "medium": "GPU", "group_idx": 1},
        {"type": "BlockStored", "block_hashes": [b"b", b"c"], "medium": "CPU", "group_idx": 1},
        {"type": "BlockStored", "block_hashes": [b"d"], "medium": None, "group_idx": 0},       # vLLM's None: device
        {"type": "BlockStored", "block_hashes": [b"e"], "medium": "STORAGE", "group_idx": 0},  # a tier not scored
        {"type": "BlockRemoved", "block_hashes": [b"b"], "medium": "CPU", "group_idx": 1}))
    assert (index.groups, index.host) == ([{b"d"}, {b"a", b"b"}], [set(), {b"c"}])
    assert index.cached(1) == {b"a", b"b"} and index.on_host(1) == {b"c"} and index.on_host(5) == frozenset()
    index.apply(3, batch({"type": "AllBlocksCleared"}))                    # both media
    assert (index.groups, index.host) == ([set(), set()], [set(), set()])
