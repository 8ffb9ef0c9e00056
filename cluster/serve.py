"""The OpenAI-compatible Ray Serve application in front of the named engine actor.

Replicas hold no model: they tokenise, validate, and relay the engine's per-request token streams, so
several replicas can share one engine. Everything a client can get wrong is answered with a 4xx and a
JSON error body (OpenAI's shape) before the engine sees the request: every field within a range the
engine carries, bodies over ``max_body_bytes`` (413) before they are parsed, prompts over the context
before they reach the engine. Parsing large bodies and tokenising run in a thread, so one huge request
never stalls the others or ``/health``. An engine that dies mid-request turns into a 503 (an SSE error
event once a stream has started) that says the request can be retried, and the next request looks the
engine up again; a request the engine fails alone gets a 500. A client that goes away cancels its
engine stream, which aborts the request there. ``X-Request-Id`` is the client's label for its request,
echoed back (by Serve's proxy); the engine names requests itself. Sampling is greedy unless ``temperature`` is set;
``max_tokens`` defaults to 16.
"""

import asyncio
import json
import random
import re
import time
import uuid
from typing import Literal

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from ray import serve
from ray.exceptions import RayActorError
from starlette.exceptions import HTTPException as StarletteHTTPException

from workers.protocol import SEED_RANGE

from .engine_actor import EngineUnavailable
from .tokenizer import StreamDecoder, load_tokenizer

ENGINE_CALL_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 5.0
RETRY_MESSAGE = "the engine restarted while serving this request; it can be retried"
DEFAULT_MAX_BODY_BYTES = 8 << 20   # a 128k-token prompt as JSON-escaped text or token ids needs ~1 MB
PARSE_IN_THREAD_BYTES = 64 << 10   # parse and tokenise bodies larger than this off the event loop


# -- request bodies -----------------------------------------------------------------------------
class _Body(BaseModel):
    # Strict: "16" is not a number and 1 is not a bool. Unused OpenAI options are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])   # int64, as OpenAI and vLLM
    n: Literal[1] = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict | None = None

    @model_validator(mode="after")
    def _no_stop_strings(self):
        if self.stop:
            raise ValueError("stop strings are not supported; use stop_token_ids")
        return self


class CompletionBody(_Body):
    prompt: str | list[int]


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


# -- errors -------------------------------------------------------------------------------------
class APIError(Exception):
    """An error response in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, ``code`` a
    string or null."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", *,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _engine_restarted() -> APIError:
    return APIError(503, RETRY_MESSAGE, "engine_restarted", code="engine_restarted")


_ENGINE_ERRORS = {   # an engine item's error_type -> (status, type)
    "request_failed": (500, "server_error"),
    "engine_unavailable": (503, "engine_unavailable"),
    "server_shutting_down": (503, "server_shutting_down"),
}


def _from_item(item: dict) -> APIError:
    status, type_ = _ENGINE_ERRORS.get(item.get("error_type"), (500, "server_error"))
    return APIError(status, item.get("error") or "the request failed", type_, code=item.get("error_type"))


def _from_engine(exc: BaseException) -> APIError:
    """An engine-side exception as the client should see it; the engine's ValueErrors are the client's."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RayActorError):
        return _engine_restarted()
    cause = getattr(exc, "cause", None) or exc  # a RayTaskError carries the engine's own exception
    if isinstance(cause, EngineUnavailable):
        type_ = "server_shutting_down" if cause.status == "stopping" else "engine_unavailable"
        return APIError(503, cause.message, type_, code=type_)
    if isinstance(cause, (ValueError, TypeError)):
        return APIError(400, str(cause))
    return APIError(503, f"engine error: {cause}", "engine_error", code="engine_error")


def _validation_error(err: ValidationError) -> APIError:
    parts, param = [], None
    for e in err.errors(include_url=False):
        if e["type"] == "json_invalid":
            return APIError(400, f"request body is not valid JSON: {e['ctx'].get('error', e['msg'])}")
        loc = ".".join(str(p) for p in e["loc"])
        parts.append(f"{loc}: {e['msg']}" if loc else e["msg"])
        param = param or loc or None
    return APIError(400, "; ".join(parts), param=param)


async def _read_body(request: Request, limit: int) -> bytes:
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


async def _parse(request: Request, body_type: type[_Body], limit: int) -> _Body:
    raw = await _read_body(request, limit)
    try:
        if len(raw) > PARSE_IN_THREAD_BYTES:
            return await asyncio.to_thread(body_type.model_validate_json, raw)
        return body_type.model_validate_json(raw)
    except ValidationError as err:
        raise _validation_error(err) from None


# -- the application ----------------------------------------------------------------------------
app = FastAPI(title="swakv", docs_url=None, redoc_url=None)


@app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return APIError(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404
                    else "invalid_request_error").response()



_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def _request_id(request: Request, kind: str) -> str:
    """``cmpl-`` / ``chatcmpl-`` and the ``X-Request-Id`` header: the client's own (so load tests and
    retries name their requests), else the one Serve's proxy assigns, which its logs carry too. Only a
    label: two requests may share it, and the engine gives each its own id."""
    given = request.headers.get("x-request-id") or uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(given):
        raise APIError(400, "X-Request-Id must be 1-128 characters of letters, digits and . _ : -",
                       param="X-Request-Id")
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{given}"


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _stop(engine, stream, request_id: str | None) -> None:
    """Cancel the engine's stream (its generator aborts the request) and, once the engine's id for it is
    known, abort it outright as well: that id is unique, so this can never reach another request."""
    try:
        ray.cancel(stream)
        if request_id is not None:
            engine.abort.remote(request_id)
    except RayActorError:
        pass  # the engine is gone, and the request with it


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# name, stats key, type, help
_METRICS = (
    ("swakv_requests_running", "running", "gauge", "Requests being computed."),
    ("swakv_requests_waiting", "waiting", "gauge", "Requests queued or preempted."),
    ("swakv_kv_cache_usage_ratio", "kv_usage", "gauge", "Fraction of KV blocks in use."),
    ("swakv_prefix_cache_hit_rate", "prefix_hit_rate", "gauge", "Prefix-cache hit tokens over queried tokens."),
    ("swakv_prefix_cache_queried_tokens_total", "prefix_queried_tokens", "counter", "Prompt tokens looked up."),
    ("swakv_prefix_cache_hit_tokens_total", "prefix_hit_tokens", "counter", "Prompt tokens found cached."),
    ("swakv_preemptions_total", "preemptions", "counter", "Requests preempted for lack of KV blocks."),
    ("swakv_steps_total", "steps", "counter", "Engine steps run."),
    ("swakv_scheduled_tokens_total", "scheduled_tokens", "counter", "Tokens computed by engine steps."),
    ("swakv_step_time_seconds_mean", "mean_step_time_s", "gauge", "Mean wall time of an engine step."),
    ("swakv_step_time_seconds_last", "last_step_time_s", "gauge", "Wall time of the last engine step."),
    ("swakv_delta_bytes_total", "delta_bytes", "counter", "Encoded block-table delta bytes sent to workers."),
    ("swakv_worker_restarts_total", "worker_restarts", "counter", "Worker-group restarts after a failure."),
    ("swakv_recomputed_requests_total", "recomputed_requests", "counter", "Requests recomputed after a restart."),
)


def prometheus_text(stats: dict) -> str:
    """The engine's stats in the Prometheus text exposition format (version 0.0.4)."""
    lines = []

    def family(name, kind, help_, samples):
        lines.extend((f"# HELP {name} {help_}", f"# TYPE {name} {kind}"))
        lines.extend(f"{name}{labels} {float(value)!r}" for labels, value in samples)

    for name, key, kind, help_ in _METRICS:
        if key in stats:
            family(name, kind, help_, [("", stats[key])])
    family("swakv_kv_cache_group_usage_ratio", "gauge", "Fraction of KV blocks held by each KV-cache group.",
           [(f'{{group="{g}"}}', u) for g, u in enumerate(stats.get("kv_usage_per_group", []))])
    family("swakv_requests_finished_total", "counter", "Finished requests by reason.",
           [(f'{{reason="{r}"}}', n) for r, n in sorted(stats.get("finished", {}).items())])
    return "\n".join(lines) + "\n"


@serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIServer:
    def __init__(self, engine_name: str, namespace: str, model_name: str, tokenizer_dir: str | None,
                 max_model_len: int, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.engine_name, self.namespace = engine_name, namespace
        self.model_name, self.max_model_len = model_name, max_model_len
        self.max_body_bytes = max_body_bytes
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.created = int(time.time())
        self._engine = None
        self._vocab_size = self.tokenizer.vocab_size
        self._eos_token_ids: tuple[int, ...] = ()

    # -- engine connection ------------------------------------------------------------------------
    async def _connect(self):
        if self._engine is None:
            try:
                engine = ray.get_actor(self.engine_name, namespace=self.namespace)
                info = await asyncio.wait_for(engine.ready.remote(), ENGINE_CALL_TIMEOUT_S)
            except (ValueError, RayActorError, asyncio.TimeoutError) as exc:
                raise APIError(503, f"engine {self.engine_name!r} is not available ({type(exc).__name__}); "
                               "the request can be retried", "engine_restarted", code="engine_restarted") from None
            self._vocab_size = (info or {}).get("vocab_size", self._vocab_size)
            self._eos_token_ids = tuple((info or {}).get("eos_token_ids", ()))
            self._engine = engine
        return self._engine

    async def _call(self, method: str):
        engine = await self._connect()
        try:
            return await asyncio.wait_for(getattr(engine, method).remote(), ENGINE_CALL_TIMEOUT_S)
        except (RayActorError, asyncio.TimeoutError):
            self._engine = None
            raise _engine_restarted() from None

    async def _start(self, label: str, prompt_ids: list[int], params: dict):
        """Submit and await the first item, so a refused request is an HTTP error, not a broken stream."""
        for attempt in (0, 1):  # a handle cached from a dead engine gets one fresh look-up
            engine = await self._connect()
            stream = engine.generate.options(num_returns="streaming").remote(label, prompt_ids, params)
            try:
                return engine, stream, await (await stream.__anext__())
            except RayActorError:
                self._engine = None
                if attempt:
                    raise _engine_restarted() from None
            except asyncio.CancelledError:  # the client left before the first token
                _stop(engine, stream, None)
                raise
            except Exception as exc:  # noqa: BLE001 - the engine's own refusal
                raise _from_engine(exc) from None

    async def _items(self, label: str, prompt_ids: list[int], params: dict):
        """The engine's items for one request; if the consumer stops early, the engine stops too. An item
        that ends the request with an error is raised as the ``APIError`` it maps to."""
        engine, stream, item = await self._start(label, prompt_ids, params)
        request_id = item["request_id"]   # the engine's own, unique id
        try:
            while True:
                if item["finish_reason"] == "error":
                    raise _from_item(item)
                yield item
                if item["finished"]:
                    break
                item = await (await stream.__anext__())
        except RayActorError:
            self._engine = None
            raise _engine_restarted() from None
        except Exception as exc:  # noqa: BLE001
            raise _from_engine(exc) from None
        finally:
            if not item["finished"]:
                _stop(engine, stream, request_id)

    # -- shared request handling -----------------------------------------------------------------
    def _params(self, body: _Body, max_tokens: int | None) -> dict:
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        stop = list(body.stop_token_ids)
        if not body.ignore_eos:
            stop += [t for t in (self.tokenizer.eos_token_id, *self._eos_token_ids) if t is not None]
        return {"max_tokens": max_tokens or 16, "temperature": body.temperature,
                "seed": body.seed if body.seed is not None else random.getrandbits(63),
                "stop_token_ids": tuple(dict.fromkeys(stop))}

    def _check_ids(self, ids: list[int], field: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):   # C speed: a prompt may be long
            bad = [t for t in ids if not 0 <= t < self._vocab_size]
            raise APIError(400, f"{field}: token ids must lie in [0, {self._vocab_size}), got {bad[:8]}", param=field)

    def _check_length(self, num_tokens: int, at_least: bool = False) -> None:
        if num_tokens >= self.max_model_len:
            raise APIError(400, f"the prompt has {'at least ' if at_least else ''}{num_tokens} tokens, which leaves "
                           f"no room to generate within max_model_len={self.max_model_len}", param="prompt",
                           code="context_length_exceeded")

    def _check_text_length(self, num_chars: int) -> None:
        """Refuse text that cannot fit before spending any time encoding it."""
        per_token = self.tokenizer.max_chars_per_token
        if per_token:
            self._check_length(-(-num_chars // per_token), at_least=True)

    async def _tokenize(self, fn, arg, size: int) -> list[int]:
        """Tokenise off the event loop when the input is large, so other requests and /health go on."""
        return await asyncio.to_thread(fn, arg) if size > PARSE_IN_THREAD_BYTES else fn(arg)

    async def _respond(self, kind: str, body: _Body, prompt_ids: list[int], params: dict, request: Request):
        label = _request_id(request, kind)
        self._check_length(len(prompt_ids))
        self._check_ids(prompt_ids, "prompt")
        self._check_ids(list(params["stop_token_ids"]), "stop_token_ids")
        items = self._items(label, prompt_ids, params)
        head = {"id": label, "created": int(time.time()), "model": self.model_name}
        if body.stream:
            first = await anext(items)  # errors before the first token are still plain HTTP errors
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._sse_stream(kind, head, first, items, len(prompt_ids), usage),
                                     media_type="text/event-stream")
        token_ids, reason = [], None
        async for item in items:
            token_ids += item["token_ids"]
            reason = item["finish_reason"]
        text = self.tokenizer.decode(token_ids)
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
            head["object"] = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
            head["object"] = "text_completion"
        choice.update(token_ids=token_ids, finish_reason=reason)
        return {**head, "choices": [choice], "usage": _usage(len(prompt_ids), len(token_ids))}

    async def _sse_stream(self, kind: str, head: dict, first: dict, items, num_prompt: int, usage: bool):
        head = {**head, "object": "chat.completion.chunk" if kind == "chat" else "text_completion"}
        decoder = StreamDecoder(self.tokenizer)
        if kind == "chat":
            yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None}]})
        item = first
        try:
            while True:
                text = decoder.add(item["token_ids"], final=item["finished"])
                choice = {"index": 0, "delta": {"content": text}} if kind == "chat" \
                    else {"index": 0, "text": text, "logprobs": None}
                choice.update(token_ids=item["token_ids"], finish_reason=item["finish_reason"])
                yield _sse({**head, "choices": [choice]})
                if item["finished"]:
                    break
                item = await anext(items)
            if usage:
                yield _sse({**head, "choices": [], "usage": _usage(num_prompt, len(decoder.token_ids))})
        except Exception as exc:  # noqa: BLE001 - after the headers went out, errors travel in the stream
            end = {"index": 0, "delta": {}} if kind == "chat" else {"index": 0, "text": "", "logprobs": None}
            yield _sse({**head, "choices": [{**end, "token_ids": [], "finish_reason": "error"}]})
            yield _sse(_from_engine(exc).body())
        finally:
            await items.aclose()  # a client that went away stops the engine stream now, not at GC
        yield _sse("[DONE]")

    # -- routes ---------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request):
        body = await _parse(request, CompletionBody, self.max_body_bytes)
        await self._connect()   # the engine's vocabulary and EOS ids, before checking against them
        params = self._params(body, body.max_tokens)
        prompt = body.prompt
        if isinstance(prompt, str):
            self._check_text_length(len(prompt))
            prompt_ids = await self._tokenize(self.tokenizer.encode, prompt, len(prompt))
        else:
            prompt_ids = prompt
        return await self._respond("completion", body, prompt_ids, params, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        body = await _parse(request, ChatBody, self.max_body_bytes)
        await self._connect()
        params = self._params(body, body.max_completion_tokens or body.max_tokens)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        size = sum(len(m["content"]) for m in messages)
        self._check_text_length(size)
        prompt_ids = await self._tokenize(self.tokenizer.chat_prompt, messages, size)
        return await self._respond("chat", body, prompt_ids, params, request)

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "swakv", "max_model_len": self.max_model_len}]}

    @app.get("/health")
    async def health(self):
        """Readiness: 200 only when a completion would be served now; 503 (with why) otherwise."""
        for attempt in (0, 1):  # a handle cached from a dead engine gets one fresh look-up
            try:
                engine = self._engine or ray.get_actor(self.engine_name, namespace=self.namespace)
                state = await asyncio.wait_for(engine.health.remote(), HEALTH_TIMEOUT_S)
                break
            except (ValueError, RayActorError, asyncio.TimeoutError) as exc:
                stale, self._engine = self._engine, None
                if attempt or stale is None or isinstance(exc, asyncio.TimeoutError):
                    return APIError(503, f"the engine does not answer ({type(exc).__name__})", "engine_restarted",
                                    code="engine_restarted").response()
        if state["status"] != "ready":
            return APIError(503, f"the engine is {state['status']}: {state['detail']}", "engine_unavailable",
                            code=state["status"]).response()
        return {"status": "ok"}

    @app.get("/health/live")
    async def live(self):
        """Liveness: this replica answers, whatever the engine's state (restart the replica if not)."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(self):
        return PlainTextResponse(prometheus_text(await self._call("stats")),
                                 media_type="text/plain; version=0.0.4")


def build_app(engine_name: str, namespace: str, model_name: str, tokenizer_dir: str | None = None,
              max_model_len: int = 4096, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """A bound Serve application for ``serve.run``; the engine actor is found by name when needed."""
    return OpenAIServer.bind(engine_name, namespace, model_name, tokenizer_dir, max_model_len, max_body_bytes)


def run(app, host: str = "127.0.0.1", port: int = 8000, name: str = "swakv"):
    """Serve ``app`` over HTTP on ``host:port`` (Ray must be initialised); returns the deployment handle."""
    serve.start(http_options={"host": host, "port": port})
    return serve.run(app, name=name, route_prefix="/")
