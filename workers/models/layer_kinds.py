"""Which attention kind each decoder layer of a Hugging Face model uses, read from its config.

The KV-cache manager only needs one ``AttentionSpec`` per layer; this module derives them from a
config.json dict or a transformers ``PretrainedConfig`` exactly as transformers' own model code would
behave. No torch import: the engine and the planner call it too (grouping is kvmanager.planning's).

Families are listed explicitly because the same field means different things in different families
(Mistral applies ``sliding_window`` to every layer and ignores ``layer_types``; Qwen2 applies it only
from ``max_window_layers`` on, and only with ``use_sliding_window``). An unknown family is refused
rather than guessed.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvmanager.checks import check_int, is_int
from kvmanager.specs import DTYPE_BYTES, AttentionSpec, ChunkedLocalAttention, FullAttention, SlidingWindow

# Families whose attention applies config.sliding_window (when set) to every layer; layer_types unused.
_ALL_LAYERS_WINDOW = {"mistral", "mixtral", "phi3", "starcoder2"}
# Families with no local attention at all.
_ALL_FULL = {"llama", "gemma"}
# Families that read layer_types; when a config.json omits it, the class builds it as below.
_PATTERN_DEFAULT = {"gemma2": 2, "gpt_oss": 2, "gemma3_text": 6, "cohere2": 4}
_USES_LAYER_TYPES = set(_PATTERN_DEFAULT) | {"ministral", "qwen2", "qwen3", "llama4_text"}
_ALIASES = {"gemma3": "gemma3_text", "llama4": "llama4_text"}
SUPPORTED_MODEL_TYPES = sorted(_ALL_LAYERS_WINDOW | _ALL_FULL | _USES_LAYER_TYPES | set(_ALIASES))

# When config.json omits these, transformers derives them (rather than using a fixed class default).
_HEAD_DIM_DERIVED = {"mistral", "mixtral", "ministral", "llama", "cohere2", "qwen2", "phi3", "starcoder2"}
_KV_HEADS_DERIVED = {"llama", "cohere2", "phi3"}

LAYER_NAME = "model.layers.{}.self_attn"


def layer_specs(config: Any, block_size: int, dtype: str | None = None) -> dict[str, AttentionSpec]:
    """Map each decoder layer name (``model.layers.{i}.self_attn``) to its attention spec.

    ``dtype`` overrides the config's ``torch_dtype``/``dtype`` (default float32, transformers' own
    default when a model is built from a config).
    """
    cfg = _text_config(_as_dict(config))
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("config field use_bidirectional_attention=True: non-causal attention cannot run on a "
                         "KV cache")
    if cfg.get("num_kv_shared_layers"):
        raise ValueError(f"config field num_kv_shared_layers={cfg['num_kv_shared_layers']}: layers that reuse "
                         "another layer's KV are not supported")
    family = _family(cfg)
    num_layers = _config_int(cfg, "num_hidden_layers")
    kinds = _layer_kinds(cfg, family, num_layers)
    shape = {"block_size": block_size, "num_kv_heads": _num_kv_heads(cfg, family),
             "head_size": _head_size(cfg, family), "dtype": _dtype(cfg, dtype)}
    specs = {}
    for i, kind in enumerate(kinds):
        if kind == "full_attention":
            spec = FullAttention(**shape)
        elif kind == "sliding_attention":
            spec = SlidingWindow(**shape, window=_window(cfg, family))
        else:
            spec = ChunkedLocalAttention(**shape, chunk_size=_config_int(cfg, "attention_chunk_size"))
        specs[LAYER_NAME.format(i)] = spec
    return specs


def check_parallel_sizes(config: Any, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> None:
    """Raise ValueError unless the parallel sizes divide heads, KV heads and layers evenly."""
    for name, value in (("tensor_parallel_size", tensor_parallel_size),
                        ("pipeline_parallel_size", pipeline_parallel_size)):
        check_int(name, value, 1)
    cfg = _text_config(_as_dict(config))
    family = _family(cfg)
    sizes = {"num_attention_heads": _config_int(cfg, "num_attention_heads"),
             "num_key_value_heads": _num_kv_heads(cfg, family)}
    for field, count in sizes.items():
        if count % tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not divide {field}={count}")
    layers = _config_int(cfg, "num_hidden_layers")
    if layers % pipeline_parallel_size:
        raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size} does not divide "
                         f"num_hidden_layers={layers}")


def _as_dict(config: Any) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"config must be a dict (config.json) or a transformers PretrainedConfig, "
                    f"got {type(config).__name__}")


def _text_config(cfg: dict) -> dict:
    """Multimodal configs (Gemma-3, Llama-4) keep the decoder's fields under ``text_config``."""
    text = cfg.get("text_config")
    if text is None:
        return cfg
    text = _as_dict(text)
    text.setdefault("model_type", cfg.get("model_type"))
    for key in ("torch_dtype", "dtype"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    return text


def _family(cfg: dict) -> str | None:
    model_type = cfg.get("model_type")
    if model_type is None:
        if cfg.get("layer_types") is None:
            raise ValueError("config has neither model_type nor layer_types: its layer kinds cannot be read")
        return None
    family = _ALIASES.get(model_type, model_type)
    if family not in _ALL_LAYERS_WINDOW | _ALL_FULL | _USES_LAYER_TYPES:
        raise ValueError(f"config field model_type={model_type!r}: layer kinds of this family are not known; "
                         f"supported: {SUPPORTED_MODEL_TYPES}")
    return family


def _layer_kinds(cfg: dict, family: str | None, num_layers: int) -> list[str]:
    given = cfg.get("layer_types")
    if family in _ALL_LAYERS_WINDOW or family in _ALL_FULL:
        window = cfg.get("sliding_window") if family in _ALL_LAYERS_WINDOW else None
        kinds = ["sliding_attention" if window is not None else "full_attention"] * num_layers
        if given is not None and list(given) != kinds:
            raise ValueError(f"config field layer_types disagrees with model_type={cfg['model_type']!r}, whose "
                             "attention ignores layer_types (it applies sliding_window to every layer or none)")
        return kinds
    if given is None:
        kinds = _default_layer_types(cfg, family, num_layers)
    else:
        if not isinstance(given, (list, tuple)) or len(given) != num_layers:
            raise ValueError(f"config field layer_types must list one kind per layer ({num_layers}), got {given!r}")
        kinds = list(given)
    known = ("full_attention", "sliding_attention", "chunked_attention")
    for i, kind in enumerate(kinds):
        if kind not in known:
            raise ValueError(f"config field layer_types[{i}]={kind!r} is not one of {known}")
    return kinds


def _default_layer_types(cfg: dict, family: str, num_layers: int) -> list[str]:
    """What transformers' config class builds when config.json carries no layer_types."""
    if family in _PATTERN_DEFAULT:
        pattern = cfg.get("sliding_window_pattern") or _PATTERN_DEFAULT[family]
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if family == "ministral":
        return ["sliding_attention" if cfg.get("sliding_window") is not None else "full_attention"] * num_layers
    if family in ("qwen2", "qwen3"):
        on = cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None
        first = cfg.get("max_window_layers", 28)
        return ["sliding_attention" if on and i >= first else "full_attention" for i in range(num_layers)]
    # llama4_text: no_rope_layers[i] truthy means layer i uses RoPE, and RoPE layers are the chunked ones.
    use_rope = cfg.get("no_rope_layers") or [int((i + 1) % cfg.get("no_rope_layer_interval", 4) != 0)
                                              for i in range(num_layers)]
    if len(use_rope) != num_layers:
        raise ValueError(f"config field no_rope_layers must have {num_layers} entries, got {len(use_rope)}")
    chunked = cfg.get("attention_chunk_size") is not None
    return ["chunked_attention" if rope and chunked else "full_attention" for rope in use_rope]


def _window(cfg: dict, family: str | None) -> int:
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        window = None  # transformers discards it: the layer would silently attend in full
    if not is_int(window) or window < 1:
        raise ValueError(f"config field sliding_window must be an integer >= 1 for sliding layers, got {window!r}")
    return window


def _config_int(cfg: dict, field: str) -> int:
    return check_int(f"config field {field}", cfg.get(field), 1)


def _num_kv_heads(cfg: dict, family: str | None) -> int:
    if cfg.get("num_key_value_heads") is None and family in _KV_HEADS_DERIVED:
        return _config_int(cfg, "num_attention_heads")
    return _config_int(cfg, "num_key_value_heads")


def _head_size(cfg: dict, family: str | None) -> int:
    if family == "cohere2" or (cfg.get("head_dim") is None and family in _HEAD_DIM_DERIVED):
        hidden, heads = _config_int(cfg, "hidden_size"), _config_int(cfg, "num_attention_heads")
        if hidden % heads:
            raise ValueError(f"config fields hidden_size={hidden} and num_attention_heads={heads}: "
                             "no whole head_dim")
        return hidden // heads
    return _config_int(cfg, "head_dim")


def _dtype(cfg: dict, override: str | None) -> str:
    value = override if override is not None else (cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    name = str(value).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"config field dtype={value!r} is not one of {sorted(DTYPE_BYTES)}")
    return name
