"""Data-parallel replicas behind the Serve app, over real Ray actors: routing by the replicas' KV events, a
replica killed with requests in it, its recovery, health and metrics per replica.

Three engine actors with simulated gemma-3-27b workers; replica 0's steps are slow (its worker sleeps
the modelled time x 60, about a second a step) so that a request can be caught in it before its first
token. Expected tokens follow the simulated worker's documented rule (a hash of the worker seed, the
request's seed and the position), whichever replica computes them.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time

import httpx
import pytest
import ray
from ray import serve

from cluster.ray.engine_actor import NAMESPACE
from cluster.ray.ports import free_port
from cluster.serve.ray_serve import build_app, run

from drivers import start_engine_actor, stop_engine_actor

BASE = "test-dp-engine"
NAMES = [f"{BASE}-{i}" for i in range(3)]
VOCAB = 262208                   # gemma-3-27b
BUILD = dict(model="gemma-3-27b", simulated_gpu="H100-80GB", kv_cache_memory=1 << 30, max_model_len=4096,
             max_num_batched_tokens=256)
PROMPT = [(7 * i) % 200 + 1 for i in range(200)]     # 200 tokens: 12 full blocks of 16


def expected(seed: int, prompt_len: int, n: int) -> list[int]:
    return [int.from_bytes(hashlib.blake2b(f"0\x00{seed}\x00{prompt_len + i}".encode(), digest_size=8).digest(),
                           "little") % VOCAB for i in range(n)]


@pytest.fixture(scope="module")
def url(ray_runtime):
    handles = []
    try:
        for rank, name in enumerate(NAMES):
            handle, _ = start_engine_actor({**BUILD, "sleep_factor": 60.0 if rank == 0 else 0.0}, name=name,
                                           rank=rank, max_restarts=1, timeout_s=120)
            handles.append(handle)
        port = free_port()
        run(build_app(NAMES, NAMESPACE, "gemma-3-27b", None, 4096, router="prefix"), port=port, name="test-dp")
        base = f"http://127.0.0.1:{port}"
        wait_routable(base, 3)
        yield base
    finally:
        serve.shutdown()
        for handle in handles:
            stop_engine_actor(handle)


def wait_routable(url: str, n: int, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(url + "/health", timeout=30)
        body = r.json()
        if r.status_code == 200 and body["ready"] == body["routable"] == n:
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.2)


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def stats(rank: int) -> dict:
    return ray.get(ray.get_actor(NAMES[rank], namespace=NAMESPACE).stats.remote(), timeout=30)


def body(prompt, max_tokens, seed, stream=False):
    return {"prompt": prompt, "max_tokens": max_tokens, "seed": seed, "temperature": 0.5, "ignore_eos": True,
            "stream": stream}


def test_health_and_metrics_report_every_replica(url):
    health = wait_routable(url, 3)
    assert health["replicas"] == {name: {"status": "ready", "detail": ""} for name in NAMES}
    m = metrics(url)
    assert [m[f'swakv_replica_up{{replica="{r}"}}'] for r in range(3)] == [1.0, 1.0, 1.0]
    assert all(f'swakv_requests_running{{replica="{r}"}}' in m for r in range(3))
    assert all(m[f'swakv_router_kv_snapshots_total{{replica="{r}"}}'] >= 1 for r in range(3))


def test_a_request_goes_to_the_replica_that_caches_its_prefix(url):
    r = httpx.post(url + "/v1/completions", json=body(PROMPT, 2, 11), timeout=60)
    assert r.json()["choices"][0]["token_ids"] == expected(11, 200, 2)
    holder = next(rank for rank in range(3) if stats(rank)["prefix_cached_blocks"][1] >= 12)
    before = metrics(url)
    follow_up = PROMPT + r.json()["choices"][0]["token_ids"] + [5] * 30
    r2 = httpx.post(url + "/v1/completions", json=body(follow_up, 2, 12), timeout=60)
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 192   # 12 blocks, found where cached
    after = metrics(url)
    key = f'swakv_router_requests_total{{replica="{holder}",reason="best-hit"}}'
    assert after.get(key, 0) == before.get(key, 0) + 1


def test_a_killed_replica_s_unstarted_requests_go_elsewhere_and_it_comes_back_relearnt(url):
    """B streams from replica 0; A, sharing B's prompt, is routed there too and waits for the next (slow)
    step; replica 0 is killed: A is retried on another replica and completes with exactly its tokens, B
    ends with the retryable error; Ray restarts replica 0, whose cache the router re-learns from a
    snapshot."""
    prompt_b = [3] * 150 + PROMPT
    engine0 = ray.get_actor(NAMES[0], namespace=NAMESPACE)
    pid0 = ray.get(engine0.__ray_call__.remote(lambda actor: os.getpid()), timeout=60)
    for ref in engine0.generate.options(num_returns="streaming").remote("seed-0", prompt_b, {"max_tokens": 1}):
        ray.get(ref, timeout=60)                         # replica 0 alone caches prompt_b (through no router)
    deadline = time.monotonic() + 30
    while metrics(url).get('swakv_router_index_hashes{replica="0",group="1"}', 0) < 21:   # 350 // 16 blocks
        assert time.monotonic() < deadline
        time.sleep(0.1)
    before = metrics(url)

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async with client.stream("POST", "/v1/completions", json=body(prompt_b, 60, 21, stream=True)) as rb:
                lines = rb.aiter_lines()
                async for line in lines:
                    if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["token_ids"]:
                        break
                assert (await asyncio.to_thread(stats, 0))["running"] == 1     # B is on replica 0
                a = asyncio.create_task(client.post("/v1/completions", json=body(prompt_b + [9] * 20, 5, 22)))
                deadline = time.monotonic() + 30
                while (await asyncio.to_thread(stats, 0))["running"] + (await asyncio.to_thread(stats, 0))["waiting"] < 2:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                ray.kill(ray.get_actor(NAMES[0], namespace=NAMESPACE), no_restart=False)
                rest = [line async for line in lines]
            return await a, rest

    a, rest = asyncio.run(main())
    # the killed engine's rings (its workers', its frontends') had their names removed once mapped: nothing
    # of it stays in /dev/shm, though it never ran its shutdown
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"swakv-{pid0}-")] == []
    assert a.status_code == 200, a.text
    assert a.json()["choices"][0]["token_ids"] == expected(22, 370, 5)           # answered once, exactly
    events = [json.loads(x[6:]) for x in rest if x.startswith("data: ") and x != "data: [DONE]"]
    assert events[-1]["error"]["type"] == "engine_restarted" and "retried" in events[-1]["error"]["message"]
    m = metrics(url)
    assert m["swakv_router_retries_total"] == before["swakv_router_retries_total"] + 1
    assert m['swakv_router_replica_down_total{replica="0"}'] >= 1

    health = wait_routable(url, 3)                    # Ray restarted it; the router follows it again
    assert health["replicas"][NAMES[0]]["status"] == "ready"
    m = metrics(url)
    assert m['swakv_router_kv_snapshots_total{replica="0"}'] >= 2  # the first, and the one after the restart
    for rank in range(3):   # each index equals its engine's cache (the new replica 0's is empty)
        cached = stats(rank)["prefix_cached_blocks"]
        assert [m.get(f'swakv_router_index_hashes{{replica="{rank}",group="{g}"}}', 0) for g in range(2)] == cached
    assert stats(0)["prefix_cached_blocks"] == [0, 0] and stats(0)["steps"] == 0
    r = httpx.post(url + "/v1/completions", json=body(PROMPT, 3, 23), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected(23, 200, 3)
