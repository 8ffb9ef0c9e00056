"""The device script, dry: ``bench/gpu_run.sh`` with ``DRY_RUN=1`` runs every GPU bench on CPU with tiny
shapes, in processes where Ray and msgpack cannot be imported (the GPU machine has neither). What it
measures is not checked here (timing belongs to the benches); that it runs, that the end-to-end bench's
swakv tokens equal transformers' in every configuration, and that its kernel rows are exact, are.
"""
from __future__ import annotations

import json
import os
import subprocess

from conftest import ROOT

BLOCKER = "import sys\nfor name in ('ray', 'msgpack'):\n    sys.modules[name] = None   # import fails, as on the GPU machine\n"


def rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_the_device_script_runs_dry_without_ray_or_msgpack_and_swakv_matches_transformers(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    out = tmp_path / "out"
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "PYTHONPATH": str(site)}
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_run.sh")], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    status = (out / "status.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in status] == ["attention", "e2e", "step_overhead", "attention_sweep",
                                                      "host_tier"]
    assert all(": exit 0 " in line for line in status), status

    e2e = rows(out / "e2e_gpu.jsonl")
    check = next(r for r in e2e if r.get("exactness"))
    configs = [k for k in check if k.startswith("async=")]
    assert len(configs) == 4 and all(check[k]["equal_seqs"] == 1.0 for k in configs)
    assert check["distinct_tokens"] > 6       # the compared outputs are not one token repeated
    hf = {r["system"]: r for r in e2e if r.get("system", "").startswith("hf_")}
    assert set(hf) == {"hf_generate_batch", "hf_generate"} and not any("failed" in r for r in hf.values())
    swakv = [r for r in e2e if r.get("system") == "swakv" and r["N"] == 4 and r["shared_prefix"] == 0]
    assert sorted((r["async"], r["graphs"]) for r in swakv) == [(False, False), (False, True), (True, False),
                                                                (True, True)]
    for r in swakv:
        assert r["output_tokens"] == 4 * 8
        assert r["decode_steps"] > 0 and r["decode_host_ms"] > 0
        assert (r.get("graph_runs", 0) > 0) == r["graphs"]      # decode steps took the padded graph path
    equal = next(r for r in e2e if r.get("tokens_equal"))
    pairs = [v for k, v in equal.items() if k.startswith("async=")]
    assert len(pairs) == 4 and all(v[f"vs_{name}"]["equal_seqs"] == 1.0 for v in pairs for name in hf)
    extra = [(r["N"], r["shared_prefix"]) for r in e2e if r.get("system") == "swakv"][4:]
    assert extra == [(2, 0), (4, 24)]
    assert next(r for r in e2e if r.get("shared_prefix") == 24)["prefix_hit_rate"] > 0
    summary = next(r for r in e2e if r.get("summary"))
    assert {"over_hf_generate_batch", "over_hf_generate", "best_config"} <= set(summary)

    host = rows(out / "host_tier_gpu.jsonl")      # sliding-only tiny-mistral, one step at a time and async
    assert [(r["model"], r["async_scheduling"]) for r in host] == [("tiny-mistral", False), ("tiny-mistral", True)]
    assert all(r["exact"] and r["zeroed_differs"] and r["blocks_loaded"] > 0 for r in host)

    kernel = [r for r in rows(out / "attention_gpu.jsonl") if "kind" in r]
    assert len(kernel) == 5 and all(r["triton_err"] < 1e-5 for r in kernel)
    worker = rows(out / "step_overhead.jsonl")
    assert [r["running"] for r in worker] == [8] and worker[0]["host"] > 0 and worker[0]["legacy_host"] > 0
