"""The Ray executor's same-node path: steps through shared-memory rings, not Ray (``workers.runtime.step_loop``).

The tokens are the in-process executor's (simulated workers: a function of seed, request and position)
or transformers' (tiny models), through pipeline stages, tensor-parallel ranks and asynchronous
scheduling; a worker killed while idle or during a step is a ``WorkerFailure``, the workers restart on
new rings and every request finishes; a chunk the workers refuse fails its request alone; the rings
leave nothing in /dev/shm. Real Ray actors and processes throughout.
"""
from __future__ import annotations

import functools
import os
import time

import pytest
import torch

from cluster.engine.build import build_engine
from cluster.engine.engine import WorkerFailure
from cluster.engine.types import SamplingParams
from cluster.ray.executors import RayExecutor
from workers.models.tiny_models import build_tiny_model
from workers.shm_channel import process_alive

SIM = dict(simulated_gpu="H100-80GB", block_size=16, num_blocks=512, max_num_batched_tokens=64)
SIM_PROMPTS = [[(13 * i + j) % 1000 + 1 for j in range(40 + 9 * i)] for i in range(5)]
PROMPTS = [[(7 * i + j) % 256 for j in range(20 + 3 * i)] for i in range(5)]


@functools.cache
def reference(model: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    m = build_tiny_model(model, seed=0)
    out = m.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def run_all(engine, requests, max_steps: int = 2000) -> tuple[dict, dict]:
    for rid, prompt, max_tokens in requests:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens))
    tokens, reasons = {rid: [] for rid, _, _ in requests}, {}
    for _ in range(max_steps):
        if not engine.has_work():
            return tokens, reasons
        for u in engine.step():
            tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.finished:
                assert u.request_id not in reasons     # answered once
                reasons[u.request_id] = u.finish_reason
    raise AssertionError("the engine did not finish")


def sim_requests(prefix: str = "r", max_tokens: int = 12):
    return [(f"{prefix}{i}", p, max_tokens) for i, p in enumerate(SIM_PROMPTS)]


@functools.cache
def sim_reference(pp: int, prefix: str = "r") -> dict:
    """The in-process executor's tokens for the same engine and requests (simulated draws)."""
    engine, _ = build_engine("gemma-3-27b", pipeline_parallel_size=pp, **SIM)
    tokens, reasons = run_all(engine, sim_requests(prefix))
    assert set(reasons.values()) == {"length"}
    return tokens


def segments() -> set[str]:
    """Shared-memory segments this process (the engine) made that are still named in /dev/shm."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"swakv-{os.getpid()}-")}


def ring_names(ex) -> set[str]:
    """The rings the executor's workers read and write now, by the names they were made under."""
    return {handle.name for role in ex._rings.roles() for key, handle in role.items()
            if key in ("steps", "upstream", "downstream", "replies")}


class RanksPerStage(RayExecutor):
    """Every simulated stage as two tensor-parallel ranks (simulated workers run one per stage otherwise),
    so that a stage's ranks read the step ring and the link ring side by side."""

    @classmethod
    def create(cls, stage_kwargs, args, ranks_per_stage, **options):
        kwargs = [dict(kw) for kw in stage_kwargs for _ in range(2)]
        return cls(kwargs, ranks_per_stage=2, num_cpus_per_worker=0.5, **options)


@pytest.mark.parametrize("pp, executor", [(2, RayExecutor), (2, RanksPerStage), (1, RanksPerStage)])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_simulated_stages_and_ranks_over_the_rings_give_the_in_process_tokens(ray_runtime, pp, executor,
                                                                                 async_scheduling):
    assert not segments()
    engine, _ = build_engine("gemma-3-27b", pipeline_parallel_size=pp, tensor_parallel_size=2, **SIM,
                             executor_cls=executor, async_scheduling=async_scheduling)
    ex = engine.executor
    try:
        assert ex.uses_shm_rings and ex.supports_async
        assert len(ex.actors) == pp * (2 if executor is RanksPerStage else 1)
        assert len(ring_names(ex)) == pp + 1           # the step ring, a link per later stage, the replies
        assert not segments()                          # every worker mapped them: their names are gone
        tokens, reasons = run_all(engine, sim_requests())
        assert tokens == sim_reference(pp) and set(reasons.values()) == {"length"}
        assert engine.stats()["worker_restarts"] == 0
    finally:
        ex.shutdown()
    assert not segments()


class Recording(RayExecutor):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def submit(self, step):
        self.calls.append(("submit", step.step_id))
        return super().submit(step)

    def collect(self, handle):
        self.calls.append(("collect", handle[1]))
        return super().collect(handle)


@pytest.mark.parametrize("tp", [1, 2])
def test_asynchronous_scheduling_over_the_rings_gives_transformers_greedy_tokens(ray_runtime, tp):
    engine, _ = build_engine("tiny-gemma2", tensor_parallel_size=tp, block_size=4, num_blocks=200,
                             max_num_batched_tokens=16, async_scheduling=True, executor_cls=Recording,
                             num_cpus_per_worker=0.5)
    try:
        assert engine.executor.supports_async
        tokens, reasons = run_all(engine, [(f"r{i}", p, 10) for i, p in enumerate(PROMPTS[:4])])
        assert tokens == {f"r{i}": reference("tiny-gemma2", tuple(p), 10) for i, p in enumerate(PROMPTS[:4])}
        assert set(reasons.values()) == {"length"} and engine.stats()["worker_restarts"] == 0
        calls = engine.executor.calls
        # step N+1 was submitted before step N was collected, for most steps
        overlapped = sum(1 for i, (kind, sid) in enumerate(calls)
                         if kind == "submit" and ("collect", sid - 1) in calls[i:])
        assert overlapped >= len([c for c in calls if c[0] == "submit"]) - 12
    finally:
        engine.executor.shutdown()


def test_a_chunk_refused_while_a_step_runs_fails_its_request_alone_over_the_rings(ray_runtime):
    engine, _ = build_engine("tiny-gemma2", block_size=4, num_blocks=64, max_num_batched_tokens=64,
                             async_scheduling=True, executor_cls=RayExecutor, num_cpus_per_worker=0.5)
    try:
        engine.config.vocab_size = None          # only the worker (vocab 256) checks token ids now
        engine.add_request("good-1", PROMPTS[0], SamplingParams(max_tokens=6))
        tokens = {}
        for _ in range(2):
            for u in engine.step():
                tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
        assert engine._inflight is not None     # good-1's step is running when the bad request arrives
        more, reasons = run_all(engine, [("bad", [1, 2, 300], 6), ("good-2", PROMPTS[1], 6)])
        for rid, t in more.items():
            tokens.setdefault(rid, []).extend(t)
        assert reasons == {"good-1": "length", "bad": "error", "good-2": "length"}
        assert (tokens["good-1"], tokens["good-2"]) == (reference("tiny-gemma2", tuple(PROMPTS[0]), 6),
                                                        reference("tiny-gemma2", tuple(PROMPTS[1]), 6))
        assert engine.metrics.worker_restarts == 0
    finally:
        engine.executor.shutdown()


def wait_dead(pid: int) -> None:
    for _ in range(600):
        if not process_alive(pid):
            return
        time.sleep(0.05)
    raise AssertionError(f"worker pid {pid} still alive after ray.kill")


def test_a_worker_killed_while_idle_fails_the_next_step_and_the_requests_finish_on_new_rings(ray_runtime):
    ray = ray_runtime
    engine, _ = build_engine("gemma-3-27b", pipeline_parallel_size=2, **SIM, executor_cls=RayExecutor)
    ex = engine.executor
    try:
        before = ring_names(ex)
        ray.kill(ex.actors[1], no_restart=True)          # the last stage: the one that answers
        wait_dead(ex.pids[1])
        tokens, reasons = run_all(engine, sim_requests())
        assert tokens == sim_reference(2) and set(reasons.values()) == {"length"}
        assert engine.stats()["worker_restarts"] == 1
        after = ring_names(ex)
        assert len(after) == 3 and not after & before    # new rings
        assert not segments()                            # neither the old rings nor the new ones are named
        assert all(process_alive(pid) for pid in ex.pids)
    finally:
        ex.shutdown()
    assert not segments()


class KillsDuringAStep(RayExecutor):
    """Kills worker ``victim`` once the workers took the ``at``-th step (it sleeps the modelled step
    times ``sleep_factor``, so the worker is inside it); restarted workers take no time."""

    victim, at = 0, 1

    def _send(self, step, ack):
        handle = super()._send(step, ack)
        self.sent = getattr(self, "sent", 0) + 1
        if self.sent == self.at:
            import ray
            for kw in self.stage_kwargs:
                kw["sleep_factor"] = 0.0
            ray.kill(self.actors[self.victim], no_restart=True)
        return handle


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("victim", [0, 1])
def test_a_worker_killed_during_a_step_is_a_worker_failure_and_every_request_finishes(ray_runtime, victim,
                                                                                       async_scheduling):
    executor = type("Kills", (KillsDuringAStep,), {"victim": victim})
    engine, _ = build_engine("gemma-3-27b", pipeline_parallel_size=2, **SIM,
                             sleep_factor=500.0, executor_cls=executor, async_scheduling=async_scheduling)
    ex = engine.executor
    try:
        tokens, reasons = run_all(engine, sim_requests())
        assert tokens == sim_reference(2) and set(reasons.values()) == {"length"}
        stats = engine.stats()
        assert stats["worker_restarts"] == 1 and stats["recomputed_requests"] >= 1
    finally:
        ex.shutdown()
    assert not segments()


def test_a_step_sent_to_a_killed_worker_raises_worker_failure_not_a_hang(ray_runtime):
    ray = ray_runtime
    engine, _ = build_engine("gemma-3-27b", **SIM, executor_cls=RayExecutor)
    ex = engine.executor
    try:
        engine.add_request("a", SIM_PROMPTS[0], SamplingParams(max_tokens=4))
        plan = engine.schedule()
        ray.kill(ex.actors[0], no_restart=True)
        wait_dead(ex.pids[0])
        with pytest.raises(WorkerFailure, match=r"died"):
            handle = ex.submit(plan.step)
            ex.collect(handle)
    finally:
        ex.shutdown()
    assert not segments()


def test_a_request_that_arrives_while_a_step_runs_is_in_the_next_step_not_the_one_after(ray_runtime):
    """Served (``EngineCore.run``) with asynchronous scheduling, the next step is scheduled shortly before the
    one in flight ends (``step_clock``), so a request added in between is in it: its first token comes with
    the second step to end after it was added (one step earlier than scheduling at once would give)."""
    import threading

    from cluster.engine.core import EngineCore
    engine, _ = build_engine("gemma-3-27b", **SIM, executor_cls=RayExecutor, async_scheduling=True,
                             sleep_factor=8.0)       # over 100 ms a step: the add below lands well inside one
    core = EngineCore(engine)
    emitted, finished = [], set()
    lock = threading.Condition()

    def emit(updates):
        with lock:
            emitted.append({u.request_id: len(u.new_token_ids) for u in updates})
            finished.update(u.request_id for u in updates if u.finished)
            lock.notify_all()
    thread = threading.Thread(target=core.run, args=(emit,), daemon=True)
    thread.start()
    try:
        core.call(core.add_request, "a", SIM_PROMPTS[0], SamplingParams(max_tokens=12)).result(60)
        with lock:       # "a" decodes for a few steps (the clock learns its step time), then at a step's end ...
            assert lock.wait_for(lambda: sum(e.get("a", 0) for e in emitted) >= 6, 60)
            mark = len(emitted)
        time.sleep(0.01)  # ... "b" comes 10 ms into the next step
        core.call(core.add_request, "b", SIM_PROMPTS[1][:40], SamplingParams(max_tokens=2)).result(60)
        with lock:
            assert lock.wait_for(lambda: any("b" in e for e in emitted[mark:]), 60)
            steps = [e for e in emitted[mark:] if e]
        first_b = next(i for i, e in enumerate(steps) if "b" in e)
        assert first_b == 1          # the step running when "b" came ends, then the one "b" is in
        with lock:
            assert lock.wait_for(lambda: finished == {"a", "b"}, 60)
    finally:
        core.call(engine.executor.shutdown).result(60)
        core.close()
        thread.join(10)
