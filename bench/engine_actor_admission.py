"""TTFT of N requests arriving at once: the engine actor's logic (``EngineService``: its engine-core thread,
inbox and per-step hand-off to the event loop, no Ray) against the bare engine stepped in this thread,
side by side, zero-time simulated workers. Says how much of the served path's TTFT the actor's own
machinery can account for (the rest is Ray's and Serve's).

    PYTHONPATH=. python bench/engine_actor_admission.py [--streams 16] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from cluster.engine.args import EngineArgs
from cluster.engine.build import build_engine
from cluster.engine.types import SamplingParams
from cluster.ray.engine_actor import EngineService


def prompts(rng, n, length=128):
    return [[rng.randrange(1, 30000) for _ in range(length)] for _ in range(n)]


def bare(args, batches, max_tokens):
    engine, _ = build_engine(args)
    ttft = []
    for batch in batches:
        t0, seen = time.perf_counter(), set()
        for i, p in enumerate(batch):
            engine.add_request(f"r{len(ttft)}-{i}", p, SamplingParams(max_tokens=max_tokens))
        while engine.has_work():
            for u in engine.step():
                if u.new_token_ids and u.request_id not in seen:
                    seen.add(u.request_id)
                    ttft.append(time.perf_counter() - t0)
    return ttft


def served(args, batches, max_tokens):
    svc = EngineService(lambda: build_engine(args))

    async def drain(i, p, t0):
        first = None
        async for item in svc.generate(f"r{i}", p, {"max_tokens": max_tokens}):
            if first is None and item["token_ids"]:
                first = time.perf_counter() - t0
        return first

    async def main():
        await svc.ready()
        out = []
        for batch in batches:
            t0 = time.perf_counter()
            out += await asyncio.gather(*(drain(i, p, t0) for i, p in enumerate(batch)))
        return out
    return asyncio.run(main())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    args = EngineArgs("gemma-3-27b", simulated_gpu="H100-80GB")
    rng = random.Random(a.seed)
    warm = [prompts(rng, 1)]
    bare(args, warm, 4)
    served(args, warm, 4)
    for r in range(a.rounds):
        batches = [prompts(rng, a.streams)]
        b = statistics.median(bare(args, batches, a.max_tokens)) * 1e3
        s = statistics.median(served(args, batches, a.max_tokens)) * 1e3
        print(f"round {r}: {a.streams} requests at once, TTFT p50: engine alone {b:.1f} ms, "
              f"EngineService (core thread) {s:.1f} ms, ratio {s / b:.2f}", flush=True)


if __name__ == "__main__":
    main()
