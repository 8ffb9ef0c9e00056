"""The open-loop HTTP load generator for the Serve app, and the figures of a run.

The generator streams every request (SSE), so time to first token (TTFT) and time per output token
(TPOT) are measured; it only talks to 127.0.0.1 and stops by itself: no new turn after ``duration_s``,
nothing in flight after ``duration_s + drain_s``. A request the server accepted (HTTP 200) but that
neither finished nor reported an error by then is **lost**; that count must be 0.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvmanager.checks import check_number

from .workloads import Session


# -- one request ----------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    session_id: str
    turn: int
    prompt_tokens: int
    max_tokens: int
    sent_s: float
    status: str = "pending"          # completed | failed | lost
    accepted: bool = False           # the server answered 200 and started the stream
    first_token_s: float | None = None
    end_s: float | None = None
    response_id: str | None = None
    seed: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int | None = None  # prompt tokens the server found in its prefix cache (usage)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None or self.status != "completed" else self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        n = len(self.output_token_ids)
        if self.status != "completed" or n < 2 or self.first_token_s is None:
            return None
        return (self.end_s - self.first_token_s) / (n - 1)


def request_seed(seed: int, session_id: str, turn: int) -> int:
    """The sampling seed a request carries: a function of the run's seed and the request only."""
    return random.Random(f"{seed}/{session_id}/{turn}").getrandbits(62)


async def stream_completion(client, url: str, body: dict, record: RequestRecord, clock,
                            headers: dict | None = None) -> None:
    """POST one streaming completion; fill ``record`` (status stays ``pending`` if the stream just stops)."""
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                try:
                    message = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = text[:200]
                record.status, record.error, record.end_s = "failed", f"HTTP {resp.status_code}: {message}", clock()
                return
            record.accepted = True
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    record.status, record.end_s = "failed", clock()
                    record.error = f"stream error: {event['error'].get('message')}"
                    return
                record.response_id = record.response_id or event.get("id")
                usage = event.get("usage")
                if usage:
                    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                for choice in event.get("choices", ()):
                    ids = choice.get("token_ids") or []
                    if ids and record.first_token_s is None:
                        record.first_token_s = clock()
                    record.output_token_ids.extend(ids)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
            if record.finish_reason is not None:
                record.status, record.end_s = "completed", clock()
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - transport errors: before acceptance a failure, after it lost
        if not record.accepted:
            record.status, record.end_s = "failed", clock()
            record.error = f"{type(exc).__name__}: {exc}"
        else:
            record.error = f"stream broke: {type(exc).__name__}: {exc}"


# -- a run ----------------------------------------------------------------------------------------
@dataclass
class RunResult:
    records: list[RequestRecord]
    not_sent: int                    # turns never sent: past the duration, or their session had failed
    wall_s: float
    timeline: list[dict]             # periodic engine stats with "t" (s since start) and "in_flight"
    last_stats: dict | None


def check_local_url(base_url: str) -> str:
    parts = urlsplit(base_url)
    if parts.scheme != "http" or parts.hostname != "127.0.0.1" or not parts.port:
        raise ValueError(f"base_url must be http://127.0.0.1:PORT[/prefix] (the load generator only talks to "
                         f"loopback), got {base_url!r}")
    return base_url.rstrip("/")


async def run_load(sessions: list[Session], base_url: str, *, duration_s: float = 60.0, drain_s: float = 60.0,
                   seed: int = 0, model: str | None = None, poll_stats: Callable[[], Awaitable[dict]] | None = None,
                   poll_interval_s: float = 0.5, request_timeout_s: float = 120.0, progress: bool = True,
                   events: list[tuple[float, Callable[[], Awaitable[str]]]] = (),
                   request_id_prefix: str | None = None) -> RunResult:
    """Drive ``sessions`` against ``base_url`` (http://127.0.0.1:PORT); return every request's record.

    ``events``: (seconds after start, async action) pairs, e.g. fault injection; their results land in
    the timeline. ``request_id_prefix``: sent as ``X-Request-Id`` (``prefix-session-turn``) so a server
    that honours it names requests deterministically.
    """
    import httpx

    url = check_local_url(base_url) + "/v1/completions"
    check_number("duration_s", duration_s, 0, above=True)
    check_number("drain_s", drain_s, 0)
    check_number("poll_interval_s", poll_interval_s, 0, above=True)
    if not sessions:
        raise ValueError("sessions is empty: nothing to send")
    t0 = time.monotonic()

    def clock() -> float:
        return time.monotonic() - t0

    records: list[RequestRecord] = []
    in_flight = 0
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(s.num_requests for s in sessions), unit="req", desc="loadtest", leave=False,
                   dynamic_ncols=True)

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    timeout = httpx.Timeout(connect=10.0, read=request_timeout_s, write=30.0, pool=30.0)

    async def one_session(client, s: Session) -> None:
        nonlocal in_flight
        await asyncio.sleep(max(0.0, s.start_s - clock()))
        history: tuple[int, ...] | str = s.prefix
        for k, turn in enumerate(s.turns):
            await asyncio.sleep(turn.think_s)
            if clock() >= duration_s:
                return
            if isinstance(turn.text, str):
                prompt: Any = turn.text
            else:
                prompt = list(history if s.carry_history else s.prefix) + list(turn.text)
            body = {"prompt": prompt, "max_tokens": turn.max_tokens, "stream": True, "ignore_eos": True,
                    "seed": request_seed(seed, s.session_id, k), "stream_options": {"include_usage": True}}
            if model:
                body["model"] = model
            rec = RequestRecord(s.session_id, k, -1 if isinstance(prompt, str) else len(prompt), turn.max_tokens,
                                clock(), seed=body["seed"])
            records.append(rec)
            headers = {"X-Request-Id": f"{request_id_prefix}-{s.session_id}-{k}"} if request_id_prefix else None
            in_flight += 1
            try:
                await stream_completion(client, url, body, rec, clock, headers)
            finally:
                in_flight -= 1
                if bar is not None and rec.status != "pending":
                    bar.update(1)
            if rec.status != "completed":
                return
            if s.carry_history and not isinstance(prompt, str):
                history = tuple(prompt) + tuple(rec.output_token_ids)

    timeline: list[dict] = []
    last_stats: dict | None = None

    async def poller() -> None:
        nonlocal last_stats
        while True:
            try:
                stats = await asyncio.wait_for(poll_stats(), timeout=10.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a missed sample is not a failed run
                timeline.append({"t": clock(), "in_flight": in_flight, "stats_error": repr(exc)})
            else:
                last_stats = stats
                timeline.append({"t": clock(), "in_flight": in_flight, **_sample(stats)})
            await asyncio.sleep(poll_interval_s)

    async def injector(at: float, action) -> None:
        await asyncio.sleep(max(0.0, at - clock()))
        try:
            note = await action()
        except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
            note = f"failed: {exc!r}"
        timeline.append({"t": clock(), "in_flight": in_flight, "event": note})

    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        tasks = [asyncio.create_task(one_session(client, s)) for s in sessions]
        side = [asyncio.create_task(injector(at, action)) for at, action in events]
        if poll_stats is not None:
            side.append(asyncio.create_task(poller()))
        deadline = duration_s + drain_s
        try:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - clock()))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        finally:
            for task in side:
                task.cancel()
            await asyncio.gather(*side, return_exceptions=True)
            if bar is not None:
                bar.close()
    if poll_stats is not None:   # one last sample: the counters at the end
        try:
            last_stats = await asyncio.wait_for(poll_stats(), timeout=10.0)
            timeline.append({"t": clock(), "in_flight": 0, **_sample(last_stats)})
        except Exception:  # noqa: BLE001
            pass
    for rec in records:
        if rec.status == "pending":   # accepted (or sent) and never answered within the run's bound
            rec.status = "lost"
            rec.error = rec.error or "no answer before the run's end"
    not_sent = sum(s.num_requests for s in sessions) - len(records)
    return RunResult(records, not_sent, clock(), timeline, last_stats)


_SAMPLED = ("running", "waiting", "kv_usage", "preemptions", "prefix_hit_rate", "worker_restarts",
            "recomputed_requests", "steps", "simulated_time_s", "replicas")


def _sample(stats: dict) -> dict:
    return {k: stats[k] for k in _SAMPLED if k in stats}


# -- metrics --------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(result: RunResult) -> dict:
    """The run's figures: counts, throughput (wall and simulated GPU time), latency percentiles, engine."""
    recs = result.records
    done = [r for r in recs if r.status == "completed"]
    out_tokens = sum(len(r.output_token_ids) for r in done)
    wall = result.wall_s
    summary: dict[str, Any] = {
        "requests": len(recs),
        "completed": len(done),
        "failed": sum(r.status == "failed" for r in recs),
        "lost": sum(r.status == "lost" for r in recs),
        "not_sent": result.not_sent,
        "errors": sorted({r.error for r in recs if r.status == "failed"})[:10],
        "wall_s": wall,
        "prompt_tokens": sum(max(0, r.prompt_tokens) for r in done),
        "output_tokens": out_tokens,
        "requests_per_s": len(done) / wall if wall else 0.0,
        "output_tokens_per_s": out_tokens / wall if wall else 0.0,
    }
    # a completed request with more tokens than it asked for was answered twice (or more)
    summary["answered_twice"] = sum(len(r.output_token_ids) > r.max_tokens for r in done)
    known = [r for r in done if r.cached_tokens is not None and r.prompt_tokens > 0]
    summary["client_prefix_hit_rate"] = (sum(r.cached_tokens for r in known) / sum(r.prompt_tokens for r in known)
                                         if known else None)
    for name, values in (("ttft_s", [r.ttft_s for r in done]), ("tpot_s", [r.tpot_s for r in done]),
                         ("e2e_s", [r.e2e_s for r in done])):
        values = [v for v in values if v is not None]
        summary[name] = {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
    samples = [s for s in result.timeline if "running" in s]
    summary["max_running"] = max((s["running"] for s in samples), default=None)
    summary["max_waiting"] = max((s["waiting"] for s in samples), default=None)
    summary["max_kv_usage"] = max((s["kv_usage"] for s in samples), default=None)
    summary["mean_running"] = (sum(s["running"] for s in samples) / len(samples)) if samples else None
    last = result.last_stats or {}
    for key in ("preemptions", "worker_restarts", "recomputed_requests", "steps"):
        summary[key] = last.get(key)
    summary["prefix_hit_rate"] = last.get("prefix_hit_rate")
    sim = last.get("simulated_time_s")
    if sim is not None:
        summary["simulated_gpu_s"] = sim
        summary["sim_requests_per_s"] = len(done) / sim if sim else None
        summary["sim_output_tokens_per_s"] = out_tokens / sim if sim else None
    summary["events"] = [s["event"] for s in result.timeline if "event" in s]
    return summary
