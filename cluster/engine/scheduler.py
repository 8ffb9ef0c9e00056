"""The scheduler: which requests compute how many tokens each step, within a token budget.

Running requests go first (a decode token or their next prefill chunk), in admission order; then waiting
ones, each looked up in the prefix cache. A chunk that does not fit shrinks (halving) until it does; only
when not even one token fits is the most recently admitted running request that is not yet in this step
preempted: its blocks go back and it recomputes later (through the prefix cache). Long prompts are
budgeted one chunk at a time, never whole at admission.

Progress: every accepted request finishes. Admission refuses a request that could not compute its last
position even with the pool to itself (``blocks_to_finish``). The oldest running request is never
preempted (only later ones are) and, alone, always fits one token, so it gains at least one token every
step; preempted requests wait at the head of the queue in their admission order, so each in turn becomes
the oldest. Hence all requests accepted by step ``t`` finish by step ``t + sum(prompt + max_tokens)``
(when no step fails; after a failure nobody can be blamed for, its requests run one per step until each
has a step of its own succeed or has failed three in a row).

A step is committed when the workers accept it (``launched``): computed counts advance then, and each
sampling chunk leaves its request one ``pending`` token, drawn on the device but not yet known here. With
asynchronous scheduling the engine schedules step N+1 before step N's tokens arrive: a request with a
pending token computes exactly that token next, as a chunk marked ``from_last_step`` (the workers take
the token from step N's draws); a request whose pending token is sure to end it (``max_tokens``, the
context) is left out. Its blocks for that position are allocated before the token is known, which the
manager allows (it caches only blocks full of known tokens). ``update`` then appends the tokens: also to
a request preempted meanwhile (its token is as valid as if it had arrived first), and a request that
stopped on a token ends although its next chunk is already running: that chunk's result is dropped.

Host tier (``kvmanager/host_tier.py``): a waiting request whose hit needs blocks loaded from host is
admitted with its hit alone (no tokens: the manager caches a block once it is computed, and these are not
yet) and computes nothing until its loads are reported (``is_loading``); its hit's table then goes to
the workers with its first chunk. A load that fails preempts it in the manager; ``requeue`` puts it back
at the head of the queue. Every step carries the copies the manager scheduled since the last one
(``take_transfers``, taken early by ``has_work`` so that stores after the last request still go out); a
step with copies and no chunk is sent too. Isolated suspects take no host hit (they run alone, plainly).

Prompt logprobs (``SamplingParams.prompt_logprobs``): the workers score every prompt position a chunk
computes (``workers/protocol.py``), so such a request takes no prefix-cache hit until all its positions
are scored: a hit would leave the positions before it unscored. After a preemption it recomputes from
position 0 and the positions already delivered are not delivered again. ``max_tokens=0`` computes the
prompt (scoring it, if asked) and finishes without sampling.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmanager import KVCacheManager, Request
from kvmanager.checks import check_int
from kvmanager.host_tier import HostRef
from kvmanager.planning import peak_blocks
from workers.protocol import RequestStart, ScheduledChunk, StepInput, StepOutput

from .types import SamplingParams


@dataclass
class Sequence:
    """A request as the engine tracks it: the manager's Request plus sampling and status."""

    req: Request
    params: SamplingParams
    status: str = "waiting"               # waiting | running | finished
    finish_reason: str | None = None      # length | stop | abort | error
    error: str | None = None              # why, when finish_reason is "error"
    num_preemptions: int = 0
    num_faults: int = 0                   # unexplained step failures in a row while it was scheduled
    on_workers: bool = False              # its sampling spec was sent (and not forgotten since)
    num_cached_tokens: int | None = None  # prompt tokens its first admission found in the prefix cache
    pending: int = 0                      # tokens a launched step draws for it that ``update`` has not appended
    num_prompt_logprobs: int = 0          # prompt positions scored and delivered (1 .. this)
    unsent_block_ids: list | None = None  # its hit's table, allocated while its loads run, for its first chunk

    @property
    def scoring(self) -> bool:
        """It asks for prompt logprobs and some positions are not delivered yet."""
        return (self.params.prompt_logprobs is not None
                and self.num_prompt_logprobs < len(self.req.prompt_token_ids) - 1)

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
    error: str | None = None              # why, when finish_reason is "error"
    prompt_logprobs: list | None = None   # per prompt position after those delivered before: (logprob, top ids,
                                          # top logprobs, rank), if asked (positions 1 .. len(prompt) - 1 in all)
    error_type: str | None = None         # with error: request_failed (None says so too) | engine_unavailable |
                                          # server_shutting_down


@dataclass
class StepPlan:
    step: StepInput
    scheduled: list[Sequence] = field(default_factory=list)
    num_tokens: int = 0
    preempted: int = 0
    started: float = 0.0
    launched: bool = False                # the workers accepted it (``Scheduler.launched``)
    loading: list = field(default_factory=list)   # requests admitted with loads from host in this step
    joiner: bool = False                  # late joiners of the step before it (``schedule_joiners``)
    joined: list = field(default_factory=list)    # (plan, handle) of the joiners the workers ran with it


def blocks_to_finish(specs, num_tokens: int, widths=None) -> int:
    """Fewest pool units with which a request that ends at ``num_tokens`` tokens (prompt + max_tokens,
    capped at max_model_len) is sure to finish once it has the pool to itself.

    Its last token is sampled, never computed, so the positions computed are ``0 .. num_tokens - 2``.
    Computing position ``c`` holds, after the drop, exactly the blocks covering ``first_needed_token(c)
    .. c`` in every group, whatever came before: so the cheapest way through is one position per step,
    and it needs the peak of that over ``c`` (``kvmanager.planning.peak_blocks``, exact), no less. Nor
    does anything need more without being able to shrink to it: a prefill chunk that does not fit halves
    down to one token; a request restarting after preemption takes back a prefix hit of ``h`` tokens,
    which holds exactly what computing position ``h`` holds (cached blocks in the free queue count as
    free until taken back); a window smaller than a block still straddles two blocks, which the peak
    counts. Look-ahead slots would widen every step by their count; this scheduler reserves none.
    """
    return peak_blocks(specs, num_tokens - 1, widths)


class Scheduler:
    """``prefill_room``, if given, widens a step's token budget past ``max_num_batched_tokens`` to its
    decodes plus the prefill tokens that fit beside them at the decodes' own time (a roofline's knee for
    that batch: ``StepCostModel.prefill_room``, given the decodes' (position, 1) pairs)."""

    def __init__(self, manager: KVCacheManager, max_num_batched_tokens: int = 512, max_num_seqs: int = 256,
                 prefill_room: Callable[[list[tuple[int, int]]], int] | None = None):
        for name, v in (("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs)):
            check_int(name, v, 1)
        self.manager = manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.prefill_room = prefill_room
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}
        self._forget: list[str] = []          # finished or preempted requests whose mirrors may be stale
        self._mirrored: set[str] = set()      # requests whose block-table mirrors the workers hold
        self._capacity: int | None = None     # the most tokens one request alone can reach (computed once)
        self._suspects: set[str] = set()      # requests of a step that failed with nobody to blame
        self._step_id = 0
        self.num_preemptions = 0
        self._stores: list = []               # host-tier copies taken from the manager, not yet sent
        self._loads: list = []
        self.host_hit_requests = 0            # admissions whose hit loaded blocks from host
        self.host_hit_tokens = 0              # ... and the tokens of those hits
        self.host_loads_preempted = 0         # ... preempted while their loads were in flight (they recompute)

    # -- requests ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        rid = seq.request_id
        if rid in self.sequences:
            raise ValueError(f"duplicate request id {rid!r}")
        limit = self.manager.max_model_len
        if seq.req.num_tokens >= limit + (seq.params.max_tokens == 0):
            raise ValueError(f"request {rid!r}: prompt of {seq.req.num_tokens} tokens leaves no room to "
                             f"generate within max_model_len={limit}")
        if seq.params.max_tokens is None:   # the rest of the context, or what the pool holds for it alone
            room = min(limit, self._pool_token_capacity()) - seq.req.num_tokens
            seq.params = dataclasses.replace(seq.params, max_tokens=max(room, 1))
        # Refuse what could never finish, instead of letting it wait or preempt itself forever.
        total = min(seq.req.num_tokens + max(seq.params.max_tokens, 1), limit)
        need = blocks_to_finish(self.manager.specs, total, self.manager.widths)
        if need > self.manager.num_blocks - 1:
            raise ValueError(f"request {rid!r}: {total} tokens need up to {need} KV blocks, the pool has "
                             f"{self.manager.num_blocks - 1}; shorten the prompt or max_tokens")
        self.sequences[rid] = seq
        self.waiting.append(seq)

    def _pool_token_capacity(self) -> int:
        """The most tokens one request alone can reach in the pool (largest T whose peak fits)."""
        if self._capacity is None:
            usable, lo, hi = self.manager.num_blocks - 1, 1, self.manager.max_model_len
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if blocks_to_finish(self.manager.specs, mid, self.manager.widths) <= usable:
                    lo = mid
                else:
                    hi = mid - 1
            self._capacity = lo
        return self._capacity

    def abort(self, request_id: str) -> bool:
        """Finish a request now (client went away). False if it is unknown or already finished."""
        return self.fail(request_id, "abort")

    def fail(self, request_id: str, reason: str = "error", error: str | None = None) -> bool:
        """Finish a request with ``reason`` (abort, error); its blocks go back. False if unknown."""
        seq = self.sequences.get(request_id)
        if seq is None:
            return False
        seq.error = error
        self._finish(seq, reason)
        return True

    def has_work(self) -> bool:
        """Requests to run, or host-tier copies to send."""
        self._take_transfers()
        return bool(self.waiting or self.running or self._stores or self._loads)

    def _take_transfers(self) -> None:
        t = self.manager.take_transfers()
        if t:
            self._stores += t.stores
            self._loads += t.loads

    @property
    def prefill_backlog(self) -> int:
        """Prompt tokens not yet computed, over every request: what a new request's first token waits
        behind, as chunked prefill shares each step."""
        return sum(len(q.req.prompt_token_ids) - q.req.num_computed_tokens for q in self.sequences.values()
                   if q.req.num_computed_tokens < len(q.req.prompt_token_ids))

    # -- one step ------------------------------------------------------------------------------
    def step_budget(self) -> int:
        """Tokens the next step may compute: the fixed budget, or with ``prefill_room`` the running decodes
        and the prefill that fits beside them, whichever is more."""
        if self.prefill_room is None:
            return self.max_num_batched_tokens
        decodes = [(q.req.num_computed_tokens, 1) for q in self.running
                   if q.req.num_computed_tokens >= len(q.req.prompt_token_ids)]
        if not self.waiting and len(decodes) == len(self.running):
            return self.max_num_batched_tokens     # no prefill to place (and the floor holds every decode)
        return max(self.max_num_batched_tokens, len(decodes) + self.prefill_room(decodes))

    def schedule(self) -> StepPlan:
        budget = total = self.step_budget()
        plan = StepPlan(StepInput(self._step_id, [], []))
        self._step_id += 1

        if self._suspects:   # after a step failed with nobody to blame: its requests run one at a time
            seq = next(s for s in self.waiting if s.request_id in self._suspects)
            budget -= self._admit(seq, budget, plan, preempt=True) or 0
            return self._close(plan, total - budget)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            req = seq.req
            i += 1
            if seq.unsent_block_ids is not None and self.manager.is_loading(req.request_id):
                continue   # its hit is still coming from host
            if seq.pending and self._ends_with_pending(seq):
                continue   # the token in flight is its last: nothing more to compute
            if req.num_computed_tokens >= req.num_tokens + seq.pending:
                continue   # max_tokens=0: its prompt is computed, it ends when that step is applied
            n, new = self._fit_running(seq, min(req.num_tokens + seq.pending - req.num_computed_tokens, budget), plan)
            if new is None:
                break  # seq preempted itself; everything after it is gone too
            self._add_chunk(plan, seq, req.num_computed_tokens, n, new)
            budget -= n

        while self.waiting and budget > 0 and not plan.preempted and len(self.running) < self.max_num_seqs:
            n = self._admit(self.waiting[0], budget, plan, preempt=False)
            if n is None:
                break
            budget -= n
        return self._close(plan, total - budget)

    def schedule_joiners(self, room: int) -> StepPlan | None:
        """Late joiners of the step being launched (``workers.runtime.step_loop``): first chunks of waiting
        requests, within ``room`` tokens. Only requests never admitted before, and none that would preempt
        (those wait for the next step); None when none fits. The joiners run in the same batch as that step,
        so it must read no block they could take: the engine sends joiners only behind a step of fed decodes
        (whose new tokens complete no cached block), and never with a host tier (a hit from host loads in a
        step of its own)."""
        if self._suspects or room <= 0:
            return None
        plan = StepPlan(StepInput(self._step_id, []), joiner=True)
        budget = room
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and self.waiting[0].num_cached_tokens is None):
            n = self._admit(self.waiting[0], budget, plan, preempt=False)
            if n is None:
                break
            budget -= n
        if not plan.scheduled:
            return None
        self._step_id += 1
        plan.step.compositions = self.manager.pop_compositions()
        plan.num_tokens = room - budget
        return plan

    def withdraw(self, plan: StepPlan) -> None:
        """The workers did not take these joiners: their requests wait again at the head of the queue, in
        order, as if never admitted; their compositions go with the next step."""
        for seq in reversed(plan.scheduled):
            self.manager.withdraw(seq.req)
            self.running.remove(seq)
            seq.status, seq.on_workers, seq.num_cached_tokens = "waiting", False, None
            self.waiting.appendleft(seq)
        self.manager.unpop_compositions(plan.step.compositions)

    def _admit(self, seq: Sequence, budget: int, plan: StepPlan, preempt: bool) -> int | None:
        """Start a waiting request with its prefix hit and a first chunk; how many tokens it computes (None:
        it does not fit; 0: its hit loads from host first). Alone, the chunk halves until it fits;
        ``preempt`` makes it alone if need be (and takes no hit from host)."""
        mgr, req = self.manager, seq.req
        while True:
            hit, num_hit = mgr.get_computed_blocks(req) if not seq.scoring else (None, 0)
            if num_hit and any(type(b) is HostRef for blocks in hit for b in blocks):
                if not preempt:
                    return self._admit_loading(seq, hit, num_hit, plan)
                hit, num_hit = None, 0
            n = min(req.num_tokens - num_hit, budget)
            new = mgr.allocate_slots(req, n, num_hit, hit)
            while new is None and not self.running and n > 1:
                n //= 2
                new = mgr.allocate_slots(req, n, num_hit, hit)
            if new is not None:
                break
            if not (preempt and self.running):
                return None
            self._preempt(self.running[-1])
            plan.preempted += 1
        self.waiting.remove(seq)
        req.num_computed_tokens += num_hit
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_hit
        seq.status = "running"
        self.running.append(seq)
        self._add_chunk(plan, seq, req.num_computed_tokens, n, new)
        return n

    def _admit_loading(self, seq: Sequence, hit, num_hit: int, plan: StepPlan) -> int | None:
        """Admit a request with its hit alone: its blocks on host load during this step (0 tokens)."""
        req = seq.req
        new = self.manager.allocate_slots(req, 0, num_hit, hit)
        if new is None:
            return None
        self.waiting.remove(seq)
        req.num_computed_tokens += num_hit
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_hit
        seq.status = "running"
        seq.unsent_block_ids = [list(ids) for ids in new]
        self.running.append(seq)
        plan.loading.append(seq)
        self.host_hit_requests += 1
        self.host_hit_tokens += num_hit
        return 0

    def requeue(self, request_ids) -> None:
        """The manager preempted these requests (their loads from host failed): back to the head of the
        queue, in admission order."""
        lost = set(request_ids)
        for seq in reversed([s for s in self.running if s.request_id in lost]):
            self._back_to_waiting(seq)

    def host_tier_lost(self) -> list[str]:
        """The workers' host memory is gone (they restarted): every copy failed, including those not sent."""
        lost = self.manager.host_tier_lost()
        self.manager.take_transfers()
        self._stores, self._loads = [], []
        self.requeue(lost)
        return lost

    def _close(self, plan: StepPlan, num_tokens: int) -> StepPlan:
        self._take_transfers()
        if plan.step.chunks or self._stores or self._loads:   # otherwise nothing is sent: keep the mirrors
            # Only mirrors the workers hold: a request that failed before its first chunk ran has none.
            forget = list(dict.fromkeys(r for r in self._forget if r in self._mirrored))
            self._mirrored.difference_update(forget)
            plan.step.forget, self._forget = forget, []
            plan.step.compositions = self.manager.pop_compositions()
            plan.step.kv_stores, plan.step.kv_loads = self._stores, self._loads
            self._stores, self._loads = [], []
        plan.num_tokens = num_tokens
        return plan

    def _fit_running(self, seq: Sequence, n: int, plan: StepPlan):
        """Allocate the largest chunk of at most ``n`` tokens that fits (halving); if not even one token
        fits, preempt the newest running request and try again. Returns (tokens, new block ids), or
        (0, None) once ``seq`` itself was the one preempted."""
        mgr, req = self.manager, seq.req
        while True:
            m = n
            new = mgr.allocate_slots(req, m)
            while new is None and m > 1:
                m //= 2
                new = mgr.allocate_slots(req, m)
            if new is not None:
                return m, new
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted += 1
            if victim is seq:
                return 0, None

    def _ends_with_pending(self, seq: Sequence) -> bool:
        req = seq.req
        return (len(req.output_token_ids) + seq.pending >= seq.params.max_tokens
                or req.num_tokens + seq.pending >= self.manager.max_model_len)

    def _add_chunk(self, plan: StepPlan, seq: Sequence, start: int, n: int, new_block_ids) -> None:
        req = seq.req
        first = None
        if not seq.on_workers:   # its first chunk since admission: the workers learn how it samples
            spec = seq.params.spec
            if spec.prompt_logprobs is not None and not seq.scoring:
                spec = dataclasses.replace(spec, prompt_logprobs=None)   # every position is delivered already
            num_prompt = len(req.prompt_token_ids)
            seen_from = 0 if spec.repetition_penalty != 1.0 else min(num_prompt, start)
            seen = req.all_token_ids[seen_from:start] if spec.has_penalties else []
            first = RequestStart(spec, num_prompt, seen)
            seq.on_workers = True
        fed = start + n > req.num_tokens   # the token a launched step is drawing (n == 1: see module doc)
        if seq.unsent_block_ids is not None:   # its first chunk after loading its hit: the whole table
            new_block_ids = [hit + list(ids) for hit, ids in zip(seq.unsent_block_ids, new_block_ids)]
            seq.unsent_block_ids = None
        plan.step.chunks.append(ScheduledChunk(
            request_id=req.request_id, token_ids=[0] if fed else req.all_token_ids[start:start + n], start_pos=start,
            new_block_ids=list(new_block_ids), sample=start + n == req.num_tokens + seq.pending and seq.params.max_tokens != 0,
            start=first,
            from_last_step=fed))
        plan.scheduled.append(seq)

    def launched(self, plan: StepPlan) -> None:
        """The workers accepted the step: its requests' mirrors exist, their computed counts advance, and
        each sampling chunk leaves a pending token until ``update``."""
        plan.launched = True
        for chunk, seq in zip(plan.step.chunks, plan.scheduled):
            self._mirrored.add(chunk.request_id)   # its mirror now exists, even if it finished meanwhile
            if seq.status != "running":
                continue  # aborted before the launch (its mirror is in _forget)
            seq.req.num_computed_tokens += len(chunk.token_ids)
            seq.pending += chunk.sample

    def update(self, plan: StepPlan, output: StepOutput) -> list[SequenceUpdate]:
        """Apply a launched step's results: append sampled tokens, finish sequences.

        A request the workers could not sample for (``output.failed``) finishes with reason "error"."""
        updates = []
        failed = output.failed
        for chunk, seq in zip(plan.step.chunks, plan.scheduled):
            if seq.status == "finished":
                continue  # aborted or stopped while the step ran (its mirror is in _forget)
            seq.num_faults = 0
            self._suspects.discard(seq.request_id)
            req = seq.req
            if chunk.sample:
                seq.pending -= 1
            if failed and seq.request_id in failed:
                self.fail(seq.request_id, "error", failed[seq.request_id])
                updates.append(SequenceUpdate(seq.request_id, [], True, "error", error=seq.error))
                continue
            end = chunk.start_pos + len(chunk.token_ids)
            prompt = self._prompt_logprobs(seq, output.prompt_logprobs.get(seq.request_id), end)
            if isinstance(prompt, str):
                self.fail(seq.request_id, "error", prompt)
                updates.append(SequenceUpdate(seq.request_id, [], True, "error", error=prompt))
                continue
            if not chunk.sample:
                if seq.params.max_tokens == 0 and end >= req.num_tokens:
                    self._finish(seq, "length")
                    updates.append(SequenceUpdate(seq.request_id, [], True, "length", None,
                                                  seq.num_cached_tokens or 0, prompt_logprobs=prompt))
                elif prompt:
                    updates.append(SequenceUpdate(seq.request_id, [], False, prompt_logprobs=prompt))
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
                                          None if logprobs is None else [logprobs], seq.num_cached_tokens or 0,
                                          prompt_logprobs=prompt))
        return updates

    @staticmethod
    def _prompt_logprobs(seq: Sequence, entry, end: int) -> list | None | str:
        """The prompt positions ``entry`` scores beyond those delivered (None if none); a message when they
        do not follow on, or when the chunk ending at ``end`` completed the prompt and some positions are
        still unscored (the request must fail: a gap would be silent)."""
        new = None
        if entry is not None and seq.params.prompt_logprobs is not None:
            start, values, top_ids, top_values, ranks = entry
            skip = seq.num_prompt_logprobs + 1 - start
            if skip < 0:
                return (f"prompt logprobs: the workers scored positions from {start} on, but only 1.."
                        f"{seq.num_prompt_logprobs} were delivered")
            new = list(zip(values[skip:], top_ids[skip:], top_values[skip:], ranks[skip:])) or None
            seq.num_prompt_logprobs += len(new or ())
        req = seq.req
        if seq.scoring and end >= len(req.prompt_token_ids):
            return (f"prompt logprobs: positions {seq.num_prompt_logprobs + 1}..{len(req.prompt_token_ids) - 1} "
                    "were computed but not scored")
        return new

    def drop_chunk(self, plan: StepPlan, request_id: str, error: str) -> SequenceUpdate | None:
        """A step failed on one request's chunk before changing anything: fail that request and take its
        chunk out, so the rest of the step can run again as it is. None if the step has no such chunk."""
        for i, chunk in enumerate(plan.step.chunks):
            if chunk.request_id == request_id:
                seq = plan.scheduled[i]
                del plan.step.chunks[i], plan.scheduled[i]
                plan.num_tokens -= len(chunk.token_ids)
                if seq.status == "running":   # its blocks were cached when allocated
                    self.manager.uncache_from(seq.req, chunk.start_pos)
                self.fail(request_id, "error", error)
                return SequenceUpdate(request_id, [], True, "error", error=error)
        return None

    def blame(self, plan: StepPlan, max_faults: int) -> list[SequenceUpdate]:
        """A step failed with nobody to blame: each of its requests becomes a suspect and runs alone until a
        step of its own succeeds; one that fails ``max_faults`` steps in a row is failed. So a request that
        breaks the workers without naming itself fails alone, and the others go on."""
        updates = []
        for seq in plan.scheduled:
            if seq.status != "running":
                continue
            seq.num_faults += 1
            self._suspects.add(seq.request_id)
            if seq.num_faults >= max_faults:
                message = f"the workers failed {seq.num_faults} times in a row on steps computing this request"
                self.fail(seq.request_id, "error", message)
                updates.append(SequenceUpdate(seq.request_id, [], True, "error", error=message))
        return updates

    @property
    def isolating(self) -> bool:
        """Requests of a step that failed with nobody to blame are running one at a time."""
        return bool(self._suspects)

    def recompute_all(self) -> int:
        """Workers lost their KV (a fault): every running request starts over; nothing is lost. Tokens a
        lost step was drawing never arrive: they are recomputed too."""
        victims = list(self.running)
        for seq in reversed(victims):
            self._preempt(seq)
        for seq in self.sequences.values():
            seq.pending = 0
        self._forget = []  # the new workers have no mirrors to drop, and know no composite
        self._mirrored.clear()
        if not self.manager.reset_prefix_cache():     # cached hashes would name KV the new workers lack
            raise RuntimeError("KV cache reset refused: blocks are still held after preempting every request")
        self.manager.replay_compositions()
        return len(victims)

    # -- internals -----------------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        if self.manager.is_loading(seq.request_id):
            self.host_loads_preempted += 1
        self.manager.preempt(seq.req)
        self._back_to_waiting(seq)

    def _back_to_waiting(self, seq: Sequence) -> None:
        """A preempted request (its blocks released) to the head of the queue; the workers drop its mirror."""
        self.running.remove(seq)
        seq.status = "waiting"
        seq.on_workers = False
        seq.unsent_block_ids = None
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._forget.append(seq.request_id)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._suspects.discard(seq.request_id)
        if seq.status == "running":
            self.manager.free(seq.req)
            self.running.remove(seq)
            self._forget.append(seq.request_id)
        elif seq.status == "waiting":
            self.waiting.remove(seq)
        seq.status = "finished"
        seq.finish_reason = reason
        del self.sequences[seq.request_id]
