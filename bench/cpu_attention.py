"""The CPU attention backend's cost per call, and the bundled model's step times, against another checkout.

Calls: ``paged_attention`` with the torch backend, by default 4 query heads over 2 KV heads of 32 (the
bundled model's shape), block 16: prompts of 140 / 600 / 2,000 tokens, 1-64 decodes of 100-600 keys, a
prompt beside 4 decodes; each with full attention and a 256-token window (``--heads``, ``--kv-heads``,
``--head-size``, ``--block-size``, ``--windows`` for other settings; 0 is full attention). Engine: the bundled model in process
(``build_engine``, one step at a time): a 140-token prompt to its first token, and a decode step of 1 and
of 16 requests of 150-token prompts.

Each checkout runs in its own process (``PYTHONPATH`` pointing at it, so a baseline imports its own
modules); the processes alternate over ``--rounds`` rounds and each figure is the best round. One thread
(``torch.set_num_threads(1)``), as the served worker runs.

    git worktree add --detach ../base HEAD~1 && python bench/cpu_attention.py --baseline ../base
    python bench/cpu_attention.py --baseline ../base --heads 8 --kv-heads 4 --head-size 128 --windows 0 1024
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cases() -> list[tuple[str, list[int], list[int]]]:
    cases = [(f"prompt {n}", [n], [n]) for n in (140, 600, 2000)]
    for b in (1, 2, 4, 16, 64):
        rng = random.Random(b)
        cases.append((f"{b} decodes", [rng.randrange(100, 600) for _ in range(b)], [1] * b))
    rng = random.Random(9)
    cases.append(("prompt 140 + 4 decodes", [140] + [rng.randrange(100, 600) for _ in range(4)], [140, 1, 1, 1, 1]))
    return cases


def _best_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e6


def child(args) -> dict:
    """This process's figures: µs per call per case and window, ms per engine phase."""
    import torch
    torch.set_num_threads(1)
    from workers.attention import paged_attention
    gen = torch.Generator().manual_seed(0)
    bs, num_blocks = args.block_size, 12800 // args.block_size
    k_cache = torch.randn(num_blocks, bs, args.kv_heads, args.head_size, generator=gen)
    v_cache = torch.randn(num_blocks, bs, args.kv_heads, args.head_size, generator=gen)
    out = {}
    for name, seq_lens, query_lens in _cases():
        tables = torch.randint(1, num_blocks, (len(seq_lens), 2048 // bs + 1), dtype=torch.int32, generator=gen)
        q = torch.randn(sum(query_lens), args.heads, args.head_size, generator=gen)
        sl, ql = torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(query_lens, dtype=torch.int32)
        for window in [w or None for w in args.windows]:
            out[f"{name}, window {window}"] = _best_us(
                lambda: paged_attention(q, k_cache, v_cache, tables, sl, ql, window=window, backend="torch"),
                5 if "2000" in name else 40)
    out.update(_engine())
    return out


def _engine() -> dict:
    from cluster.engine.args import EngineArgs
    from cluster.engine.build import build_engine
    from cluster.engine.types import SamplingParams
    engine, _ = build_engine(EngineArgs(async_scheduling=False))
    rng = random.Random(0)

    def prompt(n):
        return [rng.randrange(3, 200) for _ in range(n)]

    def first_token() -> float:
        engine.add_request(f"p{rng.random()}", prompt(140), SamplingParams(max_tokens=1))
        t = time.perf_counter()
        while engine.has_work():
            engine.step()
        return time.perf_counter() - t

    def decode_step(batch: int) -> float:
        for _ in range(batch):
            engine.add_request(f"d{rng.random()}", prompt(150), SamplingParams(max_tokens=24, temperature=1.0))
        engine.step()            # the prompts
        steps, t = 0, time.perf_counter()
        while engine.has_work():
            engine.step()
            steps += 1
        return (time.perf_counter() - t) / steps

    first_token()
    return {"engine: 140-token prompt to first token (ms)": 1e3 * min(first_token() for _ in range(15)),
            "engine: decode step, 1 request (ms)": 1e3 * min(decode_step(1) for _ in range(3)),
            "engine: decode step, 16 requests (ms)": 1e3 * min(decode_step(16) for _ in range(3))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", metavar="DIR", help="another checkout to time side by side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-size", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--windows", type=int, nargs="+", default=[0, 256], help="0: full attention")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    roots = {"this": ROOT} | ({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})
    runs: dict[str, list[dict]] = {name: [] for name in roots}
    for r in range(args.rounds):
        for name in (list(roots) if r % 2 == 0 else list(roots)[::-1]):
            print(f"[round {r + 1}/{args.rounds}] {name}: {roots[name]}", file=sys.stderr, flush=True)
            env = dict(os.environ, PYTHONPATH=roots[name])
            done = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env, cwd=roots[name],
                                  capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    best = {name: {k: min(run[k] for run in rs) for k in rs[0]} for name, rs in runs.items()}
    head = f"{'case':<48}{'this':>10}" + (f"{'baseline':>10}{'base/this':>10}" if args.baseline else "")
    print(f"best of {args.rounds} rounds; calls in µs, engine in ms\n{head}")
    for key, value in best["this"].items():
        line = f"{key:<48}{value:>10.1f}"
        if args.baseline:
            b = best["baseline"].get(key)
            line += f"{b:>10.1f}{b / value:>10.2f}" if b is not None else f"{'-':>10}{'-':>10}"
        print(line)


if __name__ == "__main__":
    main()
