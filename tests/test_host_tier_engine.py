"""The host KV tier end to end: a prefix the device pool lost comes back from host memory and greedy
decoding goes on token for token as if it had been recomputed.

Each scenario runs the same turns (two 40-token sessions, then a follow-up of each, then four requests
at once) on an engine whose device pool cannot keep the first session while the second runs, once with a
host tier and once recomputing (no tier, no prefix cache); the tokens must be identical, and must be
transformers' own. The counters prove the prefix came back from host (blocks loaded > 0), and zeroing the
workers' host memory proves the loaded bytes are the ones attention reads. Faults: a worker restart with
loads in flight, and a worker whose host memory is gone, both fall back to recomputation.
"""
from __future__ import annotations

import functools
import os
import random
import sys

import pytest
import torch

from cluster.engine.build import build_engine
from cluster.engine.engine import WorkerFailure
from cluster.engine.executor import LocalExecutor
from cluster.engine.types import SamplingParams
from cluster.ray.executors import RayExecutor
from workers.models.tiny_models import build_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from host_tier_gpu import MAX_TOKENS, POOLS, TOGETHER, TURNS, drain, run_turns, zero_host_memory  # noqa: E402
# (the scenario is the GPU bench's, which runs it on CUDA)


@functools.cache
def reference(model: str, prompt: tuple[int, ...]) -> list[int]:
    m = build_tiny_model(model, seed=0)
    out = m.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


@functools.cache
def recomputed(model: str, pp: int = 1) -> list[list[int]]:
    engine, _ = build_engine(model, block_size=4, num_blocks=POOLS[model], max_num_batched_tokens=16,
                             enable_prefix_caching=False, pipeline_parallel_size=pp)
    return run_turns(engine)


def settled(engine) -> None:
    """Idle: every device unit back in the free queue, no copy in flight, nothing loading."""
    mgr = engine.manager
    assert mgr.num_free_blocks == mgr.num_blocks - 1
    assert not mgr.host_tier.in_flight() and not mgr.requests_loading


@pytest.mark.parametrize("model", ["default", "tiny-gemma3", "tiny-mistral", "tiny-llama4"])
def test_a_prefix_restored_from_host_decodes_exactly_as_recomputed(model):
    engine, info = build_engine(model, block_size=4, num_blocks=POOLS[model], max_num_batched_tokens=16,
                                num_host_blocks=400)
    got = run_turns(engine)
    assert got == recomputed(model)
    if model != "default":   # the bundled model's weights are not build_tiny_model's
        assert got == [reference(model, tuple(p)) for p in TURNS + TOGETHER]
    stats = engine.stats()
    assert stats["kv_host_blocks_loaded"] > 0 and stats["kv_host_hit_requests"] > 0
    assert stats["kv_host_hit_tokens"] >= 4 * stats["kv_host_hit_requests"]   # at least a block each
    assert stats["kv_host_blocks_stored"] > 0 and stats["kv_host_load_failures"] == 0
    # every admission with a host hit ends its loads one way: completed, or preempted while they ran (the
    # step after the loads' step, scheduled while they ran, may need their blocks: overlapped steps only)
    assert stats["kv_host_loads_completed"] + stats["kv_host_loads_preempted"] == stats["kv_host_hit_requests"]
    assert stats["kv_host_bytes_loaded"] > 0 and stats["kv_host_load_latency_s_sum"] > 0
    settled(engine)


def test_two_pipeline_stages_restore_their_own_layers_from_host():
    engine, _ = build_engine("tiny-gemma2", pipeline_parallel_size=2, block_size=4, num_blocks=POOLS["tiny-gemma2"],
                             max_num_batched_tokens=16, num_host_blocks=400)
    assert all(w.host.num_units == 400 for w in engine.executor.workers)
    assert run_turns(engine) == recomputed("tiny-gemma2", pp=2) == [reference("tiny-gemma2", tuple(p))
                                                                    for p in TURNS + TOGETHER]
    assert engine.stats()["kv_host_blocks_loaded"] > 0
    settled(engine)


def test_with_asynchronous_scheduling_a_restore_decodes_exactly_as_recomputed():
    engine, _ = build_engine("tiny-gemma3", block_size=4, num_blocks=POOLS["tiny-gemma3"], max_num_batched_tokens=16,
                             num_host_blocks=400, async_scheduling=True)
    assert run_turns(engine) == recomputed("tiny-gemma3")
    assert engine.stats()["kv_host_blocks_loaded"] > 0
    settled(engine)


def test_the_loaded_bytes_are_what_attention_reads_zeroed_host_memory_changes_the_tokens():
    engine, _ = build_engine("tiny-gemma3", block_size=4, num_blocks=POOLS["tiny-gemma3"], max_num_batched_tokens=16,
                             num_host_blocks=400)
    got = run_turns(engine, before_turn=zero_host_memory)
    assert got[:2] == recomputed("tiny-gemma3")[:2]
    assert got[2] != recomputed("tiny-gemma3")[2]      # the follow-up read the zeros the load brought back


class CrashesWithLoads(LocalExecutor):
    """Real workers; the first step that carries loads from host crashes them (a worker lost mid-copy)."""

    def __init__(self, stage_kwargs):
        super().__init__(stage_kwargs)
        self.crashed = 0

    def submit(self, step):
        if step.kv_loads and not self.crashed:
            self.crashed = len(step.kv_loads)
            raise WorkerFailure("worker lost during a step")
        return super().submit(step)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_worker_restart_with_loads_in_flight_falls_back_to_recompute_with_the_same_tokens(async_scheduling):
    engine, _ = build_engine("tiny-gemma3", block_size=4, num_blocks=POOLS["tiny-gemma3"], max_num_batched_tokens=16,
                             num_host_blocks=400, async_scheduling=async_scheduling)
    engine.executor = CrashesWithLoads(engine.executor.stage_kwargs)
    assert run_turns(engine) == recomputed("tiny-gemma3")
    stats = engine.stats()
    assert engine.executor.crashed > 0
    assert stats["worker_restarts"] == 1
    assert stats["kv_host_load_failures"] == 1          # the one request that was loading
    assert stats["kv_host_loads_completed"] + stats["kv_host_loads_preempted"] + 1 == stats["kv_host_hit_requests"]
    settled(engine)


def lose_host_memory(turn, engine):
    if turn == 2:        # the host memory goes, the device pool stays: only the workers know
        for w in engine.executor.workers:
            w.host.filled = bytearray(w.host.num_units)
            zero_host_memory(turn, engine)


def test_loads_a_worker_reports_failed_requeue_their_request_which_recomputes_the_same_tokens():
    engine, _ = build_engine("tiny-gemma3", block_size=4, num_blocks=POOLS["tiny-gemma3"], max_num_batched_tokens=16,
                             num_host_blocks=400)
    assert run_turns(engine, before_turn=lose_host_memory) == recomputed("tiny-gemma3")
    stats = engine.stats()
    assert stats["kv_host_load_failures"] >= 1 and stats["worker_restarts"] == 0
    settled(engine)


def test_tensor_parallel_ranks_in_two_stages_over_ray_restore_exactly(ray_runtime):
    # tiny-gemma2 on four worker actors (two stages of two gloo ranks): each keeps its heads' share of
    # its layers in its own host pool.
    engine, _ = build_engine("tiny-gemma2", tensor_parallel_size=2, pipeline_parallel_size=2, block_size=4,
                             num_blocks=POOLS["tiny-gemma2"], max_num_batched_tokens=16, num_host_blocks=400,
                             executor_cls=RayExecutor, num_cpus_per_worker=0.5)
    try:
        assert run_turns(engine) == [reference("tiny-gemma2", tuple(p)) for p in TURNS + TOGETHER]
        assert engine.stats()["kv_host_blocks_loaded"] > 0
        settled(engine)
    finally:
        engine.executor.shutdown()


def random_waves(seed: int) -> list:
    """Waves of 1-3 requests at once, each a random suffix on one of three random prefixes (8-32 tokens)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(rng.randrange(8, 33))] for _ in range(3)]
    return [[(rng.choice(prefixes) + [rng.randrange(256) for _ in range(rng.randrange(1, 9))], rng.randrange(1, 7))
             for _ in range(rng.randrange(1, 4))] for _ in range(4)]


def run_waves(waves, **kwargs) -> dict:
    engine, _ = build_engine("tiny-gemma3", block_size=4, num_blocks=40, max_num_batched_tokens=16, **kwargs)
    tokens, n = {}, 0
    for wave in waves:
        for prompt, max_tokens in wave:
            engine.add_request(f"r{n}", prompt, SamplingParams(max_tokens=max_tokens))
            n += 1
        drain(engine, tokens)
    return tokens, engine


@pytest.mark.parametrize("seed", range(4))
def test_random_waves_with_preemption_and_a_small_host_decode_as_recomputed(seed):
    # 60 host units: fewer than the traces store, so host eviction runs too; some seeds preempt
    waves = random_waves(seed)
    recompute, _ = run_waves(waves, enable_prefix_caching=False)
    for async_scheduling in (False, True):
        tokens, engine = run_waves(waves, num_host_blocks=60, async_scheduling=async_scheduling)
        assert tokens == recompute
        settled(engine)
