"""Logprobs as clients read them: OpenAI's chat and legacy-completions objects, and vLLM's
``prompt_logprobs``. The engine's entries are raw log-softmax values: a generated token's
``(logprob, top ids, top logprobs)``, a prompt token's ``(logprob, top ids, top logprobs, rank)``.

An echoed prompt's tokens come first in a completion's logprobs, as OpenAI's legacy API and every eval
harness read them: the first prompt token has no logprob (nothing comes before it: ``None``), and the
text offsets run over the echoed text, so a harness can find where its continuation starts.
"""
from __future__ import annotations

from cluster.engine.tokenizer import StreamDecoder

from .openai import LOGPROB_FLOOR


def _floor(v: float) -> float:
    return max(v, LOGPROB_FLOOR)   # JSON has no -inf


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token(self, t: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(t)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat(self, entries: list) -> dict:
        """``entries``: (token, text offset, engine entry) per generated token."""
        content = []
        for t, _, (lp, top_ids, top_lps, *_) in entries:
            text, raw = self.token(t)
            content.append({"token": text, "logprob": _floor(lp), "bytes": raw, "top_logprobs": [
                {"token": self.token(i)[0], "logprob": _floor(v), "bytes": self.token(i)[1]}
                for i, v in zip(top_ids, top_lps)]})
        return {"content": content, "refusal": None}

    def completion(self, entries: list, k: int) -> dict:
        """``entries``: (token, text offset, engine entry or None) per token; ``k`` top entries each."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, offset, entry in entries:
            out["tokens"].append(self.token(t)[0])
            out["text_offset"].append(offset)
            if entry is None:          # an echoed prompt's first token: nothing before it to score it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            lp, top_ids, top_lps = entry[:3]
            top = {}
            for i, v in list(zip(top_ids, top_lps))[:k]:   # most likely first; a text two tokens share keeps the likelier
                top.setdefault(self.token(i)[0], _floor(v))
            top.setdefault(self.token(t)[0], _floor(lp))  # the token itself is always listed
            out["token_logprobs"].append(_floor(lp))
            out["top_logprobs"].append(top)
        return out

    def echoed_prompt(self, prompt: list[int], scored: list) -> list:
        """(token, text offset, entry or None) per prompt token, ``scored`` holding positions 1 on. The offsets
        are where each token's text starts in the prompt decoded token by token (the echoed text)."""
        decoder, entries = StreamDecoder(self.tokenizer), []
        for q, t in enumerate(prompt):
            entries.append((t, len(decoder.text), scored[q - 1] if q else None))
            decoder.add([t], final=q == len(prompt) - 1)
        return entries

    def prompt_logprobs(self, prompt: list[int], scored: list, k: int) -> list:
        """vLLM's ``prompt_logprobs``: None for the first token, then per prompt token a map from token id to
        ``{logprob, rank, decoded_token}`` holding that token (with its rank in the vocabulary) and the
        ``k`` most likely ones (ranks 1 .. k)."""
        out: list = [None]
        for t, (lp, top_ids, top_lps, rank) in zip(prompt[1:], scored):
            entry = {str(t): {"logprob": _floor(lp), "rank": rank, "decoded_token": self.token(t)[0]}}
            for r, (i, v) in enumerate(list(zip(top_ids, top_lps))[:k], start=1):
                entry.setdefault(str(i), {"logprob": _floor(v), "rank": r, "decoded_token": self.token(i)[0]})
            out.append(entry)
        return out
