"""The default model shipped in models/swakv-tiny-hybrid: loads offline, is hybrid, speaks bytes, learned text."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "swakv-tiny-hybrid"
PROMPT = "The "


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True).eval()


def looks_like_text(text: str) -> bool:
    """Printable, at least half letters or spaces, and at least two different words of two or more letters
    (a model stuck repeating one byte, as a random one is, gives none or one)."""
    printable = all(c.isprintable() or c in "\n\t" for c in text) and "\ufffd" not in text
    letters_or_spaces = sum(c.isalpha() or c == " " for c in text)
    words = set(re.findall(r"[A-Za-z]{2,}", text))
    return printable and len(text) >= 12 and 2 * letters_or_spaces >= len(text) and len(words) >= 2


def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int = 24) -> str:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_config_mixes_sliding_and_full_layers(model):
    config = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    assert config.layer_types.count("sliding_attention") == 4 and config.layer_types.count("full_attention") == 2
    assert config.sliding_window == 64
    assert config.hidden_size == 128 and config.head_dim == 32
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert (config.vocab_size, config.pad_token_id, config.bos_token_id, config.eos_token_id) == (259, 256, 257, 258)
    assert config.max_position_embeddings == 2048
    assert model.generation_config.eos_token_id == 258
    assert model.dtype == torch.float32


def test_swakv_reads_sliding_and_full_layer_specs(model):
    from kvmanager.specs import FullAttention, SlidingWindow
    from workers.models.layer_kinds import layer_specs

    sliding = SlidingWindow(block_size=16, num_kv_heads=2, head_size=32, dtype="float32", window=64)
    full = FullAttention(block_size=16, num_kv_heads=2, head_size=32, dtype="float32")
    specs = layer_specs(model.config, block_size=16)
    assert list(specs.values()) == [sliding, sliding, full, sliding, sliding, full]


@pytest.mark.parametrize("text", ["Hello, world!  tabs\tand\nnewlines", "héllo wörld, Ünïcödé — ça va",
                                  "emoji 🎉👍🏽 家族 ∑"])
def test_tokenizer_is_bytes_and_round_trips(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_special_tokens_and_chat_template(tokenizer):
    assert [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id] == [256, 257, 258]
    assert tokenizer.convert_ids_to_tokens([256, 257, 258]) == ["<|pad|>", "<|bos|>", "<|eos|>"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == ("<|bos|><|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello<|eos|>"
                      "<|user|>\nBye\n<|assistant|>\n")
    ids = tokenizer.encode(prompt)
    assert ids[0] == 257 and ids.count(258) == 1 and ids[1:10] == list(b"<|system|")


def test_trained_model_continues_with_text_and_random_weights_do_not(model, tokenizer):
    text = greedy_continuation(model, tokenizer, PROMPT)
    assert looks_like_text(text), repr(text)
    for seed in (0, 1, 2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random_model = transformers.Gemma3ForCausalLM(model.config).eval()
        random_text = greedy_continuation(random_model, tokenizer, PROMPT)
        assert not looks_like_text(random_text), (seed, random_text)


def test_files_are_small_and_the_card_says_what_it_is():
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 8 * 2**20
    card = (MODEL_DIR / "README.md").read_text()
    for phrase in ("tiny", "not a useful assistant", "Gemma3ForCausalLM", "nats/byte", "standard library"):
        assert phrase in card, phrase
