"""The served path against the engine alone: `swakv serve` with simulated workers, N concurrent streams.

Starts ``python -m cluster serve --model gemma-3-27b --simulated-gpu H100-80GB [--sleep-factor F]`` on a
free port (its own process group, always stopped: also on Ctrl-C or a failure), waits for ``/health``,
measures the idle CPU of every process of the server's tree (Ray's included) after ``--idle-s`` seconds
without requests, then drives 1 / 16 / 64 / 256 concurrent streams (random 128-token prompts, new for
every run so no run hits the prefix cache of another; 64 tokens out, ignore_eos, temperature 0) and
prints per run: output tokens/s, TTFT p50/p99, ITL p50/p99 (a stream's mean gap between tokens, from
its first to its last, as the issue's reproducer measures it) and the p50/p99 of every single gap
between two token events of a stream (vLLM's ITL; near 0 when events arrive in bursts), the client's own CPU share (one asyncio thread: near 100% of a core it is the limit, and the
row says so), the CPU share of each server process under load, engine steps and engine->replica record
messages per step (``swakv_stream_records_total``: one per step per HTTP replica at most, through a
shared-memory ring when the replica is on the engine's host, else a Ray stream item; a server that
streams per token has no such counter and the bench counts token events instead). Beside each
run, the in-process engine (the same simulated workers driven directly, as ``bench/step_overhead.py``
does) on the same trace: its tokens/s, TTFT and ITL, and the served/in-process ratio.

``--sleep-factor 0`` (the workers take no time: every millisecond is serving overhead) and ``1`` (the
modelled H100 step slept) each get their own server, one after the other; with ``--frontend direct serve``
each of those runs once per HTTP frontend (``swakv serve --frontend``) on the same traces, side by side. Progress goes to stderr; the
table to stdout, then one JSON line per configuration (``--out`` appends them to a file too).

    PYTHONPATH=. python bench/serving.py [--streams 1 16 64 256] [--sleep-factor 0 1] [--frontend direct serve] [--idle-s 30]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cluster.ray.ports import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLK_TCK = os.sysconf("SC_CLK_TCK")
GOALS = "idle < 2% of a core per process; 0-sleep: 256 streams >= 7,500 tok/s with TTFT p50 <= 500 ms, " \
        "16 streams TTFT p50 <= 50 ms, 64 streams ITL p50 <= 8 ms; slept: ITL p50 <= 1.1 x step + 1 ms at 64, " \
        "<= 1.25 x step at 256"


COUNTERS = {"swakv_steps_total": "steps", "swakv_stream_records_total": "records",
            "swakv_add_calls_total": "add_calls", "swakv_step_work_seconds_total": "work_s", "swakv_step_wait_seconds_total": "wait_s"}


def log(msg: str) -> None:
    print(f"[serving {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# -- processes ------------------------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (Ray's raylet, GCS and workers are the server's descendants)."""
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def process_name(pid: int) -> str:
    """``ray::WorkerActor``, ``raylet``, ``gcs_server``, ``agent.py``, ``server`` (the driver) ..."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    if argv[0].startswith("ray::"):   # Ray appends the running method: ray::EngineService.kv_events
        return argv[0].split()[0].split(".")[0]
    if "cluster" in argv and "serve" in argv:
        return "server"
    base = os.path.basename(argv[0])
    if base.startswith("python"):
        script = next((a for a in argv[1:] if a.endswith(".py")), None)
        return os.path.basename(script) if script else " ".join(argv[1:3])
    return base


def sample_tree(root: int) -> dict[int, tuple[str, float]]:
    out = {}
    for pid in process_tree(root):
        cpu = cpu_seconds(pid)
        if cpu is not None:
            out[pid] = (process_name(pid), cpu)
    return out


def cpu_shares(before: dict, after: dict, seconds: float) -> list[dict]:
    """Per process alive at both samples: its share of one core over the window, busiest first."""
    rows = [{"pid": pid, "name": name, "cpu": (cpu - before[pid][1]) / seconds}
            for pid, (name, cpu) in after.items() if pid in before]
    return sorted(rows, key=lambda r: -r["cpu"])


# -- the server -----------------------------------------------------------------------------------
def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Server:
    """``python -m cluster serve`` in its own process group; ``stop`` is bounded and leaves no process."""

    def __init__(self, args: list[str], port: int, extra_env: dict | None = None, root: str = ROOT):
        """``root``: the checkout to serve (another one's code, side by side with this one's)."""
        self.port = port
        self.log = tempfile.NamedTemporaryFile(prefix="swakv-serving-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", **(extra_env or {})}
        cmd = [sys.executable, "-m", "cluster", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
        log(f"starting: {' '.join(cmd[1:])} (log {self.log.name})")
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.known: set[int] = {self.proc.pid}

    def tail(self, lines: int = 40) -> str:
        with open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def wait_ready(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode} before it was ready; "
                                   f"its log ends:\n{self.tail()}")
            try:
                status, _ = http_get(f"http://127.0.0.1:{self.port}/health", timeout=2)
                if status == 200:
                    return time.monotonic() - t0
            except OSError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s; its log ends:\n{self.tail()}")
            self.known.update(process_tree(self.proc.pid))
            time.sleep(1)

    def counters(self) -> dict[str, float]:
        """The engine's counters this bench reads from /metrics: steps (``swakv_steps_total``), the record
        messages it sent the HTTP side (``swakv_stream_records_total``; absent from a server that streams
        one message per token) and its core thread's time in steps, working and waiting for the workers
        (``swakv_step_{work,wait}_seconds_total``). Empty if /metrics did not answer."""
        try:
            _, body = http_get(f"http://127.0.0.1:{self.port}/metrics", timeout=10)
        except OSError:
            return {}
        found = {}
        for line in body.decode().splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in COUNTERS:
                found[COUNTERS[name]] = found.get(COUNTERS[name], 0.0) + float(line.split()[-1])
        return found

    def stop(self, grace_s: float = 60.0) -> None:
        """Ctrl-C to the whole group (as a terminal sends it), then SIGKILL to whatever is left of it."""
        if self.proc.poll() is None:
            self.known.update(process_tree(self.proc.pid))
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            log(f"the server did not stop within {grace_s:.0f} s of SIGINT: killing its process group")
        for pid in [self.proc.pid, *self.known]:
            for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                try:
                    kill()
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        alive = [p for p in self.known if cpu_seconds(p) is not None and process_name(p) != "?"]
        if alive:
            log(f"still alive after stop: {alive}")


# -- the client -----------------------------------------------------------------------------------
@dataclass
class Stream:
    sent: float = 0.0
    times: list[float] = field(default_factory=list)   # arrival of each event carrying tokens
    tokens: int = 0
    done: bool = False
    error: str | None = None


async def stream_completion(host: str, port: int, body: bytes, timeout_s: float, path: str = "/v1/completions") -> Stream:
    """One streamed completion over a raw HTTP/1.1 connection: a few syscalls and one json.loads per event,
    so the client costs far less than the server it measures."""
    out = Stream(sent=time.perf_counter())
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                         b"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                         % (path.encode(), host.encode(), port, len(body), body))
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            if status != 200:
                out.error = f"HTTP {status}: {(await reader.read(2000)).decode(errors='replace')[:300]}"
                return out
            chunked = b"transfer-encoding: chunked" in head.lower()
            buf = b""
            while True:
                if chunked:
                    size = int((await reader.readline()).split(b";")[0], 16)
                    data = (await reader.readexactly(size + 2))[:-2]
                    if size == 0:
                        break
                else:
                    data = await reader.read(65536)
                    if not data:
                        break
                now = time.perf_counter()
                buf += data
                while (cut := buf.find(b"\n\n")) >= 0:
                    event, buf = buf[:cut], buf[cut + 2:]
                    if not event.startswith(b"data: "):
                        continue
                    payload = event[6:]
                    if payload == b"[DONE]":
                        out.done = True
                        continue
                    obj = json.loads(payload)
                    if "error" in obj:
                        out.error = str(obj["error"].get("message"))[:300]
                        continue
                    n = sum(len(c.get("token_ids") or ()) for c in obj.get("choices") or ())
                    if n:
                        out.times.append(now)
                        out.tokens += n
    except TimeoutError:   # asyncio.timeout raises the builtin TimeoutError
        out.error = f"no end within {timeout_s:g} s ({out.tokens} tokens)"
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        if writer is not None:
            writer.close()
    return out


def make_prompts(n: int, prompt_len: int, rng: random.Random, vocab: int = 32000) -> list[list[int]]:
    return [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(n)]


def body_for(prompt: list[int], max_tokens: int, model: str) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()


async def drive(port: int, prompts: list[list[int]], max_tokens: int, model: str, timeout_s: float) -> dict:
    bodies = [body_for(p, max_tokens, model) for p in prompts]
    cpu0, t0 = time.process_time(), time.perf_counter()
    streams = await asyncio.gather(*(stream_completion("127.0.0.1", port, b, timeout_s) for b in bodies))
    wall, client_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ttft = [s.times[0] - s.sent for s in streams if s.times]
    gaps = [b - a for s in streams for a, b in zip(s.times, s.times[1:])]
    itl = [(s.times[-1] - s.times[0]) / (s.tokens - 1) for s in streams if s.tokens > 1]
    tokens = sum(s.tokens for s in streams)
    errors = [s.error for s in streams if s.error]
    short = sum(1 for s in streams if not s.error and (s.tokens != max_tokens or not s.done))
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "ttft_p50": pct(ttft, 0.5),
            "ttft_p99": pct(ttft, 0.99), "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99),
            "gap_p50": pct(gaps, 0.5), "gap_p99": pct(gaps, 0.99),
            "token_events": sum(len(s.times) for s in streams), "client_cpu": client_cpu / wall,
            "errors": len(errors), "first_error": errors[0] if errors else None, "incomplete": short}


# -- the engine alone ------------------------------------------------------------------------------
def modelled_decode_step_s(model: str, gpu: str, n: int, context: int) -> float:
    """The cost model's time for a decode step of ``n`` sequences at ``context`` tokens (what workers sleep)."""
    from workers.sim.cost_model import StepCostModel
    from workers.sim.presets import get_model_preset
    return StepCostModel(get_model_preset(model), gpu).step([(context, 1)] * n).time_s


def in_process(prompts: list[list[int]], max_tokens: int, model: str, gpu: str, sleep_factor: float,
               async_scheduling: bool = True, max_num_batched_tokens: int | None = None) -> dict:
    """The same requests, arriving together, on the engine with simulated workers in this process (the
    server's defaults: block 16, 512 batched tokens unless given, 256 sequences; no stop token, as ignore_eos)."""
    from cluster.engine.args import EngineArgs
    from cluster.engine.build import build_engine
    from cluster.engine.types import SamplingParams
    budget = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    engine, _ = build_engine(EngineArgs(model, simulated_gpu=gpu, sleep_factor=sleep_factor,
                                         async_scheduling=async_scheduling, **budget))
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens))
    times: dict[str, list[float]] = {}
    tokens = steps = 0
    while engine.has_work():
        updates = engine.step()
        now = time.perf_counter()
        steps += 1
        for u in updates:
            if u.new_token_ids:
                times.setdefault(u.request_id, []).append(now)
                tokens += len(u.new_token_ids)
    wall = time.perf_counter() - t0
    if tokens != max_tokens * len(prompts):
        raise AssertionError(f"the in-process engine produced {tokens} tokens, not {max_tokens * len(prompts)}")
    ttft = [ts[0] - t0 for ts in times.values()]
    itl = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times.values() if len(ts) > 1]
    return {"tok_s": tokens / wall, "wall_s": wall, "steps": steps, "ttft_p50": pct(ttft, 0.5),
            "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99)}


# -- profiling (optional) -------------------------------------------------------------------------
PROFILED = ("ray::ServeReplica", "ray::HTTPEdge", "ray::EngineService", "ray::WorkerActor", "ray::ProxyActor")


def start_profiles(root: int, directory: str, tag: str, rate: int) -> list[subprocess.Popen]:
    """``py-spy record`` (raw collapsed stacks, not pausing the target) on the replica, engine, worker and
    proxy; stopped with SIGINT, on which py-spy writes its file."""
    procs = []
    for pid in process_tree(root):
        name = process_name(pid)
        if name.startswith(PROFILED):
            out = os.path.join(directory, f"{tag}-{name.split(':')[2] if name.count(':') > 1 else name[5:]}-{pid}.txt")
            procs.append(subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", str(rate), "--format",
                                           "raw", "--nonblocking", "--threads", "--duration", "600", "-o", out],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)   # py-spy attaches
    return procs


def stop_profiles(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


# -- the run --------------------------------------------------------------------------------------
def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


# the slept-step ITL goals: (streams, slack on the step, seconds added)
SLEPT_ITL_GOALS = ((64, 1.10, 0.001), (256, 1.25, 0.0))


def goals(cfg: dict) -> list[tuple[str, bool | None]]:
    runs = {r["streams"]: r for r in cfg["runs"]}
    out = [("idle < 2% of a core per process", cfg["idle_max_cpu"] is not None and cfg["idle_max_cpu"] < 0.02)]
    if cfg["sleep_factor"] == 0:
        if 256 in runs:
            r = runs[256]
            out.append(("256 streams >= 7,500 tok/s", r["tok_s"] >= 7500))
            out.append(("256 streams TTFT p50 <= 500 ms", r["ttft_p50"] is not None and r["ttft_p50"] <= 0.5))
        if 16 in runs:
            out.append(("16 streams TTFT p50 <= 50 ms", runs[16]["ttft_p50"] is not None and runs[16]["ttft_p50"] <= 0.05))
        if 64 in runs:
            out.append(("64 streams ITL p50 <= 8 ms", runs[64]["itl_p50"] is not None and runs[64]["itl_p50"] <= 0.008))
    elif cfg["sleep_factor"] == 1:
        for n, slack, extra in SLEPT_ITL_GOALS:
            if n in runs and runs[n]["itl_p50"] is not None:
                step = runs[n]["modelled_step_s"]
                out.append((f"{n} streams ITL p50 <= {slack:g} x modelled step {1e3 * step:.1f} ms"
                            + (" + 1 ms" if extra else ""), runs[n]["itl_p50"] <= slack * step + extra))
    return out


def run_config(args, sleep_factor: float, rng: random.Random, frontend: str = "direct",
               engine_alone: dict | None = None) -> dict:
    """One server (``frontend``, ``sleep_factor``) on every stream count; ``engine_alone`` (the in-process
    engine's runs on the same traces) is measured here unless given."""
    traces = {n: make_prompts(n, args.prompt_len, rng) for n in args.streams}
    given = engine_alone is not None
    engine_alone = {} if engine_alone is None else engine_alone
    if not args.no_engine and not given:
        log(f"sleep x{sleep_factor:g}: the in-process engine on the same traces (first: a warm-up)")
        in_process(make_prompts(1, args.prompt_len, rng), 4, args.model, args.gpu, 0.0)
        for n in args.streams:
            engine_alone[n] = in_process(traces[n], args.max_tokens, args.model, args.gpu, sleep_factor,
                                         args.async_scheduling, args.max_num_batched_tokens)
            log(f"  in-process N={n}: {engine_alone[n]['tok_s']:.0f} tok/s")
    port = args.port or free_port()
    server_args = ["--model", args.model, "--simulated-gpu", args.gpu, "--frontend", frontend]
    if sleep_factor:
        server_args += ["--sleep-factor", f"{sleep_factor:g}"]
    if not args.async_scheduling:
        server_args += ["--no-async-scheduling"]
    if args.max_num_batched_tokens is not None:
        server_args += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    step_tokens = served_step_budget(args, sleep_factor)
    server = Server(server_args, port, dict(kv.split("=", 1) for kv in args.server_env))
    cfg = {"frontend": frontend, "sleep_factor": sleep_factor, "async_scheduling": args.async_scheduling, "server_env": args.server_env, "max_num_batched_tokens": args.max_num_batched_tokens, "step_tokens": step_tokens, "model": args.model, "gpu": args.gpu, "prompt_len": args.prompt_len,
           "max_tokens": args.max_tokens, "runs": []}
    try:
        cfg["start_s"] = server.wait_ready(args.start_timeout)
        log(f"server ready on :{port} after {cfg['start_s']:.0f} s; warm-up request")
        warm = asyncio.run(drive(port, make_prompts(1, args.prompt_len, rng), 8, args.model, args.stream_timeout))
        if warm["errors"] or warm["incomplete"]:
            raise RuntimeError(f"the warm-up request failed: {warm['first_error']}; log:\n{server.tail()}")
        window = min(args.idle_window, args.idle_s)
        log(f"idle for {args.idle_s:.0f} s (CPU measured over the last {window:.0f} s)")
        time.sleep(args.idle_s - window)
        before = sample_tree(server.proc.pid)
        time.sleep(window)
        idle = cpu_shares(before, sample_tree(server.proc.pid), window)
        cfg["idle"] = idle
        cfg["idle_max_cpu"] = idle[0]["cpu"] if idle else None
        cfg["idle_total_cpu"] = sum(r["cpu"] for r in idle)
        log("idle CPU: " + ", ".join(f"{r['name']} {100 * r['cpu']:.1f}%" for r in idle[:5]))
        for n in args.streams:
            counters0 = server.counters()
            before = sample_tree(server.proc.pid)
            profiles = (start_profiles(server.proc.pid, args.profile, f"sleep{sleep_factor:g}-n{n}", args.profile_rate)
                        if args.profile and n in args.profile_streams else [])
            t0 = time.perf_counter()
            try:
                res = asyncio.run(drive(port, traces[n], args.max_tokens, args.model, args.stream_timeout))
            finally:
                stop_profiles(profiles)
            busy = cpu_shares(before, sample_tree(server.proc.pid), time.perf_counter() - t0)
            counters1 = server.counters()
            res["streams"] = n
            delta = {k: counters1[k] - counters0[k] for k in counters1 if k in counters0}
            res["steps"] = delta.get("steps")
            messages = delta.get("records", res["token_events"])
            res["items_per_step"] = messages / res["steps"] if res["steps"] else None
            res["requests_per_add_call"] = n / delta["add_calls"] if delta.get("add_calls") else None
            for key in ("work_s", "wait_s"):   # the engine core's time per step, working / waiting for workers
                res[f"{key[:-2]}_per_step_s"] = delta[key] / res["steps"] if res["steps"] and key in delta else None
            res["server_cpu"] = [{"name": r["name"], "cpu": round(r["cpu"], 3)} for r in busy if r["cpu"] >= 0.02]
            res["client_bound"] = res["client_cpu"] >= 0.8
            res["modelled_step_s"] = modelled_decode_step_s(args.model, args.gpu, n, args.prompt_len + args.max_tokens // 2)
            if n in engine_alone:
                res["engine"] = engine_alone[n]
                res["ratio"] = res["tok_s"] / engine_alone[n]["tok_s"]
            cfg["runs"].append(res)
            log(f"N={n}: {res['tok_s']:.0f} tok/s, TTFT p50 {fmt_ms(res['ttft_p50'])} ms, ITL p50 "
                f"{fmt_ms(res['itl_p50'])} ms, client CPU {100 * res['client_cpu']:.0f}%"
                + (f", {res['errors']} errors ({res['first_error']})" if res["errors"] else ""))
            time.sleep(2)
    finally:
        log("stopping the server")
        server.stop()
    cfg["goals"] = goals(cfg)
    cfg["engine_alone"] = engine_alone
    return cfg


def cpu_per_token_us(run: dict) -> float:
    """The server processes' CPU (those at >= 2% of a core) per token streamed, in microseconds."""
    return 1e6 * sum(p["cpu"] for p in run["server_cpu"]) * run["wall_s"] / max(run["tokens"], 1)


def references(cfg: dict) -> list[tuple[str, bool]]:
    """The slept-step ITL goals read against the in-process engine on the same trace: its streams' ITL
    includes the steps that carry other requests' prefill chunks, which the pure decode step (the goal's
    yardstick) does not, so even a server with no overhead can miss the goal; this says whether the
    serving path is the reason."""
    runs = {r["streams"]: r for r in cfg["runs"]}
    out = []
    if cfg["sleep_factor"] == 1:
        for n, slack, extra in SLEPT_ITL_GOALS:
            eng = runs.get(n, {}).get("engine", {}).get("itl_p50")
            if eng and runs[n]["itl_p50"] is not None:
                out.append((f"{n} streams ITL p50 <= {slack:g} x the in-process engine's {1e3 * eng:.1f} ms on this trace"
                            + (" + 1 ms" if extra else ""), runs[n]["itl_p50"] <= slack * eng + extra))
    return out


def served_step_budget(args, sleep_factor: float) -> int:
    """The step budget the server runs with: the one given, else the fixed part of the default
    ``build_engine`` derives (with a modelled step slept, each step also widens to its decodes' knee)."""
    from cluster.engine.args import EngineArgs
    from cluster.engine.build import build_engine
    budget = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    engine_args = EngineArgs(args.model, simulated_gpu=args.gpu, sleep_factor=sleep_factor, **budget)
    return build_engine(engine_args)[1]["max_num_batched_tokens"]


def budget_note(cfg: dict) -> str:
    if cfg.get("max_num_batched_tokens"):
        return f", {cfg['step_tokens']} tokens a step (given)"
    if cfg["sleep_factor"]:
        return f", each step its decodes' knee, at least {cfg['step_tokens']} tokens (the default)"
    return f", {cfg['step_tokens']} tokens a step (the default)"


def render(cfg: dict) -> str:
    lines = [f"frontend {cfg.get('frontend', 'serve')}, sleep x{cfg['sleep_factor']:g}{', async scheduling' if cfg.get('async_scheduling') else ', one step at a time'}{budget_note(cfg)}: {cfg['model']} on simulated {cfg['gpu']}, {cfg['prompt_len']}-token "
             f"prompts, {cfg['max_tokens']} out; server ready in {cfg.get('start_s', 0):.0f} s",
             f"{'streams':>7} {'tok/s':>8} {'engine':>8} {'ratio':>6} {'TTFT50':>8} {'TTFT99':>8} {'ITL50':>7} "
             f"{'ITL99':>7} {'gap50':>6} {'gap99':>6} {'eng TTFT50':>10} {'eng ITL50':>9} {'step*':>6} {'steps':>5} {'work/st':>7} {'wait/st':>7} {'items/st':>8} {'req/add':>7} {'tok/ev':>6} "
             f"{'client':>6} {'us/tok':>6} {'err':>4}  busiest server processes"]
    for r in cfg["runs"]:
        e = r.get("engine", {})
        busiest = ", ".join(f"{p['name'].replace('ray::', '')} {100 * p['cpu']:.0f}%" for p in r["server_cpu"][:4])
        lines.append(f"{r['streams']:>7} {r['tok_s']:>8.0f} {e.get('tok_s', 0):>8.0f} "
                     f"{(r.get('ratio') or 0):>6.3f} {fmt_ms(r['ttft_p50']):>8} {fmt_ms(r['ttft_p99']):>8} "
                     f"{fmt_ms(r['itl_p50']):>7} {fmt_ms(r['itl_p99']):>7} {fmt_ms(r['gap_p50']):>6} {fmt_ms(r['gap_p99']):>6} "
                     f"{fmt_ms(e.get('ttft_p50')):>10} "
                     f"{fmt_ms(e.get('itl_p50')):>9} {fmt_ms(r['modelled_step_s']):>6} {r['steps'] or 0:>5.0f} "
                     f"{fmt_ms(r.get('work_per_step_s')):>7} {fmt_ms(r.get('wait_per_step_s')):>7} "
                     f"{(r['items_per_step'] or 0):>8.1f} {(r.get('requests_per_add_call') or 0):>7.1f} {r['tokens'] / max(r['token_events'], 1):>6.2f} {100 * r['client_cpu']:>5.0f}%"
                     f"{'!' if r['client_bound'] else ' '}{cpu_per_token_us(r):>6.0f}{r['errors'] + r['incomplete']:>4}  {busiest}")
    lines.append("  (ms; ITL = a stream's mean gap between tokens; gap = every gap between two token events; "
                 "engine = the in-process engine on the same trace; ratio = served / engine tok/s; step* = the "
                 "modelled decode step at that batch; work/st, wait/st = the engine core's time per step working and waiting for the workers; items/st = engine->HTTP record messages per step (token events per "
                 "step for a per-token server); req/add = requests per message that queued them (a burst shares one); tok/ev = tokens per SSE event (> 1: lagging streams got several at once); client = the bench client's CPU, ! = >= 80% of its one thread: the client may be the limit; us/tok = the server "
                 "processes' CPU per token streamed, in microseconds: on C cores the served path cannot pass C x 1e6 / us/tok tok/s)")
    idle = cfg.get("idle") or []
    lines.append("idle CPU per process (% of one core): " + ", ".join(
        f"{r['name'].replace('ray::', '')} {100 * r['cpu']:.1f}" for r in idle if r["cpu"] >= 0.001)
        + f"; total {100 * cfg.get('idle_total_cpu', 0):.1f}")
    lines += [f"  goal {'met    ' if ok else 'NOT met'}  {name}" for name, ok in cfg["goals"]]
    lines += [f"  reference {'met    ' if ok else 'NOT met'}  {name}" for name, ok in references(cfg)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--sleep-factor", type=float, nargs="+", default=[0.0, 1.0],
                    help="one server per value: 0 = workers take no time, 1 = the modelled step slept")
    ap.add_argument("--model", default="gemma-3-27b")
    ap.add_argument("--gpu", default="H100-80GB")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--idle-s", type=float, default=30.0, help="seconds without requests before idle CPU is read")
    ap.add_argument("--idle-window", type=float, default=10.0, help="idle CPU is averaged over this many seconds")
    ap.add_argument("--port", type=int, default=0, help="default: a free port")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--stream-timeout", type=float, default=300.0, help="per stream")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-engine", action="store_true", help="skip the in-process engine runs")
    ap.add_argument("--profile", metavar="DIR", help="py-spy record the HTTP edge (or replica and proxy), engine and worker into DIR")
    ap.add_argument("--profile-streams", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--profile-rate", type=int, default=100)
    ap.add_argument("--server-env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="environment of the server (and so of Ray's processes), e.g. a Ray Serve flag to try")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="the server and the in-process engine schedule step N+1 while step N runs (the "
                         "server's default; --no-async-scheduling: one step at a time)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the step's token budget of the server and the in-process engine (default: the server's)")
    ap.add_argument("--frontend", nargs="+", choices=("direct", "serve"), default=["direct"],
                    help="one server per frontend and sleep factor (swakv serve --frontend), side by side")
    ap.add_argument("--out", help="append the JSON lines here too")
    args = ap.parse_args()
    if any("=" not in kv for kv in args.server_env):
        ap.error("--server-env takes KEY=VALUE pairs")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        ap.error("--max-num-batched-tokens must be >= 1")
    if any(n < 1 for n in args.streams) or args.prompt_len < 1 or args.max_tokens < 2:
        ap.error("streams and prompt length must be >= 1, max tokens >= 2 (an ITL needs two tokens)")
    if any(f < 0 for f in args.sleep_factor) or args.idle_s <= 0 or args.idle_window <= 0:
        ap.error("sleep factors must be >= 0, idle times > 0")
    if args.profile:
        if not shutil.which("py-spy"):
            ap.error("--profile needs py-spy (pip install py-spy)")
        os.makedirs(args.profile, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)   # a SIGTERM stops the server too, as Ctrl-C does
    load = os.getloadavg()
    results = []
    try:
        for factor in args.sleep_factor:
            engine_alone = None
            for frontend in args.frontend:
                # the same traces (drawn first in run_config) for every frontend of this sleep factor
                cfg = run_config(args, factor, random.Random(f"{args.seed}-{factor}"), frontend, engine_alone)
                engine_alone = cfg.pop("engine_alone")
                cfg["loadavg_before"] = load
                results.append(cfg)
                print(render(cfg), flush=True)
                print(flush=True)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    except RuntimeError as exc:
        log(f"failed: {exc}")
        return 1
    for cfg in results:
        line = json.dumps({"bench": "serving", "commit": _commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                           "cpus": os.cpu_count(), **cfg})
        print(line)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
