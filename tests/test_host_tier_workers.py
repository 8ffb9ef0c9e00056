"""The host tier's data path below the engine: the step fields, their wire format, a worker's host pool
(exact bytes back and forth), the simulated worker's PCIe time, and the flag from bytes to host units.

Figures by hand. tiny-gemma3 (block 4, float32): 3 sliding layers and 1 full, so one layer per unit
(S = 1), a sliding block is 3 units and a full one 1; a unit is 2 (K, V) x 4 tokens x 2 KV heads x 16 x 4
bytes = 1024 bytes. gemma-3-27b (block 16, bf16): 52 sliding and 10 full layers, S = 2, widths 26 and 5;
a page is 2 x 16 x 16 KV heads x 128 x 2 bytes = 131072 bytes, a unit 262144.
"""
from __future__ import annotations

import pytest
import torch

from cluster.cli import build_parser
from cluster.engine.build import build_engine
from cluster.engine.types import SamplingParams
from cluster.serve.metrics import prometheus_text
from cluster.tools.planner import plan
from workers.protocol import GREEDY, RequestStart, ScheduledChunk, StepInput, StepOutput
from workers.runtime.worker import Worker
from workers.sim.simulated import SimulatedWorker
from workers.wire import decode_output, decode_step, encode_output, encode_step

SLIDING, FULL = 0, 1
TOKENS = [11, 12, 13, 14]


def first_step():
    """Request "a" computes 4 tokens: sliding composite 1 = units 1, 2, 3; full block 4."""
    chunk = ScheduledChunk("a", TOKENS, 0, [[1], [4]], True, RequestStart(GREEDY, 4))
    return StepInput(0, [chunk], compositions=[(SLIDING, 1, (1, 2, 3))])


def unit_rows(worker, units):
    tensors = {id(t): t for pair in worker.kv.caches.values() for t in pair}.values()
    return [t[list(units)].clone() for t in tensors]


def test_a_worker_stores_a_block_to_host_units_and_loads_it_back_into_another_block_byte_for_byte():
    w = Worker("tiny-gemma3", block_size=4, num_blocks=16, num_host_blocks=8)
    assert w.host.nbytes() == 8 * 1024
    w.execute(first_step())
    source = unit_rows(w, [1, 2, 3, 4])
    assert all(r.abs().sum() > 0 for r in source)
    out = w.execute(StepInput(1, [], kv_stores=[(SLIDING, 1, (0, 1, 2)), (FULL, 4, (3,))]))
    assert (out.transfers_done, out.transfers_failed) == ([1, 4], [])
    host = [t[[0, 1, 2, 3]] for pair in w.host.pairs for t in pair]
    assert all(torch.equal(h, s) for h, s in zip(host, source))
    out = w.execute(StepInput(2, [], compositions=[(SLIDING, 5, (5, 7, 6))],
                              kv_loads=[(SLIDING, (0, 1, 2), 5), (FULL, (3,), 8)]))
    assert (out.transfers_done, out.transfers_failed) == ([5, 8], [])
    # member order: host unit 0 -> unit 5, 1 -> 7, 2 -> 6
    assert all(torch.equal(r, s) for r, s in zip(unit_rows(w, [5, 7, 6, 8]), source))


def test_a_load_from_host_units_this_worker_never_stored_is_reported_failed_and_writes_nothing():
    w = Worker("tiny-gemma3", block_size=4, num_blocks=16, num_host_blocks=8)
    out = w.execute(StepInput(0, [], compositions=[(SLIDING, 5, (5, 6, 7))],
                              kv_loads=[(SLIDING, (0, 1, 2), 5), (FULL, (3,), 8)]))
    assert (out.transfers_done, out.transfers_failed) == ([], [5, 8])
    assert all(r.abs().sum() == 0 for r in unit_rows(w, [5, 6, 7, 8]))


BAD = [
    (dict(kv_stores="nope"), "kv_stores must be a list, got str"),
    (dict(kv_stores=[(2, 4, (0,))]), r"group must be an integer in \[0, 2\)"),
    (dict(kv_stores=[(FULL, 0, (0,))]), r"the device block must be an integer in \[1, 16\)"),
    (dict(kv_stores=[(FULL, 16, (0,))]), r"the device block must be an integer in \[1, 16\)"),
    (dict(kv_stores=[(SLIDING, 1, (0, 1))]), r"group 0 needs 3 distinct host units in \[0, 8\)"),
    (dict(kv_stores=[(SLIDING, 1, (0, 1, 1))]), r"group 0 needs 3 distinct host units in \[0, 8\)"),
    (dict(kv_loads=[(FULL, (8,), 4)]), r"group 1 needs 1 distinct host units in \[0, 8\)"),
    (dict(kv_stores=[(FULL, 4, (0,))], kv_loads=[(FULL, (1,), 4)]), "device block 4 has two copies in one step"),
    (dict(kv_stores=[(FULL, 4, (0,)), (FULL, 9, (0,))]), r"host units \[0\] are written by one copy of the step"),
    (dict(kv_stores=[(FULL, 4, (0,))], kv_loads=[(FULL, (0,), 9)]), r"host units \[0\] are written by one copy"),
    (dict(kv_stores=[(FULL, 4)]), r"a copy must be a \(group, \.\.\.\) triple"),
    (dict(kv_loads=[(SLIDING, (0, 1, 2), 9)]), r"name blocks no composition has named: \[\(0, 9\)\]"),
]


@pytest.mark.parametrize("fields, message", BAD)
def test_bad_copy_fields_are_refused_before_anything_changes(fields, message):
    w = Worker("tiny-gemma3", block_size=4, num_blocks=16, num_host_blocks=8)
    step = first_step()
    for name, value in fields.items():
        setattr(step, name, value)
    with pytest.raises(ValueError, match=message):
        w.execute(step)
    assert w.request_ids == [] and not any(w.host.filled)      # not even the step's chunk was taken


def test_two_requests_hitting_one_host_copy_in_one_step_both_load_it():
    w = Worker("tiny-gemma3", block_size=4, num_blocks=16, num_host_blocks=8)
    w.execute(first_step())
    source = unit_rows(w, [4])
    w.execute(StepInput(1, [], kv_stores=[(FULL, 4, (3,))]))
    out = w.execute(StepInput(2, [], kv_loads=[(FULL, (3,), 8), (FULL, (3,), 9)]))
    assert (out.transfers_done, out.transfers_failed) == ([8, 9], [])
    assert all(torch.equal(r, s) for r, s in zip(unit_rows(w, [8]), source))
    assert all(torch.equal(r, s) for r, s in zip(unit_rows(w, [9]), source))


def test_copies_to_a_worker_without_a_host_pool_are_refused():
    w = Worker("tiny-gemma3", block_size=4, num_blocks=16)
    with pytest.raises(ValueError, match=r"this worker has no host KV pool \(num_host_blocks=0\)"):
        w.execute(StepInput(0, [], kv_stores=[(FULL, 4, (0,))]))


def test_copies_and_their_reports_survive_the_wire():
    step = StepInput(3, [], [], [(SLIDING, 5, (5, 6, 7))], kv_stores=[(SLIDING, 1, (10, 11, 12)), (FULL, 4, (2,))],
                     kv_loads=[(SLIDING, (0, 7, 3), 5), (FULL, (9,), 8)])
    assert decode_step(encode_step(step)) == step
    out = StepOutput(3, {}, transfers_done=[1, 4, 5], transfers_failed=[8])
    assert decode_output(encode_output(out)) == out


# -- simulated workers ----------------------------------------------------------------------------------------
def sim(num_host_blocks=64):
    return SimulatedWorker.for_model("gemma-3-27b", "H100-80GB", num_blocks=100, num_host_blocks=num_host_blocks)


def test_simulated_workers_charge_a_copy_at_the_gpus_host_link_rate():
    w = sim()
    out = w.execute(StepInput(0, [], compositions=[(0, 1, tuple(range(1, 27)))], kv_stores=[(0, 1, tuple(range(26)))]))
    rate = 64e9 * 0.86                       # H100 SXM: PCIe Gen5 x16 one way, at 86% (workers/sim/gpus.py)
    assert out.simulated_time_s == pytest.approx(26 * 262144 / rate, rel=1e-12)
    assert (out.transfers_done, out.transfers_failed) == ([1], [])
    out = w.execute(StepInput(1, [], compositions=[(1, 30, tuple(range(30, 35)))],
                              kv_loads=[(0, tuple(range(26)), 1), (1, (40, 41, 42, 43, 44), 30)]))
    assert out.simulated_time_s == pytest.approx(31 * 262144 / rate, rel=1e-12)
    assert (out.transfers_done, out.transfers_failed) == ([1], [30])     # host units 40..44 never stored


def test_simulated_workers_refuse_a_load_into_a_block_a_live_window_reads():
    w = sim()
    w.execute(StepInput(0, [ScheduledChunk("a", [5] * 4, 0, [[1], [27]], True)],
                        compositions=[(0, 1, tuple(range(1, 27))), (1, 27, tuple(range(27, 32)))]))
    with pytest.raises(ValueError, match="load into group 1 block 27, which a live window reads"):
        w.execute(StepInput(1, [], kv_loads=[(1, (0, 1, 2, 3, 4), 27)]))


def test_a_simulated_engine_restores_from_host_and_every_request_finishes():
    # one 600-token session holds 38 blocks in each group (the window, 1024, covers it): 38 x 31 = 1178
    # units of the 1299; the next session's prefill evicts the previous one's
    engine, _ = build_engine("gemma-3-27b", simulated_gpu="H100-80GB", block_size=16, num_blocks=1300,
                             max_num_batched_tokens=256, num_host_blocks=4000)
    prompts = [[(7 * s + j) % 1000 + 1 for j in range(600)] for s in range(3)]
    for turn in range(2):
        for s, p in enumerate(prompts):
            engine.add_request(f"s{s}-{turn}", p + [5] * turn, SamplingParams(max_tokens=4))
            while engine.has_work():
                engine.step()
    stats = engine.stats()
    assert stats["finished"] == {"length": 6}
    assert stats["kv_host_blocks_loaded"] > 0 and stats["kv_host_hit_requests"] == 3
    assert stats["kv_host_hit_tokens"] == 3 * 592               # each resend hits its 37 whole blocks
    assert engine.manager.num_free_blocks == 1299


# -- the flag ----------------------------------------------------------------------------------------------
def test_host_memory_becomes_host_units_of_every_workers_layers():
    engine, info = build_engine("tiny-gemma3", block_size=4, num_blocks=32, kv_host_memory=1 << 20)
    assert info["num_host_blocks"] == engine.manager.host_tier.num_units == 1024
    assert sum(w.host.nbytes() for w in engine.executor.workers) == 1 << 20
    assert engine.config.host_block_bytes == (3 * 1024, 1024)
    # tiny-gemma2 in two stages (a sliding and a full layer each): a host unit is 1024 bytes on each stage
    engine, info = build_engine("tiny-gemma2", pipeline_parallel_size=2, block_size=4, num_blocks=32,
                                kv_host_memory=1 << 20)
    assert info["num_host_blocks"] == 512
    assert [w.host.nbytes() for w in engine.executor.workers] == [512 * 1024] * 2


@pytest.mark.parametrize("fields, message", [
    (dict(kv_host_memory=2048), r"kv_host_memory=2048 bytes holds 2 host units of 1024 bytes .* the widest group "
                                r"takes 3: give at least 3072 bytes"),
    (dict(kv_host_memory=-1), r"kv_host_memory must be an integer >= 0, got -1"),
    (dict(kv_host_memory="8GiB"), r"kv_host_memory must be an integer >= 0, got '8GiB'"),
    (dict(kv_host_memory=4096, num_host_blocks=4), "give kv_host_memory or num_host_blocks, not both"),
])
def test_bad_host_memory_is_refused_before_anything_starts(fields, message):
    with pytest.raises(ValueError, match=message):
        build_engine("tiny-gemma3", block_size=4, num_blocks=32, **fields)


def test_the_serve_flag_takes_a_size_with_a_unit():
    args = build_parser().parse_args(["serve", "--kv-host-memory", "8GiB"])
    assert args.kv_host_memory == 8 << 30
    assert build_parser().parse_args(["serve", "--kv-host-memory", "512MiB"]).kv_host_memory == 512 << 20
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-host-memory", "lots"])


def test_speculative_stores_are_on_by_default_and_the_serve_flag_turns_them_off():
    default = build_parser().parse_args(["serve", "--kv-host-memory", "1MiB"])
    off = build_parser().parse_args(["serve", "--kv-host-memory", "1MiB", "--kv-host-known-hits-only"])
    assert (default.kv_host_speculative_stores, off.kv_host_speculative_stores) == (True, False)
    for flag in (True, False):
        engine, _ = build_engine("tiny-gemma3", block_size=4, num_blocks=32, kv_host_memory=1 << 20,
                                 kv_host_speculative_stores=flag)
        assert engine.manager.host_tier.speculative is flag
    with pytest.raises(ValueError, match="kv_host_speculative_stores must be true or false, got 'no'"):
        build_engine("tiny-gemma3", block_size=4, num_blocks=32, kv_host_speculative_stores="no")


def test_plan_shows_the_host_units_window_aware_and_as_full():
    p = plan("gemma-3-27b", context=32768, kv_host_memory=64 << 30)
    wa, sf = p["window_aware"], p["sliding_as_full"]
    assert (wa["host_unit_bytes"], wa["num_host_blocks"]) == (262144, 262144)
    assert (sf["host_unit_bytes"], sf["num_host_blocks"]) == (62 * 131072, (64 << 30) // (62 * 131072))


def test_metrics_export_the_host_tier_counters():
    stats = {"kv_host_blocks": 1024, "kv_host_blocks_stored": 7, "kv_host_blocks_loaded": 3,
             "kv_host_bytes_stored": 7168, "kv_host_bytes_loaded": 3072, "kv_host_hit_requests": 1,
             "kv_host_hit_tokens": 12, "kv_host_load_failures": 0, "kv_host_load_latency_s_sum": 0.25,
             "kv_host_loads_completed": 2, "kv_host_loads_preempted": 1}
    text = prometheus_text({0: stats})
    for line in ('swakv_kv_host_blocks{replica="0"} 1024.0', 'swakv_kv_host_blocks_stored_total{replica="0"} 7.0',
                 'swakv_kv_host_blocks_loaded_total{replica="0"} 3.0',
                 'swakv_kv_host_bytes_stored_total{replica="0"} 7168.0',
                 'swakv_kv_host_bytes_loaded_total{replica="0"} 3072.0',
                 'swakv_kv_host_hit_requests_total{replica="0"} 1.0', 'swakv_kv_host_hit_tokens_total{replica="0"} 12.0',
                 'swakv_kv_host_load_failures_total{replica="0"} 0.0',
                 'swakv_kv_host_loads_preempted_total{replica="0"} 1.0',
                 "# TYPE swakv_kv_host_load_latency_seconds summary",
                 'swakv_kv_host_load_latency_seconds_sum{replica="0"} 0.25',
                 'swakv_kv_host_load_latency_seconds_count{replica="0"} 2.0'):
        assert line in text.splitlines()
