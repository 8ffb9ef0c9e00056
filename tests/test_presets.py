"""Model and GPU presets: layer kinds as published, shapes, weights, local config.json loading."""
import json

import pytest

from kvmanager.specs import ChunkedLocalAttention, FullAttention, SlidingWindow
from workers.sim.gpus import GPU_PRESETS, get_gpu
from workers.sim.presets import MODEL_PRESETS, describe_layers, estimate_params, layer_specs
from workers.sim.presets import get_model_preset as load_model

# Published per-kind layer counts (config.json: num_hidden_layers and the sliding pattern), window or chunk,
# KV heads and head size.
PUBLISHED = {
    #                 layers, sliding, full, chunked, window, kv heads, head
    "mistral-7b-v0.1": (32, 32, 0, 0, 4096, 8, 128),
    "gemma-2-9b": (42, 21, 21, 0, 4096, 8, 256),
    "gemma-2-27b": (46, 23, 23, 0, 4096, 16, 128),
    "gemma-3-4b": (34, 29, 5, 0, 1024, 4, 256),
    "gemma-3-12b": (48, 40, 8, 0, 1024, 8, 256),
    "gemma-3-27b": (62, 52, 10, 0, 1024, 16, 128),
    "gpt-oss-20b": (24, 12, 12, 0, 128, 8, 64),
    "gpt-oss-120b": (36, 18, 18, 0, 128, 8, 64),
    "llama-4-scout": (48, 0, 12, 36, 8192, 8, 128),
    "command-a": (64, 48, 16, 0, 4096, 8, 128),
    "qwen2.5-7b": (28, 0, 28, 0, None, 4, 128),
    "llama-3.1-8b": (32, 0, 32, 0, None, 8, 128),
}


def test_every_required_preset_exists():
    assert set(PUBLISHED) <= set(MODEL_PRESETS)
    assert set(GPU_PRESETS) >= {"H100-80GB", "H200", "A100-80GB", "L40S"}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_layer_counts_per_kind_match_published_configs(name):
    layers, sliding, full, chunked, span, kv_heads, head = PUBLISHED[name]
    specs = list(layer_specs(name).values())
    assert len(specs) == layers
    assert sum(isinstance(s, SlidingWindow) for s in specs) == sliding
    assert sum(isinstance(s, FullAttention) for s in specs) == full
    assert sum(isinstance(s, ChunkedLocalAttention) for s in specs) == chunked
    assert {s.window for s in specs if isinstance(s, SlidingWindow)} <= {span}
    assert {s.chunk_size for s in specs if isinstance(s, ChunkedLocalAttention)} <= {span}
    assert {(s.num_kv_heads, s.head_size, s.dtype, s.block_size) for s in specs} == {(kv_heads, head, "bfloat16", 16)}


def test_layer_order_follows_each_family_pattern():
    def full_at(name):
        return [i for i, s in enumerate(layer_specs(name).values()) if isinstance(s, FullAttention)]
    assert full_at("gemma-3-27b") == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]     # every 6th layer
    assert full_at("gemma-3-4b") == [5, 11, 17, 23, 29]
    assert full_at("llama-4-scout") == list(range(3, 48, 4))                     # every 4th layer is NoPE
    assert full_at("command-a") == list(range(3, 64, 4))
    assert full_at("gemma-2-9b") == list(range(1, 42, 2))                        # layer 0 slides
    assert full_at("gpt-oss-20b") == list(range(1, 24, 2))


def test_layer_specs_takes_block_size_and_dtype():
    specs = layer_specs("gemma-3-4b", block_size=32, dtype="float16")
    assert {(s.block_size, s.dtype) for s in specs.values()} == {(32, "float16")}
    assert list(specs)[:2] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert describe_layers(specs) == "29 x sliding(window=1024) + 5 x full"


def test_shape_fields():
    g = MODEL_PRESETS["gemma-3-27b"]
    assert (g.hidden_size, g.num_layers, g.num_attention_heads, g.vocab_size) == (5376, 62, 32, 262208)
    s = MODEL_PRESETS["llama-4-scout"]
    assert (s.num_experts, s.experts_per_token, s.total_params, s.active_params) == (16, 1, 109 * 10**9, 17 * 10**9)


def test_mistral_parameter_count_from_its_config():
    # 2 x 32000 x 4096 (embed, unembed) + 32 x [4096 x 128 x (2 x 32 + 2 x 8) + 3 x 4096 x 14336]
    hand = 2 * 32000 * 4096 + 32 * (4096 * 128 * 80 + 3 * 4096 * 14336)
    assert hand == 7_241_465_856
    assert estimate_params(MODEL_PRESETS["mistral-7b-v0.1"].config) == hand
    # The hub count adds the RMSNorm weights: 32 x 2 x 4096 + 4096.
    assert MODEL_PRESETS["mistral-7b-v0.1"].total_params == hand + 32 * 2 * 4096 + 4096


def test_weight_bytes():
    assert MODEL_PRESETS["gemma-3-27b"].weight_bytes == 54_800_000_000                       # 27.4e9 x 2
    # gpt-oss: non-MLP parameters in bf16, MLP in MXFP4 (4.25 bits): (20.91 - 19.12)e9 x 2 + 19.12e9 x 0.53125
    assert MODEL_PRESETS["gpt-oss-20b"].weight_bytes == 3_580_000_000 + 10_157_500_000
    # ... which is the model card's 12.8 GiB checkpoint.
    assert round(MODEL_PRESETS["gpt-oss-20b"].weight_bytes / 2**30, 1) == 12.8


def test_moe_weights_read_per_step():
    p = MODEL_PRESETS["gpt-oss-120b"]
    # One token reads its active parameters; dense share = 5.13e9 - 4/128 x 114.71e9.
    dense = 5.13e9 - 114.71e9 / 32
    assert p.weight_bytes_read(1) == pytest.approx(dense * 2 + 114.71e9 * 0.53125 / 32, rel=1e-12)
    assert p.weight_bytes_read(2) == pytest.approx(dense * 2 + 114.71e9 * 0.53125 * (1 - (31 / 32) ** 2), rel=1e-12)
    assert p.weight_bytes_read(0) == 0.0
    assert MODEL_PRESETS["llama-3.1-8b"].weight_bytes_read(100) == 8_030_261_248 * 2


def _mistral_like(**changes):
    cfg = {"model_type": "mistral", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 64, "vocab_size": 1000,
           "torch_dtype": "bfloat16"}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


def test_local_config_json_file_and_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_mistral_like()))
    by_file, by_dir = load_model(str(tmp_path / "config.json")), load_model(tmp_path)
    specs = by_dir.layer_specs(16)
    assert specs == by_file.layer_specs(16)
    assert list(specs.values()) == [SlidingWindow(16, num_kv_heads=2, head_size=64, dtype="bfloat16", window=64)] * 4
    # 1000 x 256 x 2 + 4 x (256 x 64 x (8 + 4) + 3 x 256 x 512)
    assert by_dir.total_params == 512_000 + 4 * (196_608 + 393_216) == 2_871_296
    assert by_dir.weight_bytes == 2 * 2_871_296
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 12345)
    assert load_model(tmp_path).weight_bytes == 12345       # weights beside the config are counted exactly


def test_moe_config_has_no_parameter_estimate(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_mistral_like(num_local_experts=8)))
    model = load_model(str(path))
    assert model.total_params is None
    with pytest.raises(ValueError, match="--kv-memory"):
        model.weight_bytes


@pytest.mark.parametrize("text, match", [
    ("{not json", "cannot read it as JSON"),
    ("[1, 2]", "one JSON object"),
    (json.dumps(_mistral_like(num_hidden_layers=None)), "num_hidden_layers"),
    (json.dumps(_mistral_like(num_hidden_layers="4")), "num_hidden_layers"),
    (json.dumps(_mistral_like(model_type="mamba")), "model_type"),
    (json.dumps(_mistral_like(vocab_size=0)), "vocab_size"),
    (json.dumps(_mistral_like(sliding_window=0)), "sliding_window"),
    (json.dumps(_mistral_like(model_type="gemma2", head_dim=64, layer_types=["full_attention"])), "layer_types"),
])
def test_malformed_configs_name_the_field(tmp_path, text, match):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        load_model(str(path))
    assert str(path) in str(err.value)


def test_unknown_names_list_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="gemma-3-27b") as err:
        load_model("gemma-9")
    assert "known presets" in str(err.value)
    with pytest.raises(ValueError, match="H100-80GB, H200, A100-80GB, L40S"):
        get_gpu("B200")
    with pytest.raises(ValueError, match="known presets"):
        load_model(tmp_path)          # a directory without config.json
    with pytest.raises(TypeError, match="preset name or a path"):
        load_model(42)
