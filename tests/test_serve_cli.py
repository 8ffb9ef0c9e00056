"""The README's main job as an operator runs it: ``python -m cluster serve`` (its forward compiled, the default
on one CPU worker) answers on its port, and Ctrl-C stops it with a goodbye, exit status 0 and no traceback,
even when pressed twice, taking its Ray runtime down with it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PORT = 8765


def raylets() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "raylet"], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def ray_descendants(pid: int) -> dict[int, tuple[str, int]]:
    """{pid: (process title, niceness)} of the Ray worker processes (titled ``ray::...``) below ``pid``."""
    parent, stat = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode()
            except (OSError, IndexError):
                continue                         # gone meanwhile
            parent[int(entry.name)] = int(fields[1])
            stat[int(entry.name)] = (title, int(fields[16]))   # fields 4 and 19 of stat(5): ppid, nice
    below, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - below
        below |= frontier
    return {p: stat[p] for p in below if stat[p][0].startswith("ray::")}


def test_serve_answers_then_a_double_ctrl_c_stops_it_cleanly_with_its_ray_runtime():
    before = raylets()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_worker_niceness", None)         # the conftest's; the server must choose it itself
    proc = subprocess.Popen([sys.executable, "-m", "cluster", "serve", "--port", str(PORT), "--num-cpus", "2"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "serve did not become ready in 240 s"
            time.sleep(1)
        r = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", timeout=60,
                       json={"model": "swakv-tiny-hybrid", "prompt": "The ", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # the serving path runs at the operator's priority, not Ray's default nice 15 for workers
        actors = ray_descendants(proc.pid)
        assert {"ray::EngineService", "ray::WorkerActor"} <= {title.split(".")[0] for title, _ in actors.values()}
        assert {nice for _, nice in actors.values()} == {0}, actors
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGINT)          # an impatient operator, or a wrapper that forwards it too
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "swakv: compiling the model's forward first" in out    # the default on one CPU worker
    assert "Traceback" not in err, err
    assert "swakv: shutting down ..." in err and "told 0 in-flight request(s)" in err
    assert raylets() <= before                   # the runtime it started is gone


def test_a_stop_signal_landing_inside_a_string_exec_still_lets_the_server_exit_0(tmp_path):
    # Under ``python -m`` CPython ends the process by SIGINT once a bare KeyboardInterrupt has left a string
    # exec, even if caught: a clean stop exited 254 in CI when the signal landed in one (dataclasses and
    # namedtuples build methods so). The stop handler raises a subclass, which does not trip that.
    (tmp_path / "stop_in_exec.py").write_text(textwrap.dedent("""
        import os, signal, sys
        from cluster.serve.supervisor import raise_on_stop
        raise_on_stop((signal.SIGTERM,))
        try:
            exec("os.kill(os.getpid(), signal.SIGTERM)\\nwhile True: pass", {"os": os, "signal": signal})
        except KeyboardInterrupt:
            print("stopped", flush=True)
            sys.exit(0)
    """))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, "-m", "stop_in_exec"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (0, "stopped\n"), proc.stderr


def test_a_stop_signal_that_lands_inside_ray_get_still_names_its_signal(ray_runtime):
    """Ray turns the handler's ``StopRequested`` raised inside ``ray.get`` into a plain ``KeyboardInterrupt``;
    what stopped the process (``swakv loadtest`` prints it, and exits 128 + it) is SIGTERM all the same."""
    import threading

    from cluster.serve.supervisor import StopRequested, raise_on_stop

    @ray_runtime.remote
    def sleeps():
        time.sleep(60)
    ref, caught = sleeps.remote(), None
    replaced = raise_on_stop((signal.SIGTERM,))
    try:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        try:
            ray_runtime.get(ref, timeout=30)
        except KeyboardInterrupt as exc:
            caught = exc
        stopped_by = StopRequested.signal_of(caught)
    finally:
        for signum, handler in replaced.items():
            signal.signal(signum, handler)
        StopRequested.received = None
        ray_runtime.cancel(ref, force=True)
    assert type(caught) is KeyboardInterrupt and stopped_by == signal.SIGTERM
    assert StopRequested.signal_of(StopRequested(signal.SIGHUP)) == signal.SIGHUP
    assert StopRequested.signal_of(KeyboardInterrupt()) == signal.SIGINT       # nothing took a signal: Ctrl-C


def test_a_stop_the_code_it_landed_in_wrapped_is_still_a_stop():
    # CI (fortieth session): the second Ctrl-C's stop landed while the server imported httpx, inside a class
    # body's __set_name__, which Python 3.11 re-raises as RuntimeError; the goodbyes ran and it exited 1
    from cluster.serve.supervisor import StopRequested

    class Landing:
        def __set_name__(self, owner, name):
            raise StopRequested(signal.SIGTERM)

    with pytest.raises(BaseException) as caught:
        type("Task", (), {"stop_time": Landing()})
    assert isinstance(caught.value, (RuntimeError, StopRequested))   # wrapped on 3.11, as is from 3.12 on
    assert StopRequested.behind(caught.value)
    assert not StopRequested.behind(RuntimeError("the engine failed"))
    assert not StopRequested.behind(None)


def test_sleep_factor_is_refused_without_simulated_workers_and_when_negative():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    alone = subprocess.run([sys.executable, "-m", "cluster", "serve", "--sleep-factor", "1"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
    assert alone.returncode == 2 and "sleep_factor needs simulated_gpu" in alone.stderr
    negative = subprocess.run([sys.executable, "-m", "cluster", "serve", "--simulated-gpu", "H100-80GB",
                               "--sleep-factor", "-0.5"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)
    assert negative.returncode == 2 and "sleep_factor must be a finite number >= 0, got -0.5" in negative.stderr
