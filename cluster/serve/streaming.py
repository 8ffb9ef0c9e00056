"""A response's streaming side: server-sent events, one OpenAI choice fed from its engine items (text
deltas with stop strings cut, logprob entries), and usage."""
from __future__ import annotations

import json

from fastapi.responses import StreamingResponse

from cluster.engine.tokenizer import StreamDecoder
from cluster.engine.types import SamplingParams, StreamItem


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class EventStream(StreamingResponse):
    """A server-sent event stream that ends when its events do or when Serve cancels the handler.

    Starlette's ``StreamingResponse`` also stops at the first ``http.disconnect`` its ``receive`` returns.
    Behind Serve that ``receive`` is a proxy of the HTTP proxy's, and Serve makes up an ``http.disconnect``
    when the proxy no longer answers for the request (``ASGIReceiveProxy``, on a ``KeyError``). Once,
    in a full test run, a live stream ended after its first token with neither ``[DONE]`` nor an error
    while its client was still reading. A client that really leaves is seen by the HTTP proxy, which
    cancels the handler; ``_sse_stream``'s ``finally`` then aborts the engine requests."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        await self.stream_response(send)


def merged_event(a: tuple, b: tuple) -> tuple:
    """Two consecutive events of one choice as one: (choice, text delta, item, finish reason, logprobs)."""
    item = {**b[2], "token_ids": a[2]["token_ids"] + b[2]["token_ids"]}
    return a[0], a[1] + b[1], item, b[3], a[4] + b[4]


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class ResponseChoice:
    """One choice of a response: its engine request, its text (stop strings cut here) and logprobs."""

    def __init__(self, index: int, prompt: int, engine_id: str, params: SamplingParams, decoder: StreamDecoder,
                 echo: str = ""):
        self.index, self.prompt, self.engine_id, self.params = index, prompt, engine_id, params
        self.decoder, self.echo = decoder, echo
        self.first: ResponseChoice | None = None       # its prompt's first choice, whose replica its siblings join
        self.replica = None                     # the engine replica serving it, once routed
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[int, int, tuple]] = []   # (token, text offset, engine entry)
        self.prompt_logprobs: list[tuple] = []   # engine entries of prompt positions 1.. (if it scores its prompt;
                                                 # all arrive by its first token: the server's ``_open`` takes them)
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, item: StreamItem) -> tuple[str, list]:
        """Take one engine item; return its text delta and the logprob entries it added. An item holding
        several steps' tokens (its stream fell behind) may go on past a stop string: it keeps only the tokens
        up to the one that completed it (``item["token_ids"]`` is cut too, for the chunk and the usage)."""
        tokens, entries = item["token_ids"], item.get("logprobs") or []
        added, delta = [], ""
        if entries or (self.decoder.stop and len(tokens) > 1):
            # one by one: each token's text offset is where its text starts; a stop string ends at a token
            last = len(tokens) - 1
            for i, token in enumerate(tokens):
                if i < len(entries):
                    added.append((token, len(self.echo) + len(self.decoder.text), entries[i]))
                delta += self.decoder.add([token], final=item["finished"] and i == last)
                if self.decoder.stopped and i < last:
                    tokens = item["token_ids"] = tokens[:i + 1]
                    break
        else:
            delta = self.decoder.add(tokens, final=item["finished"])
        self.logprobs += added
        self.token_ids += tokens
        self.num_cached_tokens = item.get("num_cached_tokens", 0)
        if self.decoder.stopped:
            self.finish_reason = "stop"
        elif item["finished"]:
            self.finish_reason = item["finish_reason"]
        return delta, added

    @property
    def text(self) -> str:
        return self.echo + self.decoder.text

