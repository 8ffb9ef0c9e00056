"""Do swakv's KV-cache event batches decode with vLLM 0.33's own event classes? (Not a CI test: it needs
vLLM's virtual environment, see /work/shared/anchors/vllm_baseline.md.)

Run with the project's Python: it serves a few requests sharing prefixes on gemma-3-27b's and gpt-oss's
layouts (simulated workers: the real scheduler, manager and publisher), collects the numbered batches
and a snapshot, then runs itself under vLLM's Python (``--vllm-python``), which decodes each batch with
``msgspec.msgpack.decode(payload, type=vllm.distributed.kv_events.KVEventBatch)`` and compares every
field vLLM knows with what plain msgpack reads, and recomputes each stored block's hash from the event's
``token_ids`` (``kvmanager.hashing``, standard library only). It prints one line per layout and exits 1
on any mismatch. A third case drives a manager with a host tier on gpt-oss-20b's layout: its batches carry
medium "CPU" (stores to host, host evictions) beside "GPU".

    python bench/kv_events_vllm.py [--vllm-python /tmp/vllm-venv/bin/python]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VLLM_FIELDS = {   # vLLM 0.33's fields per event type (the ones swakv fills; vLLM's others keep their defaults)
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def encode(model: str, seed: int) -> list[bytes]:
    """The batches (and a final snapshot) one replica publishes serving a small chat-like trace."""
    import random

    from cluster.engine.build import build_engine
    from cluster.engine.kv_events import EventPublisher
    from cluster.engine.types import SamplingParams
    rng = random.Random(seed)
    from cluster.engine.scheduler import blocks_to_finish
    kwargs = dict(simulated_gpu="H100-80GB", block_size=16, tensor_parallel_size=8, max_num_batched_tokens=512)
    probe, _ = build_engine(model, num_blocks=1000, **kwargs)
    # a pool of three of the trace's largest requests: later sessions evict earlier ones' blocks
    need = blocks_to_finish(probe.manager.specs, 740, probe.manager.widths)
    engine, _ = build_engine(model, num_blocks=3 * need, **kwargs)
    pub = EventPublisher(engine.manager.specs, rank=1)
    pub.attach(engine.manager)
    payloads = []
    system = [rng.randrange(1000) for _ in range(300)]
    for i in range(12):   # sessions sharing a system prompt; later turns extend earlier ones
        prompt = system + [rng.randrange(1000) for _ in range(rng.randrange(20, 400))]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 40)))
        for _ in range(rng.randrange(1, 6)):
            engine.step()
            if pub.flush():
                payloads.append(pub._batches[-1][1])
    while engine.has_work():
        engine.step()
        if pub.flush():
            payloads.append(pub._batches[-1][1])
    payloads.append(pub.snapshot()[1])
    return payloads


def encode_host_tier(seed: int) -> list[bytes]:
    """Batches with the host tier's medium "CPU": gpt-oss-20b's layout driven through the manager (the engine
    side of the tier is not needed to make its events): sessions finish (stores, fenced), later ones evict
    them from the device and from host, and resends restore them (loads, fenced)."""
    import random

    from cluster.engine.kv_events import EventPublisher
    from kvmanager import KVCacheManager, Request
    from kvmanager.host_tier import HostRef
    from kvmanager.planning import kv_layout
    from workers.sim.presets import layer_specs
    rng = random.Random(seed)
    layout = kv_layout(layer_specs("gpt-oss-20b", 16))
    mgr = KVCacheManager(layout.group_specs, 200, max_model_len=4096, widths=layout.group_widths,
                         num_host_blocks=300)
    pub = EventPublisher(mgr.specs, rank=1)
    pub.attach(mgr)
    payloads, prompts = [], []
    for i in range(40):
        prompt = (rng.choice(prompts)[:rng.randrange(16, 600)] if prompts and rng.random() < 0.4 else []) \
            + [rng.randrange(1000) for _ in range(rng.randrange(20, 700))]
        req = Request(f"r{i}", prompt)
        hit, h = mgr.get_computed_blocks(req)
        if any(type(b) is HostRef for g in hit for b in g):
            mgr.allocate_slots(req, 0, h, hit)
            mgr.transfers_done([d for _, _, d in mgr.take_transfers().loads])
            req.num_computed_tokens = h
            h = 0
        if mgr.allocate_slots(req, req.num_tokens - req.num_computed_tokens - h, h, hit if h else None) is None:
            continue
        req.num_computed_tokens = req.num_tokens
        mgr.free(req)
        mgr.transfers_done([d for _, d, _ in mgr.take_transfers().stores])
        prompts.append(prompt)
        if pub.flush():
            payloads.append(pub._batches[-1][1])
    mgr.host_tier_lost()
    if pub.flush():
        payloads.append(pub._batches[-1][1])
    payloads.append(pub.snapshot()[1])
    return payloads


def decode_with_vllm(path: str) -> int:
    """In vLLM's venv: decode every batch with its classes, compare fields, recompute hashes."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    from kvmanager.hashing import hash_blocks, root_hash
    with open(path) as f:
        cases = json.load(f)
    failures = 0
    for case in cases:
        counts = {name: 0 for name in VLLM_FIELDS}
        media: dict[str, int] = {}
        mismatches, hashed = [], 0
        for hex_payload in case["payloads"]:
            payload = bytes.fromhex(hex_payload)
            batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
            ts, plain, rank = msgspec.msgpack.decode(payload)   # untyped: what any msgpack reader sees
            if (batch.ts, batch.data_parallel_rank, len(batch.events)) != (ts, rank, len(plain)):
                mismatches.append(f"batch header {batch.ts, batch.data_parallel_rank} vs {ts, rank}")
            for event, raw in zip(batch.events, plain):
                name = type(event).__name__
                if name != raw["type"]:
                    mismatches.append(f"type {name} vs {raw['type']}")
                    continue
                counts[name] += 1
                if name != "AllBlocksCleared":
                    media[event.medium] = media.get(event.medium, 0) + 1
                for field in VLLM_FIELDS[name]:
                    if getattr(event, field) != raw[field]:
                        mismatches.append(f"{name}.{field}: {getattr(event, field)!r} vs {raw[field]!r}")
                if name == "BlockStored":
                    parent = event.parent_block_hash if event.parent_block_hash is not None else root_hash()
                    if hash_blocks(parent, event.token_ids, event.block_size) != event.block_hashes:
                        mismatches.append(f"tokens of {event.block_hashes[0].hex()[:12]}.. do not hash to it")
                    hashed += len(event.block_hashes)
        failures += bool(mismatches)
        print(f"{case['model']:>14}: {len(case['payloads'])} batches decoded by vllm.distributed.kv_events."
              f"KVEventBatch: {counts['BlockStored']} BlockStored, {counts['BlockRemoved']} BlockRemoved, "
              f"{counts['AllBlocksCleared']} AllBlocksCleared; media {media}; {hashed} block hashes recomputed "
              f"from token_ids; "
              f"{'all fields match' if not mismatches else f'{len(mismatches)} MISMATCHES, first: {mismatches[:3]}'}")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    parser.add_argument("--models", nargs="+", default=["gemma-3-27b", "gpt-oss-120b"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode", help=argparse.SUPPRESS)   # the vLLM side: a file of encoded batches
    args = parser.parse_args()
    if args.decode:
        return decode_with_vllm(args.decode)
    if not os.path.exists(args.vllm_python):
        print(f"no vLLM Python at {args.vllm_python}: set it up per /work/shared/anchors/vllm_baseline.md",
              file=sys.stderr)
        return 2
    cases = [{"model": m, "payloads": [p.hex() for p in encode(m, args.seed)]} for m in args.models]
    cases.append({"model": "gpt-oss-20b+host", "payloads": [p.hex() for p in encode_host_tier(args.seed)]})
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cases, f)
    try:
        env = {**os.environ, "PYTHONPATH": ROOT}   # kvmanager only: standard library
        return subprocess.run([args.vllm_python, os.path.abspath(__file__), "--decode", f.name], env=env).returncode
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    sys.exit(main())
