"""The retention bench's report (``bench/retention.py``): the losing cells and what each computed in all."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import retention as bench  # noqa: E402


def _rows(pool: int, hits: dict[str, float], computed: dict[str, int], seed: int = 7,
          family: str = "zipf") -> list[dict]:
    base = dict(seed=seed, draw=0, family=family, layout="sliding", drawn_window=128, window=128, concurrency=4,
                chunk=256, workload_seed=1)
    out = [dict(base, system="ceiling", pool_per_group=None, hit_rate=0.9)]
    for system, hit in hits.items():
        out.append(dict(base, system=system, pool_per_group=pool, hit_rate=hit, computed=computed[system]))
    return out


def test_a_losing_cell_says_how_many_tokens_it_computed_in_all_against_the_column_it_lost_to(capsys):
    rows = (_rows(100, {"swakv": 0.006, "vllm-dense": 0.024, "vllm-sem": 0.005},
                  {"swakv": 970, "vllm-dense": 1000, "vllm-sem": 2000})
            + _rows(200, {"swakv": 0.30, "vllm-dense": 0.20, "vllm-sem": 0.40},
                    {"swakv": 1100, "vllm-dense": 1200, "vllm-sem": 1000})
            + _rows(400, {"swakv": 0.50, "vllm-dense": 0.50, "vllm-sem": 0.40},
                    {"swakv": 900, "vllm-dense": 900, "vllm-sem": 950}))
    counts = bench.report(rows)
    out = capsys.readouterr().out
    assert counts["losing"] == 2
    assert "draw 0 zipf/sliding/100: swakv 0.006 < 0.024 - 0.005   computed 3.0% fewer tokens in all" in out
    assert "draw 0 zipf/sliding/200: swakv 0.300 < 0.400 - 0.005   computed 10.0% more tokens in all" in out
    assert "  of these, 1 computed fewer tokens in all than that column" in out
    assert "zipf/sliding/400: swakv" not in out


def test_a_losing_cell_says_whether_it_trails_lru_on_its_own_admissions_and_how_much_was_written_off(capsys):
    """From swakv's floor report: behind LRU on the same admissions mostly by write-offs, behind otherwise, or
    ahead of it (then the loss is to LRU's run on its own schedule)."""
    computed = {"swakv": 1000, "vllm-dense": 1000, "vllm-sem": 1000}
    floors = {100: dict(hits=900, lru_hits=1000, prompt_tokens=10000, forgiven=80),     # 1.0% behind, 0.8% off
              200: dict(hits=800, lru_hits=1000, prompt_tokens=10000, forgiven=0),      # 2.0% behind
              400: dict(hits=1300, lru_hits=1000, prompt_tokens=10000, forgiven=0)}     # 3.0% ahead
    rows = []
    for pool, floor in floors.items():
        cell = _rows(pool, {"swakv": 0.30, "vllm-dense": 0.40, "vllm-sem": 0.20}, computed)
        next(r for r in cell if r["system"] == "swakv")["floor"] = floor
        rows += cell[1:] if rows else cell
    counts = bench.report(rows)
    out = capsys.readouterr().out
    assert counts["losing"] == 3
    assert ("zipf/sliding/100: swakv 0.300 < 0.400 - 0.005   computed 0.0% more tokens in all; on its own "
            "admissions 1.0% of the prompt tokens behind LRU (0.8% written off)") in out
    assert "zipf/sliding/200: swakv 0.300 < 0.400 - 0.005   computed 0.0% more tokens in all; on its own " \
           "admissions 2.0% of the prompt tokens behind LRU\n" in out
    assert "zipf/sliding/400: swakv 0.300 < 0.400 - 0.005   computed 0.0% more tokens in all; on its own " \
           "admissions 3.0% of the prompt tokens ahead of LRU\n" in out
    assert ("  of these, 2 trail the floor's reference LRU on swakv's own admissions by more than 0.005 of the "
            "prompt tokens (1 of them half or more by write-offs") in out
    assert "1 do not (they lose to LRU's run on its own schedule)" in out


def test_two_seeds_with_the_same_draw_and_pools_are_counted_apart_and_named_by_their_seed(capsys):
    """Each seed's draw 0 has the same cell names; a report over both keeps both and sums the counts."""
    computed = {"swakv": 1000, "vllm-dense": 1000, "vllm-sem": 1000}
    rows = (_rows(100, {"swakv": 0.30, "vllm-dense": 0.40, "vllm-sem": 0.20}, computed, seed=7)
            + _rows(100, {"swakv": 0.50, "vllm-dense": 0.40, "vllm-sem": 0.20}, computed, seed=8)
            + _rows(200, {"swakv": 0.60, "vllm-dense": 0.50, "vllm-sem": 0.20}, computed, seed=8))
    counts = bench.report(rows)
    out = capsys.readouterr().out
    assert counts == {"cells": 3, "losing": 1, "goal_b": 0, "n_b": 0}
    assert "seed 7 draw 0 zipf/sliding/100: swakv 0.300 < 0.400 - 0.005" in out
    assert "seed 8 draw 0 zipf/sliding/100: swakv" not in out
    table = out[out.index("by family and layout"):].splitlines()
    assert table[1].split() == ["sliding"] and table[2].split() == ["zipf", "1/3"]    # 1 losing cell of 3


def test_the_grids_draws_are_those_its_stored_results_were_run_with():
    # bench/results/retention-grid-2026-12-01-336151821.jsonl: window, running, chunk, workload seed per draw
    draws = bench.draw_settings(336151821, 3)
    assert [(d.window, d.concurrency, d.chunk, d.workload_seed, d.unseen) for d in draws] == [
        (4096, 4, 2048, 820520508, False), (4096, 4, 256, 797801113, False), (1024, 8, 256, 631332858, False)]
    assert bench.workload_of(draws[0], "rag")[1] == {}


def test_unseen_draws_use_no_setting_of_the_grid_and_each_replays_one_trace():
    draws = bench.draw_settings(336151821, 40, unseen=True)
    assert all(d.unseen for d in draws)
    assert not {d.window for d in draws} & set(bench.WINDOWS)
    assert not {d.concurrency for d in draws} & set(bench.CONCURRENCY)
    assert not {d.chunk for d in draws} & set(bench.CHUNKS)
    for family in bench.FAMILIES:
        a, shape = bench.workload_of(draws[0], family)
        b, again = bench.workload_of(bench.draw_settings(336151821, 1, unseen=True)[0], family)
        assert shape and shape == again and a == b
        assert a != bench.FAMILIES[family](draws[0].workload_seed)     # not the family's default shape
    shapes = [bench.workload_of(d, "rag")[1] for d in draws]
    assert len({s["documents"] for s in shapes}) > 20 and min(s["exponent"] for s in shapes) < 0.6


def test_an_unseen_draw_is_another_cell_than_the_same_seeds_grid_draw(capsys):
    computed = {"swakv": 1000, "sim:lru": 1000}
    unseen = [dict(r, unseen=True, shape={"documents": 5}) for r in _rows(100, {"swakv": 0.30, "sim:lru": 0.40}, computed)]
    counts = bench.report(_rows(100, {"swakv": 0.50, "sim:lru": 0.40}, computed) + unseen)
    out = capsys.readouterr().out
    assert counts["cells"] == 2 and counts["losing"] == 1
    assert "seed 7 unseen draw 0 zipf/sliding/100: swakv 0.300 < 0.400 - 0.005" in out
    assert "seed 7 draw 0 zipf/sliding/100: swakv" not in out
    assert "  zipf: documents 5" in out
    bench.report(unseen)
    assert "(replay: --seed 7 --unseen)" in capsys.readouterr().out


def test_the_plot_draws_every_cells_margin_and_each_goal_cells_share_of_its_target_sorted(tmp_path, capsys):
    """rag at three pools: the two tightest are goal cells (target min(1.10 x the better vLLM, the ceiling 0.9))."""
    computed = {"swakv": 1000, "vllm-dense": 1000, "vllm-sem": 1000}
    rows = (_rows(100, {"swakv": 0.30, "vllm-dense": 0.40, "vllm-sem": 0.20}, computed, family="rag")
            + _rows(200, {"swakv": 0.55, "vllm-dense": 0.50, "vllm-sem": 0.20}, computed, family="rag")
            + _rows(400, {"swakv": 0.60, "vllm-dense": 0.60, "vllm-sem": 0.20}, computed, family="rag"))
    path = tmp_path / "standing.png"
    counts = bench.report(rows, plot=str(path))
    assert counts == {"cells": 3, "losing": 1, "goal_b": 1, "n_b": 2}
    assert f"plot: {path}" in capsys.readouterr().out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    margins, goals = bench.plot_standing([("rag", 0.05), ("rag", -0.10), ("rag", 0.0)],
                                         [("rag", 1.0, False), ("rag", 0.30 / 0.44, True)],
                                         str(tmp_path / "again.png"), "t")
    assert margins == [-0.10, 0.0, 0.05]
    assert goals == [pytest.approx(0.6818, abs=1e-4), 1.0]
