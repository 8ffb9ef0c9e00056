"""Late joiners: a request that arrives while a step of fed decodes waits to be taken runs in that step's
batch (``cluster.engine.engine``, ``workers.runtime.step_loop``).

The scheduler's half without workers: joiners are first chunks of waiting requests within the step's room,
and withdrawing them (the workers took the step without them) leaves the scheduler and the KV manager as
before their admission, hit and statistics included. Then served over Ray with a real tiny model, on one
worker and on two tensor-parallel ranks: requests added while a long one decodes join its steps, and every
request's tokens are transformers' own.
"""
from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

from cluster.engine.build import build_engine
from cluster.engine.scheduler import Scheduler, Sequence
from cluster.engine.types import SamplingParams
from cluster.ray.executors import RayExecutor
from kvmanager import FullAttention, KVCacheManager, Request, SlidingWindow
from workers.models.tiny_models import build_tiny_model
from workers.protocol import StepOutput


def state(sched: Scheduler) -> tuple:
    mgr = sched.manager
    return ([q.request_id for q in sched.waiting], [q.request_id for q in sched.running], mgr.num_free_blocks,
            (mgr.stats.lookups, mgr.stats.queried_tokens, mgr.stats.hit_tokens, mgr.stats.preemptions),
            {rid: (q.status, q.req.num_computed_tokens, q.num_cached_tokens, q.on_workers, q.num_preemptions)
             for rid, q in sched.sequences.items()})


def test_withdrawn_joiners_leave_the_scheduler_and_the_manager_as_before_their_admission():
    mgr = KVCacheManager([FullAttention(4), SlidingWindow(4, window=8)], num_blocks=64, max_model_len=256)
    sched = Scheduler(mgr, max_num_batched_tokens=64)
    a_prompt = list(range(1, 31))
    sched.add(Sequence(Request("a", a_prompt), SamplingParams(max_tokens=100)))
    first = sched.schedule()                       # "a"'s prompt: 7 full blocks of 4 cached
    sched.launched(first)
    sched.update(first, StepOutput(first.step.step_id, {"a": 7}))
    decode = sched.schedule()                      # the step the joiners would join: "a"'s next token
    assert [(c.request_id, c.start_pos, len(c.token_ids)) for c in decode.step.chunks] == [("a", 30, 1)]
    sched.add(Sequence(Request("b", a_prompt[:20] + [99] * 10), SamplingParams(max_tokens=4)))
    sched.add(Sequence(Request("c", [50] * 12), SamplingParams(max_tokens=4)))
    before = state(sched)

    joiner = sched.schedule_joiners(64 - decode.num_tokens)
    assert joiner.joiner and joiner.step.step_id == decode.step.step_id + 1
    assert [(c.request_id, c.start_pos, len(c.token_ids)) for c in joiner.step.chunks] == [("b", 20, 10), ("c", 0, 12)]
    assert joiner.num_tokens == 22 and mgr.stats.hit_tokens == 20 and mgr.num_free_blocks < before[2]
    sched.withdraw(joiner)
    assert state(sched) == before

    sched.launched(decode)                         # the next step admits them as if nothing had happened
    again = sched.schedule()
    assert [(c.request_id, c.start_pos, len(c.token_ids)) for c in again.step.chunks] == \
        [("a", 31, 1), ("b", 20, 10), ("c", 0, 12)]
    assert mgr.stats.lookups == before[3][0] + 2 and mgr.stats.hit_tokens == 20


def test_no_joiner_takes_a_preempted_request_or_more_than_the_room():
    mgr = KVCacheManager([FullAttention(4)], num_blocks=64, max_model_len=256)
    sched = Scheduler(mgr, max_num_batched_tokens=64)
    sched.add(Sequence(Request("a", list(range(1, 9))), SamplingParams(max_tokens=8)))
    sched.add(Sequence(Request("b", list(range(100, 140))), SamplingParams(max_tokens=8)))
    joiner = sched.schedule_joiners(20)
    assert [(c.request_id, c.start_pos, len(c.token_ids)) for c in joiner.step.chunks] == [("a", 0, 8), ("b", 0, 12)]
    sched.launched(joiner)
    sched._preempt(sched.running[-1])              # "b" waits again at the head of the queue, preempted
    assert sched.schedule_joiners(20) is None     # it comes back through a step of its own


@functools.cache
def reference(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    m = build_tiny_model("tiny-gemma3", seed=0)
    out = m.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("tp", [1, 2])
def test_requests_that_arrive_while_a_request_decodes_join_its_steps_with_transformers_tokens(ray_runtime, tp):
    """With two tensor-parallel ranks too: they agree on the joiners each step runs (``test_step_loop``)."""
    from cluster.engine.core import EngineCore
    engine, _ = build_engine("tiny-gemma3", block_size=4, num_blocks=512, max_model_len=1024,
                             executor_cls=RayExecutor, async_scheduling=True, tensor_parallel_size=tp,
                             num_cpus_per_worker=1 / tp)
    assert engine.executor.supports_joins
    core = EngineCore(engine)
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    lock = threading.Condition()

    def emit(updates):
        with lock:
            for u in updates:
                tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
                if u.finished:
                    finished.add(u.request_id)
            lock.notify_all()
    thread = threading.Thread(target=core.run, args=(emit,), daemon=True)
    thread.start()
    prompts: dict[str, tuple[int, ...]] = {}
    longs: list[str] = []

    def start_long():
        """A long decode for arrivals to join; another once it ends (it stops at max_model_len)."""
        rid = f"long{len(longs)}"
        prompts[rid] = tuple(range(3 + len(longs), 40 + len(longs)))
        longs.append(rid)
        core.call(core.add_request, rid, list(prompts[rid]), SamplingParams(max_tokens=900)).result(60)
        with lock:
            assert lock.wait_for(lambda: len(tokens.get(rid, [])) >= 8, 60)

    try:
        start_long()
        # Arrivals while a long request decodes, a few milliseconds apart, until some joined (each decode step
        # of the tiny model is a few milliseconds, and an arrival joins only while a step waits to be taken:
        # on a loaded 2-core machine most waves have none, so the loop runs until three did).
        for wave in range(100):
            if longs[-1] in finished:
                start_long()
            for i in range(4):
                rid = f"w{wave}-{i}"
                prompts[rid] = tuple((11 * wave + 5 * i + j) % 250 + 3 for j in range(9 + 7 * i))
                core.call(core.add_request, rid, list(prompts[rid]), SamplingParams(max_tokens=6), admit=True)
                time.sleep(0.003)
            with lock:
                assert lock.wait_for(lambda: set(prompts) - set(longs) <= finished, 60)
            joined = core.call(lambda: core.engine.metrics.joined_requests).result(60)
            if joined >= 3:
                break
        assert joined >= 3
        core.call(core.abort, longs[-1]).result(60)
    finally:
        core.call(engine.executor.shutdown).result(60)
        core.close()
        thread.join(10)
    for rid, prompt in prompts.items():
        if rid not in longs:
            assert tokens[rid] == reference(prompt, 6), rid
    for rid in longs:
        assert tokens[rid] == reference(prompts[rid], len(tokens[rid])), rid
