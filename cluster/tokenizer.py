"""Text <-> token ids for the Serve app: the model's own tokenizer when it ships one, bytes otherwise.

The byte-level fallback needs no files and no downloads, so text prompts work with the tiny random
models (vocabulary 256: one token per byte). Both kinds offer what the app uses: ``encode``, ``decode``,
``chat_prompt``, ``eos_token_id`` and ``max_chars_per_token`` (when known, a prompt of ``n`` characters
has at least ``n / max_chars_per_token`` tokens: an over-long prompt is refused before it is encoded); ``StreamDecoder`` turns a stream of ids
into text deltas that never split a multi-byte character.
"""
from __future__ import annotations

import os

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _plain_chat(messages: list[dict]) -> str:
    """A template for models without one: each turn on its own lines, then the assistant's cue."""
    turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return turns + "<|assistant|>\n"


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; undecodable bytes become U+FFFD."""

    vocab_size = 256
    eos_token_id = None
    max_chars_per_token = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return self.encode(_plain_chat(messages))


class HFTokenizer:
    """A transformers tokenizer read from local files, with the model's chat template when it has one."""

    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer  # heavy: only when a model brings its own tokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.vocab_size = len(self.tok)
        self.eos_token_id = self.tok.eos_token_id
        self.max_chars_per_token = _max_chars_per_token(self.tok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self.tok.decode(token_ids, skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if self.tok.chat_template:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.encode(text, add_special_tokens=False)  # the template already holds BOS
        return self.encode(_plain_chat(messages))


def _max_chars_per_token(tok) -> int | None:
    """Most characters of text one token can stand for, or None when that is not bounded by its vocabulary.

    Bounded for a BPE model without a normalizer (which could delete characters) and without fused unknown
    tokens (one of which covers any run of unknown characters): every token's string is then the text it
    covers, in characters or (byte-level) in bytes, which are at least as many. Added tokens count too."""
    backend = getattr(tok, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if type(model).__name__ != "BPE" or backend.normalizer is not None or (model.unk_token and model.fuse_unk):
        return None
    return max(len(t) for t in tok.convert_ids_to_tokens(list(range(len(tok)))) if t) or None


def load_tokenizer(model_dir: str | os.PathLike | None) -> ByteTokenizer | HFTokenizer:
    if model_dir is not None and os.path.isdir(model_dir) \
            and any(os.path.exists(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        return HFTokenizer(os.fspath(model_dir))
    return ByteTokenizer()


class StreamDecoder:
    """Text deltas of a growing id list; a trailing partial character waits for the bytes that finish it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.sent = ""

    def add(self, token_ids: list[int], final: bool = False) -> str:
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids)
        if not final:
            text = text.rstrip("\ufffd")
        delta = text[len(self.sent):]
        self.sent += delta
        return delta
