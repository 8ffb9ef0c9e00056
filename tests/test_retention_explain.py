"""bench/retention_explain.py: the cost of a wrong guess is charged to the tier that made it."""
from __future__ import annotations

import os
import sys

from kvmanager import KVCacheManager, Request, SlidingWindow
from kvmanager.floor import Floor
from kvmanager.free_queue import FreeQueue

from test_kv_retention_floor import B, W, edit_hits, tier1_never_doubted  # noqa: F401 (a fixture)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

from retention_explain import Trace  # noqa: E402


def test_the_edit_a_wrong_tier_1_claim_loses_is_charged_to_tier_1_and_the_methods_are_restored(
        tier1_never_doubted):
    # The floor's edit trace (tests/test_kv_retention_floor.py) with tier 1's claim never doubted: round
    # 2's edit hits 0 where LRU hits 24, because tier 1 evicted the window it needs (blocks 4 and 5 of the
    # document: 2 blocks) to make room while the tiers were in charge; every other edit hits 24.
    originals = (Floor.admitted, FreeQueue._pop, FreeQueue.lost_block, FreeQueue._vote)
    mgr = KVCacheManager([SlidingWindow(B, window=W)], num_blocks=16, last_message_tokens=0)
    with Trace(mgr) as trace:
        hits, _ = edit_hits(mgr, Request)
    assert hits == [24, 0, 24, 24, 24, 24, 24, 24]
    assert dict(trace.lost_tokens) == {"tier 1 (unreachable), tiers": 24}
    assert dict(trace.lost_blocks) == {"tier 1 (unreachable), tiers": 2}
    assert len(trace.admissions) == 24
    assert [(hit, lru) for hit, lru, _, _ in trace.admissions[3:6]] == [(0, 0), (0, 0), (0, 24)]
    assert trace.admissions[5][3] == "LRU below the floor"      # the floor switched at that admission
    assert (Floor.admitted, FreeQueue._pop, FreeQueue.lost_block, FreeQueue._vote) == originals


def test_on_a_small_rag_trace_over_full_attention_the_timeline_names_the_frequency_order_where_it_acts():
    # 80 questions over 12 documents with Zipf popularity, 4 running, 400 blocks, full attention: no request
    # is followed up, so tier 3 goes by how many later prompts contained each block throughout (whatever the
    # ghosts say of youngest-first), except for the stretches the floor follows LRU
    import retention as bench
    from retention_workloads import rag

    adapter = bench.SwakvAdapter((None,), 400)
    with Trace(adapter.mgr) as trace:
        bench.serve(rag(0, requests=80, documents=12), adapter, step_tokens=512, max_running=4)
    assert {order for *_, order in trace.admissions} == {"tiers, tier 3 by count", "LRU below the floor"}


def test_nearby_pools_are_nine_evenly_spread_sizes_each_served_as_the_grid_serves_its_own():
    # +-10% of 400 blocks: a step of 10, pools 360 to 440; the row at 400 is what the grid's serve gives there
    import retention as bench
    from retention_explain import nearby
    from retention_workloads import rag

    workload, kw = rag(0, requests=40, documents=8), dict(step_tokens=512, max_running=4)
    rows = nearby(workload, (None,), "full", 400, 10, kw)
    assert [p for p, _, _ in rows] == list(range(360, 441, 10))
    swakv = bench.serve(workload, bench.SwakvAdapter((None,), 401), **kw)["hit_rate"]
    lru = bench.serve(workload, bench.SimAdapter((None,), 401, "lru"), **kw)["hit_rate"]
    assert rows[4] == (400, lru, swakv)
    assert 0 < lru < 1 and 0 < swakv < 1


def test_on_small_edit_traces_the_floors_shadow_counts_what_plain_lru_gets_served_the_same_schedule():
    # Edit sessions (half the turns cut the history in its second half) on one sliding window, 4 running:
    # the floor's shadow must estimate LRU's hits on swakv's schedule as the simulated LRU, served that
    # schedule exactly (``SameSchedule``), gets them. Until the shadow counted a second free copy of a
    # content (an edit computes a window again while its old copy waits) and left alone the free copies a
    # longer real hit took but LRU's shorter one did not, it said 2,384, 12,112, 2,368 and 8,160 tokens here
    import retention as bench
    from retention_explain import SameSchedule
    from retention_workloads import edit

    exact = []
    for seed, sessions, window, pool in ((0, 10, 128, 184), (3, 10, 64, 184), (5, 6, 128, 88), (4, 6, 64, 104)):
        workload = edit(seed, sessions=sessions, turns=6, first=(100, 400), message=(20, 150), answer=(20, 150))
        swakv = bench.SwakvAdapter((window,), pool + 1)
        both = SameSchedule(swakv, {"LRU": bench.SimAdapter((window,), pool + 1, "lru")})
        bench.serve(workload, both, step_tokens=128, max_running=4)
        assert swakv.mgr.pool.free.floor.dense_hits == both.hits["LRU"]
        exact.append(both.hits["LRU"])
    assert exact == [6640, 4576, 4704, 10304]     # on swakv's schedule: moves with its hits (the bank: 7,232 before)


def test_swakvs_tiers_alone_served_its_schedule_never_follow_lru_and_match_it_where_its_floor_never_acts():
    # ``tiers_alone`` is the twin that says what the floor did on a cell (swakv's hits minus the tiers' own on
    # the same schedule). Its floor must never act, and where swakv's own floor never acts either (a pool
    # that holds the whole trace) the two managers are one policy, so their hits are equal to the token.
    import retention as bench
    from retention_explain import SameSchedule, tiers_alone
    from retention_workloads import edit

    workload = edit(0, sessions=10, turns=6, first=(100, 400), message=(20, 150), answer=(20, 150))
    for pool, floor_acts in ((184, True), (4000, False)):
        swakv = bench.SwakvAdapter((128,), pool + 1)
        both = SameSchedule(swakv, {"tiers alone": tiers_alone((128,), "sliding", pool + 1)})
        bench.serve(workload, both, step_tokens=128, max_running=4)
        floor, alone = swakv.mgr.pool.free.floor, both.twins["tiers alone"].mgr.pool.free.floor
        assert (alone.admissions, alone.switches, alone.lru_admissions) == (60, 0, 0)
        assert (floor.switches > 0) is floor_acts
        if not floor_acts:
            assert both.hits["tiers alone"] == floor.hits > 0


def test_a_twin_whose_pool_runs_short_on_swakvs_schedule_drops_out_and_the_others_are_served_as_if_alone():
    # One run carries every twin. An LRU of 40 blocks runs short within the first admissions (4 running
    # requests' chunks of 128 tokens and windows do not fit), so it drops out (None); the LRU of swakv's size
    # goes on and counts exactly what it counts served alone (the figure the shadow test above pins)
    import retention as bench
    from retention_explain import SameSchedule
    from retention_workloads import edit

    workload = edit(0, sessions=10, turns=6, first=(100, 400), message=(20, 150), answer=(20, 150))
    kw = dict(step_tokens=128, max_running=4)
    alone = SameSchedule(bench.SwakvAdapter((128,), 185), {"LRU": bench.SimAdapter((128,), 185, "lru")})
    bench.serve(workload, alone, **kw)
    both = SameSchedule(bench.SwakvAdapter((128,), 185), {"LRU": bench.SimAdapter((128,), 185, "lru"),
                                                          "small": bench.SimAdapter((128,), 41, "lru")})
    bench.serve(workload, both, **kw)
    assert both.hits["small"] is None
    assert both.hits["LRU"] == alone.hits["LRU"] == 6640


def test_on_small_edit_traces_swakv_keeps_the_floors_stated_bound_and_its_gap_splits_at_the_reference():
    # hits >= reference - slack - forgiven - overshoot (kvmanager/floor.py) at the end of every trace; the gap
    # to the twin (plain LRU here: no vLLM) is what the twin got over the reference plus what the reference
    # got over swakv
    import retention as bench
    from retention_explain import SameSchedule, parts
    from retention_workloads import edit

    for seed, sessions, window, pool in ((0, 10, 128, 184), (3, 10, 64, 184), (5, 6, 128, 88), (4, 6, 64, 104)):
        workload = edit(seed, sessions=sessions, turns=6, first=(100, 400), message=(20, 150), answer=(20, 150))
        swakv = bench.SwakvAdapter((window,), pool + 1)
        both = SameSchedule(swakv, {"LRU": bench.SimAdapter((window,), pool + 1, "lru")})
        bench.serve(workload, both, step_tokens=128, max_running=4)
        floor = swakv.mgr.pool.free.floor
        p = parts(floor, both.hits)
        assert p["margin"] >= -1e-6       # (the credit sums floats: equal up to rounding where it is tight)
        assert p["slack"] == 0.002 * floor.prompt_tokens
        assert p["better"] == both.hits["LRU"]
        assert p["gap"] == p["vllm_over_reference"] + p["reference_over_swakv"] == both.hits["LRU"] - floor.hits


def test_a_cells_file_names_the_line_it_cannot_read_and_reads_the_grids_loser_lines(tmp_path):
    import pytest
    from retention_explain import read_cells

    good = tmp_path / "cells.txt"
    good.write_text("# losers\n127399297 2 zipf gemma3 312\n\n101 0 phase full 3767 unseen  # the unseen grid\n")
    assert read_cells(str(good)) == [(127399297, 2, "zipf", "gemma3", 312, False),
                                     (101, 0, "phase", "full", 3767, True)]
    for line in ("101 0 phase full", "101 0 phrase full 3767", "101 0 phase full 0", "101 0 phase full 9 seen"):
        bad = tmp_path / "bad.txt"
        bad.write_text(f"127399297 2 zipf gemma3 312\n{line}\n")
        with pytest.raises(SystemExit, match=f"bad.txt:2: expected 'seed draw family layout pool \\[unseen\\]', "
                                             f"got '{line}'"):
            read_cells(str(bad))
