"""The engine: scheduler + KV-cache manager + an executor of steps. A plain class; Ray wraps it.

An executor has ``execute(StepInput) -> StepOutput`` and ``restart()``. One request never stops the
engine. A step that fails because of one request's chunk (the workers raise ``RequestError`` naming it,
before changing anything) fails that request alone and runs again without it; a row the workers cannot
sample fails its request in ``apply``. Any other step failure (``WorkerFailure``: a worker lost or timed
out; or an error nobody can attribute) restarts the workers, and every running request recomputes from
its tokens (prompt and what it generated so far): nothing is lost or answered twice. Each request of
the failed step then runs alone until a step of its own succeeds; one that fails ``max_request_faults``
steps in a row is failed, so a request that breaks the workers without naming itself fails alone and
cannot make them restart forever.

Asynchronous scheduling (``EngineConfig.async_scheduling``, with an executor that can ``submit`` a step
and ``collect`` it later): each ``step()`` schedules and launches step N+1 while step N runs on the
device, then collects and applies step N. The scheduler's side is in ``scheduler.py`` (pending tokens,
chunks fed on the device). What keeps it safe: the workers run steps in launch order on one device
stream, so a block freed or dropped while step N still reads it can only be written by N+1 or later, a
composite re-formed for N+1 is re-formed after N's reads, and the host buffers a launch fills are
double-buffered. Faults: a step the workers refuse because of one request (``RequestError``, raised at
launch, before anything changed) is launched again without that request, as in the synchronous loop;
any other failure of a launch or a collect loses both steps on the device: their requests are blamed,
the workers restart and everything running recomputes. While requests are under suspicion the engine
runs one step at a time. Served, the core thread calls ``step`` only when ``next_step_due`` says (``step_clock``):
a decode step long enough is followed shortly before it ends, not at once, so that arrivals make the next one.

Late joiners (executors with ``supports_joins``: one stage of real workers on the rings, its tensor-parallel
ranks running the joiners rank 0 found). While the engine waits for the
workers to take a step of fed decodes alone, requests that arrive (``take_arrivals``, the served core's hook)
are admitted at once and their first chunks sent behind it (``Scheduler.schedule_joiners``); a worker that
finds them when it takes the step runs them in the same batch. Without them a request arriving during step
N waited for N+2 (N+1 was already queued): on short CPU decode steps the step clock cannot wait, and a
whole step of time to first token went to that. The acknowledgement says which joined; the others are
withdrawn (their requests wait at the head of the queue again, as if never admitted). A step of fed decodes
reads only its requests' blocks and completes no cached block (its new token is not known here), so nothing
a joiner's hit or new blocks can touch is read in that batch.

Host tier (``EngineConfig.num_host_blocks``): each step carries the copies the manager scheduled; each
output's reports go to ``transfers_done``, whose failed loads requeue their requests; a worker restart
loses the workers' host memory (``Scheduler.host_tier_lost``) before everything recomputes. With
asynchronous scheduling a step's copies are reported when it is collected, after the next step was
scheduled: a request loading in step N computes in step N+2 at the earliest, and a store's source block
stays pinned one step longer. The copies of step N+1 run after step N's compute on the workers
(``workers.runtime.host_pool``), so a block step N still reads is never overwritten by a load.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmanager import KVCacheManager, Request

from workers.protocol import StepInput, find_request_error

from .scheduler import Scheduler, Sequence, SequenceUpdate, StepPlan
from .step_clock import StepClock
from .types import SamplingParams


class WorkerFailure(RuntimeError):
    """A worker died or stopped answering; its KV cache is gone."""


class RestartFailed(RuntimeError):
    """The workers were lost and new ones could not be started (``cause``); ``updates``: the requests the
    failed step's blame finished, which the caller still has to deliver (``EngineCore`` retries)."""

    def __init__(self, cause: BaseException, updates: list):
        super().__init__(str(cause))
        self.cause, self.updates = cause, updates


@dataclass
class EngineConfig:
    max_model_len: int = 4096
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    max_request_faults: int = 3            # unexplained step failures in a row before a request is failed
    vocab_size: int | None = None          # token ids must lie below it (checked before queueing)
    async_scheduling: bool = True          # schedule step N+1 while step N runs (executors with ``submit``)
    num_host_blocks: int = 0               # host units of the host KV tier (0: none)
    host_speculative_stores: bool = True   # also fill free host units with blocks no known hit needs
    host_block_bytes: tuple[int, ...] = ()   # per group: bytes one of its blocks moves, all workers together
    prefill_room: Callable[[list[tuple[int, int]]], int] | None = None   # widens a step's budget: ``Scheduler``


@dataclass
class EngineMetrics:
    steps: int = 0
    scheduled_tokens: int = 0
    step_time_s: float = 0.0
    last_step_time_s: float = 0.0
    delta_bytes: int = 0
    simulated_time_s: float = 0.0                 # GPU time simulated workers report (0 for real ones)
    device_time_s: float = 0.0                    # GPU time real workers on CUDA report (events)
    host_time_s: float = 0.0                      # wall time in ``step()`` not spent waiting for results
    wait_time_s: float = 0.0                      # wall time in ``step()`` waiting for the workers' results
    worker_restarts: int = 0
    recomputed_requests: int = 0
    joined_requests: int = 0                      # requests whose first chunk joined a step already sent
    finished: dict = field(default_factory=dict)   # finish reason -> count
    host_blocks_stored: int = 0                   # host-tier copies the workers reported done, per direction
    host_blocks_loaded: int = 0
    host_bytes_stored: int = 0
    host_bytes_loaded: int = 0
    host_load_failures: int = 0                   # requests whose loads from host failed (they recompute)
    host_load_latency_s: float = 0.0              # per request loaded: from its step's scheduling to the report
    host_loads_completed: int = 0                 # requests whose loads all completed


def _decodes(plan: StepPlan) -> int | None:
    """How many sequences a step decodes, if that is all it does (one token each, no host-tier copies)."""
    step = plan.step
    if plan.num_tokens != len(step.chunks) or step.kv_loads or step.kv_stores or plan.joined:
        return None
    return plan.num_tokens


def _fed_decodes(plan: StepPlan) -> bool:
    """Every chunk decodes the token the step before drew (nothing else): what late joiners may follow."""
    return _decodes(plan) is not None and all(c.from_last_step for c in plan.step.chunks)


class Engine:
    def __init__(self, executor, group_specs, num_blocks: int, config: EngineConfig | None = None,
                 group_widths=None):
        """``group_widths``: pool units per block of each group (``kv_layout(...).group_widths``)."""
        self.config = config or EngineConfig()
        self.executor = executor
        self.manager = KVCacheManager(group_specs, num_blocks=num_blocks,
                                      enable_prefix_caching=self.config.enable_prefix_caching,
                                      max_model_len=self.config.max_model_len, widths=group_widths,
                                      num_host_blocks=self.config.num_host_blocks,
                                      host_speculative_stores=self.config.host_speculative_stores)
        self.scheduler = Scheduler(self.manager, self.config.max_num_batched_tokens, self.config.max_num_seqs,
                                   self.config.prefill_room)
        self.metrics = EngineMetrics()
        self.clock = StepClock()                # when a served engine schedules its next step
        self._inflight: tuple[StepPlan, object] | None = None   # launched, not yet collected (async only)
        self.restarting = False                 # the workers are being replaced (read by health probes)
        self.take_arrivals = None               # served: admits the requests that came meanwhile, says if any

    def add_request(self, request_id: str, prompt_token_ids, params: SamplingParams | None = None,
                    extra_keys: tuple = (), block_hashes: dict[int, list[bytes]] | None = None) -> None:
        """Validate and queue a request; raises ValueError (nothing queued) on bad input. ``block_hashes``:
        the prompt's leading block hashes, when a router computed them already (``kvmanager.Request``)."""
        req = Request(request_id, prompt_token_ids, extra_keys=extra_keys, block_hashes=block_hashes)
        vocab = self.config.vocab_size
        if vocab is not None and max(req.prompt_token_ids) >= vocab:
            raise ValueError(f"request {request_id!r}: token id {max(req.prompt_token_ids)} is outside the "
                             f"model's vocabulary [0, {vocab})")
        self.scheduler.add(Sequence(req, params or SamplingParams()))

    def abort(self, request_id: str) -> bool:
        aborted = self.scheduler.abort(request_id)
        if aborted:
            self.metrics.finished["abort"] = self.metrics.finished.get("abort", 0) + 1
        return aborted

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def step(self) -> list[SequenceUpdate]:
        """Run one step; return each request's new tokens and whether it finished. With asynchronous
        scheduling, the step applied is the one launched by the previous call (see the module doc)."""
        t0 = time.perf_counter()
        waited = self.metrics.wait_time_s
        if self._overlapping():
            updates = self._step_overlapped()
        elif self._inflight is not None:          # back to one step at a time: finish the one in flight
            plan, handle = self._inflight
            self._inflight = None
            updates = self._collect_and_apply(plan, handle, [])
        else:
            updates = self._step_sync()
        self.metrics.host_time_s += time.perf_counter() - t0 - (self.metrics.wait_time_s - waited)
        return updates

    def _overlapping(self) -> bool:
        return (self.config.async_scheduling and getattr(self.executor, "supports_async", False)
                and not self.scheduler.isolating)

    def _step_sync(self) -> list[SequenceUpdate]:
        plan = self.schedule()
        if plan is None:
            return []
        updates = []
        while True:
            try:
                output = self._wait(self.executor.execute, plan.step)
            except Exception as exc:  # noqa: BLE001 - every failure is someone's: a request's, or the workers'
                failed = self.isolate(plan, exc)
                if failed is not None:
                    updates.append(failed)
                    continue
                return updates + self.recover(plan)
            return updates + self.apply(plan, output)

    def _step_overlapped(self) -> list[SequenceUpdate]:
        updates: list[SequenceUpdate] = []
        if self._inflight is None:
            started = time.perf_counter()
            plan = self.schedule()
            if plan is None:
                return []
            self._inflight = self._launch(plan, updates, started=started)
            if self._inflight is None:
                return updates
        current, handle = self._inflight
        following = None
        started = time.perf_counter()
        self.clock.woke(started)
        plan = self.schedule()                  # while the device runs the step in flight
        if plan is not None:
            following = self._launch(plan, updates, current, started)
            if following is None and self._inflight is None:
                return updates                  # the launch failed and the workers restarted
        self._inflight = following
        return self._collect_and_apply(current, handle, updates, following)

    def _launch(self, plan: StepPlan, updates: list, inflight: StepPlan | None = None, started: float = 0.0):
        """Submit ``plan`` (again without any request the workers refuse); ``(plan, handle)``, or None after
        a failure nobody can be blamed for (then the workers restarted and the step in flight is lost).
        ``started``: when its scheduling began (the clock learns the engine's own time from it)."""
        while True:
            joiners: list[tuple[StepPlan, object]] = []
            try:
                handle = self._wait(lambda step: self._submit(plan, joiners), plan.step)   # the workers' ack is a wait
            except Exception as exc:  # noqa: BLE001
                for joiner, _ in reversed(joiners):
                    self.scheduler.withdraw(joiner)
                failed = self.isolate(plan, exc)
                if failed is not None:
                    updates.append(failed)
                    continue
                self._inflight = None
                updates += self.recover_steps([p for p in (inflight, plan) if p is not None])
                return None
            self.scheduler.launched(plan)
            took = self.executor.last_joined if joiners else ()
            for joiner, joiner_handle in reversed(joiners):
                if joiner_handle not in took:
                    self.scheduler.withdraw(joiner)
            for joiner, joiner_handle in joiners:
                if joiner_handle in took:
                    self.scheduler.launched(joiner)
                    plan.joined.append((joiner, joiner_handle))
                    self.metrics.joined_requests += len(joiner.scheduled)
            taken = time.perf_counter()
            self.clock.launched(_decodes(plan), taken, taken - started - getattr(self.executor, "last_wait_s", 0.0))
            return plan, handle

    def _submit(self, plan: StepPlan, joiners: list):
        """``executor.submit``; behind a step of fed decodes, requests arriving meanwhile join it (module doc)."""
        if not (self.take_arrivals is not None and getattr(self.executor, "supports_joins", False)
                and not self.config.num_host_blocks and _fed_decodes(plan)):
            return self.executor.submit(plan.step)

        def meanwhile():
            if not self.take_arrivals():
                return
            room = self.config.max_num_batched_tokens - plan.num_tokens - sum(j.num_tokens for j, _ in joiners)
            joiner = self.scheduler.schedule_joiners(room)
            if joiner is None:
                return
            joiner.started = time.perf_counter()
            try:
                joiners.append((joiner, self.executor.join(joiner.step)))
            except Exception as exc:  # noqa: BLE001 - its requests go with the next step, which sorts out any fault
                self.scheduler.withdraw(joiner)
                if find_request_error(exc) is None:
                    raise
        return self.executor.submit(plan.step, meanwhile)

    def next_step_due(self) -> float | None:
        """The ``time.perf_counter()`` until which a served engine gains by taking requests rather than
        scheduling its next step (``step_clock``); None: step now."""
        if self._inflight is None or not self._overlapping():
            return None
        return self.clock.due

    def _collect_and_apply(self, plan: StepPlan, handle, updates: list, following=None) -> list[SequenceUpdate]:
        try:
            output = self._wait(self.executor.collect, handle)
            joined = [(joiner, self._wait(self.executor.collect, h)) for joiner, h in plan.joined]
        except Exception:  # noqa: BLE001 - a step already launched cannot be retried alone: both are lost
            self._inflight = None
            lost = [plan] + ([following[0]] if following else [])
            return updates + self.recover_steps(lost + [joiner for p in lost for joiner, _ in p.joined])
        updates += self.apply(plan, output)
        for joiner, out in joined:
            updates += self.apply(joiner, out)
        return updates

    def _wait(self, call, arg):
        """``call(arg)``, counting as waiting what the executor says it waited (else the whole call)."""
        t0 = time.perf_counter()
        try:
            return call(arg)
        finally:
            spent = time.perf_counter() - t0
            waited = getattr(self.executor, "last_wait_s", None)
            self.metrics.wait_time_s += spent if waited is None else min(waited, spent)

    # The phases ``step`` is made of. Nothing here is thread-safe: one thread at a time drives an engine
    # (``EngineCore`` applies every other caller's commands between steps).
    def schedule(self) -> StepPlan | None:
        plan = self.scheduler.schedule()
        if not (plan.step.chunks or plan.step.kv_stores or plan.step.kv_loads):
            return None
        plan.started = time.perf_counter()
        return plan

    def apply(self, plan: StepPlan, output) -> list[SequenceUpdate]:
        dt = time.perf_counter() - plan.started
        if not plan.launched:
            self.scheduler.launched(plan)
        if output.transfers_done or output.transfers_failed:
            self._transfers_done(plan, output)
        updates = self.scheduler.update(plan, output)
        self.clock.ran(_decodes(plan), output.worker_time_s)
        m = self.metrics
        m.scheduled_tokens += plan.num_tokens
        if plan.joiner:                     # part of the step it joined, which counts the step
            self._count(updates)
            return updates
        m.steps += 1
        m.step_time_s += dt
        m.last_step_time_s = dt
        m.delta_bytes += getattr(self.executor, "last_payload_bytes", 0)
        m.simulated_time_s += output.simulated_time_s
        m.device_time_s += getattr(output, "device_time_s", 0.0)
        self._count(updates)
        return updates

    def _transfers_done(self, plan: StepPlan, output) -> None:
        """Fence the step's copies; requeue the requests whose loads failed; count what moved."""
        lost = self.manager.transfers_done(output.transfers_done, output.transfers_failed)
        self.scheduler.requeue(lost)
        m, sizes = self.metrics, self.config.host_block_bytes
        group = {block: g for g, block, _ in plan.step.kv_stores}
        loads = {block: g for g, _, block in plan.step.kv_loads}
        for block in output.transfers_done:
            if block in loads:
                m.host_blocks_loaded += 1
                m.host_bytes_loaded += sizes[loads[block]] if sizes else 0
            else:
                m.host_blocks_stored += 1
                m.host_bytes_stored += sizes[group[block]] if sizes else 0
        m.host_load_failures += len(lost)
        now = time.perf_counter()
        for seq in plan.loading:
            rid = seq.request_id
            if rid not in lost and seq.status == "running" and not self.manager.is_loading(rid):
                m.host_loads_completed += 1
                m.host_load_latency_s += now - plan.started

    def isolate(self, plan: StepPlan, exc: BaseException) -> SequenceUpdate | None:
        """If ``exc`` names one request of the step (``RequestError``), fail it and take its chunk out of
        the plan, which can then run again as it is; None when nobody can be blamed."""
        error = find_request_error(exc)
        if error is None:
            return None
        update = self.scheduler.drop_chunk(plan, error.request_id, error.message)
        if update is not None:
            self._count([update])
        return update

    def blame(self, plan: StepPlan) -> list[SequenceUpdate]:
        """A step failed with nobody to blame: its requests become suspects (``Scheduler.blame``)."""
        updates = self.scheduler.blame(plan, self.config.max_request_faults)
        self._count(updates)
        return updates

    def recover(self, plan: StepPlan | None = None) -> list[SequenceUpdate]:
        """After a failed step nobody can be blamed for: restart the workers; running requests recompute
        from their tokens. Raises ``RestartFailed`` when no worker can be started."""
        return self.recover_steps([plan] if plan is not None else [])

    def recover_steps(self, plans: list[StepPlan]) -> list[SequenceUpdate]:
        """``recover`` after losing several launched steps: each request among them is blamed once."""
        scheduled = list({id(seq): seq for p in plans for seq in p.scheduled}.values())
        updates = self.blame(StepPlan(StepInput(-1, []), scheduled)) if scheduled else []
        self._inflight = None
        self.restarting = True
        try:
            self.executor.restart()
        except Exception as exc:  # noqa: BLE001 - the caller decides when to try again
            raise RestartFailed(exc, updates) from exc
        finally:
            self.restarting = False
        self.after_restart()
        return updates

    def after_restart(self) -> None:
        self.metrics.worker_restarts += 1
        self.metrics.host_load_failures += len(self.scheduler.host_tier_lost())
        self.metrics.recomputed_requests += self.scheduler.recompute_all()

    def fail_all(self, message: str, error_type: str = "engine_unavailable") -> list[SequenceUpdate]:
        """Finish every request with reason "error" (no workers, shutting down)."""
        self._inflight = None
        updates = []
        for rid in list(self.scheduler.sequences):
            self.scheduler.fail(rid, "error", message)
            updates.append(SequenceUpdate(rid, [], True, "error", error=message, error_type=error_type))
        self._count(updates)
        return updates

    def _count(self, updates: list[SequenceUpdate]) -> None:
        finished = self.metrics.finished
        for u in updates:
            if u.finished:
                finished[u.finish_reason] = finished.get(u.finish_reason, 0) + 1

    def load(self) -> dict:
        """What a router weighs (``types.Load`` less the status): queue lengths, KV usage, prefill backlog."""
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting), "kv_usage": self.manager.usage,
                "prefill_backlog": s.prefill_backlog}

    def stats(self) -> dict:
        """A snapshot for /metrics: queue sizes, KV usage per group, prefix hits, preemptions, timings."""
        mgr, s, m = self.manager, self.scheduler, self.metrics
        usable = mgr.num_blocks - 1
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "kv_usage": mgr.usage,
            "kv_usage_per_group": [n * w / usable for n, w in zip(mgr.blocks_held_per_group(), mgr.widths)],
            "prefix_queried_tokens": mgr.stats.queried_tokens,
            "prefix_hit_tokens": mgr.stats.hit_tokens,
            "prefix_hit_rate": mgr.stats.hit_rate,
            "preemptions": s.num_preemptions,
            "steps": m.steps,
            "scheduled_tokens": m.scheduled_tokens,
            "mean_step_time_s": m.step_time_s / m.steps if m.steps else 0.0,
            "last_step_time_s": m.last_step_time_s,
            "delta_bytes": m.delta_bytes,
            "simulated_time_s": m.simulated_time_s,
            "device_time_s": m.device_time_s,
            "host_time_s": m.host_time_s,
            "wait_time_s": m.wait_time_s,
            "worker_restarts": m.worker_restarts,
            "recomputed_requests": m.recomputed_requests,
            "joined_requests": m.joined_requests,
            "finished": dict(m.finished),
            "kv_host_blocks": self.config.num_host_blocks,
            "kv_host_blocks_stored": m.host_blocks_stored,
            "kv_host_blocks_loaded": m.host_blocks_loaded,
            "kv_host_bytes_stored": m.host_bytes_stored,
            "kv_host_bytes_loaded": m.host_bytes_loaded,
            "kv_host_hit_requests": s.host_hit_requests,
            "kv_host_hit_tokens": s.host_hit_tokens,
            "kv_host_load_failures": m.host_load_failures,
            "kv_host_load_latency_s_sum": m.host_load_latency_s,
            "kv_host_loads_completed": m.host_loads_completed,
            "kv_host_loads_preempted": s.host_loads_preempted,
            "workers": list(getattr(self.executor, "worker_names", [])),   # Ray actor names, stage order
        }
