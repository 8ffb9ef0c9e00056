"""Which engine replica takes a request: round-robin, least-loaded, window-aware prefix, or Ray's prefix tree.

The ``prefix`` router scores each replica by the prefix hit its manager would grant: the longest hit
valid for every KV-cache group under that group's own window rule, found by the manager's own code
(``AttentionSpec.longest_hit`` per group, ``HitRule`` for the length all groups agree on) run on the
hashes the replica's KV events say it caches (``kv_events.KVIndex``). A sliding group needs only the last
window's blocks cached, so a replica that has evicted the start of a long prompt can still offer a hit
a text-prefix router would never see; and a replica whose window blocks were evicted offers no phantom
hit. It takes the best hit unless the estimated time to first token (prefill queued there plus the
request's own uncached tokens, in engine steps) says another replica saves more than twice the work the
move adds, or the holder is overloaded (requests wait there for admission while another replica has
fewer waiting) or its KV pool is nearly full while another's has room, in which case it takes the one
with the shorter estimate of two random replicas (power of two choices) among those that are neither and
whose hit is short of the best by at most a few steps' prefill.

With a host tier (``--kv-host-memory``), a replica's events also announce what its host memory holds
(medium "CPU"); given the deployment's ``HostHitCost``, the router counts a hit that reaches further over
device and host at a discount: the tokens past the device's hit count less the time their load would take,
in prefill tokens (``host_cost``: the formula).

A prompt's block hashes are computed lazily and once (``PromptHashes``): the scoring of every replica
shares them, and the chosen engine receives them with the request instead of hashing the prompt again.
A cold prompt costs one hash per replica-visible miss; a prompt that hits ``k`` blocks on some replica
costs ``k + 1`` hashes, which the engine would compute anyway to look it up.

``ray-prefix-tree`` is the baseline: Ray Serve LLM's ``PrefixCacheAffinityRouter`` decision, with its
defaults (route by the longest text-prefix match; below a 10% match, to the replicas holding the least
text; load only breaks ties, as its imbalance threshold defaults to infinity), over Ray's own
``PrefixTree``, fed one character per token id (exact token prefixes).
"""
from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from itertools import islice, takewhile

from kvmanager.coordinator import HitRule

from .host_cost import HostHitCost
from .kv_index import KVIndex
from .prompt import PromptHashes

ROUTERS = ("round-robin", "least-loaded", "prefix", "ray-prefix-tree")
logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Replica:
    """What the router knows of one engine replica."""

    rank: int
    name: str
    ready: bool = False
    index: KVIndex = field(default_factory=KVIndex)
    rule: HitRule | None = None          # its groups' hit rule, once its layout is known
    running: int = 0                     # as it last reported
    waiting: int = 0
    kv_usage: float = 0.0
    backlog: int = 0                     # prompt tokens it has yet to compute, as it last reported
    in_flight: int = 0                   # requests this app routed to it that have not ended
    sent_tokens: int = 0                 # uncached prompt tokens this app sent it since its last report
    prefilling: list = field(default_factory=list)   # prompts routed here whose first token has not come
    step_tokens: int = 512               # its scheduler's token budget per step (max_num_batched_tokens)

    @property
    def load(self) -> int:
        """Queue length: the replica's running + waiting, or what this app sent it if more (not reported yet)."""
        return max(self.running + self.waiting, self.in_flight)

    def wait_tokens(self, uncached: int) -> int:
        """Prompt tokens to compute on this replica before a request's first token: the backlog ahead of it
        (the scheduler gives running requests' chunks the step's budget first, in admission order, so a
        new request's prefill starts after theirs) and its own uncached tokens."""
        return self.backlog + self.sent_tokens + uncached

    def steps_for(self, tokens: int) -> int:
        """Engine steps this replica needs to prefill ``tokens``: a step's token budget less one token for
        each running request (its decode, or its next chunk, goes first)."""
        return -(-tokens // max(1, self.step_tokens - self.running))

    def wait_steps(self, uncached: int) -> int:
        """Estimated time to a request's first token if it came here now, in engine steps: the prefill
        ahead of it and its own (``wait_tokens``), never less than one step. Steps, not tokens: two
        replicas that both answer within the next step are equally fast, whichever has a few more tokens
        queued. The same for every replica of one deployment (same model, same GPUs), so steps compare."""
        return max(1, self.steps_for(self.wait_tokens(uncached)))


def prefix_hit(replica: Replica, prompt: PromptHashes) -> int:
    """The hit (tokens) ``replica``'s manager would grant ``prompt`` now from its device pool, by its own
    rules, on the hashes its events say it caches; 0 when its cache is not known. The manager looks up all
    but the last token."""
    return _longest_hit(replica, prompt, replica.index.cached)


class _Either:
    """A group's hashes on the device or on host, as the manager's lookup over both tiers sees them."""

    __slots__ = ("device", "host")

    def __init__(self, device, host):
        self.device, self.host = device, host

    def __contains__(self, block_hash) -> bool:
        return block_hash in self.device or block_hash in self.host

    def issuperset(self, hashes) -> bool:
        return all(h in self.device or h in self.host for h in hashes)


def tiered_hit(replica: Replica, prompt: PromptHashes) -> tuple[int, int, list[int]]:
    """(device hit, hit over device and host tier, per group the blocks that hit would load from host:
    those it needs, under the group's window rule, found on host only)."""
    device = prefix_hit(replica, prompt)
    index = replica.index
    if not any(index.host) or replica.rule is None:
        return device, device, [0] * len(replica.rule.specs if replica.rule else ())
    both = _longest_hit(replica, prompt, lambda g: _Either(index.cached(g), index.on_host(g)))
    loads = []
    for g, spec in enumerate(replica.rule.specs):
        bs, cached = spec.block_size, index.cached(g)
        chain = prompt.upto(bs, both // bs)
        loads.append(sum(1 for h in chain[spec.first_needed_token(both) // bs:both // bs] if h not in cached))
    return device, both, loads


def _longest_hit(replica: Replica, prompt: PromptHashes, cached_of) -> int:
    rule, index = replica.rule, replica.index
    if rule is None or not index.synced or prompt.num_tokens < 2:
        return 0
    searches = []
    for g, spec in enumerate(rule.specs):
        cached = cached_of(g)
        bs = spec.block_size

        def first_miss(start: int, stop: int, cached=cached, bs=bs) -> int:
            """First block in [start, stop) not cached; hashes lazily, doubling, at C speed per stretch
            (a whole stretch cached, the common case of a hit, is one ``issuperset``)."""
            i = start
            while i < stop:
                chain = prompt.upto(bs, min(stop, 2 * i + 1))
                end = min(stop, len(chain))
                if not cached.issuperset(islice(chain, i, end)):
                    return i + len(list(takewhile(cached.__contains__, islice(chain, i, end))))
                i = end
            return stop

        searches.append(lambda bound, spec=spec, bs=bs, f=first_miss: spec.longest_hit(None, bound // bs, f) * bs)
    return rule.longest(searches, prompt.num_tokens - 1)


def common_prefix_tokens(a: PromptHashes, b: PromptHashes, block_size: int) -> int:
    """Tokens of the longest common prefix of whole blocks: a chained hash equal at block ``i`` means
    blocks ``0 .. i`` are equal, so a binary search over the chains finds it in O(log n) comparisons."""
    n = min(a.num_tokens, b.num_tokens) // block_size
    if n == 0 or a.upto(block_size, 1)[0] != b.upto(block_size, 1)[0]:
        return 0             # the common case, decided without hashing further
    ha, hb = a.upto(block_size, n), b.upto(block_size, n)
    lo, hi = 1, n            # blocks [0, lo) are equal; block hi - 1 is known to differ if hi < n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ha[mid - 1] == hb[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo * block_size


def prefilling_hit(replica: Replica, prompt: PromptHashes) -> int:
    """The hit a prompt can expect from the requests routed to ``replica`` that are still being prefilled:
    their blocks are cached step by step as it computes them, so a request sharing their prefix that is
    admitted meanwhile or after reuses them (whether they stay depends on later evictions)."""
    rule = replica.rule
    if rule is None or not replica.prefilling:
        return 0
    bs = rule.specs[0].block_size
    best = max(common_prefix_tokens(prompt, other, bs) for other in replica.prefilling)
    return min(best, prompt.num_tokens - 1) // rule.alignment * rule.alignment


@dataclass
class Choice:
    replica: Replica
    hit_tokens: int = 0          # what the prefix router expects the replica to find cached
    reason: str = ""             # best-hit, shorter-wait, overloaded, kv-full, least-loaded, round-robin, tree-match,
                                 # tree-smallest


class Router:
    """A policy: ``choose`` among the ready replicas (never an empty list)."""

    name = "abstract"

    def choose(self, replicas: list[Replica], prompt: PromptHashes) -> Choice:
        raise NotImplementedError

    def replica_down(self, replica: Replica) -> None:
        """The replica died or left: forget what is known of it."""

    def replica_up(self, replica: Replica) -> None:
        """The replica is (again) ready."""

    def learn_model(self, info) -> None:
        """A replica's model info (``ready()``), as each replica is first reached."""


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self):
        self._next = 0

    def choose(self, replicas, prompt):
        pick = min(replicas, key=lambda r: (r.rank - self._next) % (1 << 30))
        self._next = pick.rank + 1
        return Choice(pick, reason="round-robin")


class LeastLoaded(Router):
    """The shortest queue; ties go round the ranks, so an idle set is used evenly."""

    name = "least-loaded"

    def __init__(self):
        self._next = 0

    def choose(self, replicas, prompt):
        pick = min(replicas, key=lambda r: (r.load, r.kv_usage, (r.rank - self._next) % (1 << 30)))
        self._next = pick.rank + 1
        return Choice(pick, reason="least-loaded")


class PrefixAware(Router):
    """The longest window-aware hit, unless the estimated time to first token says leaving it pays.

    A replica's hit is what its cache grants now (``prefix_hit``) or, if more, what the requests it is
    still prefilling will have cached (``prefilling_hit``): a burst of requests for one new document go
    together, and their document then stays cached there, shared. Its estimated time to first token is
    ``Replica.wait_steps``: the prefill backlog it reported, the uncached tokens sent to it since, and this
    request's own uncached tokens (its prompt less that hit), in engine steps.

    The longest hit wins; among equal hits (and for a prompt no replica has) the fewest estimated steps,
    then the emptier KV pool, then round the ranks. It goes instead to the replica with the fewest
    estimated steps when that saves more steps than ``move_cost`` times the prefill the move adds to the
    cluster (the hit it gives up, in that replica's steps), and only while nothing waits for admission on
    the holder: requests waiting there wait for KV room or a batch slot, not for prefill, so its backlog
    does not say when they start (the overload rule below covers it).

    Why not simply the fewest estimated steps, hit or not: each request moved off its hit copies a prefix
    into another replica's queue and cache, which the requests after it pay for; so the work a move adds
    is counted twice (the prefill itself, and the queue and cache room it takes from later requests).

    Overloaded, one of two ways, and then the request may escape to a replica that is neither, drawing
    two of those (power of two choices) and taking the one with the fewer estimated steps:

    - a queue: more requests wait there to be admitted (no KV room, no batch slot) than on the least
      waited-on replica, by ``slack`` or more. It escapes only to a replica whose hit is short of the
      best by at most ``escape_steps`` steps' prefill (that replica's step budget each); with none, it
      stays with its hit: under a queue every replica is busy, and a long hit given up costs the
      cluster more than the queue;
    - a full pool: ``kv_full`` of its KV pool or more is held by running requests while another replica
      holds less than ``kv_roomy``. It escapes to a replica under ``kv_roomy`` whose hit is short of the
      best by at most twice ``escape_steps``. The full pool is what comes before the queue: its
      admissions will evict the cached prefixes of later turns or preempt, while another replica has
      room. Without it, chat traffic that shares one system prompt filled two replicas and left the
      third idle.

    The measurements behind each rule and bound (``bench/router_sim.py``) are in ``docs/serving.md`` and
    ``docs/loadtest.md``."""

    name = "prefix"

    def __init__(self, slack: int = 4, move_cost: float = 2.0, escape_steps: int = 4, kv_full: float = 0.8,
                 kv_roomy: float = 0.5, seed: int = 0, host_cost: HostHitCost | None = None):
        self.host_cost = host_cost
        self.slack = slack
        self.escape_steps = escape_steps
        self.kv_full, self.kv_roomy = kv_full, kv_roomy
        self.move_cost = move_cost
        self._rng = random.Random(seed)
        self._next = 0

    def choose(self, replicas, prompt):
        n = prompt.num_tokens
        hits = [max(self.hit(r, prompt), prefilling_hit(r, prompt)) for r in replicas]
        steps = [r.wait_steps(n - h) for r, h in zip(replicas, hits)]

        def after(i):   # the emptier pool, then round the ranks
            return replicas[i].kv_usage, (replicas[i].rank - self._next) % (1 << 30)

        every = range(len(replicas))
        best = min(every, key=lambda i: (-hits[i], steps[i], *after(i)))
        reason = "best-hit" if hits[best] else "least-loaded"
        fast = min(every, key=lambda i: (steps[i], -hits[i], *after(i)))
        if not replicas[best].waiting and \
                steps[best] - steps[fast] > self.move_cost * replicas[fast].steps_for(hits[best] - hits[fast]):
            best, reason = fast, "shorter-wait"
        least = min(r.waiting for r in replicas)
        queued = replicas[best].waiting - least >= self.slack
        full = replicas[best].kv_usage >= self.kv_full and min(r.kv_usage for r in replicas) < self.kv_roomy
        if queued or full:
            bound = self.escape_steps * (1 if queued else 2)
            escapes = [i for i in every if replicas[i].waiting - least < self.slack
                       and (queued or replicas[i].kv_usage < self.kv_roomy)
                       and hits[best] - hits[i] <= bound * replicas[i].step_tokens]
            if escapes:
                drawn = self._rng.sample(escapes, 2) if len(escapes) > 2 else escapes
                best = min(drawn, key=lambda i: (steps[i], -hits[i], *after(i)))
                reason = "overloaded" if queued else "kv-full"
        pick = replicas[best]
        pick.sent_tokens += n - hits[best]
        self._next = pick.rank + 1
        return Choice(pick, hits[best], reason)

    def learn_model(self, info) -> None:
        """Score the replicas' host tiers unless ``host_cost`` was given: every replica serves one model. A
        model the cost model cannot price leaves the router on device hits (and says so), never down."""
        if self.host_cost is None:
            try:
                self.host_cost = HostHitCost.from_info(info)
            except (ValueError, KeyError) as exc:
                logger.warning("prefix router: scoring device hits only, the host tier's cannot be priced (%s)", exc)

    def hit(self, replica: Replica, prompt: PromptHashes) -> int:
        """The replica's hit as this router counts it: the device's, and with ``host_cost`` its host tier's
        too, at the discount ``host_cost.HostHitCost`` derives from the load time."""
        cost = self.host_cost
        if cost is None:
            return prefix_hit(replica, prompt)
        device, both, loads = tiered_hit(replica, prompt)
        if both == device or len(loads) != len(cost.block_bytes):   # not this deployment's layout: device only
            return device
        return cost.worth(device, both, loads)


class RayPrefixTree(Router):
    """Ray Serve LLM's PrefixCacheAffinityRouter decision (its defaults) over Ray's own PrefixTree."""

    name = "ray-prefix-tree"

    def __init__(self, imbalanced_threshold: float = math.inf, match_rate_threshold: float = 0.1, seed: int = 0):
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree
        self.tree = PrefixTree()
        self.imbalanced_threshold, self.match_rate_threshold = imbalanced_threshold, match_rate_threshold
        self._rng = random.Random(seed)

    def choose(self, replicas, prompt):
        by_name = {r.name: r for r in replicas}
        self.tree.add_tenants([n for n in by_name if n not in self.tree.tenant_to_char_count], time.time())
        loads = [r.load for r in replicas]
        candidates, reason = [], "overloaded"
        if max(loads) - min(loads) <= self.imbalanced_threshold:
            text = prompt.text
            matched, tenants = self.tree.prefix_match(text, list(by_name))
            if len(matched) / max(1, len(text)) < self.match_rate_threshold:
                tenants, reason = self.tree.get_smallest_tenants(), "tree-smallest"
            else:
                reason = "tree-match"
            candidates = [by_name[t] for t in tenants or () if t in by_name]
        if not candidates:   # its fallback: power of two choices
            candidates = self._rng.sample(replicas, min(2, len(replicas)))
        pick = min(candidates, key=lambda r: (r.load, self._rng.random()))   # the shorter queue of those offered
        self.tree.insert(prompt.text, pick.name, time.time())
        return Choice(pick, reason=reason)

    def replica_down(self, replica):
        if replica.name in self.tree.tenant_to_char_count:
            self.tree.remove_tenants([replica.name])


def make_router(name: str, seed: int = 0, host_cost: HostHitCost | None = None) -> Router:
    """``host_cost``: the prefix router also scores replicas' host tiers (``host_cost``); the others ignore it."""
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix":
        return PrefixAware(seed=seed, host_cost=host_cost)
    if name == "ray-prefix-tree":
        return RayPrefixTree(seed=seed)
    raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
