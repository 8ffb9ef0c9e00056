"""A response's streaming side: server-sent events, one OpenAI choice fed from its engine stream (text
deltas with stop strings cut, logprob entries), usage, and how an engine request is cancelled."""
from __future__ import annotations

import json

import ray
from fastapi.responses import StreamingResponse
from ray.exceptions import RayActorError

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


def cancel(engine, stream, request_id: str | None) -> None:
    """Cancel the engine's stream (its generator aborts the request) and, once the engine's id for it is
    known, abort it outright as well: that id is unique, so this can never reach another request."""
    try:
        ray.cancel(stream)
        if request_id is not None:
            engine.abort.remote(request_id)
    except RayActorError:
        pass  # the engine is gone, and the request with it


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
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, item: StreamItem) -> tuple[str, list]:
        """Take one engine item; return its text delta and the logprob entries it added."""
        entries = item.get("logprobs") or []
        added = [(token, len(self.echo) + len(self.decoder.text), entry)
                 for token, entry in zip(item["token_ids"], entries)]
        self.logprobs += added
        self.token_ids += item["token_ids"]
        self.num_cached_tokens = item.get("num_cached_tokens", 0)
        delta = self.decoder.add(item["token_ids"], final=item["finished"])
        if self.decoder.stopped:
            self.finish_reason = "stop"
        elif item["finished"]:
            self.finish_reason = item["finish_reason"]
        return delta, added

    @property
    def text(self) -> str:
        return self.echo + self.decoder.text

