"""The Ray runtime of a deployment: a Ray runtime on loopback, the named engine actors (each places its
own workers), and how they stop. ``cluster.serve.launch`` puts the OpenAI app in front of them.
"""
from __future__ import annotations

import os
import sys

from kvmanager.checks import check_int

from cluster.engine.args import EngineArgs

from .engine_actor import ENGINE_ACTOR_NAME, NAMESPACE, EngineService

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",   # keep every Ray process on 127.0.0.1
           "RAY_USAGE_STATS_ENABLED": "0",
           "GLOO_SOCKET_IFNAME": "lo",
           # The raylet starts worker processes at nice 15, and every actor of the serving path is one: any
           # other process on the node (a client, a log shipper) would then outrank the server for the CPU.
           "RAY_worker_niceness": "0"}


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


def spawn_engine_actor(args: EngineArgs | dict, name: str, *, rank: int = 0, max_restarts: int = 1,
                       detached: bool = False, resources: dict | None = None, replica_set: str | None = None):
    """Create the engine actor ``name`` (async; no CPU of its own), replica ``rank`` of its deployment;
    it builds its engine, placing its workers, at its first call (``ready``). Returns its handle.
    ``replica_set``: the name prefix its data-parallel siblings share (their workers go on other nodes)."""
    import ray

    from cluster.engine.build import build_engine

    from .executors import RayExecutor
    args = args if isinstance(args, EngineArgs) else EngineArgs.from_dict(args)
    actor_cls = ray.remote(EngineService)
    return actor_cls.options(name=name, namespace=NAMESPACE, num_cpus=0, max_restarts=max_restarts,
                             max_task_retries=0, max_concurrency=1000, enable_task_events=False,
                             lifetime="detached" if detached else None, resources=resources or {},
                             ).remote(build_engine, args, rank=rank, executor_cls=RayExecutor,
                                      executor_options={"replica_set": replica_set})


def start_engine_actors(args: EngineArgs | dict, data_parallel_size: int = 1, *, base: str = ENGINE_ACTOR_NAME,
                        max_restarts: int = 1, timeout_s: float = 900.0, detached: bool = False,
                        resources: dict | None = None) -> list[tuple]:
    """``data_parallel_size`` engine actors, each with its own workers in its own placement group, started
    side by side; returns [(handle, info)] in rank order. With several, each places its workers on nodes
    the others do not use, when the cluster has such nodes.

    ``max_restarts=1``: if an engine process dies, Ray starts it again with new workers; the Serve app
    finds it again, and in-flight requests that had streamed nothing are retried on another replica.
    ``resources`` pins them (e.g. to the head node through a custom resource). If any fails to start,
    all are stopped.
    """
    import ray
    check_int("data_parallel_size", data_parallel_size, 1)
    args = args if isinstance(args, EngineArgs) else EngineArgs.from_dict(args)   # bad values fail here
    handles = [spawn_engine_actor(args, name, rank=rank, max_restarts=max_restarts, detached=detached,
                                  resources=resources, replica_set=base if data_parallel_size > 1 else None)
               for rank, name in enumerate(engine_names(data_parallel_size, base))]
    try:
        infos = ray.get([h.ready.remote() for h in handles], timeout=timeout_s)
    except ray.exceptions.RayActorError as exc:
        stop_engines(handles, timeout_s=10)
        raise RuntimeError(f"an engine actor failed to start: {exc}") from None
    except BaseException:
        kill_engines(handles)
        raise
    return list(zip(handles, infos))


def shutdown_engines(handles: list, timeout_s: float = 30.0) -> int:
    """Every engine refuses new requests, ends every stream with a "server is shutting down" error and
    stops its workers (their placement group goes back); returns how many requests were in flight.
    Bounded: an engine that is gone or does not answer within ``timeout_s`` is skipped."""
    import ray
    refs = [h.shutdown.remote() for h in handles]
    in_flight = 0
    for ref in refs:
        try:
            in_flight += ray.get(ref, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - already dead, or not answering: killing it is all that is left
            print(f"swakv: an engine did not take the shutdown ({type(exc).__name__})", file=sys.stderr)
    return in_flight


def kill_engines(handles: list) -> None:
    """End the engine actors for good (no restart); their workers die with them."""
    import ray
    for h in handles:
        ray.kill(h, no_restart=True)


def stop_engines(handles: list, timeout_s: float = 30.0) -> int:
    """The one way to stop engines: ``shutdown_engines``, then ``kill_engines``. Killing an actor alone
    would leave its workers' placement group reserved until the job ends."""
    in_flight = shutdown_engines(handles, timeout_s)
    kill_engines(handles)
    return in_flight
