"""Routing among data-parallel replicas: the window-aware prefix router against a brute force over the
replicas' managers, its load rule, the other policies, and the prompt hashes it hands the engine.

Each replica is a real engine (scheduler + manager over a simulated worker) that served its own random
traffic; the router sees it only through its KV events. The brute force asks every manager what it
caches and applies BRIEF §2's hit rule over every length (``test_kv_properties.oracle_hit``).
"""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.engine.build import build_engine
from cluster.engine.kv_events import EventPublisher
from cluster.routing.replicas import ReplicaSet
from cluster.routing.host_cost import HostHitCost
from cluster.routing.policies import (LeastLoaded, PrefixAware, RayPrefixTree, Replica, RoundRobin, common_prefix_tokens,
                                     make_router, prefix_hit, tiered_hit)
from cluster.routing.prompt import PromptHashes
from cluster.engine.types import SamplingParams
from kvmanager import KVCacheManager, Request
from kvmanager.host_tier import HostRef
from kvmanager.coordinator import HitRule
from kvmanager.hashing import split_hashes
from workers.sim.cost_model import StepCostModel

from test_kv_events import LAYOUTS, SHARED, VOCAB, follow, make_engine
from test_kv_properties import oracle_hit


def replica_of(rank: int, engine) -> tuple[Replica, EventPublisher]:
    pub = EventPublisher(engine.manager.specs, rank)
    pub.attach(engine.manager)
    return Replica(rank, f"engine-{rank}", ready=True, rule=HitRule(engine.manager.specs),
                   step_tokens=engine.config.max_num_batched_tokens), pub


def brute_force_hit(manager, prompt: list[int]) -> int:
    """The largest hit BRIEF §2 allows on what ``manager`` caches (every length tried)."""
    req = Request("probe", prompt)
    cached = [{j for j, h in enumerate(req.block_hashes(s.block_size)) if h in manager.pool._cached[g]}
              for g, s in enumerate(manager.specs)]
    return oracle_hit(list(manager.specs), cached, len(prompt))


TRAFFIC = st.lists(st.tuples(st.integers(0, 2), st.integers(0, len(SHARED) - 1),
                             st.lists(st.integers(0, VOCAB - 1), max_size=24), st.integers(1, 10)), max_size=24)
PROBE = st.tuples(st.integers(0, len(SHARED)), st.lists(st.integers(0, VOCAB - 1), max_size=30))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(sorted(LAYOUTS)), num_blocks=st.integers(40, 160), traffic=TRAFFIC,
       probes=st.lists(PROBE, min_size=1, max_size=8))
def test_the_prefix_router_picks_the_replica_a_brute_force_over_the_managers_picks(layout, num_blocks, traffic,
                                                                                   probes):
    engines = [make_engine(layout, num_blocks) for _ in range(3)]
    replicas, pubs = zip(*(replica_of(i, e) for i, e in enumerate(engines)))
    served: list[list[int]] = []
    for n, (where, shared, text, max_tokens) in enumerate(traffic):   # each replica serves its own requests
        prompt = SHARED[shared] + text
        try:
            engines[where].add_request(f"t{n}", prompt, SamplingParams(max_tokens=max_tokens))
        except ValueError:
            continue
        while engines[where].has_work():
            for u in engines[where].step():
                if u.finished:
                    served.append(prompt)
    for r, pub in zip(replicas, pubs):
        pub.flush()
        follow(r.index, pub)
    router = PrefixAware()
    for shared, text in probes:
        prompt = (SHARED[shared] if shared < len(SHARED) else []) + text or [0]
        truth = [brute_force_hit(e.manager, prompt) for e in engines]
        for r, e in zip(replicas, engines):
            assert prefix_hit(r, PromptHashes(prompt)) == truth[r.rank] == e.manager.get_computed_blocks(
                Request("probe", prompt))[1]
        for r in replicas:      # each probe is a decision on idle replicas: no earlier probe's tokens
            r.sent_tokens = 0   # queued (they would move a short hit to a shorter wait, by design)
        choice = router.choose(list(replicas), PromptHashes(prompt))
        assert choice.hit_tokens == truth[choice.replica.rank] == max(truth)
        assert choice.reason == ("best-hit" if max(truth) else "least-loaded")


def hybrid_replicas(prompt: list[int], holders: tuple[int, ...]) -> list[Replica]:
    """Three idle gemma-3-like replicas; ``holders`` have computed ``prompt``."""
    replicas = []
    for rank in range(3):
        engine = make_engine("gemma-3", 200)
        replica, pub = replica_of(rank, engine)
        if rank in holders:
            engine.add_request("p", prompt, SamplingParams(max_tokens=1))
            while engine.has_work():
                engine.step()
        pub.flush()
        follow(replica.index, pub)
        replicas.append(replica)
    return replicas


PROMPT = SHARED[0] * 3          # 60 tokens: 15 blocks of 4


def test_the_estimated_time_to_first_token_counts_engine_steps():
    r = Replica(0, "e0", step_tokens=16)
    assert [r.wait_steps(u) for u in (0, 1, 16, 17, 62)] == [1, 1, 1, 2, 4]   # never less than one step
    r.backlog, r.sent_tokens = 30, 10            # reported backlog + uncached tokens sent since the report
    assert r.wait_tokens(2) == 42 and r.wait_steps(2) == 3
    r.running = 8                                # 8 decodes take 8 of each step's 16 tokens
    assert r.steps_for(60) == 8 and r.wait_steps(2) == 6
    r.running = 40                               # more running requests than budget: one token a step
    assert r.steps_for(5) == 5


def test_equal_hits_go_to_the_fewest_estimated_steps():
    replicas = hybrid_replicas(PROMPT, holders=(0, 2))   # budget 16 tokens a step
    ask = PromptHashes(PROMPT + [1, 1])            # 62 tokens: 60 cached on replicas 0 and 2, 2 to compute
    router = PrefixAware()
    replicas[0].backlog, replicas[2].backlog = 30, 10
    choice = router.choose(replicas, ask)          # steps to its first token: 2 (32 tokens), 4 (62), 1 (12)
    assert (choice.replica.rank, choice.hit_tokens, choice.reason) == (2, 60, "best-hit")
    assert replicas[2].sent_tokens == 2            # counted until its next report
    replicas[2].backlog, replicas[2].sent_tokens = 100, 0
    assert router.choose(replicas, ask).replica.rank == 0   # 2, 4, 7 steps: the other holder
    replicas[0].sent_tokens = 0
    replicas[0].backlog = 40                       # 3 steps (42 tokens) against 1 (12): a tie of steps is
    replicas[2].backlog = 10                       # broken by the pool, then round the ranks
    assert router.choose(replicas, ask).replica.rank == 2


@pytest.mark.parametrize("move_cost, stays_at, leaves_at", [(2.0, 190, 191), (1.0, 126, 127)])
def test_a_long_queue_gives_up_its_hit_when_the_estimated_wait_saved_exceeds_the_work_added(
        move_cost, stays_at, leaves_at):
    replicas = hybrid_replicas(PROMPT, holders=(1,))     # budget 16 tokens a step
    ask = PromptHashes(PROMPT + [1, 1])            # 62 tokens: 60 cached on replica 1 only
    router = PrefixAware(move_cost=move_cost)
    # a cold replica: 62 tokens, 4 steps. Moving adds the 60-token hit to the cluster's work: 4 steps,
    # times move_cost. The holder keeps the request while its wait is at most 4 + 4 x move_cost steps.
    replicas[1].backlog = stays_at                 # (stays_at + 2) / 16 -> 12 or 8 steps: stays
    choice = router.choose(replicas, ask)
    assert (choice.replica.rank, choice.hit_tokens, choice.reason) == (1, 60, "best-hit")
    replicas[1].sent_tokens = 0
    replicas[1].backlog = leaves_at                # one step more: it goes to a cold replica (the two tie;
    choice = router.choose(replicas, ask)          # round the ranks after replica 1: replica 2)
    assert (choice.replica.rank, choice.hit_tokens, choice.reason) == (2, 0, "shorter-wait")
    assert choice.replica.sent_tokens == 62


def test_running_decodes_slow_the_cold_replicas_and_a_waiting_queue_keeps_the_hit():
    replicas = hybrid_replicas(PROMPT, holders=(1,))
    ask = PromptHashes(PROMPT + [1, 1])
    router = PrefixAware()
    replicas[1].backlog = 360                      # 23 steps to its first token on the holder
    replicas[0].running = replicas[2].running = 8  # 8 tokens a step left for prefill: 62 tokens, 8 steps;
    choice = router.choose(replicas, ask)          # the move adds 60 tokens, 8 steps: 23 - 8 <= 2 x 8
    assert (choice.replica.rank, choice.reason) == (1, "best-hit")
    replicas[1].sent_tokens = 0
    replicas[0].running = replicas[2].running = 0  # now 4 steps, and 23 - 4 > 2 x 4: it would move, but a
    replicas[1].waiting = 1                        # request waits for admission there (KV room, a batch
    choice = router.choose(replicas, ask)          # slot): its backlog does not say when it starts
    assert (choice.replica.rank, choice.reason) == (1, "best-hit")


def test_an_overloaded_holder_passes_a_request_on_only_where_it_loses_at_most_four_steps_of_hit():
    replicas = hybrid_replicas(PROMPT, holders=(0, 2))
    ask = PromptHashes(PROMPT + [1, 1])
    router = PrefixAware(slack=4)
    replicas[0].waiting, replicas[2].waiting, replicas[1].waiting = 3, 5, 0
    assert router.choose(replicas, ask).replica.rank == 0   # 3 waiting more than replica 1: within the slack
    replicas[0].waiting = 4
    # both holders have 4 or more requests waiting for admission than replica 1: overloaded. Replica 1
    # has none of the 60-token hit, and 60 tokens are within four of its 16-token steps: it takes it
    choice = router.choose(replicas, ask)
    assert (choice.replica.rank, choice.hit_tokens, choice.reason) == (1, 0, "overloaded")
    # a hit longer than four steps' prefill stays with its holder, however long the queue there: moving
    # it would cost the cluster its whole prefill again
    longer = SHARED[0] * 4                          # 80 tokens, 5 steps of 16
    replicas = hybrid_replicas(longer, holders=(0,))
    replicas[0].waiting = 9
    choice = router.choose(replicas, PromptHashes(longer + [1, 1]))
    assert (choice.replica.rank, choice.hit_tokens, choice.reason) == (0, 80, "best-hit")


def test_an_overloaded_holder_draws_two_of_the_replicas_it_may_escape_to_and_takes_the_shorter_estimate():
    replicas = hybrid_replicas(PROMPT, holders=(0,)) + hybrid_replicas(PROMPT, holders=())[:1]
    for rank, r in enumerate(replicas):
        r.rank, r.name = rank, f"engine-{rank}"
    replicas[0].waiting = 6                        # replicas 1, 2 and 3 are cold, with nothing waiting
    replicas[1].backlog, replicas[2].backlog, replicas[3].backlog = 0, 100, 200   # 4, 11 and 17 steps
    picks = []
    for _ in range(60):
        choice = PrefixAware(slack=4, seed=len(picks)).choose(replicas, PromptHashes(PROMPT + [1]))
        assert choice.reason == "overloaded"
        picks.append(choice.replica.rank)
        for r in replicas:
            r.sent_tokens = 0
    # the least work of two drawn from three: replica 1 whenever drawn (2 pairs of 3), else replica 2;
    # replica 3 never, as it loses every pair
    assert set(picks) == {1, 2}
    assert picks.count(1) > picks.count(2)


def test_a_holder_whose_kv_pool_is_nearly_full_passes_a_request_to_a_replica_with_room():
    replicas = hybrid_replicas(PROMPT, holders=(0,))
    ask = PromptHashes(PROMPT + [1, 1])
    router = PrefixAware(kv_full=0.8, kv_roomy=0.5)
    replicas[0].kv_usage, replicas[1].kv_usage, replicas[2].kv_usage = 0.85, 0.55, 0.6
    assert router.choose(replicas, ask).replica.rank == 0      # nobody has room: it keeps its 60-token hit
    replicas[2].kv_usage = 0.3
    choice = router.choose(replicas, ask)                       # replica 2 has room, and 60 tokens are
    assert (choice.replica.rank, choice.hit_tokens, choice.reason) == (2, 0, "kv-full")   # within 8 steps
    replicas[0].kv_usage = 0.79                                 # below kv_full: the hit wins again
    assert router.choose(replicas, ask).replica.rank == 0
    # a hit longer than eight 16-token steps stays on the full pool: the move would cost more than its room
    longer = SHARED[0] * 7                                      # 140 tokens
    replicas = hybrid_replicas(longer, holders=(0,))
    replicas[0].kv_usage, replicas[1].kv_usage = 0.95, 0.1
    choice = router.choose(replicas, PromptHashes(longer + [1]))
    assert (choice.replica.rank, choice.hit_tokens, choice.reason) == (0, 140, "best-hit")


def test_a_burst_for_one_new_prefix_goes_where_it_is_being_prefilled():
    replicas = hybrid_replicas(PROMPT, holders=())
    router = PrefixAware()
    doc = [1, 2, 3, 0] * 40                         # 160 tokens no replica has
    first = router.choose(replicas, PromptHashes(doc + [1]))
    assert (first.hit_tokens, first.reason) == (0, "least-loaded")
    first.replica.prefilling.append(PromptHashes(doc + [1]))
    second = router.choose(replicas, PromptHashes(doc + [2, 2, 2, 2, 2]))
    assert (second.replica, second.hit_tokens, second.reason) == (first.replica, 160, "best-hit")
    assert common_prefix_tokens(PromptHashes(doc + [1] * 7), PromptHashes(doc + [2] * 9), 4) == 160
    assert common_prefix_tokens(PromptHashes(doc[:37]), PromptHashes(doc), 4) == 36       # whole blocks only
    assert common_prefix_tokens(PromptHashes([3] + doc), PromptHashes(doc), 4) == 0


def test_a_cold_prompt_goes_to_the_least_work_and_a_sliding_hit_needs_only_the_window():
    replicas = hybrid_replicas(PROMPT, holders=(1,))
    router = PrefixAware()
    replicas[0].backlog, replicas[1].backlog, replicas[2].backlog = 500, 0, 100
    cold = router.choose(replicas, PromptHashes([3, 3, 3] * 10))   # 34, 2 and 9 steps of 16 tokens
    assert (cold.replica.rank, cold.hit_tokens, cold.reason) == (1, 0, "least-loaded")
    # a sliding-only layout (Mistral-like, W 12, blocks of 4): a replica that lost the prompt's first blocks
    # still grants the hit, which only needs the last ceil(11/4) = 3 blocks before it
    engine = make_engine("mistral", 200)
    replica, pub = replica_of(0, engine)
    engine.add_request("p", PROMPT, SamplingParams(max_tokens=1))
    while engine.has_work():
        engine.step()
    req = Request("x", PROMPT)
    for h in req.block_hashes(4)[:10]:           # evict blocks 0..9 by hand, as reuse would
        for block in list(engine.manager.pool._cached[0].get(h, {}).values()):
            engine.manager.pool.uncache(block)
    pub.flush()
    follow(replica.index, pub)
    ask = PromptHashes(PROMPT + [0])
    assert prefix_hit(replica, ask) == 60 == engine.manager.get_computed_blocks(Request("y", PROMPT + [0]))[1]


def test_round_robin_and_least_loaded():
    replicas = [Replica(r, f"e{r}", ready=True) for r in range(3)]
    rr = RoundRobin()
    assert [rr.choose(replicas, PromptHashes([1])).replica.rank for _ in range(4)] == [0, 1, 2, 0]
    assert rr.choose([replicas[0], replicas[2]], PromptHashes([1])).replica.rank == 2   # 1 is not ready
    ll = LeastLoaded()
    replicas[0].running, replicas[1].waiting, replicas[2].in_flight = 2, 1, 3
    assert ll.choose(replicas, PromptHashes([1])).replica.rank == 1
    replicas[1].waiting = 2                       # 0 and 1 tie at 2: the ranks take turns
    assert [ll.choose(replicas, PromptHashes([1])).replica.rank for _ in range(3)] == [0, 1, 0]


def test_the_ray_prefix_tree_baseline_follows_text_prefixes():
    replicas = [Replica(r, f"e{r}", ready=True) for r in range(3)]
    tree = RayPrefixTree(seed=1)
    first = tree.choose(replicas, PromptHashes(PROMPT))
    assert first.reason == "tree-smallest"
    other = tree.choose(replicas, PromptHashes([3] * 40))          # no match: a replica holding less text
    assert other.reason == "tree-smallest" and other.replica is not first.replica
    again = tree.choose(replicas, PromptHashes(PROMPT + [1, 2]))   # 60 of 62 characters match
    assert (again.reason, again.replica) == ("tree-match", first.replica)
    tree.replica_down(first.replica)
    moved = tree.choose([r for r in replicas if r is not first.replica], PromptHashes(PROMPT + [1, 2]))
    assert moved.replica is not first.replica


def test_prompt_hashes_are_the_engines_own_and_travel_to_it():
    prompt = [2, 1, 2, 3] * 9 + [3]               # 37 tokens
    ph = PromptHashes(prompt)
    assert ph.upto(4, 3) == Request("a", prompt).block_hashes(4)[:3]
    assert ph.upto(4, 100) == Request("a", prompt).block_hashes(4)      # capped at the 9 full blocks
    assert split_hashes(ph.for_engine()) == {4: Request("a", prompt).block_hashes(4)}
    engine = make_engine("gpt-oss", 100)
    engine.add_request("given", prompt, SamplingParams(max_tokens=1), block_hashes=split_hashes(ph.for_engine()))
    assert engine.scheduler.sequences["given"].req.block_hashes(4) == Request("a", prompt).block_hashes(4)
    with pytest.raises(ValueError, match="block_hashes must map block sizes"):
        engine.add_request("bad", prompt, block_hashes={4: [b"x" * 31]})
    assert "bad" not in engine.scheduler.sequences


def test_unknown_router_names_are_refused():
    assert [make_router(n).name for n in ("round-robin", "least-loaded", "prefix", "ray-prefix-tree")] == \
        ["round-robin", "least-loaded", "prefix", "ray-prefix-tree"]
    with pytest.raises(ValueError, match="router must be one of round-robin, least-loaded, prefix, ray-prefix-tree"):
        make_router("random")
    assert math.isinf(RayPrefixTree().imbalanced_threshold)        # Ray's default: load only breaks ties


def test_a_replica_that_restarted_between_two_polls_counts_as_down_and_the_router_forgets_it():
    """No call to it failed (the kill fell between two polls), but its next reply is a snapshot of a new
    epoch: the app counts it down once and the router drops what it knew of it, as after a failed call."""
    specs, _ = LAYOUTS["llama-4"]
    router = RayPrefixTree()
    replicas = ReplicaSet(["r0", "r1"], "ns", router)
    r0 = replicas.replicas[0]
    load = {"status": "ready", "running": 0, "waiting": 0, "kv_usage": 0.0, "prefill_backlog": 0}
    first, restarted = EventPublisher(specs), EventPublisher(specs)
    replicas._apply(r0, {"epoch": first.epoch, "load": load, "snapshot": first.snapshot()})
    replicas._apply(r0, {"epoch": first.epoch, "load": load, "batches": []})   # same incarnation: nothing
    assert (r0.ready, replicas.downs["r0"]) == (True, 0)
    router.choose([r0], PromptHashes(list(range(1, 9))))          # the tree learns r0's text
    assert "r0" in router.tree.tenant_to_char_count

    replicas._apply(r0, {"epoch": restarted.epoch, "load": load, "snapshot": restarted.snapshot()})
    assert replicas.downs["r0"] == 1
    assert "r0" not in router.tree.tenant_to_char_count
    assert (r0.ready, r0.index.epoch, r0.index.snapshots) == (True, restarted.epoch, 2)

    r0.index.forget()      # a gap (missed batches) in the same incarnation: a snapshot, not a restart
    replicas._apply(r0, {"epoch": restarted.epoch, "load": load, "snapshot": restarted.snapshot()})
    assert replicas.downs["r0"] == 1


# -- the host tier: hits over device and host, counted at a discount ----------------------------------------
def host_replica(rank: int, computed: list[list[int]], evict: bool, num_blocks: int = 121, host: int = 200):
    """A gemma-3-like replica (sliding W 16 + full, blocks of 4, widths 5 and 1) with a host tier, driven
    through its manager: each prompt in ``computed`` is prefilled and finished (its stores fenced); with
    ``evict``, a request of other tokens then takes every device unit and is preempted, so what those
    prompts left is on host only."""
    specs, widths = LAYOUTS["gemma-3"]
    mgr = KVCacheManager(specs, num_blocks, max_model_len=400, widths=widths, num_host_blocks=host)
    replica, pub = Replica(rank, f"engine-{rank}", ready=True, rule=HitRule(specs)), EventPublisher(specs, rank)
    pub.attach(mgr)
    for i, prompt in enumerate(computed):
        req = Request(f"c{i}", prompt)
        assert mgr.allocate_slots(req, len(prompt)) is not None
        req.num_computed_tokens = len(prompt)
        mgr.free(req)
        mgr.transfers_done([d for _, d, _ in mgr.take_transfers().stores])
    if evict:
        filler = Request("filler", [3] * (4 * ((num_blocks - 1) // 6)))   # 6 units a block of 4 tokens: all
        assert mgr.allocate_slots(filler, filler.num_tokens) is not None
        mgr.preempt(filler)
    pub.flush()
    follow(replica.index, pub)
    return replica, mgr, pub


def manager_hit(mgr, prompt: list[int]) -> tuple[int, int, list[int]]:
    """The manager's own answer: (device hit, hit over both tiers, per group the blocks it would load)."""
    req = Request("probe", prompt)
    device = mgr.coordinator.find_hit(req, req.num_tokens - 1)[1]
    hit, both = mgr.get_computed_blocks(req)
    return device, both, [sum(type(b) is HostRef for b in blocks) for blocks in hit]


def test_a_replica_that_holds_a_prompt_on_host_only_offers_the_hit_its_manager_would_load():
    replica, mgr, _ = host_replica(0, [PROMPT], evict=True)
    ask = PromptHashes(PROMPT + [1, 1])
    assert prefix_hit(replica, ask) == 0                          # nothing left on the device
    # over both tiers: the 60-token hit; it loads the sliding group's last window below token 60 (tokens
    # 45.., blocks 11-14: 4 blocks) and every full-attention block (15)
    assert tiered_hit(replica, ask) == (0, 60, [4, 15]) == manager_hit(mgr, PROMPT + [1, 1])
    assert PrefixAware().hit(replica, ask) == 0                   # without a host cost: the device only


def test_a_host_hit_counts_less_the_time_its_load_takes_in_prefill_tokens():
    # block bytes 5 and 1 (the widths: 1-byte units), a link of 35 B/s, prefill 1/15 s a token: a 60-token
    # hit from host loads 4 x 5 + 15 x 1 = 35 B in 1 s, against 4 s to recompute: it counts 60 x 3/4 = 45
    calls = []

    def prefill_s(start, n):
        calls.append((start, n))
        return n / 15

    host = host_replica(0, [PROMPT], evict=True)[0]
    device = host_replica(1, [PROMPT[:40]], evict=False)[0]       # 40 tokens of it on the device
    cold = host_replica(2, [], evict=False)[0]
    replicas = [host, device, cold]
    ask = PromptHashes(PROMPT + [1, 1])
    assert [prefix_hit(r, ask) for r in replicas] == [0, 40, 0]
    fast = PrefixAware(host_cost=HostHitCost((5, 1), 35.0, prefill_s))
    assert fast.hit(host, ask) == 45 and calls == [(0, 60)]
    choice = fast.choose(replicas, ask)
    assert (choice.replica.rank, choice.hit_tokens, choice.reason) == (0, 45, "best-hit")
    # a link half as fast: 2 s of 4, the hit counts 30 < 40: the replica holding 40 tokens on device wins
    slow = PrefixAware(host_cost=HostHitCost((5, 1), 17.5, prefill_s))
    assert slow.hit(host, ask) == 30
    assert slow.choose(replicas, ask).replica.rank == 1
    # a load slower than recomputing counts nothing
    assert PrefixAware(host_cost=HostHitCost((5, 1), 8.75, prefill_s)).hit(host, ask) == 0
    # without the host cost the router ignores host tiers: the device's 40 tokens win
    assert PrefixAware().choose(replicas, ask).replica.rank == 1


def test_a_hit_that_starts_on_the_device_and_ends_on_host_loads_only_what_the_device_lacks():
    # the whole prompt went to host; then the device lost all but a shorter prompt's first 40 tokens
    replica, mgr, pub = host_replica(0, [PROMPT], evict=True)
    req = Request("again", PROMPT[:40] + [0, 0, 0, 0])            # recompute the first 40 tokens on device
    hit, h = mgr.get_computed_blocks(req)
    assert h == 40
    assert mgr.allocate_slots(req, 0, h, hit) is not None         # loaded from host: full blocks 0-9, sliding 6-9
    mgr.transfers_done([d for _, _, d in mgr.take_transfers().loads])
    mgr.preempt(req)
    pub.flush()
    follow(replica.index, pub)
    ask = PromptHashes(PROMPT + [1, 1])
    # device: blocks 0-9 of the full group, 6-9 of the sliding one: a 40-token hit. Both tiers: 60; the
    # load is full blocks 10-14 (5) and the sliding window's blocks 11-14 (4), whatever the device holds
    assert tiered_hit(replica, ask) == (40, 60, [4, 5]) == manager_hit(mgr, PROMPT + [1, 1])
    calls = []
    cost = HostHitCost((5, 1), 25.0, lambda start, n: calls.append((start, n)) or n / 10)
    # 25 B in 1 s against 20 tokens in 2 s: 40 + 20 x 1/2
    assert PrefixAware(host_cost=cost).hit(replica, ask) == 50 and calls == [(40, 20)]


def test_the_deployments_host_cost_uses_the_hand_derived_bytes_and_the_step_cost_model():
    cost = HostHitCost.for_deployment("gemma-3-27b", "H100-80GB")
    # 52 sliding layers in 26 units of 2, 10 full in 5; a unit is 2 layers x 16 tokens x 8,192 B
    assert cost.block_bytes == (26 * 262_144, 5 * 262_144) == (6_815_744, 1_310_720)
    assert cost.link_bytes_per_s == 64e9 * 0.86                   # PCIe Gen5 x16, one way, at 86%
    # an 8k hit from host: 64 sliding blocks + 512 full ones = 1,107,296,256 B (docs/performance.md)
    assert cost.load_s([64, 512]) == 1_107_296_256 / (64e9 * 0.86)
    assert cost.prefill_s(0, 8192) == StepCostModel("gemma-3-27b", "H100-80GB").step([(0, 8192)]).time_s
    oss = HostHitCost.for_deployment("gpt-oss-20b", "A100-80GB", tensor_parallel_size=2)
    assert oss.block_bytes == (196_608, 196_608) and oss.link_bytes_per_s == 32e9 * 0.86   # 12 x 16 x 1,024 B
    with pytest.raises(ValueError, match="link_bytes_per_s must be > 0"):
        HostHitCost((1,), 0, lambda s, n: 1.0)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(sorted(LAYOUTS)), num_blocks=st.integers(30, 120), host=st.integers(8, 80),
       traffic=st.lists(st.tuples(st.integers(0, len(SHARED)), st.lists(st.integers(0, VOCAB - 1), max_size=24),
                                  st.booleans()), max_size=16),
       probes=st.lists(PROBE, min_size=1, max_size=6))
def test_over_both_tiers_the_router_finds_the_hit_and_the_loads_the_replicas_manager_would(layout, num_blocks, host,
                                                                                          traffic, probes):
    specs, widths = LAYOUTS[layout]
    mgr = KVCacheManager(specs, num_blocks, max_model_len=200, widths=widths, num_host_blocks=host * max(widths))
    replica, pub = Replica(0, "engine-0", ready=True, rule=HitRule(specs)), EventPublisher(specs)
    pub.attach(mgr)
    for n, (shared, text, preempt) in enumerate(traffic):     # one request at a time, its copies fenced
        req = Request(f"t{n}", (SHARED[shared] if shared < len(SHARED) else []) + text + [n % VOCAB])
        hit, h = mgr.get_computed_blocks(req)
        if any(type(b) is HostRef for g in hit for b in g):
            if mgr.allocate_slots(req, 0, h, hit) is None:
                continue
            mgr.transfers_done([d for _, _, d in mgr.take_transfers().loads])
            req.num_computed_tokens, h, hit = h, 0, None
        if mgr.allocate_slots(req, req.num_tokens - req.num_computed_tokens - h, h, hit) is None:
            if mgr.is_loading(req.request_id) or req.num_computed_tokens:
                mgr.preempt(req)
            continue
        req.num_computed_tokens = req.num_tokens
        (mgr.preempt if preempt else mgr.free)(req)
        mgr.transfers_done([d for _, d, _ in mgr.take_transfers().stores])
    pub.flush()
    follow(replica.index, pub)
    for shared, text in probes:
        prompt = (SHARED[shared] if shared < len(SHARED) else []) + text or [0]
        assert tiered_hit(replica, PromptHashes(prompt)) == manager_hit(mgr, prompt)


def test_a_served_prefix_router_learns_the_host_tiers_worth_from_the_replicas_model_info():
    """The app's routers are made before any engine answers; the first replica's ``ready()`` info tells the
    prefix router the host tier's discount (gemma-3-27b on H100s: an 8k hit on host only is worth 7,838
    device tokens, docs/design.md), and nothing without a tier or on real workers."""
    _, tiered = build_engine("gemma-3-27b", simulated_gpu="H100-80GB", kv_cache_memory=1 << 30,
                             kv_host_memory=8 << 30)
    router = make_router("prefix")
    replicas = ReplicaSet(["r0", "r1"], "ns", router)
    replicas._learn(replicas.replicas[0], tiered)
    assert router.host_cost.block_bytes == (6_815_744, 1_310_720)
    assert router.host_cost.worth(0, 8192, [64, 512]) == 7838
    _, plain = build_engine("gemma-3-27b", simulated_gpu="H100-80GB", kv_cache_memory=1 << 30)
    _, real = build_engine("tiny-llama", block_size=4, num_blocks=40, num_host_blocks=8)
    for info in (plain, real):
        untiered = make_router("prefix")
        ReplicaSet(["r0"], "ns", untiered)._learn(Replica(0, "r0"), info)
        assert untiered.host_cost is None
    unpriced = make_router("prefix")        # a model the cost model cannot price: device hits, not a failure
    ReplicaSet(["r0"], "ns", unpriced)._learn(Replica(0, "r0"), {**tiered, "model_path": "no-such-model"})
    assert unpriced.host_cost is None
    given = HostHitCost((1, 1), 1.0, lambda start, n: 1.0)
    kept = PrefixAware(host_cost=given)
    ReplicaSet(["r0"], "ns", kept)._learn(Replica(0, "r0"), tiered)
    assert kept.host_cost is given
