"""One engine step fanned out to N workers and back: plain actor calls, a Ray Compiled Graph, a shm ring.

Each step the driver (the engine) sends the encoded deltas of a decode step (``--requests`` requests,
about 10 KB at 256) to N reader actors, each decodes it as a worker would and answers 4 bytes; the step
ends when every answer is back (a broadcast to the tensor-parallel ranks of a node). Mechanisms:

- ``actor calls``: ``.remote`` on each actor, ``ray.get`` of all;
- ``compiled graph``: the same as a Ray Compiled Graph (``experimental_compile``), with Ray's default
  ``read_iteration_timeout`` (0.1 s) and with it at 5 s (``RAY_CGRAPH_read_iteration_timeout_s`` in the
  actors and the driver), the only knob that bears on how a reader waits;
- ``shm ring``: ``workers/shm_channel.py``, one broadcast ring to the N actors (each reads it in a
  thread) and one ring back from each; ``spin`` is how long a reader polls after a message before it
  sleeps on its socket;
- ``executor rings``: what ``RayExecutor`` runs on one node (``workers/runtime/step_loop.py`` in each
  actor, the engine's ``_Rings``): the N actors as the tensor-parallel ranks of one stage, so rank 0
  alone answers (an encoded ``StepOutput``, as a last stage does) and the others only read the step.

Per step: latency p50/p99 and the driver's CPU per step (``--work-ms`` makes each reader sleep that long
before it answers, as a GPU step would: then the driver's CPU is what waiting costs). Idle: after
``--idle-s`` seconds with nothing sent, each process's CPU share over the last ``--idle-window`` seconds.
``--floor`` first times the ring alone (plain processes, no Ray, no decoding). Each mechanism runs with
only its own actors alive (a polling actor would slow the others), and the
whole sequence ``--rounds`` times, so drift on this shared machine shows as a difference between rounds.

    PYTHONPATH=. python bench/fanout.py [--readers 1 2 4] [--steps 400] [--idle-s 30]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray.dag import InputNode, MultiOutputNode  # noqa: E402

from workers.wire import decode_step, encode_step  # noqa: E402
from workers.protocol import ScheduledChunk, StepInput  # noqa: E402
from workers.shm_channel import ShmBroadcast, ShmReader  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class EchoWorker:
    """Decodes the step as a worker would, optionally "computes" for ``work_s``, answers 4 bytes."""

    def __init__(self, work_s: float = 0.0):
        self.work_s = work_s
        self._thread = None

    def pid(self) -> int:
        return os.getpid()

    def execute(self, payload: bytes) -> bytes:
        step = decode_step(payload)
        if self.work_s:
            time.sleep(self.work_s)
        return len(step.chunks).to_bytes(4, "little")

    def serve_ring(self, handle, index: int, spin_s: float):
        """Read steps from the ring in a thread, answer on a ring of our own; returns its handle."""
        reader = ShmReader(handle, index, spin_s=spin_s)
        self._reply = ShmBroadcast(1, slots=4, slot_bytes=4096, spin_s=spin_s)

        def loop():
            try:
                while True:
                    self._reply.send(self.execute(reader.recv()))
            except Exception:  # noqa: BLE001 - the channel closed: the bench is over
                reader.close()
                self._reply.close()

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self._reply.handle

    def serve_loop(self, role: dict) -> None:
        """The executor's step loop (rank ``role["rank"]`` of one stage) over this echo worker."""
        from workers.runtime.step_loop import StepLoop
        self._loop = StepLoop(_EchoStage(self), f"echo-{role['index']}", **role)
        self._thread = threading.Thread(target=self._loop.run, daemon=True)
        self._thread.start()

    def stop_ring(self) -> bool:
        """After the driver closed the ring: the thread ends, closing our reply ring (unlinking it)."""
        self._thread.join(10)
        return not self._thread.is_alive()


class _EchoStage:
    """A worker for the step loop: the step decoded (by the loop), the sleep, a one-token answer."""

    def __init__(self, echo: EchoWorker):
        self.echo = echo

    def execute(self, step, hidden=None, on_checked=None):
        from workers.protocol import StepOutput
        if on_checked is not None:
            on_checked()
        if self.echo.work_s:
            time.sleep(self.echo.work_s)
        return StepOutput(step.step_id, {"req-0": len(step.chunks)})


def decode_payload(num_requests: int) -> bytes:
    chunks = [ScheduledChunk(f"req-{i}", [1000 + i], 4000 + i, [[7000 + i], [9000 + i]]) for i in range(num_requests)]
    return encode_step(StepInput(1, chunks))


class Mechanism:
    """Set up N readers, ``step()`` once, ``close()``; ``pids`` of the reader processes."""

    def __init__(self, n: int, work_s: float, env: dict | None = None):
        cls = ray.remote(num_cpus=0, runtime_env={"env_vars": env or {}})(EchoWorker)
        self.actors = [cls.remote(work_s) for _ in range(n)]
        self.pids = ray.get([a.pid.remote() for a in self.actors], timeout=120)

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a)


class ActorCalls(Mechanism):
    def __init__(self, n, work_s, payload):
        super().__init__(n, work_s)
        self.payload = payload

    def step(self):
        ray.get([a.execute.remote(self.payload) for a in self.actors], timeout=60)


class CompiledGraph(Mechanism):
    def __init__(self, n, work_s, payload, read_iteration_timeout_s: float | None = None):
        env = {"RAY_CGRAPH_read_iteration_timeout_s": str(read_iteration_timeout_s)} if read_iteration_timeout_s else {}
        super().__init__(n, work_s, env)
        from ray.dag import DAGContext
        ctx = DAGContext.get_current()
        self._saved = ctx.read_iteration_timeout
        if read_iteration_timeout_s:
            ctx.read_iteration_timeout = read_iteration_timeout_s
        with InputNode() as inp:
            dag = MultiOutputNode([a.execute.bind(inp) for a in self.actors])
        self.dag = dag.experimental_compile()
        self.payload = payload

    def step(self):
        ray.get(self.dag.execute(self.payload), timeout=60)

    def close(self):
        from ray.dag import DAGContext
        try:
            self.dag.teardown()
        finally:
            DAGContext.get_current().read_iteration_timeout = self._saved
            super().close()


class ShmRing(Mechanism):
    def __init__(self, n, work_s, payload, spin_s: float):
        super().__init__(n, work_s)
        self.ring = ShmBroadcast(n, slots=8, slot_bytes=64 << 10, spin_s=spin_s)
        handles = ray.get([a.serve_ring.remote(self.ring.handle, i, spin_s) for i, a in enumerate(self.actors)],
                          timeout=120)
        self.replies = [ShmReader(h, 0, spin_s=spin_s) for h in handles]
        self.payload = payload

    def step(self):
        self.ring.send(self.payload, timeout=60)
        for r in self.replies:
            r.recv(timeout=60)

    def close(self):
        self.ring.close()
        for r in self.replies:
            r.close()
        ray.get([a.stop_ring.remote() for a in self.actors], timeout=30)
        super().close()


class ExecutorRings(Mechanism):
    def __init__(self, n, work_s, payload):
        from cluster.ray.executors import _Rings
        super().__init__(n, work_s)
        self.rings = _Rings(1, n)
        ray.get([a.serve_loop.remote(role) for a, role in zip(self.actors, self.rings.roles())], timeout=120)
        self.payload = payload

    def step(self):
        handle = self.rings.send(self.payload, False, 60)
        self.rings.wait_output((handle, 1), None, 60)

    def close(self):
        self.rings.close()
        ray.get([a.stop_ring.remote() for a in self.actors], timeout=30)
        super().close()


MECHANISMS = {
    "actor calls": lambda n, w, p: ActorCalls(n, w, p),
    "compiled graph": lambda n, w, p: CompiledGraph(n, w, p),
    "compiled graph, read timeout 5 s": lambda n, w, p: CompiledGraph(n, w, p, 5.0),
    "shm ring, spin 0": lambda n, w, p: ShmRing(n, w, p, 0.0),
    "shm ring, spin 100 us": lambda n, w, p: ShmRing(n, w, p, 1e-4),
    "executor rings": lambda n, w, p: ExecutorRings(n, w, p),
}


def _floor_echo(handle, index: int, replies, spin_s: float) -> None:
    reader = ShmReader(handle, index, spin_s=spin_s)
    reply = ShmBroadcast(1, slots=4, slot_bytes=4096, spin_s=spin_s)
    replies.put(reply.handle)
    try:
        while True:
            reader.recv()
            reply.send(b"ok")
    except Exception:  # noqa: BLE001 - the ring closed
        reader.close()
        reply.close()


def ring_floor(n: int, spin_s: float, payload_bytes: int, steps: int) -> list[float]:
    """The ring alone: N plain processes (no Ray) echo a payload of random bytes without decoding it."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    ring = ShmBroadcast(n, slots=8, slot_bytes=64 << 10, spin_s=spin_s)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_floor_echo, args=(ring.handle, i, queue, spin_s)) for i in range(n)]
    for p in procs:
        p.start()
    replies = [ShmReader(queue.get(timeout=120), 0, spin_s=spin_s) for _ in procs]
    payload, lat = os.urandom(payload_bytes), []
    try:
        for k in range(steps + 50):
            t0 = time.perf_counter()
            ring.send(payload, timeout=60)
            for r in replies:
                r.recv(timeout=60)
            if k >= 50:
                lat.append(time.perf_counter() - t0)
    finally:
        ring.close()
        for r in replies:
            r.close()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return lat


def measure(mech, steps: int) -> tuple[list[float], float]:
    for _ in range(10):
        mech.step()
    lat = []
    cpu0 = time.process_time()
    for _ in range(steps):
        t0 = time.perf_counter()
        mech.step()
        lat.append(time.perf_counter() - t0)
    return lat, (time.process_time() - cpu0) / steps


def idle_cpu(mech, idle_s: float, window: float) -> dict:
    time.sleep(max(0.0, idle_s - window))
    pids = {"driver": os.getpid(), **{f"reader{i}": p for i, p in enumerate(mech.pids)}}
    before = {k: cpu_s(p) for k, p in pids.items()}
    time.sleep(window)
    return {k: (cpu_s(p) - before[k]) / window for k, p in pids.items()}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--readers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--work-ms", type=float, nargs="+", default=[0.0, 20.0])
    ap.add_argument("--work-steps", type=int, default=50, help="steps per cell with work > 0")
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--idle-window", type=float, default=10.0)
    ap.add_argument("--idle-readers", type=int, default=None, help="idle CPU measured with this many readers "
                                                                   "(default: the largest)")
    ap.add_argument("--only", nargs="+", choices=list(MECHANISMS), default=list(MECHANISMS))
    ap.add_argument("--floor", action="store_true", help="first, the ring alone between plain processes")
    ap.add_argument("--out", help="append JSON lines here")
    args = ap.parse_args()
    payload = decode_payload(args.requests)
    if args.floor:
        for n in args.readers:
            for spin in (0.0, 1e-4):
                lat = ring_floor(n, spin, len(payload), args.steps)
                print(f"floor: shm ring without Ray or decoding, readers {n}, spin {1e6 * spin:3.0f} us: "
                      f"p50 {1e3 * pct(lat, 0.5):.3f} ms  p99 {1e3 * pct(lat, 0.99):.3f} ms", flush=True)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(f"step payload: {len(payload)} bytes ({args.requests} decode requests); 2 cores, load "
          f"{os.getloadavg()[0]:.1f} at start", flush=True)
    rows = []
    try:
        for work_ms in args.work_ms:
            steps = args.steps if work_ms == 0 else args.work_steps
            for n in args.readers:
                cells = {name: ([], []) for name in args.only}
                for _ in range(args.rounds):
                    for name in args.only:
                        mech = MECHANISMS[name](n, work_ms / 1e3, payload)
                        try:
                            lat, cpu = measure(mech, steps)
                        finally:
                            mech.close()
                        cells[name][0].extend(lat)
                        cells[name][1].append(cpu)
                for name, (lat, cpus) in cells.items():
                    row = {"mechanism": name, "readers": n, "work_ms": work_ms, "p50_ms": 1e3 * pct(lat, 0.5),
                           "p99_ms": 1e3 * pct(lat, 0.99), "mean_ms": 1e3 * statistics.mean(lat),
                           "driver_cpu_ms_per_step": 1e3 * statistics.mean(cpus), "steps": len(lat)}
                    rows.append(row)
                    print(f"work {work_ms:>4.0f} ms  readers {n}  {name:<34} p50 {row['p50_ms']:7.3f} ms  "
                          f"p99 {row['p99_ms']:8.3f} ms  driver CPU {row['driver_cpu_ms_per_step']:6.3f} ms/step",
                          flush=True)
        n = args.idle_readers or max(args.readers)
        for name in args.only:
            mech = MECHANISMS[name](n, 0.0, payload)
            try:
                for _ in range(20):
                    mech.step()
                shares = idle_cpu(mech, args.idle_s, args.idle_window)
            finally:
                mech.close()
            row = {"mechanism": name, "readers": n, "idle_s": args.idle_s, "idle_cpu": shares}
            rows.append(row)
            print(f"idle {args.idle_s:.0f} s, {n} readers  {name:<34} " + "  ".join(
                f"{k} {100 * v:5.1f}%" for k, v in shares.items()), flush=True)
    finally:
        ray.shutdown()
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps({"bench": "fanout", **row}) + "\n")


if __name__ == "__main__":
    main()
