"""The in-process executor: every pipeline stage in this process (the offline ``LLM``, benches, tests).

An executor runs one engine step on the workers: ``execute(StepInput) -> StepOutput`` and ``restart()``,
raising ``WorkerFailure`` when a worker is lost; pipeline stages run in order, each handing its hidden
states to the next. This one also splits a step in two (``submit`` queues it on the device, ``collect``
waits for its results), which asynchronous scheduling needs; ``last_wait_s`` tells how long its last
``execute``/``collect`` waited for the device. ``cluster.ray.executors.RayExecutor`` is the other kind.
"""
from __future__ import annotations

from workers.protocol import StepInput, StepOutput


def make_worker(kwargs: dict):
    """A real worker (``kind="model"``, the default) or a simulated one (``kind="simulated"``)."""
    kwargs = dict(kwargs)
    if kwargs.pop("kind", "model") == "simulated":
        from workers.sim.simulated import SimulatedWorker
        return SimulatedWorker.for_model(kwargs.pop("model"), kwargs.pop("gpu"), **kwargs)
    from workers.runtime.worker import Worker
    return Worker(**kwargs)


class LocalExecutor:
    """Every stage in this process (the offline ``LLM`` on one device, tests)."""

    in_process = True          # a loaded model instance can run here; tensor parallelism cannot

    def __init__(self, stage_kwargs: list[dict]):
        self.stage_kwargs = stage_kwargs
        self.workers = [make_worker(kw) for kw in stage_kwargs]
        self.last_wait_s = 0.0

    @classmethod
    def create(cls, stage_kwargs: list[dict], args, ranks_per_stage: int) -> LocalExecutor:
        """What ``build_engine`` calls: one worker per entry of ``stage_kwargs`` (the engine arguments'
        placement fields, devices per worker and spreading, mean nothing in one process)."""
        return cls(stage_kwargs)

    @property
    def supports_async(self) -> bool:
        """Real workers can take a step whose inputs are the previous step's draws, still on the device."""
        return all(hasattr(w, "launch") for w in self.workers)

    def execute(self, step: StepInput) -> StepOutput:
        return self.collect(self.submit(step))

    def submit(self, step: StepInput):
        """Queue the step on every stage (checked on all of them first); a handle for ``collect``.
        Simulated workers answer at once, and never import torch (the real worker's module does)."""
        self.last_wait_s = 0.0
        if self.supports_async:
            from workers.runtime.worker import launch_pipeline
            return launch_pipeline(self.workers, step)
        if len(self.workers) > 1:
            for worker in self.workers:
                worker.check(step)
        out = None
        for worker in self.workers:
            out = worker.execute(step, out)
        return out

    def collect(self, handle) -> StepOutput:
        import time
        if isinstance(handle, StepOutput):
            return handle                      # simulated workers answered at once
        t0 = time.perf_counter()
        out = self.workers[-1].collect(handle)
        self.last_wait_s = time.perf_counter() - t0
        return out

    def restart(self) -> None:
        self.workers = [make_worker(kw) for kw in self.stage_kwargs]

    def shutdown(self) -> None:
        self.workers = []
