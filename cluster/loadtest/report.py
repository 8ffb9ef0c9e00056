"""A load test's report: the runs side by side as a table, and plots (PNG) with the JSON beside them."""
from __future__ import annotations

import json
import os


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


def layout_labels(cfg: dict) -> dict[str, str]:
    return {"window_aware": "window-aware", "sliding_as_full": "sliding-as-full",
            "host_tier": f"+ host tier {(cfg.get('kv_host_memory') or 0) / (1 << 30):.3g} GiB"}


def format_report(report: dict) -> str:
    if "routers" in report:
        return format_router_report(report)
    cfg = report["config"]
    layouts = list(report["layouts"])
    labels = layout_labels(report["config"])
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
    colors = {"window_aware": "tab:blue", "sliding_as_full": "tab:red", "host_tier": "tab:green"}
    labels = layout_labels(report["config"])
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
