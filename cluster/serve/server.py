"""The OpenAI-compatible server in front of the named engine actors: its routes (``make_app``), served by
``edge.py``'s uvicorn actor (``swakv serve``'s default) or as a Ray Serve deployment (``ray_serve.py``).

A server holds no model: it tokenises, validates, and relays the engines' updates, so several servers
can share one engine. Each holds one subscription per engine (``feed.py``): one Ray message per
engine step carries every one of its requests' new tokens; they are detokenised here, per request, and a
stream that falls behind gets every token queued for it in one event. Everything a client can get wrong is answered with a 4xx and an
OpenAI-shaped error body (``{"error": {"message", "type", "param", "code"}}``) before the engine sees
the request; so is every option this server does not implement and that would change the output: a
client never gets a silent 200 for an option it asked for and did not get (README lists them). An engine
that dies mid-request turns into a 503 (an SSE error event once a stream has started) that says the
request can be retried, and the next request looks the engine up again; a request the engine fails on
its own (the model's logits for it were NaN) gets a 500. A client that goes away aborts its engine
requests.

One request cannot stall the others: bodies over ``max_body_bytes`` get a 413 before they are read
whole; large bodies are parsed and their prompts tokenised in a thread, off the event loop; a text
prompt that cannot fit the context is refused from its length before it is encoded, when the tokenizer
bounds characters per token. ``X-Request-Id`` is the client's label for its request, echoed back (by
Serve's proxy, or ``edge.ClientWatch``) and in the response ``id``; the engine names each request itself, uniquely.

Sampling is greedy unless ``temperature`` is set; ``max_tokens`` defaults to the rest of the context.
Stop strings are matched here, on the detokenised text (the engine request is aborted at the match);
``n`` siblings of a prompt are submitted once the first one's prompt is computed, so they reuse its
KV blocks through the prefix cache instead of computing the prompt ``n`` times.
"""

import asyncio
import dataclasses
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from ray.exceptions import RayActorError
from starlette.exceptions import HTTPException as StarletteHTTPException

from workers.protocol import SamplingSpec

from cluster.engine.tokenizer import StreamDecoder, load_tokenizer
from cluster.engine.types import ModelInfo, SamplingParams
from cluster.routing.policies import make_router
from cluster.routing.prompt import PromptHashes
from cluster.routing.replicas import ReplicaSet

from .feed import EngineFeeds, SubscriptionLost, next_item
from .logprobs import LogprobFormatter
from .metrics import prometheus_text
from .openai import (DEFAULT_MAX_BODY_BYTES, MAX_CHOICES, MAX_PROMPTS, PARSE_IN_THREAD_BYTES,
                     APIError, Body, ChatBody, CompletionBody, DetokenizeBody, TokenizeChatBody, engine_restarted,
                     error_from_engine, error_from_item, parse_body, parse_tokenize_body, refuse_unsupported,
                     response_id, stop_strings)
from .streaming import EventStream, ResponseChoice, merged_event, sse, usage

ENGINE_CALL_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 5.0


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
        self.formatter = LogprobFormatter(self.tokenizer)
        self.created = int(time.time())
        self.router_name = router
        self.replicas = ReplicaSet(self.engine_names, namespace, make_router(router, router_seed))
        self._info: ModelInfo | None = None
        self._vocab_size = self.tokenizer.vocab_size
        self._feeds = EngineFeeds(self.replicas)            # this frontend's subscription to each engine

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

    async def _items(self, label: str, prompt: PromptHashes, params: SamplingParams,
                     choice: ResponseChoice | None = None):
        """The engine's items for one request (all its queued tokens in one, when the consumer lags); if
        the consumer stops early, the engine stops too. An item that ends the request with an error is
        raised as the ``APIError`` it maps to."""
        affinity = choice.first.replica if choice is not None and choice.first is not None else None
        replica, feed, key, queue, item = await self._feeds.start(label, prompt, params, affinity)
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
                item = await next_item(queue)
        except (RayActorError, SubscriptionLost):
            self._feeds.lost(replica, feed)
            raise engine_restarted() from None
        except Exception as exc:  # noqa: BLE001
            raise error_from_engine(exc) from None
        finally:
            self.replicas.release(replica)
            feed.release(key, None if item["finished"] else request_id)

    # -- shared request handling -----------------------------------------------------------------
    def _check_model(self, body) -> None:
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           "invalid_request_error", param="model", code="model_not_found")

    def _params(self, body: Body, max_tokens: int | None) -> SamplingParams:
        """The engine's sampling parameters (stop strings and ``n`` stay here), checked here, at the edge."""
        self._check_model(body)
        stop = list(body.stop_token_ids)
        if not body.ignore_eos:   # the tokenizer's EOS and the model's (generation_config), as transformers
            stop += [t for t in (self.tokenizer.eos_token_id, *self._eos_token_ids) if t is not None]
        # Every sampling knob the body has a field of the same name for, then the ones it spells its own way.
        knobs = {f.name: getattr(body, f.name) for f in dataclasses.fields(SamplingSpec) if f.name in type(body).model_fields}
        knobs.update(top_k=max(body.top_k, 0),
                     logit_bias={int(t): b for t, b in (body.logit_bias or {}).items() if t.isdigit()},
                     logprobs=((body.top_logprobs or 0) if body.logprobs else None) if isinstance(body, ChatBody)
                     else body.logprobs)
        if getattr(body, "echo", False) and body.logprobs is not None:   # the echoed prompt's logprobs too
            knobs["prompt_logprobs"] = max(body.logprobs, body.prompt_logprobs or 0)
        try:
            return SamplingParams(**knobs, max_tokens=max_tokens, stop_token_ids=tuple(dict.fromkeys(stop)))
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def _check_ids(self, ids, field: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):   # C speed: a prompt may be long
            bad = [t for t in ids if not 0 <= t < self._vocab_size]
            raise APIError(400, f"{field}: token ids must lie in [0, {self._vocab_size}), got {bad[:8]}",
                           param=field.split("[")[0])

    def _check_length(self, num_tokens: int, field: str = "prompt", at_least: bool = False,
                      max_tokens: int | None = None, max_field: str = "max_tokens") -> None:
        """Nothing is cut silently: a prompt that leaves no room (none needed with max_tokens 0), or a prompt
        and ``max_tokens`` beyond the context, is refused with the figures. ``at_least``: ``num_tokens``
        is a lower bound (counted before encoding), which is as good for refusing a prompt alone."""
        limit, some = self.max_model_len, "at least " if at_least else ""
        if num_tokens > limit or (num_tokens == limit and max_tokens != 0):
            raise APIError(400, f"{field}: the prompt has {some}{num_tokens} tokens, which leaves no room to "
                           f"generate within max_model_len={limit}", param=field.split("[")[0],
                           code="context_length_exceeded")
        if max_tokens and num_tokens + max_tokens > limit:
            raise APIError(400, f"{max_field}: this model's maximum context length is {limit} tokens "
                           f"(max_model_len); you requested {num_tokens + max_tokens} tokens ({num_tokens} in {field}, "
                           f"{max_tokens} in {max_field}). {max_field} can be at most "
                           f"{limit - num_tokens} for this prompt, or omitted (the rest of the context)",
                           param=max_field, code="context_length_exceeded")

    def _check_text_length(self, num_chars: int, field: str = "prompt") -> None:
        """Refuse text that cannot fit before spending any time encoding it (with ``max_tokens``, once its
        exact length is known: the refusal gives the figures)."""
        per_token = self.tokenizer.max_chars_per_token
        if per_token:
            self._check_length(-(-num_chars // per_token), field, at_least=True, max_tokens=0)

    async def _tokenize(self, fn, arg, size: int) -> list[int]:
        """Tokenise off the event loop when the input is large, so other requests and /health go on."""
        return await asyncio.to_thread(fn, arg) if size > PARSE_IN_THREAD_BYTES else fn(arg)

    def _choices(self, request_id: str, body: Body, prompts: list[list[int]], params: SamplingParams,
                 echoes: list[str]) -> list[ResponseChoice]:
        """``n`` choices per prompt, indexed prompt-major; sibling ``j`` of a seeded request uses seed + j.
        Only a prompt's first choice scores the prompt (prompt logprobs): its siblings share its scores."""
        n, stops = body.n, stop_strings(body)
        choices = []
        for p in range(len(prompts)):
            for j in range(n):
                index = p * n + j
                own = params if params.seed is None else dataclasses.replace(params, seed=(params.seed + j) % 2**64)
                if j and own.prompt_logprobs is not None:
                    own = dataclasses.replace(own, prompt_logprobs=None)
                engine_id = request_id if len(prompts) * n == 1 else f"{request_id}-{index}"
                choices.append(ResponseChoice(index, p, engine_id, own, StreamDecoder(self.tokenizer, stops), echoes[p]))
                if j:
                    choices[-1].first = choices[-1 - j]
        return choices

    async def _open(self, choice: ResponseChoice, prompt: PromptHashes):
        """The choice's engine stream and its first item (errors before it are plain HTTP errors); a scored
        prompt's items before it only bring scores, which the choice takes here."""
        items = self._items(choice.engine_id, prompt, choice.params, choice)
        try:
            while True:   # a scored prompt's chunks come before its first token: its scores are all here then
                item = await anext(items)
                choice.prompt_logprobs += item.get("prompt_logprobs") or []
                if item["token_ids"] or item["finished"]:
                    return items, item
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
        if len(choices) == 1:   # the common case: no task and queue in between, one wake-up per engine item
            one = self._one_choice(choices[0], opened[choices[0].index])
            try:
                async for event in one:
                    yield event
            finally:
                await one.aclose()
            return
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(c, opened.get(c.index), prompts[c.prompt], queue)) for c in choices]
        try:
            remaining = len(choices)
            held = None
            while remaining:
                event, held = held or await queue.get(), None
                while not queue.empty():          # the writer lags: one event for all a choice's queued tokens
                    following = queue.get_nowait()
                    if following[0] is not event[0] or isinstance(following[1], BaseException) \
                            or isinstance(event[1], BaseException):
                        held = following
                        break
                    event = merged_event(event, following)
                if isinstance(event[1], BaseException):
                    raise error_from_engine(event[1])
                remaining -= event[3] is not None
                yield event
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    async def _one_choice(choice: ResponseChoice, opened):
        """``_events`` of a response with one choice, read straight from its engine stream (which merges
        the items queued behind the next one when this consumer lags)."""
        items, item = opened
        try:
            while True:
                delta, added = choice.feed(item)
                yield choice, delta, item, choice.finish_reason, added
                if choice.done:
                    return
                item = await anext(items)
        except Exception as exc:  # noqa: BLE001 - as the multi-choice path raises it
            raise error_from_engine(exc) from None
        finally:
            await items.aclose()   # stopped early (a stop string, a client gone): the engine request is aborted

    def _logprobs(self, kind: str, body: Body, c: ResponseChoice, entries: list, prompt: list[int] | None) -> dict:
        """OpenAI's logprobs object for a choice's (token, text offset, engine entry) entries; after its
        echoed prompt's when ``prompt`` is given."""
        if kind == "chat":
            return self.formatter.chat(entries)
        if prompt is not None:
            entries = self.formatter.echoed_prompt(prompt, self._scores(c, prompt)) + entries
        return self.formatter.completion(entries, body.logprobs)

    @staticmethod
    def _scores(c: ResponseChoice, prompt: list[int]) -> list:
        """The prompt's scores (positions 1 on), from the choice that computed them: its prompt's first."""
        scored = (c.first or c).prompt_logprobs
        if len(scored) != len(prompt) - 1:   # never expected: the engine fails a request it left unscored
            raise APIError(500, f"the engine scored {len(scored)} of the prompt's {len(prompt) - 1} positions",
                           "server_error")
        return scored

    @staticmethod
    def _stop_reason(c: ResponseChoice, body: Body) -> str | int | None:
        """vLLM's ``stop_reason``: the stop string matched, or the ``stop_token_ids`` entry that ended the
        choice; None when it ended otherwise (EOS, length)."""
        if c.decoder.stopped:
            return c.decoder.matched
        if c.finish_reason == "stop" and c.token_ids and c.token_ids[-1] in body.stop_token_ids:
            return c.token_ids[-1]
        return None

    async def _respond(self, kind: str, body: Body, prompts: list[list[int]], params: SamplingParams, request: Request,
                       echoes: list[str] | None = None, max_field: str = "max_tokens"):
        refuse_unsupported(body)
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(400, f"n: {len(prompts)} prompts x n={body.n} choices exceed {MAX_CHOICES}", param="n")
        request_id = response_id(request, kind)
        await self._connect()  # learn the model's vocabulary before checking ids against it
        for p, ids in enumerate(prompts):
            field = "messages" if kind == "chat" else "prompt" if len(prompts) == 1 else f"prompt[{p}]"
            if not ids:
                raise APIError(400, f"{field}: the prompt is empty", param="prompt")
            self._check_length(len(ids), field, max_tokens=params.max_tokens, max_field=max_field)
            self._check_ids(ids, field)
        self._check_ids(list(params.stop_token_ids), "stop_token_ids")
        self._check_ids([t for t, _ in params.logit_bias], "logit_bias")
        choices = self._choices(request_id, body, prompts, params, echoes or [""] * len(prompts))
        events = await self._run(choices, [PromptHashes(ids) for ids in prompts])
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        if body.stream:
            return EventStream(self._sse_stream(kind, head, body, choices, prompts, events))
        async for _ in events:
            pass
        echo = getattr(body, "echo", False) and params.logprobs is not None
        out, scored = [], None
        for c in choices:
            logprobs = None if params.logprobs is None else \
                self._logprobs(kind, body, c, c.logprobs, prompts[c.prompt] if echo else None)
            if kind == "chat":
                choice = {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs}
            else:
                choice = {"index": c.index, "text": c.text, "logprobs": logprobs}
            if body.prompt_logprobs is not None:
                scored = self.formatter.prompt_logprobs(prompts[c.prompt], self._scores(c, prompts[c.prompt]),
                                                        body.prompt_logprobs)
                if kind != "chat":
                    choice["prompt_logprobs"] = scored
            out.append({**choice, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                        "stop_reason": self._stop_reason(c, body)})
        head["object"] = "chat.completion" if kind == "chat" else "text_completion"
        extra = {"prompt_logprobs": scored} if kind == "chat" and scored is not None else {}
        return {**head, "choices": out, "usage": self._total_usage(choices, prompts), **extra}

    @staticmethod
    def _total_usage(choices: list[ResponseChoice], prompts: list[list[int]]) -> dict:
        """A prompt counts once however many choices it has; its cached tokens are its first choice's hit."""
        n = len(choices) // len(prompts)
        return usage(sum(map(len, prompts)), sum(len(c.token_ids) for c in choices),
                      sum(c.num_cached_tokens for c in choices if c.index % n == 0))

    async def _sse_stream(self, kind: str, head: dict, body: Body, choices: list[ResponseChoice], prompts, events):
        """The events as SSE chunks; ``stream_options``: ``include_usage`` adds a last chunk with the request's
        usage, ``continuous_usage_stats`` (vLLM's) puts in every chunk its choice's usage so far."""
        head = {**head, "object": "chat.completion.chunk" if kind == "chat" else "text_completion"}
        options = body.stream_options
        include_usage, continuous = bool(options and options.include_usage), bool(options and options.continuous_usage_stats)
        echo, wants_logprobs = getattr(body, "echo", False), choices[0].params.logprobs is not None
        produced = [0] * len(choices)   # tokens each choice has streamed

        opening = json.dumps(head)[:-1] + ', "choices": ['   # the same for every chunk: encoded once

        def chunk(choice: dict, extra: dict) -> str:
            """``sse({**head, "choices": [choice], **extra})``, the head not encoded again."""
            rest = "".join(f", {json.dumps(k)}: {json.dumps(v)}" for k, v in extra.items())
            return f"data: {opening}{json.dumps(choice)}]{rest}}}\n\n"

        def so_far(c: ResponseChoice, cached: int = 0) -> dict:
            return {"usage": usage(len(prompts[c.prompt]), produced[c.index], cached)} if continuous else {}

        if kind == "chat":
            for c in choices:
                yield sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}], **so_far(c)})
        echoed = set()
        try:
            async for c, delta, item, finish_reason, added in events:
                produced[c.index] += len(item["token_ids"])
                prompt = None
                if echo and c.index not in echoed:   # the prompt first (and its logprobs), once
                    delta, prompt = c.echo + delta, prompts[c.prompt]
                    echoed.add(c.index)
                logprobs = self._logprobs(kind, body, c, added, prompt) if wants_logprobs else None
                if kind == "chat":
                    choice = {"index": c.index, "delta": {"content": delta}, "logprobs": logprobs}
                else:
                    choice = {"index": c.index, "text": delta, "logprobs": logprobs}
                choice.update(token_ids=item["token_ids"], finish_reason=finish_reason,
                              stop_reason=self._stop_reason(c, body) if finish_reason else None)
                yield chunk(choice, so_far(c, item.get("num_cached_tokens", 0)))
            if include_usage:
                yield sse({**head, "choices": [], "usage": self._total_usage(choices, prompts)})
        except Exception as exc:  # noqa: BLE001 - after the headers went out, errors travel in the stream
            yield sse(error_from_engine(exc).body())
        finally:
            await events.aclose()  # a client that went away stops the engine streams now, not at GC
        yield sse("[DONE]")

    # -- routes ---------------------------------------------------------------------------------
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

    async def chat_completions(self, request: Request):
        body = await parse_body(request, ChatBody, self.max_body_bytes)
        await self._connect()
        params = self._params(body, body.max_completion_tokens or body.max_tokens)
        max_field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        size = sum(len(m["content"]) for m in messages)
        self._check_text_length(size, "messages")
        prompt = await self._tokenize(self.tokenizer.chat_prompt, messages, size)
        return await self._respond("chat", body, [prompt], params, request, max_field=max_field)

    async def tokenize(self, request: Request):
        """vLLM's: a prompt's token ids as the completions route encodes it, or chat messages' as the chat
        route does (its template applied), with ``count`` and ``max_model_len`` to check a fit before sending."""
        body = await parse_tokenize_body(request, self.max_body_bytes)
        self._check_model(body)
        if isinstance(body, TokenizeChatBody):
            messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                        for m in body.messages]
            size = sum(len(m["content"]) for m in messages)
            ids = await self._tokenize(lambda ms: self.tokenizer.chat_prompt(ms, body.add_generation_prompt),
                                       messages, size)
        else:
            ids = await self._tokenize(lambda p: self.tokenizer.encode(p, body.add_special_tokens), body.prompt,
                                       len(body.prompt))
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": self.tokenizer.pieces(ids) if body.return_token_strs else None}

    async def detokenize(self, request: Request):
        """vLLM's: the text of token ids, as a completion's text decodes them (special tokens skipped)."""
        body = await parse_body(request, DetokenizeBody, self.max_body_bytes)
        self._check_model(body)
        bad = [t for t in body.tokens if not 0 <= t < self.tokenizer.vocab_size]   # the tokenizer's: no engine needed
        if bad:
            raise APIError(400, f"tokens: token ids must lie in [0, {self.tokenizer.vocab_size}), got {bad[:8]}",
                           param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "swakv",
                "max_model_len": self.max_model_len}

    async def models(self):
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model_id: str):
        if model_id != self.model_name:
            raise APIError(404, f"The model {model_id!r} does not exist", "invalid_request_error", param="model",
                           code="model_not_found")
        return self._model_card()

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

    async def live(self):
        """Liveness: this replica answers, whatever the engine's state (restart the replica if not)."""
        return {"status": "ok"}

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


ROUTES = [("POST", "/v1/completions", "completions"), ("POST", "/v1/chat/completions", "chat_completions"),
          ("POST", "/tokenize", "tokenize"), ("POST", "/detokenize", "detokenize"),
          ("GET", "/v1/models", "models"), ("GET", "/v1/models/{model_id:path}", "model"),
          ("GET", "/health", "health"), ("GET", "/health/live", "live"), ("GET", "/metrics", "metrics")]


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return APIError(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404
                    else "invalid_request_error", code="not_found" if exc.status_code == 404 else None).response()


def make_app(server: OpenAIServer) -> FastAPI:
    """The FastAPI app whose routes are ``server``'s methods: what both HTTP edges serve (``edge.py``'s
    uvicorn actor, ``ray_serve.py``'s Serve deployment)."""
    app = FastAPI(title="swakv", docs_url=None, redoc_url=None)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for method, path, name in ROUTES:
        app.add_api_route(path, getattr(server, name), methods=[method])
    return app
