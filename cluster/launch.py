"""Bring the service up: a Ray runtime, the named engine actor (which places its workers), the Serve app.

``swakv serve`` runs ``serve_forever``; the load test and the tests call the pieces. Ctrl-C or SIGTERM
shuts down Serve and, when this process started it, the local Ray runtime: no Ray process is left.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from .engine_actor import ENGINE_ACTOR_NAME, NAMESPACE, EngineService

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",   # keep every Ray process on 127.0.0.1
           "RAY_USAGE_STATS_ENABLED": "0",
           "GLOO_SOCKET_IFNAME": "lo"}


def init_ray(address: str | None = None, num_cpus: int | None = None):
    """Connect to ``address`` or start a local runtime on loopback (no dashboard: it costs 1 GB here)."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    import ray
    if ray.is_initialized():
        return ray
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace=NAMESPACE,
                 log_to_driver=False)   # "local": a new runtime, never one another process started
    return ray


def start_engine_actor(build_kwargs: dict, *, name: str = ENGINE_ACTOR_NAME, max_restarts: int = 1,
                       timeout_s: float = 900.0, detached: bool = False, resources: dict | None = None):
    """The engine actor (async; no CPU of its own), started with its workers; returns (handle, info).

    ``max_restarts=1``: if the engine process dies, Ray starts it again with new workers; the Serve app
    re-finds it by name, and in-flight requests fail with a retryable error. ``resources`` pins it
    (e.g. to the head node through a custom resource).
    """
    import ray
    from .llm import build_engine
    actor_cls = ray.remote(EngineService)
    handle = actor_cls.options(name=name, namespace=NAMESPACE, num_cpus=0, max_restarts=max_restarts,
                               max_task_retries=0, max_concurrency=1000,
                               lifetime="detached" if detached else None, resources=resources or {},
                               ).remote(build_engine, use_ray=True, **build_kwargs)
    try:
        info = ray.get(handle.ready.remote(), timeout=timeout_s)
    except ray.exceptions.RayActorError as exc:
        raise RuntimeError(f"the engine actor failed to start: {exc}") from None
    except BaseException:
        ray.kill(handle, no_restart=True)
        raise
    return handle, info


def deploy(info: dict, *, host: str = "127.0.0.1", port: int = 8000, name: str = ENGINE_ACTOR_NAME):
    from .serve import build_app, run
    path = info.get("model_path")
    tokenizer_dir = path if path and os.path.isdir(path) else None
    app = build_app(name, NAMESPACE, info["model"], tokenizer_dir, info["max_model_len"])
    return run(app, host=host, port=port)


def serve_forever(build_kwargs: dict, *, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
                  num_cpus: int | None = None) -> int:
    ray = init_ray(address, num_cpus)
    started_here = not address

    def _stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        print(f"swakv: starting engine and workers for {build_kwargs.get('model', 'default')} ...", flush=True)
        engine_handle, info = start_engine_actor(build_kwargs)  # held: a named actor lives while handles do
        deploy(info, host=host, port=port)
        print(f"swakv: serving {info['model']} on http://{host}:{port}  "
              f"({info['num_blocks']} KV units, {info['num_groups']} groups, max_model_len {info['max_model_len']})\n"
              f"  curl http://{host}:{port}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{info['model']}\", \"prompt\": \"The \", \"max_tokens\": 32}}'\n"
              "Ctrl-C stops it.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nswakv: shutting down ...", file=sys.stderr, flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if started_here:
            ray.shutdown()      # stops every process of the runtime it started, Serve's included
        else:
            _stop_serve(timeout_s=30)


def _stop_serve(timeout_s: float) -> None:
    """Remove the Serve app from a cluster we only joined; Serve's shutdown can wait on draining replicas."""
    import threading

    from ray import serve
    t = threading.Thread(target=serve.shutdown, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        print(f"swakv: Serve did not shut down within {timeout_s:.0f} s; leaving it to the cluster", file=sys.stderr)
