"""Reused keep-alive connections against a running server: which requests fail, and how long their connection
had been idle (client side) when it was reused.

Runs ``repro_serving_overhead.py``'s pattern (one httpx client, a warm-up stream, then runs of N concurrent
streams) with a pause between runs, and records for every request the idle time of the connection it went out
on (None: a new connection) and any error raised up to the response's headers; a stream that raised
anywhere (connect, headers, body) is counted as well. A failure on a connection idle for about the server's keep-alive
timeout is the HTTP/1.1 race (the server closes an idle connection as the client reuses it).

    python bench/keepalive_race.py URL --ns 1,16,64,256 --pause 0 --repeat 1 [--out 64]
    python bench/keepalive_race.py URL --ns 256 --pause 4.90,4.95,4.99 --out 0   # idle edge, no engine work
Prints one line per run and a summary: failures by error and the idle times of failed requests."""
from __future__ import annotations

import argparse
import asyncio
import json
import time
import traceback

import httpcore
import httpx

RECORDS: list[tuple[float | None, str | None]] = []     # (idle seconds or None when new, error or None)
FAILED_STREAMS: list[str] = []   # every stream that raised, wherever (connect, headers, body)
_orig = httpcore._async.http11.AsyncHTTP11Connection.handle_async_request


async def _recorded(self, request):
    idle = None if self._expire_at is None else time.monotonic() - (self._expire_at - self._keepalive_expiry)
    try:   # before the request: a failed one's socket is closed, and asking it then raises EBADF
        port = self._network_stream.get_extra_info("client_addr")[1]
    except OSError as exc:
        port = repr(exc)
    try:
        response = await _orig(self, request)
    except httpcore.ConnectionNotAvailable:   # the pool's own retry: this connection was taken, not an error
        raise
    except Exception as exc:
        RECORDS.append((idle, f"{type(exc).__name__}({str(exc)!r}) port {port}"))
        raise
    RECORDS.append((idle, None))
    return response

httpcore._async.http11.AsyncHTTP11Connection.handle_async_request = _recorded


async def stream(client, url, model, i, out):
    if out == 0:   # no engine work: GET /v1/models, so the edge alone is exercised
        r = await client.get(url + "/v1/models")
        r.raise_for_status()
        return time.perf_counter()
    body = {"model": model, "prompt": [1 + (i * 7 + j) % 200 for j in range(128)], "max_tokens": out,
            "stream": True, "ignore_eos": True, "temperature": 0}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for _ in r.aiter_lines():
            pass
    return time.perf_counter()


async def main(a):
    ns = [int(n) for n in a.ns.split(",")]
    pauses = [float(p) for p in a.pause.split(",")]
    pauses = (pauses * len(ns))[:len(ns)] if len(pauses) < len(ns) else pauses
    ns = (ns * len(pauses))[:len(pauses)]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1024)) as client:
        await stream(client, a.url, a.model, 0, a.out)
        for rep in range(a.repeat):
            for n, pause in zip(ns, pauses):
                if pause:
                    await asyncio.sleep(pause)
                before, t = len(RECORDS), time.perf_counter()
                res = await asyncio.gather(*[stream(client, a.url, a.model, i, a.out) for i in range(n)],
                                           return_exceptions=True)
                done = [r for r in res if not isinstance(r, BaseException)]
                raised = [f"{type(r).__name__}({str(r)!r})" for r in res if isinstance(r, BaseException)]
                if raised and not FAILED_STREAMS:   # the first one's traceback says where it came from
                    first = next(r for r in res if isinstance(r, BaseException))
                    print("".join(traceback.format_exception(first))[-3000:], flush=True)
                FAILED_STREAMS.extend(raised)
                new = RECORDS[before:]
                reused = [idle for idle, _ in new if idle is not None]
                errs = [(idle, e) for idle, e in new if e is not None]
                print(f"rep {rep} N={n:4d} pause {pause:5.3f}: wall {time.perf_counter() - t:6.2f} s  finish spread "
                      f"{(max(done) - min(done)) if done else 0:5.2f} s  reused {len(reused)} "
                      f"(idle max {max(reused, default=0):.3f} s)  errors {len(errs)} {errs[:2]}  "
                      f"streams raised {len(raised)} {sorted(set(raised))[:3]}", flush=True)
    errs = [(idle, e) for idle, e in RECORDS if e is not None]
    reused = [i for i, _ in RECORDS if i is not None]
    print(json.dumps({"streams_raised": len(FAILED_STREAMS), "stream_errors": sorted(set(FAILED_STREAMS)),
                      "requests": len(RECORDS), "on_reused_connections": len(reused),
                      "reused_idle_ge_4s": sum(i >= 4 for i in reused), "failed": len(errs),
                      "failed_idle_s": [None if i is None else round(i, 3) for i, _ in errs][:50],
                      "errors": sorted({e for _, e in errs})}))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--model", default="gemma-3-27b")
    p.add_argument("--ns", default="1,16,64,256")
    p.add_argument("--pause", default="0", help="seconds before each run (all connections idle), comma-separated: "
                                                "paired with --ns, the shorter list repeated")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--out", type=int, default=64, help="tokens per stream; 0: GET /v1/models instead")
    asyncio.run(main(p.parse_args()))
