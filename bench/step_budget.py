"""The step budget's policies side by side on the modelled GPU's clock: no host time, no noise.

The in-process engine with simulated workers serves N requests arriving together; each step advances a
virtual clock by the cost model's time for it (what sleeping workers would sleep), and TTFT, ITL and
tokens/s are read on that clock. Three budgets on the same trace:

- ``room``: the default for simulated workers that sleep the modelled time: a step takes its decodes
  and the prefill that fits beside them before it turns compute-bound (``StepCostModel.prefill_room``),
  at least the bare knee and one token per running sequence;
- ``knee``: the bare knee alone, fixed (``StepCostModel.knee_tokens``);
- ``512``: the fixed budget real workers default to.

Besides the issue's cell (gemma-3-27b on an H100, 128-token prompts, 64 out), ``--cells`` more are drawn
at random (model, GPU, streams, prompt and output lengths) and every one is printed, with ratios to 512.

    python bench/step_budget.py --cells 12 --seed 1
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from tqdm import tqdm

MODELS = ("gemma-3-27b", "gpt-oss-120b", "gpt-oss-20b", "gemma-2-27b", "llama-3.1-8b", "command-a")
GPUS = ("H100-80GB", "H200", "A100-80GB")
STREAMS = (16, 64, 256)
PROMPTS = (128, 512, 2048)
OUTPUTS = (64, 256)
POLICIES = ("room", "knee", "512")


def fitting_tp(model: str, gpu: str) -> int:
    """The fewest tensor-parallel ranks (1, 2, 4, 8) whose devices hold the model's weights."""
    from workers.sim.gpus import default_kv_memory, get_gpu
    from workers.sim.presets import get_model_preset
    preset = get_model_preset(model)
    for tp in (1, 2, 4, 8):
        if preset.num_attention_heads % tp == 0:
            try:
                default_kv_memory(preset, get_gpu(gpu), tp, 1)
                return tp
            except ValueError:
                pass
    raise ValueError(f"{model} does not fit 8 x {gpu}")


def serve(model: str, gpu: str, streams: int, prompt: int, out: int, policy: str, seed: int) -> dict:
    """One run on the virtual clock; ``policy`` one of POLICIES."""
    from cluster.engine.args import EngineArgs
    from cluster.engine.build import build_engine
    from cluster.engine.types import SamplingParams
    # a sleep this small is nothing on the wall clock; any sleep makes the budget the modelled GPU's
    args = EngineArgs(model, simulated_gpu=gpu, sleep_factor=1e-9, tensor_parallel_size=fitting_tp(model, gpu),
                      max_num_batched_tokens=512 if policy == "512" else None)
    engine, info = build_engine(args)
    if policy == "knee":
        engine.scheduler.prefill_room = None
    rng = random.Random(seed)
    for i in range(streams):
        engine.add_request(f"r{i}", [rng.randrange(1000) for _ in range(prompt)], SamplingParams(max_tokens=out))
    times: dict[str, list[float]] = {}
    while engine.has_work():
        updates = engine.step()
        now = engine.metrics.simulated_time_s
        for u in updates:
            if u.new_token_ids:
                times.setdefault(u.request_id, []).append(now)
    if sum(map(len, times.values())) != streams * out:
        raise AssertionError(f"{model} {gpu} {policy}: {sum(map(len, times.values()))} tokens, not {streams * out}")
    clock = engine.metrics.simulated_time_s
    return {"ttft_p50": statistics.median(t[0] for t in times.values()),
            "itl_p50": statistics.median((t[-1] - t[0]) / (len(t) - 1) for t in times.values()),
            "tok_s": streams * out / clock, "steps": engine.metrics.steps,
            "floor": info["max_num_batched_tokens"], "tp": info["tensor_parallel_size"]}


def cells(n: int, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    drawn = [("gemma-3-27b", "H100-80GB", s, 128, 64) for s in STREAMS]
    while len(drawn) < len(STREAMS) + n:
        cell = (rng.choice(MODELS), rng.choice(GPUS), rng.choice(STREAMS), rng.choice(PROMPTS), rng.choice(OUTPUTS))
        if cell not in drawn:
            drawn.append(cell)
    return drawn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", type=int, default=12, help="random cells beside the issue's three")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", help="append one JSON line per cell")
    args = ap.parse_args()
    if args.cells < 0:
        ap.error("--cells must be >= 0")
    rows = []
    for cell in tqdm(cells(args.cells, args.seed), unit="cell", desc="step budget", file=sys.stderr):
        runs = {p: serve(*cell, p, seed=args.seed) for p in POLICIES}
        rows.append((cell, runs))
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({"bench": "step_budget", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                    "cell": cell, "runs": runs}) + "\n")
    head = (f"{'model':>13} {'gpu':>9} {'TP':>2} {'N':>3} {'prompt':>6} {'out':>3} {'floor':>5} | "
            + " | ".join(f"{p:>4}: {'TTFT':>7} {'ITL':>5} {'tok/s':>6}" for p in POLICIES)
            + " | room/512: TTFT   ITL tok/s")
    print("modelled time (ms), p50 over requests; floor = the default's fixed part (knee, >= max_num_seqs)")
    print(head)
    worse = 0
    for (model, gpu, n, prompt, out), runs in rows:
        r, f = runs["room"], runs["512"]
        ratios = (r["ttft_p50"] / f["ttft_p50"], r["itl_p50"] / f["itl_p50"], r["tok_s"] / f["tok_s"])
        worse += ratios[2] < 0.99
        print(f"{model:>13} {gpu:>9} {r['tp']:>2} {n:>3} {prompt:>6} {out:>3} {r['floor']:>5} | "
              + " | ".join(f"{'':>4}  {1e3 * runs[p]['ttft_p50']:7.1f} {1e3 * runs[p]['itl_p50']:5.1f} "
                           f"{runs[p]['tok_s']:6.0f}" for p in POLICIES)
              + f" |          {ratios[0]:5.2f} {ratios[1]:5.2f} {ratios[2]:5.2f}")
    print(f"room below 512 on tokens/s by more than 1%: {worse} of {len(rows)} cells")
    return 0


if __name__ == "__main__":
    sys.exit(main())
