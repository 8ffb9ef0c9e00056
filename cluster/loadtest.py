"""``swakv loadtest``: a multi-node Ray cluster on this host, the Serve app, an open-loop load, a report.

The cluster is Ray's own ``cluster_utils.Cluster``: a head node with no CPUs (it runs the engine actor
and Serve, as the head of ``ray_configs/cluster-aws-gpu.yaml`` does) and ``nodes - 1`` worker nodes
whose CPUs stand for GPUs; the pipeline stages are spread over them. The same workload runs once per KV
layout: window-aware (the preset as it is) and sliding-as-full (every layer allocated as full
attention, as engines without hybrid support do; attention still reads only the window, so step times
are the same and only memory differs). Faults are optional: ``--kill-worker-at`` kills stage 0's worker
actor, ``--kill-node-at`` a worker node with a stage on it. Everything is torn down at the end, failed
runs included; the report says whether any process of the cluster is left.

With ``--data-parallel-size N`` (or ``--router`` / ``--compare-routers``) the runs compare routers instead
of layouts: N engine replicas, each with its own workers spread over the worker nodes, behind one Serve
app that routes with each router in turn, on the same arrivals (engines restarted between routers, so
each starts cold). ``--kill-replica-at`` kills replica 0's engine actor mid-run; Ray restarts it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .engine_actor import NAMESPACE
from .launch import RAY_ENV, engine_names, start_engine_actors
from .llm import build_engine
from .loadgen import WORKLOADS, check_number, load_trace, run_load, summarize
from .router import ROUTERS

ROOT = Path(__file__).resolve().parent.parent
HEAD_RESOURCE = "swakv_head"       # pins the engine actor and the Serve replica to the head node
LAYOUTS = ("window_aware", "sliding_as_full")
_WORKLOAD_KNOBS = ("sessions", "turns", "rate", "system_tokens", "user_tokens", "max_tokens", "think_s",
                   "system_prompts", "documents", "popularity")


@dataclass
class LoadTestConfig:
    """Everything a load test needs; ``check`` names the field of any bad value."""

    model: str = "gemma-3-27b"
    gpu: str = "H100-80GB"
    real: bool = False                  # real tiny-model workers instead of simulated ones
    nodes: int = 3                      # head + (nodes - 1) worker nodes
    cpus_per_node: int = 2
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 2
    kv_memory: int | None = 6 << 30     # per device; None: what the GPU leaves (swakv plan's default)
    block_size: int = 16
    max_num_batched_tokens: int = 512
    sleep_factor: float = 1.0           # simulated step time slept by the workers, x this
    layouts: tuple[str, ...] = LAYOUTS
    workload: str = "chat"
    trace: str | None = None
    workload_args: dict = field(default_factory=dict)   # overrides of the workload's own defaults
    seed: int = 0
    duration_s: float = 20.0            # no new request after this
    drain_s: float = 30.0               # then this long for the ones in flight
    kill_worker_at: float | None = None
    kill_node_at: float | None = None
    port: int | None = None             # None: a free one
    out_dir: str | None = "loadtest-out"
    progress: bool = True
    data_parallel_size: int = 1         # engine replicas
    routers: tuple[str, ...] = ()       # non-empty: one run per router (same arrivals) instead of per layout
    kill_replica_at: float | None = None

    @property
    def runs(self) -> tuple[str, ...]:
        """What the runs compare: routers, or KV layouts."""
        return self.routers or self.layouts

    def check(self) -> LoadTestConfig:
        for name in ("nodes", "cpus_per_node", "tensor_parallel_size", "pipeline_parallel_size", "block_size",
                     "max_num_batched_tokens", "data_parallel_size"):
            check_number(name, getattr(self, name), 1)
        if self.nodes < 2:
            raise ValueError(f"nodes must be >= 2 (a head and at least one worker node), got {self.nodes}")
        workers = self.data_parallel_size * self.pipeline_parallel_size
        if (self.nodes - 1) * self.cpus_per_node < workers:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} x pipeline_parallel_size="
                             f"{self.pipeline_parallel_size} needs {workers} worker CPUs; "
                             f"nodes={self.nodes} with cpus_per_node={self.cpus_per_node} give "
                             f"{(self.nodes - 1) * self.cpus_per_node}")
        if not isinstance(self.routers, tuple) or any(r not in ROUTERS for r in self.routers) \
                or len(set(self.routers)) != len(self.routers):
            raise ValueError(f"routers must be distinct names from {', '.join(ROUTERS)}, got {self.routers!r}")
        if self.routers and len(self.layouts) != 1:
            raise ValueError(f"a comparison of routers runs one KV layout, got layouts={self.layouts!r}")
        if self.kill_replica_at is not None:
            check_number("kill_replica_at", self.kill_replica_at, 0, integer=False)
            if self.data_parallel_size < 2:
                raise ValueError("kill_replica_at needs data_parallel_size >= 2 (another replica to retry on)")
        if self.kv_memory is not None:
            check_number("kv_memory", self.kv_memory, 1)
        for name in ("sleep_factor", "duration_s", "drain_s"):
            check_number(name, getattr(self, name), 0, integer=False, above=name == "duration_s")
        for name in ("kill_worker_at", "kill_node_at"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), 0, integer=False)
        if self.kill_node_at is not None and (self.nodes - 2) * self.cpus_per_node < workers:
            raise ValueError(f"kill_node_at needs the worker nodes left after one dies to hold all "
                             f"{workers} workers: (nodes - 2) x cpus_per_node >= data_parallel_size x "
                             f"pipeline_parallel_size, got nodes={self.nodes}, cpus_per_node={self.cpus_per_node}")
        if not self.layouts or any(x not in LAYOUTS for x in self.layouts):
            raise ValueError(f"layouts must be a non-empty subset of {LAYOUTS}, got {self.layouts!r}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        unknown = sorted(set(self.workload_args) - set(_WORKLOAD_KNOBS))
        if unknown:
            raise ValueError(f"workload_args: unknown field(s) {unknown}; known: {', '.join(_WORKLOAD_KNOBS)}")
        if self.port is not None:
            check_number("port", self.port, 1)
        check_number("seed", self.seed, 0)
        return self

    def sessions(self):
        """The workload (validated by its generator: a bad knob raises naming it)."""
        if self.trace:
            return load_trace(self.trace)
        return WORKLOADS[self.workload](seed=self.seed, **self.workload_args)


# -- the cluster ----------------------------------------------------------------------------------
class LocalCluster:
    """A head (0 CPUs) and ``nodes - 1`` worker nodes on this host, on loopback; a context manager."""

    def __init__(self, nodes: int = 3, cpus_per_node: int = 2):
        self.nodes, self.cpus_per_node = nodes, cpus_per_node
        self.cluster = None
        self.worker_nodes: list = []
        self.pids: list[int] = []

    def __enter__(self) -> LocalCluster:
        for key, value in RAY_ENV.items():
            os.environ.setdefault(key, value)
        # Ray's worker processes import the engine builder and the cluster package from here.
        paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if str(ROOT) not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), *paths]))
        import ray
        from ray.cluster_utils import Cluster
        if ray.is_initialized():
            raise RuntimeError("Ray is already initialised in this process; the load test brings up its own cluster")
        try:
            with _private_address():
                self.cluster = Cluster(initialize_head=True, head_node_args={
                    "num_cpus": 0, "resources": {HEAD_RESOURCE: 1}, "include_dashboard": False})
            self.worker_nodes = [self.cluster.add_node(num_cpus=self.cpus_per_node)
                                 for _ in range(self.nodes - 1)]
            ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False)
            self.cluster.wait_for_nodes(timeout=60)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _all_pids(self) -> list[int]:
        """The nodes' processes (GCS, raylets, agents) and every descendant (worker processes)."""
        roots = {i.process.pid for node in [self.cluster.head_node, *self.cluster.worker_nodes]
                 for infos in node.all_processes.values() for i in infos if i.process is not None}
        return sorted(roots | _descendants(roots))

    def __exit__(self, *exc) -> None:
        import ray
        try:
            from ray import serve
            if ray.is_initialized():
                serve.shutdown()
        except Exception:  # noqa: BLE001 - tearing down anyway
            pass
        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.pids = self._all_pids()
            with _private_address():
                self.cluster.shutdown()

    def processes_left(self, wait_s: float = 10.0) -> int:
        """How many of the cluster's processes are still alive (waiting up to ``wait_s`` for them to exit)."""
        deadline = time.monotonic() + wait_s
        while True:
            alive = [pid for pid in self.pids if _alive(pid)]
            if not alive or time.monotonic() > deadline:
                return len(alive)
            time.sleep(0.2)

    def restore(self) -> None:
        """Add worker nodes until there are ``nodes - 1`` again (after a node was killed), as an autoscaler would."""
        while len(self.cluster.worker_nodes) < self.nodes - 1:
            self.worker_nodes.append(self.cluster.add_node(num_cpus=self.cpus_per_node))
        self.cluster.wait_for_nodes(timeout=60)

    def node_index(self, node_id: str) -> int:
        """0 for the head, i for the i-th worker node added (removed nodes keep their number)."""
        if self.cluster.head_node.node_id == node_id:
            return 0
        return 1 + [n.node_id for n in self.worker_nodes].index(node_id)


@contextlib.contextmanager
def _private_address():
    """Keep /tmp/ray/ray_current_cluster as it was: ``Cluster`` writes its address there (and deletes the
    file at shutdown), and any plain ``ray.init()`` on this host would then join the load test's cluster."""
    from ray._common.utils import get_ray_address_file
    path = get_ray_address_file(None)
    try:
        with open(path, encoding="utf-8") as f:
            before = f.read()
    except OSError:
        before = None
    try:
        yield
    finally:
        if before is None:
            with contextlib.suppress(OSError):
                os.remove(path)
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(before)


def _descendants(roots: set[int]) -> set[int]:
    """Every live descendant of ``roots``, from /proc (empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has exited
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not os.path.isdir("/proc")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engines(build_kwargs: dict, layout: str, data_parallel_size: int = 1,
                  timeout_s: float = 300.0) -> list[tuple]:
    """The named engine actors on the head node, built for ``layout``, each placing its own workers on
    the worker nodes; returns [(handle, info)] by rank. Ray restarts an engine that dies (once)."""
    return start_engine_actors({**build_kwargs, "sliding_as_full": layout == "sliding_as_full"}, data_parallel_size,
                               max_restarts=1, timeout_s=timeout_s, resources={HEAD_RESOURCE: 0.01})


def worker_names(engine) -> list[str]:
    """The engine's current worker actors, stage by stage (from its stats)."""
    import ray
    return ray.get(engine.stats.remote(), timeout=60)["workers"]


def _stage_worker(names: list[str], stage: int) -> str:
    return next(n for n in names if n.startswith(f"swakv-worker-stage{stage}-"))


def stop_engines(handles: list, timeout_s: float = 60.0) -> None:
    """Stop the workers (and free their placement groups), then the engines; wait until their names are free."""
    import ray
    names = set(engine_names(len(handles)))
    for handle in handles:
        try:
            names.update(worker_names(handle))
            ray.get(handle.__ray_call__.remote(lambda self: self.engine.executor.shutdown()), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - the engine may already be gone; its workers die with it
            pass
        ray.kill(handle, no_restart=True)
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
    """The Serve app (its replica on the head) in front of the engines, routing with ``router``; deploying
    again replaces it. Returns its base URL once every engine replica is ready behind it."""
    from ray import serve

    from .serve import OpenAIServer
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    app = OpenAIServer.options(ray_actor_options={"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.01}}).bind(
        engine_names(data_parallel_size), NAMESPACE, info["model"], None, info["max_model_len"], router=router)
    serve.run(app, name="swakv", route_prefix="/")
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


# -- a whole load test ----------------------------------------------------------------------------
def _build_kwargs(cfg: LoadTestConfig) -> dict:
    kwargs = dict(tensor_parallel_size=cfg.tensor_parallel_size, pipeline_parallel_size=cfg.pipeline_parallel_size,
                  block_size=cfg.block_size, max_num_batched_tokens=cfg.max_num_batched_tokens,
                  kv_cache_memory=cfg.kv_memory, spread_stages=True, seed=0)
    if not cfg.real:
        kwargs.update(simulated_gpu=cfg.gpu, sleep_factor=cfg.sleep_factor)
    return kwargs


def preflight(cfg: LoadTestConfig) -> None:
    """Build each layout's engine here, without Ray (simulated workers cost nothing): a model, GPU or
    parallel size that cannot work fails now with the engine's own message, before any Ray process starts."""
    if not cfg.real:
        for layout in cfg.layouts:
            build_engine(cfg.model, **{**_build_kwargs(cfg), "use_ray": False,
                                       "sliding_as_full": layout == "sliding_as_full"})


def kill_replica_action(engine, name: str):
    """Fault: ``ray.kill`` a replica's engine actor, letting Ray restart it (its workers die with it)."""
    async def kill_replica() -> str:
        import ray
        ray.kill(engine, no_restart=False)
        return f"killed replica {name} (Ray restarts it)"
    return kill_replica


class ReplicaStats:
    """Every engine replica's stats, summed for the run's timeline (per replica too). A restarted engine's
    counters start again at zero: what its predecessor had counted is kept (an engine incarnation is
    told apart by its KV-event epoch)."""

    COUNTERS = ("simulated_time_s", "prefix_queried_tokens", "prefix_hit_tokens", "preemptions", "steps",
                "worker_restarts", "recomputed_requests")

    def __init__(self, handles: list):
        self.handles = handles
        self._last: list[dict] = [{} for _ in handles]
        self._base: list[dict] = [dict.fromkeys(self.COUNTERS, 0) for _ in handles]
        self.restarts = [0] * len(handles)

    async def poll(self) -> dict:
        got = await asyncio.gather(*(asyncio.wait_for(h.stats.remote(), 10.0) for h in self.handles),
                                   return_exceptions=True)
        per = []
        for i, st in enumerate(got):
            if isinstance(st, BaseException):
                per.append(None)
                continue
            last = self._last[i]
            if last and st.get("kv_events_epoch") != last.get("kv_events_epoch"):
                self.restarts[i] += 1
                for k in self.COUNTERS:
                    self._base[i][k] += last.get(k, 0)
            self._last[i] = st
            per.append(st)
        out = {k: sum(b[k] + last.get(k, 0) for b, last in zip(self._base, self._last)) for k in self.COUNTERS}
        live = [p for p in per if p is not None]
        out.update(running=sum(p["running"] for p in live), waiting=sum(p["waiting"] for p in live),
                   kv_usage=max((p["kv_usage"] for p in live), default=0.0),
                   prefix_hit_rate=out["prefix_hit_tokens"] / out["prefix_queried_tokens"]
                   if out["prefix_queried_tokens"] else 0.0,
                   replicas=[None if p is None else {k: p[k] for k in ("running", "waiting", "kv_usage")} for p in per])
        return out


def router_view(url: str, replicas: int) -> dict:
    """What the Serve app's router did (its /metrics): requests per replica and reason, retries, replicas
    found down, snapshots loaded; and /health's replicas ready."""
    import httpx
    routed, reasons, snapshots, downs, retries, expected, shortfall = {}, {}, {}, {}, 0, 0, 0
    for line in httpx.get(url + "/metrics", timeout=30.0, trust_env=False).text.splitlines():
        if not line.startswith("swakv_router_"):
            continue
        name, value = line.rsplit(" ", 1)
        labels = dict(part.split("=") for part in name[name.find("{") + 1:-1].replace('"', "").split(",")) \
            if "{" in name else {}
        n = int(float(value))
        if name.startswith("swakv_router_requests_total"):
            rank = int(labels["replica"])
            routed[rank] = routed.get(rank, 0) + n
            reasons[labels["reason"]] = reasons.get(labels["reason"], 0) + n
        elif name.startswith("swakv_router_retries_total"):
            retries = n
        elif name.startswith("swakv_router_expected_hit_tokens_total"):
            expected = n
        elif name.startswith("swakv_router_hit_shortfall_tokens_total"):
            shortfall = n
        elif name.startswith("swakv_router_kv_snapshots_total"):
            snapshots[int(labels["replica"])] = n
        elif name.startswith("swakv_router_replica_down_total"):
            downs[int(labels["replica"])] = n
    health = httpx.get(url + "/health", timeout=30.0, trust_env=False).json()
    return {"routed": [routed.get(i, 0) for i in range(replicas)], "reasons": reasons, "retries": retries,
            "snapshots": [snapshots.get(i, 0) for i in range(replicas)], "downs": [downs.get(i, 0) for i in range(replicas)],
            "expected_hit_tokens": expected, "hit_shortfall_tokens": shortfall, "ready_at_end": health.get("ready", 0)}


def run_one(cluster: LocalCluster, cfg: LoadTestConfig, layout: str, router: str, sessions, url_holder: dict) -> dict:
    """Start the engine replicas for ``layout``, (re)deploy the app with ``router``, run the workload through
    Serve, stop the engines; the summary."""
    cluster.restore()
    dp = cfg.data_parallel_size
    started = start_engines({"model": cfg.model, **_build_kwargs(cfg)}, layout, dp)
    handles, info = [h for h, _ in started], started[0][1]
    label = router if cfg.routers else layout
    try:
        placement = [stage_nodes(cluster, h, cfg.pipeline_parallel_size) for h in handles]
        if url_holder.get("app") != (router, dp):     # the app names its engines and its router
            url_holder["port"] = url_holder.get("port") or cfg.port or _free_port()
            url_holder["url"] = deploy_app(info, url_holder["port"], dp, router)
            url_holder["app"] = (router, dp)
        else:
            wait_healthy(url_holder["url"], ready=dp)
        url = url_holder["url"]
        warm_up(url)
        events = []
        if cfg.kill_worker_at is not None:
            events.append((cfg.kill_worker_at, kill_worker_action(handles[0])))
        if cfg.kill_node_at is not None:
            events.append((cfg.kill_node_at, kill_node_action(cluster, handles[0])))
        if cfg.kill_replica_at is not None:
            events.append((cfg.kill_replica_at, kill_replica_action(handles[0], engine_names(dp)[0])))
        stats = ReplicaStats(handles)
        result = asyncio.run(run_load(
            sessions, url, duration_s=cfg.duration_s, drain_s=cfg.drain_s, seed=cfg.seed, poll_stats=stats.poll,
            progress=cfg.progress, events=events, request_id_prefix=f"{label}-{cfg.seed}"))
        if cfg.kill_replica_at is not None:
            try:   # let the restarted replica rejoin (bounded), so "ready at the end" reports recovery, not timing
                wait_healthy(url, timeout_s=120.0, ready=dp)
            except RuntimeError:
                pass   # it did not: the report shows fewer replicas ready at the end
        view = router_view(url, dp) if cfg.routers else None
    finally:
        stop_engines(handles)
    summary = summarize(result)
    summary["engine"] = {k: info.get(k) for k in ("num_blocks", "num_groups", "group_widths", "block_size",
                                                  "kv_memory_bytes", "pipeline_parallel_size",
                                                  "tensor_parallel_size", "max_model_len")}
    summary["engine"]["stage_nodes"] = placement[0]
    summary["replica_nodes"] = placement
    summary["replica_restarts"] = stats.restarts
    if view is not None:
        summary["router"] = view
    return {"summary": summary, "result": result}


def run_layout(cluster: LocalCluster, cfg: LoadTestConfig, layout: str, sessions, url_holder: dict) -> dict:
    """One layout's run (one replica unless the config says more)."""
    return run_one(cluster, cfg, layout, "prefix", sessions, url_holder)


def run_loadtest(cfg: LoadTestConfig) -> dict:
    """Bring the cluster up, run every layout (or router), tear it down; the report (summaries, timelines)."""
    cfg.check()
    sessions = cfg.sessions()
    preflight(cfg)
    started = time.monotonic()
    runs: dict[str, dict] = {}
    cluster = LocalCluster(cfg.nodes, cfg.cpus_per_node)
    with cluster:
        up_s = time.monotonic() - started
        url_holder: dict = {}
        if cfg.routers:
            for router in cfg.routers:
                runs[router] = run_one(cluster, cfg, cfg.layouts[0], router, sessions, url_holder)
        else:
            for layout in cfg.layouts:
                runs[layout] = run_one(cluster, cfg, layout, "prefix", sessions, url_holder)
    report = {
        "completed": sum(r["summary"]["completed"] for r in runs.values()),
        "failed": sum(r["summary"]["failed"] for r in runs.values()),
        "lost": sum(r["summary"]["lost"] for r in runs.values()),
        "answered_twice": sum(r["summary"]["answered_twice"] for r in runs.values()),
        "routers" if cfg.routers else "layouts": {k: r["summary"] for k, r in runs.items()},
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("progress",)},
        "workload": {"sessions": len(sessions), "requests": sum(s.num_requests for s in sessions)},
        "cluster": {"nodes": cfg.nodes, "cpus_per_node": cfg.cpus_per_node, "startup_s": round(up_s, 1),
                    "processes_left": cluster.processes_left()},
        "total_wall_s": round(time.monotonic() - started, 1),
    }
    report["_runs"] = runs
    return report


# -- output ---------------------------------------------------------------------------------------
def _fmt(value, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "ms":
        return f"{value * 1e3:,.0f}"
    if kind == "%":
        return f"{value:.1%}"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return f"{value:,}"


def _latency_rows() -> list:
    return [(f"{title} p50 / p90 / p99, ms", lambda s, m=metric: " / ".join(
        _fmt(s[m][q], "ms") for q in ("p50", "p90", "p99")))
        for metric, title in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end"))]


def _side_by_side(report: dict, header: list[str], rows: list, columns: dict[str, dict], col: int,
                  notes=lambda name, run: []) -> str:
    """The header, one column per run (``rows``: label and cell function), each run's notes, events and
    errors, and the run's total time and the processes it left."""
    width = max(len(label) for label, _ in rows)
    lines = [*header, "",
             f"{'':<{width}}  " + "  ".join(f"{name:>{col}}" for name in columns),
             f"{'-' * width}  " + "  ".join("-" * col for _ in columns)]
    for label, cell in rows:
        lines.append(f"{label:<{width}}  " + "  ".join(f"{cell(run):>{col}}" for run in columns.values()))
    for name, run in columns.items():
        lines += notes(name, run)
        lines += [f"{name}: {event}" for event in run["events"]]
        lines += [f"{name}: error: {error}" for error in run["errors"]]
    lines.append(f"\ntotal {report['total_wall_s']} s (cluster up in {report['cluster']['startup_s']} s); "
                 f"cluster processes left after teardown: {report['cluster']['processes_left']}")
    return "\n".join(lines)


def format_router_report(report: dict) -> str:
    """The routers side by side (same arrivals): what each did to hits, latency and GPU time."""
    cfg = report["config"]
    runs = report["routers"]
    rows = [
        ("requests completed / failed / lost", lambda s: f"{s['completed']} / {s['failed']} / {s['lost']}"),
        ("answered twice", lambda s: _fmt(s["answered_twice"])),
        ("turns not sent", lambda s: _fmt(s["not_sent"])),
        ("prefix hit rate (cached / prompt tokens)", lambda s: _fmt(s["client_prefix_hit_rate"], "%")),
    ]
    rows += _latency_rows()
    rows += [
        ("throughput, output tokens/s (wall)", lambda s: _fmt(s["output_tokens_per_s"])),
        ("simulated GPU busy time, s (all replicas)", lambda s: _fmt(s.get("simulated_gpu_s"))),
        ("output tokens per GPU-second", lambda s: _fmt(s.get("sim_output_tokens_per_s"))),
        ("requests routed to each replica", lambda s: " / ".join(map(str, s["router"]["routed"]))),
        ("running requests, mean / max (all)", lambda s: f"{_fmt(s['mean_running'])} / {_fmt(s['max_running'])}"),
        ("preemptions", lambda s: _fmt(s["preemptions"])),
        ("retried elsewhere / replicas down / snapshots",
         lambda s: f"{s['router']['retries']} / {sum(s['router']['downs'])} / {sum(s['router']['snapshots'])}"),
        ("replicas ready at the end", lambda s: _fmt(s["router"]["ready_at_end"])),
        ("replicas' stages on nodes (0 = head)",
         lambda s: " | ".join(",".join(map(str, n)) for n in s["replica_nodes"])),
    ]
    first = next(iter(runs.values()))
    header = [
        (f"swakv loadtest: {cfg['model']} on {'CPU (real workers)' if cfg['real'] else 'simulated ' + cfg['gpu']}, "
         f"{cfg['data_parallel_size']} replicas x (TP={cfg['tensor_parallel_size']} PP={cfg['pipeline_parallel_size']}), "
         f"KV {first['engine']['kv_memory_bytes'] / (1 << 30):.3g} GiB per device, "
         f"{report['cluster']['nodes']} Ray nodes on this host"),
        f"workload: {cfg['trace'] or cfg['workload']}, {report['workload']['sessions']} sessions / "
        f"{report['workload']['requests']} requests, seed {cfg['seed']}, the same arrivals for every router"
        + ("" if cfg["real"] else f", workers sleep simulated time x {cfg['sleep_factor']:g}"),
    ]
    return _side_by_side(report, header, rows, runs, max(24, *(len(r) for r in runs)),
                         lambda r, s: [f"{r}: routing " + ", ".join(
                             f"{k} {v}" for k, v in sorted(s["router"]["reasons"].items()))])


def format_report(report: dict) -> str:
    if "routers" in report:
        return format_router_report(report)
    cfg = report["config"]
    layouts = list(report["layouts"])
    labels = {"window_aware": "window-aware", "sliding_as_full": "sliding-as-full"}
    rows = [
        ("requests completed / failed / lost", lambda s: f"{s['completed']} / {s['failed']} / {s['lost']}"),
        ("turns not sent (past duration)", lambda s: _fmt(s["not_sent"])),
        ("throughput, requests/s (wall)", lambda s: _fmt(s["requests_per_s"])),
        ("throughput, output tokens/s (wall)", lambda s: _fmt(s["output_tokens_per_s"])),
        ("simulated GPU busy time, s", lambda s: _fmt(s.get("simulated_gpu_s"))),
        ("throughput, output tokens/s (GPU time)", lambda s: _fmt(s.get("sim_output_tokens_per_s"))),
    ]
    rows += _latency_rows()
    rows += [
        ("running requests, mean / max", lambda s: f"{_fmt(s['mean_running'])} / {_fmt(s['max_running'])}"),
        ("waiting requests, max", lambda s: _fmt(s["max_waiting"])),
        ("KV usage, max", lambda s: _fmt(s["max_kv_usage"], "%")),
        ("preemptions", lambda s: _fmt(s["preemptions"])),
        ("prefix-cache hit rate", lambda s: _fmt(s["prefix_hit_rate"], "%")),
        ("worker restarts / recomputed requests",
         lambda s: f"{_fmt(s['worker_restarts'])} / {_fmt(s['recomputed_requests'])}"),
        ("KV pool units (units per block)",
         lambda s: f"{s['engine']['num_blocks']:,} ({' + '.join(map(str, s['engine']['group_widths'] or []))})"),
        ("pipeline stages on nodes (0 = head)", lambda s: ", ".join(map(str, s["engine"]["stage_nodes"]))),
    ]
    kv = next(iter(report["layouts"].values()))["engine"]["kv_memory_bytes"]
    header = [
        (f"swakv loadtest: {cfg['model']} on {'CPU (real workers)' if cfg['real'] else 'simulated ' + cfg['gpu']}, "
         f"TP={cfg['tensor_parallel_size']} PP={cfg['pipeline_parallel_size']}, "
         f"KV {kv / (1 << 30):.3g} GiB per device ({'given' if cfg['kv_memory'] else 'derived'}), "
         f"{report['cluster']['nodes']} Ray nodes on this host"),
        f"workload: {cfg['trace'] or cfg['workload']}, {report['workload']['sessions']} sessions / "
        f"{report['workload']['requests']} requests, seed {cfg['seed']}"
        + ("" if cfg["real"] else f", workers sleep simulated time x {cfg['sleep_factor']:g}"),
    ]
    return _side_by_side(report, header, rows, {labels[x]: report["layouts"][x] for x in layouts}, 20)


def write_router_plots(report: dict, out_dir: str) -> str:
    """The routers side by side: hit rate, TTFT, GPU efficiency, and how evenly each spread the load."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["routers"]
    names = list(runs)
    colors = [f"C{i}" for i in range(len(names))]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    ax.bar(names, [100 * (runs[n]["client_prefix_hit_rate"] or 0) for n in names], color=colors)
    ax.set_title("prefix hit rate (% of prompt tokens found cached)")
    ax = axes[0][1]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [runs[n]["ttft_s"]["p50"] or 0 for n in names], 0.4, label="p50", color="tab:blue")
    ax.bar([i + 0.2 for i in x], [runs[n]["ttft_s"]["p99"] or 0 for n in names], 0.4, label="p99", color="tab:red")
    ax.set_xticks(list(x), names)
    ax.set_title("time to first token (s, wall clock)")
    ax.legend()
    ax = axes[1][0]
    ax.bar(names, [runs[n].get("sim_output_tokens_per_s") or 0 for n in names], color=colors)
    ax.set_title("output tokens per GPU-second (simulated GPUs, all replicas)")
    ax = axes[1][1]
    for n, color in zip(names, colors):
        pts = [(p["t"], max(r["running"] + r["waiting"] for r in p["replicas"] if r)
                - min(r["running"] + r["waiting"] for r in p["replicas"] if r))
               for p in report["_runs"][n]["result"].timeline if p.get("replicas") and any(p["replicas"])]
        if pts:
            ax.plot(*zip(*pts), color=color, label=n)
    ax.set_title("load imbalance: longest - shortest replica queue")
    ax.set_xlabel("seconds since the load started")
    ax.legend()
    for row in axes:
        for a in row:
            a.grid(alpha=0.3)
    cfg = report["config"]
    fig.suptitle(f"swakv loadtest: {cfg['data_parallel_size']} replicas of {cfg['model']}, "
                 f"{cfg['trace'] or cfg['workload']}, same arrivals for every router")
    fig.tight_layout()
    path = os.path.join(out_dir, f"routers-{cfg['trace'] and 'trace' or cfg['workload']}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(report: dict, out_dir: str) -> list[str]:
    """PNG plots of KV usage, running and waiting requests over time, and latency percentiles (layouts), or
    the routers side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    if "routers" in report:
        path = write_router_plots(report, out_dir)
        with open(os.path.join(out_dir, "loadtest.json"), "w", encoding="utf-8") as f:
            json.dump(public_report(report), f, indent=2)
        return [path]
    runs = report["_runs"]
    colors = {"window_aware": "tab:blue", "sliding_as_full": "tab:red"}
    labels = {"window_aware": "window-aware", "sliding_as_full": "sliding-as-full"}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = ((axes[0][0], "kv_usage", "KV cache usage", 100.0), (axes[0][1], "running", "running requests", 1.0),
              (axes[1][0], "waiting", "waiting requests", 1.0))
    for ax, key, title, scale in panels:
        for layout, run in runs.items():
            pts = [(p["t"], p[key] * scale) for p in run["result"].timeline if key in p]
            if pts:
                ax.plot(*zip(*pts), color=colors[layout], label=labels[layout])
            for p in run["result"].timeline:
                if "event" in p:
                    ax.axvline(p["t"], color=colors[layout], linestyle=":", linewidth=1)
        ax.set_title(title + (" (%)" if scale == 100.0 else ""))
        ax.set_xlabel("seconds since the load started")
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[1][1]
    width = 0.8 / max(1, len(runs))
    names = ["TTFT p50", "TTFT p90", "TTFT p99", "E2E p50", "E2E p90", "E2E p99"]
    for i, (layout, run) in enumerate(runs.items()):
        s = run["summary"]
        values = [(s[m][q] or 0.0) for m in ("ttft_s", "e2e_s") for q in ("p50", "p90", "p99")]
        ax.bar([j + i * width for j in range(len(names))], values, width, color=colors[layout], label=labels[layout])
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(names))], names, rotation=30)
    ax.set_title("latency (s, wall clock)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    cfg = report["config"]
    fig.suptitle(f"swakv loadtest: {cfg['model']} ({'real' if cfg['real'] else 'simulated ' + cfg['gpu']}), "
                 f"{cfg['trace'] or cfg['workload']}, {report['cluster']['nodes']} Ray nodes")
    fig.tight_layout()
    path = os.path.join(out_dir, "loadtest.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    with open(os.path.join(out_dir, "loadtest.json"), "w", encoding="utf-8") as f:
        json.dump(public_report(report), f, indent=2)
    return [path]


def public_report(report: dict) -> dict:
    return {k: v for k, v in report.items() if not k.startswith("_")}


# -- the command ----------------------------------------------------------------------------------
def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value
    return parse


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


# A router comparison's workloads, unless overridden: enough sessions and arrivals to keep three replicas
# busy, and prefixes shared among sessions (a few apps' system prompts; a dozen documents), some more
# popular than others (Zipf-like, ``loadgen._popular``), as real traffic is.
ROUTER_WORKLOADS = {
    "chat": {"sessions": 48, "rate": 4.0, "system_prompts": 6, "popularity": 1.0},
    "qa": {"sessions": 80, "rate": 4.0, "documents": 12, "popularity": 1.0},
    "agent": {"sessions": 24, "rate": 2.0},
}


def config_from_args(args: argparse.Namespace) -> LoadTestConfig:
    knobs = {k: getattr(args, k) for k in _WORKLOAD_KNOBS if getattr(args, k, None) is not None}
    routers = ROUTERS if args.compare_routers else (args.router,) if args.router else \
        ("prefix",) if args.data_parallel_size > 1 else ()
    if args.workload == "agent" and (args.shared_prefixes is not None or args.popularity is not None):
        raise ValueError("--shared-prefixes, --popularity: agent sessions all share one system prompt")
    if args.shared_prefixes is not None:
        knobs["system_prompts" if args.workload == "chat" else "documents"] = args.shared_prefixes
    if routers and not args.trace:
        knobs = {**ROUTER_WORKLOADS.get(args.workload, {}), **knobs}
    layouts = {"both": LAYOUTS, "window-aware": ("window_aware",), "sliding-as-full": ("sliding_as_full",)}
    layout = args.layouts or ("window-aware" if routers else "both")
    pp = args.pipeline_parallel_size or (1 if args.real or routers else LoadTestConfig.pipeline_parallel_size)
    if args.kv_memory is None:   # not given: the default budget (simulated) or the CPU workers' default (real)
        kv_memory = None if args.real else LoadTestConfig.kv_memory
    else:
        kv_memory = None if args.kv_memory == "auto" else args.kv_memory
    cfg = LoadTestConfig(
        model=args.model or ("default" if args.real else LoadTestConfig.model), gpu=args.gpu, real=args.real, nodes=args.nodes, cpus_per_node=args.cpus_per_node,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=pp,
        kv_memory=kv_memory, block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
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


def _run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args).check()
        cfg.sessions()   # a bad workload knob or trace line fails here, before any Ray process starts
        with _stdout_to_stderr():
            report = run_loadtest(cfg)
    except (ValueError, TypeError) as exc:
        print(f"swakv loadtest: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:   # the cluster could not do its part; it has been torn down
        print(f"swakv loadtest: failed: {exc}", file=sys.stderr)
        return 1
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
    from .planner import _size_arg
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
    g.add_argument("--nodes", type=_positive(int), default=d.nodes, help="Ray nodes incl. the head (default 3)")
    g.add_argument("--cpus-per-node", type=_positive(int), default=d.cpus_per_node)
    g.add_argument("--tensor-parallel-size", "-tp", type=_positive(int), default=d.tensor_parallel_size)
    g.add_argument("--pipeline-parallel-size", "-pp", type=_positive(int), default=None,
                   help=f"pipeline stages, spread over the worker nodes (default {d.pipeline_parallel_size}; 1 with --real)")
    g.add_argument("--kv-memory", type=lambda t: "auto" if t == "auto" else _size_arg(t), default=None,
                   help="KV-cache memory per device (default 6GiB, so a load this machine can drive fills it; "
                        "with --real, 256MiB); 'auto': what the GPU leaves, as swakv plan derives it")
    g.add_argument("--block-size", type=_positive(int), default=d.block_size)
    g.add_argument("--max-num-batched-tokens", type=_positive(int), default=d.max_num_batched_tokens)
    g.add_argument("--sleep-factor", type=_non_negative, default=d.sleep_factor,
                   help="workers sleep the simulated step time x this (default 1: real time; 0: as fast as "
                        "the CPU goes, GPU time reported apart)")
    g.add_argument("--layouts", choices=("both", "window-aware", "sliding-as-full"), default=None,
                   help="KV layouts to compare (default both; with routers, window-aware)")
    g.add_argument("--data-parallel-size", "-dp", type=_positive(int), default=d.data_parallel_size,
                   help="engine replicas behind the app (default 1); more than 1 compares routers")
    g.add_argument("--router", choices=ROUTERS, default=None,
                   help="route with this one (default prefix when --data-parallel-size > 1)")
    g.add_argument("--compare-routers", action="store_true",
                   help=f"run every router ({', '.join(ROUTERS)}) on the same arrivals and plot them side by side")
    g.add_argument("--port", type=_positive(int), default=None, help="HTTP port on 127.0.0.1 (default: a free one)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=tuple(WORKLOADS), default=d.workload,
                   help="chat: multi-turn, shared history; agent: loops over one long shared system prompt; "
                        "qa: long documents, short answers")
    w.add_argument("--trace", default=None, help="a JSONL trace instead (arrival_s, prompt or prompt_token_ids, "
                                                 "max_tokens per line)")
    w.add_argument("--rate", type=_positive(float), default=None, help="session arrivals per second (Poisson)")
    w.add_argument("--sessions", type=_positive(int), default=None)
    w.add_argument("--turns", type=_positive(int), default=None, help="requests per session")
    w.add_argument("--system-tokens", type=_positive(int), default=None,
                   help="system prompt (chat, agent) or document (qa) length")
    w.add_argument("--user-tokens", type=_positive(int), default=None, help="new user text per turn")
    w.add_argument("--max-tokens", type=_positive(int), default=None, help="answer length")
    w.add_argument("--think-s", type=_non_negative, default=None, help="mean pause between a session's turns")
    w.add_argument("--popularity", type=_non_negative, default=None,
                   help="skew of the shared prefixes' popularity: prefix k drawn with weight 1/(k+1)^s (default 0, "
                        "uniform; 1 when comparing routers)")
    w.add_argument("--shared-prefixes", type=_positive(int), default=None,
                   help="distinct system prompts the chat sessions draw from (default: one each; 6 when comparing "
                        "routers), or documents the qa sessions ask about (default 4; 12 when comparing routers)")
    w.add_argument("--seed", type=int, default=d.seed)
    r = p.add_argument_group("run")
    r.add_argument("--duration", type=_positive(float), default=d.duration_s, help="seconds of arrivals per layout")
    r.add_argument("--drain", type=_non_negative, default=d.drain_s, help="seconds to let requests in flight finish")
    r.add_argument("--kill-worker-at", type=_non_negative, default=None, help="kill stage 0's worker actor then")
    r.add_argument("--kill-node-at", type=_non_negative, default=None, help="kill the node holding stage 0 then")
    r.add_argument("--kill-replica-at", type=_non_negative, default=None,
                   help="kill replica 0's engine actor then (Ray restarts it); needs --data-parallel-size >= 2")
    r.add_argument("--out", default=d.out_dir, help="folder for loadtest.png and loadtest.json (default loadtest-out)")
    r.add_argument("--json", action="store_true", help="print one JSON object (top level: completed, failed, lost, ...)")
    r.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run)
    return p
