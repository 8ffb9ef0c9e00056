"""SimulatedWorker: mirrors fed by the real KVCacheManager's deltas, strict checks, seeded tokens, step times."""
import pytest

from kvmanager import FullAttention, KVCacheManager, Request, SlidingWindow
from kvmanager.planning import kv_layout
from workers.sim.cost_model import StepCostModel
from workers.sim.presets import layer_specs
from workers.protocol import GREEDY, RequestStart, SamplingSpec, ScheduledChunk, StepInput
from workers.sim.simulated import SimulatedWorker

HYBRID = [FullAttention(4), SlidingWindow(4, window=8)]


def drive(mgr, worker, prompts, num_steps, chunk=512):
    """A minimal engine loop: prefill in chunks, then decode; yields each step's (output, requests)."""
    reqs = [Request(rid, prompt) for rid, prompt in prompts]
    hits = {}
    for step_id in range(num_steps):
        chunks, scheduled = [], []
        for req in reqs:
            if req.num_computed_tokens == 0:
                hit, h = mgr.get_computed_blocks(req)
            else:
                hit, h = None, 0
            start = req.num_computed_tokens + h
            n = min(chunk, req.num_tokens - start)
            new = mgr.allocate_slots(req, n, num_new_computed_tokens=h, new_computed_blocks=hit)
            assert new is not None, "the test pool is large enough"
            hits[req.request_id] = hits.get(req.request_id, 0) + h
            sample = start + n == req.num_tokens
            chunks.append(ScheduledChunk(req.request_id, req.all_token_ids[start:start + n], start,
                                         [list(g) for g in new], sample))
            scheduled.append((req, h + n, sample))
        out = worker.execute(StepInput(step_id, chunks))
        for req, advance, sample in scheduled:
            req.num_computed_tokens += advance
            if sample:
                req.append_output_token_ids([out.sampled[req.request_id]])
        yield out, reqs, hits


def test_sliding_only_preset_holds_exactly_the_plans_bound():
    # mistral-7b-v0.1: 32 sliding layers, W = 4096, B = 16 -> one group.
    specs = kv_layout(layer_specs("mistral-7b-v0.1")).group_specs
    assert [s.window for s in specs] == [4096]
    mgr = KVCacheManager(specs, num_blocks=400, max_model_len=8192)
    worker = SimulatedWorker.for_model("mistral-7b-v0.1", "H100-80GB", num_blocks=400, seed=3)
    prompt = [7] * 4100                         # 8 chunks of 512, then 4 tokens, then decode
    peak_prefill = peak_decode = 0
    for out, (req,), _ in drive(mgr, worker, [("r", prompt)], 9 + 300):
        (in_use,) = worker.blocks_in_use("r")
        (table,) = mgr.get_block_ids("r")
        assert in_use == [b for b in table if b != 0]       # the mirror's live blocks are what the manager holds
        assert out.simulated_time_s > 0
        if len(req.output_token_ids) <= 1:
            peak_prefill = max(peak_prefill, len(in_use))
        else:
            peak_decode = max(peak_decode, len(in_use))
    assert req.num_computed_tokens == 4100 + 300
    # Decode bound ceil((W - 1) / B) + 1 = ceil(4095 / 16) + 1 = 257, reached once the window is unaligned.
    assert peak_decode == 257
    # Prefill bound with 512-token chunks: ceil((4095 + 512 - 1) / 16) + 1 = 289. This prompt's widest
    # prefill step is its last (4 tokens from 4096, reading from position 1): blocks 0..256.
    assert peak_prefill == 257 <= 289
    plan = kv_layout(layer_specs("mistral-7b-v0.1"))
    assert plan.blocks_per_request(32768) == 257 and plan.blocks_per_request(32768, 512) == 289


def _tokens(worker_seed, prompts, steps=12):
    mgr = KVCacheManager(HYBRID, num_blocks=200)
    worker = SimulatedWorker(HYBRID, 200, vocab_size=1000, seed=worker_seed)
    outs = [out.sampled for out, _, _ in drive(mgr, worker, prompts, steps, chunk=5)]
    return outs


def test_deterministic_for_a_seed_and_replayable():
    prompts = [("a", list(range(1, 14))), ("b", list(range(1, 10)) + [99, 98])]
    first, again, other = _tokens(7, prompts), _tokens(7, prompts), _tokens(8, prompts)
    assert first == again
    assert first != other
    # a (13 tokens, chunks of 5) samples from its third step on; b hits a's first block (cached when a
    # allocated it in step 0) and samples from its second.
    assert [sum(rid in s for s in first) for rid in "ab"] == [10, 11]
    # A fresh worker (after a fault) re-running one request produces the same token at the same position.
    w1, w2 = (SimulatedWorker(HYBRID, 200, vocab_size=1000, seed=7) for _ in range(2))
    seeded = RequestStart(SamplingSpec(seed=5), 3)
    chunk = ScheduledChunk("a", [1, 2, 3], 0, [[1], [2]], sample=True, start=seeded)
    assert w1.execute(StepInput(0, [chunk])).sampled == w2.execute(StepInput(9, [chunk])).sampled
    # Seeded requests differ by their seeds, not their ids (the engine names requests itself, uniquely),
    # so a client can recompute them; unseeded ones differ by their ids.
    assert [w1.sample(ScheduledChunk("a", [1], p, [[], []], start=seeded)) for p in range(8)] != \
           [w1.sample(ScheduledChunk("a", [1], p, [[], []], start=RequestStart(SamplingSpec(seed=6), 3)))
            for p in range(8)]
    assert [w1.sample(ScheduledChunk("a#1", [1], p, [[], []], start=seeded)) for p in range(8)] == \
           [w1.sample(ScheduledChunk("z#2", [1], p, [[], []], start=seeded)) for p in range(8)]
    unseeded = RequestStart(SamplingSpec(), 3)
    assert [w1.sample(ScheduledChunk("a#1", [1], p, [[], []], start=unseeded)) for p in range(8)] != \
           [w1.sample(ScheduledChunk("z#2", [1], p, [[], []], start=unseeded)) for p in range(8)]


def test_sampling_specs_live_with_the_mirror_and_logprobs_are_uniform():
    w = SimulatedWorker(HYBRID, 200, vocab_size=1000, seed=7)
    spec = SamplingSpec(temperature=1.0, seed=5, logprobs=2)
    first = w.execute(StepInput(0, [ScheduledChunk("a", [1, 2, 3], 0, [[1], [2]], start=RequestStart(spec, 3))]))
    token = first.sampled["a"]
    assert first.logprobs == {"a": (pytest.approx(-6.907755), [token, (token + 1) % 1000], [pytest.approx(-6.907755)] * 2)}
    second = w.execute(StepInput(1, [ScheduledChunk("a", [token], 3, [[], []])]))   # no start: the kept spec
    assert set(second.logprobs) == {"a"}
    w.execute(StepInput(2, [ScheduledChunk("a", [1, 2, 3], 0, [[3], [4]])], forget=["a"]))   # recomputed, no start
    assert w.execute(StepInput(3, [ScheduledChunk("a", [9], 3, [[], []])])).logprobs == {}   # greedy defaults


def test_prefix_hit_first_chunk_starts_after_the_hit():
    mgr = KVCacheManager(HYBRID, num_blocks=200)
    worker = SimulatedWorker(HYBRID, 200, vocab_size=1000)
    shared = list(range(1, 30))
    list(drive(mgr, worker, [("a", shared + [40])], 4, chunk=8))     # a's prefill: its window still holds 16..
    steps = list(drive(mgr, worker, [("b", shared + [50, 51])], 3, chunk=8))
    assert steps[-1][2]["b"] == 28               # 7 blocks of 4 hit
    full, window = worker.block_table("b")
    # The window (8) at position 28 reads from 21: the first chunk carries 5 leading nulls, then real blocks.
    assert window[:5] == [0] * 5 and 0 not in window[5:] and 0 not in full
    assert full[:7] == mgr.get_block_ids("a")[0][:7]


def _worker():
    w = SimulatedWorker(HYBRID, 50, vocab_size=100)
    w.execute(StepInput(0, [ScheduledChunk("r", list(range(10)), 0, [[1, 2, 3], [4, 5, 6]])]))
    return w


@pytest.mark.parametrize("step, match", [
    (StepInput(1, [ScheduledChunk("r", [1], 9, [[], []])]), r"start_pos=9 does not continue .* 0\.\.9"),
    (StepInput(1, [ScheduledChunk("r", [1], 11, [[], []])]), "does not continue"),
    (StepInput(1, [ScheduledChunk("r", [1, 2, 3], 10, [[], []])]), "group 0 table has 3 blocks .* position 12"),
    (StepInput(1, [ScheduledChunk("n", [1] * 9, 0, [[7, 8], [9, 10]])]), "first chunk on this worker must carry"),
    (StepInput(1, [ScheduledChunk("n", [1, 2], 0, [[7], [0]])]),
     r"group 1 \(sliding\) has the null block at logical blocks \[0\]"),
    (StepInput(1, [ScheduledChunk("n", [1], 8, [[7, 8, 9], [0, 0, 10]])]), r"null block at logical blocks \[0, 1\]"),
    (StepInput(1, [ScheduledChunk("n", [1], 0, [[50], [9]])]),
     r"new_block_ids\[0\] holds ids outside \[0, 50\): \[50\]"),
    (StepInput(1, [ScheduledChunk("n", [1], 0, [[7]])]), "must be 2 lists, one per KV-cache group"),
    (StepInput(1, [ScheduledChunk("n", [100], 0, [[7], [8]])]), r"token_ids must be integers in \[0, 100\)"),
    (StepInput(1, [ScheduledChunk("n", [1], 0, [[7], [8]], start=RequestStart(SamplingSpec(logit_bias={100: 1.0}), 1))]),
     r"logit_bias names token ids outside \[0, 100\): \[100\]"),
    (StepInput(1, [ScheduledChunk("r", [1], 10, [[], []], start=RequestStart(GREEDY, 10))]), "already holds"),
    (StepInput(1, [ScheduledChunk("n", [1], 0, [[7], [8]]), ScheduledChunk("n", [1], 0, [[9], [10]])]),
     "appears twice"),
    (StepInput(1, [ScheduledChunk("r", [1], 10, [[], []]), ScheduledChunk("n", [1], 0, [[3], [8]])]),
     "step writes block 3 for request 'n' group 0 and for request 'r' group 0"),
    (StepInput(1, [ScheduledChunk("n", [1], 0, [[8], [8]])]), "step writes block 8"),
    (StepInput(1, [ScheduledChunk("n", [1] * 5, 0, [[7, 7], [8, 9]])]), r"holds blocks \[7\] at two places"),
    (StepInput(1, [], forget=["x"]), r"forget names request ids this worker does not hold: \['x'\]"),
    (StepInput(1, [], forget=["r", "r"]), "duplicate"),
])
def test_inconsistent_deltas_raise_and_change_nothing(step, match):
    w = _worker()
    with pytest.raises(ValueError, match=match):
        w.execute(step)
    assert w.request_ids == ["r"] and w.block_table("r") == [[1, 2, 3], [4, 5, 6]]
    w.execute(StepInput(2, [ScheduledChunk("r", [1], 10, [[], []])]))   # still in step with the engine


def test_forget_then_restart_and_stale_mirror_entries():
    w = _worker()
    w.execute(StepInput(1, [ScheduledChunk("r", [1], 0, [[11], [12]])], forget=["r"]))   # preempted, restarted
    assert w.block_table("r") == [[11], [12]]
    w.execute(StepInput(2, [ScheduledChunk("r", list(range(15)), 1, [[13, 14, 15], [16, 17, 18]])]))
    # At position 16 the window (8) reads from 9: group 1's block 0 was dropped and the engine reuses it.
    w.execute(StepInput(3, [ScheduledChunk("r", [5], 16, [[19], [12]])]))
    assert w.block_table("r")[1] == [12, 16, 17, 18, 12]          # the mirror keeps the stale entry
    assert w.blocks_in_use("r") == [[11, 13, 14, 15, 19], [17, 18, 12]]


def test_step_time_comes_from_the_cost_model():
    cost = StepCostModel("gemma-3-27b", "H100-80GB", pipeline_parallel_size=2)
    layout = kv_layout(layer_specs("gemma-3-27b"), 2)
    specs, widths = layout.group_specs, layout.group_widths
    assert widths == (26, 5)           # 26 sliding + 5 full layers per stage, one layer per unit
    # one block per group: sliding = units 1..26, full = units 27..31
    step = StepInput(0, [ScheduledChunk("r", [1, 2, 3], 0, [[1], [27]])],
                     compositions=[(0, 1, list(range(1, 27))), (1, 27, list(range(27, 32)))])
    whole = SimulatedWorker(specs, 100, vocab_size=262208, widths=widths, cost_model=cost).execute(step)
    assert whole.simulated_time_s == cost.step([(0, 3)]).time_s
    last = SimulatedWorker(specs, 100, vocab_size=262208, widths=widths, cost_model=cost,
                           pipeline_stage=1).execute(step)
    assert last.simulated_time_s == cost.step([(0, 3)]).time_s   # any stage reports the whole step
    assert SimulatedWorker(specs, 100, vocab_size=262208, widths=widths).execute(step).simulated_time_s == 0.0
    built = SimulatedWorker.for_model("gemma-3-27b", "H100-80GB", num_blocks=100, pipeline_parallel_size=2)
    assert built.groups == list(specs) and built.widths == widths and built.vocab_size == 262208


@pytest.mark.parametrize("kwargs, match", [
    (dict(group_specs=[], num_blocks=10, vocab_size=10), "group_specs"),
    (dict(group_specs=HYBRID, num_blocks=1, vocab_size=10), "num_blocks"),
    (dict(group_specs=HYBRID, num_blocks=10, vocab_size=0), "vocab_size"),
    (dict(group_specs=HYBRID, num_blocks=10, vocab_size=10, sleep_factor=-1), "sleep_factor"),
    (dict(group_specs=HYBRID, num_blocks=10, vocab_size=10, pipeline_stage=0), "pipeline_stage"),
])
def test_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SimulatedWorker(**kwargs)


# ---------------------------------------------------------------------------------------------------------
# Composites: a block of a group of width k spans k pool units, named by its first
# ---------------------------------------------------------------------------------------------------------
WIDE = [FullAttention(4), SlidingWindow(4, window=8)]


def _wide_worker():
    w = SimulatedWorker(WIDE, 50, vocab_size=100, widths=(2, 3))
    w.execute(StepInput(0, [ScheduledChunk("r", [1, 2, 3, 4], 0, [[1], [3]])],
                        compositions=[(0, 1, [1, 2]), (1, 3, [3, 4, 5])]))
    return w


@pytest.mark.parametrize("step, match", [
    (StepInput(1, [ScheduledChunk("n", [1], 0, [[6], [9]])]), "group 0 reads block 6, which no composition has named"),
    (StepInput(1, [], compositions=[(0, 1, [1, 2])]), "composition of group 0 block 1: a live window still reads it"),
    (StepInput(1, [], compositions=[(1, 6, [6, 7, 2])]),
     r"composition of group 1 block 6 spans unit 2, which group 0 block 1 \(read by a live window\) spans too"),
    # unit 6 goes to block 9 of group 0 after block 6 of group 1 took it: block 6 no longer holds it
    (StepInput(1, [ScheduledChunk("n", [1], 0, [[9], [6]])], compositions=[(1, 6, [6, 7, 8]), (0, 9, [9, 6])]),
     "group 1 block 6 spans unit 6, which a later composition gave to group 0 block 9"),
    (StepInput(1, [], compositions=[(0, 6, [6, 7, 8])]), r"group 0 needs 2 distinct units in \[1, 50\)"),
    (StepInput(1, [], compositions=[(0, 6, [7, 6])]), "a composite is named by its first unit, 7"),
    (StepInput(1, [], compositions=[(2, 6, [6, 7])]), r"group must be one of the groups wider than one unit \[0, 1\]"),
])
def test_inconsistent_compositions_raise_and_change_nothing(step, match):
    w = _wide_worker()
    with pytest.raises(ValueError, match=match):
        w.execute(step)
    assert w.request_ids == ["r"] and w.block_table("r") == [[1], [3]] and w.units(1, 3) == (3, 4, 5)
    assert w.blocks_in_use("r") == [[1], [3]]
    w.execute(StepInput(2, [ScheduledChunk("r", [1], 4, [[6], [9]])], compositions=[(0, 6, [6, 7]),
                                                                                      (1, 9, [9, 10, 11])]))
    assert w.blocks_in_use("r") == [[1, 6], [3, 9]]


def test_a_composite_leaving_every_window_may_be_recomposed_in_the_same_step():
    w = SimulatedWorker([FullAttention(4), SlidingWindow(4, window=1)], 50, vocab_size=100, widths=(1, 2))
    w.execute(StepInput(0, [ScheduledChunk("r", [1, 2, 3, 4], 0, [[1], [2]])], compositions=[(1, 2, [2, 3])]))
    # position 4 reads only itself: sliding block 0 (composite 2) leaves the window, and block 1 is the same
    # id composed anew from units 2 and 5; unit 3 is free again
    w.execute(StepInput(1, [ScheduledChunk("r", [5], 4, [[4], [2]])], compositions=[(1, 2, [2, 5])]))
    assert w.units(1, 2) == (2, 5) and w.block_table("r") == [[1, 4], [2, 2]]
    assert w.blocks_in_use("r") == [[1, 4], [2]]
    # unit 3 now serves full attention's block 3 of a new request
    w.execute(StepInput(2, [ScheduledChunk("s", [1], 0, [[3], [6]])], compositions=[(1, 6, [6, 7])]))
    assert w.blocks_in_use("s") == [[3], [6]]
