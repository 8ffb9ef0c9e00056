"""``swakv plan``: how many requests of a given context fit, window-aware and with sliding layers as full.

The arithmetic is ``kvmanager.planning.capacity_report``'s; this module picks the model and the budget
and prints the result. Without ``--kv-memory`` the budget per device is what the GPU leaves
(``workers.sim.gpus.default_kv_memory``: memory less a 10% activation reserve, less the weights).
With ``--kv-host-memory``, it also sizes the host KV tier (``cluster.engine.build.host_tier_size``): host
units, and how many requests' whole KV at the context length the tier holds.
"""
from __future__ import annotations

import argparse
import json
import sys

from kvmanager.planning import capacity_report
from workers.sim.gpus import ACTIVATION_RESERVE, default_kv_memory, format_size

from .args import positive_int, size_arg

DEFAULT_GPU = "H100-80GB"


def plan(model, *, context: int, kv_memory: int | None = None, gpu=DEFAULT_GPU, block_size: int = 16,
         tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, prefill_chunk: int = 512,
         kv_host_memory: int | None = None) -> dict:
    """The capacity report for ``model`` (preset name, config.json path or preset) and its inputs."""
    from workers.models.layer_kinds import check_parallel_sizes
    from workers.sim.gpus import get_gpu
    from workers.sim.presets import describe_layers, get_model_preset

    preset, device = get_model_preset(model), get_gpu(gpu)
    check_parallel_sizes(preset.config, tensor_parallel_size, pipeline_parallel_size)
    specs = preset.layer_specs(block_size)
    source = "--kv-memory"
    if kv_memory is None:
        kv_memory, source = default_kv_memory(preset, device, tensor_parallel_size, pipeline_parallel_size), "derived"
    report = capacity_report(specs, kv_memory, context, prefill_chunk=prefill_chunk,
                             pipeline_parallel_size=pipeline_parallel_size, tensor_parallel_size=tensor_parallel_size)
    ratio = report.pop("concurrency_ratio")
    if kv_host_memory:
        from kvmanager.planning import as_full_attention, kv_layout

        from cluster.engine.build import host_tier_size, host_unit_bytes
        for label, layer_specs in (("window_aware", specs), ("sliding_as_full", as_full_attention(specs))):
            layout = kv_layout(layer_specs, pipeline_parallel_size, tensor_parallel_size)
            units, _ = host_tier_size(layout, kv_host_memory, tensor_parallel_size)
            r = report[label]
            r["host_unit_bytes"] = host_unit_bytes(layout, tensor_parallel_size)
            r["num_host_blocks"] = units
            r["host_requests"] = units // r["blocks_per_request"]
    return {"model": preset.name, "layers": describe_layers(specs), "gpu": device.name,
            "tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size,
            "block_size": block_size, "context": context, "prefill_chunk": min(prefill_chunk, context),
            "kv_memory_bytes": kv_memory, "kv_memory_source": source, "kv_host_memory_bytes": kv_host_memory,
            "activation_reserve": ACTIVATION_RESERVE if source == "derived" else None,
            "window_aware": report["window_aware"], "sliding_as_full": report["sliding_as_full"],
            "concurrency_ratio": None if ratio == float("inf") else ratio,
            "kv_bytes_ratio": report["sliding_as_full"]["kv_bytes_per_request"]
            / report["window_aware"]["kv_bytes_per_request"]}


def format_plan(p: dict) -> str:
    wa, sf = p["window_aware"], p["sliding_as_full"]
    how = ("given" if p["kv_memory_source"] == "--kv-memory"
           else f"{p['gpu']} memory x {1 - p['activation_reserve']:.2f} - weights / (TP x PP)")
    rows = [
        ("KV-cache groups (units per block)",
         lambda r: f"{r['num_groups']} ({' + '.join(map(str, r['group_widths']))})"),
        ("layers per pool unit", lambda r: _per_stage(r["layers_per_group"])),
        ("bytes per pool unit", lambda r: format_size(r["block_bytes"])),
        ("pool units", lambda r: f"{r['num_blocks']:,}"),
        ("units per request, decode", lambda r: f"{r['blocks_per_request']:,}"),
        ("KV bytes per request, decode", lambda r: format_size(r["kv_bytes_per_request"])),
        ("max concurrency, decode", lambda r: f"{r['max_concurrency']:,}"),
        (f"KV bytes per request, prefill peak ({p['prefill_chunk']})",
         lambda r: format_size(r["prefill_peak_kv_bytes_per_request"])),
        ("max concurrency, prefill peak", lambda r: f"{r['max_concurrency_prefill_peak']:,}"),
    ]
    if p.get("kv_host_memory_bytes"):
        rows += [("bytes per host unit (all devices)", lambda r: format_size(r["host_unit_bytes"])),
                 ("host units", lambda r: f"{r['num_host_blocks']:,}"),
                 ("requests the host tier holds", lambda r: f"{r['host_requests']:,}")]
    width = max(len(label) for label, _ in rows)
    lines = [f"swakv plan: {p['model']} on {p['gpu']}, TP={p['tensor_parallel_size']} "
             f"PP={p['pipeline_parallel_size']}, context {p['context']:,} tokens, block size {p['block_size']}",
             f"layers: {p['layers']}",
             f"KV memory per device: {format_size(p['kv_memory_bytes'])} ({how})"
             + (f"; host KV tier: {format_size(p['kv_host_memory_bytes'])}" if p.get("kv_host_memory_bytes") else ""),
             "",
             f"{'':<{width}}  {'window-aware':>16}  {'sliding-as-full':>16}",
             f"{'-' * width}  {'-' * 16}  {'-' * 16}"]
    lines += [f"{label:<{width}}  {cell(wa):>16}  {cell(sf):>16}" for label, cell in rows]
    ratio = p["concurrency_ratio"]
    lines += ["", f"window-aware holds {p['kv_bytes_ratio']:.2f}x less KV per request; concurrency ratio "
              f"{'n/a (sliding-as-full fits none)' if ratio is None else f'{ratio:.2f}x'}"]
    return "\n".join(lines)


def _per_stage(values: list[int]) -> str:
    """One figure when every pipeline stage agrees, else one per stage."""
    return str(values[0]) if len(set(values)) == 1 else "/".join(map(str, values))


def _run(args: argparse.Namespace) -> int:
    try:
        result = plan(args.model, context=args.context, kv_memory=args.kv_memory, gpu=args.gpu,
                      block_size=args.block_size, tensor_parallel_size=args.tensor_parallel_size,
                      pipeline_parallel_size=args.pipeline_parallel_size, prefill_chunk=args.prefill_chunk,
                      kv_host_memory=args.kv_host_memory)
    except (ValueError, TypeError) as exc:
        print(f"swakv plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``plan`` to a CLI's subcommands."""
    from workers.sim.gpus import GPU_PRESETS
    from workers.sim.presets import MODEL_PRESETS

    p = subparsers.add_parser(
        "plan", help="KV memory and concurrency at a context length, window-aware vs sliding-as-full",
        description="Size a deployment: KV bytes and pool units per request and the maximum concurrency at a "
                    "context length, for the window-aware layout and for sliding layers treated as full.")
    p.add_argument("--model", required=True,
                   help=f"a preset ({', '.join(MODEL_PRESETS)}) or a config.json path / model directory")
    p.add_argument("--kv-memory", type=size_arg, default=None,
                   help="KV-cache memory per device, e.g. 20GiB (default: the GPU's memory minus weights and a "
                        f"{ACTIVATION_RESERVE:.0%} activation reserve)")
    p.add_argument("--kv-host-memory", type=size_arg, default=None,
                   help="host memory for the host KV tier, all devices of a replica together, e.g. 64GiB "
                        "(default: none)")
    p.add_argument("--context", type=positive_int, default=32768, help="tokens per request (default 32768)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--gpu", default=DEFAULT_GPU, help=f"one of {', '.join(GPU_PRESETS)} (default {DEFAULT_GPU})")
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1)
    p.add_argument("--prefill-chunk", type=positive_int, default=512,
                   help="tokens per chunked-prefill step, for the prefill peak (default 512)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run)
    return p
