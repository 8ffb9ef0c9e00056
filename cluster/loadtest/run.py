"""One load-test run per KV layout (or per router, on the same arrivals), and the whole test."""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

from cluster.engine.build import build_engine
from cluster.ray.launch import engine_names
from cluster.ray.ports import free_port

from .actions import (deploy_app, kill_node_action, kill_replica_action, kill_worker_action, stage_nodes,
                      start_engines, stop_engines, wait_healthy, warm_up)
from .client import run_load, summarize
from .config import LoadTestConfig
from .local_cluster import LocalCluster


def preflight(cfg: LoadTestConfig) -> None:
    """Build each layout's engine here, without Ray (simulated workers cost nothing): a model, GPU or
    parallel size that cannot work fails now with the engine's own message, before any Ray process starts."""
    if not cfg.real:
        for layout in cfg.layouts:
            build_engine(cfg.engine_args(layout))


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


def rejoin(url: str, replicas: int, stats: ReplicaStats, routers, timeout_s: float) -> bool:
    """Until every replica is ready behind ``/health`` and, with a router, the router has loaded a snapshot
    of each restarted engine (one more than its restarts: the first at the start): a router keeps a
    restarting replica's old state until a call to it fails or answers from the new engine, which may come
    after the load has ended. False if that did not happen within ``timeout_s`` (the report shows it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            wait_healthy(url, timeout_s=max(1.0, deadline - time.monotonic()), ready=replicas)
        except RuntimeError:
            return False
        asyncio.run(stats.poll())   # every engine answers now: a restart seen only after the load is counted
        if not routers or all(n >= 1 + r for n, r in zip(router_view(url, replicas)["snapshots"], stats.restarts)):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)


def run_one(cluster: LocalCluster, cfg: LoadTestConfig, layout: str, router: str, sessions, url_holder: dict) -> dict:
    """Start the engine replicas for ``layout``, (re)deploy the app with ``router``, run the workload through
    Serve, stop the engines; the summary."""
    cluster.restore()
    dp = cfg.data_parallel_size
    started = start_engines(cfg.engine_args(layout), dp)
    handles, info = [h for h, _ in started], started[0][1]
    label = router if cfg.routers else layout
    try:
        placement = [stage_nodes(cluster, h, cfg.pipeline_parallel_size) for h in handles]
        if url_holder.get("app") != (router, dp):     # the app names its engines and its router
            url_holder["port"] = url_holder.get("port") or cfg.port or free_port()
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
        if cfg.kill_replica_at is not None:   # the restarted replica rejoins (bounded), so the report shows
            rejoin(url, dp, stats, cfg.routers, timeout_s=120.0)   # recovery, not timing
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
