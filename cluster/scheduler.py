"""The scheduler: which requests compute how many tokens each step, within a token budget.

Running requests go first (a decode token or their next prefill chunk), in admission order; then waiting
ones, each looked up in the prefix cache. When the pool is short, the most recently admitted running
request that is not yet in this step is preempted: its blocks go back and it recomputes later (through
the prefix cache). Long prompts are budgeted one chunk at a time, never whole at admission.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from kvmanager import KVCacheManager, Request
from kvmanager.planning import max_blocks_held
from workers.protocol import RequestStart, SamplingSpec, ScheduledChunk, StepInput, StepOutput


@dataclass(frozen=True)
class SamplingParams:
    """A request's limits and stops (the engine's) and how it samples (the workers', as ``spec``)."""

    max_tokens: int | None = None          # None: the rest of the context, as far as the pool lets one request go
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] | dict = ()
    logprobs: int | None = None
    seed: int | None = None                # any integer in [-2**63, 2**64); sent reduced mod 2**64
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64), got {self.seed!r}")
        knobs = {f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingSpec)}
        knobs["seed"] = None if self.seed is None else self.seed % 2**64
        object.__setattr__(self, "spec", SamplingSpec(**knobs))   # checks every knob: ValueError names it


@dataclass
class Sequence:
    """A request as the engine tracks it: the manager's Request plus sampling and status."""

    req: Request
    params: SamplingParams
    status: str = "waiting"               # waiting | running | finished
    finish_reason: str | None = None      # length | stop | abort | error
    num_preemptions: int = 0
    on_workers: bool = False              # its sampling spec was sent (and not forgotten since)
    num_cached_tokens: int | None = None  # prompt tokens its first admission found in the prefix cache

    @property
    def request_id(self) -> str:
        return self.req.request_id


@dataclass
class SequenceUpdate:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list | None = None          # per new token: (raw logprob, top ids, top logprobs), if asked
    num_cached_tokens: int = 0


@dataclass
class StepPlan:
    step: StepInput
    scheduled: list[Sequence] = field(default_factory=list)
    num_tokens: int = 0
    preempted: int = 0
    started: float = 0.0


class Scheduler:
    def __init__(self, manager: KVCacheManager, max_num_batched_tokens: int = 512, max_num_seqs: int = 256):
        for name, v in (("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.manager = manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}
        self._forget: list[str] = []          # worker mirrors to drop at the next step
        self._step_id = 0
        self.num_preemptions = 0

    # -- requests ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        rid = seq.request_id
        if rid in self.sequences:
            raise ValueError(f"duplicate request id {rid!r}")
        limit = self.manager.max_model_len
        if seq.req.num_tokens >= limit:
            raise ValueError(f"request {rid!r}: prompt of {seq.req.num_tokens} tokens leaves no room to "
                             f"generate within max_model_len={limit}")
        if seq.params.max_tokens is None:   # the rest of the context, or what the pool holds for it alone
            room = min(limit, self._pool_token_capacity()) - seq.req.num_tokens
            seq.params = dataclasses.replace(seq.params, max_tokens=max(room, 1))
        # Refuse what could never fit, instead of letting it wait forever at the head of the queue: even
        # alone, its last decode step must fit (prefill chunks shrink to fit when nothing else runs).
        total = min(seq.req.num_tokens + seq.params.max_tokens, limit)
        need = self._units_held(total)
        if need > self.manager.num_blocks - 1:
            raise ValueError(f"request {rid!r}: {total} tokens need up to {need} KV blocks, the pool has "
                             f"{self.manager.num_blocks - 1}; shorten the prompt or max_tokens")
        self.sequences[rid] = seq
        self.waiting.append(seq)

    def _units_held(self, num_tokens: int) -> int:
        """Pool units one request holds at most at ``num_tokens`` (a block of a width-k group is k units)."""
        return sum(max_blocks_held(s, num_tokens) * w for s, w in zip(self.manager.specs, self.manager.widths))

    def _pool_token_capacity(self) -> int:
        """The most tokens one request alone can reach in the pool (largest T whose peak fits)."""
        if getattr(self, "_capacity", None) is None:
            usable, lo, hi = self.manager.num_blocks - 1, 1, self.manager.max_model_len
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._units_held(mid) <= usable:
                    lo = mid
                else:
                    hi = mid - 1
            self._capacity = lo
        return self._capacity

    def abort(self, request_id: str) -> bool:
        """Finish a request now (client went away). False if it is unknown or already finished."""
        seq = self.sequences.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        mgr = self.manager
        budget = self.max_num_batched_tokens
        plan = StepPlan(StepInput(self._step_id, [], []))
        self._step_id += 1
        scheduled_ids: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            req = seq.req
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            new = mgr.allocate_slots(req, n)
            while new is None:
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted += 1
                if victim is seq:
                    break
                new = mgr.allocate_slots(req, n)
            if new is None:
                break  # seq preempted itself; everything after it is gone too
            self._add_chunk(plan, seq, req.num_computed_tokens, n, new)
            scheduled_ids.add(seq.request_id)
            budget -= n
            i += 1

        while self.waiting and budget > 0 and not plan.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            req = seq.req
            hit, num_hit = mgr.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            new = mgr.allocate_slots(req, n, num_hit, hit)
            while new is None and not self.running and n > 1:  # alone and still short: smaller chunks
                n //= 2
                new = mgr.allocate_slots(req, n, num_hit, hit)
            if new is None:
                break
            self.waiting.popleft()
            req.num_computed_tokens += num_hit
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_hit
            seq.status = "running"
            self.running.append(seq)
            self._add_chunk(plan, seq, req.num_computed_tokens, n, new)
            budget -= n

        if plan.step.chunks:  # otherwise nothing is sent: keep the mirrors to drop for the next step
            plan.step.forget, self._forget = self._forget, []
            plan.step.compositions = mgr.pop_compositions()
        plan.num_tokens = self.max_num_batched_tokens - budget
        return plan

    def _add_chunk(self, plan: StepPlan, seq: Sequence, start: int, n: int, new_block_ids) -> None:
        req = seq.req
        first = None
        if not seq.on_workers:   # its first chunk since admission: the workers learn how it samples
            spec = seq.params.spec
            num_prompt = len(req.prompt_token_ids)
            seen_from = 0 if spec.repetition_penalty != 1.0 else min(num_prompt, start)
            seen = req.all_token_ids[seen_from:start] if spec.has_penalties else []
            first = RequestStart(spec, num_prompt, seen)
            seq.on_workers = True
        plan.step.chunks.append(ScheduledChunk(
            request_id=req.request_id, token_ids=req.all_token_ids[start:start + n], start_pos=start,
            new_block_ids=list(new_block_ids), sample=start + n == req.num_tokens, start=first))
        plan.scheduled.append(seq)

    def update(self, plan: StepPlan, output: StepOutput) -> list[SequenceUpdate]:
        """Apply a step's results: advance computed counts, append sampled tokens, finish sequences."""
        updates = []
        for chunk, seq in zip(plan.step.chunks, plan.scheduled):
            if seq.status != "running":
                continue  # aborted while the step ran
            req = seq.req
            req.num_computed_tokens += len(chunk.token_ids)
            if not chunk.sample:
                continue
            token = output.sampled[seq.request_id]
            req.append_output_token_ids([token])
            reason = None
            if token in seq.params.stop_token_ids:
                reason = "stop"
            elif len(req.output_token_ids) >= seq.params.max_tokens:
                reason = "length"
            elif req.num_tokens >= self.manager.max_model_len:
                reason = "length"
            if reason:
                self._finish(seq, reason)
            logprobs = output.logprobs.get(seq.request_id)
            updates.append(SequenceUpdate(seq.request_id, [token], reason is not None, reason,
                                          None if logprobs is None else [logprobs], seq.num_cached_tokens or 0))
        return updates

    def recompute_all(self) -> int:
        """Workers lost their KV (a fault): every running request starts over; nothing is lost."""
        victims = list(self.running)
        for seq in reversed(victims):
            self._preempt(seq)
        self._forget = []  # the new workers have no mirrors to drop, and know no composite
        self.manager.reset_prefix_cache()
        self.manager.replay_compositions()
        return len(victims)

    # -- internals -----------------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.manager.preempt(seq.req)
        self.running.remove(seq)
        seq.status = "waiting"
        seq.on_workers = False
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._forget.append(seq.request_id)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == "running":
            self.manager.free(seq.req)
            self.running.remove(seq)
            self._forget.append(seq.request_id)
        elif seq.status == "waiting":
            self.waiting.remove(seq)
        seq.status = "finished"
        seq.finish_reason = reason
        del self.sequences[seq.request_id]
