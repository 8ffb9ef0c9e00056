"""``swakv plan``: how many requests of a given context fit, window-aware and with sliding layers as full.

The arithmetic is ``kvmanager.planning.capacity_report``'s; this module picks the model and the budget
and prints the result. Without ``--kv-memory`` the budget per device is what the GPU leaves:

    kv_memory = memory x (1 - ACTIVATION_RESERVE) - weight_bytes / (TP x PP)

ACTIVATION_RESERVE (10% of device memory, as vLLM's default gpu_memory_utilization=0.9 leaves) covers
activations of a prefill chunk, the CUDA context, communication buffers, CUDA graphs and fragmentation.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

from kvmanager.planning import capacity_report

ACTIVATION_RESERVE = 0.10
DEFAULT_GPU = "H100-80GB"

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'20GiB', '16 GB', '512MiB', '1.5GiB', '21474836480' -> bytes (GB decimal, GiB binary)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: use a number with an optional unit "
                         f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 20GiB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{text!r}: the size must be positive")
    return value


def _size_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def default_kv_memory(model, gpu, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> int:
    """KV bytes per device once weights (split over TP x PP) and the activation reserve are taken."""
    weights = model.weight_bytes / (tensor_parallel_size * pipeline_parallel_size)
    usable = gpu.memory_bytes * (1 - ACTIVATION_RESERVE)
    kv = int(usable - weights)
    if kv <= 0:
        raise ValueError(f"{model.name} weights take {_size(weights)} per device with TP={tensor_parallel_size} x "
                         f"PP={pipeline_parallel_size}, more than the {_size(usable)} one {gpu.name} leaves after "
                         f"its {ACTIVATION_RESERVE:.0%} activation reserve; raise --tensor-parallel-size / "
                         "--pipeline-parallel-size or give --kv-memory")
    return kv


def plan(model, *, context: int, kv_memory: int | None = None, gpu=DEFAULT_GPU, block_size: int = 16,
         tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, prefill_chunk: int = 512) -> dict:
    """The capacity report for ``model`` (preset name, config.json path or preset) and its inputs."""
    from workers.layer_kinds import check_parallel_sizes
    from workers.presets import describe_layers, get_gpu, load_model

    preset, device = load_model(model), get_gpu(gpu)
    check_parallel_sizes(preset.config, tensor_parallel_size, pipeline_parallel_size)
    specs = preset.layer_specs(block_size)
    source = "--kv-memory"
    if kv_memory is None:
        kv_memory, source = default_kv_memory(preset, device, tensor_parallel_size, pipeline_parallel_size), "derived"
    report = capacity_report(specs, kv_memory, context, prefill_chunk=prefill_chunk,
                             pipeline_parallel_size=pipeline_parallel_size, tensor_parallel_size=tensor_parallel_size)
    ratio = report.pop("concurrency_ratio")
    return {"model": preset.name, "layers": describe_layers(specs), "gpu": device.name,
            "tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size,
            "block_size": block_size, "context": context, "prefill_chunk": min(prefill_chunk, context),
            "kv_memory_bytes": kv_memory, "kv_memory_source": source,
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
        ("bytes per pool unit", lambda r: _size(r["block_bytes"])),
        ("pool units", lambda r: f"{r['num_blocks']:,}"),
        ("units per request, decode", lambda r: f"{r['blocks_per_request']:,}"),
        ("KV bytes per request, decode", lambda r: _size(r["kv_bytes_per_request"])),
        ("max concurrency, decode", lambda r: f"{r['max_concurrency']:,}"),
        (f"KV bytes per request, prefill peak ({p['prefill_chunk']})",
         lambda r: _size(r["prefill_peak_kv_bytes_per_request"])),
        ("max concurrency, prefill peak", lambda r: f"{r['max_concurrency_prefill_peak']:,}"),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"swakv plan: {p['model']} on {p['gpu']}, TP={p['tensor_parallel_size']} "
             f"PP={p['pipeline_parallel_size']}, context {p['context']:,} tokens, block size {p['block_size']}",
             f"layers: {p['layers']}",
             f"KV memory per device: {_size(p['kv_memory_bytes'])} ({how})",
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


def _size(n: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):,.2f} {unit}"
    return f"{n:,.0f} B"


def _run(args: argparse.Namespace) -> int:
    try:
        result = plan(args.model, context=args.context, kv_memory=args.kv_memory, gpu=args.gpu,
                      block_size=args.block_size, tensor_parallel_size=args.tensor_parallel_size,
                      pipeline_parallel_size=args.pipeline_parallel_size, prefill_chunk=args.prefill_chunk)
    except (ValueError, TypeError) as exc:
        print(f"swakv plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``plan`` to a CLI's subcommands."""
    from workers.presets import GPU_PRESETS, MODEL_PRESETS

    p = subparsers.add_parser(
        "plan", help="KV memory and concurrency at a context length, window-aware vs sliding-as-full",
        description="Size a deployment: KV bytes and pool units per request and the maximum concurrency at a "
                    "context length, for the window-aware layout and for sliding layers treated as full.")
    p.add_argument("--model", required=True,
                   help=f"a preset ({', '.join(MODEL_PRESETS)}) or a config.json path / model directory")
    p.add_argument("--kv-memory", type=_size_arg, default=None,
                   help="KV-cache memory per device, e.g. 20GiB (default: the GPU's memory minus weights and a "
                        f"{ACTIVATION_RESERVE:.0%} activation reserve)")
    p.add_argument("--context", type=_positive_int, default=32768, help="tokens per request (default 32768)")
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--gpu", default=DEFAULT_GPU, help=f"one of {', '.join(GPU_PRESETS)} (default {DEFAULT_GPU})")
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=_positive_int, default=1)
    p.add_argument("--prefill-chunk", type=_positive_int, default=512,
                   help="tokens per chunked-prefill step, for the prefill peak (default 512)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run)
    return p
