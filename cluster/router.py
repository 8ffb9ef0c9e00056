"""Which engine replica takes a request: round-robin, least-loaded, window-aware prefix, or Ray's prefix tree.

The ``prefix`` router scores each replica by the prefix hit its manager would grant: the longest hit
valid for every KV-cache group under that group's own window rule, found by the manager's own code
(``AttentionSpec.longest_hit`` per group, ``HitRule`` for the length all groups agree on) run on the
hashes the replica's KV events say it caches (``kv_events.KVIndex``). A sliding group needs only the last
window's blocks cached, so a replica that has evicted the start of a long prompt can still offer a hit
a text-prefix router would never see; and a replica whose window blocks were evicted offers no phantom
hit. It takes the best hit unless that replica is overloaded (requests wait there for admission while
another replica has fewer waiting, or its KV pool is full while another's is not), in which case it
takes the one with less prefill work ahead of the first token of two random replicas (power of two
choices).

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

import math
import random
import time
from dataclasses import dataclass, field
from itertools import islice, takewhile

from kvmanager.coordinator import HitRule
from kvmanager.hashing import HASH_BYTES, hash_blocks, root_hash

from .kv_events import KVIndex

ROUTERS = ("round-robin", "least-loaded", "prefix", "ray-prefix-tree")


class PromptHashes:
    """A prompt's chained block hashes per block size, computed on demand and once (``kvmanager.hashing``,
    no extra keys: the chain the engine's ``Request`` computes)."""

    __slots__ = ("token_ids", "_chains", "_text")

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids
        self._chains: dict[int, list[bytes]] = {}
        self._text: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def upto(self, block_size: int, n: int) -> list[bytes]:
        """The chain, holding at least the first ``n`` full blocks' hashes (all there are if fewer)."""
        chain = self._chains.get(block_size)
        if chain is None:
            chain = self._chains[block_size] = []
        n = min(n, len(self.token_ids) // block_size)
        if len(chain) < n:
            parent = chain[-1] if chain else root_hash(())
            chain.extend(hash_blocks(parent, self.token_ids[len(chain) * block_size:n * block_size], block_size))
        return chain

    def for_engine(self) -> dict[int, bytes]:
        """What was hashed, per block size, as one byte string each (cheap to send)."""
        return {bs: b"".join(chain) for bs, chain in self._chains.items() if chain}

    @property
    def text(self) -> str:
        """One character per token id (for the text-prefix baseline)."""
        if self._text is None:
            self._text = "".join(map(chr, self.token_ids))
        return self._text


def split_hashes(packed: dict[int, bytes] | None) -> dict[int, list[bytes]] | None:
    """``PromptHashes.for_engine`` back into lists of digests (in the engine)."""
    if not packed:
        return None
    return {bs: [blob[i:i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)] for bs, blob in packed.items()}


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

    @property
    def load(self) -> int:
        """Queue length: the replica's running + waiting, or what this app sent it if more (not reported yet)."""
        return max(self.running + self.waiting, self.in_flight)

    def wait_tokens(self, uncached: int) -> int:
        """Prompt tokens to compute on this replica before a request's first token: the backlog ahead of it
        (chunked prefill serves requests in turn) and its own uncached tokens."""
        return self.backlog + self.sent_tokens + uncached


def prefix_hit(replica: Replica, prompt: PromptHashes) -> int:
    """The hit (tokens) ``replica``'s manager would grant ``prompt`` now, by its own rules, on the hashes
    its events say it caches; 0 when its cache is not known. The manager looks up all but the last token."""
    rule, index = replica.rule, replica.index
    if rule is None or not index.synced or prompt.num_tokens < 2:
        return 0
    searches = []
    for g, spec in enumerate(rule.specs):
        cached = index.cached(g)
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
    reason: str = ""             # best-hit, overloaded, least-loaded, round-robin, tree-match, tree-smallest


class Router:
    """A policy: ``choose`` among the ready replicas (never an empty list)."""

    name = "abstract"

    def choose(self, replicas: list[Replica], prompt: PromptHashes) -> Choice:
        raise NotImplementedError

    def replica_down(self, replica: Replica) -> None:
        """The replica died or left: forget what is known of it."""

    def replica_up(self, replica: Replica) -> None:
        """The replica is (again) ready."""


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
    """Best window-aware hit unless that replica is overloaded; then power of two choices.

    A replica's hit is what its cache grants now (``prefix_hit``) or, if more, what the requests it is
    still prefilling will have cached (``prefilling_hit``): a burst of requests for one new document go
    together, and their document then stays cached there, shared. Overloaded: more requests wait there
    to be admitted (no KV room, no batch slot) than on the least waited-on replica, by ``slack`` or more.
    Then two random replicas are drawn and the one with less prefill work ahead of the request's first
    token (its uncached tokens included) takes it. Among equal hits, and for a prompt no replica has, the
    least such work wins: chunked prefill serves running requests in turn, so that work is what a first
    token waits for."""

    name = "prefix"

    def __init__(self, slack: int = 4, seed: int = 0):
        self.slack = slack
        self._rng = random.Random(seed)
        self._next = 0

    def choose(self, replicas, prompt):
        n = prompt.num_tokens
        hits = [max(prefix_hit(r, prompt), prefilling_hit(r, prompt)) for r in replicas]
        work = [r.wait_tokens(n - h) for r, h in zip(replicas, hits)]
        # the longest hit; among equal hits the least work ahead, then the emptier pool, then round the ranks
        best = min(range(len(replicas)), key=lambda i: (-hits[i], work[i], replicas[i].kv_usage,
                                                        (replicas[i].rank - self._next) % (1 << 30)))
        reason = "best-hit" if hits[best] else "least-loaded"
        if len(replicas) > 1 and replicas[best].waiting - min(r.waiting for r in replicas) >= self.slack:
            a, b = self._rng.sample(range(len(replicas)), 2)
            best = min((a, b), key=lambda i: (work[i], -hits[i]))
            reason = "overloaded"
        pick = replicas[best]
        pick.sent_tokens += n - hits[best]
        self._next = pick.rank + 1
        return Choice(pick, hits[best], reason)


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


def make_router(name: str, seed: int = 0) -> Router:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix":
        return PrefixAware(seed=seed)
    if name == "ray-prefix-tree":
        return RayPrefixTree(seed=seed)
    raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
