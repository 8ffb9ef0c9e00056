"""The engine replicas behind one OpenAI app: found by name, followed through their KV events, routed to.

Each replica is a named engine actor (``swakv-engine-{i}``). One task per replica long-polls its
``kv_events``: the batches keep the router's index of that replica's cache (``kv_index.KVIndex``) and
each reply carries its load (status, running, waiting, KV usage). A replica whose call fails is **down**:
the router forgets its index and stops sending it requests; the task keeps looking it up by name (Ray
restarts a crashed engine, or an operator starts a new one) and, once it answers, re-learns its cache
from a snapshot (its epoch changed). A replica never heard of yet is **unknown**: requests go to the
ready ones, and only when none is ready are the others tried, so the first request after a start-up or
a restart does not wait for the poll.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter

import ray
from ray.exceptions import RayActorError

from kvmanager.coordinator import HitRule

from cluster.engine.kv_events import KVEventsReply, specs_from_metadata
from cluster.engine.types import ModelInfo

from .kv_index import Gap
from .policies import Replica, Router
from .prompt import PromptHashes

log = logging.getLogger("swakv.replicas")

POLL_WAIT_S = 1.0          # a kv_events call waits this long for a batch (so load is at most this stale)
POLL_GAP_S = 0.05          # and the next one goes this long after a reply: a replica stepping faster sends
                           # several steps' batches in one reply, so following costs at most 20 calls a second
CALL_TIMEOUT_S = 30.0


class ReplicaSet:
    def __init__(self, names: list[str], namespace: str, router: Router, poll_wait_s: float = POLL_WAIT_S):
        if not names or len(set(names)) != len(names):
            raise ValueError(f"engine names must be a non-empty list of distinct names, got {names!r}")
        self.namespace = namespace
        self.router = router
        self.poll_wait_s = poll_wait_s
        self.replicas = [Replica(rank, name) for rank, name in enumerate(names)]
        self.state = {r.name: "unknown" for r in self.replicas}   # unknown | ready | <engine status> | down
        self._handles: dict[str, object] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self.routed: Counter = Counter()        # (replica name, reason) -> requests
        self.retries = 0                        # requests moved to another replica before their first token
        self.downs: Counter = Counter()         # replica name -> times it was found down
        self.expected_hit_tokens = 0            # prompt tokens the router expected the chosen replicas to hit
        self.shortfall_tokens = 0               # ... that they did not find (evicted before admission)

    # -- handles ---------------------------------------------------------------------------------
    def handle(self, replica: Replica):
        """The replica's actor handle (looked up by name the first time, and after it was found down);
        raises ValueError when no actor has that name."""
        h = self._handles.get(replica.name)
        if h is None:
            h = self._handles[replica.name] = ray.get_actor(replica.name, namespace=self.namespace)
        return h

    def down(self, replica: Replica) -> None:
        """A call failed: forget the handle and what is known of its cache; route elsewhere."""
        self._handles.pop(replica.name, None)
        if self.state[replica.name] != "down":
            self.downs[replica.name] += 1
        self.state[replica.name] = "down"
        replica.ready = False
        replica.index.forget()
        self.router.replica_down(replica)

    async def info(self, replica: Replica) -> ModelInfo:
        """The replica's model info (``ready``); learns its KV layout for the router."""
        info = await asyncio.wait_for(self.handle(replica).ready.remote(), CALL_TIMEOUT_S)
        self._learn(replica, info)
        return info

    def _learn(self, replica: Replica, info: ModelInfo) -> None:
        """What routing needs of a replica's model: its KV layout's hit rule, its step budget, and (for the
        router) its host tier's worth."""
        if replica.rule is None and info.get("kv_groups"):
            replica.rule = HitRule(specs_from_metadata(info["kv_groups"]))
            self.router.learn_model(info)
        replica.step_tokens = info.get("max_num_batched_tokens", replica.step_tokens)

    # -- following the replicas ------------------------------------------------------------------
    def follow(self) -> None:
        """Start (or restart) the task following each replica (call on the app's event loop)."""
        for r in self.replicas:
            task = self._tasks.get(r.name)
            if task is None or task.done():
                self._tasks[r.name] = asyncio.get_running_loop().create_task(self._follow(r))

    async def _follow(self, replica: Replica) -> None:
        delay = 0.2
        while True:
            try:
                if replica.rule is None:
                    await self.info(replica)
                idx = replica.index
                reply = await asyncio.wait_for(
                    self.handle(replica).kv_events.remote(idx.epoch, idx.seq or 0, self.poll_wait_s),
                    self.poll_wait_s + CALL_TIMEOUT_S)
                self._apply(replica, reply)
                delay = 0.2
                await asyncio.sleep(POLL_GAP_S)
            except asyncio.CancelledError:
                raise
            except (ValueError, RayActorError, asyncio.TimeoutError) as exc:   # gone, restarting, or stuck
                if self.state[replica.name] != "down":
                    log.warning("replica %s is down (%s)", replica.name, type(exc).__name__)
                self.down(replica)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
            except Exception:  # noqa: BLE001 - never let the follower die
                log.exception("following replica %s failed", replica.name)
                await asyncio.sleep(delay)

    def _apply(self, replica: Replica, reply: KVEventsReply) -> None:
        load = reply["load"]
        replica.running, replica.waiting, replica.kv_usage = load["running"], load["waiting"], load["kv_usage"]
        replica.backlog, replica.sent_tokens = load["prefill_backlog"], 0   # the report counts what was sent
        idx = replica.index
        if "snapshot" in reply:
            if idx.epoch is not None and reply["epoch"] != idx.epoch:
                # Restarted between two polls, with none of this app's calls to it failing: it was down all
                # the same, and the router must forget what it knew of it, as after a failed call.
                log.warning("replica %s restarted (new KV-event epoch)", replica.name)
                self.down(replica)
            idx.load(reply["epoch"], *reply["snapshot"])
        else:
            try:
                for seq, payload in reply["batches"]:
                    idx.apply(seq, payload)
            except Gap:
                idx.forget()     # the next poll, with no epoch, gets a snapshot
        was_ready = replica.ready
        replica.ready = load["status"] == "ready" and idx.synced
        self.state[replica.name] = "ready" if replica.ready else load["status"]
        if replica.ready and not was_ready:
            self.router.replica_up(replica)

    def check_hit(self, expected: int, cached: int) -> None:
        """The engine's first item says how much it found cached: count what the router expected more."""
        self.shortfall_tokens += max(0, expected - cached)

    # -- routing ---------------------------------------------------------------------------------
    def candidates(self, prompt: PromptHashes, affinity: Replica | None,
                   tried: set[str]) -> list[tuple[Replica, int]]:
        """Replicas to try, best first, each with the prefix hit (tokens) the router expects there: the
        affinity replica (an ``n`` sibling's) if ready, else the router's choice among the ready ones, then
        the others not yet tried (maybe back already), expected to hit nothing."""
        ready = [r for r in self.replicas if r.ready and r.name not in tried]
        first: list[Replica] = []
        expected = 0
        if affinity is not None and affinity in ready:
            first = [affinity]
            self.routed[(affinity.name, "sibling")] += 1
        elif len(ready) == 1:   # nothing to choose: the engine hashes the prompt itself
            first = ready
            self.routed[(ready[0].name, "only")] += 1
        elif ready:
            choice = self.router.choose(ready, prompt)
            first = [choice.replica]
            self.routed[(choice.replica.name, choice.reason)] += 1
            self.expected_hit_tokens += choice.hit_tokens
            expected = choice.hit_tokens
        rest = [r for r in self.replicas if r.name not in tried and r not in first and not r.ready]
        return [(r, expected) for r in first] + [(r, 0) for r in rest]

    # -- requests in flight ----------------------------------------------------------------------
    def acquire(self, replica: Replica, prompt: PromptHashes) -> None:
        """A request was sent to ``replica``: in flight there, and prefilling (its blocks get cached there
        as the prefill goes, which ``prefilling_hit`` counts for the requests after it)."""
        replica.in_flight += 1
        replica.prefilling.append(prompt)

    def first_token(self, replica: Replica, prompt: PromptHashes) -> None:
        """The request's first item came: its prompt is computed."""
        replica.prefilling.remove(prompt)

    def release(self, replica: Replica, prompt: PromptHashes | None = None) -> None:
        """The request ended on ``replica`` (``prompt``: before its first item, so still prefilling)."""
        replica.in_flight -= 1
        if prompt is not None:
            replica.prefilling.remove(prompt)
