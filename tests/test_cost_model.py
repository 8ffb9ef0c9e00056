"""The roofline step model, checked by hand on small cases and against brute-force sums."""
import pytest

from kvmanager.specs import ChunkedLocalAttention, FullAttention, SlidingWindow
from workers.sim.cost_model import StepCostModel, attended_pairs, keys_read
from workers.sim.gpus import GpuPreset
from workers.sim.presets import MODEL_PRESETS, from_config

# Round numbers so every figure below can be checked by hand.
GPU = GpuPreset("toy", memory_bytes=10**9, hbm_bytes_per_s=1e11, bf16_flops_per_s=1e12,
                interconnect_bytes_per_s=1e10, interconnect="toy", source="test")


def _toy(**moe):
    # gpt_oss layer_types: layer 0 sliding (window 4), layer 1 full; 4 query heads, 2 KV heads of size 8.
    cfg = {"model_type": "gpt_oss", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 4, "vocab_size": 100,
           "layer_types": ["sliding_attention", "full_attention"], "torch_dtype": "bfloat16"}
    return from_config("toy", cfg, total_params=1_000_000, **moe)


@pytest.mark.parametrize("spec, keys", [
    (FullAttention(4), lambda p: p + 1),
    (SlidingWindow(4, window=5), lambda p: min(p + 1, 5)),
    (SlidingWindow(4, window=1), lambda p: 1),
    (ChunkedLocalAttention(4, chunk_size=6), lambda p: p % 6 + 1),
])
def test_attended_pairs_is_the_brute_force_sum(spec, keys):
    for start in range(0, 20):
        for n in range(1, 20):
            assert attended_pairs(spec, start, n) == sum(keys(p) for p in range(start, start + n)), (start, n)


def test_keys_read_is_capped_by_window_and_chunk():
    assert keys_read(FullAttention(16), 32767, 1) == 32768
    assert keys_read(SlidingWindow(16, window=1024), 32767, 1) == 1024
    assert keys_read(SlidingWindow(16, window=1024), 0, 512) == 512
    assert keys_read(SlidingWindow(16, window=1024), 2048, 512) == 1023 + 512
    assert keys_read(ChunkedLocalAttention(16, chunk_size=8192), 10000, 1) == 10001 - 8192


def test_one_step_by_hand():
    # Batch: a decode at position 10 and a 3-token prefill from 0. T = 4 tokens.
    cost = StepCostModel(_toy(), GPU).step([(10, 1), (0, 3)])
    (stage,) = cost.stages
    # KV per token and layer: 2 (K, V) x 2 heads x 8 x 2 bytes = 64. Keys read: sliding 4 + 3, full 11 + 3.
    assert stage.kv_read_bytes == 64 * (4 + 3 + 11 + 3) == 1344
    assert stage.kv_write_bytes == 64 * 4 * 2 == 512
    assert stage.weight_bytes == 2_000_000
    # FLOPs: 2 x 1e6 x 4, plus 4 x 4 heads x 8 x pairs; pairs: sliding 4 + (1+2+3), full 11 + (1+2+3).
    assert stage.flops == 8_000_000 + 128 * (10 + 17) == 8_003_456
    assert stage.memory_s == pytest.approx(2_001_856 / 1e11, rel=1e-12)
    assert stage.compute_s == pytest.approx(8_003_456 / 1e12, rel=1e-12)
    assert stage.tp_comm_s == 0
    assert cost.time_s == pytest.approx(2.001856e-5, rel=1e-12)      # memory bound


def test_tensor_parallel_by_hand():
    (stage,) = StepCostModel(_toy(), GPU, tensor_parallel_size=2).step([(10, 1), (0, 3)]).stages
    assert stage.weight_bytes == 1_000_000
    assert stage.kv_read_bytes == 672 and stage.kv_write_bytes == 256      # one KV head per rank
    assert stage.flops == 4_000_000 + 64 * 27
    # 2 all-reduces per layer x 2 layers, each 32 x 4 tokens x 2 bytes = 256 B, ring factor 2 (2-1)/2 = 1.
    assert stage.tp_comm_s == pytest.approx(4 * 256 / 1e10, rel=1e-12)
    assert stage.time_s == pytest.approx(1_000_928 / 1e11 + 1.024e-7, rel=1e-12)


def test_pipeline_parallel_by_hand():
    cost = StepCostModel(_toy(), GPU, pipeline_parallel_size=2).step([(10, 1), (0, 3)])
    first, second = cost.stages
    assert (first.kv_read_bytes, second.kv_read_bytes) == (64 * 7, 64 * 14)      # sliding stage, full stage
    assert first.weight_bytes == second.weight_bytes == 1_000_000
    assert cost.pp_transfer_s == pytest.approx(256 / 1e10, rel=1e-12)
    assert cost.time_s == pytest.approx((1_000_704 + 1_001_152) / 1e11 + 2.56e-8, rel=1e-12)
    assert cost.stage_time_s(0) == pytest.approx(1_000_704 / 1e11 + 2.56e-8, rel=1e-12)
    assert cost.stage_time_s(1) == pytest.approx(1_001_152 / 1e11, rel=1e-12)


def test_moe_reads_the_experts_its_tokens_touch():
    # 4 experts, 1 per token, 400 expert parameters in all: 1000 total, 700 active.
    model = _toy(active_params=700, num_experts=4, experts_per_token=1, expert_params=400)
    assert model.weight_bytes_read(1) == (700 - 100) * 2 + 400 * 2 * (1 / 4)
    assert model.weight_bytes_read(2) == (700 - 100) * 2 + 400 * 2 * (7 / 16)
    (stage,) = StepCostModel(model, GPU).step([(0, 2)]).stages
    assert stage.weight_bytes == 1550
    assert stage.flops == 2 * 700 * 2 + 128 * 2 * (1 + 2)


def test_compute_bound_when_the_batch_is_large():
    (stage,) = StepCostModel(_toy(), GPU).step([(0, 4096)]).stages
    assert stage.compute_s > stage.memory_s
    assert stage.flops == 2e6 * 4096 + 128 * (4 * 4096 - 6 + 4097 * 4096 // 2)


def test_gemma3_27b_decode_on_h100_by_hand():
    cost = StepCostModel("gemma-3-27b", "H100-80GB").step([(32767, 1)])
    (stage,) = cost.stages
    token = 2 * 16 * 128 * 2                       # 8192 bytes per token and layer
    assert stage.kv_read_bytes == 52 * 1024 * token + 10 * 32768 * token
    assert stage.weight_bytes == 54.8e9
    assert cost.time_s == pytest.approx((54.8e9 + 3_120_562_176 + 62 * token) / 3.35e12, rel=1e-12)


def test_bad_inputs():
    model = StepCostModel("gemma-3-27b", "H100-80GB")
    with pytest.raises(ValueError, match=r"batch\[1\]: num_tokens"):
        model.step([(0, 1), (5, 0)])
    with pytest.raises(ValueError, match=r"batch\[0\]: start"):
        model.step([(-1, 1)])
    with pytest.raises(ValueError, match=r"batch\[0\] must be a \(start, num_tokens\) pair"):
        model.step([5])
    with pytest.raises(ValueError, match="num_attention_heads=32"):
        StepCostModel("gemma-3-27b", "H100-80GB", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        StepCostModel("gemma-3-27b", "H100-80GB", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="exceeds the model's 62 layers"):
        StepCostModel("gemma-3-27b", "H100-80GB", pipeline_parallel_size=63)
    assert model.step([]).time_s == 0.0
    assert MODEL_PRESETS["gemma-3-27b"].weight_bytes_read(0) == 0.0


def test_the_knee_is_the_fewest_prefill_tokens_at_which_a_step_is_compute_bound():
    # A t-token prefill from 0 on the toy: memory 2e6 + 64 x (t + t) keys read + 64 x 2 t written = 2e6 + 256 t
    # bytes at 1e11 B/s; compute 2e6 t + 128 x (pairs: sliding sum min(p+1, 4), full t(t+1)/2) at 1e12 FLOP/s.
    # t = 10: 2.0e7 + 128 x (34 + 55) = 20,011,392 < 10 x (2e6 + 2,560) = 20,025,600; t = 11: 22,013,312 > 20,028,160.
    model = StepCostModel(_toy(), GPU)
    assert model.knee_tokens(granule=1) == 11
    assert model.knee_tokens(granule=4) == 12
    assert model.knee_tokens(granule=1, limit=8) == 8        # none within the limit: the limit
    with pytest.raises(ValueError, match="limit must be an integer >= 4, got 3"):
        model.knee_tokens(granule=4, limit=3)


def test_the_prefill_room_is_what_a_prefill_adds_to_a_batch_until_the_step_is_compute_bound():
    # With a decode at position 10 (keys read: sliding 4, full 11; pairs the same): memory 2e6 + 64 x (15 + 2t)
    # + 128 x (1 + t) = 2,001,088 + 256 t bytes; compute 2e6 (1 + t) + 128 x (15 + pairs of the prefill).
    # t = 9: 20,011,520 < 10 x 2,003,392; t = 10: 22,013,...: bound. One token fewer than the bare knee (11).
    model = StepCostModel(_toy(), GPU)
    assert model.prefill_room([(10, 1)], granule=1) == 10
    assert model.prefill_room([(0, 20)], granule=1) == 0       # a 20-token prefill is compute-bound already
    with pytest.raises(ValueError, match=r"batch\[0\]: num_tokens must be an integer >= 1, got 0"):
        model.prefill_room([(10, 0)])
