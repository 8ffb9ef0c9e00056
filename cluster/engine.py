"""The engine: scheduler + KV-cache manager + an executor of steps. A plain class; Ray wraps it.

An executor has ``execute(StepInput) -> StepOutput`` and ``restart()``; it raises ``WorkerFailure`` when
a worker is lost. Then the engine restarts the workers, and every running request recomputes from its
tokens (prompt and what it generated so far): no accepted request is lost or answered twice.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvmanager import KVCacheManager, Request

from .scheduler import SamplingParams, Scheduler, Sequence, SequenceUpdate


class WorkerFailure(RuntimeError):
    """A worker died or stopped answering; its KV cache is gone."""


@dataclass
class EngineConfig:
    max_model_len: int = 4096
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    max_worker_restarts: int = 3
    vocab_size: int | None = None          # token ids must lie below it (checked before queueing)


@dataclass
class EngineMetrics:
    steps: int = 0
    scheduled_tokens: int = 0
    step_time_s: float = 0.0
    last_step_time_s: float = 0.0
    delta_bytes: int = 0
    simulated_time_s: float = 0.0                 # GPU time simulated workers report (0 for real ones)
    worker_restarts: int = 0
    recomputed_requests: int = 0
    finished: dict = field(default_factory=dict)   # finish reason -> count


class Engine:
    def __init__(self, executor, group_specs, num_blocks: int, config: EngineConfig | None = None,
                 group_widths=None):
        """``group_widths``: pool units per block of each group (``kv_layout(...).group_widths``)."""
        self.config = config or EngineConfig()
        self.executor = executor
        self.manager = KVCacheManager(group_specs, num_blocks=num_blocks,
                                      enable_prefix_caching=self.config.enable_prefix_caching,
                                      max_model_len=self.config.max_model_len, widths=group_widths)
        self.scheduler = Scheduler(self.manager, self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self.metrics = EngineMetrics()
        self._restarts_in_a_row = 0

    def add_request(self, request_id: str, prompt_token_ids, params: SamplingParams | None = None,
                    extra_keys: tuple = ()) -> None:
        """Validate and queue a request; raises ValueError (nothing queued) on bad input."""
        req = Request(request_id, prompt_token_ids, extra_keys=extra_keys)
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
        return self.scheduler.has_work()

    def step(self) -> list[SequenceUpdate]:
        """Run one step; return each request's new tokens and whether it finished."""
        plan = self.schedule()
        if plan is None:
            return []
        try:
            output = self.executor.execute(plan.step)
        except WorkerFailure:
            return self.recover()
        return self.apply(plan, output)

    # The three phases, for callers that run ``executor.execute`` off their event loop: ``schedule`` and
    # ``apply`` mutate state and must not overlap ``add_request`` / ``abort``; ``execute`` touches none.
    def schedule(self):
        plan = self.scheduler.schedule()
        if not plan.step.chunks:
            return None
        plan.started = time.perf_counter()
        return plan

    def apply(self, plan, output) -> list[SequenceUpdate]:
        self._restarts_in_a_row = 0
        dt = time.perf_counter() - plan.started
        updates = self.scheduler.update(plan, output)
        m = self.metrics
        m.steps += 1
        m.scheduled_tokens += plan.num_tokens
        m.step_time_s += dt
        m.last_step_time_s = dt
        m.delta_bytes += getattr(self.executor, "last_payload_bytes", 0)
        m.simulated_time_s += output.simulated_time_s
        for u in updates:
            if u.finished:
                m.finished[u.finish_reason] = m.finished.get(u.finish_reason, 0) + 1
        return updates

    def recover(self) -> list[SequenceUpdate]:
        """After a ``WorkerFailure``: restart the workers; running requests recompute from their tokens."""
        self._restarts_in_a_row += 1
        if self._restarts_in_a_row > self.config.max_worker_restarts:
            raise RuntimeError(f"workers failed {self._restarts_in_a_row} steps in a row; giving up")
        self.executor.restart()
        self.metrics.worker_restarts += 1
        self.metrics.recomputed_requests += self.scheduler.recompute_all()
        return []

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
            "worker_restarts": m.worker_restarts,
            "recomputed_requests": m.recomputed_requests,
            "finished": dict(m.finished),
            "workers": list(getattr(self.executor, "worker_names", [])),   # Ray actor names, stage order
        }
