"""The batched sampler against a plain per-row reference written here, one row and one token at a time.

The reference follows the documented semantics (OpenAI's presence / frequency penalties over generated
tokens; transformers' repetition penalty over prompt and output; vLLM's order: bias, penalties,
temperature, min_p, top_k, top_p) in float64 Python, so agreement is to float32 rounding.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from workers.protocol import GREEDY, RequestStart, SamplingSpec, ScheduledChunk
from workers.runtime.sampling import Sampler

VOCAB = 40


def reference_distribution(logits: list[float], spec: SamplingSpec, prompt: list[int], output: list[int]):
    """(greedy token, probabilities or None for greedy rows) of one row, the slow and obvious way."""
    x = [float(v) for v in logits]
    for t, b in spec.logit_bias:
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / spec.repetition_penalty if x[t] > 0 else x[t] * spec.repetition_penalty
    for t in set(output):
        x[t] -= spec.frequency_penalty * output.count(t) + spec.presence_penalty
    greedy = max(range(len(x)), key=lambda i: x[i])
    if spec.temperature < 1e-5:
        return greedy, None
    x = [v / spec.temperature for v in x]
    keep = set(range(len(x)))
    top = max(x)
    p = [math.exp(v - top) for v in x]
    total = sum(p)
    p = [v / total for v in p]
    if spec.min_p:
        keep = {i for i in keep if p[i] >= spec.min_p * max(p)}
    order = sorted(keep, key=lambda i: -x[i])
    if spec.top_k:
        order = order[:spec.top_k]
    if spec.top_p < 1:
        mass = sum(p[i] for i in order)
        kept, acc = [], 0.0
        for i in order:
            if acc >= spec.top_p:
                break
            kept.append(i)
            acc += p[i] / mass
        order = kept
    mass = sum(p[i] for i in order)
    return greedy, [p[i] / mass if i in order else 0.0 for i in range(len(x))]


def make_chunks(specs, prompts, outputs, seen_prompt=0):
    """One sampling chunk per request: the whole history as one prefill (minus a 'prefix hit' of
    ``seen_prompt`` tokens sent as seen_token_ids, as the scheduler does)."""
    chunks = []
    for i, (spec, prompt, output) in enumerate(zip(specs, prompts, outputs)):
        history = prompt + output
        hit = min(seen_prompt, len(prompt) - 1)
        seen = history[:hit] if spec.repetition_penalty != 1.0 else history[min(len(prompt), hit):hit]
        chunks.append(ScheduledChunk(f"r{i}", history[hit:], hit, [[]], start=RequestStart(spec, len(prompt), seen)))
    return chunks


SPECS = [
    GREEDY,
    SamplingSpec(logit_bias={3: 5.0, 7: -100.0}),                                   # greedy with bias
    SamplingSpec(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3),   # greedy, penalised
    SamplingSpec(temperature=0.7),
    SamplingSpec(temperature=1.3, top_k=5),
    SamplingSpec(temperature=0.9, top_p=0.6),
    SamplingSpec(temperature=1.0, min_p=0.2),
    SamplingSpec(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05, repetition_penalty=1.3, presence_penalty=1.0,
                 frequency_penalty=0.5, logit_bias={0: 2.0}),
    SamplingSpec(temperature=1.0, repetition_penalty=0.6, frequency_penalty=-0.7),   # rewards repeats
]


@pytest.mark.parametrize("seen_prompt", [0, 5])
def test_distributions_match_the_per_row_reference(seen_prompt):
    rng = random.Random(1)
    logits = torch.randn(len(SPECS), VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    prompts = [[rng.randrange(VOCAB) for _ in range(12)] for _ in SPECS]
    outputs = [[rng.randrange(VOCAB) for _ in range(6)] + [prompts[i][0]] * 3 for i in range(len(SPECS))]
    sampler = Sampler(VOCAB)
    chunks = make_chunks(SPECS, prompts, outputs, seen_prompt)
    sampler.observe(chunks)
    x = sampler.adjusted_logits(logits, chunks, SPECS)
    drawn = [i for i, s in enumerate(SPECS) if not s.greedy]
    probs = sampler.probabilities(x[drawn], [SPECS[i] for i in drawn])
    for i, spec in enumerate(SPECS):
        greedy, expected = reference_distribution(logits[i].tolist(), spec, prompts[i], outputs[i])
        assert int(x[i].argmax()) == greedy, i
        if expected is not None:
            got = probs[drawn.index(i)].tolist()
            assert got == pytest.approx(expected, abs=1e-5), i
            assert [g == 0 for g, e in zip(got, expected) if e == 0 or e > 1e-6] == \
                   [e == 0 for e in expected if e == 0 or e > 1e-6], i   # truncation drops exactly these
    tokens, _ = sampler.sample(logits, chunks)
    assert [tokens[i] for i, s in enumerate(SPECS) if s.greedy] == \
           [reference_distribution(logits[i].tolist(), s, prompts[i], outputs[i])[0] for i, s in enumerate(SPECS)
            if s.greedy]


def test_greedy_rows_are_the_plain_argmax_of_the_logits_in_their_own_dtype():
    logits = (torch.randn(16, 1000, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    chunks = [ScheduledChunk(f"g{i}", [1], 5, [[]]) for i in range(16)]   # no start: greedy
    tokens, logprobs = Sampler(1000).sample(logits, chunks)
    assert tokens == logits.argmax(dim=-1).tolist() and logprobs == {}


def test_draws_follow_the_distribution():
    """20000 unseeded rows of one distribution in one pass: empirical frequencies within 1.5 points."""
    spec = SamplingSpec(temperature=0.8, top_k=6, top_p=0.95)
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    _, expected = reference_distribution(row.tolist(), spec, [], [])
    n = 20000
    sampler = Sampler(VOCAB)
    chunks = [ScheduledChunk(f"r{i}", [1], 0, [[]], start=RequestStart(spec, 1)) for i in range(n)]
    sampler.observe(chunks)
    tokens, _ = sampler.sample(row.expand(n, VOCAB), chunks)
    freq = [0] * VOCAB
    for t in tokens:
        freq[t] += 1
    assert all(freq[t] == 0 for t in range(VOCAB) if expected[t] == 0)
    assert [f / n for f in freq] == pytest.approx(expected, abs=0.015)


def test_seeded_draws_replay_whatever_the_batch_and_differ_by_position_and_seed():
    logits = torch.zeros(1, VOCAB)   # uniform: the draw is the noise alone

    def draw(seed, position, others=0, sampler=None):
        sampler = sampler or Sampler(VOCAB)
        spec = SamplingSpec(temperature=1.0, seed=seed)
        chunks = [ScheduledChunk(f"x{i}", [1], position, [[]], start=RequestStart(SamplingSpec(temperature=1.0), 1))
                  for i in range(others)]
        chunks.append(ScheduledChunk("s", [1], position - 1, [[]], start=RequestStart(spec, 1)))
        sampler.observe(chunks)
        return sampler.sample(logits.expand(len(chunks), VOCAB), chunks)[0][-1]

    assert draw(7, 10) == draw(7, 10, others=5) == draw(7, 10, others=3, sampler=Sampler(VOCAB))
    assert len({draw(7, p) for p in range(1, 30)}) > 10
    assert len({draw(s, 10) for s in range(30)}) > 10
    assert draw(2**64 - 1, 3) == draw(2**64 - 1, 3)


def test_unseeded_requests_draw_their_own_randomness():
    logits = torch.zeros(64, VOCAB)
    chunks = [ScheduledChunk(f"r{i}", [1], 0, [[]], start=RequestStart(SamplingSpec(temperature=1.0), 1))
              for i in range(64)]
    sampler = Sampler(VOCAB)
    sampler.observe(chunks)
    first = sampler.sample(logits, chunks)[0]
    assert len(set(first)) > 20 and first != sampler.sample(logits, chunks)[0]


@pytest.mark.parametrize("temperature", [1e-39, 1e-6, 1e-5, 1e-3])
def test_tiny_temperatures_are_numerically_safe(temperature):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3)) * 50
    spec = SamplingSpec(temperature=temperature, seed=1)
    chunks = [ScheduledChunk(f"r{i}", [1], 0, [[]], start=RequestStart(spec, 1)) for i in range(4)]
    sampler = Sampler(VOCAB)
    sampler.observe(chunks)
    if not spec.greedy:
        assert not sampler.probabilities(logits, [spec] * 4).isnan().any()
    tokens, _ = sampler.sample(logits, chunks)
    assert tokens == logits.argmax(dim=-1).tolist()   # this sharp, the draw is the argmax


def test_logprobs_are_the_raw_log_softmax_with_the_top_k():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    specs = [SamplingSpec(logprobs=0), SamplingSpec(temperature=1.0, top_k=3, logprobs=5, logit_bias={9: 50.0}),
             SamplingSpec(temperature=0.5)]
    chunks = [ScheduledChunk(f"r{i}", [1], 0, [[]], start=RequestStart(s, 1)) for i, s in enumerate(specs)]
    sampler = Sampler(VOCAB)
    sampler.observe(chunks)
    tokens, logprobs = sampler.sample(logits, chunks)
    assert set(logprobs) == {"r0", "r1"} and tokens[1] == 9   # the bias makes 9 all but certain
    for i, k in ((0, 0), (1, 5)):
        row = logits[i].tolist()
        norm = math.log(sum(math.exp(v) for v in row))
        raw = [v - norm for v in row]
        chosen, ids, values = logprobs[f"r{i}"]
        assert chosen == pytest.approx(raw[tokens[i]], abs=1e-5)     # raw: before bias, top-k, temperature
        assert ids == sorted(range(VOCAB), key=lambda t: -raw[t])[:k]
        assert values == pytest.approx([raw[t] for t in ids], abs=1e-5)


def test_penalty_counts_follow_chunks_hits_recompute_and_forget():
    spec = SamplingSpec(frequency_penalty=1.0)     # counts output only: the prompt needs no seen tokens
    rep = SamplingSpec(repetition_penalty=1.5)
    sampler = Sampler(VOCAB)
    # 'a': prompt 0..5 in two chunks, then outputs 7, 7, 8 decoded one by one.
    sampler.observe([ScheduledChunk("a", [1, 2, 3], 0, [[]], sample=False, start=RequestStart(spec, 6))])
    sampler.observe([ScheduledChunk("a", [4, 5, 6], 3, [[]])])
    for pos, token in ((6, 7), (7, 7), (8, 8)):
        sampler.observe([ScheduledChunk("a", [token], pos, [[]])])
    # 'b': recomputed after preemption: 4 prompt tokens, 2 outputs (9, 9) inside a 5-token prefix hit.
    sampler.observe([ScheduledChunk("b", [2, 11], 5, [[]], start=RequestStart(rep, 4, [1, 2, 3, 4, 9]))])
    counts = {rid: sampler.output_counts[sampler.rows[rid]] for rid in "ab"}
    assert {t: int(counts["a"][t]) for t in counts["a"].nonzero().flatten().tolist()} == {7: 2, 8: 1}
    assert {t: int(counts["b"][t]) for t in counts["b"].nonzero().flatten().tolist()} == {9: 1, 2: 1, 11: 1}
    assert sampler.prompt_seen[sampler.rows["b"]].nonzero().flatten().tolist() == [1, 2, 3, 4]
    row = sampler.rows["a"]
    sampler.forget("a")
    assert not sampler.output_counts[row].any() and "a" not in sampler.specs
    sampler.observe([ScheduledChunk("c", [3], 0, [[]], start=RequestStart(spec, 1))])
    assert sampler.rows["c"] == row   # the freed row is reused


def test_bad_specs_are_refused_naming_the_field():
    for kwargs, field in (({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                          ({"top_k": -1}, "top_k"), ({"min_p": 1.5}, "min_p"),
                          ({"repetition_penalty": 0.0}, "repetition_penalty"),
                          ({"presence_penalty": math.inf}, "presence_penalty"),
                          ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": {1: math.nan}}, "logit_bias"),
                          ({"logprobs": 21}, "logprobs"), ({"seed": 2**64}, "seed"), ({"seed": -1}, "seed")):
        with pytest.raises(ValueError, match=f"^{field} must be"):
            SamplingSpec(**kwargs)
