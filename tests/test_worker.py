"""The worker against transformers' own dense eager forward: same tokens, same logits, same greedy text.

Block tables are kept by hand here, the way the engine keeps them: ids handed out in a shuffled order,
sliding groups drop blocks that fall out of the window and the freed ids go straight to the next
allocation, so the worker's append-only mirrors hold stale ids that now carry other requests' K/V.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvmanager.planning import kv_layout
from workers.models.layer_kinds import layer_specs
from workers.protocol import GREEDY, RequestStart, SamplingSpec, ScheduledChunk, StepInput
from workers.models.tiny_models import build_tiny_model, tiny_config
from workers.runtime.worker import Worker

from drivers import execute_pipeline, worker_from_kv_budget

BLOCK = 4
NUM_BLOCKS = 96
ATOL = 1e-4


class HandTables:
    """Test-side block bookkeeping for one worker's KV-cache groups, in pool units: a block of a group of
    width k takes k units from the free list, freshly composed every time (named by its first unit)."""

    def __init__(self, worker, num_blocks=NUM_BLOCKS, seed=0):
        self.groups, self.widths = worker.groups, worker.widths
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[list[int]]] = {}
        self.sent: dict[str, list[int]] = {}
        self.owner: dict[int, str] = {}          # unit -> request it was last taken for
        self.units: dict[tuple[int, int], list[int]] = {}    # (group, block id) -> its units
        self.compositions: list = []             # made since the last step

    def chunk(self, rid, token_ids, pos, **kwargs) -> ScheduledChunk:
        tables = self.tables.setdefault(rid, [[] for _ in self.groups])
        sent = self.sent.setdefault(rid, [0] * len(self.groups))
        end = pos + len(token_ids)
        new = []
        for g, spec in enumerate(self.groups):
            table = tables[g]
            for j in range(min(spec.first_needed_token(pos) // BLOCK, len(table))):
                if table[j]:
                    self.free[:0] = self.units[g, table[j]]  # reused by the very next allocation
                    table[j] = 0
            while len(table) * BLOCK < end:
                units = [self.free.pop(0) for _ in range(self.widths[g])]
                for unit in units:
                    self.owner[unit] = rid
                self.units[g, units[0]] = units
                if len(units) > 1:
                    self.compositions.append((g, units[0], units))
                table.append(units[0])
            new.append(table[sent[g]:])
            sent[g] = len(table)
        return ScheduledChunk(rid, list(token_ids), pos, new, **kwargs)

    def step(self, step_id, chunks, forget=()) -> StepInput:
        """A step carrying the compositions made for its chunks."""
        compositions, self.compositions = self.compositions, []
        return StepInput(step_id, chunks, list(forget), compositions)

    def share_prefix(self, src, dst, num_tokens):
        """A prefix-cache hit: ``dst`` starts with ``src``'s blocks for its first tokens, nulls where dropped."""
        self.tables[dst] = []
        for g, spec in enumerate(self.groups):
            first = spec.first_needed_token(num_tokens) // BLOCK
            src_blocks = self.tables[src][g][:num_tokens // BLOCK]
            self.tables[dst].append([0 if j < first else b for j, b in enumerate(src_blocks)])
        self.sent[dst] = [0] * len(self.groups)

    def release(self, rid):
        for g, table in enumerate(self.tables.pop(rid)):
            for b in table:
                if b:
                    self.free[:0] = self.units[g, b]
        del self.sent[rid]


def tokens(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def dense_logits(model, token_ids):
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def make(name, **kwargs):
    worker = Worker(build_tiny_model(name), block_size=BLOCK, num_blocks=kwargs.pop("num_blocks", NUM_BLOCKS),
                    **kwargs)
    return worker, build_tiny_model(name)


# (request, first token, last token + 1) per step: chunked prefills, decodes, a request joining late,
# one finishing early (forgotten, its blocks reused at once).
SCHEDULE = [
    [("A", 0, 13)],
    [("A", 13, 26), ("B", 0, 21)],
    [("A", 26, 37), ("B", 21, 22)],
    [("A", 37, 38), ("B", 22, 23), ("C", 0, 9)],
    [("C", 9, 10), ("A", 38, 39)],
    [("A", 39, 40), ("C", 10, 11)],
    [("A", 40, 41), ("C", 11, 19)],
    [("A", 41, 42)],
]
FINISHED_BEFORE = {4: "B"}


def run_schedule(forward, worker, seqs):
    """Drive ``forward(step) -> logits`` through SCHEDULE; yield (step, rid, end, logits row)."""
    hand = HandTables(worker)
    for step_id, entries in enumerate(SCHEDULE):
        forget = []
        if step_id in FINISHED_BEFORE:
            forget.append(FINISHED_BEFORE[step_id])
            hand.release(FINISHED_BEFORE[step_id])
        chunks = [hand.chunk(rid, seqs[rid][a:b], a) for rid, a, b in entries]
        logits = forward(hand.step(step_id, chunks, forget))
        assert logits.shape == (len(chunks), 256)
        for (rid, _, end), row in zip(entries, logits):
            yield rid, end, row
    return hand


@pytest.mark.parametrize("name", ["tiny-mistral", "tiny-gemma2", "tiny-gemma3", "tiny-llama", "tiny-llama4"])
def test_logits_match_dense_forward(name):
    worker, ref = make(name)
    seqs = {"A": tokens(1, 42), "B": tokens(2, 23), "C": tokens(3, 19)}
    expected = {rid: dense_logits(ref, s) for rid, s in seqs.items()}
    rows = list(run_schedule(worker.forward, worker, seqs))
    assert len(rows) == 15
    for rid, end, row in rows:
        torch.testing.assert_close(row, expected[rid][end - 1], atol=ATOL, rtol=0)
    assert sorted(worker.request_ids) == ["A", "C"]


def test_stale_mirror_ids_are_reused_by_other_requests():
    """The schedule really leaves A's sliding mirror pointing at blocks B and C have since written."""
    worker, _ = make("tiny-gemma2")
    seqs = {"A": tokens(1, 42), "B": tokens(2, 23), "C": tokens(3, 19)}
    gen = run_schedule(worker.forward, worker, seqs)
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            hand = stop.value
            break
    sliding = 0
    mirror = worker.block_table("A")[sliding]
    engine = hand.tables["A"][sliding]
    assert len(mirror) == len(engine) == 11
    dropped = [j for j, b in enumerate(engine) if b == 0]
    assert dropped == list(range(8))  # 41 tokens computed, W = 8: blocks 0..7 lie before position 34
    reused = [mirror[j] for j in dropped if hand.owner[mirror[j]] != "A"]
    assert reused, "no stale id was handed to another request"
    full = worker.block_table("A")[1]
    assert 0 not in full and full == hand.tables["A"][1]


def test_window_and_softcap_change_the_reference():
    """The references above would catch a kernel that ignored the window or the softcap."""
    seq = tokens(1, 30)
    base = dense_logits(build_tiny_model("tiny-gemma2"), seq)[-1]
    no_softcap = build_tiny_model("tiny-gemma2")
    for layer in no_softcap.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    no_window = build_tiny_model("tiny-gemma2")
    no_window.config.sliding_window = 10_000  # eager builds its sliding mask from the config
    assert (base - dense_logits(no_softcap, seq)[-1]).abs().max() > 0.1
    assert (base - dense_logits(no_window, seq)[-1]).abs().max() > 0.1


@pytest.mark.parametrize("name", ["tiny-mistral", "tiny-gemma2", "tiny-gemma3", "tiny-llama4"])
def test_greedy_decoding_equals_generate(name):
    worker, ref = make(name)
    prompt = tokens(7, 24)  # three windows / chunks of 8
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, 24:].tolist()
    hand = HandTables(worker)
    out = []
    for step_id, (a, b) in enumerate([(0, 10), (10, 20), (20, 24)]):
        sampled = worker.execute(hand.step(step_id, [hand.chunk("r", prompt[a:b], a, sample=b == 24)])).sampled
    out.append(sampled["r"])
    while len(out) < 20:
        pos = 24 + len(out) - 1
        sampled = worker.execute(hand.step(len(out) + 3, [hand.chunk("r", [out[-1]], pos)])).sampled
        out.append(sampled["r"])
    assert out == expected
    assert len(set(expected)) > 8  # the model does not just repeat itself


@pytest.mark.parametrize("name", ["tiny-mistral", "tiny-gemma2"])
def test_prefix_hit_with_null_blocks_in_mirror(name):
    """A request new to the worker arrives with a table whose out-of-window entries are the null block."""
    worker, ref = make(name)
    a_tokens = tokens(11, 24)
    b_tokens = a_tokens[:16] + tokens(12, 14)
    hand = HandTables(worker)
    worker.forward(StepInput(0, [hand.chunk("A", a_tokens, 0)]))
    hand.share_prefix("A", "B", 16)
    chunk = hand.chunk("B", b_tokens[16:26], 16)
    sliding = 0
    assert chunk.new_block_ids[sliding][:2] == [0, 0]
    assert chunk.new_block_ids[sliding][2:4] == hand.tables["A"][sliding][2:4]
    logits = worker.forward(StepInput(1, [chunk]))
    expected = dense_logits(ref, b_tokens)
    torch.testing.assert_close(logits[0], expected[25], atol=ATOL, rtol=0)
    for pos in range(26, 30):
        logits = worker.forward(StepInput(pos, [hand.chunk("B", [b_tokens[pos]], pos)]))
        torch.testing.assert_close(logits[0], expected[pos], atol=ATOL, rtol=0)
    assert worker.block_table("B")[sliding][:2] == [0, 0]


def test_forget_then_recompute():
    worker, ref = make("tiny-gemma3")
    seq = tokens(5, 20)
    hand = HandTables(worker)
    worker.forward(hand.step(0, [hand.chunk("r", seq[:12], 0)]))
    hand.release("r")
    logits = worker.forward(hand.step(1, [hand.chunk("r", seq, 0)], forget=["r"]))
    torch.testing.assert_close(logits[0], dense_logits(ref, seq)[-1], atol=ATOL, rtol=0)


def test_pipeline_of_two_stages_matches_one_stage():
    single, ref = make("tiny-gemma2")
    stages = [make("tiny-gemma2", layers=(0, 2))[0], make("tiny-gemma2", layers=(2, 4))[0]]
    assert sorted(stages[0].kv.caches) == [0, 1] and sorted(stages[1].kv.caches) == [2, 3]
    assert stages[0].kv_cache_bytes() == stages[1].kv_cache_bytes() == single.kv_cache_bytes() // 2
    with pytest.raises(RuntimeError, match="does not hold the LM head"):
        stages[0].stage.model.lm_head(torch.zeros(1, 64))
    seqs = {"A": tokens(1, 42), "B": tokens(2, 23), "C": tokens(3, 19)}
    expected = {rid: dense_logits(ref, s) for rid, s in seqs.items()}

    def two_stages(step):
        hidden = stages[0].forward(step)
        assert hidden.shape == (sum(len(c.token_ids) for c in step.chunks), 64)
        return stages[1].forward(step, hidden)

    rows = list(run_schedule(two_stages, single, seqs))
    single_rows = list(run_schedule(single.forward, single, seqs))
    for (rid, end, row), (_, _, single_row) in zip(rows, single_rows):
        torch.testing.assert_close(row, single_row, atol=1e-5, rtol=0)
        torch.testing.assert_close(row, expected[rid][end - 1], atol=ATOL, rtol=0)
    hand = HandTables(single)
    step = hand.step(0, [hand.chunk("D", tokens(9, 17), 0)])
    assert execute_pipeline(stages, step).sampled == {"D": int(expected_argmax(ref, tokens(9, 17)))}


def expected_argmax(model, seq):
    return dense_logits(model, seq)[-1].argmax()


def test_stage_missing_a_group_is_refused():
    # layers 0-2 chunked, layer 3 full: stage 0 would hold no full-attention layer
    with pytest.raises(ValueError, match=r"different mixes of layer kinds.*stage 0 .*: 2 x chunked_local\(chunk=8\); "
                                         r"stage 1 .*: 1 x chunked_local\(chunk=8\), 1 x full"):
        make("tiny-llama4", layers=(0, 2))
    with pytest.raises(ValueError, match="layers must be"):
        make("tiny-gemma2", layers=(2, 9))


def test_temperature_sampling_replays_and_varies():
    seq = tokens(4, 10)

    def sample(seeds, temperature=1.0, table_seed=0, step_id=0):
        worker = make("tiny-llama")[0]
        hand = HandTables(worker, seed=table_seed)
        chunks = [hand.chunk(f"r{seed}", seq, 0, start=RequestStart(SamplingSpec(temperature=temperature, seed=seed),
                                                                     len(seq))) for seed in seeds]
        sampled = worker.execute(hand.step(step_id, chunks)).sampled
        return [sampled[f"r{seed}"] for seed in seeds]

    # A replay on another worker, other blocks, another step id: the same draw.
    assert sample([3]) == sample([3], table_seed=1, step_id=7)
    assert len(set(sample(range(25)))) > 5
    assert sample([9], temperature=1e-4) == [int(expected_argmax(build_tiny_model("tiny-llama"), seq))]


def test_kv_budget_and_bytes():
    # tiny-gemma2: one layer's page = 2 (K, V) x block 4 x 2 KV heads x head 16 x 4 bytes = 1024 bytes.
    # 2 sliding + 2 full layers: two groups of S = gcd(2, 2) = 2 layers, so a pool block is 2048 bytes
    # and the worker allocates S = 2 K/V pairs that both groups share (not 4, one per layer).
    worker = worker_from_kv_budget(build_tiny_model("tiny-gemma2"), block_size=BLOCK, kv_budget_bytes=2048 * 10 + 2047)
    assert worker.num_blocks == 10
    assert worker.kv_cache_bytes() == 2 * 10 * 1024
    # Stage 1 of 2 holds layers 2 (sliding) and 3 (full): S = 1, a pool block is 1024 bytes.
    stage = worker_from_kv_budget(build_tiny_model("tiny-gemma2"), block_size=BLOCK, kv_budget_bytes=40960,
                                  layers=(2, 4))
    assert stage.num_blocks == 40
    assert stage.kv_cache_bytes() == 40 * 1024
    with pytest.raises(ValueError, match="kv_budget_bytes"):
        worker_from_kv_budget(build_tiny_model("tiny-gemma2"), block_size=BLOCK, kv_budget_bytes=4095)


def snapshot(worker):
    return ({rid: worker.block_table(rid) for rid in worker.request_ids},
            {i: (k.clone(), v.clone()) for i, (k, v) in worker.kv.caches.items()})


def assert_unchanged(worker, before):
    tables, caches = before
    assert {rid: worker.block_table(rid) for rid in worker.request_ids} == tables
    for i, (k, v) in worker.kv.caches.items():
        assert torch.equal(k, caches[i][0]) and torch.equal(v, caches[i][1])


def test_bad_steps_are_refused_before_any_change():
    worker, _ = make("tiny-gemma2", num_blocks=32)
    hand = HandTables(worker, num_blocks=32)
    worker.forward(StepInput(0, [hand.chunk("A", tokens(1, 10), 0)]))   # A holds 3 blocks per group
    before = snapshot(worker)
    ok = hand.chunk("B", tokens(2, 5), 0)
    cases = [
        # unknown request whose first chunk lacks its full table
        (ScheduledChunk("N", [1, 2], 8, [[5, 6], [7, 8]]), "new to this worker"),
        # beyond the table's capacity: A has 12 slots, this reaches 13 with no new block
        (ScheduledChunk("A", [1, 2, 3], 10, [[], []]), "reaches 13 tokens"),
        (ScheduledChunk("A", [1], 10, [[32], []]), r"outside \[0, 32\)"),
        (ScheduledChunk("A", [1], 10, [[-1], []]), r"outside \[0, 32\)"),
        (ScheduledChunk("A", [1], 10, [[]]), "2 lists"),
        (ScheduledChunk("A", [256], 10, [[], []]), "token_ids"),
        (ScheduledChunk("A", [], 10, [[], []]), "token_ids"),
        (ScheduledChunk("A", [1], -1, [[], []]), "start_pos"),
        (ScheduledChunk("A", [1], 10, [[], []], start=RequestStart(GREEDY, 10)), "already holds"),
        (ScheduledChunk("N", [1], 0, [[5], [7]], start=RequestStart(SamplingSpec(logit_bias={256: 1.0}), 1)),
         r"logit_bias names token ids outside \[0, 256\)"),
        # the window of position 12 (W = 8) starts at 5: logical block 1 must be real
        (ScheduledChunk("N", [1], 12, [[0, 0, 9, 10], [11, 12, 13, 14]]), r"null block at logical blocks \[1\]"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            worker.forward(StepInput(1, [ok, bad]))
        assert_unchanged(worker, before)
    with pytest.raises(ValueError, match="appears twice"):
        worker.forward(StepInput(1, [ok, ok]))
    with pytest.raises(ValueError, match="forget: unknown request id 'Z'"):
        worker.forward(StepInput(1, [ok], forget=["Z"]))
    with pytest.raises(ValueError, match="hidden_states"):
        worker.forward(StepInput(1, [ok]), hidden_states=torch.zeros(5, 64))
    with pytest.raises(TypeError, match="StepInput"):
        worker.forward({"step_id": 1})
    assert_unchanged(worker, before)
    worker.forward(StepInput(1, [ok]))   # the good chunk alone still runs
    assert sorted(worker.request_ids) == ["A", "B"]


def test_construction_errors():
    with pytest.raises(ValueError, match="num_blocks"):
        Worker(build_tiny_model("tiny-llama"), block_size=BLOCK, num_blocks=1)
    with pytest.raises(ValueError, match="block_size"):
        Worker(build_tiny_model("tiny-llama"), block_size=0, num_blocks=8)
    other = kv_layout(layer_specs(tiny_config("tiny-llama"), BLOCK))
    with pytest.raises(ValueError, match="are not stage 0 of the layout"):
        Worker("tiny-gemma2", block_size=BLOCK, num_blocks=8, layout=other, stage=0)
    with pytest.raises(ValueError, match="model must be"):
        Worker("no-such-model", block_size=BLOCK, num_blocks=8)


def test_unsupported_models_are_refused():
    import transformers
    sinks = transformers.GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                                      num_experts_per_tok=1, sliding_window=8)
    with pytest.raises(ValueError, match="attention sinks"):
        Worker(sinks, block_size=BLOCK, num_blocks=8)
    tuned = build_tiny_model("tiny-llama4")
    tuned.config.attn_temperature_tuning = True
    with pytest.raises(ValueError, match="attn_temperature_tuning"):
        Worker(tuned, block_size=BLOCK, num_blocks=8)


def test_model_from_local_directory(tmp_path):
    ref = build_tiny_model("tiny-mistral", seed=3)
    ref.save_pretrained(tmp_path)
    worker = Worker(str(tmp_path), block_size=BLOCK, num_blocks=16)
    seq = tokens(8, 11)
    logits = worker.forward(StepInput(0, [HandTables(worker, num_blocks=16).chunk("r", seq, 0)]))
    torch.testing.assert_close(logits[0], dense_logits(ref, seq)[-1], atol=ATOL, rtol=0)


def test_stages_built_from_a_config_and_seed_agree():
    """Pipeline actors each build the model from (config, seed); their stages must make up the same model."""
    config = {"model_type": "mistral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 8}
    seq = tokens(6, 20)

    def logits(workers):
        step = StepInput(0, [HandTables(workers[0]).chunk("r", seq, 0)])
        out = None
        for w in workers:
            out = w.forward(step, out)
        return out[0]

    single = logits([Worker(config, block_size=BLOCK, num_blocks=NUM_BLOCKS, seed=5)])
    stages = logits([Worker(config, block_size=BLOCK, num_blocks=NUM_BLOCKS, seed=5, layers=(0, 1)),
                     Worker(config, block_size=BLOCK, num_blocks=NUM_BLOCKS, seed=5, layers=(1, 2))])
    other_seed = logits([Worker(config, block_size=BLOCK, num_blocks=NUM_BLOCKS, seed=6)])
    torch.testing.assert_close(stages, single, atol=1e-5, rtol=0)
    assert (other_seed - single).abs().max() > 0.1


def _tensor_parallel_rank(rank, size, init_file, out_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    seqs = {"A": tokens(1, 42), "B": tokens(2, 23), "C": tokens(3, 19)}
    for name in ("tiny-gemma2", "tiny-gemma3"):
        worker = Worker(name, block_size=BLOCK, num_blocks=NUM_BLOCKS, tensor_parallel_size=size,
                        tensor_parallel_rank=rank)
        rows = torch.stack([row for _, _, row in run_schedule(worker.forward, worker, seqs)])
        torch.save({"rows": rows, "kv_bytes": worker.kv_cache_bytes()}, f"{out_dir}/{name}-{rank}.pt")
    dist.destroy_process_group()


def test_tensor_parallel_ranks_match_dense_forward(tmp_path):
    import torch.multiprocessing as mp
    mp.spawn(_tensor_parallel_rank, args=(2, tmp_path / "init", tmp_path), nprocs=2, join=True)
    seqs = {"A": tokens(1, 42), "B": tokens(2, 23), "C": tokens(3, 19)}
    for name in ("tiny-gemma2", "tiny-gemma3"):
        ref = build_tiny_model(name)
        expected = {rid: dense_logits(ref, s) for rid, s in seqs.items()}
        want = torch.stack([expected[rid][end - 1] for rid, a, end in (e for step in SCHEDULE for e in step)])
        single_bytes = Worker(name, block_size=BLOCK, num_blocks=NUM_BLOCKS).kv_cache_bytes()
        for rank in range(2):
            got = torch.load(tmp_path / f"{name}-{rank}.pt")
            torch.testing.assert_close(got["rows"], want, atol=ATOL, rtol=0)
            assert got["kv_bytes"] * 2 == single_bytes


def test_tensor_parallel_sizes_must_divide():
    with pytest.raises(ValueError, match="does not divide num_attention_heads=4"):
        Worker("tiny-gemma2", block_size=BLOCK, num_blocks=8, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="does not divide num_key_value_heads=2"):
        Worker("tiny-gemma2", block_size=BLOCK, num_blocks=8, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_rank"):
        Worker("tiny-gemma2", block_size=BLOCK, num_blocks=8, tensor_parallel_size=2, tensor_parallel_rank=2)
    with pytest.raises(ValueError, match="torch.distributed"):
        Worker("tiny-gemma2", block_size=BLOCK, num_blocks=8, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="gated dense MLPs"):
        Worker("tiny-llama4", block_size=BLOCK, num_blocks=8, tensor_parallel_size=2)


def test_members_table_routes_each_layer_to_its_unit():
    # tiny-gemma3: layers sliding, sliding, full, sliding -> S = 1; sliding is 3 units wide, full 1. Layer
    # 0 is sliding member 0, layer 1 member 1, layer 3 member 2; layer 2 is full attention's block itself.
    worker, ref = make("tiny-gemma3")
    assert worker.widths == (3, 1)
    seq = tokens(4, 3)
    logits = worker.forward(StepInput(0, [ScheduledChunk("r", seq, 0, [[5], [7]])], compositions=[(0, 5, [5, 9, 2])]))
    torch.testing.assert_close(logits[0], dense_logits(ref, seq)[-1], atol=ATOL, rtol=0)
    assert worker._members[0][5].tolist() == [5, 9, 2]
    k_cache = worker.kv.caches[0][0]                      # the one K tensor every layer shares (S = 1)
    written = {b for b in range(NUM_BLOCKS) if k_cache[b].abs().sum() > 0}
    assert written == {2, 5, 7, 9}
    assert all(k_cache[b, :3].abs().sum(-1).min() > 0 and k_cache[b, 3:].abs().sum() == 0 for b in written)
    # recomposing block 5 (a new request after "r" is forgotten) moves its layers to other units
    logits = worker.forward(StepInput(1, [ScheduledChunk("s", seq, 0, [[5], [8]])], forget=["r"],
                                      compositions=[(0, 5, [5, 11, 12])]))
    torch.testing.assert_close(logits[0], dense_logits(ref, seq)[-1], atol=ATOL, rtol=0)
    assert worker._members[0][5].tolist() == [5, 11, 12]
    with pytest.raises(ValueError, match="group 0 reads blocks \\[6\\], which no composition has named"):
        worker.forward(StepInput(2, [ScheduledChunk("t", seq, 0, [[6], [9]])]))
