"""Sampling through the engine: parameters travel once per admission, seeded draws survive preemption and
worker restarts token for token, and a request without max_tokens runs to the end of what it can hold.
"""
from __future__ import annotations

import pytest

from workers.wire import decode_output, decode_step, encode_output, encode_step
from cluster.engine.engine import WorkerFailure
from cluster.engine.build import build_engine
from cluster.engine.types import SamplingParams

# Six prompts of 20..35 tokens (windows are 8); the last shares the first one's 20-token prefix.
PROMPTS = [[(7 * i + j) % 256 for j in range(20 + 3 * i)] for i in range(5)] + [[j % 256 for j in range(20)] + [1, 2, 3]]
SAMPLED = [SamplingParams(max_tokens=12, temperature=1.0, seed=11, top_p=0.9),
           SamplingParams(max_tokens=12, temperature=0.8, seed=12, top_k=20, presence_penalty=1.5),
           SamplingParams(max_tokens=12, temperature=1.2, seed=13, repetition_penalty=1.4, min_p=0.02),
           SamplingParams(max_tokens=12, temperature=1.0, seed=-5, frequency_penalty=0.8, logit_bias={5: 3.0}),
           SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, logprobs=3),
           SamplingParams(max_tokens=12, temperature=1.0, seed=2**64 - 1, logprobs=2)]


class Recording:
    """Wraps an executor: every step goes through the msgpack wire format both ways and is kept; ``fail_at``
    step numbers raise a WorkerFailure instead (the engine then restarts the workers)."""

    def __init__(self, executor, fail_at=()):
        self.executor, self.fail_at, self.steps = executor, set(fail_at), []

    def execute(self, step):
        wired = decode_step(encode_step(step))
        assert wired == step
        self.steps.append(wired)
        if len(self.steps) in self.fail_at:
            raise WorkerFailure("injected")
        out = self.executor.execute(wired)
        assert decode_output(encode_output(out)) == out
        return out

    def restart(self):
        self.executor.restart()


def run(num_blocks: int, fail_at=(), model="tiny-gemma3"):
    engine, _ = build_engine(model, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=16)
    engine.executor = Recording(engine.executor, fail_at)
    for i, (prompt, params) in enumerate(zip(PROMPTS, SAMPLED)):
        engine.add_request(f"r{i}", prompt, params)
    tokens = {f"r{i}": [] for i in range(len(PROMPTS))}
    logprobs = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_work():
        for u in engine.step():
            tokens[u.request_id] += u.new_token_ids
            logprobs[u.request_id] += u.logprobs or []
    return engine, tokens, logprobs


@pytest.fixture(scope="module")
def roomy():
    return run(num_blocks=400)


def test_sampling_params_travel_with_each_admissions_first_chunk_only(roomy):
    engine, tokens, _ = run(num_blocks=32)      # too small for all six: requests are preempted (chunks shrink first)
    assert engine.stats()["preemptions"] >= 2
    on_workers, starts = set(), 0
    for step in engine.executor.steps:
        on_workers -= set(step.forget)
        for chunk in step.chunks:
            i = int(chunk.request_id[1:])
            # a start exactly when the workers do not hold the request (new, or forgotten on preemption)
            assert (chunk.start is not None) == (chunk.request_id not in on_workers)
            on_workers.add(chunk.request_id)
            if chunk.start is not None:
                starts += 1
                assert chunk.start.sampling == SAMPLED[i].spec
                assert chunk.start.num_prompt_tokens == len(PROMPTS[i])
                # the history travels only for penalties, and only the part the workers cannot have seen
                seen = chunk.start.seen_token_ids
                history = PROMPTS[i] + tokens[chunk.request_id]
                if not SAMPLED[i].spec.has_penalties:
                    assert seen == []
                elif SAMPLED[i].repetition_penalty != 1.0:
                    assert seen == history[:chunk.start_pos]
                else:
                    assert seen == history[len(PROMPTS[i]):chunk.start_pos]
    assert starts == len(PROMPTS) + engine.stats()["preemptions"]
    assert all(len(t) == 12 for t in tokens.values())


def test_seeded_and_greedy_tokens_survive_preemption_and_worker_restarts(roomy):
    _, expected, expected_logprobs = roomy
    preempted_engine, preempted, _ = run(num_blocks=32)
    assert preempted_engine.stats()["preemptions"] >= 2
    restarted_engine, restarted, restarted_logprobs = run(num_blocks=400, fail_at=(6, 14))
    assert restarted_engine.stats()["worker_restarts"] == 2
    assert preempted == expected
    assert restarted == expected
    assert len(set(map(tuple, expected.values()))) == len(PROMPTS)
    assert [len(v) for v in restarted_logprobs.values()] == [0, 0, 0, 0, 12, 12]
    for rid in ("r4", "r5"):
        for (lp, ids, values), (lp2, ids2, values2) in zip(expected_logprobs[rid], restarted_logprobs[rid]):
            assert ids == ids2 and lp == pytest.approx(lp2, abs=1e-4) and values == pytest.approx(values2, abs=1e-4)


def test_max_tokens_left_out_means_the_rest_of_what_the_request_can_hold():
    # 64 blocks of 4: one request alone reaches T tokens while computing positions 0..T-2 holds
    # ceil((T-1)/4) full + 3 sliding x 3 <= 63 blocks (its last token is sampled, never computed): T = 217.
    engine, _ = build_engine("tiny-gemma3", block_size=4, num_blocks=64, max_model_len=256)
    engine.add_request("pool", [1] * 10, SamplingParams())
    assert engine.scheduler.sequences["pool"].params.max_tokens == 207
    engine2, _ = build_engine("tiny-gemma3", block_size=4, num_blocks=400, max_model_len=40)
    engine2.add_request("context", [1] * 10, SamplingParams())
    out = []
    while engine2.has_work():
        out += engine2.step()
    assert sum(len(u.new_token_ids) for u in out) == 30 and out[-1].finish_reason == "length"
