"""``swakv`` / ``python -m cluster``: one entry point, one subcommand per job."""
from __future__ import annotations

import argparse
import dataclasses
import sys


def _demo(args: argparse.Namespace) -> int:
    from .tools.demo import run
    run()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .engine.args import EngineArgs
    try:
        engine = EngineArgs.for_serve({f.name: getattr(args, f.name) for f in _engine_flags()})
    except ValueError as exc:
        print(f"swakv serve: error: {exc}", file=sys.stderr)
        return 2
    from .serve.supervisor import supervise, supervised
    if not supervised():   # the server runs in a child, so that any stop is complete (serve/supervisor.py)
        return supervise(args.argv)
    from .serve.launch import serve_forever
    return serve_forever(engine, host=args.host, port=args.port, address=args.address, num_cpus=args.num_cpus,
                         dashboard=args.dashboard, max_body_bytes=args.max_body_bytes,
                         data_parallel_size=args.data_parallel_size, router=args.router, frontend=args.frontend,
                         http_frontends=args.http_frontends)


def _engine_flags() -> list:
    """``EngineArgs``' fields that are ``swakv serve`` flags (those with help)."""
    from .engine.args import EngineArgs
    return [f for f in dataclasses.fields(EngineArgs) if f.metadata.get("help")]


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ``EngineArgs`` field with help: its name in kebab case, its default, its type."""
    from .tools.args import positive_int, size_arg
    for f in _engine_flags():
        meta = f.metadata
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        if meta["auto"]:                                            # --name, --no-name, or serve decides
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=meta["help"] + " (default: on where it can run: one worker on the CPU, not "
                                               "simulated, with a C++ compiler for inductor)")
        elif isinstance(f.default, bool) and meta["flag"] is None:  # --name and --no-name
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                           help=meta["help"] + (" (default: on)" if f.default else " (default: off)"))
        elif f.default is True:                                     # a flag named for turning it off
            p.add_argument(flag, dest=f.name, action="store_false", help=meta["help"])
        elif f.default is False:
            p.add_argument(flag, dest=f.name, action="store_true", help=meta["help"])
        else:
            kind = size_arg if meta["size"] else positive_int if "int" in f.type else \
                float if "float" in f.type else str
            p.add_argument(flag, dest=f.name, type=kind, default=f.default, help=meta["help"])


def _add_serve(sub) -> None:
    from .routing.policies import ROUTERS
    from .tools.args import positive_int, size_arg
    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible) on a local or existing Ray cluster")
    _add_engine_flags(p)
    p.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                   help="engine replicas, each with its own workers and placement group, spread over nodes "
                        "when the cluster has several (default 1)")
    p.add_argument("--router", choices=ROUTERS, default="prefix",
                   help="how a request picks a replica: prefix (window-aware prefix hits and load, the default), "
                        "round-robin, least-loaded, or ray-prefix-tree (Ray Serve LLM's text-prefix policy)")
    p.add_argument("--frontend", choices=("direct", "serve"), default="direct",
                   help="the HTTP side: direct (uvicorn in a Ray actor on this node, one hop from the engines; the "
                        "default) or serve (a Ray Serve app: its proxy and a replica in between, as "
                        "ray_configs/serve.yaml deploys)")
    p.add_argument("--http-frontends", type=positive_int, default=1,
                   help="with --frontend direct: uvicorn actors sharing the port, for more than one core of HTTP "
                        "work (default 1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=positive_int, default=8000)
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: start a local one)")
    p.add_argument("--num-cpus", type=positive_int, default=None, help="logical CPUs of the local Ray runtime")
    p.add_argument("--dashboard", action="store_true",
                   help="start Ray's dashboard with the local runtime, so `ray list actors` and `serve status` work "
                        "(off by default: it costs about 1 GB of memory)")
    p.add_argument("--max-body-bytes", type=size_arg, default=None,
                   help="largest request body accepted, e.g. 8MiB (default); larger ones get HTTP 413")
    p.set_defaults(func=_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swakv", description="Sliding-window-aware LLM serving on Ray.")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")
    demo = sub.add_parser("demo", help="walk through the KV-cache manager on a hybrid layout")
    demo.set_defaults(func=_demo)
    _add_serve(sub)
    from .tools.planner import register as register_plan
    register_plan(sub)
    from .loadtest.cli import register as register_loadtest
    register_loadtest(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
