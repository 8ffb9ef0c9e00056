"""Tiny random Hugging Face models, one per attention mix swakv serves, for tests and the CPU demo.

Real transformers model classes with real configs, shrunk: hidden 64, a few layers, vocab 256 (a byte
fits in a token), windows and chunks of 8 tokens so a prompt of a few dozen tokens crosses them. Weights
are drawn from a fixed seed with a wider init than the default so attention is far from uniform and
softcapping bites: a wrong window or a missing softcap then changes the logits visibly. Embeddings are
untied: tied ones make a random Gemma (which scales them by sqrt(hidden)) repeat its last token forever,
and greedy decoding would then compare nothing.
"""
from __future__ import annotations

from typing import Callable

import torch
import transformers

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=1024, initializer_range=0.15, bos_token_id=None,
               eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def _mistral() -> transformers.PretrainedConfig:
    return transformers.MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=8)


def _gemma2() -> transformers.PretrainedConfig:
    return transformers.Gemma2Config(**_COMMON, num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=16,
                                     attn_logit_softcapping=4.0, final_logit_softcapping=6.0)


def _gemma3() -> transformers.PretrainedConfig:
    return transformers.Gemma3TextConfig(
        **_COMMON, num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])


def _llama() -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(**_COMMON, num_hidden_layers=2)


def _llama4() -> transformers.PretrainedConfig:
    # Layers 0-2 chunked local (RoPE), layer 3 full (NoPE); temperature tuning off (see model_runner).
    return transformers.Llama4TextConfig(
        **{**_COMMON, "intermediate_size": 64}, intermediate_size_mlp=128, num_hidden_layers=4,
        attention_chunk_size=8, num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
        attn_temperature_tuning=False, use_qk_norm=False)


TINY_MODELS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "tiny-mistral": _mistral,   # every layer sliding
    "tiny-gemma2": _gemma2,     # alternating sliding/full, attention and final-logit softcap
    "tiny-gemma3": _gemma3,     # sliding, sliding, full, sliding
    "tiny-llama": _llama,       # full attention only
    "tiny-llama4": _llama4,     # chunked local + full
}

_CLASSES = {"tiny-mistral": "MistralForCausalLM", "tiny-gemma2": "Gemma2ForCausalLM",
            "tiny-gemma3": "Gemma3ForCausalLM", "tiny-llama": "LlamaForCausalLM", "tiny-llama4": "Llama4ForCausalLM"}


def tiny_config(name: str) -> transformers.PretrainedConfig:
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {sorted(TINY_MODELS)}")
    return TINY_MODELS[name]()


def build_tiny_model(name: str, seed: int = 0, attn_implementation: str = "eager",
                     dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """The same seed gives the same weights, so a reference copy can be built next to the served one."""
    config = tiny_config(name)
    config._attn_implementation = attn_implementation
    model_class = getattr(transformers, _CLASSES[name])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.to(dtype).eval()
