"""The application builder named by ``ray_configs/serve.yaml`` (``serve run`` / ``serve deploy``).

``args`` are ``EngineArgs``' fields (checked before anything starts), plus the serving options ``max_body_bytes``,
``data_parallel_size`` (engine replicas, each with its own workers; default 1) and ``router``
(round-robin, least-loaded, prefix, ray-prefix-tree; default prefix). The engine actors are found by
name, or started detached so they outlive the builder: Serve may call the builder again on redeploys.
"""
from __future__ import annotations

from kvmanager.checks import check_int


def build(args: dict):
    import ray

    from cluster.engine.args import EngineArgs
    from cluster.ray.engine_actor import NAMESPACE
    from cluster.ray.launch import engine_names, start_engine_actors
    from cluster.routing.policies import make_router

    from .launch import app_for
    from .openai import DEFAULT_MAX_BODY_BYTES

    args = dict(args)
    max_body_bytes = args.pop("max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    dp = args.pop("data_parallel_size", 1)
    router = args.pop("router", "prefix")
    make_router(router)   # a bad name fails before any engine starts
    names = engine_names(check_int("data_parallel_size", dp, 1))
    engine = EngineArgs.for_serve(args)   # a bad engine argument fails here too
    try:
        handles = [ray.get_actor(name, namespace=NAMESPACE) for name in names]
        info = ray.get(handles[0].ready.remote(), timeout=600)
    except ValueError:   # not running yet
        info = start_engine_actors(engine, dp, detached=True)[0][1]
    return app_for(info, names, max_body_bytes=max_body_bytes, router=router)
