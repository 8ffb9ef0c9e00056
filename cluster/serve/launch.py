"""Bring the service up and down: the engine actors (``cluster.ray.launch``), then the OpenAI app in front.

``swakv serve`` runs ``serve_forever``; ``ray_configs/serve.yaml``'s builder and the load test build the
same app through ``app_for``. Ctrl-C or SIGTERM first tells every in-flight request that the server is
shutting down (``stop_serving``), then shuts down Serve and, when this process started it, the local Ray
runtime: no Ray process is left. ``swakv serve`` runs this under a supervisor (``supervisor.py``), so that
a stop is bounded and complete however the signal arrives.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time

from cluster.engine.args import EngineArgs
from cluster.engine.types import ModelInfo
from cluster.ray.engine_actor import NAMESPACE
from cluster.ray.launch import engine_names, init_ray, kill_engines, shutdown_engines, start_engine_actors

from .edge import GRACEFUL_S, HTTPEdge, bind
from .openai import DEFAULT_MAX_BODY_BYTES
from .ray_serve import build_app, run
from .supervisor import StopRequested, goodbye_deadline, raise_on_stop

FRONTENDS = ("direct", "serve")
EDGE_ACTOR_NAME = "swakv-http"


def server_args(info: ModelInfo, names: list[str], *, max_body_bytes: int | None = None,
                router: str = "prefix") -> tuple:
    """``OpenAIServer``'s arguments for the engines ``names`` (found by name when needed), described by one
    engine's model info: its name, context length, and tokenizer (the model directory's, if it has one)."""
    path = info.get("model_path")
    tokenizer_dir = path if path and os.path.isdir(path) else None
    return (names, NAMESPACE, info["model"], tokenizer_dir, info["max_model_len"],
            max_body_bytes or DEFAULT_MAX_BODY_BYTES, router)


def app_for(info: ModelInfo, names: list[str], *, max_body_bytes: int | None = None, router: str = "prefix",
            ray_actor_options: dict | None = None):
    """The Serve app in front of the engines ``names``."""
    return build_app(*server_args(info, names, max_body_bytes=max_body_bytes, router=router),
                     ray_actor_options=ray_actor_options)


def start_edges(args: tuple, *, host: str = "127.0.0.1", port: int = 8000, count: int = 1,
                name: str = EDGE_ACTOR_NAME) -> list:
    """``count`` HTTP edges (``edge.py``) of ``OpenAIServer(*args)`` on this node sharing ``host:port``, each
    restarted by Ray if its process dies; returns their handles once all serve. A port in use is a
    ``RuntimeError`` naming it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(HTTPEdge)
    handles = [actor.options(name=f"{name}-{i}", num_cpus=0, max_restarts=-1, namespace=NAMESPACE, enable_task_events=False,
                             scheduling_strategy=here).remote(args, host, port, count > 1) for i in range(count)]
    try:
        ray.get([h.ready.remote() for h in handles], timeout=60)
    except Exception as exc:
        for h in handles:
            ray.kill(h, no_restart=True)
        raise RuntimeError(f"the HTTP edge did not start on {host}:{port}: {_cause(exc)}") from None
    return handles


def stop_edges(handles: list, timeout_s: float = GRACEFUL_S + 5) -> None:
    """Let each edge finish its open responses (bounded), then end it for good."""
    import ray
    try:
        ray.get([h.stop.remote(timeout_s) for h in handles], timeout=timeout_s + 5)
    except Exception:  # noqa: BLE001 - a dead or stuck edge is killed below all the same
        pass
    for h in handles:
        ray.kill(h, no_restart=True)


def check_port(host: str, port: int) -> None:
    """Fail now, before any engine starts, when ``host:port`` is taken."""
    bind(host, port).close()


def _cause(exc: BaseException) -> str:
    """What failed inside Ray's wrapping: the OS's error for a port in use, else the first line."""
    found = re.search(r"\[Errno \d+\] cannot listen on [^:]+:\d+: (.+)", str(exc))
    return found.group(1) if found else (str(exc).splitlines() or [type(exc).__name__])[0]


def deploy(info: ModelInfo, names: list[str], *, host: str = "127.0.0.1", port: int = 8000,
           max_body_bytes: int | None = None, router: str = "prefix", proxy_location: str | None = None,
           ray_actor_options: dict | None = None):
    """``app_for``, served over HTTP on ``host:port``; returns the deployment handle."""
    app = app_for(info, names, max_body_bytes=max_body_bytes, router=router, ray_actor_options=ray_actor_options)
    return run(app, host=host, port=port, proxy_location=proxy_location)


def stop_serving(engine_handles: list, timeout_s: float = 30.0, edges: list | None = None) -> int:
    """Before tearing down: every engine refuses new requests and ends every stream with a "server is
    shutting down" error; then the HTTP side stops gracefully, which lets it deliver those last events
    (``edges``: the direct edges; else Serve); then the engines go. Returns how many requests were in
    flight. Bounded."""
    in_flight = shutdown_engines(engine_handles, timeout_s)
    if edges is not None:
        stop_edges(edges)
    else:
        _stop_serve(timeout_s)
    kill_engines(engine_handles)
    return in_flight


def serve_forever(args: EngineArgs, *, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
                  num_cpus: int | None = None, dashboard: bool = False, max_body_bytes: int | None = None,
                  data_parallel_size: int = 1, router: str = "prefix", frontend: str = "direct",
                  http_frontends: int = 1) -> int:
    """``swakv serve``: the engines for ``args`` and the app in front (``frontend``: ``direct``, uvicorn
    actors on this node, ``http_frontends`` of them sharing the port; or ``serve``, a Ray Serve app),
    until Ctrl-C or SIGTERM."""
    if frontend not in FRONTENDS:
        raise ValueError(f"frontend must be one of {', '.join(FRONTENDS)}, got {frontend!r}")
    try:
        check_port(host, port)
    except OSError as exc:
        print(f"swakv serve: error: {exc.strerror}", file=sys.stderr)
        return 1
    ray = init_ray(address, num_cpus, dashboard)
    started_here = not address
    handles, edges = [], [] if frontend == "direct" else None

    old_sigint = raise_on_stop((signal.SIGINT, signal.SIGTERM))[signal.SIGINT]
    try:
        print(f"swakv: starting {data_parallel_size} engine replica(s) and their workers for "
              f"{args.model} ...", flush=True)
        if args.compile_model:
            print("swakv: compiling the model's forward first (torch.compile, 30-60 s on a small CPU; "
                  "--no-compile-model starts in seconds and serves more slowly)", flush=True)
        started = start_engine_actors(args, data_parallel_size)   # held: a named actor lives while handles do
        handles = [h for h, _ in started]
        info = started[0][1]
        names = engine_names(data_parallel_size)
        if frontend == "direct":
            edges = start_edges(server_args(info, names, max_body_bytes=max_body_bytes, router=router), host=host,
                                port=port, count=http_frontends)
        else:
            deploy(info, names, host=host, port=port, max_body_bytes=max_body_bytes, router=router)
        _wait_routable(host, port)
        print(f"swakv: serving {info['model']} on http://{host}:{port}  "
              f"({data_parallel_size} replica(s), router {router}, frontend {frontend}; each {info['num_blocks']} KV units, "
              f"{info['num_groups']} groups, max_model_len {info['max_model_len']})\n"
              f"  curl http://{host}:{port}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{info['model']}\", \"prompt\": \"The \", \"max_tokens\": 32}}'\n"
              + ("  dashboard: http://127.0.0.1:8265 (ray list actors, serve status)\n" if dashboard else "")
              + "Ctrl-C stops it.", flush=True)
        while True:
            time.sleep(3600)
    except BaseException as exc:     # a stop: as raised, or wrapped by the code it landed in
        if StopRequested.signal_behind(exc) is None:
            raise
        print("\nswakv: shutting down ...", file=sys.stderr, flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)     # also when start-up itself failed
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        goodbye_deadline()
        try:
            if handles:
                n = stop_serving(handles, edges=edges)
                print(f"swakv: told {n} in-flight request(s) that the server is shutting down", file=sys.stderr)
            elif edges is not None:
                stop_edges(edges)
            elif frontend == "serve":
                _stop_serve(timeout_s=30)
            if started_here:
                ray.shutdown()      # stops every process of the runtime it started
        finally:
            signal.signal(signal.SIGINT, old_sigint)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _wait_routable(host: str, port: int, timeout_s: float = 60.0) -> None:
    """Announce the server only once its router follows a ready engine: the app starts following the
    engines at its first request, so ask ``/health`` until it says ``routable`` (a first answer would
    otherwise be a 200 with ``routable: 0``: served, but by a router that knows no replica's cache yet)."""
    import httpx
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}/health"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200 and r.json().get("routable", 0) >= 1:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    print(f"swakv: {url} did not report a routable engine within {timeout_s:.0f} s; serving anyway", file=sys.stderr)


def _stop_serve(timeout_s: float) -> None:
    """Remove the Serve app from a cluster we only joined; Serve's shutdown can wait on draining replicas."""
    import threading

    from ray import serve
    t = threading.Thread(target=serve.shutdown, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        print(f"swakv: Serve did not shut down within {timeout_s:.0f} s; leaving it to the cluster", file=sys.stderr)
