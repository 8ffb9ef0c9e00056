"""The router sim's engine-step floor (``bench/router_sim.py``): a request's first token cannot come before
the end of the first step that starts at or after its arrival, and the sim reports how many met it."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import router_sim  # noqa: E402
from cluster.loadtest.workloads import Session, Turn  # noqa: E402
from workers.sim.cost_model import StepCostModel  # noqa: E402

MODEL, GPU = "gemma-3-27b", "H100-80GB"


def run(sessions, replicas=1):
    return router_sim.simulate("round-robin", sessions, model=MODEL, gpu=GPU, replicas=replicas,
                               kv_memory=6 << 30, duration_s=5.0)


def session(name, start_s, num_tokens, first_token=1):
    """One request; sessions with different ``first_token`` share no prefix."""
    text = tuple(range(first_token, first_token + num_tokens))
    return Session(name, start_s, (Turn(text, max_tokens=4),), carry_history=False)


def test_a_lone_request_on_an_idle_replica_gets_its_first_token_at_the_end_of_one_step():
    out = run([session("a", 0.0, 400)])
    step_s = StepCostModel(MODEL, GPU).step([(0, 400)]).time_s
    assert out["ttft_p50"] == pytest.approx(step_s)
    assert out["floor_p50"] == pytest.approx(step_s)
    assert out["any_floor_p50"] == pytest.approx(step_s)
    assert out["at_floor"] == 1.0


def test_a_prompt_longer_than_one_steps_budget_misses_the_floor_and_a_step_under_way_sets_it():
    # a (400 tokens) starts a step at once; b (900 tokens, over the 512-token budget) arrives during it, so
    # b's floor is the end of the next step, and b needs one step more than that.
    cost = StepCostModel(MODEL, GPU)
    first = cost.step([(0, 400)]).time_s
    second = cost.step([(400, 1), (0, 511)]).time_s
    out = run([session("a", 0.0, 400), session("b", 0.001, 900, first_token=1000)])
    assert out["completed"] == 2
    assert out["at_floor"] == 0.5
    b_floor = first + second - 0.001
    assert out["floor_p50"] == pytest.approx((first + b_floor) / 2)     # the mean of two values is their median
    assert out["any_floor_p50"] == out["floor_p50"]                      # one replica: nowhere else to go
    assert out["ttft_p50"] > out["floor_p50"]


def test_with_an_idle_second_replica_the_any_replica_floor_is_one_step_from_arrival():
    cost = StepCostModel(MODEL, GPU)
    out = run([session("a", 0.0, 400), session("b", 0.001, 400, first_token=1000)], replicas=2)
    # round-robin sends b to the idle replica, which starts b's step on arrival: every request at its floor.
    assert out["at_floor"] == 1.0
    assert out["any_floor_p50"] == pytest.approx(cost.step([(0, 400)]).time_s)
