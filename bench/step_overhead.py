"""Engine host time per decode step and the simulated workers' execute, on gemma-3-27b's layout.

Trace: ``N`` requests (64 / 256 / 1024) with ``--prompt-len``-token prompts are prefilled, then decoded
together for ``--steps`` steps on simulated H100 workers (``build_engine(..., simulated_gpu=...,
sleep_factor=0)``). Per step: ``schedule`` (scheduler + KV-cache manager), ``encode`` (the step's msgpack
payload, as the Ray executor sends it), ``apply`` (results into the scheduler), and, worker side, ``decode``
(the payload) and ``execute`` (the simulated worker's checks, mirrors, sampling, cost model). The engine's
host time is schedule + encode + apply: the mean per step, and ``host_p50`` the median step. Side by side
in the same run: the previous layout (one group per ``S`` layers of a kind: 26 sliding + 5 full groups,
width 1), driven by the same engine and worker code. Also printed: table ids and composition unit ids per
step (deltas per step), and the GPU time the cost model gives the step, which host time must stay well
below. CPU time (``time.process_time``), best round, garbage collection included (a full pass over a pool
of millions of units shows up at 1024 requests). In that trace every decode adds full-attention blocks and
nothing is ever freed, so every new full block is a new composite. ``--churn`` adds the serving steady
state: requests finish and new ones arrive (random prompts of 512..2048 tokens, half behind a shared
512-token prefix, 16..256 output tokens) in a pool 1.1x what the running ones need, so the prefix cache
fills and is recycled; after a warm-up, it prints the ids the deltas carry per step.

    PYTHONPATH=. python bench/step_overhead.py [--requests 64 256 1024] [--steps 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cluster.deltas import decode_step, encode_step  # noqa: E402
from cluster.engine import Engine, EngineConfig  # noqa: E402
from cluster.llm import build_engine  # noqa: E402
from cluster.scheduler import SamplingParams  # noqa: E402
from kvmanager.planning import kv_layout  # noqa: E402
from workers.cost_model import StepCostModel  # noqa: E402
from workers.presets import load_model  # noqa: E402
from workers.simulated import SimulatedWorker  # noqa: E402

MODEL, GPU, BLOCK = "gemma-3-27b", "H100-80GB", 16
PHASES = ("schedule", "encode", "apply", "decode", "execute")


class _Executor:
    def __init__(self, worker):
        self.worker = worker

    def execute(self, step):
        return self.worker.execute(step)


def engine_for(layout_name: str, num_requests: int, prompt_len: int, steps: int):
    """``per_kind``: the product (build_engine). ``split``: the previous layout, 1 group per S layers."""
    max_len = prompt_len + steps + num_requests // 4 + 64    # early requests decode while later ones prefill
    layout = kv_layout(load_model(MODEL).layer_specs(BLOCK))
    # Simulated workers allocate nothing: room for every request decoding, and 16 at their prefill peak
    # (8 prompts a step, each holding its whole prompt's window until its first decode step).
    num_blocks = num_requests * layout.blocks_per_request(max_len) + 16 * layout.blocks_per_request(max_len, prompt_len)
    config = dict(max_model_len=max_len, max_num_batched_tokens=prompt_len * 8, max_num_seqs=num_requests)
    if layout_name == "per_kind":
        engine, _ = build_engine(MODEL, simulated_gpu=GPU, sleep_factor=0, block_size=BLOCK, num_blocks=num_blocks,
                                 **config)
        return engine
    specs = tuple(s for s, w in zip(layout.group_specs, layout.group_widths) for _ in range(w))
    preset = load_model(MODEL)
    worker = SimulatedWorker(specs, num_blocks, vocab_size=preset.vocab_size, cost_model=StepCostModel(preset, GPU))
    return Engine(_Executor(worker), specs, num_blocks, EngineConfig(**config, vocab_size=preset.vocab_size))


def run(layout_name: str, num_requests: int, prompt_len: int, steps: int, seed: int) -> dict:
    engine = engine_for(layout_name, num_requests, prompt_len, steps)
    rng = random.Random(seed)
    for i in range(num_requests):
        engine.add_request(f"r{i}", [rng.randrange(1, 32000) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=engine.config.max_model_len - prompt_len - 1))
    while engine.scheduler.waiting or any(s.req.num_computed_tokens < s.req.num_tokens - 1
                                          for s in engine.scheduler.running):
        engine.step()                                  # prefill (and a first decode for the early ones)
    assert len(engine.scheduler.running) == num_requests, "every request must be decoding"
    totals = dict.fromkeys(PHASES, 0.0)
    host_steps = []
    table_ids = unit_ids = payload = 0
    gpu_s = 0.0
    worker = engine.executor.worker if hasattr(engine.executor, "worker") else engine.executor.workers[0]
    gc.collect()
    clock = time.process_time
    for _ in range(steps):
        t0 = clock()
        plan = engine.schedule()
        t1 = clock()
        wire = encode_step(plan.step)
        t2 = clock()
        step = decode_step(wire)
        t3 = clock()
        out = worker.execute(step)
        t4 = clock()
        engine.apply(plan, out)
        t5 = clock()
        for name, dt in zip(PHASES, (t1 - t0, t2 - t1, t5 - t4, t3 - t2, t4 - t3)):
            totals[name] += dt
        host_steps.append((t2 - t0) + (t5 - t4))
        table_ids += sum(len(ids) for c in plan.step.chunks for ids in c.new_block_ids)
        unit_ids += sum(len(units) for _, _, units in plan.step.compositions)
        payload += len(wire)
        gpu_s += out.simulated_time_s
        assert len(plan.step.chunks) == num_requests
    per_step = {k: v / steps * 1e3 for k, v in totals.items()}
    per_step["host"] = per_step["schedule"] + per_step["encode"] + per_step["apply"]
    per_step["host_p50"] = statistics.median(host_steps) * 1e3     # a typical step, no collector pass
    per_step.update(table_ids=table_ids / steps, unit_ids=unit_ids / steps, payload_bytes=payload / steps,
                    gpu_ms=gpu_s / steps * 1e3)
    return per_step


def run_churn(num_running: int, steps: int, warmup: int, seed: int) -> dict:
    """Turnover at a full pool: block ids per step in the deltas, table entries vs composed units."""
    rng = random.Random(seed)
    layout = kv_layout(load_model(MODEL).layer_specs(BLOCK))
    max_len = 2048 + 256 + 16
    num_blocks = int(num_running * layout.blocks_per_request(max_len, 512) * 1.1)
    engine, _ = build_engine(MODEL, simulated_gpu=GPU, sleep_factor=0, block_size=BLOCK, num_blocks=num_blocks,
                             max_model_len=max_len, max_num_batched_tokens=2048, max_num_seqs=num_running)
    shared = [rng.randrange(1, 32000) for _ in range(512)]
    count = 0

    def arrive():
        nonlocal count
        n = rng.randrange(512, 2049)
        head = shared if rng.random() < 0.5 else []
        prompt = head + [rng.randrange(1, 32000) for _ in range(n - len(head))]
        engine.add_request(f"c{count}", prompt, SamplingParams(max_tokens=rng.randrange(16, 257)))
        count += 1

    for _ in range(num_running):
        arrive()
    table_ids = unit_ids = 0
    for step in range(warmup + steps):
        plan = engine.schedule()
        out = engine.executor.execute(plan.step)
        for update in engine.apply(plan, out):
            if update.finished:
                arrive()
        if step >= warmup:
            table_ids += sum(len(ids) for c in plan.step.chunks for ids in c.new_block_ids)
            unit_ids += sum(len(units) for _, _, units in plan.step.compositions)
    usage = engine.stats()["kv_usage"]
    return {"table_ids": table_ids / steps, "unit_ids": unit_ids / steps, "finished": count - num_running,
            "free_units": engine.manager.num_free_blocks, "usage": usage,
            "loose_units": sum(1 for e in engine.manager.pool.free.entries() if e.kind < 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--churn", action="store_true", help="also the turnover trace (block ids per step only)")
    args = ap.parse_args()
    layouts = ("per_kind", "split")
    best: dict = {}
    for rnd in range(args.rounds):
        for n in args.requests:
            for name in layouts:
                r = run(name, n, args.prompt_len, args.steps, seed=rnd)
                key = (name, n)
                if key not in best or r["host"] + r["execute"] < best[key]["host"] + best[key]["execute"]:
                    best[key] = r
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)

    print(f"\n{MODEL} on simulated {GPU}: ms of CPU per decode step (prompt {args.prompt_len}, block {BLOCK}, "
          f"{args.steps} steps, best of {args.rounds} rounds)")
    print("per_kind: one group per attention kind (sliding 26 units wide, full 5); split: 26 + 5 groups of width 1")
    cols = ("schedule", "encode", "apply", "host", "host_p50", "decode", "execute", "table_ids", "unit_ids",
            "payload_bytes", "gpu_ms")
    print(f"{'layout':<9}{'running':>8}" + "".join(f"{c:>14}" for c in cols))
    for n in args.requests:
        for name in layouts:
            r = best[(name, n)]
            print(f"{name:<9}{n:>8}" + "".join(f"{r[c]:>14.2f}" if c not in ("table_ids", "unit_ids", "payload_bytes")
                                               else f"{r[c]:>14.1f}" for c in cols))
    print("\nratios (split / per_kind), and host time as a share of the modelled GPU step:")
    for n in args.requests:
        a, b = best[("per_kind", n)], best[("split", n)]
        print(f"  {n:>5} running: host {b['host'] / a['host']:.1f}x, execute {b['execute'] / a['execute']:.1f}x, "
              f"payload {b['payload_bytes'] / a['payload_bytes']:.1f}x; per_kind host = "
              f"{a['host'] / a['gpu_ms']:.1%} of the GPU step ({a['gpu_ms']:.1f} ms)")
    if args.churn:
        r = run_churn(64, steps=1000, warmup=2000, seed=0)
        print(f"\nturnover, 64 running, pool 1.1x their need, steps 2000..3000 ({r['finished']} requests finished "
              f"by then): {r['table_ids']:.1f} table ids + {r['unit_ids']:.1f} composed units per step")


if __name__ == "__main__":
    main()
