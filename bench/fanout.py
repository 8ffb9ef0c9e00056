"""Cost of one step's fan-out to the worker actors: plain actor calls vs a Ray Compiled Graph.

Each step the engine sends the encoded deltas of a decode step (``--requests`` requests, one new block
id each) to every worker and waits for the last stage's answer. Two shapes: a broadcast to N actors
(tensor-parallel ranks of one stage) and a chain of N actors (pipeline stages, each passing its output
on). Both mechanisms run side by side in one process; the figures are per step.

    python bench/fanout.py --actors 2 4 --steps 300
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray.dag import InputNode, MultiOutputNode  # noqa: E402

from workers.wire import decode_step, encode_step  # noqa: E402
from workers.protocol import ScheduledChunk, StepInput  # noqa: E402


@ray.remote(num_cpus=0)
class EchoWorker:
    """Decodes the step as a worker would and answers with a small payload."""

    def execute(self, payload: bytes, previous=None) -> bytes:
        step = decode_step(payload)
        return len(step.chunks).to_bytes(4, "little")


def decode_payload(num_requests: int) -> bytes:
    chunks = [ScheduledChunk(f"req-{i}", [1000 + i], 4000 + i, [[7000 + i], [9000 + i]]) for i in range(num_requests)]
    return encode_step(StepInput(1, chunks))


def timed(fn, steps: int) -> list[float]:
    for _ in range(10):
        fn()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--actors", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--requests", type=int, default=256)
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    payload = decode_payload(args.requests)
    print(f"step payload: {len(payload)} bytes ({args.requests} decode requests); ms per step, mean / p99", flush=True)
    print(f"{'shape':<12}{'actors':>7}{'plain':>16}{'compiled':>16}{'plain/compiled':>16}")
    for n in args.actors:
        actors = [EchoWorker.remote() for _ in range(n)]
        ray.get([a.execute.remote(payload) for a in actors])
        shapes = {}
        with InputNode() as inp:
            shapes["broadcast"] = (lambda: ray.get([a.execute.remote(payload) for a in actors]),
                                   MultiOutputNode([a.execute.bind(inp) for a in actors]))
        with InputNode() as inp:
            node = None
            for a in actors:
                node = a.execute.bind(inp, node) if node is not None else a.execute.bind(inp)
        def chain():
            ref = None
            for a in actors:
                ref = a.execute.remote(payload, ref) if ref is not None else a.execute.remote(payload)
            return ray.get(ref)
        shapes["chain"] = (chain, node)
        for shape, (plain, dag) in shapes.items():
            compiled = dag.experimental_compile()
            try:
                p = timed(plain, args.steps)
                c = timed(lambda: ray.get(compiled.execute(payload)), args.steps)
            finally:
                compiled.teardown()
            pm, cm = statistics.mean(p) * 1e3, statistics.mean(c) * 1e3
            p99 = lambda xs: sorted(xs)[int(0.99 * len(xs))] * 1e3  # noqa: E731
            print(f"{shape:<12}{n:>7}{pm:>9.2f} / {p99(p):<5.2f}{cm:>9.2f} / {p99(c):<5.2f}{pm / cm:>15.1f}x", flush=True)
        for a in actors:
            ray.kill(a)
    ray.shutdown()


if __name__ == "__main__":
    main()
