"""Time to first token of requests that arrive while others decode, with late joiners and without, on real
workers over the rings (the tiny Gemma-3 model; ``--tp 2``: two tensor-parallel ranks, whose rank 0 decides
which joiners run). Both sides use the same executor, the joins switched off on one; rounds alternate, each
with the same arrival times and prompts, in one process.

    PYTHONPATH=. python bench/late_joiners.py --tp 2 --rounds 3

Two requests decode throughout; 80 more arrive 10-50 ms apart (seeded), each asking for 2 tokens. The
printed ratio is with joiners over without, per round, of the TTFT median.
"""
from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import ray

from cluster.engine.build import build_engine
from cluster.engine.core import EngineCore
from cluster.engine.types import SamplingParams
from cluster.ray.executors import RayExecutor


class WithoutJoins(RayExecutor):
    supports_joins = property(lambda self: False)


def one_run(executor_cls, tp: int, seed: int, arrivals: int) -> dict:
    engine, _ = build_engine("tiny-gemma3", block_size=4, num_blocks=1024, max_model_len=1024,
                             executor_cls=executor_cls, async_scheduling=True, tensor_parallel_size=tp,
                             num_cpus_per_worker=1 / tp)
    core = EngineCore(engine)
    first, sent, lock = {}, {}, threading.Lock()

    def emit(updates):
        now = time.perf_counter()
        with lock:
            for u in updates:
                if u.new_token_ids and u.request_id not in first:
                    first[u.request_id] = now
    thread = threading.Thread(target=core.run, args=(emit,), daemon=True)
    thread.start()
    rng = random.Random(seed)
    try:
        for i in range(2):
            core.call(core.add_request, f"long{i}", list(range(3 + i, 40 + i)),
                      SamplingParams(max_tokens=1000)).result(60)
        time.sleep(1.0)
        for i in range(arrivals):
            prompt = [rng.randrange(3, 250) for _ in range(rng.randrange(8, 40))]
            sent[f"w{i}"] = time.perf_counter()
            core.call(core.add_request, f"w{i}", prompt, SamplingParams(max_tokens=2), admit=True)
            time.sleep(rng.uniform(0.01, 0.05))
        deadline = time.monotonic() + 60
        while len(first) < len(sent) + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        joined = core.call(lambda: core.engine.metrics.joined_requests).result(60)
        for i in range(2):
            core.call(core.abort, f"long{i}").result(60)
    finally:
        core.call(engine.executor.shutdown).result(60)
        core.close()
        thread.join(10)
    missing = [rid for rid in sent if rid not in first]
    if missing:
        raise RuntimeError(f"{len(missing)} requests got no token: {missing[:5]}")
    ttft = sorted((first[r] - sent[r]) * 1e3 for r in sent)
    return {"p50": statistics.median(ttft), "p90": ttft[int(0.9 * len(ttft))], "joined": joined}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arrivals", type=int, default=80)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    ratios = []
    for rnd in range(args.rounds):
        runs = {name: one_run(cls, args.tp, rnd, args.arrivals)
                for name, cls in (("with joiners", RayExecutor), ("without", WithoutJoins))}
        for name, r in runs.items():
            print(f"tp={args.tp} round {rnd} {name:>12}: TTFT p50 {r['p50']:6.1f} ms  p90 {r['p90']:6.1f} ms  "
                  f"({r['joined']} of {args.arrivals} joined)", flush=True)
        ratios.append(runs["with joiners"]["p50"] / runs["without"]["p50"])
        print(f"tp={args.tp} round {rnd} ratio of TTFT p50, with / without: {ratios[-1]:.2f}x", flush=True)
    print(f"tp={args.tp}: TTFT p50 with joiners / without, per round: "
          + ", ".join(f"{r:.2f}x" for r in ratios) + f"; median {statistics.median(ratios):.2f}x")
    ray.shutdown()


if __name__ == "__main__":
    main()
