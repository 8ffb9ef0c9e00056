"""The Ray executor: one worker actor per device (``worker_actor.WorkerActor``), placed by Ray.

Same interface as ``cluster.engine.executor.LocalExecutor`` (``execute``, ``submit`` / ``collect``,
``restart``, ``shutdown``; ``WorkerFailure`` when a worker is lost). Ray places the workers, owns their
lifetime and reports their death; it is not in the step's path when every worker shares the engine's
node: then the engine writes each encoded step (``workers.wire``) once to a shared-memory ring that all
workers read, stages hand hidden states on through link rings, and the last stage's rank 0 answers
on a reply ring (``workers.runtime.step_loop``). Nothing polls: an idle worker sleeps on its ring, and
so does the engine while it waits for a step. Workers on other nodes get each step by plain actor calls.

Faults: a step refused because of one request raises that ``RequestError`` (from ``submit`` when it
was submitted alone, before the next is scheduled, as asynchronous scheduling needs); a worker that
dies (its pid gone, its ring's writer gone, Ray's actor error) or does not answer within
``step_timeout_s`` raises ``WorkerFailure``; ``restart`` makes new actors and new rings. The engine makes
every ring and removes their names from /dev/shm as soon as the workers have mapped them, so nothing is
left there however the processes end.
"""
from __future__ import annotations

import itertools
import logging
import os
import time

import msgpack

from workers.protocol import StepInput, StepOutput
from workers.runtime.step_loop import (ACK, ERROR, JOIN, OUTPUT, POLL_S, SPIN_S, STEP, STEP_ACK, frame, load_error,
                                       unframe)
from workers.shm_channel import ChannelError, ChannelTimeout, ShmBroadcast, ShmReader, ShmSegment, process_alive
from workers.wire import decode_output, encode_step

from cluster.engine.engine import WorkerFailure

from .worker_actor import WorkerActor

log = logging.getLogger("swakv.executor")


def _owner() -> str:
    """``namespace.actor-name.`` of the named actor starting the workers (the engine), else ""."""
    import ray
    context = ray.get_runtime_context()
    actor = context.get_actor_name() if context.get_actor_id() else None
    return f"{context.namespace}.{actor}." if actor else ""


def _remove_stale_groups(owner: str, token: str) -> None:
    """Remove the placement groups a dead predecessor of this named engine left behind.

    A group outlives the actor that created it (Ray ties it to the job), so an engine that Ray restarts
    after a crash would find its predecessor's devices still reserved and could never place its own
    workers. An actor name is unique in its namespace, so a live group under this name and another
    process's token is a dead predecessor's."""
    import ray
    for info in ray.util.placement_group_table().values():
        name = info.get("name") or ""
        if f"-ranks-{owner}" in name and not name.endswith(f"-{token}") and info.get("state") != "REMOVED":
            ray.util.remove_placement_group(ray.util.get_placement_group(name))


class RayExecutor:
    """One worker actor per device, in one placement group named for what it holds (a bundle per stage).

    ``replica_set``: the name prefix the engines of one data-parallel deployment share; the group is then
    placed on nodes none of them uses, when the cluster has such nodes (``_place_apart``).

    ``stage_kwargs`` holds one entry per worker, stage-major: ``ranks_per_stage`` tensor-parallel ranks
    (with ``tensor_parallel_size`` / ``tensor_parallel_rank`` set) per pipeline stage. Ranks are packed; stages too unless
    ``spread_stages`` asks for different nodes. Each step's encoded deltas go to every actor; every rank
    of stage ``k`` receives rank 0 of stage ``k-1``'s hidden states, never passing through the engine.
    ``shm_rings=False`` sends steps by actor calls even on one node (benches compare the two).
    """

    in_process = False

    @classmethod
    def create(cls, stage_kwargs: list[dict], args, ranks_per_stage: int, *,
               replica_set: str | None = None) -> RayExecutor:
        """What ``build_engine`` calls: placed as the engine arguments (``EngineArgs``) say."""
        return cls(stage_kwargs, num_gpus_per_worker=args.num_gpus_per_worker,
                   num_cpus_per_worker=args.num_cpus_per_worker, spread_stages=args.spread_stages,
                   ranks_per_stage=ranks_per_stage, replica_set=replica_set)

    def __init__(self, stage_kwargs: list[dict], *, num_gpus_per_worker: float = 0.0, num_cpus_per_worker: float = 1.0,
                 spread_stages: bool = False, step_timeout_s: float = 300.0, start_timeout_s: float = 600.0,
                 placement_timeout_s: float = 120.0,
                 shm_rings: bool = True, ranks_per_stage: int = 1, replica_set: str | None = None,
                 spread_wait_s: float = 5.0):
        if len(stage_kwargs) % ranks_per_stage:
            raise ValueError(f"{len(stage_kwargs)} workers do not split into stages of {ranks_per_stage} ranks")
        self.stage_kwargs = stage_kwargs
        self.ranks_per_stage = ranks_per_stage
        self.shm_rings = shm_rings
        self._rings: _Rings | None = None
        self.num_gpus = num_gpus_per_worker
        self.num_cpus = num_cpus_per_worker
        self.spread_stages = spread_stages
        self.step_timeout_s = step_timeout_s
        self.start_timeout_s = start_timeout_s
        self.placement_timeout_s = placement_timeout_s
        self.replica_set = replica_set      # engine-name prefix of data-parallel siblings to keep away from
        self.spread_wait_s = spread_wait_s
        self.last_payload_bytes = 0
        self.last_wait_s = 0.0
        self.last_joined: set = set()       # handles of the joiners the workers took with the last ``submit``
        self._joins: list = []              # handles of the joiners sent while ``submit`` waits
        self.actors: list = []
        self.pids: list[int] = []
        self._stages: list[list] = []
        self.worker_names: list[str] = []
        self.placement_group = None
        self._generation = 0
        self._start()

    def _start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._generation += 1
        n = len(self.stage_kwargs)
        tp = self.ranks_per_stage
        pp = n // tp
        # One bundle per stage holding all its ranks' devices: a bundle lives on one node, so a stage's
        # tensor-parallel ranks are always packed; stages are packed, or spread when asked.
        bundle = {"CPU": self.num_cpus * tp, **({"GPU": self.num_gpus * tp} if self.num_gpus else {})}
        strategy = "SPREAD" if self.spread_stages and pp > 1 else "PACK"
        # Unique per start: a restarted engine must not meet the names of its dead predecessor's workers.
        token = f"{os.getpid()}-{self._generation}"
        owner = _owner()
        name = f"swakv-{pp}-stages-of-{tp}-ranks-{owner}{token}"
        if self._generation == 1 and owner:
            _remove_stale_groups(owner, token)
        self.placement_group = self._place_apart([dict(bundle) for _ in range(pp)], strategy, name)
        if self.placement_group is None:
            self.placement_group = placement_group([dict(bundle) for _ in range(pp)], strategy=strategy, name=name)
        try:
            ray.get(self.placement_group.ready(), timeout=self.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.placement_group)
            raise RuntimeError(f"placement group {name} ({pp} x {bundle}, {strategy}) could not be placed within "
                               f"{self.placement_timeout_s:.0f} s: the cluster lacks the resources") from None
        actor_cls = ray.remote(WorkerActor)
        env = {"env_vars": {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
                            "OMP_WAIT_POLICY": "PASSIVE"}}   # ranks sharing cores must not spin
        self.worker_names = [f"swakv-worker-stage{i // tp}-rank{i % tp}-{token}" for i in range(n)]
        self.actors = [
            actor_cls.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0, runtime_env=env, name=name,
                              enable_task_events=False,
                              scheduling_strategy=PlacementGroupSchedulingStrategy(
                                  placement_group=self.placement_group, placement_group_bundle_index=i // tp)
                              ).remote(kwargs)
            for i, (kwargs, name) in enumerate(zip(self.stage_kwargs, self.worker_names))]
        try:
            rendezvous = [None] * n
            if tp > 1 and not self._simulated:      # simulated ranks share nothing: no collectives
                host, port = ray.get(self.actors[0].address.remote(), timeout=self.start_timeout_s)
                stage_ranks = [list(range(s, s + tp)) for s in range(0, n, tp)]
                rendezvous = [dict(address=f"{host}:{port}", rank=i, world_size=n, stage=i // tp,
                                   stage_ranks=stage_ranks) for i in range(n)]
            started = ray.get([a.setup.remote(r) for a, r in zip(self.actors, rendezvous)], timeout=self.start_timeout_s)
            self.pids = [pid for pid, _ in started]
            self._stages = [self.actors[s:s + tp] for s in range(0, n, tp)]
            here = ray.get_runtime_context().get_node_id()
            if self.shm_rings and all(node == here for _, node in started):
                self._rings = _Rings(pp, tp, joins=not self._simulated)
                ray.get([a.serve.remote(name, rings) for a, name, rings
                         in zip(self.actors, self.worker_names, self._rings.roles())], timeout=self.start_timeout_s)
                self._rings.unlink()        # every worker mapped its rings in ``serve``: the names may go
        except Exception as exc:  # noqa: BLE001 - a worker that cannot start is a start-up error
            self.shutdown()
            raise RuntimeError(f"worker actors failed to start: {exc}") from exc

    def _place_apart(self, bundles: list[dict], strategy: str, name: str):
        """The placement group on nodes holding no data-parallel sibling's workers, when there are such
        nodes big enough for a bundle and it is placed within ``spread_wait_s``; else None (place anywhere).
        Ray spreads the bundles of one group, not groups: siblings' nodes are read from their groups' names."""
        import ray
        from ray.util.placement_group import placement_group
        if not self.replica_set:
            return None
        fragment = f"-ranks-{ray.get_runtime_context().namespace}.{self.replica_set}-"
        taken = {node for info in ray.util.placement_group_table().values()
                 if fragment in (info.get("name") or "") and info.get("name") != name and info.get("state") == "CREATED"
                 for node in (info.get("bundles_to_node_id") or {}).values()}
        if not taken:
            return None
        room = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in taken
                and all(n.get("Resources", {}).get(k, 0) >= v for k, v in bundles[0].items())]
        if not room:
            return None
        selector = {"ray.io/node-id": f"!in({','.join(sorted(taken))})"}
        pg = placement_group(bundles, strategy=strategy, name=name, bundle_label_selector=[selector] * len(bundles))
        try:
            ray.get(pg.ready(), timeout=self.spread_wait_s)
            return pg
        except ray.exceptions.GetTimeoutError:   # those nodes are busy: anywhere will do
            ray.util.remove_placement_group(pg)
            return None

    @property
    def uses_shm_rings(self) -> bool:
        """Steps travel through shared-memory rings (every worker on this node), not actor calls."""
        return self._rings is not None

    @property
    def supports_async(self) -> bool:
        """``submit`` can return before the step's result (asynchronous scheduling): over the rings, with
        one stage, or with simulated workers (whose draws feed nothing). A real later stage would need the
        last stage's draws back for a chunk fed by the previous step: not done yet."""
        return self._rings is not None and (len(self._stages) == 1 or self._simulated)

    @property
    def _simulated(self) -> bool:
        return self.stage_kwargs[0].get("kind") == "simulated"

    @property
    def supports_joins(self) -> bool:
        """Steps can take late joiners (``workers.runtime.step_loop``): one stage of real workers reads the
        ring (its tensor-parallel ranks run the joiners rank 0 found)."""
        return self.supports_async and self._rings.pp == 1 and not self._simulated

    def execute(self, step: StepInput) -> StepOutput:
        return self.collect(self._send(step, STEP))

    def submit(self, step: StepInput, meanwhile=None):
        """Send the step; return once the workers took it (a handle for ``collect``). A chunk they refuse
        raises its ``RequestError`` here, before anything changed on them. ``meanwhile()``: called while
        waiting, at each ``nudge``; it may send joiners (``join``). ``last_joined``: the handles of those
        the workers ran with this step."""
        self.last_joined, self._joins = set(), []
        handle = self._send(step, STEP_ACK if self.supports_async else STEP)
        if self._rings is not None and self.supports_async:
            t0 = time.perf_counter()
            check = self._check if meanwhile is None else lambda: (self._check(), meanwhile())
            joined = self._failing(step.step_id, lambda: self._rings.wait_ack(handle, check, self.step_timeout_s))
            self.last_joined = {h for h in self._joins if h[0] in joined}
            self.last_wait_s = time.perf_counter() - t0
        return handle

    def join(self, step: StepInput):
        """Send ``step`` (first chunks of new requests) to run with the step ``submit`` waits on, if the workers
        have not taken it yet (``last_joined`` says); a handle for ``collect``."""
        handle = self._send(step, JOIN)
        self._joins.append(handle)
        return handle

    def nudge(self) -> None:
        """From another thread: make a waiting ``submit`` call its ``meanwhile`` now."""
        rings = self._rings
        if rings is not None:
            rings.reader.nudge()

    def _send(self, step: StepInput, kind: int):
        payload = encode_step(step)              # RequestError naming a chunk msgpack cannot carry
        self.last_payload_bytes = len(payload) * len(self.actors)
        self.last_wait_s = 0.0
        if self._rings is not None:
            return self._failing(step.step_id, lambda: self._rings.send(payload, kind, self.step_timeout_s)), step.step_id
        refs, hidden = [], None
        for ranks in self._stages:
            stage = [a.execute.remote(payload, hidden) for a in ranks]
            refs += stage
            hidden = stage[0]
        return step.step_id, refs

    def collect(self, handle) -> StepOutput:
        """The step's ``StepOutput``, or the error it met: the worker's own (a ``RequestError`` keeps its
        request id), or ``WorkerFailure``."""
        import ray

        t0 = time.perf_counter()
        try:
            if self._rings is not None:
                return decode_output(self._failing(
                    handle[1], lambda: self._rings.wait_output(handle, self._check, self.step_timeout_s)))
            step_id, refs = handle
            try:
                result = ray.get(refs, timeout=self.step_timeout_s)[-len(self._stages[-1])]
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ObjectLostError) as exc:
                raise WorkerFailure(f"step {step_id}: {type(exc).__name__}: {exc}") from exc
            return decode_output(result)
        finally:
            self.last_wait_s += time.perf_counter() - t0

    @staticmethod
    def _failing(step_id: int, call):
        """``call()``, a lost or silent worker on the rings raised as ``WorkerFailure``."""
        try:
            return call()
        except ChannelError as exc:
            raise WorkerFailure(f"step {step_id}: {type(exc).__name__}: {exc}") from exc

    def _check(self) -> None:
        """Every worker of this node alive (checked while waiting: a dead rank may not be the one that
        answers, and its peers would wait for it in a collective)."""
        dead = [name for name, pid in zip(self.worker_names, self.pids) if not process_alive(pid)]
        if dead:
            raise WorkerFailure(f"worker(s) {dead} died")

    def restart(self) -> None:
        self.shutdown()
        self._start()

    def shutdown(self) -> None:
        import ray
        if self._rings is not None:             # the loops end; every segment is unlinked
            self._rings.close()
            self._rings = None
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self.pids = [], []
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None


class _Rings:
    """The engine's end of the same-node step path (``workers.runtime.step_loop``): it makes every ring and
    unlinks them all once the workers mapped them, whichever worker dies later. Replies come in the order
    steps were sent: an answer for an earlier step that arrives while waiting for a later one is kept until
    it is collected."""

    LINK_SLOT_BYTES = 1 << 20            # hidden states: a chunk of 512 tokens x 5k x 2 bytes is 5 MB

    def __init__(self, pp: int, tp: int, *, joins: bool = False):
        self.pp, self.tp = pp, tp
        self.segments: list = []
        self.steps = self.reader = None
        try:
            self.steps = ShmBroadcast(pp * tp, spin_s=SPIN_S, poll_s=POLL_S)
            self.links = [self._segment(ShmSegment(tp, slots=8, slot_bytes=self.LINK_SLOT_BYTES))
                          for _ in range(pp - 1)]
            self.reply = self._segment(ShmSegment(1))
            # With one stage of several ranks that take late joiners (``joins``: real workers): rank 0 tells the
            # others how many each step runs.
            self.decisions = (self._segment(ShmSegment(tp - 1, slots=64, slot_bytes=64))
                              if joins and pp == 1 < tp else None)
            # The engine checks its workers this often while it waits for an answer.
            self.reader = ShmReader(self.reply.handle, 0, spin_s=SPIN_S, poll_s=0.2)
        except BaseException:
            self.close()
            raise
        self._seq = itertools.count(1)
        self._answers: dict[int, tuple[int, bytes]] = {}    # seq -> (kind, body) read ahead

    def _segment(self, segment):
        self.segments.append(segment)
        return segment

    def roles(self) -> list[dict]:
        """Each worker's rings, stage-major (``StepLoop``'s arguments)."""
        roles = []
        for s in range(self.pp):
            for r in range(self.tp):
                role = dict(steps=self.steps.handle, index=s * self.tp + r, rank=r)
                if s > 0:
                    role["upstream"] = self.links[s - 1].handle
                if r == 0 and s < self.pp - 1:
                    role["downstream"] = self.links[s].handle
                if r == 0 and s == self.pp - 1:
                    role["replies"] = self.reply.handle
                if self.decisions is not None:
                    role["decisions"] = self.decisions.handle
                roles.append(role)
        return roles

    def send(self, payload: bytes, kind: int, timeout: float) -> int:
        seq = next(self._seq)
        self.steps.send(frame(kind, seq, payload), timeout=timeout)
        return seq

    def wait_ack(self, handle, check, timeout: float) -> set[int]:
        """Once the workers took the step: the sequence numbers of the joiners they took with it."""
        body = self._wait(handle[0], ACK, check, timeout)
        return set(msgpack.unpackb(body)) if body else set()

    def wait_output(self, handle, check, timeout: float) -> bytes:
        return self._wait(handle[0], OUTPUT, check, timeout)

    def _wait(self, seq: int, wanted: int, check, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            answer = self._answers.get(seq)
            if answer is not None and (answer[0] != ACK or wanted == ACK):
                del self._answers[seq]
                kind, body = answer
                if kind == ERROR:
                    raise load_error(body)
                return body
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelTimeout(f"no answer from the workers within {timeout:.0f} s")
            kind, got, body = unframe(self.reader.recv(timeout=left, check=check))
            self._answers[got] = (kind, bytes(body))

    def unlink(self) -> None:
        """Remove every ring's name from /dev/shm once every worker has mapped its rings: the rings work on,
        and however the engine's process ends (killed outright, its resource tracker with it) nothing of
        them is left there."""
        self.steps.unlink()
        for segment in self.segments:
            segment.unlink()

    def close(self) -> None:
        """Close both ends and unlink every segment, even if a thread still waits on the reply ring
        (a shutdown under a running step: that wait then fails, and the step is dropped)."""
        for end in (self.steps, self.reader):
            try:
                if end is not None:
                    end.close()
            except Exception as exc:  # noqa: BLE001 - the segments must go whatever the ends say
                log.warning("closing a step ring: %r", exc)
        for segment in self.segments:
            segment.close()
        self.segments = []
