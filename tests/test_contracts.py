"""The records that cross the Ray boundary are exactly what cluster/engine/types.py declares: the model info
an engine gives, its stream items, its load and its KV-event replies (the engine actor's logic runs here
without Ray), and the sampling parameters the HTTP edge sends."""
from __future__ import annotations

import asyncio
import pickle

import pytest

from cluster.engine.build import build_engine
from cluster.engine.kv_events import KVEventsReply
from cluster.engine.types import Load, ModelInfo, SamplingParams, StreamItem
from cluster.ray.engine_actor import EngineService


def keys(typed_dict) -> tuple[set, set]:
    """(required keys, optional keys) of a TypedDict."""
    return set(typed_dict.__required_keys__), set(typed_dict.__optional_keys__)


def simulated_service() -> EngineService:
    return EngineService(lambda: build_engine("gemma-3-27b", simulated_gpu="H100-80GB", kv_cache_memory=1 << 30,
                                              max_num_batched_tokens=64))


def test_build_engine_gives_every_model_info_key_and_the_actor_adds_its_rank():
    _, info = build_engine("tiny-llama", block_size=4, num_blocks=40)
    required, optional = keys(ModelInfo)
    assert set(info) == required and optional == {"replica"}
    assert (info["model"], info["block_size"], info["num_blocks"], info["group_widths"]) == ("tiny-llama", 4, 40, [1])

    async def main():
        svc = simulated_service()
        return await svc.ready()
    served = asyncio.run(main())
    assert set(served) == required | {"replica"} and served["replica"] == 0
    assert (served["model"], served["simulated_gpu"], served["max_num_batched_tokens"]) == ("gemma-3-27b", "H100-80GB", 64)


def test_stream_items_loads_and_kv_event_replies_have_exactly_the_declared_keys():
    async def main():
        svc = simulated_service()
        items = [item async for item in svc.generate("a", list(range(1, 40)), SamplingParams(max_tokens=3))]
        reply = await svc.kv_events(None, 0, 0.0)
        again = await svc.kv_events(reply["epoch"], reply["snapshot"][0], 0.0)
        return items, reply, again
    items, reply, again = asyncio.run(main())
    assert [set(i) for i in items] == [keys(StreamItem)[0]] * 3
    assert [(len(i["token_ids"]), i["finished"], i["finish_reason"], i["error_type"]) for i in items] == \
        [(1, False, None, None), (1, False, None, None), (1, True, "length", None)]
    required, optional = keys(KVEventsReply)
    assert set(reply) == required | {"snapshot"} and set(again) == required | {"batches"}
    assert optional == {"snapshot", "batches"} and again["batches"] == []
    assert set(reply["load"]) == keys(Load)[0]
    assert reply["load"] == {"status": "ready", "running": 0, "waiting": 0, "kv_usage": 0.0, "prefill_backlog": 0}


def test_sampling_params_are_checked_where_they_are_made_and_cross_a_pickle_whole():
    with pytest.raises(ValueError, match="top_p must be a number in \\(0, 1\\], got 0"):
        SamplingParams(top_p=0)
    params = SamplingParams(max_tokens=5, temperature=0.7, seed=-1, logit_bias={7: 2.0}, stop_token_ids=(3,))
    copy = pickle.loads(pickle.dumps(params))
    assert copy == params and copy.spec == params.spec and copy.spec.seed == 2**64 - 1
    assert copy.spec.logit_bias == ((7, 2.0),)
