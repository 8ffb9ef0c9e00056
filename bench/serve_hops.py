"""What each hop of the served path costs without the engine: Serve's proxy, the replica, an actor stream.

N concurrent streams of ``--tokens`` items each, through a trivial path (the items are made up, no
engine, no tokenizer), 1 / 16 / 256 streams:

- ``http relay``: client -> Serve proxy -> replica (FastAPI, SSE events shaped like the app's) -> an
  actor's streaming generator, one Ray item per token: the real app's path with nothing else in it;
- ``http fanout``: the same, but the replica holds one subscription to the actor, which yields one
  record per step with every live stream's token; the replica fans it out to its streams (issue 19's
  "one message per step"); ``coalesced``: an SSE event carries every token queued for its stream;
- ``http``: client -> proxy -> replica, which makes the tokens itself (the proxy and replica hops);
- ``handle``: the driver calls the replica through a ``DeploymentHandle`` (stream=True): the replica
  hop without HTTP or the proxy;
- ``actor``: the driver reads an actor's streaming generator (one Ray item per token): the engine ->
  replica hop alone;
- ``actor batched``: the same actor yields one item per step holding every stream's token (what issue
  19's "one message per step" would send), read by the driver and fanned out to the N streams there;
- ``uvicorn actor``: no Serve: uvicorn and the same routes in a plain async actor, the tokens made there
  (``own``) or by a step loop on the same event loop (``fanout``, ``coalesced``): the bound for an HTTP
  edge living with the engine.

Each variant runs in its own Ray runtime (a child process) because the Serve flags it tries are read at
start-up: ``default``, ``same-loop`` (``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0``: the replica runs
user code on its main loop instead of a second thread) and ``direct-ingress``
(``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``, experimental in Ray 2.60: no proxy, the replica serves HTTP).

    PYTHONPATH=. python bench/serve_hops.py [--variants default same-loop] [--streams 1 16 256]
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ray  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402
from ray import serve  # noqa: E402

from bench.serving import log, pct, stream_completion  # noqa: E402
from cluster.ray.ports import free_port  # noqa: E402

VARIANTS = {"default": {}, "same-loop": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"},
            "direct-ingress": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}}
EVENT_MANY = 'data: {"id":"x","object":"text_completion","created":0,"model":"m","choices":[{"index":0,' \
             '"text":"ab","logprobs":null,"token_ids":[%s],"finish_reason":null}]}\n\n'
EVENT = 'data: {"id":"x","object":"text_completion","created":0,"model":"m","choices":[{"index":0,"text":"ab",' \
        '"logprobs":null,"token_ids":[%d],"finish_reason":null}]}\n\n'


async def own_events(n: int):
    """``n`` made-up tokens as SSE events, made where the HTTP side runs."""
    for i in range(n):
        yield EVENT % i
        await asyncio.sleep(0)
    yield "data: [DONE]\n\n"


async def fanout_events(queue: asyncio.Queue, coalesce: bool, close):
    """One stream's SSE events from the step records fanned out to its ``queue`` (True: its last token); with
    ``coalesce``, an event carries every token queued for it. ``close`` runs when the stream ends."""
    i, done = 0, False
    try:
        while not done:
            done = await queue.get()
            count = 1
            while coalesce and not done and not queue.empty():
                done = queue.get_nowait()
                count += 1
            yield EVENT_MANY % ",".join(str(i + j) for j in range(count))
            i += count
        yield "data: [DONE]\n\n"
    finally:
        close()


def summarise(starts: list[float], times: list[list[float]], wall: float, cpu: float,
              tokens: list[int] | None = None) -> dict:
    """``times``: each stream's event arrivals; ``tokens``: each stream's tokens (default: one per event).
    ITL: a stream's mean gap per token, first to last (as bench/serving.py)."""
    tokens = tokens or [len(ts) for ts in times]
    ttft = [ts[0] - t0 for t0, ts in zip(starts, times) if ts]
    itl = [(ts[-1] - ts[0]) / (k - 1) for ts, k in zip(times, tokens) if k > 1]
    return {"items_s": sum(tokens) / wall, "events_s": sum(map(len, times)) / wall,
            "ttft_p50_ms": 1e3 * pct(ttft, 0.5), "ttft_p99_ms": 1e3 * pct(ttft, 0.99),
            "itl_p50_ms": 1e3 * pct(itl, 0.5), "itl_p99_ms": 1e3 * pct(itl, 0.99), "items": sum(tokens),
            "client_cpu": cpu / wall}


class Producer:
    """Stands in for the engine: yields made-up tokens, one Ray item each, or one item per step for all.

    ``add`` + ``subscribe`` is a step loop in miniature: streams are added by a call, and each step yields
    one record of every live stream's next token to the subscriber (issue 19's "one message per step")."""

    def __init__(self):
        self.live: dict[str, list[int]] = {}    # stream id -> [tokens left]
        self.wake = asyncio.Event()

    async def add(self, sid: str, n: int) -> None:
        self.live[sid] = [n]
        self.wake.set()

    async def subscribe(self):
        while True:
            if not self.live:
                self.wake.clear()
                await self.wake.wait()
                continue
            record = {}
            for sid, left in list(self.live.items()):
                left[0] -= 1
                record[sid] = left[0] == 0
                if left[0] == 0:
                    del self.live[sid]
            yield record
            await asyncio.sleep(0)

    async def stream(self, n: int):
        for i in range(n):
            yield i
            await asyncio.sleep(0)

    async def batched(self, num_streams: int, n: int):
        for i in range(n):
            yield [i] * num_streams
            await asyncio.sleep(0)


app = FastAPI()


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Hops:
    """Stands in for the OpenAI app: SSE events shaped like its own, made here or relayed from Producer."""

    def __init__(self):
        self.producer = ray.get_actor("producer", namespace="hops")
        self.queues: dict[str, asyncio.Queue] = {}
        self.follower = None

    @app.post("/own")
    async def own(self, request: Request):
        n = (await request.json())["n"]
        return StreamingResponse(own_events(n), media_type="text/event-stream")

    @app.post("/relay")
    async def relay(self, request: Request):
        n = (await request.json())["n"]
        gen = self.producer.stream.options(num_returns="streaming").remote(n)

        async def events():
            async for ref in gen:
                yield EVENT % (await ref)
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/fanout")
    async def fanout(self, request: Request):
        """One subscription to the producer's step records, fanned out here to the streams; with
        ``coalesce``, an event carries every token queued for its stream (vLLM's stream interval, adaptive)."""
        body = await request.json()
        n, coalesce = body["n"], body.get("coalesce", False)
        if self.follower is None or self.follower.done():
            self.follower = asyncio.get_running_loop().create_task(self._follow())
        sid = uuid.uuid4().hex
        queue = self.queues[sid] = asyncio.Queue()
        await self.producer.add.remote(sid, n)
        return StreamingResponse(fanout_events(queue, coalesce, lambda: self.queues.pop(sid, None)),
                                 media_type="text/event-stream")

    async def _follow(self):
        async for ref in self.producer.subscribe.options(num_returns="streaming").remote():
            for sid, last in (await ref).items():
                queue = self.queues.get(sid)
                if queue is not None:
                    queue.put_nowait(last)

    async def tokens(self, n: int):
        for i in range(n):
            yield i
            await asyncio.sleep(0)


class HttpActor:
    """The HTTP edge without Serve: uvicorn and the same FastAPI routes on a plain async actor's loop,
    with the step loop (``Producer``'s, in process) on that loop too: the colocated design's upper bound."""

    async def start(self, port: int) -> None:
        import uvicorn
        local = FastAPI()
        producer = Producer()
        queues: dict[str, asyncio.Queue] = {}

        async def follow():
            async for record in producer.subscribe():
                for sid, last in record.items():
                    queue = queues.get(sid)
                    if queue is not None:
                        queue.put_nowait(last)

        @local.post("/own")
        async def own(request: Request):
            n = (await request.json())["n"]
            return StreamingResponse(own_events(n), media_type="text/event-stream")

        @local.post("/fanout")
        async def fanout(request: Request):
            body = await request.json()
            n, coalesce = body["n"], body.get("coalesce", False)
            sid = uuid.uuid4().hex
            queue = queues[sid] = asyncio.Queue()
            await producer.add(sid, n)
            return StreamingResponse(fanout_events(queue, coalesce, lambda: queues.pop(sid, None)),
                                     media_type="text/event-stream")

        self.follower = asyncio.get_running_loop().create_task(follow())
        config = uvicorn.Config(local, host="127.0.0.1", port=port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.task = asyncio.get_running_loop().create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.05)


def child(variant: str, streams: list[int], tokens: int, port: int) -> list[dict]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="hops")
    producer = ray.remote(num_cpus=0, max_concurrency=1000)(Producer).options(name="producer").remote()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    handle = serve.run(Hops.bind(), name="hops", route_prefix="/")
    async def http(path: str, n: int, coalesce: bool = False) -> dict:
        body = json.dumps({"n": tokens, "coalesce": coalesce}).encode()
        cpu0, t0 = time.process_time(), time.perf_counter()
        res = await asyncio.gather(*(stream_completion("127.0.0.1", port, body, 300, path) for _ in range(n)))
        wall = time.perf_counter() - t0
        bad = [r.error for r in res if r.error or r.tokens != tokens]
        out = summarise([r.sent for r in res], [r.times for r in res], wall, time.process_time() - cpu0,
                        [r.tokens for r in res])
        return {**out, "errors": len(bad), "first_error": bad[0] if bad else None}

    async def via_handle(n: int) -> dict:
        async def one():
            t0, ts = time.perf_counter(), []
            async for _ in handle.options(stream=True).tokens.remote(tokens):
                ts.append(time.perf_counter())
            return t0, ts
        cpu0, t0 = time.process_time(), time.perf_counter()
        res = await asyncio.gather(*(one() for _ in range(n)))
        return summarise([r[0] for r in res], [r[1] for r in res], time.perf_counter() - t0, time.process_time() - cpu0)

    async def via_actor(n: int) -> dict:
        async def one():
            t0, ts = time.perf_counter(), []
            async for ref in producer.stream.options(num_returns="streaming").remote(tokens):
                await ref
                ts.append(time.perf_counter())
            return t0, ts
        cpu0, t0 = time.process_time(), time.perf_counter()
        res = await asyncio.gather(*(one() for _ in range(n)))
        return summarise([r[0] for r in res], [r[1] for r in res], time.perf_counter() - t0, time.process_time() - cpu0)

    async def via_batched(n: int) -> dict:
        queues = [asyncio.Queue() for _ in range(n)]

        async def one(q):
            t0, ts = time.perf_counter(), []
            for _ in range(tokens):
                await q.get()
                ts.append(time.perf_counter())
            return t0, ts
        cpu0, t0 = time.process_time(), time.perf_counter()
        readers = [asyncio.ensure_future(one(q)) for q in queues]
        async for ref in producer.batched.options(num_returns="streaming").remote(n, tokens):
            for q, tok in zip(queues, await ref):
                q.put_nowait(tok)
        res = await asyncio.gather(*readers)
        return summarise([r[0] for r in res], [r[1] for r in res], time.perf_counter() - t0, time.process_time() - cpu0)

    actor_port = free_port()
    if variant == "default":
        http_actor = ray.remote(num_cpus=0, max_concurrency=1000)(HttpActor).remote()
        ray.get(http_actor.start.remote(actor_port), timeout=60)

    async def direct(path: str, n: int, coalesce: bool = False) -> dict:
        body = json.dumps({"n": tokens, "coalesce": coalesce}).encode()
        cpu0, t0 = time.process_time(), time.perf_counter()
        res = await asyncio.gather(*(stream_completion("127.0.0.1", actor_port, body, 300, path) for _ in range(n)))
        wall = time.perf_counter() - t0
        bad = [r.error for r in res if r.error or r.tokens != tokens]
        out = summarise([r.sent for r in res], [r.times for r in res], wall, time.process_time() - cpu0,
                        [r.tokens for r in res])
        return {**out, "errors": len(bad), "first_error": bad[0] if bad else None}

    async def run_all() -> list[dict]:
        rows = []
        cases = [("http relay", lambda n: http("/relay", n)),
                 ("http fanout", lambda n: http("/fanout", n)),
                 ("http fanout coalesced", lambda n: http("/fanout", n, True)),
                 ("http", lambda n: http("/own", n)), ("handle", via_handle)]
        if variant == "default":
            cases += [("actor", via_actor), ("actor batched", via_batched),
                      ("uvicorn actor", lambda n: direct("/own", n)),
                      ("uvicorn actor fanout", lambda n: direct("/fanout", n)),
                      ("uvicorn actor coalesced", lambda n: direct("/fanout", n, True))]
        for name, fn in cases:
            await fn(1)      # warm-up
            for n in streams:
                row = {"variant": variant, "path": name, "streams": n, **(await fn(n))}
                log(f"{variant:<14} {name:<22} N={n:<4} {row['items_s']:8.0f} items/s  TTFT p50 "
                    f"{row['ttft_p50_ms']:7.1f} ms  ITL p50 {row['itl_p50_ms']:6.2f} ms")
                rows.append(row)
        return rows

    try:
        return asyncio.run(run_all())
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=900.0, help="per variant")
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        rows = child(args.child, args.streams, args.tokens, free_port())
        print("ROWS " + json.dumps(rows), flush=True)
        return 0
    rows = []
    for variant in args.variants:
        env = {**os.environ, **VARIANTS[variant], "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               "RAY_USAGE_STATS_ENABLED": "0"}
        cmd = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens), "--streams",
               *map(str, args.streams)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=args.timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            os.killpg(proc.pid, 9)
            proc.communicate()
            log(f"variant {variant} did not finish; killed")
            continue
        found = [line for line in out.splitlines() if line.startswith("ROWS ")]
        if proc.returncode or not found:
            log(f"variant {variant} failed (status {proc.returncode})")
            continue
        rows += json.loads(found[-1][5:])
    print(f"{'variant':<15}{'path':<23}{'streams':>7}{'items/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'ITL p50':>9}{'ITL p99':>9}{'events/s':>9}{'client':>8}")
    for r in rows:
        print(f"{r['variant']:<15}{r['path']:<23}{r['streams']:>7}{r['items_s']:>10.0f}{r['ttft_p50_ms']:>10.1f}"
              f"{r['ttft_p99_ms']:>10.1f}{r['itl_p50_ms']:>9.2f}{r['itl_p99_ms']:>9.2f}{r['events_s']:>9.0f}"
              f"{100 * r['client_cpu']:>7.0f}%"
              + (f"  {r['errors']} errors: {r['first_error']}" if r.get("errors") else ""))
    print("(ms; items = tokens; ITL = a stream's mean gap per token; client = this process's CPU share: the client, or the driver reading the stream)")
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "serve_hops", **r}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
