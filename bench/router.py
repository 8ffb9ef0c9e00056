"""Router CPU per request for 32k-token prompts, side by side with what hashing the prompt costs.

Three replicas of gemma-3-27b's layout (52 sliding W=1024 + 10 full layers: two KV-cache groups of 16-token
blocks) whose managers computed 32k-token prompts; the router's indexes come from their KV events, and
each replica is prefilling a few more prompts. Requests: cold (no replica has any of it), a full hit (the
next turn of a cached prompt) and a half hit (a shared 16k prefix). For each:

- **decision**: ``PrefixAware.choose`` over the three replicas with the prompt's block hashes already
  computed (what each request costs the router on top of hashing);
- **hashing**: the chained block hashes the decision needs (all of a hit's blocks, one block of a cold
  prompt) -- computed once in the app and handed to the engine, which then skips them: not extra work;
- **engine**: a request hashing all its full blocks (as caching them after the prefill does) vs one
  given the router's hashes (what the engine saves; the request's construction and checks included);
- **ray-prefix-tree**: the text-prefix baseline's choice (Ray's PrefixTree match and insert).

    python bench/router.py            # about 20 s
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.engine.kv_events import EventPublisher  # noqa: E402
from cluster.routing.policies import PrefixAware, RayPrefixTree, Replica  # noqa: E402
from cluster.routing.prompt import PromptHashes  # noqa: E402
from kvmanager import KVCacheManager, Request  # noqa: E402
from kvmanager.coordinator import HitRule  # noqa: E402
from kvmanager.hashing import split_hashes  # noqa: E402
from kvmanager.planning import kv_layout  # noqa: E402
from workers.sim.presets import get_model_preset  # noqa: E402

TOKENS = 32768
REPEAT = 200


def us(samples: list[float]) -> str:
    qs = statistics.quantiles(samples, n=100)
    return f"{statistics.median(samples) * 1e6:8.1f} / {qs[98] * 1e6:8.1f}"


def main() -> int:
    rng = random.Random(0)
    layout = kv_layout(get_model_preset("gemma-3-27b").layer_specs(16), 1, 1)
    specs = layout.group_specs
    shared = [rng.randrange(1, 262000) for _ in range(TOKENS // 2)]
    cached_prompts, replicas = [], []
    for rank in range(3):
        mgr = KVCacheManager.from_layout(layout, num_blocks=400_000, max_model_len=1 << 20)
        pub = EventPublisher(specs, rank)
        pub.attach(mgr)
        for k in range(4):        # four 32k prompts each, the first half shared by replica 0's
            prompt = (shared if rank == 0 and k == 0 else [rng.randrange(1, 262000) for _ in range(TOKENS // 2)]) \
                + [rng.randrange(1, 262000) for _ in range(TOKENS // 2)]
            req = Request(f"r{k}", prompt)
            assert mgr.allocate_slots(req, TOKENS) is not None
            req.num_computed_tokens = TOKENS
            mgr.free(req)
            cached_prompts.append((rank, prompt))
        pub.flush()
        replica = Replica(rank, f"replica-{rank}", ready=True, rule=HitRule(specs))
        replica.index.load(pub.epoch, *pub.snapshot())
        for _ in range(4):        # requests it is prefilling now
            p = PromptHashes([rng.randrange(1, 262000) for _ in range(TOKENS)])
            p.upto(16, TOKENS)
            replica.prefilling.append(p)
        replicas.append(replica)
        cached = sum(len(g) for g in replica.index.groups)
        print(f"replica {rank}: {cached:,} cached block hashes in its index (both groups)")
    cases = {
        "cold": [rng.randrange(1, 262000) for _ in range(TOKENS)],
        "full hit": cached_prompts[5][1] + [7] * 16,                           # replica 1's, one more block
        "half hit": shared + [rng.randrange(1, 262000) for _ in range(TOKENS // 2)],   # replica 0's prefix
    }
    router, tree = PrefixAware(), RayPrefixTree()
    for rank, prompt in cached_prompts:       # the tree learns the same history
        tree.tree.add_tenants([replicas[rank].name], 0.0)
        tree.tree.insert(PromptHashes(prompt).text, replicas[rank].name, 0.0)
    print(f"\n{TOKENS:,}-token prompts, 3 replicas; microseconds per request, median / p99 of {REPEAT}")
    print(f"{'request':>9}  {'hit':>6}  {'decision':>17}  {'hashing':>17}  {'engine hashes all':>21}  "
          f"{'given hashes':>17}  {'ray-prefix-tree':>17}")
    for name, prompt in cases.items():
        decide, hashing, own, given, baseline = [], [], [], [], []
        for i in range(REPEAT):
            ph = PromptHashes(prompt)
            t0 = time.perf_counter()
            choice = router.choose(replicas, ph)          # hashes what it needs, lazily
            t1 = time.perf_counter()
            decide_cold = t1 - t0
            t0 = time.perf_counter()
            router.choose(replicas, ph)                   # again, the hashes now known: the decision alone
            decide.append(time.perf_counter() - t0)
            hashing.append(max(0.0, decide_cold - decide[-1]))
            for r in replicas:
                r.sent_tokens = 0
            t0 = time.perf_counter()
            Request(f"a{i}", prompt).block_hashes(16)          # the engine hashes every full block to cache it
            own.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            Request(f"b{i}", prompt, block_hashes=split_hashes(ph.for_engine())).block_hashes(16)
            given.append(time.perf_counter() - t0)
            if i < 20:
                t0 = time.perf_counter()
                tree.choose(replicas, PromptHashes(prompt))
                baseline.append(time.perf_counter() - t0)
        print(f"{name:>9}  {choice.hit_tokens:>6}  {us(decide)}  {us(hashing)}  {us(own):>21}  {us(given)}  "
              f"{us(baseline)}")
    print("\ndecision: the prefix router's choice with the prompt's hashes known; hashing: what computing the hashes "
          "it needed added (done once, handed to the engine); engine: a request hashing all its full blocks itself vs "
          "given the router's (construction and checks included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
