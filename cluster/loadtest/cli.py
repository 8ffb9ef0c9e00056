"""``swakv loadtest``: the subcommand's arguments, the config they make, and the run."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys

from cluster.routing.policies import ROUTERS
from cluster.serve.supervisor import StopRequested, raise_on_stop, supervise, supervised
from cluster.tools.args import non_negative, positive, size_arg

from .config import HOST_TIER, LAYOUTS, ROUTER_WORKLOADS, WORKLOAD_KNOBS, LoadTestConfig
from .report import format_report, public_report, write_plots
from .run import run_loadtest
from .workloads import WORKLOADS


def config_from_args(args: argparse.Namespace) -> LoadTestConfig:
    knobs = {k: getattr(args, k) for k in WORKLOAD_KNOBS if getattr(args, k, None) is not None}
    routers = ROUTERS if args.compare_routers else (args.router,) if args.router else \
        ("prefix",) if args.data_parallel_size > 1 else ()
    if args.workload == "agent" and (args.shared_prefixes is not None or args.popularity is not None):
        raise ValueError("--shared-prefixes, --popularity: agent sessions all share one system prompt")
    if args.shared_prefixes is not None:
        knobs["system_prompts" if args.workload == "chat" else "documents"] = args.shared_prefixes
    if routers and not args.trace:
        knobs = {**ROUTER_WORKLOADS.get(args.workload, {}), **knobs}
    layouts = {"both": LAYOUTS, "window-aware": ("window_aware",), "sliding-as-full": ("sliding_as_full",),
               "host-tier": ("window_aware", HOST_TIER)}
    if (args.layouts == "host-tier") != (args.kv_host_memory is not None):
        raise ValueError("--layouts host-tier compares window-aware without and with a host KV tier of "
                         "--kv-host-memory: give both or neither")
    layout = args.layouts or ("window-aware" if routers else "both")
    pp = args.pipeline_parallel_size or (1 if args.real or routers else LoadTestConfig.pipeline_parallel_size)
    if args.kv_memory is None:   # not given: the default budget (simulated) or the CPU workers' default (real)
        kv_memory = None if args.real else LoadTestConfig.kv_memory
    else:
        kv_memory = None if args.kv_memory == "auto" else args.kv_memory
    cfg = LoadTestConfig(
        model=args.model or ("default" if args.real else LoadTestConfig.model), gpu=args.gpu, real=args.real, nodes=args.nodes, cpus_per_node=args.cpus_per_node,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=pp,
        kv_memory=kv_memory, kv_host_memory=args.kv_host_memory, block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
        sleep_factor=args.sleep_factor, layouts=layouts[layout], workload=args.workload, trace=args.trace,
        workload_args=knobs, seed=args.seed, duration_s=args.duration, drain_s=args.drain,
        kill_worker_at=args.kill_worker_at, kill_node_at=args.kill_node_at, port=args.port, out_dir=args.out,
        progress=not args.no_progress and not args.json, data_parallel_size=args.data_parallel_size,
        routers=tuple(routers), kill_replica_at=args.kill_replica_at)
    return cfg


@contextlib.contextmanager
def _stdout_to_stderr():
    """Ray prints node deaths and log lines to stdout; keep stdout for the report (``--json`` parses it)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def ending_of(exc: BaseException) -> tuple[str, int] | None:
    """The line and exit status for what ended a load test early, or None for an exception to raise. A stop
    signal first, also one the code it landed in re-raised as another exception (the cluster went down on
    the way here either way); then bad input; then a cluster that could not do its part (torn down too)."""
    signum = StopRequested.signal_behind(exc)
    if signum is not None:
        return f"stopped by {signal.Signals(signum).name}; its Ray cluster is torn down", 128 + signum
    if isinstance(exc, (ValueError, TypeError)):
        return f"error: {exc}", 2
    if isinstance(exc, RuntimeError):
        return f"failed: {exc}", 1
    return None


def _run(args: argparse.Namespace) -> int:
    # The load test runs in a child in a session of its own (cluster/serve/supervisor.py), so a signal to the
    # terminal's or a service manager's process group reaches the supervisor alone, which passes it on: Ray's
    # GCS and raylets, in the child's group, never see it (a group's SIGTERM killed them under the teardown,
    # which then waited 60 s on the dead GCS). Any stop signal tears the cluster down on the way out, with a
    # line instead of a traceback. Bad arguments fail first, in this process.
    try:
        cfg = config_from_args(args).check()
        cfg.sessions()   # a bad workload knob or trace line fails here, before any Ray process starts
    except (ValueError, TypeError) as exc:
        print(f"swakv loadtest: error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "argv", None) is not None and not supervised():   # argv: from the command line
        return supervise(args.argv, as_sent=True)
    replaced = raise_on_stop()
    try:
        with _stdout_to_stderr():
            report = run_loadtest(cfg)
    except BaseException as exc:
        ending = ending_of(exc)
        if ending is None:
            raise
        print(f"swakv loadtest: {ending[0]}", file=sys.stderr)
        return ending[1]
    finally:
        for signum, handler in replaced.items():
            signal.signal(signum, handler)
    plots = write_plots(report, cfg.out_dir) if cfg.out_dir else []
    if args.json:
        print(json.dumps(public_report(report), indent=2))
    else:
        print(format_report(report))
        for path in plots:
            print(f"plot: {path}")
    ok = report["lost"] == 0 and report["answered_twice"] == 0 and report["cluster"]["processes_left"] == 0
    return 0 if ok else 1


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``loadtest`` to a CLI's subcommands."""
    d = LoadTestConfig()
    p = subparsers.add_parser(
        "loadtest", help="multi-node load test on this host: window-aware vs sliding-as-full, or routers",
        description="Bring up a Ray cluster of several nodes on this host, deploy the Serve app with simulated "
                    "(or real tiny-model) workers, drive it over HTTP with an open-loop workload, report "
                    "throughput, latency percentiles, KV usage and faults for each KV layout (or, with several "
                    "engine replicas, for each router on the same arrivals), and tear it all down.")
    g = p.add_argument_group("cluster")
    g.add_argument("--model", default=None,
                   help=f"a model preset or config.json (default {d.model}; with --real, the bundled tiny hybrid)")
    g.add_argument("--gpu", default=d.gpu, help=f"GPU preset the simulated workers model (default {d.gpu})")
    g.add_argument("--real", action="store_true", help="real tiny-model workers on CPU instead of simulated ones")
    g.add_argument("--nodes", type=positive(int), default=d.nodes, help="Ray nodes incl. the head (default 3)")
    g.add_argument("--cpus-per-node", type=positive(int), default=d.cpus_per_node)
    g.add_argument("--tensor-parallel-size", "-tp", type=positive(int), default=d.tensor_parallel_size)
    g.add_argument("--pipeline-parallel-size", "-pp", type=positive(int), default=None,
                   help=f"pipeline stages, spread over the worker nodes (default {d.pipeline_parallel_size}; 1 with --real)")
    g.add_argument("--kv-memory", type=lambda t: "auto" if t == "auto" else size_arg(t), default=None,
                   help="KV-cache memory per device (default 6GiB, so a load this machine can drive fills it; "
                        "with --real, 256MiB); 'auto': what the GPU leaves, as swakv plan derives it")
    g.add_argument("--block-size", type=positive(int), default=d.block_size)
    g.add_argument("--max-num-batched-tokens", type=positive(int), default=d.max_num_batched_tokens)
    g.add_argument("--sleep-factor", type=non_negative, default=d.sleep_factor,
                   help="workers sleep the simulated step time x this (default 1: real time; 0: as fast as "
                        "the CPU goes, GPU time reported apart)")
    g.add_argument("--layouts", choices=("both", "window-aware", "sliding-as-full", "host-tier"), default=None,
                   help="KV layouts to compare (default both; with routers, window-aware); host-tier: window-aware "
                        "without and with a host KV tier of --kv-host-memory")
    g.add_argument("--kv-host-memory", type=size_arg, default=None,
                   help="with --layouts host-tier: the host KV tier of each replica, e.g. 24GiB")
    g.add_argument("--data-parallel-size", "-dp", type=positive(int), default=d.data_parallel_size,
                   help="engine replicas behind the app (default 1); more than 1 compares routers")
    g.add_argument("--router", choices=ROUTERS, default=None,
                   help="route with this one (default prefix when --data-parallel-size > 1)")
    g.add_argument("--compare-routers", action="store_true",
                   help=f"run every router ({', '.join(ROUTERS)}) on the same arrivals and plot them side by side")
    g.add_argument("--port", type=positive(int), default=None, help="HTTP port on 127.0.0.1 (default: a free one)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=tuple(WORKLOADS), default=d.workload,
                   help="chat: multi-turn, shared history; agent: loops over one long shared system prompt; "
                        "qa: long documents, short answers")
    w.add_argument("--trace", default=None, help="a JSONL trace instead (arrival_s, prompt or prompt_token_ids, "
                                                 "max_tokens per line)")
    w.add_argument("--rate", type=positive(float), default=None, help="session arrivals per second (Poisson)")
    w.add_argument("--sessions", type=positive(int), default=None)
    w.add_argument("--turns", type=positive(int), default=None, help="requests per session")
    w.add_argument("--system-tokens", type=positive(int), default=None,
                   help="system prompt (chat, agent) or document (qa) length")
    w.add_argument("--user-tokens", type=positive(int), default=None, help="new user text per turn")
    w.add_argument("--max-tokens", type=positive(int), default=None, help="answer length")
    w.add_argument("--think-s", type=non_negative, default=None, help="mean pause between a session's turns")
    w.add_argument("--popularity", type=non_negative, default=None,
                   help="skew of the shared prefixes' popularity: prefix k drawn with weight 1/(k+1)^s (default 0, "
                        "uniform; 1 when comparing routers)")
    w.add_argument("--shared-prefixes", type=positive(int), default=None,
                   help="distinct system prompts the chat sessions draw from (default: one each; 6 when comparing "
                        "routers), or documents the qa sessions ask about (default 4; 12 when comparing routers)")
    w.add_argument("--seed", type=int, default=d.seed)
    r = p.add_argument_group("run")
    r.add_argument("--duration", type=positive(float), default=d.duration_s, help="seconds of arrivals per layout")
    r.add_argument("--drain", type=non_negative, default=d.drain_s, help="seconds to let requests in flight finish")
    r.add_argument("--kill-worker-at", type=non_negative, default=None, help="kill stage 0's worker actor then")
    r.add_argument("--kill-node-at", type=non_negative, default=None, help="kill the node holding stage 0 then")
    r.add_argument("--kill-replica-at", type=non_negative, default=None,
                   help="kill replica 0's engine actor then (Ray restarts it); needs --data-parallel-size >= 2")
    r.add_argument("--out", default=d.out_dir, help="folder for loadtest.png and loadtest.json (default loadtest-out)")
    r.add_argument("--json", action="store_true", help="print one JSON object (top level: completed, failed, lost, ...)")
    r.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run)
    return p
