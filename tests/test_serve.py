"""The OpenAI app end to end behind ``swakv serve``'s default HTTP edge (uvicorn in a Ray actor): real HTTP,
a real engine actor on a tiny hybrid model. (``test_openai_client`` and ``test_replicas`` run the same app
as a Ray Serve deployment.)

Expected tokens come from transformers' own dense greedy decode of the same tiny model (seed 0), never
from the server. Ray and Serve start once for the whole module; the engine-restart test runs last.
"""
from __future__ import annotations

import asyncio
import functools
import json
import os
import time

import httpx
import pytest
import ray
import torch
from starlette.responses import StreamingResponse

from cluster.ray.engine_actor import NAMESPACE
from cluster.ray.ports import free_port
from cluster.serve.launch import start_edges, stop_edges
from cluster.serve.streaming import EventStream, ResponseChoice
from cluster.engine.tokenizer import StreamDecoder, load_tokenizer
from cluster.engine.types import SamplingParams
from workers.models.tiny_models import build_tiny_model

from conftest import ROOT
from drivers import start_engine_actor, stop_engine_actor

MODEL = "tiny-gemma3"          # sliding, sliding, full, sliding: two KV-cache groups (3 units + 1 of one layer)
ENGINE = "test-serve-engine"
BLOCK, NUM_BLOCKS, MAX_LEN = 4, 512, 1024
BODY_LIMIT = 256 << 10         # the app's max_body_bytes here (the default is 8 MiB)


_handles = []   # a named actor lives only as long as a handle from its creator does


def start_engine():
    """The real start-up path: the named engine actor places a worker actor and loads the model. After a
    ``ray.kill`` it first waits for the name to come free: the kill returns at once, and the name stays
    taken until Ray has recorded the old actor's death."""
    deadline = time.monotonic() + 30
    while True:
        try:
            ray.get_actor(ENGINE, namespace=NAMESPACE)
        except ValueError:
            break
        assert time.monotonic() < deadline, f"{ENGINE} is still registered 30 s after it was killed"
        time.sleep(0.05)
    handle, _ = start_engine_actor(dict(model=MODEL, block_size=BLOCK, num_blocks=NUM_BLOCKS, max_model_len=MAX_LEN),
                                   name=ENGINE, max_restarts=0, timeout_s=120)
    _handles.append(handle)


def engine_stats() -> dict:
    return ray.get(ray.get_actor(ENGINE, namespace=NAMESPACE).stats.remote(), timeout=30)


# -- the dense reference ---------------------------------------------------------------------------
@functools.cache
def _reference_model():
    return build_tiny_model(MODEL, seed=0)


@functools.cache
def greedy(prompt_ids: tuple[int, ...], max_tokens: int) -> list[int]:
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(_reference_model()(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def text_of(token_ids) -> str:
    return bytes(token_ids).decode("utf-8", errors="replace")


def chat_ids(*turns: tuple[str, str]) -> tuple[int, ...]:
    text = "".join(f"<|{role}|>\n{content}\n" for role, content in turns) + "<|assistant|>\n"
    return tuple(text.encode())


# -- fixtures and helpers --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url(ray_runtime):
    edges = []
    try:
        start_engine()
        port = free_port()
        edges += start_edges(([ENGINE], NAMESPACE, MODEL, None, MAX_LEN, BODY_LIMIT, "prefix"), port=port,
                             name="test-serve-http")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_edges(edges)
        for handle in _handles:
            stop_engine_actor(handle)
        _handles.clear()


def sse_events(lines) -> list:
    """The JSON payloads of an SSE body, with the final ``[DONE]`` kept as the string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream(url: str, path: str, body: dict) -> list:
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def wait_for(running: int, timeout_s: float = 30.0) -> dict:
    """The engine's stats once ``running`` requests run and none wait (or the last ones seen, after the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine_stats()
        if (stats["running"], stats["waiting"]) == (running, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def wait_idle() -> dict:
    return wait_for(0)


def assert_still_serving(url: str) -> None:
    """After a hostile request: ready, and a normal request gets its exact tokens."""
    health = httpx.get(url + "/health", timeout=30)
    assert (health.status_code, health.json()["status"]) == (200, "ok")
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == greedy(tuple(PROMPT.encode()), 4)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


PROMPT = "The sliding window"


# -- tokenizers (no Ray) ---------------------------------------------------------------------------
def test_byte_tokenizer_and_stream_decoder_keep_characters_whole():
    tok = load_tokenizer(None)
    assert tok.encode("hé") == [104, 195, 169] and tok.eos_token_id is None
    assert tok.chat_prompt([{"role": "user", "content": "hi"}]) == list(b"<|user|>\nhi\n<|assistant|>\n")
    decoder = StreamDecoder(tok)
    deltas = [decoder.add([104]), decoder.add([195]), decoder.add([169]), decoder.add([226, 130])]
    assert deltas == ["h", "", "\u00e9", ""]
    assert decoder.add([], final=True) == "\ufffd"   # a character that never finished
    assert decoder.sent == tok.decode([104, 195, 169, 226, 130]) == "h\u00e9\ufffd"


def test_a_choice_fed_several_tokens_in_one_item_gives_each_its_own_text_offset():
    # A stream that fell behind gets one item holding several steps' tokens; CI once saw [0, 1, 2, 3, 4, 4].
    tok = load_tokenizer(None)
    choice = ResponseChoice(0, 3, "r#0", SamplingParams(), StreamDecoder(tok), echo="ab")
    entry = (-0.5, [1], [-0.5])

    def item(ids, finished=False):
        return {"token_ids": ids, "finished": finished, "finish_reason": "length" if finished else None,
                "logprobs": [entry] * len(ids), "num_cached_tokens": 0}

    deltas = [choice.feed(item([104]))[0], choice.feed(item([105, 195, 169, 33]))[0],
              choice.feed(item([106, 107], finished=True))[0]]
    assert deltas == ["h", "i\u00e9!", "jk"]
    assert [offset for _, offset, _ in choice.logprobs] == [2, 3, 4, 4, 5, 6, 7]   # "\u00e9" starts at 4, both bytes
    assert choice.text == "abhi\u00e9!jk" and choice.finish_reason == "length"


def test_a_choice_fed_tokens_past_its_stop_string_in_one_item_keeps_those_up_to_the_one_that_completed_it():
    # A stream that fell behind gets one item holding several steps' tokens, and the stop string "ini" ends
    # inside it (CI once saw a completion report 14 tokens where the stop string ended at the 13th). The
    # choice keeps "...mini" (7 tokens), so do the item (its chunk) and the usage; the text stops before "ini".
    tok = load_tokenizer(None)
    for logprobs in (False, True):
        choice = ResponseChoice(0, 0, "r#0", SamplingParams(), StreamDecoder(tok, ["ini"]))

        def item(ids):
            return {"token_ids": ids, "finished": False, "finish_reason": None, "num_cached_tokens": 0,
                    "logprobs": [(-0.5, [1], [-0.5])] * len(ids) if logprobs else None}

        late = item(list(b"cminiXYZ"))
        deltas = [choice.feed(item(list(b"ab")))[0], choice.feed(late)[0]]
        assert deltas == ["ab", "cm"] and choice.text == "abcm"
        assert choice.token_ids == list(b"abcmini") and late["token_ids"] == list(b"cmini")
        assert (choice.finish_reason, choice.decoder.matched) == ("stop", "ini")
        assert len(choice.logprobs) == (7 if logprobs else 0)


def test_model_tokenizer_is_used_when_the_directory_has_one(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"<eos>": 0, "hello": 1, "world": 2, "[UNK]": 3, "user": 4, ":": 5},
                                       unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", unk_token="[UNK]")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    fast.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert (tok.encode("hello world moon"), tok.eos_token_id, tok.vocab_size) == ([1, 2, 3], 0, 6)
    assert tok.max_chars_per_token is None   # a word-level [UNK] stands for any word: no bound
    assert tok.decode([1, 2, 0]) == "hello world"
    assert tok.chat_prompt([{"role": "user", "content": "hello"}]) == [4, 5, 1]
    assert isinstance(load_tokenizer(ROOT / "tests"), type(load_tokenizer(None)))   # no tokenizer files there


def test_the_bundled_tokenizer_bounds_characters_per_token():
    tok = load_tokenizer(ROOT / "models" / "swakv-tiny-hybrid")   # byte-level BPE, no normalizer
    assert tok.max_chars_per_token == len("<|bos|>")             # its longest token is an added one
    for text in ("plain ascii text", "<|eos|><|bos|><|pad|>", "h\u00e9 \u2603 \U0001f600", "a" * 300):
        assert len(tok.encode(text)) >= -(-len(text) // tok.max_chars_per_token)


# -- the application -------------------------------------------------------------------------------
def test_completion_matches_dense_greedy(url):
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    expected = greedy(tuple(PROMPT.encode()), 12)
    choice = out["choices"][0]
    assert out["object"] == "text_completion" and out["model"] == MODEL and out["id"].startswith("cmpl-")
    assert choice["token_ids"] == expected
    assert choice["text"] == text_of(expected)
    assert choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 18, "completion_tokens": 12, "total_tokens": 30,
                            "prompt_tokens_details": {"cached_tokens": 0}}


def test_streaming_completion_with_token_id_prompt(url):
    prompt = [7, 200, 13, 99, 0, 255, 42, 42, 42, 1, 2, 3, 4, 5, 6, 7, 8]
    events = stream(url, "/v1/completions", {"prompt": prompt, "max_tokens": 10, "stream": True,
                                             "stream_options": {"include_usage": True}})
    expected = greedy(tuple(prompt), 10)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected
    assert "".join(c["choices"][0]["text"] for c in chunks) == text_of(expected)
    # a stream that lags gets several tokens in one event (CI once saw 9 events for the 10 tokens): none is empty
    assert all(c["choices"][0]["token_ids"] for c in chunks) and len(chunks) <= 10
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert events[-2]["usage"] == {"prompt_tokens": 17, "completion_tokens": 10, "total_tokens": 27,
                                   "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_streaming_and_not(url):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    expected = greedy(chat_ids(("system", "Be brief."), ("user", "Hi there")), 8)
    r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 8}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": text_of(expected)}
    assert out["choices"][0]["token_ids"] == expected
    assert out["usage"]["prompt_tokens"] == len(chat_ids(("system", "Be brief."), ("user", "Hi there")))

    events = stream(url, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 8,
                                                  "stream": True})
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    chunks = events[1:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == text_of(expected)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_clients_all_get_complete_answers(url):
    prompts = [f"client {i} asks about windows" + "." * i for i in range(8)]
    lengths = [6 + i for i in range(8)]

    async def one(client, i):
        body = {"prompt": prompts[i], "max_tokens": lengths[i], "stream": i % 2 == 1}
        if not body["stream"]:
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        return [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    got = asyncio.run(main())
    assert got == [greedy(tuple(p.encode()), n) for p, n in zip(prompts, lengths)]


BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "hi", ', 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "Input should be an object"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt: Field required"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "16"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n: Input should be less than or equal to 16"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4 stop strings"),
    ("/v1/completions", {"prompt": [["a"], "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "'gpt-4' does not exist"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed: Input should be less than 18446744073709551616"),
    ("/v1/completions", {"prompt": "hi", "seed": -2**63 - 1}, 400, "seed: Input should be greater than or equal"),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature: Input should be less than or equal"),
    ("/v1/completions", {"prompt": [1, 256, 3]}, 400, "token ids must lie in [0, 256), got [256]"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt: the prompt is empty"),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt[1]: the prompt is empty"),
    ("/v1/completions", {"prompt": "x" * MAX_LEN, "stream": True}, 400, f"max_model_len={MAX_LEN}"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "stream": True}, 400, "content"),
]


@pytest.mark.parametrize("path,body,status,needle", BAD_REQUESTS)
def test_bad_requests_get_4xx_json(url, path, body, status, needle):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + path, headers={"content-type": "application/json"}, timeout=60, **kwargs)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}   # OpenAI's shape
    assert needle in error["message"]
    assert error["code"] == ("model_not_found" if status == 404 else
                             "context_length_exceeded" if "max_model_len" in needle else None)
    assert error["type"] == "invalid_request_error"
    if status == 404:
        assert error["param"] == "model"
    if not isinstance(body, bytes):   # a body that is not a JSON object has no field to blame
        assert error["param"] is not None and error["param"] in error["message"]
    assert "cmpl-" not in error["message"] and "#" not in error["message"]   # no internal request id


def test_a_burst_of_requests_reaches_the_engine_in_one_ray_call(url):
    """Six requests added in one turn of the frontend's event loop travel in one ``add_requests`` call, each
    getting its own engine id and its own greedy tokens."""
    from cluster.serve.feed import EngineFeed, next_item
    prompts = [[5 + i, 6, 7, 8] for i in range(6)]

    async def main():
        feed = EngineFeed(ray.get_actor(ENGINE, namespace=NAMESPACE), "burst-test")
        before = (await feed.handle.stats.remote())["add_calls"]
        added = await asyncio.gather(*(feed.add(f"burst{i}", p, {"max_tokens": 3}, None) for i, p in enumerate(prompts)))
        calls = (await feed.handle.stats.remote())["add_calls"] - before
        tokens = []
        for _, key, queue in added:
            out, item = [], {"finished": False}
            while not item["finished"]:
                item = await asyncio.wait_for(next_item(queue), 60)
                out += item["token_ids"]
            tokens.append(out)
            feed.release(key)
        feed.close()
        return calls, [request_id for request_id, _, _ in added], tokens

    calls, ids, tokens = asyncio.run(main())
    assert calls == 1
    assert [i.split("#")[0] for i in ids] == [f"burst{i}" for i in range(6)] and len(set(ids)) == 6
    assert tokens == [greedy(tuple(p), 3) for p in prompts]


def test_the_edge_engine_and_worker_processes_froze_their_start_up_heaps(url):
    """Each serving process moved what it built at start-up out of the cyclic collector's reach, so a full
    collection there walks only what serving allocated (without it one took 45-100 ms mid-burst, measured);
    cyclic garbage made afterwards is still collected."""
    def frozen(actor):
        return ray.get(actor.__ray_call__.remote(lambda self: __import__("gc").get_freeze_count()), timeout=30)

    def cycle_collected(actor):
        def probe(self):
            import gc
            import weakref

            class Node:
                pass
            a, b = Node(), Node()
            a.other, b.other = b, a
            alive = weakref.ref(a)
            del a, b
            gc.collect()
            return alive() is None
        return ray.get(actor.__ray_call__.remote(probe), timeout=30)

    engine = ray.get_actor(ENGINE, namespace=NAMESPACE)
    edge = ray.get_actor("test-serve-http-0", namespace=NAMESPACE)
    workers = ray.get(engine.__ray_call__.remote(lambda self: self.core.engine.executor.actors), timeout=30)
    assert len(workers) == 1
    for actor in (edge, engine, *workers):
        assert frozen(actor) > 10_000      # Ray's modules alone are well over that many objects
        assert cycle_collected(actor)


def test_the_edge_on_the_engines_host_adds_and_reads_through_shared_memory_rings(url):
    """The test's edge runs on the engine's host: its subscription got the rings (``record_ring``), not Ray
    stream items, and no add waits for a result after its request finished."""
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy(tuple(PROMPT.encode()), 3)
    edge = ray.get_actor("test-serve-http-0", namespace=NAMESPACE)
    feeds = ray.get(edge.__ray_call__.remote(lambda self: [
        (type(f._records).__name__, type(f._adds).__name__, len(f._ring_adds)) for f in self.server._feeds._feeds.values()]),
        timeout=30)
    assert feeds == [("LoopReader", "AddWriter", 0)]


def test_a_frontend_that_lags_gets_the_steps_it_missed_merged_into_one_record(url):
    """The subscription keeps at most ``SLOTS`` records unread (a frontend on the engine's host reads them from
    a shared-memory ring of that many slots; Ray's generator backpressure keeps one elsewhere): while the
    frontend's event loop is busy, the engine goes on stepping and merges what it owes, so a lagging frontend
    gets one record for many steps (one SSE event for many tokens) instead of a growing queue of one per step."""
    from cluster.ray.record_ring import SLOTS
    from cluster.serve.feed import EngineFeed, next_item
    prompt = [9, 8, 7, 6]

    async def main():
        handle = ray.get_actor(ENGINE, namespace=NAMESPACE)
        feed = EngineFeed(handle, "lag-test")
        _, key, queue = await feed.add("lag", prompt, {"max_tokens": 24}, None)
        before = ray.get(handle.stats.remote(), timeout=30)
        deadline = time.monotonic() + 60
        while ray.get(handle.stats.remote(), timeout=30)["running"] and time.monotonic() < deadline:
            time.sleep(0.05)   # blocks this loop: the feed reads nothing until the request has finished
        after = ray.get(handle.stats.remote(), timeout=30)
        tokens, item = [], {"finished": False}
        while not item["finished"]:
            item = await asyncio.wait_for(next_item(queue), 60)
            tokens += item["token_ids"]
        feed.release(key)
        feed.close()
        return before, after, tokens

    before, after, tokens = asyncio.run(main())
    assert tokens == greedy(tuple(prompt), 24)
    assert after["steps"] - before["steps"] >= 20               # the engine stepped on while nothing was read
    assert after["stream_records"] - before["stream_records"] <= SLOTS + 1   # a full ring, then the rest in one


@ray.remote
class StalledFrontend:
    """A frontend whose event loop stops reading its subscription after adding one long request."""

    async def add(self, max_tokens: int) -> None:
        from cluster.serve.feed import EngineFeed
        self.feed = EngineFeed(ray.get_actor(ENGINE, namespace=NAMESPACE), "stalled-frontend")
        await self.feed.add("stalled", [3, 4, 5, 6], {"max_tokens": max_tokens}, None)

    async def stall(self) -> None:
        time.sleep(600)   # blocks the loop: the engine's stream waits on the record it cannot hand over


def test_a_frontend_that_dies_while_the_engine_waits_on_its_unread_record_has_its_requests_aborted(url):
    """Backpressure must not pin a dead frontend's stream: the engine learns of the death, ends the stream and
    aborts the request long before its 1,000 tokens."""
    before = wait_idle()["finished"].get("length", 0)
    frontend = StalledFrontend.remote()
    ray.get(frontend.add.remote(1000), timeout=60)
    frontend.stall.remote()
    # 1,000 tokens take ~3 s here with overlapped steps: the stall, its check and the kill take ~1 s of them
    time.sleep(0.5)          # the stall has begun: what the feed had read before it is counted already
    records = engine_stats()["stream_records"]
    time.sleep(0.5)
    stalled = engine_stats()
    assert stalled["running"] == 1 and stalled["stream_records"] - records <= 1   # it waits, stepping on
    ray.kill(frontend)
    stats = wait_idle()
    assert (stats["running"], stats["waiting"]) == (0, 0)
    assert stats["finished"].get("length", 0) == before     # aborted, not run to its end
    assert_still_serving(url)


def test_unknown_route_and_nothing_left_behind(url):
    r = httpx.get(url + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(url + "/v1/completions", timeout=30)
    assert r.status_code == 405 and r.json()["error"] == {"message": "Method Not Allowed", "type": "invalid_request_error",
                                                          "param": None, "code": None}
    stats = wait_idle()
    assert (stats["running"], stats["waiting"]) == (0, 0)


def test_client_request_id_names_the_request(url):
    body = {"prompt": PROMPT, "max_tokens": 3}
    r = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "run-7.session-2:turn-1"}, timeout=60)
    assert r.status_code == 200 and r.json()["id"] == "cmpl-run-7.session-2:turn-1"
    assert r.json()["choices"][0]["token_ids"] == greedy(tuple(PROMPT.encode()), 3)
    bad = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "has space"}, timeout=60)
    assert bad.status_code == 400 and "X-Request-Id must be" in bad.json()["error"]["message"]


def test_models_health_metrics(url):
    models = httpx.get(url + "/v1/models", timeout=30).json()
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(MODEL, MAX_LEN)]
    health = httpx.get(url + "/health", timeout=30)
    assert (health.status_code, health.json()) == (200, {"status": "ok", "ready": 1, "routable": 1, "replicas": {
        ENGINE: {"status": "ready", "detail": ""}}})

    wait_idle()
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in r.text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    stats = engine_stats()   # no traffic in between: the same numbers the endpoint rendered
    one = '{replica="0"}'    # a deployment of one replica: every engine series is replica 0's
    assert samples["swakv_replica_up" + one] == 1.0
    assert samples["swakv_requests_running" + one] == 0.0 and samples["swakv_requests_waiting" + one] == 0.0
    assert samples["swakv_kv_cache_usage_ratio" + one] == stats["kv_usage"]
    assert samples["swakv_prefix_cache_hit_rate" + one] == stats["prefix_hit_rate"]
    assert samples["swakv_preemptions_total" + one] == stats["preemptions"]
    assert samples["swakv_steps_total" + one] == stats["steps"] > 0
    assert samples["swakv_step_time_seconds_mean" + one] == stats["mean_step_time_s"] > 0
    assert samples["swakv_delta_bytes_total" + one] == stats["delta_bytes"]
    assert samples["swakv_worker_restarts_total" + one] == 0.0
    # 3 sliding layers + 1 full: one group per kind, sliding first (its blocks 3 units of one layer wide)
    assert [k for k in samples if k.startswith("swakv_kv_cache_group_usage_ratio")] == [
        f'swakv_kv_cache_group_usage_ratio{{replica="0",group="{g}"}}' for g in range(2)]
    assert samples['swakv_requests_finished_total{replica="0",reason="length"}'] == stats["finished"]["length"]
    # the router's view: one replica, so nothing to choose; its index follows the engine's KV events
    assert samples['swakv_router_requests_total{replica="0",reason="only"}'] >= 1
    assert samples["swakv_router_retries_total"] == 0.0
    assert samples['swakv_router_kv_snapshots_total{replica="0"}'] >= 1


# -- hostile requests: each gets its error, and the server goes on ------------------------------------
def test_a_seed_beyond_int64_is_refused_at_the_edge(url):
    # it used to reach the step encoder (msgpack: OverflowError) and stop the engine for everyone; the
    # edge takes int64 and uint64 seeds, which the engine carries reduced to uint64
    error = error_of(httpx.post(url + "/v1/completions", json={"prompt": "hi", "temperature": 0.7, "seed": 10**29},
                                timeout=60), 400)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "seed", None)
    assert "seed: Input should be less than 18446744073709551616" in error["message"]
    assert_still_serving(url)


def test_a_tiny_temperature_samples_greedily(url):
    # 1e-39 used to turn logits / temperature into inf, probabilities into NaN, and stop the engine
    for temperature in (1e-39, 1e-6):
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": temperature,
                                                      "seed": 1}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == greedy(tuple(PROMPT.encode()), 6)
    assert_still_serving(url)


def test_a_body_over_the_limit_gets_413_declared_or_streamed(url):
    big = b'{"prompt": "' + b"a" * BODY_LIMIT + b'", "max_tokens": 4}'
    headers = {"content-type": "application/json"}
    error = error_of(httpx.post(url + "/v1/completions", content=big, headers=headers, timeout=60), 413)
    assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
    assert f"request body exceeds {BODY_LIMIT} bytes" in error["message"]
    chunks = (big[i:i + 16384] for i in range(0, len(big), 16384))   # no Content-Length: chunked transfer
    error = error_of(httpx.post(url + "/v1/chat/completions", content=chunks, headers=headers, timeout=60), 413)
    assert error["code"] == "request_too_large"
    assert_still_serving(url)


def test_over_long_prompts_are_refused_before_the_engine(url):
    # text: refused from its length in characters (a byte per token at least), before it is encoded
    cases = [("/v1/completions", {"prompt": "x" * (BODY_LIMIT // 2)}, f"at least {BODY_LIMIT // 2}"),
             ("/v1/completions", {"prompt": [65] * MAX_LEN}, f"{MAX_LEN}"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 5000}]}, "at least 5000")]
    for path, body, tokens in cases:
        error = error_of(httpx.post(url + path, json=body, timeout=60), 400)
        field = "messages" if "chat" in path else "prompt"
        assert (error["param"], error["code"]) == (field, "context_length_exceeded")
        assert error["message"] == (f"{field}: the prompt has {tokens} tokens, which leaves no room to generate "
                                    f"within max_model_len={MAX_LEN}")
    assert engine_stats()["finished"].get("error", 0) == 0   # none reached the engine
    assert_still_serving(url)


def test_requests_sharing_an_x_request_id_are_distinct_requests(url):
    """The client's id is a label, echoed back; the engine names each request itself, so two requests with
    one label run side by side, and a retry is not touched by the attempt it replaces."""
    prompts = [PROMPT, "another prompt"]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            same = {"X-Request-Id": "shared-7"}
            both = await asyncio.gather(*(client.post("/v1/completions", headers=same,
                                                      json={"prompt": p, "max_tokens": 6}) for p in prompts))
            async with client.stream("POST", "/v1/completions", headers={"X-Request-Id": "retry-1"},
                                     json={"prompt": PROMPT, "max_tokens": 1000, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break      # attempt 1 goes away after its first event: its stream is cancelled, aborted
            retry = await client.post("/v1/completions", headers={"X-Request-Id": "retry-1"},
                                      json={"prompt": PROMPT, "max_tokens": 8})
            return both, retry

    both, retry = asyncio.run(main())
    for r, p in zip(both, prompts):
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "shared-7" and r.json()["id"] == "cmpl-shared-7"
        assert r.json()["choices"][0]["token_ids"] == greedy(tuple(p.encode()), 6)
    assert retry.status_code == 200 and retry.headers["x-request-id"] == "retry-1"
    assert retry.json()["choices"][0]["token_ids"] == greedy(tuple(PROMPT.encode()), 8)
    assert retry.json()["choices"][0]["finish_reason"] == "length"
    stats = wait_idle()
    assert (stats["running"], stats["waiting"]) == (0, 0)


POISON = 0x7f   # DEL: its embedding is NaN in the poisoned copy of the model


def test_a_request_the_engine_fails_alone_gets_a_500_and_the_others_are_served(url, tmp_path):
    """A second engine over a copy of the model whose embedding of one byte is NaN, behind its own route."""
    clean = greedy(tuple(PROMPT.encode()), 8)
    assert POISON not in clean and POISON not in PROMPT.encode()
    model = build_tiny_model(MODEL, seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight[POISON] = float("nan")
    model.save_pretrained(tmp_path)
    handle, _ = start_engine_actor(dict(model=str(tmp_path), block_size=BLOCK, num_blocks=NUM_BLOCKS,
                                        max_model_len=MAX_LEN), name="test-serve-poisoned", max_restarts=0,
                                   timeout_s=120)
    edges = []
    try:
        port = free_port()
        edges += start_edges((["test-serve-poisoned"], NAMESPACE, MODEL, None, MAX_LEN, BODY_LIMIT, "prefix"),
                             port=port, name="test-serve-poisoned-http")
        base = f"http://127.0.0.1:{port}"

        async def main():
            async with httpx.AsyncClient(base_url=base, timeout=120) as client:
                return await asyncio.gather(
                    client.post("/v1/completions", json={"prompt": "bad \x7f byte", "max_tokens": 8}),
                    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8}),
                    client.post("/v1/completions", json={"prompt": [1, POISON], "max_tokens": 8, "stream": True}))

        bad, good, bad_stream = asyncio.run(main())
        for r in (bad, bad_stream):   # failed before its first token: a plain HTTP error, stream or not
            error = error_of(r, 500)
            assert error == {"message": "the model produced NaN logits for this request", "type": "server_error",
                             "param": None, "code": "request_failed"}
        assert good.status_code == 200 and good.json()["choices"][0]["token_ids"] == clean
        assert httpx.get(base + "/health", timeout=30).status_code == 200
        r = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8}, timeout=60)
        assert r.json()["choices"][0]["token_ids"] == clean
    finally:
        stop_edges(edges)
        stop_engine_actor(handle)


def test_liveness_and_readiness(url):
    assert httpx.get(url + "/health/live", timeout=30).json() == {"status": "ok"}
    assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"


def test_an_event_stream_ignores_a_disconnect_message_and_ends_with_its_events():
    # Serve's receive proxy can make up an http.disconnect for a client that is still reading; a real
    # departure cancels the handler instead (the next test). Starlette's own StreamingResponse stops at it.
    async def events():
        for i in range(3):
            await asyncio.sleep(0)
            yield f"data: {i}\n\n"

    async def disconnected():
        return {"type": "http.disconnect"}

    def bodies(response_class) -> list:
        sent = []

        async def send(message):
            sent.append(message)

        asyncio.run(response_class(events())({"type": "http", "asgi": {"spec_version": "2.3"}}, disconnected, send))
        return [m["body"] for m in sent if m["type"] == "http.response.body"]

    assert bodies(EventStream) == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert bodies(StreamingResponse) == []


def leave_a_stream_after_three_events(url: str, body: dict) -> bool:
    """Read three events of a streamed request and close the connection; True when the request was still
    running as the client left (False: it finished first, which a stream lagging the engine allows)."""
    finished = sum(wait_idle()["finished"].values())
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        seen = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen.append(line)
            if len(seen) == 3:
                break
        stats = engine_stats()
    if (stats["running"], stats["waiting"]) == (0, 0):
        return False
    assert (stats["running"], stats["waiting"], sum(stats["finished"].values())) == (1, 0, finished), (seen, stats)
    return True


def test_client_disconnect_aborts_the_request(url):
    body = {"prompt": "go on and on", "max_tokens": 1000}
    # 1000 tokens of the tiny model take about a second; a stream that lags the engine under the suite's
    # load (several steps' tokens per event) can see it end before three events: then try again.
    for _ in range(3):
        before = wait_idle()["finished"].get("length", 0)
        if leave_a_stream_after_three_events(url, body):
            break
    else:
        pytest.fail("the 1000-token request finished before the client read three events, three times")
    stats = wait_idle()   # the connection is closed: the engine must drop the request long before 1000 tokens
    assert (stats["running"], stats["waiting"]) == (0, 0)

    async def leave_while_waiting():   # a non-streaming client that goes away
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            task = asyncio.create_task(client.post("/v1/completions", json=body))
            assert (await asyncio.to_thread(wait_for, 1))["running"] == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(leave_while_waiting())
    stats = wait_idle()
    assert (stats["running"], stats["waiting"]) == (0, 0)
    assert stats["finished"].get("length", 0) == before   # both were aborted, not run to their end
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 12}, timeout=60)
    assert r.json()["choices"][0]["token_ids"] == greedy(tuple(PROMPT.encode()), 12)


def actor_pid(actor, timeout: float = 30) -> int:
    """The process id an actor answers from."""
    return ray.get(actor.__ray_call__.remote(lambda self: __import__("os").getpid()), timeout=timeout)


def test_a_crashed_http_edge_is_restarted_by_ray_and_serves_again(url):
    """The edge is a plain actor: if its process dies, Ray starts it again and it binds the same port."""
    edge = ray.get_actor("test-serve-http-0", namespace=NAMESPACE)
    pid = actor_pid(edge)
    ray.kill(edge, no_restart=False)
    # Until the old process is gone its socket may still answer /health, and while Ray restarts the actor
    # calls to it fail (CI once got ActorUnavailableError right after a 200 from the old process): wait for
    # the actor to answer from a new process, then for that one to serve.
    deadline, new_pid = time.monotonic() + 60, pid
    while time.monotonic() < deadline:
        try:
            new_pid = actor_pid(edge, timeout=5)
            if new_pid != pid and httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, httpx.HTTPError):
            pass
        time.sleep(0.2)
    assert new_pid != pid
    assert_still_serving(url)


def test_two_http_edges_share_a_port_and_one_serves_when_the_other_is_gone(url):
    port = free_port()
    edges = start_edges(([ENGINE], NAMESPACE, MODEL, None, MAX_LEN, BODY_LIMIT, "prefix"), port=port, count=2,
                        name="test-serve-pair-http")
    try:
        base = f"http://127.0.0.1:{port}"
        pids = {actor_pid(e) for e in edges}
        assert len(pids) == 2
        assert_still_serving(base)
        pid0 = actor_pid(edges[0])
        ray.kill(edges[0], no_restart=True)
        deadline = time.monotonic() + 30   # ray.kill returns at once: until the process is gone, the kernel
        while time.monotonic() < deadline:  # may still hand its socket a connection, which its death resets
            try:
                os.kill(pid0, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        for _ in range(8):   # a new connection each time: whichever edge the kernel picks must be alive
            assert_still_serving(base)
    finally:
        stop_edges(edges)


def test_an_http_edge_on_a_port_in_use_fails_with_the_port_named(url):
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}.*[Aa]ddress already in use"):
        start_edges(([ENGINE], NAMESPACE, MODEL, None, MAX_LEN, BODY_LIMIT, "prefix"), port=port,
                    name="test-serve-second-http")
    assert_still_serving(url)


def test_shutdown_tells_in_flight_requests_and_readiness_turns_503(url):
    """What Ctrl-C does first (``launch.stop_serving``): the engine ends every stream with "the server is
    shutting down", not "the engine restarted", and refuses new requests until it is replaced."""
    body = {"prompt": "until the server stops", "max_tokens": 1000}

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            plain = asyncio.create_task(client.post("/v1/completions", json=body))
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break
                assert (await asyncio.to_thread(wait_for, 2))["running"] == 2
                engine = ray.get_actor(ENGINE, namespace=NAMESPACE)
                assert await engine.shutdown.remote() == 2
                events = sse_events([line async for line in lines])
            return await plain, events

    plain, events = asyncio.run(main())
    assert events[-1] == "[DONE]"
    expected = {"message": "the server is shutting down; the request can be retried once it is back",
                "type": "server_shutting_down", "param": None, "code": "server_shutting_down"}
    assert events[-2]["error"] == expected
    assert error_of(plain, 503) == expected
    assert error_of(httpx.post(url + "/v1/completions", json={"prompt": PROMPT}, timeout=60), 503) == expected
    health = error_of(httpx.get(url + "/health", timeout=30), 503)
    assert (health["type"], health["code"]) == ("engine_unavailable", "stopping")
    assert httpx.get(url + "/health/live", timeout=30).status_code == 200   # the replica itself is fine

    ray.kill(ray.get_actor(ENGINE, namespace=NAMESPACE), no_restart=True)   # what comes back is a new engine
    start_engine()
    assert_still_serving(url)


def test_engine_restart_fails_in_flight_requests_with_retryable_503(url):
    """Runs last: kills the engine mid-generation, then serves again once a new engine has the name."""
    body = {"prompt": "until the engine dies", "max_tokens": 1000}

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            plain = asyncio.create_task(client.post("/v1/completions", json=body))
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break
                assert (await asyncio.to_thread(wait_for, 2))["running"] == 2   # both are in the engine
                ray.kill(ray.get_actor(ENGINE, namespace=NAMESPACE), no_restart=True)
                events = sse_events([line async for line in lines])
            return await plain, events

    plain, events = asyncio.run(main())
    assert plain.status_code == 503
    assert plain.json()["error"]["type"] == "engine_restarted" and "retried" in plain.json()["error"]["message"]
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert (error["type"], error["code"]) == ("engine_restarted", "engine_restarted") and "retried" in error["message"]

    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_restarted"
    assert error_of(httpx.get(url + "/health", timeout=30), 503)["code"] == "engine_restarted"   # not ready
    assert httpx.get(url + "/health/live", timeout=30).status_code == 200                        # but alive

    start_engine()
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 12}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == greedy(tuple(PROMPT.encode()), 12)
