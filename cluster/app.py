"""The application builder named by ``ray_configs/serve.yaml`` (``serve run`` / ``serve deploy``).

``args`` are ``build_engine``'s keywords, plus the serving option ``max_body_bytes``. The engine actor is
found by name, or started detached so it outlives the builder: Serve may call the builder again on
redeploys.
"""
from __future__ import annotations

import os


def build(args: dict):
    import ray

    from .engine_actor import ENGINE_ACTOR_NAME, NAMESPACE
    from .launch import start_engine_actor
    from .serve import DEFAULT_MAX_BODY_BYTES, build_app

    args = dict(args)
    max_body_bytes = args.pop("max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    try:
        handle = ray.get_actor(ENGINE_ACTOR_NAME, namespace=NAMESPACE)
        info = ray.get(handle.ready.remote(), timeout=600)
    except ValueError:   # not running yet
        handle, info = start_engine_actor(dict(args), detached=True)
    path = info.get("model_path")
    return build_app(ENGINE_ACTOR_NAME, NAMESPACE, info["model"], path if path and os.path.isdir(path) else None,
                     info["max_model_len"], max_body_bytes)
