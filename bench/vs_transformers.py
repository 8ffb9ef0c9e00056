"""swakv against `transformers serve` on the bundled model, the same client run the same way against both.

Issue 19's side-by-side goal: at a constant 8 req/s swakv's TTFT p50 and ITL p50 no worse than
transformers'; at an unlimited rate its throughput no lower; three runs of each within 15%.

Each round starts one server at a time (its own process group, on a free port, under the shared heavy-job
lock so no other session's benchmark overlaps it), waits until ``/v1/models`` answers and a chat
completion streams back (the warm-up: a few requests before anything is measured), runs guidellm once per
mode, then stops the server with SIGINT to its group and SIGKILL after a grace period. The rounds
alternate which server goes first. Modes: one request at a time (``synchronous``), a constant rate
(``constant``, 8 req/s, 100 requests), and an unlimited rate (``throughput``: 500 requests, 100 in
flight at a time, so the run lasts several seconds and guidellm's own ramp, 0.2-0.5 s to send the first
100, is a small part of it). Both servers get the same requests in a mode: chat completions, streamed,
synthetic prompts of 128 tokens from guidellm's seed for that mode (each mode its own, so that no run
finds another's prompts in swakv's prefix cache), ``max_completion_tokens`` 32, temperature 0. guidellm
would also send ``ignore_eos`` and ``stop: null`` when the data fixes the output length, and
``transformers serve`` refuses unknown fields with a 422, so the output cap goes in the backend's
``max_tokens`` instead: both servers then stop at 32 tokens or at EOS (greedy on the same
weights, the outputs are the same; the table's ``out tok`` column shows what came back).

Figures per run, from guidellm's JSON: TTFT p50 and ITL p50 (guidellm's medians over the requests),
req/s and output tok/s (successful requests and their output tokens over guidellm's measured
duration, the first request's start to the last one's end), the 1-minute load average before and
after, and the steal time over the run (/proc/stat: the share of CPU time the hypervisor gave to other
guests, on a shared VM). Then the swakv / transformers ratio of the medians over the runs, each server's spread over its
runs (max / min - 1), each round's own ratio (its two servers run minutes apart, so the machine's drift
between rounds stays out of it), and whether each goal is met (on the medians). One JSON line per run
(``--jsonl``).

    PYTHONPATH=. python bench/vs_transformers.py [--swakv-cmd "python -m cluster serve --port {port}"]
        [--runs 3] [--requests 100] [--rate 8] [--jsonl bench/results/x.jsonl]
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.ray.ports import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "models", "swakv-tiny-hybrid")
TF_PYTHON = "/tmp/tf-serve-venv/bin/python"
# `transformers serve` as its console script runs it, from a venv whose entry points live elsewhere.
TF_CMD = (TF_PYTHON + " -c \"import sys; sys.argv[0] = 'transformers'; "
          "from transformers.cli.transformers import main; sys.exit(main())\" "
          "serve --continuous-batching --device cpu --host 127.0.0.1 --port {port} {model}")
SWAKV_CMD = sys.executable + " -m cluster serve --host 127.0.0.1 --port {port}"
GUIDELLM = "/tmp/guidellm-venv-c2/bin/guidellm"
MODES = {"sync": {"kind": "synchronous"}, "rate": {"kind": "constant"}, "max": {"kind": "throughput"}}
# guidellm's synthetic prompts follow its seed: one seed per mode, so that no mode's run finds another's
# prompts in swakv's prefix cache (the same seed for both servers, so both get the same requests)
MODE_SEEDS = {"rate": 1, "max": 2, "sync": 3}
SPREAD_GOAL = 0.15
RATE_TOLERANCE = 0.10    # a rate run whose achieved req/s is further off than this did not run at the rate


def log(msg: str) -> None:
    print(f"[vs-tf {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def stream_chat(url: str, model: str, timeout: float) -> int:
    """One streamed chat completion; returns the number of content events (raises on any failure)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What does os.path.join do?"}],
                       "max_tokens": 8, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json"})
    events = 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                delta = json.loads(line[6:])["choices"]
                events += bool(delta and delta[0].get("delta", {}).get("content"))
    return events


class Server:
    """One server process group: started on a free port, ready once it streams a chat answer, always stopped."""

    def __init__(self, name: str, cmd: str, log_path: str, start_timeout: float, stop_grace: float):
        self.name, self.port = name, free_port()
        self.cmd = cmd.format(port=self.port, model=MODEL_DIR, python=sys.executable)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path, self.start_timeout, self.stop_grace = log_path, start_timeout, stop_grace
        self.proc: subprocess.Popen | None = None
        self.model = ""

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        log(f"{self.name}: {self.cmd}")
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(self.cmd, shell=True, cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready; "
                                   f"its log: {self.log_path}")
            if time.monotonic() - t0 > self.start_timeout:
                raise RuntimeError(f"{self.name} not ready after {self.start_timeout:.0f} s; log: {self.log_path}")
            try:
                self.model = self.model or get_json(self.url + "/v1/models")["data"][0]["id"]
                if stream_chat(self.url, self.model, timeout=60) > 0:
                    break
            except Exception:
                pass
            time.sleep(1)
        for _ in range(3):   # warm-up beyond the first answer
            stream_chat(self.url, self.model, timeout=60)
        log(f"{self.name}: ready in {time.monotonic() - t0:.1f} s on {self.url}, model {self.model!r}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None and not self._group_alive():
            return
        pgid = self.proc.pid
        self._signal(pgid, signal.SIGINT)
        deadline = time.monotonic() + self.stop_grace
        while time.monotonic() < deadline and self._group_alive():
            time.sleep(0.2)
        if self._group_alive():
            log(f"{self.name}: still running {self.stop_grace:.0f} s after SIGINT: SIGKILL to its group")
            self._signal(pgid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        if self.proc.poll() is None:
            return True
        # Only zombies of the group left? They count as gone.
        out = subprocess.run(["ps", "-o", "stat=", "-g", str(self.proc.pid)], capture_output=True, text=True)
        return any(not s.startswith("Z") for s in out.stdout.split())

    @staticmethod
    def _signal(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass


@dataclass
class Run:
    server: str
    mode: str
    run: int
    ttft_p50_ms: float
    itl_p50_ms: float
    req_s: float
    out_tok_s: float
    ok: int
    errored: int
    out_tokens_mean: float
    load_before: float
    load_after: float
    wall_s: float
    steal: float = float("nan")     # share of the CPU time the hypervisor gave to others during the run


def cpu_times() -> list[int]:
    """The machine's CPU time counters (/proc/stat's first line: user .. steal)."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def steal_share(before: list[int], after: list[int]) -> float:
    delta = [b - a for a, b in zip(before, after)]
    return delta[7] / sum(delta) if sum(delta) else float("nan")


def mode_requests(args, mode: str) -> int:
    """How many requests a run of ``mode`` sends."""
    return {"sync": args.sync_requests, "rate": args.requests, "max": args.max_requests}[mode]


def guidellm(args, server: Server, mode: str, run: int, workdir: str) -> Run:
    backend = {"kind": "openai_http", "target": server.url, "model": server.model,
               "request_format": "/v1/chat/completions", "max_tokens": args.output_tokens,
               "extras": {"body": {"temperature": 0}}}
    profile = dict(MODES[mode], **({"kind": args.arrivals, "rate": args.rate} if mode == "rate" else {}),
                   **({"max_concurrency": args.requests} if mode == "max" else {}))
    out = os.path.join(workdir, f"{server.name}-{mode}-{run}.json")
    cmd = [args.guidellm, "run", "--backend", json.dumps(backend), "--profile", json.dumps(profile),
           "--constraint", f"kind=max_requests,count={mode_requests(args, mode)}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens}",
           "--seed", f"kind=static,value={MODE_SEEDS[mode]}",
           "--tokenizer", f"kind=huggingface_auto,model={MODEL_DIR}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               GUIDELLM__MAX_WORKER_PROCESSES=str(args.client_processes))
    load_before, t0, cpu0 = os.getloadavg()[0], time.monotonic(), cpu_times()
    with open(out[:-5] + ".log", "w") as logf:
        rc = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=args.client_timeout).returncode
    wall, load_after, steal = time.monotonic() - t0, os.getloadavg()[0], steal_share(cpu0, cpu_times())
    if rc != 0:
        raise RuntimeError(f"guidellm exited {rc} against {server.name} ({mode}); log: {out[:-5]}.log")
    bench = json.load(open(out))["benchmarks"][0]
    m, totals = bench["metrics"], bench["metrics"]["request_totals"]
    done = bench["requests"]["successful"]
    out_tokens = [r["output_metrics"]["text_tokens"] or 0 for r in done]
    duration = bench["duration"]
    return Run(server.name, mode, run,
               ttft_p50_ms=m["time_to_first_token_ms"]["successful"]["median"],
               itl_p50_ms=m["inter_token_latency_ms"]["successful"]["median"],
               req_s=len(done) / duration, out_tok_s=sum(out_tokens) / duration,
               ok=totals["successful"], errored=totals["errored"] + totals["incomplete"],
               out_tokens_mean=statistics.fmean(out_tokens) if out_tokens else 0.0,
               load_before=load_before, load_after=load_after, wall_s=wall, steal=steal)


class HeavyLock:
    """The shared lock other sessions take around anything heavy: one server + client session at a time."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        self.fd = open(self.path, "a")
        t0 = time.monotonic()
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        waited = time.monotonic() - t0
        if waited > 1:
            log(f"waited {waited:.0f} s for {self.path}")

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.fd.close()


def session(args, name: str, cmd: str, run: int, workdir: str, emit) -> None:
    with HeavyLock(args.lock):
        server = Server(name, cmd, os.path.join(workdir, f"{name}-server-{run}.log"), args.start_timeout,
                        args.stop_grace)
        try:
            try:
                server.start()
            except RuntimeError:
                # The free port can be taken before the server binds it (Ray's own processes start on
                # random ports): once, on another.
                if "Address already in use" not in open(server.log_path).read():
                    raise
                server.stop()
                log(f"{name}: port {server.port} was taken before the server bound it; again on another")
                server = Server(name, cmd, server.log_path[:-4] + "-retry.log", args.start_timeout, args.stop_grace)
                server.start()
            for mode in args.modes:
                try:
                    r = guidellm(args, server, mode, run, workdir)
                except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
                    log(f"{name} {mode} run {run}: no result: {e}")   # the other cells still run
                    args.failures.append(f"{name} {mode} run {run}: {e}")
                    continue
                log(f"{name} {mode} run {run}: TTFT p50 {r.ttft_p50_ms:.1f} ms, ITL p50 {r.itl_p50_ms:.2f} ms, "
                    f"{r.req_s:.2f} req/s, {r.out_tok_s:.0f} tok/s, {r.ok} ok / {r.errored} failed, "
                    f"load {r.load_before:.2f}->{r.load_after:.2f}")
                emit(r)
        finally:
            server.stop()


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def pct(x: float) -> str:
    return "n/a" if x != x else f"{x:.0%}"


def report(runs: list[Run], args) -> list[str]:
    lines = [f"{'server':<13}{'mode':<6}{'run':>4}{'TTFT p50 ms':>13}{'ITL p50 ms':>12}{'req/s':>8}"
             f"{'out tok/s':>11}{'ok':>5}{'fail':>6}{'out tok':>9}{'load 1m':>13}{'steal':>7}"]
    for r in runs:
        lines.append(f"{r.server:<13}{r.mode:<6}{r.run:>4}{r.ttft_p50_ms:>13.1f}{r.itl_p50_ms:>12.2f}{r.req_s:>8.2f}"
                     f"{r.out_tok_s:>11.1f}{r.ok:>5}{r.errored:>6}{r.out_tokens_mean:>9.1f}"
                     f"{r.load_before:>7.2f}->{r.load_after:<5.2f}{pct(r.steal):>7}")
    metrics = ("ttft_p50_ms", "itl_p50_ms", "req_s", "out_tok_s")
    cell = {}
    for r in runs:
        cell.setdefault((r.server, r.mode), []).append(r)
    lines += ["", "medians over the runs; ratio = swakv / transformers; spread = max / min - 1 over the runs",
              f"{'mode':<6}{'metric':<13}{'swakv':>10}{'transformers':>14}{'ratio':>8}{'swakv spread':>14}"
              f"{'tf spread':>11}"]
    med, spread = {}, {}
    for mode in args.modes:
        for metric in metrics:
            for srv in ("swakv", "transformers"):
                xs = [getattr(r, metric) for r in cell.get((srv, mode), [])]
                med[srv, mode, metric] = median(xs)
                spread[srv, mode, metric] = (max(xs) / min(xs) - 1) if len(xs) > 1 and min(xs) > 0 else float("nan")
            s, t = med["swakv", mode, metric], med["transformers", mode, metric]
            lines.append(f"{mode:<6}{metric:<13}{s:>10.2f}{t:>14.2f}{s / t if t else float('nan'):>8.2f}"
                         f"{pct(spread['swakv', mode, metric]):>14}{pct(spread['transformers', mode, metric]):>11}")
    # Each round's own ratio: its two servers run minutes apart, closer in time than the rounds are
    rounds = sorted({r.run for r in runs})
    lines += ["", "per round, swakv / transformers (the same round's runs, minutes apart: less of the machine's "
              "drift than the medians carry)", f"{'mode':<6}{'metric':<13}" + "".join(f"{'round ' + str(k):>10}"
                                                                                        for k in rounds)]
    by_round = {(r.server, r.mode, r.run): r for r in runs}
    for mode in args.modes:
        for metric in ("ttft_p50_ms", "itl_p50_ms"):
            row = f"{mode:<6}{metric:<13}"
            for k in rounds:
                s, t = by_round.get(("swakv", mode, k)), by_round.get(("transformers", mode, k))
                ok = s is not None and t is not None and getattr(t, metric) > 0
                row += f"{getattr(s, metric) / getattr(t, metric):>10.2f}" if ok else f"{'-':>10}"
            lines.append(row)
    goals = []
    if "rate" in args.modes:
        for metric, label in (("ttft_p50_ms", "TTFT p50"), ("itl_p50_ms", "ITL p50")):
            s, t = med["swakv", "rate", metric], med["transformers", "rate", metric]
            goals.append((f"{label} at {args.rate:g} req/s no worse than transformers' ({s:.1f} vs {t:.1f} ms)",
                          s <= t))
    if "max" in args.modes:
        s, t = med["swakv", "max", "out_tok_s"], med["transformers", "max", "out_tok_s"]
        goals.append((f"throughput at an unlimited rate >= transformers' ({s:.1f} vs {t:.1f} output tok/s)", s >= t))
    goal_cells = [("rate", "ttft_p50_ms"), ("rate", "itl_p50_ms"), ("max", "out_tok_s")]
    cells = [(m, x) for m, x in goal_cells if m in args.modes]
    worst = max((spread["swakv", m, x] for m, x in cells), default=float("nan"))
    n = min((len(cell.get(("swakv", m), [])) for m, _ in cells), default=0)
    goals.append((f"swakv's runs within {SPREAD_GOAL:.0%} on those figures (worst spread {pct(worst)} over "
                  f"{n} run(s) a cell)", worst <= SPREAD_GOAL if n >= 2 else None))
    mark = {True: "met", False: "NOT met", None: "n/a: fewer than 2 runs"}
    lines += ["", "goals:"] + [f"  [{mark[ok]}] {text}" for text, ok in goals]
    lines += [f"  no result: {f}" for f in args.failures]
    failed = sum(r.errored for r in runs)
    if failed:
        lines.append(f"  note: {failed} request(s) failed or were cut short across the runs")
    # guidellm sends what is overdue at once when its processes start late (a busy 2-core machine): such a
    # run measured a burst, not the rate asked for
    off = [r for r in runs if r.mode == "rate" and abs(r.req_s / args.rate - 1) > RATE_TOLERANCE]
    for r in off:
        lines.append(f"  note: {r.server} rate run {r.run} ran at {r.req_s:.2f} req/s, not {args.rate:g}: the client "
                     f"did not hold the rate (a burst at its start), and the run's figures are not the rate's")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--swakv-cmd", default=SWAKV_CMD,
                   help="swakv's server command; {port}, {model} and {python} are filled in")
    p.add_argument("--tf-cmd", default=TF_CMD, help="transformers serve's command (its own venv)")
    p.add_argument("--guidellm", default=GUIDELLM, help="guidellm executable (its own venv)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--first-run", type=int, default=1,
                   help="number of the first run (to add the later runs of an interrupted series to its --jsonl)")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--max-requests", type=int, default=1500,
                   help="requests of the unlimited-rate mode, --requests of them in flight at a time: with "
                        "100 in all, swakv's run lasted 1.1-1.5 s, of which guidellm took 0.2-0.5 s to send the "
                        "first 100, so the figure measured the client's ramp more than the server; with 500, "
                        "about 10 s, swakv's runs moved 8-21%% between fresh servers, from the ramp and drain "
                        "and from stretches of faster steps inside a run (the client shares the 2 cores), and "
                        "a longer run averages over them")
    p.add_argument("--sync-requests", type=int, default=20,
                   help="requests of the one-at-a-time mode (a reference figure, not a goal: it is the slowest)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--rate", type=float, default=8.0, help="req/s of the rate mode")
    p.add_argument("--arrivals", choices=["constant", "poisson"], default="constant",
                   help="the rate mode's arrival process")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["sync", "rate", "max"])
    p.add_argument("--servers", nargs="+", choices=["swakv", "transformers"], default=["swakv", "transformers"])
    p.add_argument("--client-processes", type=int, default=2,
                   help="guidellm worker processes (its default, 10, is five per core on a 2-core machine)")
    p.add_argument("--lock", default="/tmp/swakv-heavy.lock")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--stop-grace", type=float, default=30)
    p.add_argument("--client-timeout", type=float, default=900)
    p.add_argument("--workdir", default=None, help="guidellm's JSON and logs, the servers' logs (default: a temp dir)")
    p.add_argument("--jsonl", default=None, help="append one JSON line per run to this file")
    p.add_argument("--report", metavar="JSONL", default=None,
                   help="run nothing: print the table and goals of the runs recorded in this file")
    args = p.parse_args()
    args.failures = []
    if args.report:
        fields = set(Run.__dataclass_fields__)
        runs = [Run(**{k: v for k, v in json.loads(line).items() if k in fields}) for line in open(args.report)]
        args.modes = [m for m in MODES if any(r.mode == m for r in runs)]
        args.runs = max(r.run for r in runs)
        print("\n".join(report(runs, args)))
        return
    for exe in (args.guidellm, TF_PYTHON if args.tf_cmd == TF_CMD else None):
        if exe and not os.access(exe, os.X_OK):
            p.error(f"{exe} not found: see docs/performance.md (side by side with transformers serve) to set it up")
    if args.runs < args.first_run or args.first_run < 1 or args.requests < 1 or args.sync_requests < 1 or args.rate <= 0 \
            or args.max_requests < args.requests:
        p.error("need 1 <= --first-run <= --runs, --requests and --sync-requests >= 1, --rate > 0, "
                "--max-requests >= --requests")
    workdir = args.workdir or tempfile.mkdtemp(prefix="vs-tf-")
    os.makedirs(workdir, exist_ok=True)
    log(f"logs and guidellm reports in {workdir}")
    cmds = {"swakv": args.swakv_cmd, "transformers": args.tf_cmd}
    runs: list[Run] = []

    def emit(r: Run) -> None:
        runs.append(r)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(dict(asdict(r), cmd=cmds[r.server],
                                        requests=mode_requests(args, r.mode),
                                        seed=MODE_SEEDS[r.mode],
                                        prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                                        rate=args.rate if r.mode == "rate" else None,
                                        arrivals=args.arrivals if r.mode == "rate" else None)) + "\n")

    for run in range(args.first_run, args.runs + 1):
        order = args.servers if run % 2 else list(reversed(args.servers))   # alternate who goes first
        for name in order:
            session(args, name, cmds[name], run, workdir, emit)
    print(f"swakv: {args.swakv_cmd}\ntransformers: {args.tf_cmd}\nclient: guidellm, chat completions streamed, "
          f"prompts of {args.prompt_tokens} tokens, max {args.output_tokens} out, temperature 0, new prompts for each mode; "
          f"modes: sync = {args.sync_requests} one at a time, rate = {args.requests} at {args.rate:g} req/s ({args.arrivals}), "
          f"max = {args.max_requests} with {args.requests} in flight at a time\n")
    print("\n".join(report(runs, args)))


if __name__ == "__main__":
    main()
