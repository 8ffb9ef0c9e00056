"""One streamed chat completion at a time against running servers: TTFT p50 and ITL p50 of each.

The served path's fixed cost per request and per token, with nothing queued beside it: each request opens
a new connection, sends a 128-character prompt (32 tokens out, temperature 0) and reads its SSE events;
TTFT is the send to the first content event, ITL every gap between two content events. The first
``--skip`` requests warm the path up and are not counted. With several ``--port``s each prompt goes to
every server in turn (the order reversed every other round), so that the machine's drift from minute to
minute, which on a shared 2-core host is larger than the differences between builds, falls on all alike.

    python bench/one_stream.py --port 8000 --requests 60
    python bench/one_stream.py --port 8000 8001 8002:/path/to/model --requests 200    # side by side
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import time

WORDS = "the of and to in is that for it as with was on be by this are from or".split()


def one_request(port: int, model: str, text: str) -> list[float]:
    """Seconds from sending to each content event."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 32,
                       "temperature": 0, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.connect()
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        times = []
        while line := response.readline():
            if line.startswith(b"data: [DONE]"):
                break
            if line.startswith(b"data: "):
                choices = json.loads(line[6:]).get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):
                    times.append(time.perf_counter() - t0)
        return times
    finally:
        conn.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", nargs="+", default=["8000"], metavar="PORT[:MODEL]",
                   help="servers on 127.0.0.1, each with the model name it serves (default: --model)")
    p.add_argument("--model", default="swakv-tiny-hybrid")
    p.add_argument("--requests", type=int, default=60, help="prompts, each sent to every server")
    p.add_argument("--skip", type=int, default=5, help="warm-up requests not counted")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    servers = [(int(port), model or args.model) for port, _, model in (s.partition(":") for s in args.port)]
    rng = random.Random(args.seed)
    ttft = {s: [] for s in servers}
    itl = {s: [] for s in servers}
    for i in range(args.requests):
        text = ""
        while len(text) < 128:
            text += rng.choice(WORDS) + " "
        for port, model in servers if i % 2 == 0 else servers[::-1]:
            times = one_request(port, model, text[:128])
            if i >= args.skip and times:
                ttft[port, model].append(1e3 * times[0])
                itl[port, model].extend(1e3 * (b - a) for a, b in zip(times, times[1:]))
            time.sleep(0.05)
    for server in servers:
        t, gaps = ttft[server], itl[server]
        if not t:
            raise SystemExit("no request was counted (raise --requests above --skip)")
        print(f"{server[0]}: TTFT p50 {statistics.median(t):.2f} ms  min {min(t):.2f}  "
              f"ITL p50 {statistics.median(gaps):.2f} ms  (n={len(t)}, events/req {len(gaps) / len(t) + 1:.1f})")


if __name__ == "__main__":
    main()
