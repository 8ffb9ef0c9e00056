"""Requests that arrive while steps run: TTFT and ITL under Poisson arrivals, this checkout against another.

Where a request lands depends on when the engine schedules the step after the one running: scheduled at
once, it is fixed a whole step before the workers reach it and an arrival waits one step more
(``cluster/engine/step_clock.py``). This bench serves ``--model`` on simulated workers that sleep the
modelled step (``--sleep-factor``: GPU-length steps, no GPU needed) from this checkout and, with
``--baseline DIR``, from another checkout side by side (both up at once, each idle while the other is
measured). Each round draws one trace (Poisson arrivals at ``--rate`` for ``--duration`` seconds, random
``--prompt-len``-token prompts, ``--max-tokens`` out, ignore_eos) and sends it to every server in turn, the
order reversed every other round. Prints TTFT p50/p99 and ITL p50 (a stream's mean gap) per run, the medians
over the rounds and the ratio to the baseline.

    PYTHONPATH=. python bench/arrivals.py [--baseline DIR] [--rate 16] [--duration 30] [--rounds 3]
        [--model gemma-3-27b] [--gpu H100-80GB] [--tensor-parallel-size 1] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import Server, body_for, log, pct, stream_completion   # noqa: E402

from cluster.ray.ports import free_port  # noqa: E402  (serving put the repository on the path)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trace(rng: random.Random, rate: float, duration: float, prompt_len: int) -> list[tuple[float, list[int]]]:
    """(send offset in seconds, prompt) for every arrival of one round."""
    out, t = [], 0.0
    while t < duration:
        out.append((t, [rng.randrange(1, 32000) for _ in range(prompt_len)]))
        t += rng.expovariate(rate)
    return out


async def replay(port: int, arrivals, max_tokens: int, model: str, timeout_s: float) -> dict:
    async def one(offset: float, prompt: list[int]):
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        return await stream_completion("127.0.0.1", port, body_for(prompt, max_tokens, model), timeout_s)
    t0 = time.perf_counter()
    streams = await asyncio.gather(*(one(offset, prompt) for offset, prompt in arrivals))
    ttft = [s.times[0] - s.sent for s in streams if s.times]
    itl = [(s.times[-1] - s.times[0]) / (s.tokens - 1) for s in streams if s.tokens > 1]
    bad = sum(1 for s in streams if s.error or s.tokens != max_tokens or not s.done)
    return {"requests": len(streams), "failed": bad, "ttft_p50_ms": 1e3 * pct(ttft, 0.5),
            "ttft_p99_ms": 1e3 * pct(ttft, 0.99), "itl_p50_ms": 1e3 * pct(itl, 0.5)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", metavar="DIR", help="another checkout, served side by side")
    ap.add_argument("--rate", type=float, default=16.0, help="arrivals per second (Poisson)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="gemma-3-27b")
    ap.add_argument("--gpu", default="H100-80GB")
    ap.add_argument("--sleep-factor", type=float, default=1.0)
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="for models one GPU cannot hold")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jsonl", help="append one JSON line per run to this file")
    args = ap.parse_args()
    if args.rate <= 0 or args.duration <= 0 or args.rounds < 1:
        ap.error("--rate and --duration must be > 0 and --rounds >= 1")
    roots = {"this": ROOT}
    if args.baseline:
        if not os.path.isdir(os.path.join(args.baseline, "cluster")):
            ap.error(f"--baseline {args.baseline!r} is not a swakv checkout (no cluster/ in it)")
        roots["baseline"] = os.path.abspath(args.baseline)
    serve_args = ["--model", args.model, "--simulated-gpu", args.gpu, "--sleep-factor", str(args.sleep_factor),
                  "--tensor-parallel-size", str(args.tensor_parallel_size)]
    servers = {}
    rng = random.Random(args.seed)
    runs: dict[str, list[dict]] = {name: [] for name in roots}
    try:
        for name, root in roots.items():
            servers[name] = Server(serve_args, free_port(), root=root)
            servers[name].wait_ready(300)
        for r in range(args.rounds):
            arrivals = trace(rng, args.rate, args.duration, args.prompt_len)
            for name in (list(roots) if r % 2 == 0 else list(roots)[::-1]):
                log(f"round {r + 1}/{args.rounds}: {len(arrivals)} arrivals to {name}")
                run = asyncio.run(replay(servers[name].port, arrivals, args.max_tokens, args.model, 300.0))
                run.update(server=name, round=r + 1, rate=args.rate, model=args.model, gpu=args.gpu,
                           tp=args.tensor_parallel_size, sleep_factor=args.sleep_factor)
                runs[name].append(run)
                print(f"{name:9s} round {r + 1}  TTFT p50 {run['ttft_p50_ms']:7.1f} ms  p99 {run['ttft_p99_ms']:7.1f} ms"
                      f"  ITL p50 {run['itl_p50_ms']:6.2f} ms  requests {run['requests']}  failed {run['failed']}",
                      flush=True)
                if args.jsonl:
                    with open(args.jsonl, "a") as f:
                        f.write(json.dumps(run) + "\n")
    finally:
        for server in servers.values():
            server.stop()
    medians = {name: {k: statistics.median(run[k] for run in rs) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms")}
               for name, rs in runs.items()}
    print(f"\nmedians over {args.rounds} rounds, {args.rate:g} req/s, {args.model} on a modelled {args.gpu} "
          f"(sleep x{args.sleep_factor:g}):")
    for name, m in medians.items():
        ratio = ""
        if name != "baseline" and "baseline" in medians:
            b = medians["baseline"]
            ratio = "  (" + ", ".join(f"{k.split('_ms')[0]} {m[k] / b[k]:.2f}x" for k in m) + " of the baseline)"
        print(f"{name:9s} TTFT p50 {m['ttft_p50_ms']:7.1f} ms  p99 {m['ttft_p99_ms']:7.1f} ms  "
              f"ITL p50 {m['itl_p50_ms']:6.2f} ms{ratio}")
    failed = sum(run["failed"] for rs in runs.values() for run in rs)
    if failed:
        print(f"{failed} requests failed or came back short")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
