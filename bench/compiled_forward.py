"""The bundled model with its forward compiled (``--compile-model``) against eager, side by side in one run.

In process: two ``LLM``s, one compiled (its warm-up timed), serve the same drawn batches in turn (the order
reversed every other round): batch sizes and prompt lengths are drawn at random each round, ``--max-tokens``
out, greedy; each cell prints ms per step of both and the ratio, and checks that both drew the same tokens.
With ``--served``: two ``swakv serve`` processes (eager, compiled) up at once, each round one Poisson trace at
``--rate`` req/s of random ``--prompt-len``-token prompts sent to each in turn; TTFT p50 and ITL p50 of each
run, and the ratios of the medians over the rounds.

    PYTHONPATH=. python bench/compiled_forward.py --rounds 4 --served --rate 8
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

from bench.serving import Server, stream_completion


def in_process(args) -> None:
    from cluster.engine.llm import LLM
    eager = LLM("default")
    t0 = time.perf_counter()
    compiled = LLM("default", compile_model=True)
    print(f"compiled LLM built in {time.perf_counter() - t0:.1f} s (warm-up included)", flush=True)
    rng = random.Random(args.seed)
    ratios = []
    for r in range(args.rounds):
        batch = rng.choice((1, 2, 4, 8, 16))
        prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(16, 512))] for _ in range(batch)]
        times, tokens = {}, {}
        for name in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
            llm = eager if name == "eager" else compiled
            steps = llm.engine.metrics.steps
            t = time.perf_counter()
            out = llm.generate(prompts, max_tokens=args.max_tokens, ignore_eos=True)
            times[name] = (time.perf_counter() - t) * 1e3 / (llm.engine.metrics.steps - steps)
            tokens[name] = [o.output_token_ids for o in out]
        ratios.append(times["compiled"] / times["eager"])
        print(f"round {r}: {batch:2d} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens: "
              f"eager {times['eager']:.2f} ms/step, compiled {times['compiled']:.2f} ({ratios[-1]:.2f}x), "
              f"tokens {'equal' if tokens['eager'] == tokens['compiled'] else 'DIFFER'}", flush=True)
    print(f"compiled / eager ms per step: median {statistics.median(ratios):.2f}x, "
          f"range {min(ratios):.2f}-{max(ratios):.2f}x")


async def _trace(port: int, rng: random.Random, args) -> tuple[float, float, int]:
    async def one(delay: float, prompt: list[int]):
        await asyncio.sleep(delay)
        body = json.dumps({"model": "swakv-tiny-hybrid", "prompt": prompt, "max_tokens": args.max_tokens,
                           "ignore_eos": True, "temperature": 0, "stream": True}).encode()
        return await stream_completion("127.0.0.1", port, body, 60)
    at, sends = 0.0, []
    for _ in range(args.requests):
        at += rng.expovariate(args.rate)
        sends.append(one(at, [rng.randrange(3, 250) for _ in range(args.prompt_len)]))
    streams = await asyncio.gather(*sends)
    ttft = [s.times[0] - s.sent for s in streams if s.times]
    itl = [b - a for s in streams for a, b in zip(s.times, s.times[1:])]
    return statistics.median(ttft) * 1e3, statistics.median(itl) * 1e3, sum(1 for s in streams if s.error)


def served(args) -> None:
    servers = {"eager": Server([], args.port), "compiled": Server(["--compile-model"], args.port + 1)}
    try:
        for name, server in servers.items():
            print(f"{name}: ready in {server.wait_ready(600):.1f} s", flush=True)
        got = {name: [] for name in servers}
        for r in range(args.rounds):
            for name in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
                ttft, itl, errors = asyncio.run(_trace(servers[name].port, random.Random(args.seed + r), args))
                got[name].append((ttft, itl))
                print(f"round {r} {name:8s}: TTFT p50 {ttft:.1f} ms, ITL p50 {itl:.2f} ms, {errors} failed", flush=True)
        for i, what in enumerate(("TTFT p50", "ITL p50")):
            e, c = (statistics.median(x[i] for x in got[n]) for n in ("eager", "compiled"))
            per_round = ", ".join(f"{b[i] / a[i]:.2f}" for a, b in zip(got["eager"], got["compiled"]))
            print(f"{what}: eager {e:.2f} ms, compiled {c:.2f} ms ({c / e:.2f}x; rounds {per_round})")
    finally:
        for server in servers.values():
            server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--served", action="store_true", help="also the two servers side by side")
    ap.add_argument("--rate", type=float, default=8.0, help="served: requests per second (Poisson)")
    ap.add_argument("--requests", type=int, default=100, help="served: requests per run")
    ap.add_argument("--prompt-len", type=int, default=128, help="served: tokens per prompt")
    ap.add_argument("--port", type=int, default=8140, help="served: the eager server's port; the compiled one's +1")
    args = ap.parse_args()
    in_process(args)
    if args.served:
        served(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
