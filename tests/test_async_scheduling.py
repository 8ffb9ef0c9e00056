"""Asynchronous scheduling: step N+1 is scheduled and launched before step N's tokens are read, and the
outputs are the tokens of one step at a time: transformers' greedy tokens, or, for sampled requests, the
same draws as without overlap. Through chunked prefill, prefix hits, preemption, stop tokens, aborts,
refused chunks, lost workers and pipeline stages; and the worker feeding a draw still on the device.
"""
from __future__ import annotations

import functools

import pytest
import torch

from cluster.engine.engine import WorkerFailure
from cluster.engine.executor import LocalExecutor
from cluster.engine.build import build_engine
from cluster.engine.llm import LLM
from cluster.engine.types import SamplingParams
from workers.protocol import RequestError, ScheduledChunk, StepInput
from workers.models.tiny_models import build_tiny_model
from workers.runtime.worker import Worker
from drivers import CrashesOn

# Six prompts, 20..35 tokens (windows are 8), the last sharing the first one's 20-token prefix.
PROMPTS = [[(7 * i + j) % 256 for j in range(20 + 3 * i)] for i in range(5)] + [[j % 256 for j in range(20)] + [1, 2, 3]]


@functools.cache
def reference(model: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    m = build_tiny_model(model, seed=0)
    out = m.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


class Recording(LocalExecutor):
    """Real workers; records the order of submits and collects, and every step submitted."""

    def __init__(self, stage_kwargs):
        super().__init__(stage_kwargs)
        self.calls, self.steps = [], []

    def submit(self, step):
        self.calls.append(("submit", step.step_id))
        self.steps.append(step)
        return super().submit(step), step.step_id

    def collect(self, handle):
        handle, step_id = handle
        self.calls.append(("collect", step_id))
        return super().collect(handle)


def recorded_engine(model="tiny-gemma3", **kwargs):
    engine, _ = build_engine(model, block_size=4, async_scheduling=True, **kwargs)
    engine.executor = Recording(engine.executor.stage_kwargs)
    return engine


def run_all(engine, max_steps: int = 1000):
    tokens, reasons, logprobs = {}, {}, {}
    for _ in range(max_steps):
        if not engine.has_work():
            return tokens, reasons, logprobs
        for u in engine.step():
            tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            logprobs.setdefault(u.request_id, []).extend(u.logprobs or [])
            if u.finished:
                assert u.request_id not in reasons    # answered once
                reasons[u.request_id] = u.finish_reason
    raise AssertionError("the engine did not finish")


def overlapped(calls) -> int:
    """Steps launched while the step before them was still uncollected."""
    collected, count = set(), 0
    for kind, step_id in calls:
        if kind == "collect":
            collected.add(step_id)
        elif step_id - 1 >= 0 and step_id - 1 not in collected and ("submit", step_id - 1) in calls:
            count += 1
    return count


def test_overlapped_steps_give_transformers_tokens_through_chunked_prefill_hits_and_preemption():
    # 40 units of 4 tokens cannot hold six requests of ~40 tokens: some are preempted, some while their
    # previous step is still running.
    engine = recorded_engine(num_blocks=40, max_num_batched_tokens=16)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12))
    tokens, reasons, _ = run_all(engine)
    assert tokens == {f"r{i}": reference("tiny-gemma3", tuple(p), 12) for i, p in enumerate(PROMPTS)}
    assert set(reasons.values()) == {"length"}
    stats = engine.stats()
    assert stats["preemptions"] >= 1 and stats["prefix_hit_tokens"] > 0 and stats["worker_restarts"] == 0
    assert engine.manager.num_free_blocks == 39
    steps = engine.executor.steps
    fed = [c for s in steps for c in s.chunks if c.from_last_step]
    assert fed and all(c.token_ids == [0] and c.sample for c in fed)
    assert overlapped(engine.executor.calls) >= len(steps) - 12   # all but a few steps overlap the previous
    assert stats["host_time_s"] > 0 and stats["wait_time_s"] >= 0


def test_a_request_is_never_scheduled_past_a_token_that_will_end_it():
    engine = recorded_engine(num_blocks=200, max_num_batched_tokens=64, max_model_len=30)
    engine.add_request("short", PROMPTS[0], SamplingParams(max_tokens=3))
    engine.add_request("context", PROMPTS[1], SamplingParams(max_tokens=100))   # 23 + 7 = max_model_len
    tokens, reasons, _ = run_all(engine)
    assert (len(tokens["short"]), len(tokens["context"])) == (3, 7) and set(reasons.values()) == {"length"}
    computed = {}
    for step in engine.executor.steps:
        for c in step.chunks:
            computed[c.request_id] = c.start_pos + len(c.token_ids)
    # the last token drawn is never computed: no step wasted on either request
    assert computed == {"short": 20 + 3 - 1, "context": 30 - 1}


def test_a_stop_token_ends_a_request_whose_next_chunk_is_already_running():
    ref = reference("tiny-gemma3", tuple(PROMPTS[0]), 12)
    stop = ref[4]
    assert stop not in ref[:4]
    engine = recorded_engine(num_blocks=200, max_num_batched_tokens=64)
    engine.add_request("stops", PROMPTS[0], SamplingParams(max_tokens=12, stop_token_ids=(stop,)))
    engine.add_request("runs", PROMPTS[2], SamplingParams(max_tokens=12))
    tokens, reasons, _ = run_all(engine)
    assert (tokens["stops"], reasons["stops"]) == (ref[:5], "stop")
    assert (tokens["runs"], reasons["runs"]) == (reference("tiny-gemma3", tuple(PROMPTS[2]), 12), "length")
    # the chunk computing the stop token was launched before the stop was known, and its draw was dropped
    last = max(c.start_pos for s in engine.executor.steps for c in s.chunks if c.request_id == "stops")
    assert last == len(PROMPTS[0]) + 4
    assert engine.manager.num_free_blocks == 199
    forgotten = [s for s in engine.executor.steps if "stops" in s.forget]
    assert len(forgotten) == 1   # its mirror is dropped once, by the first step scheduled after the stop


SAMPLED = [SamplingParams(max_tokens=12, temperature=1.0, seed=11, top_p=0.9),
           SamplingParams(max_tokens=12, temperature=0.8, seed=12, top_k=20, presence_penalty=1.5),
           SamplingParams(max_tokens=12, temperature=1.2, seed=13, repetition_penalty=1.4, min_p=0.02),
           SamplingParams(max_tokens=12, temperature=1.0, seed=7, frequency_penalty=0.8, logit_bias={5: 3.0}),
           SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, logprobs=3),
           SamplingParams(max_tokens=12, temperature=1.0, seed=2**64 - 1, logprobs=2)]


@pytest.mark.parametrize("num_blocks", [400, 32])   # roomy, and small enough to preempt
def test_seeded_draws_and_penalties_fed_on_the_device_match_one_step_at_a_time(num_blocks):
    results = []
    for overlap in (False, True):
        engine, _ = build_engine("tiny-gemma3", block_size=4, num_blocks=num_blocks, max_num_batched_tokens=16,
                                 async_scheduling=overlap)
        for i, (prompt, params) in enumerate(zip(PROMPTS, SAMPLED)):
            engine.add_request(f"r{i}", prompt, params)
        tokens, reasons, logprobs = run_all(engine)
        results.append((tokens, reasons, logprobs, engine.stats()["preemptions"]))
    (tokens, reasons, logprobs, _), (tokens_a, reasons_a, logprobs_a, preemptions) = results
    assert tokens_a == tokens and reasons_a == reasons
    assert all(len(t) == 12 for t in tokens.values())
    for rid in logprobs:
        for (lp, ids, top), (lp_a, ids_a, top_a) in zip(logprobs[rid], logprobs_a[rid], strict=True):
            assert ids == ids_a and lp == pytest.approx(lp_a, abs=1e-5) and top == pytest.approx(top_a, abs=1e-5)
    assert (preemptions > 0) == (num_blocks == 32)


def test_a_chunk_refused_at_launch_while_a_step_runs_fails_its_request_alone():
    engine = recorded_engine(num_blocks=64, max_num_batched_tokens=64)
    engine.config.vocab_size = None            # only the worker (vocab 256) checks token ids now
    engine.add_request("good-1", PROMPTS[0], SamplingParams(max_tokens=6))
    tokens, reasons = {}, {}
    for _ in range(2):
        for u in engine.step():
            tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
    assert engine._inflight is not None       # good-1's step is running when the bad request arrives
    engine.add_request("bad", [1, 2, 300], SamplingParams(max_tokens=6))
    engine.add_request("good-2", PROMPTS[1], SamplingParams(max_tokens=6))
    more, reasons, _ = run_all(engine)
    for rid, t in more.items():
        tokens.setdefault(rid, []).extend(t)
    assert reasons == {"good-1": "length", "bad": "error", "good-2": "length"}
    assert (tokens["good-1"], tokens["good-2"]) == (reference("tiny-gemma3", tuple(PROMPTS[0]), 6),
                                                    reference("tiny-gemma3", tuple(PROMPTS[1]), 6))
    assert engine.metrics.worker_restarts == 0
    assert engine.manager.num_free_blocks == 63


class LosesWorkersOnce(Recording):
    """A worker is lost while two steps are on the device: the collect of the ``at``-th step fails."""

    def __init__(self, stage_kwargs, at: int):
        super().__init__(stage_kwargs)
        self.at, self.collects, self.restarts = at, 0, 0

    def collect(self, handle):
        self.collects += 1
        if self.collects == self.at:
            self.uncollected_at_loss = [c for c in self.calls if c[0] == "submit"].__len__() - (self.at - 1)
            raise WorkerFailure("worker lost")
        return super().collect(handle)

    def restart(self):
        self.restarts += 1
        super().restart()


def test_a_worker_lost_with_two_steps_in_flight_loses_no_token():
    engine, _ = build_engine("tiny-gemma3", block_size=4, num_blocks=64, max_num_batched_tokens=16,
                             async_scheduling=True)
    engine.executor = LosesWorkersOnce(engine.executor.stage_kwargs, at=6)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=10))
    tokens, reasons, _ = run_all(engine)
    assert tokens == {f"r{i}": reference("tiny-gemma3", tuple(p), 10) for i, p in enumerate(PROMPTS[:3])}
    assert engine.executor.restarts == engine.metrics.worker_restarts == 1
    assert engine.executor.uncollected_at_loss == 2     # both steps on the device were lost and recomputed
    assert engine.manager.num_free_blocks == 63


def test_a_request_that_crashes_a_launch_without_a_name_fails_alone_after_three_tries():
    engine, _ = build_engine("tiny-llama", block_size=4, num_blocks=64, max_num_batched_tokens=64,
                             async_scheduling=True)
    engine.executor = CrashesOn(engine.executor.stage_kwargs, "poison")
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=6))
    early = [t for _ in range(2) for u in engine.step() for t in u.new_token_ids]
    assert engine._inflight is not None        # "a" is decoding, a step in flight, when "poison" arrives
    engine.add_request("poison", PROMPTS[2], SamplingParams(max_tokens=6))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=6))
    tokens, reasons, _ = run_all(engine)
    assert reasons == {"a": "length", "poison": "error", "b": "length"}
    assert early + tokens["a"] == reference("tiny-llama", tuple(PROMPTS[0]), 6)
    assert tokens["b"] == reference("tiny-llama", tuple(PROMPTS[1]), 6)
    assert engine.executor.restarts == engine.metrics.worker_restarts == 3
    assert engine.manager.num_free_blocks == 63


def test_abort_of_a_request_whose_step_is_running_forgets_it_on_the_workers():
    engine = recorded_engine(num_blocks=200, max_num_batched_tokens=64)
    engine.add_request("keep", PROMPTS[0], SamplingParams(max_tokens=10))
    engine.add_request("drop", PROMPTS[1], SamplingParams(max_tokens=10))
    for _ in range(3):
        engine.step()
    assert any(c.request_id == "drop" for c in engine._inflight[0].step.chunks)
    assert engine.abort("drop")
    tokens, reasons, _ = run_all(engine)
    assert reasons == {"keep": "length"} and engine.metrics.finished == {"abort": 1, "length": 1}
    assert [s for s in engine.executor.steps if "drop" in s.forget]
    assert "drop" not in engine.executor.workers[0].request_ids
    assert engine.manager.num_free_blocks == 199


def test_two_pipeline_stages_in_this_process_overlap_with_the_same_tokens():
    llm = LLM("tiny-gemma2", pipeline_parallel_size=2, block_size=4, num_blocks=200, max_num_batched_tokens=16,
              async_scheduling=True)
    outs = llm.generate(PROMPTS[:3], max_tokens=10)
    assert [o.output_token_ids for o in outs] == [reference("tiny-gemma2", tuple(p), 10) for p in PROMPTS[:3]]


# -- the worker: a draw fed on the device ------------------------------------------------------------------
def test_the_worker_feeds_a_draw_it_has_not_reported_yet():
    worker = Worker(build_tiny_model("tiny-mistral"), block_size=4, num_blocks=32)
    prompt = PROMPTS[0][:10]
    first = worker.launch(StepInput(0, [ScheduledChunk("r", prompt, 0, [[1, 2, 3]])]))
    second = worker.launch(StepInput(1, [ScheduledChunk("r", [0], 10, [[]], from_last_step=True)]))
    third = worker.launch(StepInput(2, [ScheduledChunk("r", [0], 11, [[4]], from_last_step=True)]))
    drawn = [worker.collect(p).sampled["r"] for p in (first, second, third)]
    assert drawn == reference("tiny-mistral", tuple(prompt), 3)
    with pytest.raises(RequestError, match="that step drew none for it"):
        worker.launch(StepInput(3, [ScheduledChunk("s", [0], 0, [[5]], from_last_step=True)]))
    with pytest.raises(RequestError, match="holds one token"):
        worker.launch(StepInput(3, [ScheduledChunk("r", [0, 0], 12, [[]], from_last_step=True)]))
    assert worker.block_table("r") == [[1, 2, 3, 4]]   # nothing changed by the refused steps


def test_the_blocks_of_a_chunk_refused_at_launch_are_not_hit_later():
    """Blocks are cached when allocated (their tokens are known), before a step computes them; a chunk the
    workers refuse never computes its blocks, so a later prompt must not find them in the prefix cache."""
    engine = recorded_engine(num_blocks=64, max_num_batched_tokens=64)
    engine.config.vocab_size = None            # only the worker (vocab 256) checks token ids now
    shared = list(PROMPTS[2][:12])             # three full blocks of 4, valid tokens
    engine.add_request("bad", shared + [300], SamplingParams(max_tokens=4))
    _, reasons, _ = run_all(engine)
    assert reasons == {"bad": "error"}
    engine.add_request("good", shared + [5, 6], SamplingParams(max_tokens=6))
    tokens, reasons, _ = run_all(engine)
    assert reasons == {"good": "length"}
    assert tokens["good"] == reference("tiny-gemma3", tuple(shared + [5, 6]), 6)
    assert engine.manager.stats.hit_tokens == 0
