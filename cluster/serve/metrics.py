"""``/metrics``: the engines' stats and the router's counters in Prometheus' text format."""
from __future__ import annotations

from cluster.routing.replicas import ReplicaSet


# name, stats key, type, help
_METRICS = (
    ("swakv_requests_running", "running", "gauge", "Requests being computed."),
    ("swakv_requests_waiting", "waiting", "gauge", "Requests queued or preempted."),
    ("swakv_kv_cache_usage_ratio", "kv_usage", "gauge", "Fraction of KV blocks in use."),
    ("swakv_prefix_cache_hit_rate", "prefix_hit_rate", "gauge", "Prefix-cache hit tokens over queried tokens."),
    ("swakv_prefix_cache_queried_tokens_total", "prefix_queried_tokens", "counter", "Prompt tokens looked up."),
    ("swakv_prefix_cache_hit_tokens_total", "prefix_hit_tokens", "counter", "Prompt tokens found cached."),
    ("swakv_preemptions_total", "preemptions", "counter", "Requests preempted for lack of KV blocks."),
    ("swakv_steps_total", "steps", "counter", "Engine steps run."),
    ("swakv_scheduled_tokens_total", "scheduled_tokens", "counter", "Tokens computed by engine steps."),
    ("swakv_step_time_seconds_mean", "mean_step_time_s", "gauge", "Mean wall time of an engine step."),
    ("swakv_step_time_seconds_last", "last_step_time_s", "gauge", "Wall time of the last engine step."),
    ("swakv_step_work_seconds_total", "host_time_s", "counter",
     "Engine-core wall time in steps not spent waiting for the workers (scheduling, applying results)."),
    ("swakv_step_wait_seconds_total", "wait_time_s", "counter",
     "Engine-core wall time in steps spent waiting for the workers (their step, and the hand-offs)."),
    ("swakv_delta_bytes_total", "delta_bytes", "counter", "Encoded block-table delta bytes sent to workers."),
    ("swakv_worker_restarts_total", "worker_restarts", "counter", "Worker-group restarts after a failure."),
    ("swakv_recomputed_requests_total", "recomputed_requests", "counter", "Requests recomputed after a restart."),
    ("swakv_joined_requests_total", "joined_requests", "counter",
     "Requests whose first chunk joined a step already sent to the workers (late joiners)."),
    ("swakv_kv_host_blocks", "kv_host_blocks", "gauge", "Host KV tier size in host units (0: no host tier)."),
    ("swakv_kv_host_blocks_stored_total", "kv_host_blocks_stored", "counter",
     "KV blocks copied from device to the host tier (copies reported done)."),
    ("swakv_kv_host_blocks_loaded_total", "kv_host_blocks_loaded", "counter",
     "KV blocks copied from the host tier back to device (copies reported done)."),
    ("swakv_kv_host_bytes_stored_total", "kv_host_bytes_stored", "counter",
     "Bytes copied from device to the host tier, all workers together."),
    ("swakv_kv_host_bytes_loaded_total", "kv_host_bytes_loaded", "counter",
     "Bytes copied from the host tier to device, all workers together."),
    ("swakv_kv_host_hit_requests_total", "kv_host_hit_requests", "counter",
     "Requests admitted with a prefix hit that loads blocks from the host tier."),
    ("swakv_kv_host_hit_tokens_total", "kv_host_hit_tokens", "counter",
     "Prefix-hit tokens of the requests whose hit loads blocks from the host tier."),
    ("swakv_kv_host_load_failures_total", "kv_host_load_failures", "counter",
     "Requests whose loads from the host tier failed (host memory lost); they recompute."),
    ("swakv_kv_host_loads_preempted_total", "kv_host_loads_preempted", "counter",
     "Requests preempted while their loads from the host tier were in flight (the pool ran short); they "
     "recompute, through the prefix cache."),
    ("swakv_stream_records_total", "stream_records", "counter",
     "Records sent to HTTP frontends' subscriptions (one message each, a shared-memory ring's on the engine's "
     "host, else Ray's; one per step per frontend at most, plus one per burst of adds through a ring)."),
    ("swakv_add_calls_total", "add_calls", "counter",
     "Bursts of adds from HTTP frontends (one message each, through a ring on the engine's host, else a Ray "
     "call; a burst of requests shares one)."),
)


def prometheus_text(per_replica: dict[int, dict | None], replicas: ReplicaSet | None = None) -> str:
    """The engines' stats in the Prometheus text exposition format (version 0.0.4), every series labelled
    with its replica (``per_replica``: rank -> stats, None when it did not answer), then the router's."""
    lines = []

    def family(name, kind, help_, samples):
        lines.extend((f"# HELP {name} {help_}", f"# TYPE {name} {kind}"))
        lines.extend(f"{name}{labels} {float(value)!r}" for labels, value in samples)

    up = sorted(per_replica.items())
    family("swakv_replica_up", "gauge", "1 while the engine replica answers.",
           [(f'{{replica="{r}"}}', st is not None) for r, st in up])
    live = [(r, st) for r, st in up if st is not None]
    for name, key, kind, help_ in _METRICS:
        samples = [(f'{{replica="{r}"}}', st[key]) for r, st in live if key in st]
        if samples:
            family(name, kind, help_, samples)
    latency = [(r, st) for r, st in live if "kv_host_load_latency_s_sum" in st]
    if latency:
        name = "swakv_kv_host_load_latency_seconds"
        lines.extend((f"# HELP {name} Per request loading from the host tier: from the scheduling of the step "
                      "carrying its loads to their report.", f"# TYPE {name} summary"))
        for r, st in latency:
            lines.append(f'{name}_sum{{replica="{r}"}} {float(st["kv_host_load_latency_s_sum"])!r}')
            lines.append(f'{name}_count{{replica="{r}"}} {float(st["kv_host_loads_completed"])!r}')
    family("swakv_kv_cache_group_usage_ratio", "gauge", "Fraction of KV blocks held by each KV-cache group.",
           [(f'{{replica="{r}",group="{g}"}}', u) for r, st in live
            for g, u in enumerate(st.get("kv_usage_per_group", []))])
    family("swakv_requests_finished_total", "counter", "Finished requests by reason.",
           [(f'{{replica="{r}",reason="{reason}"}}', n) for r, st in live
            for reason, n in sorted(st.get("finished", {}).items())])
    if replicas is not None:
        rank = {x.name: x.rank for x in replicas.replicas}
        family("swakv_router_requests_total", "counter", f"Requests routed by this app ({replicas.router.name} "
               "router), by replica and reason (best-hit, overloaded, kv-full, least-loaded, round-robin, "
               "sibling, ...).",
               [(f'{{replica="{rank[name]}",reason="{reason}"}}', n)
                for (name, reason), n in sorted(replicas.routed.items())])
        family("swakv_router_expected_hit_tokens_total", "counter",
               "Prompt tokens the prefix router expected the replicas it chose to find cached.",
               [("", replicas.expected_hit_tokens)])
        family("swakv_router_hit_shortfall_tokens_total", "counter",
               "Prompt tokens the router expected a replica to find cached that it did not (evicted meanwhile).",
               [("", replicas.shortfall_tokens)])
        family("swakv_router_retries_total", "counter",
               "Requests moved to another replica before their first token (the first was gone or refused).",
               [("", replicas.retries)])
        family("swakv_router_replica_down_total", "counter", "Times a replica was found gone or not answering.",
               [(f'{{replica="{x.rank}"}}', replicas.downs[x.name]) for x in replicas.replicas])
        family("swakv_router_index_hashes", "gauge",
               "Block hashes the router knows a replica caches, per KV-cache group (from its KV events).",
               [(f'{{replica="{x.rank}",group="{g}"}}', len(h)) for x in replicas.replicas
                for g, h in enumerate(x.index.groups)])
        family("swakv_router_kv_event_batches_total", "counter", "KV-event batches applied, per replica.",
               [(f'{{replica="{x.rank}"}}', x.index.batches) for x in replicas.replicas])
        family("swakv_router_kv_snapshots_total", "counter",
               "KV-cache snapshots loaded, per replica (at start, after a gap, after a restart).",
               [(f'{{replica="{x.rank}"}}', x.index.snapshots) for x in replicas.replicas])
    return "\n".join(lines) + "\n"

