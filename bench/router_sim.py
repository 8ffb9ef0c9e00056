"""Routers compared on simulated time: N engine replicas (real scheduler + manager, simulated workers timed
by the cost model), the real routers over KV-event indexes, the load test's workloads, no wall clock.

The live load test (``swakv loadtest --compare-routers``) measures the whole stack on this machine, whose
CPUs are shared and noisy; this replays the same sessions in simulated GPU time, so a comparison of
routers depends only on their decisions. Every replica steps whenever it has work, each step taking the
cost model's time; a turn arrives, is routed (the router sees each replica's queues, KV usage, prefill
backlog and cached hashes as of that moment), and its session's next turn arrives its think time after
the answer's last token. TTFT is arrival to the first token's step end.

Each run also prints the engine-step floor under the medians: a request cannot have its first token
before the end of the first step that starts at or after its arrival (a step under way cannot take it
in). ``floor p50`` is the median of that bound on the replica the router chose, ``at floor`` the share
of requests that met it, and ``any p50`` the median over requests of the bound on whichever replica's
next step ends first: what a router would get that knew every replica's step phase and lost no hit by
moving a request.

    python bench/router_sim.py --workload chat --seeds 0,1,2,3,4
    python bench/router_sim.py --workload qa --seeds 0,1,2,3,4
    python bench/router_sim.py --workload chat --shared-prefixes 1,2,3,6,12 --seeds 0,1,2,3,4 --plot sweep.png
"""
from __future__ import annotations

import argparse
import bisect
import heapq
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.engine.kv_events import EventPublisher  # noqa: E402
from cluster.engine.build import build_engine  # noqa: E402
from cluster.loadtest.client import percentile, request_seed  # noqa: E402
from cluster.loadtest.workloads import WORKLOADS  # noqa: E402
from cluster.loadtest.config import ROUTER_WORKLOADS  # noqa: E402
from cluster.routing.policies import ROUTERS, Replica, make_router  # noqa: E402
from cluster.routing.prompt import PromptHashes  # noqa: E402
from cluster.engine.types import SamplingParams  # noqa: E402
from kvmanager.coordinator import HitRule  # noqa: E402


def simulate(router_name: str, sessions, *, model: str, gpu: str, replicas: int, kv_memory: int,
             duration_s: float, seed: int = 0) -> dict:
    engines, pubs, views = [], [], []
    for rank in range(replicas):
        engine, _ = build_engine(model, simulated_gpu=gpu, kv_cache_memory=kv_memory, pipeline_parallel_size=1)
        pub = EventPublisher(engine.manager.specs, rank)
        pub.attach(engine.manager)
        engines.append(engine)
        pubs.append(pub)
        views.append(Replica(rank, f"replica-{rank}", ready=True, rule=HitRule(engine.manager.specs),
                             step_tokens=engine.config.max_num_batched_tokens))
    router = make_router(router_name, seed)
    events: list = []       # (time, order, kind, payload)
    order = 0

    def push(t, kind, payload):
        nonlocal order
        order += 1
        heapq.heappush(events, (t, order, kind, payload))

    for s in sessions:
        push(s.start_s + s.turns[0].think_s, "arrive", (s, 0, tuple(s.prefix)))
    busy = [False] * replicas
    steps: list[list[tuple[float, float]]] = [[] for _ in range(replicas)]   # (start, end) per replica
    reasons: dict[str, int] = {}
    records: dict[str, dict] = {}
    where: dict[str, int] = {}

    def refresh(r: int) -> None:
        e, v = engines[r], views[r]
        pubs[r].flush()
        v.index.load(pubs[r].epoch, *pubs[r].snapshot()) if not v.index.synced else \
            [v.index.apply(q, p) for q, p in pubs[r].since(v.index.seq)]
        sch = e.scheduler
        v.running, v.waiting, v.kv_usage = len(sch.running), len(sch.waiting), e.manager.usage
        v.backlog = sum(len(q.req.prompt_token_ids) - q.req.num_computed_tokens for q in sch.sequences.values()
                        if q.req.num_computed_tokens < len(q.req.prompt_token_ids))
        v.sent_tokens = 0

    def start_step(r: int, t: float) -> None:
        e = engines[r]
        before = e.metrics.simulated_time_s
        updates = e.step()
        busy[r] = True
        end = t + (e.metrics.simulated_time_s - before)
        steps[r].append((t, end))
        push(end, "step", (r, updates))

    while events:
        t, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            s, k, history = payload
            if t >= duration_s:
                continue
            prompt = list(history if s.carry_history else s.prefix) + list(s.turns[k].text)
            rid = f"{s.session_id}-{k}"
            ph = PromptHashes(prompt)
            choice = router.choose(views, ph)
            r = choice.replica.rank
            choice.replica.prefilling.append(ph)
            reasons[choice.reason] = reasons.get(choice.reason, 0) + 1
            engines[r].add_request(rid, prompt, SamplingParams(max_tokens=s.turns[k].max_tokens,
                                                               seed=request_seed(seed, s.session_id, k)))
            records[rid] = {"arrival": t, "prompt": len(prompt), "cached": None, "first": None, "tokens": [],
                            "session": s, "turn": k, "prompt_ids": prompt, "hashes": ph}
            where[rid] = r
            refresh(r)
            if not busy[r]:
                start_step(r, t)
        else:
            r, updates = payload
            busy[r] = False
            for u in updates:
                rec = records[u.request_id]
                if (u.new_token_ids or u.finished) and rec["first"] is None:
                    rec["first"] = t
                    rec["cached"] = u.num_cached_tokens
                    views[r].prefilling.remove(rec["hashes"])
                rec["tokens"] += u.new_token_ids
                if u.finished:
                    rec["end"] = t
                    s, k = rec["session"], rec["turn"]
                    if u.finish_reason == "length" and k + 1 < len(s.turns):
                        push(t + s.turns[k + 1].think_s, "arrive", (s, k + 1, tuple(rec["prompt_ids"] + rec["tokens"])))
            refresh(r)
            if engines[r].has_work():
                start_step(r, t)
    done = [x for x in records.values() if "end" in x]
    gpu_s = sum(e.metrics.simulated_time_s for e in engines)
    ttft = [x["first"] - x["arrival"] for x in done]
    starts = [[a for a, _ in st] for st in steps]

    def next_step_end(r: int, t: float) -> float:
        i = bisect.bisect_left(starts[r], t)
        return steps[r][i][1] if i < len(steps[r]) else math.inf

    floor = [next_step_end(where[rid], x["arrival"]) - x["arrival"] for rid, x in records.items() if "end" in x]
    any_floor = [min(next_step_end(r, x["arrival"]) for r in range(replicas)) - x["arrival"] for x in done]
    return {"completed": len(done), "hit_rate": sum(x["cached"] or 0 for x in done) / sum(x["prompt"] for x in done),
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "tokens_per_gpu_s": sum(len(x["tokens"]) for x in done) / gpu_s,
            "per_replica": [sum(1 for rid in where if where[rid] == r) for r in range(replicas)],
            "preemptions": sum(e.scheduler.num_preemptions for e in engines), "reasons": reasons,
            "floor_p50": percentile(floor, 50), "any_floor_p50": percentile(any_floor, 50),
            "at_floor": sum(f == t for f, t in zip(floor, ttft)) / len(done)}


def run_seeds(args, knobs: dict, seeds: list[int], routers: list[str]) -> dict[str, dict]:
    """One run per seed and router, each printed as it ends; the means per router."""
    print(f"{args.workload} {knobs} on {args.replicas} x {args.model} ({args.gpu}), simulated time, seeds {seeds}")
    print(f"{'router':>16} {'seed':>4} {'done':>5} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/GPU-s':>10} "
          f"{'floor p50':>9} {'at floor':>8} {'any p50':>8} {'preempt':>8}  requests per replica, routing")
    results: dict[str, list[dict]] = {r: [] for r in routers}
    for seed in seeds:
        sessions = WORKLOADS[args.workload](seed=seed, **knobs)
        for name in routers:
            out = simulate(name, sessions, model=args.model, gpu=args.gpu, replicas=args.replicas,
                           kv_memory=int(args.kv_memory_gib * (1 << 30)), duration_s=args.duration, seed=seed)
            results[name].append(out)
            print(f"{name:>16} {seed:>4} {out['completed']:>5} {out['hit_rate']:>9.1%} {out['ttft_p50'] * 1e3:>8.0f}m "
                  f"{out['ttft_p99'] * 1e3:>8.0f}m {out['tokens_per_gpu_s']:>10.1f} {out['floor_p50'] * 1e3:>8.1f}m "
                  f"{out['at_floor']:>8.0%} {out['any_floor_p50'] * 1e3:>7.1f}m {out['preemptions']:>8}  "
                  f"{out['per_replica']}  {', '.join(f'{k} {v}' for k, v in sorted(out['reasons'].items()))}",
                  flush=True)
    means = {name: {key: sum(o[key] for o in outs) / len(outs)
                    for key in ("hit_rate", "ttft_p50", "ttft_p99", "tokens_per_gpu_s", "floor_p50", "at_floor",
                                "any_floor_p50")}
             for name, outs in results.items()}
    if len(seeds) > 1:
        print(f"\nmeans over {len(seeds)} seeds")
        for name, m in means.items():
            print(f"{name:>16}      {'':>5} {m['hit_rate']:>9.1%} {m['ttft_p50'] * 1e3:>8.0f}m "
                  f"{m['ttft_p99'] * 1e3:>8.0f}m {m['tokens_per_gpu_s']:>10.1f} {m['floor_p50'] * 1e3:>8.1f}m "
                  f"{m['at_floor']:>8.0%} {m['any_floor_p50'] * 1e3:>7.1f}m")
    return means


def plot_sweep(path: str, workload: str, counts: list[int], sweep: list[dict[str, dict]]) -> None:
    """TTFT p50 and p99 (log scale) and hit rate against the number of shared prefixes, one line per router."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name in sweep[0]:
        for ax, key, scale in zip(axes, ("ttft_p50", "ttft_p99", "hit_rate"), (1e3, 1e3, 100)):
            ax.plot(counts, [m[name][key] * scale for m in sweep], marker="o", label=name)
    for ax, title in zip(axes, ("TTFT p50, ms", "TTFT p99, ms", "prefix hit rate, %")):
        ax.set_title(title)
        ax.set_xlabel("system prompts" if workload == "chat" else "documents")
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{workload}: routers against the number of shared prefixes (simulated time, means over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def workload_knobs(args) -> dict:
    """The load test's knobs for ``args.workload`` (``ROUTER_WORKLOADS``), with those ``args`` sets instead."""
    knobs = dict(ROUTER_WORKLOADS.get(args.workload, {}))
    for k in ("popularity", "rate", "sessions"):
        if getattr(args, k, None) is not None:
            knobs[k] = getattr(args, k)
    return knobs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="chat")
    p.add_argument("--model", default="gemma-3-27b")
    p.add_argument("--gpu", default="H100-80GB")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--kv-memory-gib", type=float, default=6.0)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--shared-prefixes", default=None,
                   help="chat's system prompts or qa's documents; several (1,2,3,6) run one after the other")
    p.add_argument("--popularity", type=float, default=None)
    p.add_argument("--rate", type=float, default=None)
    p.add_argument("--sessions", type=int, default=None)
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--seeds", default="0", help="workload seeds, e.g. 0,1,2,3,4: one run each, then the means")
    p.add_argument("--plot", default=None, help="with several --shared-prefixes: write their means here (PNG)")
    args = p.parse_args(argv)
    knobs = workload_knobs(args)
    seeds = [int(x) for x in args.seeds.split(",")]
    routers = args.routers.split(",")
    unknown = sorted(set(routers) - set(ROUTERS))
    if unknown:
        p.error(f"--routers: unknown {', '.join(unknown)}; choose from {', '.join(ROUTERS)}")
    if args.shared_prefixes is None:
        run_seeds(args, knobs, seeds, routers)
        return 0
    try:
        counts = [int(x) for x in args.shared_prefixes.split(",")]
    except ValueError:
        p.error(f"--shared-prefixes: integers separated by commas, got {args.shared_prefixes!r}")
    if min(counts) < 1:
        p.error("--shared-prefixes: each must be >= 1")
    key = "system_prompts" if args.workload == "chat" else "documents"
    sweep = []
    for count in counts:
        sweep.append(run_seeds(args, {**knobs, key: count}, seeds, routers))
        print()
    if len(counts) > 1:
        print(f"{key:>16}  " + "  ".join(f"{name:>26}" for name in routers))
        print(f"{'':>16}  " + "  ".join(f"{'hit  p50  p99':>26}" for _ in routers))
        for count, m in zip(counts, sweep):
            print(f"{count:>16}  " + "  ".join(
                f"{m[name]['hit_rate']:>10.1%} {m[name]['ttft_p50'] * 1e3:>6.0f}m {m[name]['ttft_p99'] * 1e3:>6.0f}m"
                for name in routers))
        if args.plot:
            plot_sweep(args.plot, args.workload, counts, sweep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
