"""Prompt logprobs (scoring a prompt, as eval harnesses do): every prompt token's raw log-softmax given the
tokens before it, and the top k, equal to transformers' dense forward of the same model, however the
prompt is chunked, split into stages or ranks, preempted or found in the prefix cache.

The expected values always come from transformers' own forward over the whole prompt.
"""
from __future__ import annotations

import functools

import pytest
import torch
import transformers

from cluster.engine.build import DEFAULT_MODEL, build_engine
from cluster.engine.engine import Engine, EngineConfig
from cluster.engine.llm import LLM
from cluster.engine.types import SamplingParams
from cluster.ray.executors import RayExecutor
from kvmanager import FullAttention, SlidingWindow
from workers.models.tiny_models import build_tiny_model
from workers.protocol import StepOutput
from workers.wire import decode_output, encode_output

from drivers import SimulatedExecutor

PROMPT = [(13 * j + 5) % 256 for j in range(50)]      # 50 tokens: four chunks of 16 at most
CHUNK = 16


@functools.cache
def dense_log_softmax(model: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """[len(prompt), vocab]: row q is the log-softmax of the logits after tokens 0..q."""
    if model == "default":
        m = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, local_files_only=True).eval()
    else:
        m = build_tiny_model(model, seed=0)
    with torch.no_grad():
        return torch.log_softmax(m(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_scores_match(model: str, prompt, scored, k: int) -> None:
    """``scored``: None, then (logprob, top ids, top logprobs) for positions 1 .. len(prompt) - 1."""
    ref = dense_log_softmax(model, tuple(prompt))
    assert len(scored) == len(prompt) and scored[0] is None
    got = [entry[0] for entry in scored[1:]]
    assert got == pytest.approx([float(ref[q - 1, prompt[q]]) for q in range(1, len(prompt))], abs=1e-4)
    for q in range(1, len(prompt)):
        values, ids = ref[q - 1].topk(k)
        assert scored[q][1] == ids.tolist()
        assert scored[q][2] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_longer_than_a_chunk_is_scored_exactly_and_max_tokens_0_generates_nothing(async_scheduling):
    llm = LLM("default", block_size=4, max_num_batched_tokens=CHUNK, async_scheduling=async_scheduling)
    out, short = llm.generate([PROMPT, PROMPT[:17]], max_tokens=0, prompt_logprobs=3)
    for o, prompt in ((out, PROMPT), (short, PROMPT[:17])):
        assert (o.output_token_ids, o.finish_reason, o.error) == ([], "length", None)
        assert_scores_match("default", prompt, o.prompt_logprobs, 3)
    assert llm.engine.stats()["finished"] == {"length": 2}
    assert llm.engine.manager.num_free_blocks == llm.engine.manager.num_blocks - 1


def test_a_scored_prompt_takes_no_prefix_hit_and_then_generates_as_without_scores():
    llm = LLM("default", block_size=4, max_num_batched_tokens=CHUNK)
    (plain,) = llm.generate([PROMPT], max_tokens=5)
    hits_before = llm.engine.stats()["prefix_hit_tokens"]
    (scored,) = llm.generate([PROMPT], max_tokens=5, prompt_logprobs=0)
    assert llm.engine.stats()["prefix_hit_tokens"] == hits_before          # the cached prompt was not used
    assert_scores_match("default", PROMPT, scored.prompt_logprobs, 0)
    assert scored.output_token_ids == plain.output_token_ids
    (again,) = llm.generate([PROMPT], max_tokens=5)
    assert llm.engine.stats()["prefix_hit_tokens"] == hits_before + 48      # still cached for the others
    assert again.prompt_logprobs is None


def test_max_tokens_0_without_scores_computes_the_prompt_into_the_cache_and_generates_nothing():
    llm = LLM("default", block_size=4, max_num_batched_tokens=CHUNK)
    (warm,) = llm.generate([PROMPT], max_tokens=0)
    assert (warm.output_token_ids, warm.finish_reason, warm.prompt_logprobs) == ([], "length", None)
    llm.generate([PROMPT], max_tokens=1)
    assert llm.engine.stats()["prefix_hit_tokens"] == 48     # all but the last block: the prompt was computed


def test_requests_preempted_while_scoring_deliver_every_position_once():
    # 30 units of 4 tokens cannot hold three 50-token prompts of tiny-gemma3 (sliding blocks take 3 units)
    prompts = [PROMPT, PROMPT[::-1], [(t + 7) % 256 for t in PROMPT]]
    llm = LLM("tiny-gemma3", block_size=4, num_blocks=40, max_num_batched_tokens=CHUNK)
    outs = llm.generate(prompts, max_tokens=4, prompt_logprobs=2)
    assert llm.engine.stats()["preemptions"] >= 1
    for o, prompt in zip(outs, prompts):
        assert o.finish_reason == "length" and len(o.output_token_ids) == 4
        assert_scores_match("tiny-gemma3", prompt, o.prompt_logprobs, 2)


def test_pipeline_stages_score_the_prompt_on_the_last_stage():
    llm = LLM("tiny-gemma2", pipeline_parallel_size=2, block_size=4, num_blocks=200, max_num_batched_tokens=CHUNK)
    (out,) = llm.generate([PROMPT], max_tokens=0, prompt_logprobs=4)
    assert_scores_match("tiny-gemma2", PROMPT, out.prompt_logprobs, 4)


def test_tensor_and_pipeline_parallel_ranks_over_ray_score_the_prompt(ray_runtime):
    engine, _ = build_engine("tiny-gemma2", tensor_parallel_size=2, pipeline_parallel_size=2, block_size=4,
                             num_blocks=200, max_num_batched_tokens=CHUNK, executor_cls=RayExecutor,
                             num_cpus_per_worker=0.5)
    try:
        engine.add_request("scored", PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=2))
        engine.add_request("both", PROMPT[:30], SamplingParams(max_tokens=3, prompt_logprobs=1))
        scored = {"scored": [None], "both": [None]}
        finished = {}
        while engine.has_work():
            for u in engine.step():
                scored[u.request_id] += u.prompt_logprobs or []
                if u.finished:
                    finished[u.request_id] = (u.finish_reason, u.error)
        assert finished == {"scored": ("length", None), "both": ("length", None)}
        assert_scores_match("tiny-gemma2", PROMPT, scored["scored"], 2)
        assert_scores_match("tiny-gemma2", PROMPT[:30], scored["both"], 1)
    finally:
        engine.executor.shutdown()


def test_simulated_workers_score_every_prompt_position_uniformly():
    specs = [SlidingWindow(block_size=4, window=8), FullAttention(block_size=4)]
    engine = Engine(SimulatedExecutor(specs, 200, [1, 1], 1000), specs, 200,
                    EngineConfig(max_model_len=256, max_num_batched_tokens=CHUNK, vocab_size=1000))
    engine.add_request("s", PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=1))
    scored, finished = [], None
    while engine.has_work():
        for u in engine.step():
            scored += u.prompt_logprobs or []
            finished = (u.finish_reason, u.error) if u.finished else finished
    assert finished == ("length", None)
    assert scored == [(pytest.approx(-6.907755), [t], [pytest.approx(-6.907755)]) for t in PROMPT[1:]]


def test_prompt_logprobs_cross_the_wire_as_packed_float32():
    n, k = 1000, 5
    values = [float(torch.tensor(-0.001 * i).float()) for i in range(n)]
    top_ids = [[(i + j) % 256 for j in range(k)] for i in range(n)]
    top_values = [[float(torch.tensor(-0.5 * j - 1e-3 * i).float()) for j in range(k)] for i in range(n)]
    out = StepOutput(3, {"a": 7}, prompt_logprobs={"a": (1, values, top_ids, top_values),
                                                   "b": (17, values[:3], [[]] * 3, [[]] * 3)})
    payload = encode_output(out)
    assert decode_output(payload) == out
    assert len(payload) < n * (4 + 8 * k) + 100      # 4 bytes a logprob, 8 a top entry: no boxed numbers


@pytest.mark.parametrize("params, field", [
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(prompt_logprobs=True), "prompt_logprobs"),
    (dict(max_tokens=-1), "max_tokens"),
])
def test_bad_prompt_logprob_settings_are_refused_naming_the_field(params, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**params)
