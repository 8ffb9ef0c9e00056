"""Do requests lose their prefix hit while they wait for admission? A diagnosis over ``bench/router_sim.py``.

For every request: the hit its replica's manager would grant at arrival (the manager's own rule, looked up
without side effects), the hit it got at its first admission, and, where the second is smaller, which
free-queue tier each block the arrival hit needed was evicted from. Also what the prefix router expected
(its KV-event index, and its bet on prompts still being prefilled there), and how the arrival hit
compares in pool units with the free part of the pool. Observation only: the real scheduler, manager
and routers run unchanged (their methods are wrapped to record, never to decide).

    python bench/waiting_hits.py --rate 8 --sessions 96 --seeds 0,1,2
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import router_sim  # noqa: E402

import cluster.routing.policies as router_mod  # noqa: E402
from cluster.loadtest.workloads import WORKLOADS  # noqa: E402
from cluster.engine.scheduler import Scheduler  # noqa: E402
from kvmanager.block_pool import BlockPool  # noqa: E402

evicted: dict = {}        # (pool, group, hash) -> the tier its last cached block was evicted from
arrival: dict = {}        # request id -> (hit tokens, prompt tokens, manager, router's view, units, free units)
admitted: dict = {}       # request id -> (arrival hit, admission hit, lost blocks by tier, free units, queue)
_last_choice: dict = {}


def tier_of(pool: BlockPool, block) -> str:
    b, fq = block.bin, pool.free
    if b is None:
        return "?"
    if b.batches is None:
        return ("0 empty", "1 unreachable", "2 speculative")[fq._tiers.index(b)]
    return ("3 chain" if b.batches is fq._chains else "3 proven") + (" (youngest-first)" if b.young else "")


def arrival_hit(mgr, req) -> int:
    """The hit the manager would grant now, without counting or learning."""
    return mgr.coordinator.hit_length(req, req.num_tokens - 1)


def hit_units(mgr, req, h: int) -> int:
    return sum(len(range(g.spec.first_needed_token(h) // g.block_size, h // g.block_size)) * g.width
               for g in mgr.coordinator.groups) if h else 0


def install() -> None:
    uncache, add, admit, choose = BlockPool.uncache, Scheduler.add, Scheduler._admit, router_mod.PrefixAware.choose

    def _uncache(self, block):
        evicted[(id(self), block.group, block.block_hash)] = tier_of(self, block)
        uncache(self, block)

    def _choose(self, replicas, prompt):
        c = choose(self, replicas, prompt)
        _last_choice["x"] = (c.hit_tokens, router_mod.prefix_hit(c.replica, prompt),
                             router_mod.prefilling_hit(c.replica, prompt))
        return c

    def _add(self, seq):
        add(self, seq)
        mgr, req = self.manager, seq.req
        h = arrival_hit(mgr, req)
        arrival[seq.request_id] = (h, req.num_tokens, mgr, _last_choice.pop("x", None), hit_units(mgr, req, h),
                                   mgr.num_free_blocks)

    def _admit(self, seq, budget, plan, preempt):
        first = seq.num_cached_tokens is None
        free_before = self.manager.num_free_blocks
        n = admit(self, seq, budget, plan, preempt)
        if n and first:
            a, _, mgr = arrival[seq.request_id][:3]
            h = seq.num_cached_tokens
            lost = collections.Counter()
            pool = mgr.pool
            for g in mgr.coordinator.groups if h < a else ():
                bs = g.block_size
                hashes = seq.req.block_hashes(bs, a // bs)
                for j in range(g.spec.first_needed_token(a) // bs, a // bs):
                    if not pool.is_cached(g.group_id, hashes[j]):
                        lost[evicted.get((id(pool), g.group_id, hashes[j]), "?")] += 1
            admitted[seq.request_id] = (a, h, lost, free_before, len(self.waiting))
        return n

    BlockPool.uncache, Scheduler.add, Scheduler._admit = _uncache, _add, _admit
    router_mod.PrefixAware.choose = _choose


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="chat")
    p.add_argument("--rate", type=float, default=None)
    p.add_argument("--sessions", type=int, default=None)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--routers", default="prefix,ray-prefix-tree")
    args = p.parse_args(argv)
    knobs = router_sim.workload_knobs(args)
    install()
    print(f"{args.workload} {knobs}, 3 x gemma-3-27b (H100-80GB, 6 GiB KV), seeds {args.seeds}")
    for name in args.routers.split(","):
        t = collections.Counter()
        lost_by_tier = collections.Counter()
        units, free, free_admit, queue = [], [], [], []
        for seed in (int(x) for x in args.seeds.split(",")):
            arrival.clear()
            admitted.clear()
            sessions = WORKLOADS[args.workload](seed=seed, **knobs)
            out = router_sim.simulate(name, sessions, model="gemma-3-27b", gpu="H100-80GB", replicas=3,
                                      kv_memory=6 << 30, duration_s=20.0, seed=seed)
            print(f"{name:>16} seed {seed}: hit rate {out['hit_rate']:.1%}, TTFT p50 {out['ttft_p50'] * 1e3:.0f} ms")
            for rid, (a, h, lost, fa, q) in admitted.items():
                free_admit.append(fa)
                queue.append(q)
                _, prompt, mgr, view, u, f = arrival[rid]
                t["n"] += 1
                t["prompt"] += prompt
                t["arrival"] += a
                t["admission"] += h
                t["lost_reqs"] += h < a
                t["gained_reqs"] += h > a
                t["lost"] += max(0, a - h)
                t["gained"] += max(0, h - a)
                if view is not None:
                    t["expected"] += view[0]
                    t["index"] += view[1]
                    t["prefilling_beyond_index"] += max(0, view[2] - view[1])
                    t["index_above_arrival"] += max(0, view[1] - a)
                lost_by_tier.update(lost)
                if a:
                    units.append(u)
                    free.append(f)
        P = t["prompt"]
        print(f"{name:>16}: {t['n']} requests admitted; hit at arrival {t['arrival'] / P:.1%} of prompt tokens, "
              f"at admission {t['admission'] / P:.1%}")
        print(f"{'':>16}  {t['lost_reqs']} requests lost hit tokens while queued ({t['lost'] / P:.1%} of prompt "
              f"tokens), {t['gained_reqs']} gained ({t['gained'] / P:.1%})")
        if t["expected"]:
            print(f"{'':>16}  router expected {t['expected'] / P:.1%}: its index {t['index'] / P:.1%} (above the "
                  f"arrival hit: {t['index_above_arrival'] / P:.1%}), prompts prefilling there beyond the index "
                  f"{t['prefilling_beyond_index'] / P:.1%}")
        total = sum(lost_by_tier.values())
        print(f"{'':>16}  blocks lost, by the tier they were evicted from: "
              + ", ".join(f"{k} {v / total:.0%}" for k, v in lost_by_tier.most_common()))
        print(f"{'':>16}  an arrival hit needs median {statistics.median(units):.0f} pool units; free units at "
              f"those arrivals (cached ones included): median {statistics.median(free):.0f} of "
              f"{mgr.num_blocks - 1}; at admissions median {statistics.median(free_admit):.0f}; requests still "
              f"queued behind an admitted one: median {statistics.median(queue):.0f}, max {max(queue)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
