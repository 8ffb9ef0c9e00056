"""A port for a server started beside a Ray runtime (a load test's HTTP app, a bench's or a test's server)
that nothing else on the host takes before the server binds it.

Asking the kernel for port 0 and handing the number to a server started later races: the number comes from
the ephemeral range, from which every ``bind(0)`` and every outgoing connection also draws, and Ray's
processes do both all the time while a server starts (a fresh-clone test run lost a module's 43 tests to
Serve's proxy failing to bind 127.0.0.1:43933). So the port is drawn below the ephemeral range and above
Ray's worker ports (10002-19999 by default), where only explicit binds land, and checked free.
"""
from __future__ import annotations

import random
import socket

RAY_WORKER_PORTS_END = 20_000


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768                   # Linux's default


def free_port() -> int:
    low, high = RAY_WORKER_PORTS_END, ephemeral_low()
    if high - low < 1_000:              # a host whose ephemeral range starts low: the kernel's pick, racy as it is
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high - 1} after 200 tries")
