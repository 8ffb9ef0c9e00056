"""The served engine runs the offline engine's step loop (``EngineCore``) on one engine-core thread: with
asynchronous scheduling too, its tokens are transformers' greedy ones; a frontend's subscription gets
one record per step holding all its requests' updates; the actor answers while a step runs; a
subscription that ends aborts its requests. No Ray here: ``EngineService`` is a plain class."""
from __future__ import annotations

import asyncio
import functools
import os
import threading

import pytest
import torch

from cluster.engine.build import build_engine
from cluster.engine.executor import LocalExecutor
from cluster.engine.types import SamplingParams
from cluster.ray.engine_actor import EngineService
from cluster.ray.record_ring import ADDED, AddWriter, LoopReader, RingHandles, host_id
from cluster.serve.feed import merge, next_item
from workers.models.tiny_models import build_tiny_model

MODEL = "tiny-llama"
PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 101, 102, 103], [42] * 5]


@functools.cache
def reference(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    m = build_tiny_model(MODEL, seed=0)
    out = m.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


class Counting(LocalExecutor):
    """Real workers; counts steps launched while another was still in flight (the overlapped path)."""

    def __init__(self, stage_kwargs):
        super().__init__(stage_kwargs)
        self.in_flight = self.overlapped = 0

    def submit(self, step):
        self.in_flight += 1
        self.overlapped += self.in_flight > 1
        return super().submit(step)

    def collect(self, handle):
        self.in_flight -= 1
        return super().collect(handle)


async def read_subscription(svc: EngineService, name: str, keys: set[int]) -> list[list]:
    """Records of ``name``'s subscription until every key's request finished."""
    records, open_ = [], set(keys)
    sub = svc.subscribe(name)
    assert await anext(sub) == []
    async for record in sub:
        records.append(record)
        open_ -= {key for key, item in record if item["finished"]}
        if not open_:
            break
    await sub.aclose()
    return records


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_subscription_gets_one_record_per_step_with_every_request_and_greedy_tokens(async_scheduling):
    def build():
        engine, info = build_engine(MODEL, block_size=4, num_blocks=256, async_scheduling=async_scheduling)
        engine.executor = Counting(engine.executor.stage_kwargs)
        return engine, info

    async def main():
        svc = EngineService(build)
        sub = svc.subscribe("frontend-a")
        assert await anext(sub) == []                     # registered: requests may be added now
        ids = [await svc.add_request("frontend-a", key, f"r{key}", p, {"max_tokens": 6})
               for key, p in enumerate(PROMPTS)]
        records, finished = [], set()
        async for record in sub:
            records.append(record)
            finished |= {key for key, item in record if item["finished"]}
            if len(finished) == 3:
                break
        await sub.aclose()
        return svc, ids, records

    svc, ids, records = asyncio.run(main())
    tokens = {key: [] for key in range(3)}
    for record in records:
        for key, item in record:
            assert item["request_id"] == ids[key]
            tokens[key] += item["token_ids"]
    assert [tokens[k] for k in range(3)] == [reference(tuple(p), 6) for p in PROMPTS]
    assert svc.records == len(records) <= svc.engine.metrics.steps    # at most one Ray message per step
    assert any(len(record) == 3 for record in records)                # one record carried all three
    assert (svc.engine.executor.overlapped > 0) == async_scheduling        # the overlapped path ran when asked


def test_add_request_refuses_bad_input_before_queueing_and_an_unknown_subscription():
    async def main():
        svc = EngineService(lambda: build_engine(MODEL, block_size=4, num_blocks=64))
        sub = svc.subscribe("f")
        await anext(sub)
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            await svc.add_request("f", 0, "bad", [1, 2, 10**6], {"max_tokens": 2})
        with pytest.raises(ValueError, match="max_tokens"):
            await svc.add_request("f", 1, "bad", [1, 2], {"max_tokens": -1})
        with pytest.raises(RuntimeError, match="no subscription 'g'"):
            await svc.add_request("g", 0, "x", [1, 2], {"max_tokens": 2})
        stats = await svc.stats()
        await sub.aclose()
        return stats

    stats = asyncio.run(main())
    assert (stats["running"], stats["waiting"]) == (0, 0)


def test_a_subscription_that_ends_aborts_its_requests_and_not_another_frontends():
    async def main():
        svc = EngineService(lambda: build_engine(MODEL, block_size=4, num_blocks=256))
        gone, stays = svc.subscribe("gone"), svc.subscribe("stays")
        await anext(gone)
        await anext(stays)
        await svc.add_request("gone", 0, "a", PROMPTS[0], {"max_tokens": 400})
        await svc.add_request("stays", 0, "b", PROMPTS[1], {"max_tokens": 12})
        await anext(gone)
        await gone.aclose()                               # the frontend died
        tokens = []
        async for record in stays:
            tokens += [t for _, item in record for t in item["token_ids"]]
            if any(item["finished"] for _, item in record):
                break
        await stays.aclose()
        for _ in range(3000):                               # the abort lands between two steps: poll, bounded
            stats = await svc.stats()   # running == 0 alone holds too before the first step admits it
            if stats["running"] == stats["waiting"] == 0 and stats["finished"]:
                break
            await asyncio.sleep(0.01)
        return tokens, stats

    tokens, stats = asyncio.run(main())
    assert tokens == reference(tuple(PROMPTS[1]), 12)
    assert (stats["running"], stats["finished"]) == (0, {"abort": 1, "length": 1})


class Blocking(LocalExecutor):
    """Real workers; a step waits until the test lets it go."""

    def __init__(self, stage_kwargs):
        super().__init__(stage_kwargs)
        self.entered, self.go = threading.Event(), threading.Event()

    def submit(self, step):
        self.entered.set()
        self.go.wait()
        return super().submit(step)


def test_health_stats_and_kv_events_answer_while_a_step_runs():
    def build():
        engine, info = build_engine(MODEL, block_size=4, num_blocks=64)
        engine.executor = Blocking(engine.executor.stage_kwargs)
        return engine, info

    async def main():
        svc = EngineService(build)
        gen = svc.generate("a", PROMPTS[0], {"max_tokens": 3})
        first = asyncio.create_task(anext(gen))
        await svc.ready()
        executor = svc.engine.executor
        await asyncio.to_thread(executor.entered.wait, 30)   # the core thread is inside a step
        health = await asyncio.wait_for(svc.health(), 10)
        stats = await asyncio.wait_for(svc.stats(), 10)
        events = await asyncio.wait_for(svc.kv_events(svc.events.epoch, 0, 0.0), 10)
        executor.go.set()
        items = [await first] + [item async for item in gen]
        return health, stats, items, events

    health, stats, items, events = asyncio.run(main())
    assert events["batches"] == [] and events["load"]["running"] == 1
    assert health["status"] == "ready" and (stats["running"], stats["steps"]) == (1, 0)
    assert [t for i in items for t in i["token_ids"]] == reference(tuple(PROMPTS[0]), 3)


def test_a_lagging_consumer_gets_its_queued_items_as_one():
    def item(tokens, finished=False, reason=None, logprobs=None):
        return {"request_id": "r#1", "token_ids": tokens, "finished": finished, "finish_reason": reason,
                "logprobs": logprobs, "num_cached_tokens": 4, "error": None, "error_type": None,
                "prompt_logprobs": None}

    async def main():
        queue = asyncio.Queue()
        for i in (item([1], logprobs=[(-0.1, [1], [-0.1])]), item([2], logprobs=[(-0.2, [2], [-0.2])]),
                  item([3], True, "length", logprobs=[(-0.3, [3], [-0.3])]), item([9])):
            queue.put_nowait(i)
        return await next_item(queue), await next_item(queue)

    merged, after = asyncio.run(main())
    assert merged == item([1, 2, 3], True, "length", [(-0.1, [1], [-0.1]), (-0.2, [2], [-0.2]), (-0.3, [3], [-0.3])])
    assert after["token_ids"] == [9]                      # nothing merged across a finished item
    assert merge(item([1]), item([2]))["logprobs"] is None


def test_a_second_subscription_under_one_name_ends_the_first_and_aborts_its_requests():
    async def main():
        svc = EngineService(lambda: build_engine(MODEL, block_size=4, num_blocks=256))
        first = svc.subscribe("f")
        await anext(first)
        await svc.add_request("f", 0, "a", PROMPTS[0], {"max_tokens": 400})
        second = svc.subscribe("f")
        assert await anext(second) == []
        async def records():
            return [record async for record in first]
        rest = await asyncio.wait_for(records(), 30)        # ends instead of waiting forever
        await second.aclose()
        for _ in range(3000):                               # the abort lands between two steps: poll, bounded
            stats = await svc.stats()   # running == 0 alone holds too before the first step admits it
            if stats["running"] == stats["waiting"] == 0 and stats["finished"]:
                break
            await asyncio.sleep(0.01)
        return rest, stats

    rest, stats = asyncio.run(main())
    assert all(key == 0 for record in rest for key, _ in record)
    assert (stats["running"], stats["finished"]) == (0, {"abort": 1})


def test_a_batch_of_adds_queues_the_good_requests_and_returns_each_bad_ones_own_error():
    async def main():
        svc = EngineService(lambda: build_engine(MODEL, block_size=4, num_blocks=256))
        sub = svc.subscribe("f")
        assert await anext(sub) == []
        results = await svc.add_requests("f", [
            (0, "a", PROMPTS[0], {"max_tokens": 3}, None),
            (1, "bad-token", [1, 2, 10**6], {"max_tokens": 2}, None),     # refused by the engine
            (2, "bad-params", PROMPTS[1], {"max_tokens": -1}, None),      # refused before the engine
            (3, "d", PROMPTS[2], {"max_tokens": 4}, None)])
        tokens, finished = {}, set()
        async for record in sub:
            for key, item in record:
                tokens.setdefault(key, []).extend(item["token_ids"])
                finished |= {key} if item["finished"] else set()
            if finished == {0, 3}:
                break
        await sub.aclose()
        return results, tokens, await svc.stats()

    results, tokens, stats = asyncio.run(main())
    assert results[0] == "a#1" and results[3] == "d#3"
    assert isinstance(results[1], ValueError) and "outside the model's vocabulary" in str(results[1])
    assert isinstance(results[2], ValueError) and "max_tokens" in str(results[2])
    assert tokens == {0: reference(tuple(PROMPTS[0]), 3), 3: reference(tuple(PROMPTS[2]), 4)}   # none for 1, 2
    assert (stats["add_calls"], stats["finished"]) == (1, {"length": 2})


def test_a_frontend_on_the_engines_host_adds_and_reads_through_rings_and_leaving_them_aborts_its_requests():
    """A subscriber on the engine's host gets two shared-memory rings' handles instead of records
    (``record_ring``): its adds go in through one, each burst's results (engine ids, or a refusal) and every
    record come out through the other, one message per step at most, greedy tokens as over Ray. A reader
    that detaches (its frontend died) ends the subscription: its request is aborted. The rings' names leave
    /dev/shm as soon as both ends have mapped them, so a killed engine or frontend leaves nothing there."""
    async def main():
        svc = EngineService(lambda: build_engine(MODEL, block_size=4, num_blocks=256))
        sub = svc.subscribe("f", host_id())
        handles = await anext(sub)
        assert isinstance(handles, RingHandles)
        follow = asyncio.ensure_future(anext(sub))          # the subscription's loop: ends when it does
        records = []
        reader, adds = LoopReader(handles.records, records.append), AddWriter(handles.adds)
        assert adds.try_send([(key, f"r{key}", p, {"max_tokens": 6}, None) for key, p in enumerate(PROMPTS)]
                             + [(3, "bad", [1, 2, 10**6], {"max_tokens": 2}, None)])
        for _ in range(3000):
            if len({key for record in records for key, item in record if key != ADDED and item["finished"]}) == 3:
                break
            await asyncio.sleep(0.01)
        finished_records, sent, calls = list(records), svc.records, svc.add_calls
        names_while_live = [os.path.exists(f"/dev/shm/{h.name}") for h in (handles.records, handles.adds)]
        assert adds.try_send([(7, "long", PROMPTS[0], {"max_tokens": 400}, None)])
        while not any(key == 7 for record in records for key, _ in record):
            await asyncio.sleep(0.01)
        reader.close()                                      # the frontend is gone
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(follow, 30)              # the watch or the writer found it
        for _ in range(3000):
            stats = await svc.stats()
            if stats["running"] == stats["waiting"] == 0 and stats["finished"].get("abort"):
                break
            await asyncio.sleep(0.01)
        adds.close()
        return finished_records, sent, calls, svc.engine.metrics.steps, stats, handles, names_while_live

    records, sent, calls, steps, stats, handles, names_while_live = asyncio.run(main())
    added = [result for record in records for key, results in record if key == ADDED for result in results]
    assert [key for key, _ in added] == [0, 1, 2, 3] and calls == 1           # one burst, one add call
    assert [result for _, result in added[:3]] == ["r0#1", "r1#2", "r2#3"]
    assert isinstance(added[3][1], ValueError) and "vocabulary" in str(added[3][1])
    tokens = {key: [] for key in range(3)}
    for record in records:
        for key, item in record:
            if key != ADDED:
                tokens[key] += item["token_ids"]
    assert [tokens[k] for k in range(3)] == [reference(tuple(p), 6) for p in PROMPTS]
    assert sent == len(records) <= steps + 1                # one ring message per record: a step's, or the adds'
    assert (stats["running"], stats["finished"]) == (0, {"length": 3, "abort": 1})
    assert not os.path.exists(f"/dev/shm/{handles.records.name}") and not os.path.exists(f"/dev/shm/{handles.adds.name}")
    # both ends had mapped both rings once the first record went out: their names were gone from then on,
    # while every record still came through
    assert names_while_live == [False, False]


def test_requests_whose_add_was_in_flight_when_the_subscription_ended_are_aborted():
    """The frontend's stream ends while its add waits for the core thread: nobody will read those requests,
    so they must be aborted, not run to ``max_tokens``."""
    async def main():
        svc = EngineService(lambda: build_engine(MODEL, block_size=4, num_blocks=256))
        sub = svc.subscribe("f")
        await anext(sub)
        adding = asyncio.ensure_future(svc.add_requests("f", [(0, "a", PROMPTS[0], {"max_tokens": 400}, None)]))
        await asyncio.sleep(0)                              # the add waits on the core thread now
        await sub.aclose()                                  # the frontend died
        ids = await adding
        for _ in range(3000):
            stats = await svc.stats()
            if stats["running"] == stats["waiting"] == 0 and stats["finished"]:
                break
            await asyncio.sleep(0.01)
        return ids, stats

    ids, stats = asyncio.run(main())
    assert ids == ["a#1"]
    assert (stats["running"], stats["finished"]) == (0, {"abort": 1})


def test_the_step_clock_waits_on_decode_steps_once_timed_until_the_shortest_recent_one_less_its_lead():
    from cluster.engine.step_clock import LEAD_FLOOR_S, StepClock
    clock = StepClock()
    clock.launched(8, taken_at=100.0, host_s=0.001)
    assert clock.due is None                       # steps of 8 tokens never timed: schedule at once
    for took in (0.050, 0.030, 0.040, 0.045, 0.060):
        clock.ran(8, took)
    clock.ran(12, 0.500)                           # the same size class (8-15 tokens): 0.050 and 0.030 drop out
    clock.ran(16, 0.001)                           # another class, and a worker that does not say:
    clock.ran(9, 0.0)
    clock.launched(9, taken_at=100.0, host_s=0.002)
    # the shortest of 0.040, 0.045, 0.060, 0.500, less twice the longest host time and the floor
    assert clock.due == pytest.approx(100.0 + 0.040 - (LEAD_FLOOR_S + 2 * 0.002))
    clock.launched(40, taken_at=200.0, host_s=0.0)
    assert clock.due is None
    clock.ran(None, 0.040)                         # a step with a prompt chunk: not timed ...
    clock.launched(None, taken_at=300.0, host_s=0.0)
    assert clock.due is None                       # ... and followed at once


def test_the_step_clock_schedules_at_once_steps_too_short_for_their_lead():
    from cluster.engine.step_clock import LEAD_FLOOR_S, StepClock
    clock = StepClock()
    for took in (0.0030, 0.0029):                  # CPU-length decode steps
        clock.ran(1, took)
    clock.launched(1, taken_at=10.0, host_s=0.0002)
    assert clock.due is None                       # a lead of 1.4 ms is over a quarter of 2.9 ms
    clock.ran(1, 0.0056)                           # a step of 5.6 ms: one of 2.9 is still among the last four
    clock.launched(1, taken_at=10.0, host_s=0.0002)
    assert clock.due is None
    for _ in range(4):                             # the last four of 6 ms: a lead of 1.4 ms is under a quarter
        clock.ran(1, 0.0060)
    clock.launched(1, taken_at=10.0, host_s=0.0002)
    assert clock.due == pytest.approx(10.0 + 0.0060 - (LEAD_FLOOR_S + 2 * 0.0002))


def test_the_step_clock_lengthens_its_lead_by_late_wake_ups_and_forgets_them_after_256_steps():
    from cluster.engine.step_clock import LATE_MEMORY_STEPS, LEAD_FLOOR_S, StepClock
    clock = StepClock()
    for _ in range(4):
        clock.ran(16, 0.015)                       # GPU-length steps of 16 tokens
    clock.launched(16, taken_at=0.0, host_s=0.0005)
    assert clock.due == pytest.approx(0.015 - (LEAD_FLOOR_S + 0.001))
    clock.woke(clock.due - 0.001)                  # did not wait for it (nothing counted) ...
    clock.launched(16, taken_at=1.0, host_s=0.0005)
    clock.woke(clock.due + 0.0025)                 # ... then woke 2.5 ms past it: the lead grows by that
    clock.launched(16, taken_at=2.0, host_s=0.0005)
    assert clock.due is None                       # a lead of 4.5 ms is over a quarter of 15 ms
    for step in range(LATE_MEMORY_STEPS - 1):
        clock.woke(100.0 + step)                   # no due: nothing counted
        clock.launched(16, taken_at=100.0 + step, host_s=0.0005)
        assert clock.due is None
    clock.woke(500.0)                              # 256 steps on, the late wake-up is forgotten
    clock.launched(16, taken_at=3.0, host_s=0.0005)
    assert clock.due == pytest.approx(3.0 + 0.015 - (LEAD_FLOOR_S + 0.001))
