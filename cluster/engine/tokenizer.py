"""Text <-> token ids for the Serve app: the model's own tokenizer when it ships one, bytes otherwise.

The byte-level fallback needs no files and no downloads, so text prompts work with the tiny random
models (vocabulary 256: one token per byte). Both kinds offer the same things the app uses:
``encode``, ``decode``, ``chat_prompt``, ``eos_token_id``, for logprobs ``token_bytes`` (the raw bytes a
token stands for; its text is their UTF-8 reading), and ``max_chars_per_token`` (when known, a prompt of
``n`` characters has at least ``n / max_chars_per_token`` tokens: an over-long prompt is refused before it
is encoded). ``StreamDecoder`` turns a stream of ids into text deltas that never split a multi-byte
character and never show part of a stop string.
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

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else b""


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for bytes (GPT-2's scheme): printable Latin-1 bytes stand for
    themselves, the others for the code points from 256 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet, extra = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[chr(b)] = b
        else:
            alphabet[chr(256 + extra)] = b
            extra += 1
    return alphabet


class HFTokenizer:
    """A transformers tokenizer read from local files, with the model's chat template when it has one."""

    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer  # heavy: only when a model brings its own tokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.vocab_size = len(self.tok)
        self.eos_token_id = self.tok.eos_token_id
        self.max_chars_per_token = _max_chars_per_token(self.tok)
        self._special = set(self.tok.all_special_ids)
        backend = getattr(self.tok, "backend_tokenizer", None)
        byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self._alphabet = _byte_level_alphabet() if byte_level else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self.tok.decode(token_ids, skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if self.tok.chat_template:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.encode(text, add_special_tokens=False)  # the template already holds BOS
        return self.encode(_plain_chat(messages))

    def token_bytes(self, token_id: int) -> bytes:
        piece = self.tok.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self._alphabet is not None and token_id not in self._special \
                and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        if token_id in self._special:
            return piece.encode()
        return self.tok.decode([token_id]).encode()


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
    """Text deltas of a growing id list, decoding only a short tail each time.

    A trailing partial character waits for the bytes that finish it. With ``stop`` strings, text that
    could still become a stop string is held back, and once one appears the text ends just before it
    (``stopped``); the stop string itself is never returned.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] | list[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.token_ids: list[int] = []
        self.text = ""            # decoded so far; with stop strings, cut at the first one
        self.sent = ""            # what ``add`` returned so far
        self.stopped = False
        self._prefix = self._read = 0   # the tail decoded each time starts at _prefix; text covers up to _read

    def add(self, token_ids: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        decode = self.tokenizer.decode
        before = decode(self.token_ids[self._prefix:self._read])
        now = decode(self.token_ids[self._prefix:])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self.token_ids)
        pending = self.text[len(self.sent):]
        if self.stop:
            found = [i for i in (self.text.find(s, len(self.sent)) for s in self.stop) if i >= 0]
            if found:
                self.stopped = True
                self.text = self.text[:min(found)]
                pending = self.text[len(self.sent):]
            elif not final:
                pending = pending[:len(pending) - self._could_become_stop(pending)]
        self.sent += pending
        return pending

    def _could_become_stop(self, pending: str) -> int:
        """Length of the longest end of ``pending`` that begins some stop string."""
        for k in range(min(len(pending), max(map(len, self.stop)) - 1), 0, -1):
            tail = pending[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
