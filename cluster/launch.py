"""Bring the service up: a Ray runtime, the named engine actors (each places its workers), the Serve app.

``swakv serve`` runs ``serve_forever``; the load test and the tests call the pieces. Ctrl-C or SIGTERM
first tells every in-flight request that the server is shutting down (``stop_serving``), then shuts down
Serve and, when this process started it, the local Ray runtime: no Ray process is left.

However the signal arrives, shutdown is bounded and complete (``supervise``): ``swakv serve`` runs the
server in a child process in a session of its own, so a signal to the terminal's or a service manager's
process group reaches only the supervisor, which passes it on once. Without this, ``kill -TERM -PGID``
also reached Ray's GCS, raylet and agents (they share the server's process group and block SIGINT, not
SIGTERM): they died at once, under the server's goodbyes, which then failed ("an engine did not take the
shutdown"), so requests in flight were never told and the server waited out its timeouts. The child's
goodbyes are bounded (``GOODBYE_S``), after which it kills its whole process group (itself, GCS, raylet,
the agents; Ray's workers, each in a process group of its own, exit when their raylet is gone); the
supervisor sweeps that group again once the child ends. If the supervisor is killed outright, the kernel
signals the child (``PR_SET_PDEATHSIG``), which says its goodbyes as for SIGTERM; Ray ties GCS and the
raylet to the child the same way, so they never outlive it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from .engine_actor import ENGINE_ACTOR_NAME, NAMESPACE, EngineService

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",   # keep every Ray process on 127.0.0.1
           "RAY_USAGE_STATS_ENABLED": "0",
           "GLOO_SOCKET_IFNAME": "lo"}


GOODBYE_S = 20.0          # the most a stop may take before everything left is killed (the goal is 30 s)
SUPERVISED = "SWAKV_SUPERVISED"   # set in the server process a supervisor started


def supervise(argv: list[str]) -> int:
    """Run ``python -m cluster *argv`` (the server) as a child in its own session and process group, pass
    the first SIGINT / SIGTERM / SIGHUP on to it alone, and once it ends, kill whatever is left in its
    group; return its exit status. See the module doc for why."""
    parent = os.getpid()

    def in_child():   # after fork, before exec: die with the supervisor, even if it is already gone
        _die_with_parent(signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    child = subprocess.Popen([sys.executable, "-m", "cluster", *argv], env={**os.environ, SUPERVISED: "1"},
                             start_new_session=True, preexec_fn=in_child)
    signalled = threading.Event()

    def forward(signum, frame):
        if not signalled.is_set():   # the first one starts the goodbyes; more must not cut them short
            signalled.set()
            _signal_group(child.pid, signal.SIGTERM, leader_only=True)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    deadline = None
    try:
        while True:
            try:
                code = child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if signalled.is_set():
                    deadline = deadline or time.monotonic() + GOODBYE_S + 5
                    if time.monotonic() > deadline:   # the child's own bound failed: end it all now
                        _signal_group(child.pid, signal.SIGKILL)
    finally:
        _signal_group(child.pid, signal.SIGKILL)   # Ray processes it left behind, if any
    return 0 if code == -signal.SIGTERM and signalled.is_set() else code


def _signal_group(pgid: int, sig: int, leader_only: bool = False) -> None:
    try:
        os.kill(pgid, sig) if leader_only else os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _die_with_parent(sig: int) -> None:
    """Linux: the kernel sends ``sig`` to this process when its parent ends (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)   # 1: PR_SET_PDEATHSIG


def _goodbye_deadline() -> None:
    """In a supervised server: if the goodbyes are not over in ``GOODBYE_S``, kill the whole process group
    (the server, GCS, raylet, the workers). The group is this process's own only when supervised."""
    if os.environ.get(SUPERVISED) and os.getpgrp() == os.getpid():
        timer = threading.Timer(GOODBYE_S, os.killpg, (os.getpgrp(), signal.SIGKILL))
        timer.daemon = True
        timer.start()


def init_ray(address: str | None = None, num_cpus: int | None = None, dashboard: bool = False):
    """Connect to ``address`` or start a local runtime on loopback. The dashboard (``ray list actors``,
    ``serve status``) only when asked: it costs about 1 GB here."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    import ray
    if ray.is_initialized():
        return ray
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=dashboard, dashboard_host="127.0.0.1",
                 namespace=NAMESPACE, log_to_driver=False)   # "local": a new runtime, never one another process started
    return ray


def engine_names(data_parallel_size: int, base: str = ENGINE_ACTOR_NAME) -> list[str]:
    """The engine actors of a deployment: replica ``i`` is ``{base}-{i}``."""
    return [f"{base}-{i}" for i in range(data_parallel_size)]


def start_engine_actors(build_kwargs: dict, data_parallel_size: int = 1, *, base: str = ENGINE_ACTOR_NAME,
                        max_restarts: int = 1, timeout_s: float = 900.0, detached: bool = False,
                        resources: dict | None = None) -> list[tuple]:
    """``data_parallel_size`` engine actors (async; no CPU of their own), each with its own workers in its
    own placement group, started side by side; returns [(handle, info)] in rank order. With several, each
    places its workers on nodes the others do not use, when the cluster has such nodes.

    ``max_restarts=1``: if an engine process dies, Ray starts it again with new workers; the Serve app
    finds it again, and in-flight requests that had streamed nothing are retried on another replica.
    ``resources`` pins them (e.g. to the head node through a custom resource). If any fails to start,
    all are stopped.
    """
    import ray
    from .llm import build_engine
    if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be an integer >= 1, got {data_parallel_size!r}")
    kwargs = dict(build_kwargs)
    if data_parallel_size > 1:
        kwargs["replica_set"] = base
    actor_cls = ray.remote(EngineService)
    handles = [actor_cls.options(name=name, namespace=NAMESPACE, num_cpus=0, max_restarts=max_restarts,
                                 max_task_retries=0, max_concurrency=1000,
                                 lifetime="detached" if detached else None, resources=resources or {},
                                 ).remote(build_engine, rank=rank, use_ray=True, **kwargs)
               for rank, name in enumerate(engine_names(data_parallel_size, base))]
    try:
        infos = ray.get([h.ready.remote() for h in handles], timeout=timeout_s)
    except ray.exceptions.RayActorError as exc:
        for h in handles:
            stop_engine_actor(h, timeout_s=10)
        raise RuntimeError(f"an engine actor failed to start: {exc}") from None
    except BaseException:
        for h in handles:
            ray.kill(h, no_restart=True)
        raise
    return list(zip(handles, infos))


def start_engine_actor(build_kwargs: dict, *, name: str = ENGINE_ACTOR_NAME, max_restarts: int = 1,
                       timeout_s: float = 900.0, detached: bool = False, resources: dict | None = None,
                       rank: int = 0):
    """One engine actor named ``name`` (replica ``rank`` of a deployment, or a test's engine), started
    with its workers; returns (handle, info)."""
    import ray
    from .llm import build_engine
    actor_cls = ray.remote(EngineService)
    handle = actor_cls.options(name=name, namespace=NAMESPACE, num_cpus=0, max_restarts=max_restarts,
                               max_task_retries=0, max_concurrency=1000,
                               lifetime="detached" if detached else None, resources=resources or {},
                               ).remote(build_engine, rank=rank, use_ray=True, **build_kwargs)
    try:
        info = ray.get(handle.ready.remote(), timeout=timeout_s)
    except ray.exceptions.RayActorError as exc:
        raise RuntimeError(f"the engine actor failed to start: {exc}") from None
    except BaseException:
        ray.kill(handle, no_restart=True)
        raise
    return handle, info


def stop_engine_actor(handle, timeout_s: float = 30.0) -> None:
    """Stop an engine for good: its workers first (their placement group goes back), then the actor.
    Killing the actor alone would leave the group reserved until the job ends."""
    import ray
    try:
        ray.get(handle.shutdown.remote(), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - already dead, or not answering: killing it is all that is left
        pass
    ray.kill(handle, no_restart=True)


def deploy(info: dict, *, host: str = "127.0.0.1", port: int = 8000, names: list[str] | None = None,
           max_body_bytes: int | None = None, router: str = "prefix"):
    """The OpenAI app in front of the engines ``names`` (found by name), routing with ``router``."""
    from .serve import DEFAULT_MAX_BODY_BYTES, build_app, run
    path = info.get("model_path")
    tokenizer_dir = path if path and os.path.isdir(path) else None
    app = build_app(names or engine_names(1), NAMESPACE, info["model"], tokenizer_dir, info["max_model_len"],
                    max_body_bytes or DEFAULT_MAX_BODY_BYTES, router=router)
    return run(app, host=host, port=port)


def stop_serving(engine_handles, timeout_s: float = 30.0) -> int:
    """Before tearing down: every engine refuses new requests and ends every stream with a "server is
    shutting down" error; then Serve shuts down gracefully, which waits for the replicas to deliver those
    last events. Returns how many requests were in flight. Bounded: nothing here can hang."""
    import ray
    handles = engine_handles if isinstance(engine_handles, (list, tuple)) else [engine_handles]
    refs = [h.shutdown.remote() for h in handles]
    in_flight = 0
    for h, ref in zip(handles, refs):
        try:
            in_flight += ray.get(ref, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - the engine is gone already: nothing to tell
            print(f"swakv: an engine did not take the shutdown ({type(exc).__name__})", file=sys.stderr)
    _stop_serve(timeout_s)
    return in_flight


def serve_forever(build_kwargs: dict, *, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
                  num_cpus: int | None = None, dashboard: bool = False, max_body_bytes: int | None = None,
                  data_parallel_size: int = 1, router: str = "prefix") -> int:
    ray = init_ray(address, num_cpus, dashboard)
    started_here = not address
    handles = []

    def _stop(signum, frame):
        # the first Ctrl-C or SIGTERM starts the goodbyes; a second one must not cut them short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    old_sigint = signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        print(f"swakv: starting {data_parallel_size} engine replica(s) and their workers for "
              f"{build_kwargs.get('model', 'default')} ...", flush=True)
        started = start_engine_actors(build_kwargs, data_parallel_size)   # held: a named actor lives while handles do
        handles = [h for h, _ in started]
        info = started[0][1]
        deploy(info, host=host, port=port, names=engine_names(data_parallel_size), max_body_bytes=max_body_bytes,
               router=router)
        _wait_routable(host, port)
        print(f"swakv: serving {info['model']} on http://{host}:{port}  "
              f"({data_parallel_size} replica(s), router {router}; each {info['num_blocks']} KV units, "
              f"{info['num_groups']} groups, max_model_len {info['max_model_len']})\n"
              f"  curl http://{host}:{port}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{info['model']}\", \"prompt\": \"The \", \"max_tokens\": 32}}'\n"
              + ("  dashboard: http://127.0.0.1:8265 (ray list actors, serve status)\n" if dashboard else "")
              + "Ctrl-C stops it.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nswakv: shutting down ...", file=sys.stderr, flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)     # also when start-up itself failed
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _goodbye_deadline()
        try:
            if handles:
                n = stop_serving(handles)
                print(f"swakv: told {n} in-flight request(s) that the server is shutting down", file=sys.stderr)
            else:
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
