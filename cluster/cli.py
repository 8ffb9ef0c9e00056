"""``swakv`` / ``python -m cluster``: one entry point, one subcommand per job."""
from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run
    run()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .launch import serve_forever
    build = dict(model=args.model, tensor_parallel_size=args.tensor_parallel_size,
                 pipeline_parallel_size=args.pipeline_parallel_size, block_size=args.block_size,
                 num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
                 max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                 enable_prefix_caching=not args.no_prefix_caching, num_gpus_per_worker=args.num_gpus_per_worker,
                 spread_stages=args.spread_stages, simulated_gpu=args.simulated_gpu, device=args.device)
    if args.sleep_factor:
        if not args.simulated_gpu:
            print("swakv serve: error: --sleep-factor needs --simulated-gpu (only simulated workers sleep)",
                  file=sys.stderr)
            return 2
        build["sleep_factor"] = args.sleep_factor
    return serve_forever(build, host=args.host, port=args.port, address=args.address, num_cpus=args.num_cpus,
                         dashboard=args.dashboard, max_body_bytes=args.max_body_bytes,
                         data_parallel_size=args.data_parallel_size, router=args.router)


def _non_negative_float(text: str) -> float:
    import math
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _add_serve(sub) -> None:
    from .planner import _positive_int, _size_arg
    from .router import ROUTERS
    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible) on a local or existing Ray cluster")
    p.add_argument("--model", default="default",
                   help="local model directory, a tiny test model name, or 'default' (the bundled tiny hybrid model)")
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1)
    p.add_argument("--pipeline-parallel-size", type=_positive_int, default=1)
    p.add_argument("--block-size", type=_positive_int, default=16)
    p.add_argument("--num-blocks", type=_positive_int, default=None, help="KV pool size (default: from memory)")
    p.add_argument("--kv-cache-memory", type=_size_arg, default=None, help="KV memory per device, e.g. 2GiB")
    p.add_argument("--max-model-len", type=_positive_int, default=None)
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=512)
    p.add_argument("--max-num-seqs", type=_positive_int, default=256)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--device", default=None, help="torch device for the workers (default: the model's)")
    p.add_argument("--num-gpus-per-worker", type=float, default=0.0)
    p.add_argument("--spread-stages", action="store_true", help="place pipeline stages on different nodes")
    p.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1,
                   help="engine replicas, each with its own workers and placement group, spread over nodes "
                        "when the cluster has several (default 1)")
    p.add_argument("--router", choices=ROUTERS, default="prefix",
                   help="how a request picks a replica: prefix (window-aware prefix hits and load, the default), "
                        "round-robin, least-loaded, or ray-prefix-tree (Ray Serve LLM's text-prefix policy)")
    p.add_argument("--simulated-gpu", default=None,
                   help="serve a preset with simulated workers timed as on this GPU (e.g. H100-80GB)")
    p.add_argument("--sleep-factor", type=_non_negative_float, default=0.0,
                   help="with --simulated-gpu: the workers sleep the modelled step time x this (default 0: no sleep)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_positive_int, default=8000)
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: start a local one)")
    p.add_argument("--num-cpus", type=_positive_int, default=None, help="logical CPUs of the local Ray runtime")
    p.add_argument("--dashboard", action="store_true",
                   help="start Ray's dashboard with the local runtime, so `ray list actors` and `serve status` work "
                        "(off by default: it costs about 1 GB of memory)")
    p.add_argument("--max-body-bytes", type=_size_arg, default=None,
                   help="largest request body accepted, e.g. 8MiB (default); larger ones get HTTP 413")
    p.set_defaults(func=_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swakv", description="Sliding-window-aware LLM serving on Ray.")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")
    demo = sub.add_parser("demo", help="walk through the KV-cache manager on a hybrid layout")
    demo.set_defaults(func=_demo)
    _add_serve(sub)
    from .planner import register as register_plan
    register_plan(sub)
    from .loadtest import register as register_loadtest
    register_loadtest(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
