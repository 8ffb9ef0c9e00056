"""CPU time per request-step of the KV-cache manager on a decode trace, swakv vs vLLM side by side.

Trace: running requests (block 16), prefilled at once, then decoded for ``--steps`` steps (after one
untimed step, which drops what the prefill held beyond each window); each request-step appends one token
(hashing every full block) and calls ``allocate_slots(req, 1)``.
Layouts: full-only, sliding-only (W=128) and hybrid (one of each), 256 requests x 512-token prompts; the
real models' layer mixes, each system grouping layers its own way: gpt-oss-20b (12 sliding W=128 + 12
full; 256 x 512) and gemma-3-27b (52 sliding W=1024 + 10 full; 128 x 2048). swakv: one group per kind
(``kv_layout``: gemma's sliding blocks span 26 pool units, its full ones 5), and, for gemma, the previous
layout too (``split``: 26 + 5 groups of one unit). vLLM: the groups its hybrid allocator forms
(``_get_kv_cache_groups_uniform_page_size``: gemma 6 sliding + 1 full, gpt-oss 1 + 1).
Also a cold prefix lookup of a 131072-token prompt (nothing cached), and, per swakv layout, the block
ids its deltas carry per step: table entries and the units of new composites.

vLLM 0.33 runs in the same process when importable (a virtual environment of its own, VLLM_VENV
below, with vLLM 0.33 installed; run this file with that interpreter: kvmanager needs only the
standard library). Engines alternate over ``--rounds`` rounds; each figure is the best round.
``--baseline DIR`` also times the kvmanager of another checkout (e.g. main, to check a change for
regressions) in the same process, alternating with this one, and prints the best and median ratios.

    python bench/manager_overhead.py            # swakv alone
    $VLLM_VENV/bin/python bench/manager_overhead.py --json out.json
    git worktree add ../main main && python bench/manager_overhead.py --no-vllm --baseline ../main --rounds 9
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kvmanager  # noqa: E402
import kvmanager.planning  # noqa: E402

BLOCK = 16
WINDOW = 128


class Layout:
    """A model's layers, in order, as (kind, window) per layer; and the trace run on it."""

    def __init__(self, name: str, layers: list, num_reqs: int | None = None, prompt_len: int | None = None):
        self.name, self.layers, self.num_reqs, self.prompt_len = name, layers, num_reqs, prompt_len

    def kv_layout(self, pkg=kvmanager):
        return pkg.planning.kv_layout({f"layer.{i}": (pkg.FullAttention(BLOCK) if kind == "full"
                                                      else pkg.SlidingWindow(BLOCK, window=w))
                                       for i, (kind, w) in enumerate(self.layers)})

    def swakv_groups(self, split: bool = False, pkg=kvmanager) -> tuple[list, list]:
        """Specs and widths as ``kv_layout`` forms them (one group per kind), or one group per S layers."""
        layout = self.kv_layout(pkg)
        if split:
            return [s for s, w in zip(layout.group_specs, layout.group_widths) for _ in range(w)], None
        return list(layout.group_specs), list(layout.group_widths)


def _model_layers(full: int, sliding: int, window: int, pattern: int) -> list:
    """``pattern - 1`` sliding layers then one full, repeated (gemma-3: 6; gpt-oss alternates: 2)."""
    out = [("full", None) if (i + 1) % pattern == 0 else ("sliding", window) for i in range(full + sliding)]
    assert sum(k == "full" for k, _ in out) == full
    return out


LAYOUTS = {
    "full": Layout("full", [("full", None)]),
    "sliding": Layout("sliding", [("sliding", WINDOW)]),
    "hybrid": Layout("hybrid", [("full", None), ("sliding", WINDOW)]),
    "gpt-oss-20b": Layout("gpt-oss-20b", _model_layers(12, 12, 128, 2)),
    "gemma-3-27b": Layout("gemma-3-27b", _model_layers(10, 52, 1024, 6), num_reqs=128, prompt_len=2048),
}


class SwakvDriver:
    name = "swakv"
    split = False
    pkg = kvmanager      # the kvmanager package it drives (``--baseline``: another checkout's)

    def __init__(self, layout: Layout, num_blocks: int, max_len: int):
        specs, widths = layout.swakv_groups(self.split, self.pkg)
        self.mgr = self.pkg.KVCacheManager(specs, num_blocks=num_blocks, enable_prefix_caching=True,
                                           max_model_len=max_len, widths=widths)
        self.units_per_block = sum(widths) if widths else len(specs)
        self.table_ids = self.composed_units = 0

    def admit(self, rid: str, prompt: list[int]):
        req = self.pkg.Request(rid, prompt)
        hit, n = self.mgr.get_computed_blocks(req)
        assert self.mgr.allocate_slots(req, len(prompt) - n, n, hit) is not None, "pool too small"
        req.num_computed_tokens = len(prompt)
        return req

    def decode(self, reqs, tokens):
        alloc = self.mgr.allocate_slots
        for req, tok in zip(reqs, tokens):
            req.append_output_token_ids((tok,))
            if alloc(req, 1) is None:
                raise RuntimeError("pool too small")
            req.num_computed_tokens += 1

    def count_ids(self, reqs, tokens):
        """Block ids a decode step's deltas carry: table entries, and units of the composites it made."""
        self.mgr.pop_compositions()
        for req, tok in zip(reqs, tokens):
            req.append_output_token_ids((tok,))
            self.table_ids += sum(map(len, self.mgr.allocate_slots(req, 1)))
            req.num_computed_tokens += 1
        self.composed_units += sum(len(units) for _, _, units in self.mgr.pop_compositions())

    def lookup(self, prompt: list[int]) -> int:
        return self.mgr.get_computed_blocks(self.pkg.Request("cold", prompt))[1]


def baseline_driver(root: str):
    """A driver class for the kvmanager package of the checkout at ``root``, imported under another name."""
    path = os.path.join(os.path.abspath(root), "kvmanager")
    spec = importlib.util.spec_from_file_location("kvmanager_baseline", os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pkg
    spec.loader.exec_module(pkg)
    importlib.import_module("kvmanager_baseline.planning")
    return type("BaselineDriver", (SwakvDriver,), {"name": "baseline", "pkg": pkg})


class SplitDriver(SwakvDriver):
    """swakv's previous layout: one group per S layers of a kind (gemma-3-27b: 26 sliding + 5 full)."""
    name = "swakv-split"
    split = True


def vllm_driver():
    """A driver for vLLM 0.33's manager, or None when vLLM is not importable here."""
    try:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VKVCacheManager
        from vllm.v1.core.kv_cache_planning import \
            _get_kv_cache_groups_uniform_page_size as uniform_page_size_groups
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheTensor, SlidingWindowSpec
        from vllm.v1.request import Request as VRequest, RequestStatus
        from vllm.sampling_params import SamplingParams
    except Exception as exc:  # noqa: BLE001 - any import failure means "no baseline here"
        print(f"[vllm baseline unavailable: {type(exc).__name__}: {exc}]", file=sys.stderr)
        return None
    import torch
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)

    class VllmDriver:
        name = "vllm"

        def __init__(self, layout: Layout, num_blocks: int, max_len: int):
            per_layer = {}
            for i, (kind, window) in enumerate(layout.layers):
                common = dict(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
                per_layer[f"layer.{i}"] = (FullAttentionSpec(**common) if kind == "full"
                                           else SlidingWindowSpec(**common, sliding_window=window))
            groups = uniform_page_size_groups(per_layer)       # vLLM's own grouping of these layers
            self.num_groups = len(groups)
            page = next(iter(per_layer.values())).page_size_bytes
            tensors = [KVCacheTensor(size=page * num_blocks * len(g.layer_names), layers=list(g.layer_names),
                                     layer_stride=page * num_blocks, block_stride=page) for g in groups]
            cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)
            self.mgr = VKVCacheManager(cfg, max_model_len=max_len, scheduler_block_size=BLOCK,
                                       hash_block_size=BLOCK, enable_caching=True)
            self.params = SamplingParams(max_tokens=1 << 20)

        def _request(self, rid, prompt):
            return VRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=self.params,
                            pooling_params=None, block_hasher=hasher)

        def admit(self, rid, prompt):
            req = self._request(rid, prompt)
            hit, n, *_ = self.mgr.get_computed_blocks(req)  # 0.33 adds a shared-prefix boundary
            assert self.mgr.allocate_slots(req, len(prompt) - n, n, hit) is not None, "pool too small"
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = len(prompt)
            return req

        def decode(self, reqs, tokens):
            alloc = self.mgr.allocate_slots
            for req, tok in zip(reqs, tokens):
                req.append_output_token_ids(tok)
                if alloc(req, 1) is None:
                    raise RuntimeError("pool too small")
                req.num_computed_tokens += 1

        def lookup(self, prompt):
            return self.mgr.get_computed_blocks(self._request("cold", prompt))[1]

    return VllmDriver


def run_trace(driver_cls, layout: Layout, num_reqs: int, prompt_len: int, steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    max_len = prompt_len + 2 * steps + 32
    # pool: what every request holds at its peak (swakv's units; vLLM's blocks span more layers, so fewer)
    num_blocks = num_reqs * layout.kv_layout().blocks_per_request(max_len, prompt_len) + 64
    drv = driver_cls(layout, num_blocks, max_len)
    reqs = [drv.admit(f"r{i}", [rng.randrange(32000) for _ in range(prompt_len)]) for i in range(num_reqs)]
    tokens = [[rng.randrange(32000) for _ in range(num_reqs)] for _ in range(steps)]
    # One untimed step first: it drops what the prefill held beyond each window (a one-off, not decode).
    drv.decode(reqs, [rng.randrange(32000) for _ in range(num_reqs)])
    gc.collect()
    t0 = time.process_time()
    for step_tokens in tokens:
        drv.decode(reqs, step_tokens)
    cpu = time.process_time() - t0
    out = {"us_per_request_step": cpu / (steps * num_reqs) * 1e6}
    if hasattr(drv, "count_ids"):      # the same trace again, untimed, counting what deltas carry
        for step_tokens in [[rng.randrange(32000) for _ in range(num_reqs)] for _ in range(steps)]:
            drv.count_ids(reqs, step_tokens)
        out["table_ids_per_step"] = drv.table_ids / steps
        out["composed_units_per_step"] = drv.composed_units / steps
    return out


def run_cold_lookup(driver_cls, prompt_len: int, seed: int) -> dict:
    rng = random.Random(seed)
    drv = driver_cls(LAYOUTS["hybrid"], 1024, prompt_len + 16)
    prompt = [rng.randrange(32000) for _ in range(prompt_len)]
    gc.collect()
    t0 = time.process_time()
    hit = drv.lookup(prompt)
    cpu = time.process_time() - t0
    assert hit == 0
    return {"ms": cpu * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--cold-prompt-len", type=int, default=131072)
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM baseline even if importable")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--baseline", metavar="DIR", help="also time the kvmanager of the checkout at DIR "
                    "(e.g. main), alternating with this one in the same process")
    args = ap.parse_args()

    drivers = [SwakvDriver]
    vllm = None if args.no_vllm else vllm_driver()
    if vllm is not None:
        drivers.append(vllm)
    baseline = baseline_driver(args.baseline) if args.baseline else None
    best: dict = {}
    runs: dict = {}      # every round's figure, for the baseline's medians
    ids: dict = {}
    for rnd in range(args.rounds):
        order = drivers + ([baseline] if baseline else [])
        order = order if rnd % 2 == 0 else order[::-1]       # alternate who goes first
        for name in args.layouts:
            layout = LAYOUTS[name]
            num_reqs, prompt_len = layout.num_reqs or args.requests, layout.prompt_len or args.prompt_len
            for drv in order + ([SplitDriver] if name == "gemma-3-27b" else []):
                r = run_trace(drv, layout, num_reqs, prompt_len, args.steps, seed=rnd)
                key = (drv.name, name)
                best[key] = min(best.get(key, float("inf")), r["us_per_request_step"])
                runs.setdefault(key, []).append(r["us_per_request_step"])
                if "table_ids_per_step" in r:
                    ids[key] = (r["table_ids_per_step"], r["composed_units_per_step"])
        for drv in order:
            r = run_cold_lookup(drv, args.cold_prompt_len, seed=rnd)
            key = (drv.name, "cold_lookup_ms")
            best[key] = min(best.get(key, float("inf")), r["ms"])
            runs.setdefault(key, []).append(r["ms"])
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)

    names = [d.name for d in drivers]
    print(f"\nmanager CPU per decode request-step (us), block {BLOCK}, {args.steps} steps, best of {args.rounds} "
          f"rounds; toy layouts and gpt-oss: {args.requests} requests x {args.prompt_len}-token prompts, W={WINDOW}; "
          f"gemma-3-27b: 128 x 2048, W=1024")
    header = f"{'layout':<16}" + "".join(f"{n:>12}" for n in names) + ("   vllm/swakv" if vllm else "") + \
        f"{'swakv/hybrid':>14}{'split':>10}{'split/swakv':>13}"
    print(header)
    out = {}
    for name in [*args.layouts, "cold_lookup_ms"]:
        row = [best[(n, name)] for n in names]
        line = f"{name:<16}" + "".join(f"{v:>12.2f}" for v in row)
        if vllm:
            line += f"   {row[1] / row[0]:>10.1f}x"
        if name != "cold_lookup_ms" and ("swakv", "hybrid") in best:
            line += f"{row[0] / best[('swakv', 'hybrid')]:>13.2f}x"
        if ("swakv-split", name) in best:
            split = best[("swakv-split", name)]
            line += f"{split:>10.2f}{split / row[0]:>12.1f}x"
        print(line)
        out[name] = dict(zip(names, row))
    print("\nblock ids per decode step in swakv's deltas (table entries + units of new composites):")
    for (drv_name, name), (table, units) in sorted(ids.items()):
        print(f"  {name:<14} {drv_name:<12} {table:>8.1f} table ids + {units:>6.1f} composed units")
        out.setdefault(name, {})[f"{drv_name}_ids_per_step"] = [table, units]
    if baseline:
        print(f"\nthis checkout vs {args.baseline} (same process, alternating), best and median of {args.rounds}:")
        print(f"{'layout':<16}{'baseline':>10}{'swakv':>8}{'ratio':>8}{'median':>10}{'median':>8}{'ratio':>8}")
        for name in [*args.layouts, "cold_lookup_ms"]:
            b, w = best[("baseline", name)], best[("swakv", name)]
            mb, mw = statistics.median(runs[("baseline", name)]), statistics.median(runs[("swakv", name)])
            print(f"{name:<16}{b:>10.2f}{w:>8.2f}{w / b:>7.2f}x{mb:>10.2f}{mw:>8.2f}{mw / mb:>7.2f}x")
            out[name]["baseline"] = b
            out[name]["median"] = {"swakv": mw, "baseline": mb}
    if vllm:
        for name, goal in (("hybrid", 5), ("gemma-3-27b", 10)):
            if ("vllm", name) in best:
                ratio = best[("vllm", name)] / best[("swakv", name)]
                print(f"goal: {name} vLLM / swakv = {ratio:.1f}x (>= {goal}x: {'met' if ratio >= goal else 'NOT met'})")
        print("\nvLLM's groups: " + ", ".join(f"{n}: {vllm(LAYOUTS[n], 64, 64).num_groups}" for n in args.layouts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
