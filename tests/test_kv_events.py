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
