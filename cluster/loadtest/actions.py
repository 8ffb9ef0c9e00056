"""What a load test does to the cluster: start and stop the engines, deploy the app in front of them,
wait for it, and inject faults (kill a worker, a node, a replica)."""
from __future__ import annotations

import asyncio
import time

from cluster.engine.args import EngineArgs
from cluster.ray.engine_actor import NAMESPACE
from cluster.ray.launch import engine_names, start_engine_actors, stop_engines as stop_engine_actors
from cluster.serve.launch import deploy

from .local_cluster import HEAD_RESOURCE, LocalCluster


def start_engines(args: EngineArgs, data_parallel_size: int = 1, timeout_s: float = 300.0) -> list[tuple]:
    """The named engine actors on the head node, each placing its own workers on the worker nodes;
    returns [(handle, info)] by rank. Ray restarts an engine that dies (once)."""
    return start_engine_actors(args, data_parallel_size, max_restarts=1, timeout_s=timeout_s,
                               resources={HEAD_RESOURCE: 0.01})


def worker_names(engine) -> list[str]:
    """The engine's current worker actors, stage by stage (from its stats)."""
    import ray
    return ray.get(engine.stats.remote(), timeout=60)["workers"]


def _stage_worker(names: list[str], stage: int) -> str:
    return next(n for n in names if n.startswith(f"swakv-worker-stage{stage}-"))


def stop_engines(handles: list, timeout_s: float = 60.0) -> None:
    """Stop the engines (``cluster.ray.launch.stop_engines``: their workers and placement groups first);
    wait until their names and their workers' names are free, so the next run can take them."""
    names = set(engine_names(len(handles)))
    for handle in handles:
        try:
            names.update(worker_names(handle))
        except Exception:  # noqa: BLE001 - the engine may already be gone; its workers die with it
            pass
    stop_engine_actors(handles, timeout_s)
    deadline = time.monotonic() + timeout_s
    while set(_named_actors()) & names:
        if time.monotonic() > deadline:
            raise RuntimeError(f"engines or workers still alive {timeout_s:.0f} s after stopping them")
        time.sleep(0.1)


def _named_actors() -> list[str]:
    import ray
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == NAMESPACE]


def deploy_app(info: dict, port: int, data_parallel_size: int = 1, router: str = "prefix",
               timeout_s: float = 120.0) -> str:
    """The Serve app in front of the engines, routing with ``router``, its proxy and replica on the head;
    deploying again replaces it. Returns its base URL once every engine replica is ready behind it."""
    deploy(info, engine_names(data_parallel_size), host="127.0.0.1", port=port, router=router,
           proxy_location="HeadOnly", ray_actor_options={"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.01}})
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout_s, ready=data_parallel_size)
    return url


def wait_healthy(url: str, timeout_s: float = 60.0, ready: int = 1) -> None:
    """Until /health answers 200 with ``ready`` engine replicas ready (the app finds new engine actors by
    name on its first call)."""
    import httpx
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=10.0, trust_env=False)
            if r.status_code == 200 and min(r.json().get("ready", 0), r.json().get("routable", 0)) >= ready:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.25)
    raise RuntimeError(f"{url}/health did not answer 200 within {timeout_s:.0f} s (last: {last})")


def warm_up(url: str, timeout_s: float = 60.0) -> None:
    """One tiny request through every hop (proxy, replica, engine, workers), so neither layout's run pays
    for first-call costs the other does not."""
    import httpx
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 2, "ignore_eos": True},
                   timeout=timeout_s, trust_env=False)
    if r.status_code != 200:
        raise RuntimeError(f"warm-up request failed: HTTP {r.status_code}: {r.text[:300]}")


# -- faults ---------------------------------------------------------------------------------------
def _node_id(_actor) -> str:
    import ray
    return ray.get_runtime_context().get_node_id()


def stage_nodes(cluster: LocalCluster, engine, stages: int) -> list[int]:
    """The node (0 = head) each pipeline stage's worker actor runs on now."""
    import ray
    names = worker_names(engine)
    refs = [ray.get_actor(_stage_worker(names, i), namespace=NAMESPACE).__ray_call__.remote(_node_id)
            for i in range(stages)]
    return [cluster.node_index(n) for n in ray.get(refs, timeout=60)]


def kill_worker_action(engine, stage: int = 0):
    """Fault: ``ray.kill`` the named worker actor of ``stage``; the engine restarts its workers."""
    async def kill_worker() -> str:
        import ray
        name = _stage_worker((await engine.stats.remote())["workers"], stage)
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        return f"killed worker {name}"
    return kill_worker


def kill_node_action(cluster: LocalCluster, engine, stage: int = 0):
    """Fault: remove (SIGKILL) the worker node that holds ``stage``'s worker."""
    async def kill_node() -> str:
        import ray
        name = _stage_worker((await engine.stats.remote())["workers"], stage)
        node_id = await ray.get_actor(name, namespace=NAMESPACE).__ray_call__.remote(_node_id)
        node = next(n for n in cluster.cluster.worker_nodes if n.node_id == node_id)
        await asyncio.to_thread(cluster.cluster.remove_node, node, False)
        return f"killed node {cluster.node_index(node_id)} (held {name})"
    return kill_node


def kill_replica_action(engine, name: str):
    """Fault: ``ray.kill`` a replica's engine actor, letting Ray restart it (its workers die with it)."""
    async def kill_replica() -> str:
        import ray
        ray.kill(engine, no_restart=False)
        return f"killed replica {name} (Ray restarts it)"
    return kill_replica
