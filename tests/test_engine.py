"""The engine end to end on tiny models: exact greedy tokens through chunked prefill, prefix hits,
preemption, pipeline stages, worker loss; and refusals before anything starts.

The expected tokens always come from transformers' own dense ``generate`` on the same seeded model.
"""
from __future__ import annotations

import functools
import time

import pytest
import torch

from cluster.engine.engine import WorkerFailure
from cluster.engine.build import build_engine
from cluster.engine.llm import LLM
from cluster.engine.types import SamplingParams
from cluster.ray.executors import RayExecutor
from workers.models.tiny_models import build_tiny_model


@functools.cache
def reference(model: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    m = build_tiny_model(model, seed=0)
    out = m.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


# Six prompts, 20..35 tokens (windows are 8), the last sharing the first one's 20-token prefix.
PROMPTS = [[(7 * i + j) % 256 for j in range(20 + 3 * i)] for i in range(5)] + [[j % 256 for j in range(20)] + [1, 2, 3]]


def test_llm_matches_transformers_through_chunked_prefill_hits_and_preemption():
    # 40 units of 4 tokens cannot hold six requests of ~40 tokens (sliding blocks take 3 units, full 1):
    # some are preempted.
    llm = LLM("tiny-gemma3", block_size=4, num_blocks=40, max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, max_tokens=12)
    for prompt, out in zip(PROMPTS, outs):
        assert out.output_token_ids == reference("tiny-gemma3", tuple(prompt), 12)
        assert out.finish_reason == "length"
    stats = llm.engine.stats()
    assert stats["preemptions"] >= 1
    assert stats["prefix_hit_tokens"] > 0
    assert llm.engine.manager.num_free_blocks == 39      # everything returned to the pool


@pytest.mark.parametrize("model", ["tiny-mistral", "tiny-gemma2", "tiny-llama"])
def test_pipeline_of_two_stages_gives_the_same_tokens(model):
    llm = LLM(model, pipeline_parallel_size=2, block_size=4, num_blocks=200, max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS[:3], max_tokens=10)
    assert [o.output_token_ids for o in outs] == [reference(model, tuple(p), 10) for p in PROMPTS[:3]]


def test_stages_with_different_layer_kinds_are_refused_before_loading():
    # tiny-llama4: layers 0-2 chunked local, layer 3 full: stage 0 would have no full-attention layer.
    with pytest.raises(ValueError, match=r"different mixes of layer kinds.*stage 0 \(layers model.layers.0.self_attn"
                                         r"..model.layers.1.self_attn\): 2 x chunked_local\(chunk=8\); stage 1 .*"
                                         r"1 x chunked_local\(chunk=8\), 1 x full"):
        build_engine("tiny-llama4", pipeline_parallel_size=2, block_size=4, executor_cls=RayExecutor)  # no Ray needed: refused first


def test_parallel_sizes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 does not divide num_hidden_layers=4"):
        build_engine("tiny-gemma3", pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        build_engine("tiny-gemma3", tensor_parallel_size=3)


def test_bad_requests_are_refused_and_nothing_is_queued():
    engine, _ = build_engine("tiny-gemma3", block_size=4, num_blocks=64, max_model_len=256)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.add_request("a", [1, 2, 256])
    with pytest.raises(ValueError, match="leaves no room"):
        engine.add_request("b", list(range(256)))
    # 64 units of 4 tokens: 100 + 150 = 250 tokens need ceil(250/4) = 63 full-attention blocks (1 unit)
    # + (ceil((8-1)/4) + 1 = 3) sliding blocks of 3 units = 72 > 63 allocatable (unit 0 is the null block)
    with pytest.raises(ValueError, match="250 tokens need up to 72 KV blocks, the pool has 63"):
        engine.add_request("c", [1] * 100, SamplingParams(max_tokens=150))
    with pytest.raises(ValueError, match="max_tokens must be"):
        engine.add_request("d", [1, 2], SamplingParams(max_tokens=-1))
    engine.add_request("e", [1, 2, 3])
    with pytest.raises(ValueError, match="duplicate request id 'e'"):
        engine.add_request("e", [1, 2, 3])
    assert [s.request_id for s in engine.scheduler.waiting] == ["e"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_lost_worker_is_rebuilt_and_told_every_composite_again(async_scheduling):
    # tiny-gemma3: a sliding block is a composite of 3 units; rebuilt workers know none of them, so the
    # first step after the restart carries every composite of the pool.
    engine, _ = build_engine("tiny-gemma3", block_size=4, num_blocks=64, max_num_batched_tokens=16,
                             async_scheduling=async_scheduling)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=10))
    executor, steps, sent = engine.executor, [], []
    real_submit = executor.submit

    def submit(step):              # the real workers, lost once at the sixth step (one at a time or overlapped)
        steps.append(step)
        if len(steps) == 6:
            executor.workers = []
            raise WorkerFailure("lost")
        if len(steps) == 7:
            sent.append({b.block_id: b.units for b in engine.manager.pool.blocks
                         if b.kind == 0 and b.units[0] == b.block_id})
        return real_submit(step)

    executor.submit = submit
    tokens = {f"r{i}": [] for i in range(3)}
    while engine.has_work():
        for u in engine.step():
            tokens[u.request_id] += u.new_token_ids
    assert engine.stats()["worker_restarts"] == 1
    assert tokens == {f"r{i}": reference("tiny-gemma3", tuple(p), 10) for i, p in enumerate(PROMPTS[:3])}
    replayed = {block: tuple(units) for g, block, units in steps[6].compositions}
    assert sent[0] and all(replayed[b] == units for b, units in sent[0].items())


def test_killing_a_worker_actor_mid_generation_loses_nothing(ray_runtime):
    ray = ray_runtime
    engine, _ = build_engine("tiny-gemma2", block_size=4, num_blocks=200, max_num_batched_tokens=16, executor_cls=RayExecutor)
    try:
        assert engine.executor.uses_shm_rings   # one node: steps travel through shared-memory rings
        for i, prompt in enumerate(PROMPTS[:4]):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=10))
        tokens = {f"r{i}": [] for i in range(4)}
        finished = {}
        steps = 0
        while engine.has_work():
            if steps == 6:    # mid-generation: some prompts done, some decoding
                victim = engine.executor.actors[0]
                ray.kill(victim, no_restart=True)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:   # wait until Ray reports it dead
                    try:
                        ray.get(victim.pid.remote(), timeout=5)
                    except Exception:  # noqa: BLE001 - any error means it is gone
                        break
            for u in engine.step():
                tokens[u.request_id] += u.new_token_ids
                if u.finished:
                    assert u.request_id not in finished      # answered once
                    finished[u.request_id] = u.finish_reason
            steps += 1
        stats = engine.stats()
        assert engine.executor.uses_shm_rings   # new rings after the restart
        assert stats["worker_restarts"] == 1
        assert stats["recomputed_requests"] >= 1
        assert finished == {f"r{i}": "length" for i in range(4)}
        for i, prompt in enumerate(PROMPTS[:4]):
            assert tokens[f"r{i}"] == reference("tiny-gemma2", tuple(prompt), 10)
    finally:
        engine.executor.shutdown()


def test_a_chunk_a_worker_actor_refuses_fails_its_request_alone_through_ray(ray_runtime):
    """The worker's RequestError crosses the rings (two stages) and still names its request."""
    engine, _ = build_engine("tiny-llama", pipeline_parallel_size=2, block_size=4, num_blocks=64, executor_cls=RayExecutor,
                             num_cpus_per_worker=0.5)
    try:
        assert engine.executor.uses_shm_rings
        engine.config.vocab_size = None      # the engine no longer checks ids: the workers (vocab 256) must
        engine.add_request("good", PROMPTS[0], SamplingParams(max_tokens=6))
        engine.add_request("bad", [1, 2, 300], SamplingParams(max_tokens=6))
        tokens, finished, errors = {"good": [], "bad": []}, {}, {}
        while engine.has_work():
            for u in engine.step():
                tokens[u.request_id] += u.new_token_ids
                if u.finished:
                    finished[u.request_id], errors[u.request_id] = u.finish_reason, u.error
        assert finished == {"good": "length", "bad": "error"}
        assert errors["bad"] == "request 'bad': token_ids must be integers in [0, 256)"
        assert tokens["good"] == reference("tiny-llama", tuple(PROMPTS[0]), 6)
        assert engine.stats()["worker_restarts"] == 0   # the workers survive a refusal
    finally:
        engine.executor.shutdown()


def test_an_engine_restarted_after_a_crash_reclaims_the_placement_group_its_predecessor_left(ray_runtime):
    """Ray ties a placement group to the job, not to the actor that made it: a named engine that dies
    would keep its devices reserved and its successor could never place workers."""
    from drivers import start_engine_actor
    ray = ray_runtime

    def groups():
        return {i["name"]: i["state"] for i in ray.util.placement_group_table().values()
                if "-ranks-swakv.test-pg-engine." in (i["name"] or "")}

    handle, _ = start_engine_actor(dict(model="tiny-llama", block_size=4, num_blocks=64), name="test-pg-engine",
                                   max_restarts=0, timeout_s=120)
    (first,) = groups()
    ray.kill(handle, no_restart=True)
    time.sleep(1)
    assert groups() == {first: "CREATED"}          # the crash left it behind
    handle, _ = start_engine_actor(dict(model="tiny-llama", block_size=4, num_blocks=64), name="test-pg-engine",
                                   max_restarts=0, timeout_s=120)
    try:
        (second,) = set(groups()) - {first}
        assert groups() == {first: "REMOVED", second: "CREATED"}
    finally:
        assert ray.get(handle.shutdown.remote(), timeout=60) == 0   # stops the workers: the group goes too
        ray.kill(handle, no_restart=True)
    assert groups()[second] == "REMOVED"


def test_tensor_parallel_ranks_over_ray_with_gloo_give_the_same_tokens(ray_runtime):
    # tiny-gemma2: 4 heads, 2 KV heads, MLP 128 -> 2 ranks each keep 2 heads, 1 KV head, 64 columns;
    # two stages of two ranks: four worker actors, one gloo world, one sub-group per stage.
    engine, info = build_engine("tiny-gemma2", tensor_parallel_size=2, pipeline_parallel_size=2, block_size=4,
                                num_blocks=200, max_num_batched_tokens=16, executor_cls=RayExecutor, num_cpus_per_worker=0.5)
    try:
        assert [n.rsplit("-", 2)[0] for n in engine.stats()["workers"]] == [
            "swakv-worker-stage0-rank0", "swakv-worker-stage0-rank1",
            "swakv-worker-stage1-rank0", "swakv-worker-stage1-rank1"]
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8))
        tokens = {f"r{i}": [] for i in range(3)}
        while engine.has_work():
            for u in engine.step():
                tokens[u.request_id] += u.new_token_ids
        assert tokens == {f"r{i}": reference("tiny-gemma2", tuple(p), 8) for i, p in enumerate(PROMPTS[:3])}
    finally:
        engine.executor.shutdown()


TRITON_SCRIPT = """
import json, sys
from cluster.engine.llm import LLM
prompts = json.loads(sys.argv[1])
llm = LLM("tiny-gemma3", block_size=4, num_blocks=64, max_num_batched_tokens=8)
print(json.dumps([o.output_token_ids for o in llm.generate(prompts, max_tokens=6)]))
"""


def test_engine_with_the_triton_backend_under_the_interpreter_gives_the_same_tokens():
    """Every layer through the Triton kernel (run by Triton's interpreter on CPU tensors): prompts longer
    than the window (8), prefilled in chunks of 8, then decoded."""
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT
    prompts = [PROMPTS[0][:12], PROMPTS[1][:10]]
    env = {**os.environ, "SWAKV_ATTENTION_BACKEND": "triton", "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, json.dumps(prompts)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [reference("tiny-gemma3", tuple(p), 6) for p in prompts]


def test_a_step_of_decodes_is_filled_with_prefill_up_to_its_own_knee_on_sleeping_simulated_workers():
    # gemma-3-27b on a modelled H100: a bare prefill turns compute-bound at 304 tokens (the budget's floor);
    # 8 decodes past 4,096 tokens read enough KV that a step holding them turns compute-bound only with ~336
    # prefill tokens beside them, so the step takes those, not 304 - 8.
    from workers.sim.cost_model import StepCostModel
    engine, info = build_engine("gemma-3-27b", simulated_gpu="H100-80GB", sleep_factor=1e-6)
    assert info["max_num_batched_tokens"] == 304
    for i in range(8):
        engine.add_request(f"long{i}", list(range(i, 4096 + i)), SamplingParams(max_tokens=200))
    running = engine.scheduler.running
    while len(running) < 8 or any(q.req.num_computed_tokens < 4096 for q in running):
        engine.step()
    engine.add_request("new", list(range(5000, 9000)), SamplingParams(max_tokens=1))
    decodes = [(q.req.num_computed_tokens, 1) for q in running]
    room = StepCostModel("gemma-3-27b", "H100-80GB").prefill_room(decodes)
    assert 320 <= room <= 352 and engine.scheduler.step_budget() == 8 + room
    before = engine.metrics.scheduled_tokens
    engine.step()
    assert engine.metrics.scheduled_tokens - before == 8 + room      # the new prompt's first chunk fills it
    fixed, _ = build_engine("gemma-3-27b", simulated_gpu="H100-80GB", sleep_factor=1e-6, max_num_batched_tokens=304)
    assert fixed.scheduler.step_budget() == 304                      # a budget given stays fixed
