"""CPU time per request-step of the KV-cache manager on a decode trace, swakv vs vLLM side by side.

Trace: 256 running requests with 512-token prompts (block 16), prefilled at once, then decoded for
``--steps`` steps; each request-step appends one token (hashing every full block) and calls
``allocate_slots(req, 1)``. Layouts: full-only, sliding-only (W=128) and hybrid (one of each).
Also a cold prefix lookup of a 131072-token prompt (nothing cached).

vLLM 0.33 runs in the same process when importable (its own virtual environment, see
shared/anchors/vllm_baseline.md; run this file with that interpreter: kvmanager needs only the
standard library). Engines alternate over ``--rounds`` rounds; each figure is the best round.

    python bench/manager_overhead.py            # swakv alone
    /tmp/vllm-venv/bin/python bench/manager_overhead.py --json out.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvmanager import FullAttention, KVCacheManager, Request, SlidingWindow  # noqa: E402

BLOCK = 16
WINDOW = 128
LAYOUTS = ("full", "sliding", "hybrid")


class SwakvDriver:
    name = "swakv"

    def __init__(self, layout: str, num_blocks: int, max_len: int):
        specs = {"full": [FullAttention(BLOCK)], "sliding": [SlidingWindow(BLOCK, window=WINDOW)],
                 "hybrid": [FullAttention(BLOCK), SlidingWindow(BLOCK, window=WINDOW)]}[layout]
        self.mgr = KVCacheManager(specs, num_blocks=num_blocks, enable_prefix_caching=True,
                                  max_model_len=max_len)

    def admit(self, rid: str, prompt: list[int]):
        req = Request(rid, prompt)
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

    def lookup(self, prompt: list[int]) -> int:
        return self.mgr.get_computed_blocks(Request("cold", prompt))[1]


def vllm_driver():
    """A driver for vLLM 0.33's manager, or None when vLLM is not importable here."""
    try:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VKVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                                KVCacheTensor, SlidingWindowSpec)
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

        def __init__(self, layout: str, num_blocks: int, max_len: int):
            full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
            swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                                    sliding_window=WINDOW)
            kinds = {"full": [full], "sliding": [swa], "hybrid": [full, swa]}[layout]
            groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(kinds)]
            page = full.page_size_bytes
            tensors = [KVCacheTensor(size=page * num_blocks, layers=[f"layer.{i}"], layer_stride=page * num_blocks,
                                     block_stride=page) for i in range(len(kinds))]
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


def run_trace(driver_cls, layout: str, num_reqs: int, prompt_len: int, steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    max_len = prompt_len + steps + 16
    per_req = -(-max_len // BLOCK)
    num_blocks = num_reqs * per_req * (2 if layout == "hybrid" else 1) + 64
    drv = driver_cls(layout, num_blocks, max_len)
    reqs = [drv.admit(f"r{i}", [rng.randrange(32000) for _ in range(prompt_len)]) for i in range(num_reqs)]
    tokens = [[rng.randrange(32000) for _ in range(num_reqs)] for _ in range(steps)]
    gc.collect()
    t0 = time.process_time()
    for step_tokens in tokens:
        drv.decode(reqs, step_tokens)
    cpu = time.process_time() - t0
    return {"us_per_request_step": cpu / (steps * num_reqs) * 1e6}


def run_cold_lookup(driver_cls, prompt_len: int, seed: int) -> dict:
    rng = random.Random(seed)
    drv = driver_cls("hybrid", 1024, prompt_len + 16)
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
    ap.add_argument("--cold-prompt-len", type=int, default=131072)
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM baseline even if importable")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()

    drivers = [SwakvDriver]
    if not args.no_vllm and (v := vllm_driver()) is not None:
        drivers.append(v)
    best: dict = {}
    for rnd in range(args.rounds):
        for layout in LAYOUTS:
            for drv in drivers:
                r = run_trace(drv, layout, args.requests, args.prompt_len, args.steps, seed=rnd)
                key = (drv.name, layout)
                best[key] = min(best.get(key, float("inf")), r["us_per_request_step"])
        for drv in drivers:
            r = run_cold_lookup(drv, args.cold_prompt_len, seed=rnd)
            key = (drv.name, "cold_lookup_ms")
            best[key] = min(best.get(key, float("inf")), r["ms"])
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)

    names = [d.name for d in drivers]
    print(f"\nmanager CPU per decode request-step (us), {args.requests} requests x {args.steps} steps, "
          f"prompt {args.prompt_len}, block {BLOCK}, W={WINDOW}; best of {args.rounds} rounds")
    header = f"{'layout':<14}" + "".join(f"{n:>12}" for n in names) + ("   vllm/swakv" if len(names) > 1 else "")
    print(header)
    out = {}
    for layout in LAYOUTS + ("cold_lookup_ms",):
        row = [best[(n, layout)] for n in names]
        line = f"{layout:<14}" + "".join(f"{v:>12.2f}" for v in row)
        if len(names) > 1:
            line += f"   {row[1] / row[0]:>10.1f}x"
        print(line)
        out[layout] = dict(zip(names, row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
