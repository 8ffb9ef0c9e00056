"""The host KV tier's CUDA path on a GPU: pinned host pages, copies on a side stream, the compute stream
waiting on their event (``workers/runtime/host_pool.py``), which CPU runs cannot exercise.

Per tiny model (random weights from a seed; hybrid, sliding and chunked layouts) and per scheduling mode
(one step at a time, and asynchronous: step N+1 launched while step N runs), the same turns run on an
engine whose device pool cannot keep one session while the other runs: two 40-token sessions, a follow-up
of each, then four requests at once. Once with a host tier, once recomputing (no tier, no prefix cache).
Rows (JSON lines in --out): ``exact`` (greedy tokens identical), blocks loaded and stored (> 0: the prefix
came back from host), and ``zeroed_differs``: with the host pages zeroed after the sessions were stored,
the follow-up's tokens change (the bytes a load brings back are what attention reads).

    python bench/host_tier_gpu.py --out bench/results/host_tier_gpu.jsonl     # on the GPU
    python bench/host_tier_gpu.py --dry-run --out /tmp/host_tier_gpu.jsonl    # CPU (tests run it)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cluster.engine.build import build_engine  # noqa: E402
from cluster.engine.types import SamplingParams  # noqa: E402

A = [(5 * j + 3) % 256 for j in range(40)]
B = [(11 * j + 1) % 256 for j in range(40)]
TURNS = [A, B, A + [9, 9], B + [7]]                           # one at a time
TOGETHER = [A + [1], B + [2], A + [3, 4], B + [5, 6]]         # then all at once
MAX_TOKENS = 6
# Device pools (blocks of 4 tokens) two blocks above what one request needs: the second session's prefill
# evicts the first's blocks. tests/test_host_tier_engine.py runs the same scenario on CPU.
POOLS = {"default": 38, "tiny-gemma3": 23, "tiny-mistral": 5, "tiny-llama4": 20, "tiny-gemma2": 17}
MODELS = ("tiny-gemma3", "tiny-mistral", "tiny-llama4")        # hybrid, sliding, chunked


def drain(engine, tokens: dict) -> None:
    for _ in range(2000):
        if not engine.has_work():
            return
        for u in engine.step():
            tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
    raise RuntimeError("the engine did not finish")


def run_turns(engine, before_turn=None) -> list[list[int]]:
    """The turns one at a time, then the four requests at once; each request's tokens in that order."""
    tokens: dict = {}
    for i, prompt in enumerate(TURNS):
        if before_turn is not None:
            before_turn(i, engine)
        engine.add_request(f"turn{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS))
        drain(engine, tokens)
    for i, prompt in enumerate(TOGETHER):
        engine.add_request(f"together{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS))
    drain(engine, tokens)
    return [tokens[f"turn{i}"] for i in range(len(TURNS))] + [tokens[f"together{i}"] for i in range(len(TOGETHER))]


def zero_host_memory(turn, engine) -> None:
    """Before turn 2 (both sessions stored, the follow-ups not yet loaded): every worker's host pages to 0."""
    if turn != 2:
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()              # no copy still writing the pages
    for w in engine.executor.workers:
        for pair in w.host.pairs:
            for t in pair:
                t.zero_()


def engine_for(model: str, device: str, tier: bool, async_scheduling: bool):
    kw = dict(num_host_blocks=400) if tier else dict(enable_prefix_caching=False)
    engine, _ = build_engine(model, device=device, block_size=4, num_blocks=POOLS[model], max_num_batched_tokens=16,
                             async_scheduling=async_scheduling, **kw)
    return engine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true", help="on CPU (the copies then run in order, no stream)")
    p.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS), help=",".join(POOLS))
    args = p.parse_args(argv)
    unknown = sorted(set(args.models) - set(POOLS))
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {', '.join(POOLS)}")
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on CPU", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    failures = 0
    with args.out.open("w") as f:
        for model in args.models:
            for async_scheduling in (False, True):
                t0 = time.perf_counter()
                recomputed = run_turns(engine_for(model, device, False, async_scheduling))
                tiered_engine = engine_for(model, device, True, async_scheduling)
                tiered = run_turns(tiered_engine)
                stats = tiered_engine.stats()
                zeroed = run_turns(engine_for(model, device, True, async_scheduling), before_turn=zero_host_memory)
                row = {"bench": "host_tier_gpu", "device": device,
                       "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "model": model, "async_scheduling": async_scheduling, "exact": tiered == recomputed,
                       "blocks_loaded": stats["kv_host_blocks_loaded"], "blocks_stored": stats["kv_host_blocks_stored"],
                       "load_failures": stats["kv_host_load_failures"], "zeroed_differs": zeroed[2] != recomputed[2],
                       "seconds": round(time.perf_counter() - t0, 2)}
                ok = row["exact"] and row["blocks_loaded"] > 0 and row["zeroed_differs"] and not row["load_failures"]
                row["ok"] = ok
                failures += not ok
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(f"{model:<12} async={async_scheduling!s:<5} exact={row['exact']!s:<5} "
                      f"loaded={row['blocks_loaded']:>4} stored={row['blocks_stored']:>4} "
                      f"zeroed_differs={row['zeroed_differs']!s:<5} {row['seconds']:>6.2f} s  {'ok' if ok else 'FAILED'}",
                      flush=True)
    cases = 2 * len(args.models)
    print(f"{cases - failures} of {cases} cases ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
