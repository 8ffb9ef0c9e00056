"""The OpenAI API as this server reads it: request bodies (strict: unknown or mistyped fields are refused),
the options it refuses because it does not implement them, OpenAI-shaped errors, and how an engine's
refusal or failure becomes one. ``server.py`` answers the routes; README lists what is refused and why.
"""
from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray.exceptions import RayActorError

from workers.protocol import MAX_LOGPROBS

from cluster.engine.types import StreamItem
from cluster.ray.engine_actor import EngineUnavailable

DEFAULT_MAX_BODY_BYTES = 8 << 20   # a 128k-token prompt as JSON-escaped text or token ids needs ~1 MB
PARSE_IN_THREAD_BYTES = 64 << 10   # parse and tokenise bodies larger than this off the event loop
RETRY_MESSAGE = "the engine restarted while serving this request; it can be retried"
MAX_N = 16                 # choices per prompt
MAX_PROMPTS = 64           # prompts in one /v1/completions request
MAX_CHOICES = 256          # prompts x n
MAX_STOP = 4               # stop strings (OpenAI's limit)
LOGPROB_FLOOR = -9999.0    # JSON has no -inf


# -- request bodies -----------------------------------------------------------------------------
class Strict(BaseModel):
    # Strict: "16" is not a number and 1 is not a bool. Unknown fields are refused (400 naming them):
    # an option we ignored silently would be an option the client believes it got.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class Body(Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)                       # vLLM's extension; -1 and 0: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)          # vLLM's extension
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)   # vLLM's extension
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-2**63, lt=2**64)
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = None                          # only best_of == n (nothing to choose between)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict | None = None                 # only {"type": "text"}
    # Tool calling is not implemented: any use of it is refused (see ``_refuse``).
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    # Accepted and ignored on purpose: they label, store or route a request, never change its output.
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionBody(Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None                           # insertion is not implemented: refused unless empty


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None                             # passed to the chat template, which may use it

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    modalities: list[Literal["text"]] | None = None


# -- errors -------------------------------------------------------------------------------------
class APIError(Exception):
    """An OpenAI-shaped error: ``code`` is a string or None, ``param`` the request field at fault."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def engine_restarted() -> APIError:
    return APIError(503, RETRY_MESSAGE, "engine_restarted", code="engine_restarted")


# Refusals a replica makes before streaming anything, which another replica may not make.
RETRY_ELSEWHERE = ("engine_restarted", "engine_unavailable", "server_shutting_down")

_ENGINE_ERRORS = {   # an engine item's error_type -> (status, type)
    "request_failed": (500, "server_error"),
    "engine_unavailable": (503, "engine_unavailable"),
    "server_shutting_down": (503, "server_shutting_down"),
}


def error_from_item(item: StreamItem) -> APIError:
    """The error an engine item that ends its request with finish_reason "error" carries."""
    status, type_ = _ENGINE_ERRORS.get(item.get("error_type"), (500, "server_error"))
    return APIError(status, item.get("error") or "the request failed", type_, code=item.get("error_type"))


def error_from_engine(exc: BaseException) -> APIError:
    """An engine-side exception as the client should see it; the engine's ValueErrors are the client's."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RayActorError):
        return engine_restarted()
    cause = getattr(exc, "cause", None) or exc  # a RayTaskError carries the engine's own exception
    if isinstance(cause, EngineUnavailable):
        type_ = "server_shutting_down" if cause.status == "stopping" else "engine_unavailable"
        return APIError(503, cause.message, type_, code=type_)
    if isinstance(cause, (ValueError, TypeError)):
        return APIError(400, str(cause))
    return APIError(503, f"engine error: {cause}", "engine_error", code="engine_error")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "literal"}


def validation_error(err: ValidationError) -> APIError:
    parts, param = [], None
    for e in err.errors(include_url=False):
        if e["type"] == "json_invalid":
            return APIError(400, f"request body is not valid JSON: {e['ctx'].get('error', e['msg'])}")
        path = [str(p) for p in e["loc"] if isinstance(p, int) or ("[" not in p and p not in _TYPE_TAGS)]
        loc = ".".join(path)
        param = param or loc or None
        if e["type"] == "extra_forbidden":
            parts.append(f"{loc}: unrecognized request argument (this server does not support it)")
        else:
            parts.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    return APIError(400, "; ".join(dict.fromkeys(parts)), param=param)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` (by its Content-Length, or
    while it streams in), so a huge body is never held whole."""
    def too_large() -> APIError:
        return APIError(413, f"request body exceeds {limit} bytes (the server's --max-body-bytes)",
                        code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large()
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, body_type: type[Body], limit: int) -> Body:
    raw = await read_body(request, limit)
    try:
        if len(raw) > PARSE_IN_THREAD_BYTES:
            return await asyncio.to_thread(body_type.model_validate_json, raw)
        return body_type.model_validate_json(raw)
    except ValidationError as err:
        raise validation_error(err) from None


def refuse_unsupported(body: Body) -> None:
    """Options that are well-formed but would change the output in ways this server does not implement."""
    def no(param: str, message: str):
        raise APIError(400, f"{param}: {message}", param=param)

    if body.best_of is not None and body.best_of != body.n:
        no("best_of", f"only best_of == n is supported (got best_of={body.best_of}, n={body.n})")
    if body.response_format is not None and body.response_format != {"type": "text"}:
        no("response_format", 'only {"type": "text"} is supported (no JSON mode or schemas)')
    if body.tools:
        no("tools", "tool calling is not supported")
    if body.tool_choice not in (None, "none"):
        no("tool_choice", "tool calling is not supported")
    if body.functions:
        no("functions", "function calling is not supported")
    if body.function_call not in (None, "none"):
        no("function_call", "function calling is not supported")
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stops) > MAX_STOP or not all(stops):
        no("stop", f"at most {MAX_STOP} stop strings, none empty")
    if body.stream_options is not None and not body.stream:
        no("stream_options", "only allowed when stream is true")
    for key, bias in (body.logit_bias or {}).items():
        if not key.isdigit():
            no("logit_bias", f"keys must be token ids, got {key!r}")
        if not -100.0 <= bias <= 100.0:
            no("logit_bias", f"biases must lie in [-100, 100], got {bias} for token {key}")
    if isinstance(body, CompletionBody):
        if body.suffix:
            no("suffix", "inserting text before a suffix is not supported")
        if body.echo and body.logprobs is not None:
            no("echo", "echo with logprobs would need the prompt's logprobs, which this server does not compute")
    if isinstance(body, ChatBody) and body.top_logprobs is not None and not body.logprobs:
        no("top_logprobs", "top_logprobs needs logprobs: true")


def stop_strings(body: Body) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])



REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def response_id(request: Request, kind: str) -> str:
    """``cmpl-`` / ``chatcmpl-`` and the ``X-Request-Id`` header: the client's own (so load tests and
    retries name their requests), else the one Serve's proxy assigns, which its logs carry too. Only a
    label: two requests may share it, and the engine gives each its own id."""
    given = request.headers.get("x-request-id") or uuid.uuid4().hex
    if not REQUEST_ID_PATTERN.fullmatch(given):
        raise APIError(400, "X-Request-Id must be 1-128 characters of letters, digits and . _ : -",
                       param="X-Request-Id")
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{given}"

