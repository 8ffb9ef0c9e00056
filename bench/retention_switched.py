"""Rerun, with this checkout's kvmanager, only the retention cells whose floor switched to LRU in a stored run.

A change to what the floor does *after* it switched (``kvmanager/floor.py``: the evidence, the write-off)
cannot change a cell whose floor never switched: up to the first switch both runs are the same. So such a
change is checked on every cell it can touch, on any seed with stored rows, in seconds instead of a grid's
minutes: each stored swakv row with ``floor.switches > 0`` is served again (same draw, workload, layout,
pool, ``serve``) and printed next to the stored hit rate and the better baseline (vLLM dense / semantic, or
the simulated LRU, from ``--baseline`` files). The stored swakv rows must come from the code the change is
measured against (or run that code with this file: ``cd`` to its checkout, ``--json`` to keep the figures).

    python bench/retention_switched.py bench/results/X-ret6.jsonl --baseline bench/results/X.jsonl
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import retention as R  # noqa: E402

BASELINES = ("vllm-dense", "vllm-sem", "sim:lru")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stored", help="jsonl with the swakv rows to rerun (those whose floor switched)")
    ap.add_argument("--baseline", default="", help="comma-separated jsonl files with vLLM or sim:lru rows")
    ap.add_argument("--json", help="write {cell: hit rate} of this run here")
    args = ap.parse_args()
    best: dict = collections.defaultdict(float)
    for path in filter(None, args.baseline.split(",") + [args.stored]):
        for line in open(path):
            r = json.loads(line)
            if r["system"] in BASELINES and r.get("hit_rate") is not None:
                k = (r["seed"], r["draw"], r["family"], r["layout"], r["pool_per_group"])
                best[k] = max(best[k], r["hit_rate"])
    rows = [r for r in map(json.loads, open(args.stored))
            if r["system"] == "swakv" and r.get("floor", {}).get("switches", 0) > 0]
    out, counts = {}, collections.Counter()
    for r in rows:
        draw = R.draw_settings(r["seed"], r["draw"] + 1, r.get("unseen", False))[r["draw"]]
        windows = R.windows_of(r["layout"], draw.window)
        adapter = R.SwakvAdapter(windows, r["pool_per_group"] * len(windows) + 1, units=R.UNITS.get(r["layout"]))
        stats = R.serve(R.workload_of(draw, r["family"])[0], adapter, step_tokens=draw.chunk,
                        max_running=draw.concurrency)
        k = (r["seed"], r["draw"], r["family"], r["layout"], r["pool_per_group"])
        before, after, b = r["hit_rate"], stats["hit_rate"], best.get(k)
        out["|".join(map(str, k))] = after
        loses = b is not None and after < b - 0.005
        counts["up"] += after > before + 0.005
        counts["down"] += after < before - 0.005
        counts["lost before"] += b is not None and before < b - 0.005
        counts["loses"] += loses
        print(f"seed {k[0]} draw {k[1]} {k[2]}/{k[3]}/{k[4]}: {before:.4f} -> {after:.4f} ({after - before:+.4f})"
              f"  baseline {'-' if b is None else f'{b:.4f}'}{'  LOSES' if loses else ''}", flush=True)
    print(f"{len(rows)} cells whose floor switched: {counts['up']} up, {counts['down']} down by > 0.005; "
          f"losing to the baseline by > 0.005: {counts['lost before']} before, {counts['loses']} after")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
