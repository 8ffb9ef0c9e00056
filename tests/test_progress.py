"""Progress: every accepted request finishes within a bounded number of steps, and admission refuses only
what could never finish.

A hypothesis search over tiny configurations (block sizes, pool size, windows and chunks, layer kinds,
prefix caching on and off, token budget, several requests with prompts over a 3-token alphabet so that
prefixes are shared, arriving at different steps) drives the real ``Engine`` with the simulated worker,
which checks every step's block tables strictly. The step bound is the scheduler's progress argument:
the oldest running request gains a token every step and is never preempted, so everything accepted by
step ``t`` is done by ``t + sum(prompt + max_tokens)``. The refusal oracle is a brute force over every
position: computing position ``c`` needs real blocks covering ``first_needed_token(c) .. c`` in every
group (the simulated worker refuses a step that lacks them), so a request whose worst position needs
more than the pool has can never finish. The two livelocks the issue reports run through ``LLM`` with a
real tiny model and must give transformers' tokens.
"""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cluster import LLM
from cluster.engine.engine import Engine, EngineConfig
from cluster.engine.types import SamplingParams
from kvmanager import ChunkedLocalAttention, FullAttention, SlidingWindow
from kvmanager.planning import peak_blocks
from workers.models.tiny_models import build_tiny_model
from workers.sim.cost_model import StepCostModel

from drivers import SimulatedExecutor

VOCAB = 3   # generated tokens come from the same alphabet as prompts: outputs are shared prefixes too
ROOFLINE = StepCostModel("gemma-3-27b", "H100-80GB")


def brute_force_need(specs, widths, num_tokens: int) -> int:
    """Pool units the worst computed position (0 .. num_tokens - 2) needs, all groups together."""
    return max(sum(w * (c // s.block_size - s.first_needed_token(c) // s.block_size + 1)
                   for s, w in zip(specs, widths))
               for c in range(num_tokens - 1))


BLOCK = st.sampled_from([1, 2, 3, 4, 8])
SPEC = st.one_of(st.builds(FullAttention, block_size=BLOCK),
                 st.builds(SlidingWindow, block_size=BLOCK, window=st.integers(1, 20)),
                 st.builds(ChunkedLocalAttention, block_size=BLOCK, chunk_size=st.integers(1, 20)))
REQUEST = st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),   # prompt
                    st.integers(1, 24),                                                # max_tokens
                    st.integers(0, 12))                                                # arrival step


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=st.lists(st.tuples(SPEC, st.integers(1, 3)), min_size=1, max_size=3), num_blocks=st.integers(2, 24),
       caching=st.booleans(), budget=st.integers(1, 48), max_model_len=st.integers(2, 80),
       requests=st.lists(REQUEST, min_size=1, max_size=6), widened=st.booleans())
def test_every_accepted_request_finishes_within_the_progress_bound(groups, num_blocks, caching, budget, max_model_len,
                                                                   requests, widened):
    specs, widths = [s for s, _ in groups], [w for _, w in groups]
    assume(num_blocks > max(widths))   # the manager refuses a pool that cannot hold one block of each group
    # ``widened``: each step's budget also grows by a roofline's prefill room beside its decodes (up to 2 x budget)
    room = functools.partial(ROOFLINE.prefill_room, granule=1, limit=2 * budget) if widened else None
    engine = Engine(SimulatedExecutor(specs, num_blocks, widths, VOCAB), specs, num_blocks,
                    EngineConfig(max_model_len=max_model_len, max_num_batched_tokens=budget,
                                 enable_prefix_caching=caching, vocab_size=VOCAB, prefill_room=room),
                    group_widths=widths)
    expected, outputs, reasons = {}, {}, {}
    bound = max(arrival for _, _, arrival in requests) + 1
    step = 0
    while step < bound or engine.has_work():
        for i, (prompt, max_tokens, arrival) in enumerate(requests):
            if arrival != step:
                continue
            total = min(len(prompt) + max_tokens, max_model_len)
            try:
                engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens))
            except ValueError as exc:
                if len(prompt) >= max_model_len:
                    assert "leaves no room to generate" in str(exc)
                else:   # refused only what can never finish, with the figures that say so
                    need = brute_force_need(specs, widths, total)
                    assert need > num_blocks - 1
                    assert f"{total} tokens need up to {need} KV blocks, the pool has {num_blocks - 1}" in str(exc)
                continue
            expected[f"r{i}"] = total - len(prompt)
            outputs[f"r{i}"] = []
            bound += total
        assert step < bound, f"step {step}: accepted requests still unfinished: {sorted(set(outputs) - set(reasons))}"
        if engine.has_work():
            updates = engine.step()
            assert updates or engine.scheduler.running, "a step with work scheduled nothing"
            for u in updates:
                outputs[u.request_id] += u.new_token_ids
                if u.finished:
                    reasons[u.request_id] = u.finish_reason
        step += 1
    assert reasons == {rid: "length" for rid in expected}
    assert {rid: len(out) for rid, out in outputs.items()} == expected
    assert engine.manager.num_free_blocks == num_blocks - 1   # every block back in the pool
    assert engine.metrics.worker_restarts == 0                 # the worker never refused a step


@settings(max_examples=300, deadline=None)
@given(groups=st.lists(st.tuples(SPEC, st.integers(1, 4)), min_size=1, max_size=4), num_positions=st.integers(0, 200))
def test_peak_blocks_is_the_brute_force_maximum_in_units(groups, num_positions):
    specs, widths = [s for s, _ in groups], [w for _, w in groups]
    brute = max((sum(w * (c // s.block_size - s.first_needed_token(c) // s.block_size + 1)
                     for s, w in zip(specs, widths))
                 for c in range(num_positions)), default=0)
    assert peak_blocks(specs, num_positions, widths) == brute


# -- the reported livelocks, through LLM with a real tiny model ---------------------------------------
@functools.cache
def reference(model: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    m = build_tiny_model(model, seed=0)
    out = m.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("block_size,num_blocks,caching,prompt", [
    (4, 6, False, list(range(50))),        # repro_livelock_llm: a running request alone preempted itself
    (16, 3, True, list(range(1, 51))),     # repro_livelock_llm2: window 8 < block 16, computed 16 -> 24 -> 16 ...
])
def test_a_request_alone_in_a_tight_pool_finishes_with_the_right_tokens(block_size, num_blocks, caching, prompt):
    llm = LLM("tiny-mistral", block_size=block_size, num_blocks=num_blocks, max_num_batched_tokens=64,
              enable_prefix_caching=caching)
    (out,) = llm.generate([prompt], max_tokens=4)
    assert out.output_token_ids == reference("tiny-mistral", tuple(prompt), 4)
    assert out.finish_reason == "length"
    assert llm.engine.metrics.steps <= len(prompt) + 4   # at least a token a step, as the bound says


def test_a_request_that_cannot_fit_even_alone_is_refused_with_its_figures():
    # tiny-mistral: 2 sliding layers, W = 8, one group; block 4: position c holds 8 tokens over up to 3 blocks
    llm = LLM("tiny-mistral", block_size=4, num_blocks=3, enable_prefix_caching=False)
    with pytest.raises(ValueError, match=r"12 tokens need up to 3 KV blocks, the pool has 2"):
        llm.generate([list(range(8))], max_tokens=4)
    (out,) = llm.generate([list(range(5))], max_tokens=1)   # positions 0..4: two blocks at most
    assert out.output_token_ids == reference("tiny-mistral", tuple(range(5)), 1)
