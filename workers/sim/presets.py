"""Model presets from published figures, for planning and simulation without weights or GPUs.

A model preset is the decoder's ``config.json`` fields (as the hub publishes them, multimodal configs
reduced to their ``text_config``) plus the parameter counts the model card gives. Layer kinds are not
restated here: ``workers.models.layer_kinds.layer_specs`` derives them from the config exactly as transformers
does, so a preset and a local ``config.json`` of the same model give the same layers.

Sources. Config fields are quoted from each repository's ``config.json`` on the Hugging Face hub, named
below by repo and field, from the author's knowledge of those files; the search tool corroborated
gemma-3-27b, llama-4-scout, gpt-oss-20b and gpt-oss-120b against third-party copies of their configs.
Parameter counts are the model cards' (rounded as published). GPU figures are NVIDIA's datasheets.
No torch import: the planner and the engine use this.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from kvmanager.checks import check_int
from kvmanager.specs import DTYPE_BYTES, AttentionSpec
from workers.models.layer_kinds import layer_specs as _config_layer_specs

# The fields a config may carry that make its MLP a mixture of experts (parameters cannot be estimated).
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class ModelPreset:
    """One model's shape, as planning and the cost model need it.

    ``expert_params``: routed-expert parameters of all MoE layers together (0 for dense models);
    ``expert_weight_bytes``: bytes per such parameter as shipped (gpt-oss keeps them in MXFP4).
    ``weight_bytes_on_disk``: exact weight bytes when known from local files (overrides the estimate).
    """

    name: str
    config: dict = field(repr=False, hash=False, compare=False)
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    dtype: str
    total_params: int | None
    active_params: int | None
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    expert_weight_bytes: float | None = None
    weight_bytes_on_disk: int | None = None
    source: str = ""

    def layer_specs(self, block_size: int = 16, dtype: str | None = None) -> dict[str, AttentionSpec]:
        return _config_layer_specs(self.config, block_size, dtype or self.dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights (the memory they take on the devices, before any split)."""
        if self.weight_bytes_on_disk is not None:
            return self.weight_bytes_on_disk
        if self.total_params is None:
            raise ValueError(f"model {self.name!r}: its parameter count is unknown (a mixture-of-experts config "
                             "without local weights); give the KV memory explicitly (--kv-memory)")
        dense = (self.total_params - self.expert_params) * DTYPE_BYTES[self.dtype]
        return round(dense + self.expert_params * self._expert_bytes)

    @property
    def _expert_bytes(self) -> float:
        return DTYPE_BYTES[self.dtype] if self.expert_weight_bytes is None else self.expert_weight_bytes

    def weight_bytes_read(self, num_tokens: int) -> float:
        """Weight bytes one step of ``num_tokens`` tokens reads (whole model, before any split).

        Dense weights are read once per step. Each MoE layer reads only the experts its tokens route to;
        with ``k`` of ``E`` experts per token and routing taken as uniform and independent, an expert is
        touched by at least one of ``T`` tokens with probability ``1 - (1 - k/E)^T`` (``k/E`` at T = 1,
        i.e. the active parameters; towards all experts as the batch grows).
        """
        if num_tokens <= 0:
            return 0.0
        if self.active_params is None:
            raise ValueError(f"model {self.name!r}: its active parameter count is unknown")
        if not self.num_experts:
            return float(self.active_params * DTYPE_BYTES[self.dtype])
        share = self.experts_per_token / self.num_experts
        dense_active = self.active_params - share * self.expert_params
        touched = 1.0 - (1.0 - share) ** num_tokens
        return dense_active * DTYPE_BYTES[self.dtype] + self.expert_params * self._expert_bytes * touched


def from_config(name: str, config: dict, *, total_params: int | None, active_params: int | None = None,
                num_experts: int = 0, experts_per_token: int = 0, expert_params: int = 0,
                expert_weight_bytes: float | None = None, weight_bytes_on_disk: int | None = None,
                source: str = "") -> ModelPreset:
    """A preset whose shape fields are read from ``config`` (its layer kinds are checked on the way)."""
    if not isinstance(config, dict):
        raise TypeError(f"model {name!r}: config must be a dict (config.json), got {type(config).__name__}")
    text = config.get("text_config") or config
    if not isinstance(text, dict):
        raise ValueError(f"model {name!r}: config field text_config must be an object, got {text!r}")
    first = next(iter(_config_layer_specs(config, 16).values()))
    return ModelPreset(
        name=name, config=config, hidden_size=_field(text, "hidden_size"), num_layers=_field(text, "num_hidden_layers"),
        num_attention_heads=_field(text, "num_attention_heads"), num_kv_heads=first.num_kv_heads,
        head_size=first.head_size, vocab_size=_field(text, "vocab_size"), dtype=first.dtype,
        total_params=total_params, active_params=active_params if active_params is not None else total_params,
        num_experts=num_experts, experts_per_token=experts_per_token, expert_params=expert_params,
        expert_weight_bytes=expert_weight_bytes, weight_bytes_on_disk=weight_bytes_on_disk, source=source)


def _field(cfg: dict, name: str) -> int:
    return check_int(f"config field {name}", cfg.get(name), 1)


# --------------------------------------------------------------------------------------------------
# Model presets. Every config below lists the hub config.json's fields (defaults of the config class
# written out where the hub file omits them). dtype: bfloat16, the dtype these models are served in.
# --------------------------------------------------------------------------------------------------
_B = 10**9


def _mistral_7b() -> ModelPreset:
    # mistralai/Mistral-7B-v0.1 config.json: model_type, hidden_size, intermediate_size, num_hidden_layers,
    # num_attention_heads, num_key_value_heads, sliding_window (4096, applied to every layer), vocab_size;
    # head_dim is derived: 4096 / 32 = 128.
    cfg = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096, "vocab_size": 32000,
           "torch_dtype": "bfloat16", "max_position_embeddings": 32768}
    # Parameters: 7,241,732,096 = the hub's safetensors count, and exactly what the fields above give
    # (2 x 32000 x 4096 embed/unembed + 32 x (41,943,040 attention + 176,160,768 MLP + 8,192 norms) + 4,096).
    return from_config("mistral-7b-v0.1", cfg, total_params=7_241_732_096,
                       source="hf:mistralai/Mistral-7B-v0.1 config.json")


def _gemma2(name: str, repo: str, hidden: int, inter: int, layers: int, heads: int, kv: int, head: int,
            params: int) -> ModelPreset:
    # google/gemma-2-{9b,27b} config.json: model_type gemma2; sliding_window 4096; layers alternate,
    # layer 0 sliding (transformers' Gemma2Config: layer_types default, "sliding_attention" on even layers);
    # vocab_size 256000; head_dim given explicitly (256 for 9b, 128 for 27b).
    cfg = {"model_type": "gemma2", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head, "sliding_window": 4096,
           "vocab_size": 256000, "torch_dtype": "bfloat16", "max_position_embeddings": 8192}
    return from_config(name, cfg, total_params=params, source=f"hf:{repo} config.json; model card parameter count")


def _gemma3(name: str, repo: str, hidden: int, inter: int, layers: int, heads: int, kv: int, head: int,
            params: int) -> ModelPreset:
    # google/gemma-3-{4b,12b,27b}-it config.json, text_config: model_type gemma3_text; sliding_window 1024;
    # sliding_window_pattern 6 (5 sliding layers, then 1 full); vocab_size 262208.
    # Parameter counts are the hub's, vision tower included (a multimodal server loads it too).
    cfg = {"model_type": "gemma3_text", "hidden_size": hidden, "intermediate_size": inter,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head,
           "sliding_window": 1024, "sliding_window_pattern": 6, "vocab_size": 262208, "torch_dtype": "bfloat16",
           "max_position_embeddings": 131072}
    return from_config(name, cfg, total_params=params, source=f"hf:{repo} config.json text_config; hub parameter count")


def _gpt_oss(name: str, layers: int, experts: int, total: int, active: int, mlp: int) -> ModelPreset:
    # openai/gpt-oss-{20b,120b} config.json: model_type gpt_oss; hidden_size 2880; num_attention_heads 64;
    # num_key_value_heads 8; head_dim 64; sliding_window 128; layer_types alternate sliding/full from
    # layer 0; num_local_experts 32 / 128; num_experts_per_tok 4; vocab_size 201088.
    cfg = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": layers,
           "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention"] * (layers // 2), "num_local_experts": experts,
           "num_experts_per_tok": 4, "vocab_size": 201088, "torch_dtype": "bfloat16",
           "max_position_embeddings": 131072}
    # gpt-oss model card (Table 1): total / active parameters and the MLP (routed experts + routers)
    # share; "MoE weights quantized to MXFP4 ... 4.25 bits per parameter" = 0.53125 bytes.
    return from_config(name, cfg, total_params=total, active_params=active, num_experts=experts,
                       experts_per_token=4, expert_params=mlp, expert_weight_bytes=4.25 / 8,
                       source=f"hf:openai/{name} config.json; gpt-oss model card Table 1")


def _llama4_scout() -> ModelPreset:
    # meta-llama/Llama-4-Scout-17B-16E-Instruct config.json, text_config: model_type llama4_text;
    # hidden_size 5120; intermediate_size 8192 (per expert); num_hidden_layers 48; num_attention_heads 40;
    # num_key_value_heads 8; head_dim 128; attention_chunk_size 8192; no_rope_layer_interval 4 (every 4th
    # layer is NoPE and attends in full, the others are chunked local); num_local_experts 16;
    # num_experts_per_tok 1; interleave_moe_layer_step 1 (every layer MoE); vocab_size 202048.
    cfg = {"model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
           "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
           "num_key_value_heads": 8, "head_dim": 128, "attention_chunk_size": 8192, "no_rope_layer_interval": 4,
           "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
           "vocab_size": 202048, "torch_dtype": "bfloat16", "max_position_embeddings": 10485760}
    # Model card: 109B total, 17B active. Routed experts: 48 layers x 16 experts x 3 x 5120 x 8192.
    return from_config("llama-4-scout", cfg, total_params=109 * _B, active_params=17 * _B, num_experts=16,
                       experts_per_token=1, expert_params=48 * 16 * 3 * 5120 * 8192,
                       source="hf:meta-llama/Llama-4-Scout-17B-16E-Instruct config.json; model card")


def _command_a() -> ModelPreset:
    # CohereLabs/c4ai-command-a-03-2025 config.json: model_type cohere2; hidden_size 12288;
    # intermediate_size 36864; num_hidden_layers 64; num_attention_heads 96; num_key_value_heads 8;
    # head_dim derived 12288 / 96 = 128; sliding_window 4096; sliding_window_pattern 4 (3 sliding, 1 full
    # NoPE layer); vocab_size 256000. Model card: 111B parameters.
    cfg = {"model_type": "cohere2", "hidden_size": 12288, "intermediate_size": 36864, "num_hidden_layers": 64,
           "num_attention_heads": 96, "num_key_value_heads": 8, "sliding_window": 4096, "sliding_window_pattern": 4,
           "vocab_size": 256000, "torch_dtype": "bfloat16", "max_position_embeddings": 131072}
    return from_config("command-a", cfg, total_params=111 * _B,
                       source="hf:CohereLabs/c4ai-command-a-03-2025 config.json; model card")


def _qwen25_7b() -> ModelPreset:
    # Qwen/Qwen2.5-7B-Instruct config.json: model_type qwen2; hidden_size 3584; intermediate_size 18944;
    # num_hidden_layers 28; num_attention_heads 28; num_key_value_heads 4; head_dim 3584 / 28 = 128;
    # sliding_window 131072 but use_sliding_window false: every layer full. vocab_size 152064.
    # Model card: 7.61B parameters.
    cfg = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
           "num_attention_heads": 28, "num_key_value_heads": 4, "sliding_window": 131072,
           "use_sliding_window": False, "max_window_layers": 28, "vocab_size": 152064, "torch_dtype": "bfloat16",
           "max_position_embeddings": 32768}
    return from_config("qwen2.5-7b", cfg, total_params=7_610_000_000, source="hf:Qwen/Qwen2.5-7B-Instruct config.json")


def _llama31_8b() -> ModelPreset:
    # meta-llama/Llama-3.1-8B config.json: model_type llama; hidden_size 4096; intermediate_size 14336;
    # num_hidden_layers 32; num_attention_heads 32; num_key_value_heads 8; head_dim 128; vocab_size 128256.
    # Hub parameter count 8,030,261,248.
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
           "torch_dtype": "bfloat16", "max_position_embeddings": 131072}
    return from_config("llama-3.1-8b", cfg, total_params=8_030_261_248, source="hf:meta-llama/Llama-3.1-8B config.json")


MODEL_PRESETS: dict[str, ModelPreset] = {p.name: p for p in (
    _mistral_7b(),
    # hidden, intermediate, layers, heads, kv heads, head_dim; parameters as on the hub model page.
    _gemma2("gemma-2-9b", "google/gemma-2-9b", 3584, 14336, 42, 16, 8, 256, 9_240_000_000),
    _gemma2("gemma-2-27b", "google/gemma-2-27b", 4608, 36864, 46, 32, 16, 128, 27_200_000_000),
    _gemma3("gemma-3-4b", "google/gemma-3-4b-it", 2560, 10240, 34, 8, 4, 256, 4_300_000_000),
    _gemma3("gemma-3-12b", "google/gemma-3-12b-it", 3840, 15360, 48, 16, 8, 256, 12_200_000_000),
    _gemma3("gemma-3-27b", "google/gemma-3-27b-it", 5376, 21504, 62, 32, 16, 128, 27_400_000_000),
    # layers, experts, total, active, MLP parameters (gpt-oss model card Table 1).
    _gpt_oss("gpt-oss-20b", 24, 32, 20_910_000_000, 3_610_000_000, 19_120_000_000),
    _gpt_oss("gpt-oss-120b", 36, 128, 116_830_000_000, 5_130_000_000, 114_710_000_000),
    _llama4_scout(),
    _command_a(),
    _qwen25_7b(),
    _llama31_8b(),
)}


def get_model_preset(name_or_path: Any) -> ModelPreset:
    """A preset by name, or a model read from a local ``config.json`` (or a directory holding one).

    For a local model, weights are counted from the ``*.safetensors`` files beside the config when there
    are any; otherwise parameters are estimated from the config for dense models (unknown for MoE).
    """
    if isinstance(name_or_path, ModelPreset):
        return name_or_path
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"model must be a preset name or a path, got {type(name_or_path).__name__}")
    key = os.fspath(name_or_path)
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    path = os.path.join(key, "config.json") if os.path.isdir(key) else key
    if not os.path.isfile(path):
        raise ValueError(f"model {key!r} is neither a known preset nor a config.json path (or a directory "
                         f"holding one); known presets: {', '.join(MODEL_PRESETS)}")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a config.json must hold one JSON object, got {type(config).__name__}")
    folder = os.path.dirname(os.path.abspath(path))
    weights = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors")]
    on_disk = sum(os.path.getsize(w) for w in weights) if weights else None
    try:
        return from_config(path, config, total_params=estimate_params(config), weight_bytes_on_disk=on_disk,
                           source=path)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{path}: {exc}") from None


def estimate_params(config: dict) -> int | None:
    """Parameters of a dense decoder from its config (embeddings, attention, gated MLP); None for MoE.

    Norms and biases are left out (well under 0.1% of any model here).
    """
    text = config.get("text_config") or config
    if any(text.get(k) for k in _MOE_FIELDS) or not isinstance(text.get("intermediate_size"), int):
        return None
    first = next(iter(_config_layer_specs(config, 16).values()))
    hidden, layers = _field(text, "hidden_size"), _field(text, "num_hidden_layers")
    heads = _field(text, "num_attention_heads")
    attention = hidden * first.head_size * (2 * heads + 2 * first.num_kv_heads)
    mlp = 3 * hidden * text["intermediate_size"]
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    embeddings = _field(text, "vocab_size") * hidden * (1 if tied else 2)
    return embeddings + layers * (attention + mlp)


def describe_layers(specs: dict[str, AttentionSpec]) -> str:
    """'52 x sliding(window=1024) + 10 x full', kinds in order of first appearance."""
    counts: dict[str, int] = {}
    for spec in specs.values():
        counts[spec.label] = counts.get(spec.label, 0) + 1
    return " + ".join(f"{n} x {label}" for label, n in counts.items())


def layer_specs(preset: Any, block_size: int = 16, dtype: str | None = None) -> dict[str, AttentionSpec]:
    """Layer name -> attention spec, in model order, for a preset name, a config.json path or a preset."""
    return get_model_preset(preset).layer_specs(block_size, dtype)
