"""One request never stops the engine; request ids are the engine's own; the offline LLM's EOS and seeds.

Faults are real where the real thing can produce them: a model whose embedding of one token is NaN
(its requests get NaN logits), an engine and worker that disagree on the vocabulary (the worker refuses
the chunk). Where nothing real fails on demand (a worker that crashes without saying why, workers that
cannot be placed) an executor injects the failure around the real worker. No Ray here: the engine
actor's logic is ``EngineService``, a plain class; ``test_engine.py`` and ``test_serve.py`` cover Ray.
"""
from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from workers.wire import encode_step
from cluster.engine.engine import WorkerFailure
from cluster.ray.engine_actor import SHUTTING_DOWN, EngineService, EngineUnavailable
from cluster.engine.executor import LocalExecutor
from cluster.engine.build import build_engine
from cluster.engine.llm import LLM
from cluster.engine.types import SamplingParams
from workers.protocol import RequestError, RequestStart, SamplingSpec, ScheduledChunk, StepInput
from workers.models.tiny_models import build_tiny_model
from drivers import CrashesOn

MODEL = "tiny-llama"
POISON = 250                        # its embedding is NaN in the poisoned copy; no clean output below holds it
CLEAN = [[5, 6, 7, 8, 9, 10], [100, 101, 102, 103], [42] * 5]


@functools.cache
def reference(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    m = build_tiny_model(MODEL, seed=0)
    out = m.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def run_all(engine, max_steps: int = 500) -> tuple[dict, dict, dict]:
    tokens, reasons, errors = {}, {}, {}
    for _ in range(max_steps):
        if not engine.has_work():
            return tokens, reasons, errors
        for u in engine.step():
            tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.finished:
                assert u.request_id not in reasons   # answered once
                reasons[u.request_id], errors[u.request_id] = u.finish_reason, u.error
    raise AssertionError("the engine did not finish")


# -- faults a request brings ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def poisoned_model(tmp_path_factory):
    m = build_tiny_model(MODEL, seed=0)
    with torch.no_grad():
        m.model.embed_tokens.weight[POISON] = float("nan")
    path = tmp_path_factory.mktemp("poisoned")
    m.save_pretrained(path)
    return str(path)


def test_a_request_with_nan_logits_fails_alone_and_the_others_get_their_tokens(poisoned_model):
    assert all(POISON not in reference(tuple(p), 8) for p in CLEAN)   # the clean requests never meet it
    llm = LLM(poisoned_model, block_size=4, num_blocks=64, max_num_batched_tokens=64)
    outs = llm.generate([CLEAN[0], [1, 2, POISON, 3], CLEAN[1], CLEAN[2]], max_tokens=8)
    bad = outs[1]
    assert (bad.output_token_ids, bad.finish_reason) == ([], "error")
    assert bad.error == "the model produced NaN logits for this request"
    assert [o.output_token_ids for o in outs[::2] + outs[3:]] == [reference(tuple(p), 8) for p in CLEAN]
    assert [o.finish_reason for o in outs if o is not bad] == ["length"] * 3
    stats = llm.engine.stats()
    assert (stats["finished"], stats["worker_restarts"]) == ({"length": 3, "error": 1}, 0)
    assert llm.engine.manager.num_free_blocks == 63
    (again,) = llm.generate([CLEAN[0]], max_tokens=8)   # and the engine goes on
    assert again.output_token_ids == reference(tuple(CLEAN[0]), 8)


def test_a_chunk_the_worker_refuses_fails_its_request_and_the_step_runs_without_it():
    engine, _ = build_engine(MODEL, block_size=4, num_blocks=64)
    engine.config.vocab_size = None          # the engine no longer checks ids: the worker (vocab 256) must
    engine.add_request("good-1", CLEAN[0], SamplingParams(max_tokens=6))
    engine.add_request("bad", [1, 2, 300], SamplingParams(max_tokens=6))
    engine.add_request("good-2", CLEAN[1], SamplingParams(max_tokens=6))
    tokens, reasons, errors = run_all(engine)
    assert reasons == {"good-1": "length", "bad": "error", "good-2": "length"}
    assert errors["bad"] == "request 'bad': token_ids must be integers in [0, 256)"
    assert (tokens["good-1"], tokens["good-2"]) == (reference(tuple(CLEAN[0]), 6), reference(tuple(CLEAN[1]), 6))
    assert engine.metrics.worker_restarts == 0   # nothing to restart: nothing had changed
    assert engine.manager.num_free_blocks == 63


def test_a_request_the_encoder_cannot_carry_is_named():
    huge = RequestStart(SamplingSpec(logit_bias={2**70: 1.0}), 1)   # a token id msgpack cannot carry
    chunk = ScheduledChunk("huge-bias", [1], 0, [[1]], True, huge)
    with pytest.raises(RequestError, match=r"request 'huge-bias' cannot be encoded") as info:
        encode_step(StepInput(0, [ScheduledChunk("fine", [1], 0, [[2]], True), chunk]))
    assert info.value.request_id == "huge-bias"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_crashes_the_workers_without_a_name_fails_alone_after_three_tries(async_scheduling):
    engine, _ = build_engine(MODEL, block_size=4, num_blocks=64, max_num_batched_tokens=64,
                             async_scheduling=async_scheduling)
    engine.executor = CrashesOn(engine.executor.stage_kwargs, "poison")
    for rid, prompt in (("a", CLEAN[0]), ("poison", CLEAN[2]), ("b", CLEAN[1])):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=6))
    tokens, reasons, errors = run_all(engine)
    assert reasons == {"a": "length", "poison": "error", "b": "length"}
    assert errors["poison"] == "the workers failed 3 times in a row on steps computing this request"
    # a and b shared the first failed step, then each ran alone once and was cleared
    assert (tokens["a"], tokens["b"]) == (reference(tuple(CLEAN[0]), 6), reference(tuple(CLEAN[1]), 6))
    assert engine.executor.restarts == engine.metrics.worker_restarts == 3
    assert engine.manager.num_free_blocks == 63


# -- the engine actor's logic ----------------------------------------------------------------------------
def service(**kwargs) -> EngineService:
    return EngineService(lambda: build_engine(MODEL, block_size=4, num_blocks=256, **kwargs))


async def collect(gen) -> list[dict]:
    return [item async for item in gen]


async def wait_ready(svc: EngineService, timeout_s: float = 30.0) -> str:
    for _ in range(int(timeout_s / 0.05)):
        if (await svc.health())["status"] == "ready":
            break
        await asyncio.sleep(0.05)
    return (await svc.health())["status"]


def test_a_retry_reusing_a_label_is_neither_aborted_by_its_predecessor_nor_loses_its_stream():
    async def main():
        svc = service()
        first = svc.generate("cmpl-retry", CLEAN[0], {"max_tokens": 50})
        item = await anext(first)
        old_id = item["request_id"]
        await first.aclose()                                  # attempt 1's client went away
        retry = asyncio.create_task(collect(svc.generate("cmpl-retry", CLEAN[0], {"max_tokens": 5})))
        await asyncio.sleep(0.05)
        assert not await svc.abort(old_id)                    # attempt 1's late abort reaches nothing
        assert not await svc.abort("cmpl-retry")              # nor does the bare label
        items = await asyncio.wait_for(retry, 30)
        assert items[0]["request_id"] not in (old_id, "cmpl-retry")
        assert [t for i in items for t in i["token_ids"]] == reference(tuple(CLEAN[0]), 5)
        assert items[-1]["finish_reason"] == "length"

        done = svc.generate("cmpl-abc", CLEAN[1], {"max_tokens": 2})
        while not (await anext(done))["finished"]:
            pass
        second = asyncio.create_task(collect(svc.generate("cmpl-abc", CLEAN[2], {"max_tokens": 2})))
        await asyncio.sleep(0)                                # registered before the first stream closes
        await done.aclose()
        items = await asyncio.wait_for(second, 30)
        assert [t for i in items for t in i["token_ids"]] == reference(tuple(CLEAN[2]), 2)

    asyncio.run(main())


def test_abort_ends_the_stream_its_consumer_waits_on():
    async def main():
        svc = service()
        gen = svc.generate("long", CLEAN[0], {"max_tokens": 500})
        first = await anext(gen)
        assert await svc.abort(first["request_id"])
        rest = await asyncio.wait_for(collect(gen), 30)
        assert rest[-1]["finished"] and rest[-1]["finish_reason"] == "abort"
        assert (await svc.stats())["running"] == 0

    asyncio.run(main())


class LosesWorkers(LocalExecutor):
    """Real workers; the first step fails as a lost worker would, and the first restart finds no room."""

    def __init__(self, stage_kwargs):
        super().__init__(stage_kwargs)
        self.failures, self.restarts = 1, 0

    def submit(self, step):
        if self.failures:
            self.failures -= 1
            raise WorkerFailure("worker actor died")
        return super().submit(step)

    def restart(self):
        self.restarts += 1
        if self.restarts == 1:
            raise RuntimeError("placement group could not be placed")
        super().restart()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_workers_that_cannot_restart_fail_requests_clearly_and_the_engine_comes_back(async_scheduling):
    def build():
        engine, info = build_engine(MODEL, block_size=4, num_blocks=64, async_scheduling=async_scheduling)
        engine.executor = LosesWorkers(engine.executor.stage_kwargs)
        return engine, info

    async def main():
        svc = EngineService(build)
        items = await asyncio.wait_for(collect(svc.generate("a", CLEAN[0], {"max_tokens": 4})), 30)
        assert (items[-1]["finish_reason"], items[-1]["error_type"]) == ("error", "engine_unavailable")
        assert "cannot start new ones: placement group could not be placed" in items[-1]["error"]
        assert (await svc.health())["status"] == "no_workers"
        with pytest.raises(EngineUnavailable, match="no workers"):
            await anext(svc.generate("b", CLEAN[1], {"max_tokens": 4}))
        assert await wait_ready(svc) == "ready"                # the back-off retry (1 s) succeeds
        items = await asyncio.wait_for(collect(svc.generate("c", CLEAN[1], {"max_tokens": 4})), 30)
        assert [t for i in items for t in i["token_ids"]] == reference(tuple(CLEAN[1]), 4)

    asyncio.run(main())


def test_an_error_in_the_engines_own_bookkeeping_fails_requests_and_the_engine_starts_afresh():
    async def main():
        svc = service()
        await svc.ready()
        broken = svc.engine

        def schedule():
            raise KeyError("a bug in the scheduler")
        broken.schedule = schedule
        items = await asyncio.wait_for(collect(svc.generate("a", CLEAN[0], {"max_tokens": 4})), 30)
        assert (items[-1]["finish_reason"], items[-1]["error_type"]) == ("error", "engine_unavailable")
        assert "a bug in the scheduler" in items[-1]["error"]
        assert await wait_ready(svc) == "ready" and svc.engine is not broken
        items = await asyncio.wait_for(collect(svc.generate("b", CLEAN[0], {"max_tokens": 4})), 30)
        assert [t for i in items for t in i["token_ids"]] == reference(tuple(CLEAN[0]), 4)

    asyncio.run(main())


def test_shutdown_tells_every_stream_and_refuses_new_requests():
    async def main():
        svc = service()
        gen = svc.generate("a", CLEAN[0], {"max_tokens": 500})
        await anext(gen)
        assert await svc.shutdown() == 1
        rest = await asyncio.wait_for(collect(gen), 30)
        assert (rest[-1]["finish_reason"], rest[-1]["error_type"], rest[-1]["error"]) == (
            "error", "server_shutting_down", SHUTTING_DOWN)
        assert (await svc.health())["status"] == "stopping"
        with pytest.raises(EngineUnavailable, match="shutting down"):
            await anext(svc.generate("b", CLEAN[1], {"max_tokens": 4}))

    asyncio.run(main())


def test_health_says_starting_while_the_engine_builds_in_a_thread():
    async def main():
        svc = service()
        assert (await svc.health())["status"] == "starting"    # answered at once: the build is off the loop
        await svc.ready()
        assert (await svc.health())["status"] == "ready"

    asyncio.run(main())


# -- the offline LLM: EOS and seeds -----------------------------------------------------------------------
def test_llm_stops_at_the_models_eos_as_transformers_does_unless_told_not_to(tmp_path):
    m = build_tiny_model(MODEL, seed=0)
    eos = reference((1, 2, 3), 6)[2]
    m.generation_config.eos_token_id = eos
    m.save_pretrained(tmp_path)
    hf = m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False)[0, 3:].tolist()
    llm = LLM(str(tmp_path), block_size=4, num_blocks=64)
    (out,) = llm.generate([[1, 2, 3]], max_tokens=6)
    assert (out.output_token_ids, out.finish_reason) == (hf, "stop") and len(hf) == 3
    (out,) = llm.generate([[1, 2, 3]], max_tokens=6, ignore_eos=True)
    assert (out.output_token_ids, out.finish_reason) == (reference((1, 2, 3), 6), "length")


def test_tiny_temperatures_sample_greedily():
    llm = LLM(MODEL, block_size=4, num_blocks=64)
    for t in (1e-39, 1e-30, 9e-6):
        (out,) = llm.generate([[1, 2, 3]], max_tokens=5, temperature=t, seed=1)
        assert out.output_token_ids == reference((1, 2, 3), 5)


def test_requests_without_a_seed_draw_their_own_randomness_and_a_seed_reproduces():
    llm = LLM(MODEL, block_size=4, num_blocks=256)
    unseeded = [tuple(o.output_token_ids) for o in llm.generate([[5, 6, 7]] * 4, max_tokens=12, temperature=1.5)]
    assert len(set(unseeded)) == 4    # equal by chance with probability < 4 * 2**-80 at this temperature
    seeded = [[o.output_token_ids for o in llm.generate([[5, 6, 7], [8, 9]], max_tokens=12, temperature=1.5,
                                                         seed=7)] for _ in range(2)]
    assert seeded[0] == seeded[1] and seeded[0][0] != seeded[0][1]
