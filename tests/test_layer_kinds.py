"""Layer kinds read from the config.json fields of published models, checked against their model cards'
layer counts and against what transformers' own config classes derive from the same fields."""
from __future__ import annotations

from collections import Counter

import pytest
import transformers

from kvmanager.planning import kv_layout
from kvmanager.specs import ChunkedLocalAttention, FullAttention, SlidingWindow
from workers.models.layer_kinds import check_parallel_sizes, layer_specs

MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000,
}
MISTRAL_7B_V02 = {**MISTRAL_7B_V01, "sliding_window": None, "rope_theta": 1000000.0}
GEMMA_2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0, "cache_implementation": "hybrid",
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_size": 3584, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 16, "num_hidden_layers": 42,
    "num_key_value_heads": 8, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_size": 4096,
    "torch_dtype": "float32", "vocab_size": 256000,
}
GEMMA_3_27B_TEXT = {
    "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
}
GEMMA_3_27B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
               "text_config": GEMMA_3_27B_TEXT, "torch_dtype": "bfloat16"}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "head_dim": 64, "hidden_size": 2880, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "model_type": "gpt_oss",
    "num_attention_heads": 64, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
    "sliding_window": 128, "vocab_size": 201088,
}
LLAMA_4_SCOUT_TEXT = {
    "attention_chunk_size": 8192, "attn_temperature_tuning": True, "head_dim": 128, "hidden_size": 5120,
    "interleave_moe_layer_step": 1, "model_type": "llama4_text", "no_rope_layers": [1, 1, 1, 0] * 12,
    "num_attention_heads": 40, "num_hidden_layers": 48, "num_key_value_heads": 8, "num_local_experts": 16,
    "torch_dtype": "bfloat16", "vocab_size": 202048,
}
LLAMA_4_SCOUT = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
                 "text_config": LLAMA_4_SCOUT_TEXT, "torch_dtype": "bfloat16"}
COMMAND_A = {
    "model_type": "cohere2", "hidden_size": 12288, "num_attention_heads": 96, "num_key_value_heads": 8,
    "num_hidden_layers": 64, "sliding_window": 4096, "sliding_window_pattern": 4, "torch_dtype": "bfloat16",
}
QWEN_2_5_7B = {
    "model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
    "num_hidden_layers": 28, "max_window_layers": 28, "sliding_window": 131072, "use_sliding_window": False,
    "torch_dtype": "bfloat16",
}


def census(specs):
    """Counter of (kind, window or chunk) over layers."""
    return Counter((s.kind, getattr(s, "window", None) or getattr(s, "chunk_size", None)) for s in specs.values())


@pytest.mark.parametrize("config, layers, kinds, kv_heads, head_size, dtype", [
    (MISTRAL_7B_V01, 32, {("sliding", 4096): 32}, 8, 128, "bfloat16"),
    (MISTRAL_7B_V02, 32, {("full", None): 32}, 8, 128, "bfloat16"),
    (GEMMA_2_9B, 42, {("sliding", 4096): 21, ("full", None): 21}, 8, 256, "float32"),
    (GEMMA_3_27B, 62, {("sliding", 1024): 52, ("full", None): 10}, 16, 128, "bfloat16"),
    (GEMMA_3_27B_TEXT, 62, {("sliding", 1024): 52, ("full", None): 10}, 16, 128, "float32"),
    (GPT_OSS_20B, 24, {("sliding", 128): 12, ("full", None): 12}, 8, 64, "float32"),
    (LLAMA_4_SCOUT, 48, {("chunked_local", 8192): 36, ("full", None): 12}, 8, 128, "bfloat16"),
    (COMMAND_A, 64, {("sliding", 4096): 48, ("full", None): 16}, 8, 128, "bfloat16"),
    (QWEN_2_5_7B, 28, {("full", None): 28}, 4, 128, "bfloat16"),
])
def test_published_configs(config, layers, kinds, kv_heads, head_size, dtype):
    specs = layer_specs(config, block_size=16)
    assert list(specs) == [f"model.layers.{i}.self_attn" for i in range(layers)]
    assert census(specs) == kinds
    assert {(s.num_kv_heads, s.head_size, s.dtype, s.block_size) for s in specs.values()} == \
        {(kv_heads, head_size, dtype, 16)}


@pytest.mark.parametrize("config", [MISTRAL_7B_V01, MISTRAL_7B_V02, GEMMA_2_9B, GEMMA_3_27B, GEMMA_3_27B_TEXT,
                                    GPT_OSS_20B, LLAMA_4_SCOUT, COMMAND_A, QWEN_2_5_7B])
def test_dict_reading_agrees_with_transformers_config_classes(config):
    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **fields)
    assert layer_specs(hf_config, block_size=16) == layer_specs(config, block_size=16)


def test_which_layers_are_which():
    gemma3 = list(layer_specs(GEMMA_3_27B, 16).values())
    assert [i for i, s in enumerate(gemma3) if isinstance(s, FullAttention)] == list(range(5, 62, 6))
    gemma2 = list(layer_specs(GEMMA_2_9B, 16).values())
    assert all(isinstance(s, SlidingWindow) == (i % 2 == 0) for i, s in enumerate(gemma2))
    scout = list(layer_specs(LLAMA_4_SCOUT, 16).values())
    assert [i for i, s in enumerate(scout) if isinstance(s, FullAttention)] == list(range(3, 48, 4))
    # An empty no_rope_layers means "the default": every 4th layer NoPE (full), as transformers does.
    assert layer_specs({**LLAMA_4_SCOUT_TEXT, "no_rope_layers": []}, 16) == layer_specs(LLAMA_4_SCOUT, 16)


def test_gemma3_memory_figure_at_32k():
    """Brief §4: with sliding layers bounded, gemma-3-27b fits about 5.3x the requests at 32k context."""
    specs = layer_specs(GEMMA_3_27B, 16).values()
    full_blocks = 32768 // 16
    as_full = full_blocks * len(specs)
    # brief §2: a sliding group holds at most ceil((W-1)/B) + 1 real blocks per request in steady decode
    hybrid = sum(-(-(s.window - 1) // 16) + 1 if isinstance(s, SlidingWindow) else full_blocks for s in specs)
    assert as_full == 62 * 2048
    assert hybrid == 10 * 2048 + 52 * 65
    assert round(as_full / hybrid, 2) == 5.32


def test_groups_follow_first_appearance():
    # gpt-oss-20b: 12 sliding + 12 full layers -> one group of each, one unit (of S = 12 layers) wide,
    # sliding first; layer slots are (group, member unit, tensor slot)
    layout = kv_layout(layer_specs(GPT_OSS_20B, 16))
    assert layout.group_specs == (SlidingWindow(16, 8, 64, "float32", window=128), FullAttention(16, 8, 64, "float32"))
    assert layout.group_widths == (1, 1) and layout.stages[0].layers_per_group == 12
    assert [layout.stages[0].layer_slots[f"model.layers.{i}.self_attn"] for i in range(4)] == \
        [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)]
    # llama-4-scout: 36 chunked + 12 full -> S = 12: one chunked group 3 units wide, then one full group
    layout = kv_layout(layer_specs(LLAMA_4_SCOUT, 16))
    assert layout.group_specs == (ChunkedLocalAttention(16, 8, 128, "bfloat16", chunk_size=8192),
                                  FullAttention(16, 8, 128, "bfloat16"))
    assert layout.group_widths == (3, 1)
    # gemma-3-27b: 52 sliding + 10 full -> S = 2; sliding 26 units wide, full 5. Its k-th sliding layer
    # is member k // 2, slot k % 2: layers 0-4 sliding (k = 0..4), layer 5 full (k = 0), layer 6 sliding (k = 5).
    layout = kv_layout(layer_specs(GEMMA_3_27B, 16))
    assert layout.group_widths == (26, 5) and layout.stages[0].layers_per_group == 2
    assert [layout.stages[0].layer_slots[f"model.layers.{i}.self_attn"] for i in range(7)] == \
        [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (0, 2, 0), (1, 0, 0), (0, 2, 1)]
    layout = kv_layout(layer_specs({**GEMMA_2_9B, "layer_types": ["full_attention", "sliding_attention"] * 21}, 16))
    assert [g.kind for g in layout.group_specs] == ["full", "sliding"]


def test_dtype_override_and_pretrained_config():
    specs = layer_specs(transformers.MistralConfig(num_hidden_layers=3, sliding_window=64), 8, dtype="float16")
    assert set(specs.values()) == {SlidingWindow(8, 8, 128, "float16", window=64)}


@pytest.mark.parametrize("config, match", [
    ({**GPT_OSS_20B, "layer_types": ["sliding_attention", "linear_attention"] * 12}, r"layer_types\[1\]"),
    ({**GPT_OSS_20B, "layer_types": ["sliding_attention"] * 23}, "layer_types must list one kind per layer"),
    ({**GPT_OSS_20B, "sliding_window": None}, "sliding_window"),
    ({**GEMMA_2_9B, "sliding_window": 0}, "sliding_window"),
    ({k: v for k, v in GEMMA_2_9B.items() if k != "num_hidden_layers"}, "num_hidden_layers"),
    ({k: v for k, v in GEMMA_2_9B.items() if k != "head_dim"}, "head_dim"),
    ({k: v for k, v in MISTRAL_7B_V01.items() if k != "num_key_value_heads"}, "num_key_value_heads"),
    ({**MISTRAL_7B_V01, "layer_types": ["full_attention"] * 32}, "layer_types disagrees"),
    ({**GEMMA_3_27B_TEXT, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({**GEMMA_3_27B_TEXT, "model_type": "gemma3n", "num_kv_shared_layers": 10}, "num_kv_shared_layers"),
    ({**GEMMA_2_9B, "model_type": "jamba"}, "model_type='jamba'"),
    ({k: v for k, v in GEMMA_2_9B.items() if k != "model_type"}, "neither model_type nor layer_types"),
    ({**GEMMA_2_9B, "torch_dtype": "float64"}, "dtype"),
    ({**LLAMA_4_SCOUT_TEXT, "no_rope_layers": [1, 0]}, "no_rope_layers"),
    ({**QWEN_2_5_7B, "layer_types": ["sliding_attention"] * 28}, "sliding_window"),
])
def test_unreadable_configs_raise(config, match):
    with pytest.raises(ValueError, match=match):
        layer_specs(config, 16)


def test_layer_types_without_model_type_is_read():
    config = {k: v for k, v in GPT_OSS_20B.items() if k != "model_type"}
    assert layer_specs(config, 16) == layer_specs(GPT_OSS_20B, 16)


def test_not_a_config():
    with pytest.raises(TypeError, match="config must be"):
        layer_specs(["model_type", "llama"], 16)
    with pytest.raises(ValueError, match="block_size"):
        layer_specs(GEMMA_2_9B, 0)


def test_parallel_sizes_must_divide():
    check_parallel_sizes(GEMMA_3_27B, tensor_parallel_size=16, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="does not divide num_attention_heads=32"):
        check_parallel_sizes(GEMMA_3_27B, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="does not divide num_key_value_heads=16"):
        check_parallel_sizes(GEMMA_3_27B, tensor_parallel_size=32)
    with pytest.raises(ValueError, match="does not divide num_hidden_layers=62"):
        check_parallel_sizes(GEMMA_3_27B, pipeline_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be"):
        check_parallel_sizes(GEMMA_3_27B, tensor_parallel_size=0)


def test_stage_kind_mixes():
    # gemma-3-27b in 2 stages of 31 layers: 26 sliding + 5 full each, the same mix
    assert len(kv_layout(layer_specs(GEMMA_3_27B, 16), 2).stages) == 2
    kv_layout(layer_specs(LLAMA_4_SCOUT, 16), 4)
    twelve = {**GEMMA_3_27B_TEXT, "num_hidden_layers": 12}   # sliding x5, full, sliding x5, full
    kv_layout(layer_specs(twelve, 16), 2)
    with pytest.raises(ValueError, match=r"stage 0 \(layers model.layers.0.self_attn..model.layers.3.self_attn\): "
                                         r"4 x sliding\(window=1024\); stage 1 \(layers model.layers.4.self_attn.."
                                         r"model.layers.7.self_attn\): 3 x sliding\(window=1024\), 1 x full"):
        kv_layout(layer_specs(twelve, 16), 3)
