"""Stopping ``python -m cluster serve`` however the signal arrives: SIGINT or SIGTERM to the main process or
to its whole process group (a terminal's Ctrl-C, ``kill -TERM -PGID``, a service manager), or the main
process killed outright. A stream in flight is told that the server is shutting down, and within 30 s
nothing of ours is left (no process that inherited the server's environment: the server, GCS, raylet,
Ray's workers; no shared-memory segment any of them made) and the port is free.

The cases share one port, in order: each server's start on it proves the stop before it freed it at once.
Every process the server starts carries a marker in its environment, which is how they are found, and so does
every session they run in: Ray retitles its agents (``ray::DashboardAgent``), which overwrites their environment
and the marker with it, but not their session.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from cluster.ray.ports import free_port


ROOT = Path(__file__).resolve().parents[1]
STOP_WITHIN_S = 30.0
PORT = free_port()


def processes_marked(mark: bytes, sessions: frozenset[int] = frozenset()) -> dict[int, str]:
    """pid -> command line of every live process whose environment holds ``mark`` or which runs in one of
    ``sessions`` (zombies are neither)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _ppid, _pgid, sid = f.read().rsplit(")", 1)[1].split()[:4]
            if state == "Z":
                continue
            if int(sid) not in sessions:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark not in f.read().split(b"\0"):
                        continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
    return found


def sessions_of(pids) -> frozenset[int]:
    """The session ids of ``pids`` that are still alive."""
    sessions = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                sessions.add(int(f.read().rsplit(")", 1)[1].split()[3]))
        except OSError:
            continue
    return frozenset(sessions)


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as a server binds it (TIME_WAIT is fine)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def start_server(mark: str) -> subprocess.Popen:
    """The server in a process group of its own (as a shell starts a job), once it announces it serves on
    ``PORT``: by then ``/health`` says it is ready and routable (the router follows its engine)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SWAKV_SHUTDOWN_TEST": mark}
    proc = subprocess.Popen([sys.executable, "-m", "cluster", "serve", "--port", str(PORT), "--num-cpus", "2",
                             "--num-blocks", "256", "--no-compile-model"], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    announced = threading.Event()

    def read_stdout():   # drained to the end, so the server never blocks on a full pipe
        for line in proc.stdout:
            if line.startswith(f"swakv: serving swakv-tiny-hybrid on http://127.0.0.1:{PORT}"):
                announced.set()

    threading.Thread(target=read_stdout, daemon=True).start()
    deadline = time.monotonic() + 240
    while not announced.wait(0.5):
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"serve exited with {proc.returncode} before it was ready:\n{err[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("serve did not announce itself in 240 s")
    health = httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=10)
    assert (health.status_code, health.json()["status"], health.json()["routable"]) == (200, "ok", 1)
    return proc


def stream_in_flight() -> tuple[list[dict], threading.Thread]:
    """A long streamed completion, returned once its first token has arrived; its events keep coming in."""
    events: list[dict] = []
    started = threading.Event()

    def read():
        body = {"model": "swakv-tiny-hybrid", "prompt": "The ", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{PORT}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        started.set()
        except httpx.HTTPError as exc:
            events.append({"transport_error": repr(exc)})
        finally:
            started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(120) and "choices" in events[0], events[:1]
    return events, reader


def wait_until_gone(mark: bytes, sessions: frozenset[int], proc: subprocess.Popen) -> tuple[float, dict[int, str]]:
    """Seconds until no process of ours is left and the port is free (or what is left at the deadline)."""
    t0 = time.monotonic()
    while True:
        proc.poll()   # reap the main process: a zombie is not a process of ours
        left = processes_marked(mark, sessions)
        if not left and port_is_free(PORT):
            return time.monotonic() - t0, {}
        if time.monotonic() - t0 > STOP_WITHIN_S:
            return time.monotonic() - t0, left
        time.sleep(0.25)


@pytest.mark.parametrize("sig, target", [pytest.param(sig, target, id=f"{sig.name}-{target}") for sig, target in (
    (signal.SIGTERM, "group"),    # kill -TERM -PGID: systemd's default, a container runtime
    (signal.SIGINT, "group"),     # a terminal's Ctrl-C
    (signal.SIGTERM, "main"),     # kill PID
    (signal.SIGINT, "main"),
    (signal.SIGKILL, "main"),     # the main process killed outright: what it started must go too
)])
def test_serve_stops_completely_within_30_s_however_the_signal_arrives(sig, target):
    token = uuid.uuid4().hex
    mark = f"SWAKV_SHUTDOWN_TEST={token}".encode()
    proc = start_server(token)
    sessions = frozenset()
    try:
        assert len(processes_marked(mark)) >= 4          # the server, GCS, raylet, workers: all marked
        events, reader = stream_in_flight()
        sessions = sessions_of(processes_marked(mark))
        ours = processes_marked(mark, sessions)
        assert any(cmd.startswith("ray::DashboardAgent") for cmd in ours.values()), ours   # found by session
        if target == "group":
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        took, left = wait_until_gone(mark, sessions, proc)
        assert left == {}, f"{len(left)} processes left {took:.0f} s after {sig.name} to the {target}: {left}"
        assert port_is_free(PORT)
        segments = sorted(n for n in os.listdir("/dev/shm") if any(n.startswith(f"swakv-{pid}-") for pid in ours))
        assert segments == [], f"left in /dev/shm after {sig.name} to the {target}: {segments}"
        reader.join(10)
        assert events[-1].get("error", {}).get("type") == "server_shutting_down", events[-1]
        out, err = proc.communicate(timeout=10)
        assert "told 1 in-flight request(s) that the server is shutting down" in err, err[-3000:]
        assert "did not take the shutdown" not in err and "Traceback" not in err, err[-3000:]
        assert "graceful_shutdown failed" not in err, err[-3000:]
        if sig != signal.SIGKILL:
            assert proc.returncode == 0, err[-3000:]
    finally:
        for pid in processes_marked(mark, sessions):   # a failed case must not leave anything to the next one
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
