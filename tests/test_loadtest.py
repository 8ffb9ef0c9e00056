"""The load test: workloads, trace and config errors, and real multi-node runs through Serve.

The cluster (a head and two worker nodes on this host) starts once for the module, in a subprocess of
its own; five short runs go through it: one seeded chat workload on simulated gemma-3-27b workers
(window-aware, window-aware with stage 0's worker killed mid-run, sliding-as-full) and a small one on
real workers with the bundled tiny model (both layouts). Expected tokens come from the simulated
worker's documented sampling rule (blake2b of seed, request seed and position), recomputed
here, and from transformers' dense greedy decode for the real model; expected pool sizes from
gemma-3-27b's published shape, computed by hand below.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.loadtest.cli import register
from cluster.loadtest.client import RequestRecord, check_local_url, percentile
from cluster.loadtest.config import LoadTestConfig
from cluster.loadtest.local_cluster import LocalCluster
from cluster.loadtest.run import run_one
from cluster.loadtest.workloads import Session, Turn, agent_loops, document_qa, multi_turn_chat, parse_trace
from cluster.ray.ports import free_port

from drivers import run_layout

ROOT = Path(__file__).resolve().parents[1]


GEMMA3_VOCAB = 262208          # google/gemma-3-27b-it config.json, text_config.vocab_size


# -- workloads (no Ray) ----------------------------------------------------------------------------
def test_chat_workload_is_a_function_of_its_seed_and_shares_history():
    a = multi_turn_chat(sessions=5, turns=3, rate=2.0, system_tokens=100, user_tokens=20, max_tokens=7, seed=11)
    assert a == multi_turn_chat(sessions=5, turns=3, rate=2.0, system_tokens=100, user_tokens=20,
                                max_tokens=7, seed=11)
    assert a != multi_turn_chat(sessions=5, turns=3, rate=2.0, system_tokens=100, user_tokens=20,
                                max_tokens=7, seed=12)
    assert [s.session_id for s in a] == ["chat0", "chat1", "chat2", "chat3", "chat4"]
    assert a[0].start_s == 0.0 and all(x.start_s < y.start_s for x, y in itertools.pairwise(a))
    for s in a:
        assert s.carry_history and len(s.turns) == 3 and 50 <= len(s.prefix) <= 150
        assert all(10 <= len(t.text) <= 30 and t.max_tokens == 7 for t in s.turns)
        assert all(1 <= tok <= 255 for t in s.turns for tok in t.text)
        assert s.turns[0].think_s == 0.0 and all(t.think_s > 0 for t in s.turns[1:])
    assert len({s.prefix for s in a}) == 5             # every user has their own system prompt


def test_agents_share_one_system_prompt_and_qa_shares_documents_without_history():
    agents = agent_loops(sessions=4, turns=2, system_tokens=300, seed=1)
    assert len({s.prefix for s in agents}) == 1 and all(s.carry_history for s in agents)
    qa = document_qa(sessions=12, documents=2, system_tokens=500, max_tokens=4, seed=1)
    assert len({s.prefix for s in qa}) == 2 and not any(s.carry_history for s in qa)
    assert all(250 <= len(s.prefix) <= 750 and s.turns[0].max_tokens == 4 for s in qa)


def test_percentile_interpolates_like_numpy():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5          # between 2 and 3
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == 4.6      # 4 + 0.6 * (5 - 4)
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None


# -- traces and configs: errors name the line and the field -----------------------------------------
def test_trace_lines_parse_into_requests_sorted_by_arrival():
    sessions = parse_trace(['{"arrival_s": 1.5, "prompt": "hello", "max_tokens": 4}', "",
                            '{"arrival_s": 0, "prompt_token_ids": [5, 6, 7], "max_tokens": 2}'])
    assert sessions == [Session("trace3", 0.0, (Turn((5, 6, 7), 2),), carry_history=False),
                        Session("trace1", 1.5, (Turn("hello", 4),), carry_history=False)]


@pytest.mark.parametrize("line, message", [
    ("{not json", "trace line 2: not valid JSON"),
    ("[1, 2]", "trace line 2: expected a JSON object, got list"),
    ('{"prompt": "x", "max_tokens": 3}', "trace line 2: field 'arrival_s' is missing"),
    ('{"arrival_s": -1, "prompt": "x", "max_tokens": 3}', "trace line 2: field 'arrival_s' must be a finite number >= 0"),
    ('{"arrival_s": "soon", "prompt": "x", "max_tokens": 3}', "trace line 2: field 'arrival_s' must be"),
    ('{"arrival_s": 1, "prompt": "x"}', "trace line 2: field 'max_tokens' is missing"),
    ('{"arrival_s": 1, "prompt": "x", "max_tokens": 0}', "trace line 2: field 'max_tokens' must be an integer >= 1"),
    ('{"arrival_s": 1, "prompt": "x", "max_tokens": 2.5}', "trace line 2: field 'max_tokens' must be an integer"),
    ('{"arrival_s": 1, "max_tokens": 3}', "trace line 2: give exactly one of fields 'prompt' and 'prompt_token_ids'"),
    ('{"arrival_s": 1, "prompt": "x", "prompt_token_ids": [1], "max_tokens": 3}', "give exactly one of fields"),
    ('{"arrival_s": 1, "prompt": "", "max_tokens": 3}', "trace line 2: field 'prompt' must be a non-empty string"),
    ('{"arrival_s": 1, "prompt_token_ids": [1, -2], "max_tokens": 3}',
     "trace line 2: field 'prompt_token_ids' must be a non-empty list of integers >= 0"),
    ('{"arrival_s": 1, "prompt_token_ids": [1, true], "max_tokens": 3}', "field 'prompt_token_ids'"),
    ('{"arrival_s": 1, "prompt": "x", "max_tokens": 3, "temprature": 0}', "trace line 2: unknown field(s) 'temprature'"),
])
def test_malformed_trace_lines_name_the_line_and_field(line, message):
    with pytest.raises(ValueError) as err:
        parse_trace(['{"arrival_s": 0, "prompt": "ok", "max_tokens": 1}', line])
    assert message in str(err.value)


def test_trace_file_errors(tmp_path):
    from cluster.loadtest.workloads import load_trace
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.jsonl: holds no requests"):
        load_trace(str(empty))
    with pytest.raises(ValueError, match="cannot read it"):
        load_trace(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize("kwargs, message", [
    ({"rate": 0}, "rate must be a finite number > 0"),
    ({"sessions": 0}, "sessions must be an integer >= 1"),
    ({"turns": 2.0}, "turns must be an integer >= 1"),
    ({"max_tokens": True}, "max_tokens must be an integer >= 1"),
    ({"think_s": float("nan")}, "think_s must be a finite number >= 0"),
])
def test_bad_workload_knobs_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        multi_turn_chat(**kwargs)


@pytest.mark.parametrize("changes, message", [
    ({"nodes": 1}, "nodes must be >= 2"),
    ({"nodes": 2, "cpus_per_node": 1, "pipeline_parallel_size": 2},
     "data_parallel_size=1 x pipeline_parallel_size=2 needs 2 worker CPUs; nodes=2 with cpus_per_node=1 give 1"),
    ({"data_parallel_size": 3, "pipeline_parallel_size": 2}, "data_parallel_size=3 x pipeline_parallel_size=2 needs 6"),
    ({"data_parallel_size": 0}, "data_parallel_size must be an integer >= 1"),
    ({"routers": ("prefix", "random")}, "routers must be distinct names from round-robin, least-loaded, prefix"),
    ({"routers": ("prefix", "prefix")}, "routers must be distinct names"),
    ({"routers": ("prefix",)}, "a comparison of routers runs one KV layout"),
    ({"kill_replica_at": 3.0, "data_parallel_size": 1, "layouts": ("window_aware",), "pipeline_parallel_size": 1},
     "kill_replica_at needs data_parallel_size >= 2"),
    ({"workload_args": {"popularity": -1}}, None),
    ({"kill_node_at": 3.0, "nodes": 2}, "kill_node_at needs the worker nodes left after one dies to hold all 2"),
    ({"kill_worker_at": -1.0}, "kill_worker_at must be a finite number >= 0"),
    ({"duration_s": 0}, "duration_s must be a finite number > 0"),
    ({"layouts": ("window_aware", "paged")}, "layouts must be a non-empty subset"),
    ({"workload": "chess"}, "workload must be one of chat, agent, qa"),
    ({"workload_args": {"session": 3}}, "workload_args: unknown field(s) ['session']"),
    ({"kv_memory": 0}, "kv_memory must be an integer >= 1"),
    ({"layouts": ("window_aware", "host_tier")}, "the host_tier layout and kv_host_memory go together"),
    ({"kv_host_memory": 1 << 30}, "the host_tier layout and kv_host_memory go together"),
    ({"layouts": ("host_tier",), "kv_host_memory": 0}, "kv_host_memory must be an integer >= 1"),
])
def test_bad_load_test_configs_are_named(changes, message):
    with pytest.raises(ValueError) as err:
        LoadTestConfig(**changes).check().sessions()
    assert message is None and "popularity must be a finite number >= 0" in str(err.value) \
        or message in str(err.value)


def test_workload_knobs_are_checked_by_the_generator_they_feed():
    with pytest.raises(ValueError, match="user_tokens must be an integer >= 1"):
        LoadTestConfig(workload_args={"user_tokens": 0}).check().sessions()


def test_command_line_refuses_bad_values_before_starting_anything(capsys):
    parser = argparse.ArgumentParser(prog="swakv")
    register(parser.add_subparsers(dest="command"))
    for argv, message in ((["--rate", "0"], "argument --rate: '0' must be > 0"),
                          (["--kv-memory", "lots"], "argument --kv-memory: 'lots' is not a size"),
                          (["--layouts", "paged"], "argument --layouts: invalid choice")):
        with pytest.raises(SystemExit):
            parser.parse_args(["loadtest", *argv])
        assert message in capsys.readouterr().err
    args = parser.parse_args(["loadtest", "--trace", "/nonexistent/trace.jsonl"])
    assert args.func(args) == 2
    assert "trace '/nonexistent/trace.jsonl': cannot read it" in capsys.readouterr().err
    for argv, message in ((["-dp", "0"], "argument --data-parallel-size/-dp: '0' must be > 0"),
                          (["--router", "random"], "argument --router: invalid choice: 'random'"),
                          (["--kill-replica-at", "-2"], "argument --kill-replica-at: '-2' must be >= 0"),
                          (["--shared-prefixes", "0"], "argument --shared-prefixes: '0' must be > 0"),
                          (["--popularity", "x"], "argument --popularity: 'x' is not a number")):
        with pytest.raises(SystemExit):
            parser.parse_args(["loadtest", *argv])
        assert message in capsys.readouterr().err
    for argv, message in ((["-dp", "3", "--layouts", "both"], "a comparison of routers runs one KV layout"),
                          (["--workload", "agent", "--shared-prefixes", "2"], "agent sessions all share one"),
                          (["--kill-replica-at", "3"], "kill_replica_at needs data_parallel_size >= 2"),
                          (["-dp", "3", "--nodes", "2"], "needs 3 worker CPUs; nodes=2 with cpus_per_node=2 give 2")):
        args = parser.parse_args(["loadtest", *argv])
        assert args.func(args) == 2
        assert message in capsys.readouterr().err


def test_the_host_tier_comparison_runs_window_aware_without_and_with_a_host_tier_of_the_given_size():
    from cluster.loadtest.cli import config_from_args
    parser = argparse.ArgumentParser(prog="swakv")
    register(parser.add_subparsers(dest="command"))
    cfg = config_from_args(parser.parse_args(["loadtest", "--layouts", "host-tier", "--kv-host-memory", "24GiB",
                                              "--kv-memory", "3GiB"]))
    assert (cfg.layouts, cfg.kv_host_memory, cfg.kv_memory) == (("window_aware", "host_tier"), 24 << 30, 3 << 30)
    plain, tier = cfg.engine_args("window_aware"), cfg.engine_args("host_tier")
    assert (plain.kv_host_memory, tier.kv_host_memory, tier.sliding_as_full, tier.kv_cache_memory) == \
        (None, 24 << 30, False, 3 << 30)
    for argv in (["--layouts", "host-tier"], ["--kv-host-memory", "8GiB"]):
        with pytest.raises(ValueError, match="--layouts host-tier compares window-aware without and with"):
            config_from_args(parser.parse_args(["loadtest", *argv]))


def test_router_comparisons_default_to_one_layout_one_stage_and_busier_shared_prefix_workloads():
    from cluster.loadtest.cli import config_from_args
    parser = argparse.ArgumentParser(prog="swakv")
    register(parser.add_subparsers(dest="command"))
    cfg = config_from_args(parser.parse_args(["loadtest", "--compare-routers", "-dp", "3", "--workload", "qa"]))
    assert (cfg.routers, cfg.layouts, cfg.pipeline_parallel_size, cfg.data_parallel_size) == (
        ("round-robin", "least-loaded", "prefix", "ray-prefix-tree"), ("window_aware",), 1, 3)
    assert cfg.workload_args == {"sessions": 80, "rate": 4.0, "documents": 12, "popularity": 1.0}
    cfg = config_from_args(parser.parse_args(["loadtest", "-dp", "2", "--shared-prefixes", "3", "--popularity", "0"]))
    assert (cfg.routers, cfg.workload_args["system_prompts"], cfg.workload_args["popularity"]) == (("prefix",), 3, 0.0)
    cfg = config_from_args(parser.parse_args(["loadtest"]))       # no replicas: the layouts, as before
    assert (cfg.routers, cfg.layouts, cfg.pipeline_parallel_size, cfg.workload_args) == (
        (), ("window_aware", "sliding_as_full"), 2, {})


def test_shared_system_prompts_and_their_popularity_are_functions_of_the_seed():
    chats = multi_turn_chat(sessions=40, system_tokens=50, system_prompts=3, popularity=2.0, seed=4)
    assert chats == multi_turn_chat(sessions=40, system_tokens=50, system_prompts=3, popularity=2.0, seed=4)
    counts = sorted((sum(s.prefix == p for s in chats) for p in {s.prefix for s in chats}), reverse=True)
    assert len(counts) == 3 and sum(counts) == 40 and counts[0] > 40 * 0.4    # weights 1, 1/4, 1/9: 73% first
    docs = document_qa(sessions=40, documents=5, system_tokens=50, popularity=0.0, seed=4)
    assert len({s.prefix for s in docs}) == 5


def test_the_load_generator_talks_only_to_loopback():
    for url in ("http://10.0.0.5:8000", "http://localhost:8000", "https://127.0.0.1:8000", "http://127.0.0.1"):
        with pytest.raises(ValueError, match="only talks to loopback"):
            check_local_url(url)
    assert check_local_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"


# -- multi-node runs through Serve -------------------------------------------------------------------
CONFIG = LoadTestConfig(
    kv_memory=4 << 30, sleep_factor=1.0, duration_s=30.0, drain_s=60.0, progress=False, seed=5,
    workload_args={"sessions": 4, "turns": 3, "rate": 4.0, "system_tokens": 256, "user_tokens": 48,
                   "max_tokens": 24, "think_s": 0.1})


RUNS = (("plain", "window_aware", None), ("killed", "window_aware", 1.5), ("full", "sliding_as_full", None),
        ("real", "window_aware", None), ("real_full", "sliding_as_full", None), ("replicas", "window_aware", None))
# The bundled tiny model (sliding W=64 + full layers) on real CPU workers; prompts run to ~400 tokens.
REAL = dataclasses.replace(CONFIG, model="default", real=True, pipeline_parallel_size=1, kv_memory=None,
                           workload_args={"sessions": 3, "turns": 2, "rate": 4.0, "system_tokens": 160,
                                          "user_tokens": 40, "max_tokens": 8, "think_s": 0.1})


# Three engine replicas (one simulated stage each) behind the prefix router; replica 0's engine actor is
# killed mid-run and Ray restarts it. Chats share two system prompts.
REPLICAS = dataclasses.replace(CONFIG, data_parallel_size=3, pipeline_parallel_size=1, routers=("prefix",),
                               layouts=("window_aware",),
                               kill_replica_at=2.0, workload_args={**CONFIG.workload_args, "sessions": 6,
                                                                   "system_prompts": 2})


# A bound against a hang, not a timing: the six runs take ~100 s on an idle 2-core machine and went past
# 160 s at load 5-7.
DRIVER_LIMIT_S = 480


def drive(out_path: str) -> None:
    """In a process of its own: one cluster, every run of ``RUNS``, records and summaries to JSON."""
    cfg = CONFIG.check()
    cluster = LocalCluster(cfg.nodes, cfg.cpus_per_node)
    out = {}
    with cluster:
        url: dict = {}
        for name, layout, kill_at in RUNS:
            if name == "replicas":
                base = REPLICAS.check()
                run = run_one(cluster, base, layout, "prefix", base.sessions(), url)
            else:
                base = REAL if name.startswith("real") else cfg
                run = run_layout(cluster, dataclasses.replace(base, kill_worker_at=kill_at), layout, base.sessions(),
                                 url)
            out[name] = {"summary": run["summary"], "timeline": run["result"].timeline,
                         "records": [dataclasses.asdict(r) for r in run["result"].records]}
    out["processes_left"] = cluster.processes_left()
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs, from a subprocess: its Ray cluster never meets a Ray runtime other tests keep in this one."""
    out = tmp_path_factory.mktemp("loadtest") / "runs.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, __file__, "--drive", str(out)], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = proc.communicate(timeout=DRIVER_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # the driver and every Ray process it started
        log, _ = proc.communicate()
        pytest.fail(f"the load-test driver ran over {DRIVER_LIMIT_S} s:\n{log[-3000:]}")
    assert proc.returncode == 0, log[-3000:]
    with open(out, encoding="utf-8") as f:
        data = json.load(f)
    for name, _, _ in RUNS:
        data[name]["records"] = [RequestRecord(**r) for r in data[name]["records"]]
    data["sessions"] = CONFIG.sessions()
    data["real_sessions"] = REAL.sessions()
    data["replica_sessions"] = REPLICAS.sessions()
    return data


def _expected_tokens(record) -> list[int]:
    """The simulated worker's rule: token at position p = blake2b(worker seed 0, request seed, p) mod vocab."""
    out = []
    for i in range(len(record.output_token_ids)):
        key = f"0\x00{record.seed}\x00{record.prompt_tokens + i}".encode()
        out.append(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % GEMMA3_VOCAB)
    return out


def _shape(run) -> list[tuple]:
    return sorted((r.session_id, r.turn, r.prompt_tokens, len(r.output_token_ids), r.status) for r in run["records"])


@pytest.mark.parametrize("name", ["plain", "killed", "full"])
def test_every_request_completes_none_lost(runs, name):
    s = runs[name]["summary"]
    assert (s["requests"], s["completed"], s["failed"], s["lost"], s["not_sent"]) == (12, 12, 0, 0, 0)
    assert s["output_tokens"] == 12 * 24 and s["errors"] == []
    for rec in runs[name]["records"]:
        assert rec.output_token_ids == _expected_tokens(rec), (rec.session_id, rec.turn)
        assert rec.finish_reason == "length" and rec.ttft_s > 0 and rec.e2e_s >= rec.ttft_s


def test_turns_carry_the_history_of_their_session(runs):
    by_session = {s.session_id: s for s in runs["sessions"]}
    for rec in runs["plain"]["records"]:
        s = by_session[rec.session_id]
        # prompt k = system prompt + every earlier (user text + 24-token answer) + user text k
        expected = len(s.prefix) + sum(len(t.text) + 24 for t in s.turns[:rec.turn]) + len(s.turns[rec.turn].text)
        assert rec.prompt_tokens == expected


def test_stages_are_spread_over_the_worker_nodes(runs):
    assert sorted(runs["plain"]["summary"]["engine"]["stage_nodes"]) == [1, 2]


def test_a_worker_killed_mid_run_loses_nothing(runs):
    s = runs["killed"]["summary"]
    assert len(s["events"]) == 1 and re.fullmatch(r"killed worker swakv-worker-stage0-\S+", s["events"][0])
    kill = next(p for p in runs["killed"]["timeline"] if "event" in p)
    assert kill["in_flight"] >= 1                       # requests were being served when it died
    assert s["worker_restarts"] == 1 and s["recomputed_requests"] >= 1


def test_a_run_is_deterministic_for_its_seed(runs):
    # Same prompts (lengths and history), same token counts, whichever layout and with or without the fault;
    # the tokens themselves are the seeded function of each request checked above.
    assert _shape(runs["plain"]) == _shape(runs["killed"]) == _shape(runs["full"])
    assert [(r.session_id, r.turn, r.seed) for r in sorted(runs["plain"]["records"],
                                                             key=lambda r: (r.session_id, r.turn))] == \
        [(r.session_id, r.turn, r.seed) for r in sorted(runs["full"]["records"],
                                                          key=lambda r: (r.session_id, r.turn))]


def test_both_layouts_get_the_same_kv_bytes(runs):
    # gemma-3-27b, PP=2: 31 layers per stage (26 sliding + 5 full), 16 KV heads x 128 x bf16, K and V.
    # One layer's 16-token page: 2 x 16 x 128 x 2 B x 16 = 131,072 B. 4 GiB per device:
    #   window-aware: gcd(26, 5) = 1 layer per unit, a unit is one page: 4 GiB / 131,072 = 32,768 units;
    #     one group per kind, a sliding block 26 units wide and a full one 5
    #   sliding-as-full: one group of 31 layers, a unit is 31 pages: 4 GiB / 4,063,232 = 1,057
    wa, full = runs["plain"]["summary"]["engine"], runs["full"]["summary"]["engine"]
    assert (wa["num_blocks"], wa["num_groups"], wa["group_widths"]) == (32768, 2, [26, 5])
    assert (full["num_blocks"], full["num_groups"], full["group_widths"]) == (1057, 1, [1])
    assert wa["kv_memory_bytes"] == full["kv_memory_bytes"] == 4 << 30


def test_report_is_json_with_the_run_counts(runs):
    from cluster.loadtest.report import format_report, public_report
    report = {"completed": 36, "failed": 0, "lost": 0,
              "layouts": {"window_aware": runs["plain"]["summary"], "sliding_as_full": runs["full"]["summary"]},
              "config": {**CONFIG.__dict__, "layouts": list(CONFIG.layouts)},
              "workload": {"sessions": 4, "requests": 12},
              "cluster": {"nodes": 3, "cpus_per_node": 2, "startup_s": 0.0, "processes_left": 0},
              "total_wall_s": 0.0, "_runs": {}}
    data = json.loads(json.dumps(public_report(report)))
    assert (data["completed"], data["failed"], data["lost"]) == (36, 0, 0) and "_runs" not in data
    table = format_report(report)
    assert "requests completed / failed / lost" in table and "12 / 0 / 0" in table


@pytest.mark.parametrize("name", ["real", "real_full"])
def test_real_workers_give_dense_greedy_tokens_in_both_layouts(runs, name):
    """Real attention through the cluster, window-aware and sliding-as-full, against transformers' dense
    greedy decode of the same model and prompts (history included): the layouts only move memory."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(ROOT / "models" / "swakv-tiny-hybrid",
                                                              local_files_only=True).eval()
    records = {(r.session_id, r.turn): r for r in runs[name]["records"]}
    assert len(records) == 6 and all(r.status == "completed" for r in records.values())
    for s in runs["real_sessions"]:
        history = list(s.prefix)
        for k, turn in enumerate(s.turns):
            ids = history + list(turn.text)
            prompt_len = len(ids)
            with torch.no_grad():
                for _ in range(turn.max_tokens):
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            rec = records[(s.session_id, k)]
            assert rec.prompt_tokens == prompt_len and rec.output_token_ids == ids[prompt_len:], (name, s.session_id, k)
            history = ids
    assert max(r.prompt_tokens for r in records.values()) > 2 * 64   # beyond the sliding window


def test_replicas_spread_over_nodes_and_a_killed_one_loses_nothing_answers_nothing_twice(runs):
    s = runs["replicas"]["summary"]
    assert s["events"] == ["killed replica swakv-engine-0 (Ray restarts it)"]
    kill = next(p for p in runs["replicas"]["timeline"] if "event" in p)
    assert kill["in_flight"] >= 1                                      # requests were in flight when it died
    assert (s["lost"], s["answered_twice"]) == (0, 0)
    assert s["completed"] + s["failed"] == s["requests"] and s["completed"] >= 12
    for rec in runs["replicas"]["records"]:
        if rec.status == "completed":
            assert rec.output_token_ids == _expected_tokens(rec), (rec.session_id, rec.turn)   # exactly once each
        else:   # it had streamed tokens from the replica that died: the retryable error it gets today
            assert rec.error.startswith("stream error: the engine restarted") and "retried" in rec.error
    # 3 replicas, one worker each, on the two worker nodes (2 CPUs each): both used
    assert sorted(n for nodes in s["replica_nodes"] for n in nodes) in ([1, 1, 2], [1, 2, 2])
    router = s["router"]
    assert s["replica_restarts"] == [1, 0, 0] and router["downs"][0] >= 1 and router["ready_at_end"] == 3
    assert router["snapshots"][0] >= 2                 # learnt at the start, re-learnt after the restart
    assert sum(router["routed"]) == s["requests"] + router["retries"] + 1   # + the warm-up request


def test_teardown_leaves_no_process_of_the_cluster(runs):
    assert runs["processes_left"] == 0


if __name__ == "__main__" and sys.argv[1:2] == ["--drive"]:
    drive(sys.argv[2])


def test_a_servers_port_lies_above_rays_worker_ports_and_below_the_ephemeral_range_and_is_free():
    # bind(0) and outgoing connections draw from the ephemeral range and Ray's workers from 10002-19999: a
    # port between them is taken by nobody between the pick and the server's bind
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = 20_000, int(f.read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(low <= p < high for p in ports) and len(ports) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def ray_processes() -> dict[int, str]:
    """pid -> command line of every live Ray process on this host (a node's or a worker's: Ray retitles its
    agents and workers ``ray::...``, which overwrites their environment, so a mark there is not enough)."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith("ray::") or any(n in cmd for n in ("/raylet ", "/gcs_server ", "ray/_private/",
                                                              "ray/dashboard/")):
            found[int(entry)] = cmd
    return found


def ray_processes_left(before: dict[int, str], wait_s: float = 10.0) -> list[str]:
    """Ray processes that were not running before and still run ``wait_s`` later."""
    deadline = time.monotonic() + wait_s
    while (left := [c[:80] for p, c in ray_processes().items() if p not in before]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


INTERRUPTED_START = """
import os
import time

import ray._private.services as services
from cluster.loadtest.local_cluster import LocalCluster

started, raylets = services.start_raylet, []


def start_then_interrupt(*args, **kwargs):
    raylets.append(started(*args, **kwargs))
    if len(raylets) == 2:   # the worker node's raylet runs and has started its agents; Ray's Cluster never
        pid = raylets[-1].process.pid   # lists the node
        deadline = time.monotonic() + 30
        while len(children(pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        raise KeyboardInterrupt
    return raylets[-1]


def children(pid):
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return out


services.start_raylet = start_then_interrupt
try:
    with LocalCluster(nodes=2, cpus_per_node=1):
        pass
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_while_a_node_starts_leaves_none_of_the_clusters_processes_behind():
    # Before: a node interrupted between starting its processes and being listed by Ray's Cluster was shut
    # down by nobody; its dashboard and runtime-env agents outlived the load test (Ctrl-C 5-6 s into
    # `swakv loadtest`: 4 of 4 stops).
    before = ray_processes()
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED_START], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=180)
    assert proc.stdout == "interrupted\n", proc.stderr[-3000:]
    assert ray_processes_left(before) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_signal_to_a_running_load_tests_process_group_stops_it_with_one_line_and_nothing_left(sig):
    """A terminal's Ctrl-C, or a service manager's SIGTERM to the group: one line, status 128 + the signal."""
    before = ray_processes()
    proc = subprocess.Popen([sys.executable, "-m", "cluster", "loadtest", "--nodes", "2", "--duration", "60",
                             "--layouts", "window-aware", "--no-progress"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while sum("/raylet " in c for p, c in ray_processes().items() if p not in before) < 2:   # both nodes up
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(1.0)
        os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 128 + sig, err[-3000:]
    assert f"swakv loadtest: stopped by {sig.name}; its Ray cluster is torn down" in err
    assert "Traceback" not in err
    assert ray_processes_left(before) == []


def test_a_stop_the_code_it_landed_in_rewrapped_ends_a_load_test_as_a_stop_not_as_a_failure():
    # a stop landing in a class body's __set_name__ comes out of Python 3.11 as a RuntimeError caused by it;
    # the load test caught RuntimeError first and said "failed", status 1, for an operator's Ctrl-C
    from cluster.loadtest.cli import ending_of
    from cluster.serve.supervisor import StopRequested

    try:
        try:
            raise StopRequested(signal.SIGTERM)
        except StopRequested as stop:
            raise RuntimeError("Error calling __set_name__ on 'Landing' instance 'stop_time' in 'Task'") from stop
    except RuntimeError as exc:
        wrapped = exc
    assert ending_of(wrapped) == ("stopped by SIGTERM; its Ray cluster is torn down", 128 + 15)
    assert ending_of(StopRequested(signal.SIGINT)) == ("stopped by SIGINT; its Ray cluster is torn down", 128 + 2)
    assert ending_of(RuntimeError("engine 1 never became ready")) == ("failed: engine 1 never became ready", 1)
    assert ending_of(ValueError("--rate must be > 0")) == ("error: --rate must be > 0", 2)
    assert ending_of(MemoryError()) is None      # anything else is raised as it is
