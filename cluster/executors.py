"""Executors run one engine step on the workers: in this process, or on Ray worker actors.

Both offer ``execute(StepInput) -> StepOutput`` and ``restart()``, and raise ``WorkerFailure`` when a
worker is lost. Pipeline stages run in order, each handing its hidden states to the next.
"""
from __future__ import annotations

import os
from workers.protocol import StepInput, StepOutput

from .deltas import decode_output, decode_step, encode_output, encode_step
from .engine import WorkerFailure


def make_worker(kwargs: dict):
    """A real worker (``kind="model"``, the default) or a simulated one (``kind="simulated"``)."""
    kwargs = dict(kwargs)
    if kwargs.pop("kind", "model") == "simulated":
        from workers.simulated import SimulatedWorker
        return SimulatedWorker.for_model(kwargs.pop("model"), kwargs.pop("gpu"), **kwargs)
    from workers.worker import Worker
    return Worker(**kwargs)


class LocalExecutor:
    """Every stage in this process (the offline ``LLM`` on one device, tests)."""

    def __init__(self, stage_kwargs: list[dict]):
        self.stage_kwargs = stage_kwargs
        self.workers = [make_worker(kw) for kw in stage_kwargs]

    def execute(self, step: StepInput) -> StepOutput:
        hidden = None
        for worker in self.workers[:-1]:
            hidden = worker.execute(step, hidden)
        return self.workers[-1].execute(step, hidden)

    def restart(self) -> None:
        self.workers = [make_worker(kw) for kw in self.stage_kwargs]

    def shutdown(self) -> None:
        self.workers = []


class WorkerActor:
    """Ray actor shell over a worker: decodes the step, runs it, encodes the result."""

    def __init__(self, worker_kwargs: dict):
        self.worker = make_worker(worker_kwargs)

    def execute(self, payload: bytes, hidden=None):
        out = self.worker.execute(decode_step(payload), hidden)
        return encode_output(out) if isinstance(out, StepOutput) else out

    def pid(self) -> int:
        return os.getpid()


class RayExecutor:
    """One worker actor per device, all in one placement group named for what it holds.

    Tensor-parallel ranks of a stage are packed on one node; stages are packed too unless
    ``spread_stages`` asks for them on different nodes. Each step's encoded deltas go to every actor;
    stage ``k`` receives stage ``k-1``'s hidden states as an object ref, so they never pass the engine.
    """

    def __init__(self, stage_kwargs: list[dict], *, num_gpus_per_worker: float = 0.0,
                 spread_stages: bool = False, step_timeout_s: float = 300.0, start_timeout_s: float = 600.0):
        self.stage_kwargs = stage_kwargs
        self.num_gpus = num_gpus_per_worker
        self.spread_stages = spread_stages
        self.step_timeout_s = step_timeout_s
        self.start_timeout_s = start_timeout_s
        self.last_payload_bytes = 0
        self.actors: list = []
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
        bundle = {"CPU": 1, **({"GPU": self.num_gpus} if self.num_gpus else {})}
        strategy = "SPREAD" if self.spread_stages and n > 1 else "PACK"
        # Unique per start: a restarted engine must not meet the names of its dead predecessor's workers.
        token = f"{os.getpid()}-{self._generation}"
        name = f"swakv-workers-pp{n}-{token}"
        self.placement_group = placement_group([dict(bundle) for _ in range(n)], strategy=strategy, name=name)
        try:
            ray.get(self.placement_group.ready(), timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.placement_group)
            raise RuntimeError(f"placement group {name} ({n} x {bundle}, {strategy}) could not be placed within "
                               f"{self.start_timeout_s:.0f} s: the cluster lacks the resources") from None
        actor_cls = ray.remote(WorkerActor)
        env = {"env_vars": {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}}
        self.actors = [
            actor_cls.options(num_cpus=1, num_gpus=self.num_gpus, max_restarts=0, runtime_env=env,
                              name=f"swakv-worker-stage{i}-{token}",
                              scheduling_strategy=PlacementGroupSchedulingStrategy(
                                  placement_group=self.placement_group, placement_group_bundle_index=i)
                              ).remote(kwargs)
            for i, kwargs in enumerate(self.stage_kwargs)]
        self.worker_names = [f"swakv-worker-stage{i}-{token}" for i in range(n)]
        try:
            self.pids = ray.get([a.pid.remote() for a in self.actors], timeout=self.start_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a worker that cannot start is a start-up error
            self.shutdown()
            raise RuntimeError(f"worker actors failed to start: {exc}") from exc

    def execute(self, step: StepInput) -> StepOutput:
        import ray
        payload = encode_step(step)
        self.last_payload_bytes = len(payload) * len(self.actors)
        ref = None
        for actor in self.actors:
            ref = actor.execute.remote(payload, ref)
        try:
            return decode_output(ray.get(ref, timeout=self.step_timeout_s))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                ray.exceptions.ObjectLostError) as exc:
            raise WorkerFailure(f"step {step.step_id}: {type(exc).__name__}: {exc}") from exc

    def restart(self) -> None:
        self.shutdown()
        self._start()

    def shutdown(self) -> None:
        import ray
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
