"""The OpenAI-compatible Ray Serve application in front of the named engine actors: its routes.

Replicas hold no model: they tokenise, validate, and relay the engine's per-request token streams, so
several replicas can share one engine. Everything a client can get wrong is answered with a 4xx and an
OpenAI-shaped error body (``{"error": {"message", "type", "param", "code"}}``) before the engine sees
the request; so is every option this server does not implement and that would change the output: a
client never gets a silent 200 for an option it asked for and did not get (README lists them). An engine
that dies mid-request turns into a 503 (an SSE error event once a stream has started) that says the
request can be retried, and the next request looks the engine up again; a request the engine fails on
its own (the model's logits for it were NaN) gets a 500. A client that goes away cancels its engine
streams, which aborts the requests there.

One request cannot stall the others: bodies over ``max_body_bytes`` get a 413 before they are read
whole; large bodies are parsed and their prompts tokenised in a thread, off the event loop; a text
prompt that cannot fit the context is refused from its length before it is encoded, when the tokenizer
bounds characters per token. ``X-Request-Id`` is the client's label for its request, echoed back (by
Serve's proxy) and in the response ``id``; the engine names each request itself, uniquely.

Sampling is greedy unless ``temperature`` is set; ``max_tokens`` defaults to the rest of the context.
Stop strings are matched here, on the detokenised text (the engine request is aborted at the match);
``n`` siblings of a prompt are submitted once the first one's prompt is computed, so they reuse its
KV blocks through the prefix cache instead of computing the prompt ``n`` times.
"""

import asyncio
import dataclasses
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from ray import serve
from ray.exceptions import RayActorError
from starlette.exceptions import HTTPException as StarletteHTTPException

from workers.protocol import SamplingSpec

from cluster.engine.tokenizer import StreamDecoder, load_tokenizer
from cluster.engine.types import ModelInfo, SamplingParams
from cluster.routing.policies import make_router
from cluster.routing.prompt import PromptHashes
from cluster.routing.replicas import ReplicaSet

from .metrics import prometheus_text
from .openai import (DEFAULT_MAX_BODY_BYTES, LOGPROB_FLOOR, MAX_CHOICES, MAX_PROMPTS, PARSE_IN_THREAD_BYTES,
                     RETRY_ELSEWHERE, APIError, Body, ChatBody, CompletionBody, engine_restarted, error_from_engine,
                     error_from_item, parse_body, refuse_unsupported, response_id, stop_strings)
from .streaming import EventStream, ResponseChoice, cancel, sse, usage

ENGINE_CALL_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 5.0


# -- the application ----------------------------------------------------------------------------
app = FastAPI(title="swakv", docs_url=None, redoc_url=None)


@app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return APIError(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404
                    else "invalid_request_error", code="not_found" if exc.status_code == 404 else None).response()



@serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIServer:
    _eos_token_ids: tuple[int, ...] = ()   # the model's own EOS ids besides the tokenizer's; learned from the engine

    def __init__(self, engine_names: str | list[str], namespace: str, model_name: str, tokenizer_dir: str | None,
                 max_model_len: int, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, router: str = "prefix",
                 router_seed: int = 0):
        """``engine_names``: the engine replicas' actor names (one name: one replica); ``router``: how a
        request picks one (``cluster/routing/policies.py``)."""
        self.engine_names = [engine_names] if isinstance(engine_names, str) else list(engine_names)
        self.namespace = namespace
        self.model_name, self.max_model_len = model_name, max_model_len
        self.max_body_bytes = max_body_bytes
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.created = int(time.time())
        self.router_name = router
        self.replicas = ReplicaSet(self.engine_names, namespace, make_router(router, router_seed))
        self._info: ModelInfo | None = None
        self._vocab_size = self.tokenizer.vocab_size

    # -- engine replicas --------------------------------------------------------------------------
    async def _connect(self) -> None:
        """Follow the replicas (once) and learn the model's vocabulary and EOS ids from one of them."""
        self.replicas.follow()
        if self._info is not None:
            return
        last = None
        for replica in self.replicas.replicas:
            try:
                info = await self.replicas.info(replica)
                break
            except (ValueError, RayActorError, asyncio.TimeoutError) as exc:
                last = exc
                self.replicas.down(replica)
        else:
            names = ", ".join(repr(n) for n in self.engine_names)
            raise APIError(503, f"engine {names} is not available ({type(last).__name__}); "
                           "the request can be retried", "engine_restarted", code="engine_restarted") from None
        self._vocab_size = (info or {}).get("vocab_size", self._vocab_size)
        self._eos_token_ids = tuple((info or {}).get("eos_token_ids", ()))
        self._info = info

    async def _start(self, label: str, prompt: PromptHashes, params: SamplingParams, affinity=None):
        """Route, submit, and await the first item, so a refused request is an HTTP error, not a broken
        stream. A replica that is gone, or refuses (no workers, shutting down), or fails the request for
        its own reasons before a first token: the request goes to another replica, each tried once
        (nothing was streamed, so nothing is answered twice); the last error if none takes it."""
        tried: set[str] = set()
        last: APIError = engine_restarted()
        while True:
            candidates = self.replicas.candidates(prompt, affinity, tried)
            if not candidates:
                raise last
            replica, expected = candidates[0]
            if tried:
                self.replicas.retries += 1
            tried.add(replica.name)
            try:
                engine = self.replicas.handle(replica)
            except ValueError:   # no actor of that name (yet)
                self.replicas.down(replica)
                continue
            stream = engine.generate.options(num_returns="streaming").remote(
                label, prompt.token_ids, params, prompt.for_engine())
            self.replicas.acquire(replica, prompt)
            try:
                item = await (await stream.__anext__())
            except RayActorError:
                self.replicas.release(replica, prompt)
                self.replicas.down(replica)
                continue
            except asyncio.CancelledError:  # the client left before the first token
                self.replicas.release(replica, prompt)
                cancel(engine, stream, None)
                raise
            except Exception as exc:  # noqa: BLE001 - the engine's own refusal
                self.replicas.release(replica, prompt)
                error = error_from_engine(exc)
                if error.type in RETRY_ELSEWHERE:
                    last = error
                    continue
                raise error from None
            self.replicas.first_token(replica, prompt)
            if item["finish_reason"] == "error" and item.get("error_type") in RETRY_ELSEWHERE \
                    and not item["token_ids"]:
                self.replicas.release(replica)
                last = error_from_item(item)
                continue
            self.replicas.check_hit(expected, item.get("num_cached_tokens", 0))
            return replica, engine, stream, item

    async def _items(self, label: str, prompt: PromptHashes, params: SamplingParams,
                     choice: ResponseChoice | None = None):
        """The engine's items for one request; if the consumer stops early, the engine stops too. An item
        that ends the request with an error is raised as the ``APIError`` it maps to."""
        affinity = choice.first.replica if choice is not None and choice.first is not None else None
        replica, engine, stream, item = await self._start(label, prompt, params, affinity)
        if choice is not None:
            choice.replica = replica
        request_id = item["request_id"]   # the engine's own, unique id
        try:
            while True:
                if item["finish_reason"] == "error":
                    raise error_from_item(item)
                yield item
                if item["finished"]:
                    break
                item = await (await stream.__anext__())
        except RayActorError:
            self.replicas.down(replica)
            raise engine_restarted() from None
        except Exception as exc:  # noqa: BLE001
            raise error_from_engine(exc) from None
        finally:
            self.replicas.release(replica)
            if not item["finished"]:
                cancel(engine, stream, request_id)

    # -- shared request handling -----------------------------------------------------------------
    def _params(self, body: Body, max_tokens: int | None) -> SamplingParams:
        """The engine's sampling parameters (stop strings and ``n`` stay here), checked here, at the edge."""
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           "invalid_request_error", param="model", code="model_not_found")
        stop = list(body.stop_token_ids)
        if not body.ignore_eos:   # the tokenizer's EOS and the model's (generation_config), as transformers
            stop += [t for t in (self.tokenizer.eos_token_id, *self._eos_token_ids) if t is not None]
        # Every sampling knob the body has a field of the same name for, then the ones it spells its own way.
        knobs = {f.name: getattr(body, f.name) for f in dataclasses.fields(SamplingSpec) if f.name in type(body).model_fields}
        knobs.update(top_k=max(body.top_k, 0),
                     logit_bias={int(t): b for t, b in (body.logit_bias or {}).items() if t.isdigit()},
                     logprobs=((body.top_logprobs or 0) if body.logprobs else None) if isinstance(body, ChatBody)
                     else body.logprobs)
        try:
            return SamplingParams(**knobs, max_tokens=max_tokens, stop_token_ids=tuple(dict.fromkeys(stop)))
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def _check_ids(self, ids, field: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):   # C speed: a prompt may be long
            bad = [t for t in ids if not 0 <= t < self._vocab_size]
            raise APIError(400, f"{field}: token ids must lie in [0, {self._vocab_size}), got {bad[:8]}",
                           param=field.split("[")[0])

    def _check_length(self, num_tokens: int, field: str = "prompt", at_least: bool = False) -> None:
        if num_tokens >= self.max_model_len:
            raise APIError(400, f"{field}: the prompt has {'at least ' if at_least else ''}{num_tokens} tokens, "
                           f"which leaves no room to generate within max_model_len={self.max_model_len}",
                           param=field.split("[")[0], code="context_length_exceeded")

    def _check_text_length(self, num_chars: int, field: str = "prompt") -> None:
        """Refuse text that cannot fit before spending any time encoding it."""
        per_token = self.tokenizer.max_chars_per_token
        if per_token:
            self._check_length(-(-num_chars // per_token), field, at_least=True)

    async def _tokenize(self, fn, arg, size: int) -> list[int]:
        """Tokenise off the event loop when the input is large, so other requests and /health go on."""
        return await asyncio.to_thread(fn, arg) if size > PARSE_IN_THREAD_BYTES else fn(arg)

    def _choices(self, request_id: str, body: Body, prompts: list[list[int]], params: SamplingParams,
                 echoes: list[str]) -> list[ResponseChoice]:
        """``n`` choices per prompt, indexed prompt-major; sibling ``j`` of a seeded request uses seed + j."""
        n, stops = body.n, stop_strings(body)
        choices = []
        for p in range(len(prompts)):
            for j in range(n):
                index = p * n + j
                own = params if params.seed is None else dataclasses.replace(params, seed=(params.seed + j) % 2**64)
                engine_id = request_id if len(prompts) * n == 1 else f"{request_id}-{index}"
                choices.append(ResponseChoice(index, p, engine_id, own, StreamDecoder(self.tokenizer, stops), echoes[p]))
                if j:
                    choices[-1].first = choices[-1 - j]
        return choices

    async def _open(self, choice: ResponseChoice, prompt: PromptHashes):
        """The choice's engine stream and its first item (errors before it are plain HTTP errors)."""
        items = self._items(choice.engine_id, prompt, choice.params, choice)
        try:
            return items, await anext(items)
        except BaseException:
            await items.aclose()
            raise

    async def _pump(self, choice: ResponseChoice, opened, prompt: PromptHashes, queue: asyncio.Queue) -> None:
        """Feed a choice from its engine stream (opening it first if needed), reporting each step."""
        items = None
        try:
            items, item = opened if opened is not None else await self._open(choice, prompt)
            while True:
                delta, added = choice.feed(item)   # the event as of now: the consumer may lag behind
                queue.put_nowait((choice, delta, item, choice.finish_reason, added))
                if choice.done:
                    return
                item = await anext(items)
        except Exception as exc:  # noqa: BLE001 - the consumer raises it
            queue.put_nowait((choice, exc, None, None, []))
        finally:
            if items is not None:
                await items.aclose()   # stopped early (a stop string): the engine request is aborted

    async def _run(self, choices: list[ResponseChoice], prompts: list[PromptHashes]):
        """Each prompt's first choice is opened before anything is returned, so a refused request is an HTTP
        error; its siblings start once it has its first token: its prompt's blocks are cached by then, and
        they reuse them. Yields (choice, text delta, engine item, finish reason, new logprob entries)."""
        firsts = [c for c in choices if c.index % (len(choices) // len(prompts)) == 0]
        opened = await asyncio.gather(*(self._open(c, prompts[c.prompt]) for c in firsts), return_exceptions=True)
        failed = next((o for o in opened if isinstance(o, BaseException)), None)
        if failed is not None:
            await asyncio.gather(*(o[0].aclose() for o in opened if not isinstance(o, BaseException)))
            raise error_from_engine(failed)
        return self._events(choices, prompts, dict(zip((c.index for c in firsts), opened)))

    async def _events(self, choices: list[ResponseChoice], prompts: list[PromptHashes], opened: dict):
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(c, opened.get(c.index), prompts[c.prompt], queue)) for c in choices]
        try:
            remaining = len(choices)
            while remaining:
                event = await queue.get()
                if isinstance(event[1], BaseException):
                    raise error_from_engine(event[1])
                remaining -= event[3] is not None
                yield event
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _logprobs(self, kind: str, entries: list) -> dict | None:
        """OpenAI's logprobs object for (token, text offset, engine entry) entries."""
        def token(t):
            raw = self.tokenizer.token_bytes(t)
            return raw.decode("utf-8", errors="replace"), list(raw)

        if kind == "chat":
            content = []
            for t, _, (lp, top_ids, top_lps) in entries:
                text, raw = token(t)
                content.append({"token": text, "logprob": max(lp, LOGPROB_FLOOR), "bytes": raw, "top_logprobs": [
                    {"token": token(i)[0], "logprob": max(v, LOGPROB_FLOOR), "bytes": token(i)[1]}
                    for i, v in zip(top_ids, top_lps)]})
            return {"content": content, "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, offset, (lp, top_ids, top_lps) in entries:
            top = {}
            for i, v in zip(top_ids, top_lps):   # most likely first; a text two tokens share keeps the likelier
                top.setdefault(token(i)[0], max(v, LOGPROB_FLOOR))
            top.setdefault(token(t)[0], max(lp, LOGPROB_FLOOR))   # the sampled token is always listed
            out["tokens"].append(token(t)[0])
            out["token_logprobs"].append(max(lp, LOGPROB_FLOOR))
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
        return out

    async def _respond(self, kind: str, body: Body, prompts: list[list[int]], params: SamplingParams, request: Request,
                       echoes: list[str] | None = None):
        refuse_unsupported(body)
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(400, f"n: {len(prompts)} prompts x n={body.n} choices exceed {MAX_CHOICES}", param="n")
        request_id = response_id(request, kind)
        await self._connect()  # learn the model's vocabulary before checking ids against it
        for p, ids in enumerate(prompts):
            field = "prompt" if len(prompts) == 1 else f"prompt[{p}]"
            self._check_length(len(ids), field)
            self._check_ids(ids, field)
        self._check_ids(list(params.stop_token_ids), "stop_token_ids")
        self._check_ids([t for t, _ in params.logit_bias], "logit_bias")
        choices = self._choices(request_id, body, prompts, params, echoes or [""] * len(prompts))
        events = await self._run(choices, [PromptHashes(ids) for ids in prompts])
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        wants_logprobs = params.logprobs is not None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventStream(self._sse_stream(kind, head, choices, prompts, events, wants_logprobs, include_usage))
        async for _ in events:
            pass
        out = []
        for c in choices:
            logprobs = self._logprobs(kind, c.logprobs) if wants_logprobs else None
            if kind == "chat":
                choice = {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs}
            else:
                choice = {"index": c.index, "text": c.text, "logprobs": logprobs}
            out.append({**choice, "token_ids": c.token_ids, "finish_reason": c.finish_reason})
        head["object"] = "chat.completion" if kind == "chat" else "text_completion"
        return {**head, "choices": out, "usage": self._total_usage(choices, prompts)}

    @staticmethod
    def _total_usage(choices: list[ResponseChoice], prompts: list[list[int]]) -> dict:
        """A prompt counts once however many choices it has; its cached tokens are its first choice's hit."""
        n = len(choices) // len(prompts)
        return usage(sum(map(len, prompts)), sum(len(c.token_ids) for c in choices),
                      sum(c.num_cached_tokens for c in choices if c.index % n == 0))

    async def _sse_stream(self, kind: str, head: dict, choices: list[ResponseChoice], prompts, events,
                          wants_logprobs: bool, include_usage: bool):
        head = {**head, "object": "chat.completion.chunk" if kind == "chat" else "text_completion"}
        if kind == "chat":
            for c in choices:
                yield sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
        echoed = set()
        try:
            async for c, delta, item, finish_reason, added in events:
                logprobs = self._logprobs(kind, added) if wants_logprobs else None
                if kind == "chat":
                    choice = {"index": c.index, "delta": {"content": delta}, "logprobs": logprobs}
                else:
                    if c.echo and c.index not in echoed:
                        delta = c.echo + delta
                        echoed.add(c.index)
                    choice = {"index": c.index, "text": delta, "logprobs": logprobs}
                choice.update(token_ids=item["token_ids"], finish_reason=finish_reason)
                yield sse({**head, "choices": [choice]})
            if include_usage:
                yield sse({**head, "choices": [], "usage": self._total_usage(choices, prompts)})
        except Exception as exc:  # noqa: BLE001 - after the headers went out, errors travel in the stream
            yield sse(error_from_engine(exc).body())
        finally:
            await events.aclose()  # a client that went away stops the engine streams now, not at GC
        yield sse("[DONE]")

    # -- routes ---------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request):
        body = await parse_body(request, CompletionBody, self.max_body_bytes)
        await self._connect()   # the model's vocabulary and EOS ids, before checking against them
        params = self._params(body, body.max_tokens)
        prompt = body.prompt
        batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        if len(batch) > MAX_PROMPTS:
            raise APIError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(batch)}", param="prompt")
        texts = [(i, p) for i, p in enumerate(batch) if isinstance(p, str)]
        for i, p in texts:
            self._check_text_length(len(p), "prompt" if len(batch) == 1 else f"prompt[{i}]")
        size = sum(len(p) for _, p in texts)
        encoded = await self._tokenize(lambda ps: [self.tokenizer.encode(p) for _, p in ps], texts, size)
        prompts = [list(p) for p in batch]
        for (i, _), ids in zip(texts, encoded):
            prompts[i] = ids
        echoes = [(p if isinstance(p, str) else self.tokenizer.decode(ids)) if body.echo else ""
                  for p, ids in zip(batch, prompts)]
        return await self._respond("completion", body, prompts, params, request, echoes)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        body = await parse_body(request, ChatBody, self.max_body_bytes)
        await self._connect()
        params = self._params(body, body.max_completion_tokens or body.max_tokens)
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        size = sum(len(m["content"]) for m in messages)
        self._check_text_length(size)
        prompt = await self._tokenize(self.tokenizer.chat_prompt, messages, size)
        return await self._respond("chat", body, [prompt], params, request)

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "swakv",
                "max_model_len": self.max_model_len}

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str):
        if model_id != self.model_name:
            raise APIError(404, f"The model {model_id!r} does not exist", "invalid_request_error", param="model",
                           code="model_not_found")
        return self._model_card()

    @app.get("/health")
    async def health(self):
        """Readiness: 200 when at least one replica would serve a completion now (the router sends
        requests only to ready replicas); 503 (with why) when none would. ``replicas`` lists each one's
        state: ready, starting, restarting, no_workers, stopping, or engine_restarted (does not answer);
        ``routable``: how many the router has caught up with (their KV events) and sends requests to."""
        self.replicas.follow()
        states = await asyncio.gather(*(self._replica_health(r) for r in self.replicas.replicas))
        report = {r.name: state for r, state in zip(self.replicas.replicas, states)}
        ready = [name for name, st in report.items() if st["status"] == "ready"]
        routable = sum(r.ready for r in self.replicas.replicas)   # those the router follows and sends to
        if ready:
            return {"status": "ok", "ready": len(ready), "routable": routable, "replicas": report}
        codes = {st["status"] for st in report.values()}
        if len(report) == 1:
            state = next(iter(report.values()))
            error = (APIError(503, f"the engine does not answer ({state['detail']})", "engine_restarted",
                              code="engine_restarted") if state["status"] == "engine_restarted" else
                     APIError(503, f"the engine is {state['status']}: {state['detail']}", "engine_unavailable",
                              code=state["status"]))
        else:
            code = codes.pop() if len(codes) == 1 else "no_replica_ready"
            error = APIError(503, "no engine replica is ready: " + "; ".join(
                f"{name} is {st['status']}" for name, st in report.items()), "engine_unavailable", code=code)
        return JSONResponse({**error.body(), "replicas": report}, status_code=503)

    async def _replica_health(self, replica) -> dict:
        """One replica's state; a handle cached from a dead engine gets one fresh look-up."""
        for attempt in (0, 1):
            try:
                return await asyncio.wait_for(self.replicas.handle(replica).health.remote(), HEALTH_TIMEOUT_S)
            except (ValueError, RayActorError, asyncio.TimeoutError) as exc:
                self.replicas.down(replica)
                if attempt or isinstance(exc, (ValueError, asyncio.TimeoutError)):
                    return {"status": "engine_restarted", "detail": type(exc).__name__}
        raise AssertionError("unreachable")

    @app.get("/health/live")
    async def live(self):
        """Liveness: this replica answers, whatever the engine's state (restart the replica if not)."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(self):
        """Every engine series labelled with its replica (a replica that does not answer has none but
        ``swakv_replica_up 0``), and the router's own counters."""
        self.replicas.follow()
        replicas = self.replicas.replicas

        async def stats(r):
            try:
                return await asyncio.wait_for(self.replicas.handle(r).stats.remote(), ENGINE_CALL_TIMEOUT_S)
            except (ValueError, RayActorError, asyncio.TimeoutError):
                self.replicas.down(r)
                return None

        per_replica = await asyncio.gather(*(stats(r) for r in replicas))
        return PlainTextResponse(prometheus_text({r.rank: st for r, st in zip(replicas, per_replica)},
                                                 self.replicas), media_type="text/plain; version=0.0.4")


def build_app(engine_names: str | list[str], namespace: str, model_name: str, tokenizer_dir: str | None = None,
              max_model_len: int = 4096, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, router: str = "prefix",
              ray_actor_options: dict | None = None):
    """A bound Serve application for ``serve.run``; the engine actors are found by name when needed.
    ``ray_actor_options``: where its replica runs, when not anywhere (the load test pins it to the head)."""
    make_router(router)   # an unknown router name fails here, before anything is deployed
    deployment = OpenAIServer.options(ray_actor_options=ray_actor_options) if ray_actor_options else OpenAIServer
    return deployment.bind(engine_names, namespace, model_name, tokenizer_dir, max_model_len, max_body_bytes, router)


def run(app, host: str = "127.0.0.1", port: int = 8000, name: str = "swakv", proxy_location: str | None = None):
    """Serve ``app`` over HTTP on ``host:port`` (Ray must be initialised); returns the deployment handle.
    ``proxy_location``: Serve's (EveryNode by default; the load test keeps the proxy on its head node)."""
    serve.start(http_options={"host": host, "port": port},
                **({"proxy_location": proxy_location} if proxy_location else {}))
    return serve.run(app, name=name, route_prefix="/")
