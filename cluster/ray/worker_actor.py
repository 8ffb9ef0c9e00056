"""The worker actor: a thin Ray shell over a worker (``make_worker``) and, on the engine's node, its step
loop (``workers.runtime.step_loop``) in a thread; across nodes, plain actor calls (``execute``)."""
from __future__ import annotations

import os
import threading
import time

from workers.protocol import StepOutput

from cluster.engine.executor import make_worker

from .heap import freeze_startup_heap


class WorkerActor:
    """Built in two calls so that tensor-parallel ranks can first agree on a rendezvous: ``address`` (rank
    0's node and a free port), then ``setup`` on every rank at once; ``serve`` then starts the step loop."""

    def __init__(self, worker_kwargs: dict):
        self.worker_kwargs = worker_kwargs
        self.worker = None
        self._loop = None

    def address(self) -> tuple[str, int]:
        import socket

        import ray
        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def setup(self, rendezvous: dict | None = None) -> tuple[int, str]:
        """``rendezvous``: world rank/size, address, and this stage's tensor-parallel ranks. Returns this
        process's pid and node id (the engine watches the pids of workers on its node)."""
        import ray
        kwargs = dict(self.worker_kwargs)
        if rendezvous:
            import torch
            import torch.distributed as dist
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{rendezvous['address']}",
                                    rank=rendezvous["rank"], world_size=rendezvous["world_size"])
            groups = [dist.new_group(ranks) for ranks in rendezvous["stage_ranks"]]   # every rank, same order
            kwargs["tensor_parallel_group"] = groups[rendezvous["stage"]]
        self.worker = make_worker(kwargs)
        freeze_startup_heap()          # the model and the runtime are built: what steps allocate is all that is left
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def serve(self, name: str, rings: dict) -> None:
        """Attach to the engine's rings (``workers.runtime.step_loop.StepLoop``'s arguments) and run the step
        loop in a thread until the engine closes them."""
        from workers.runtime.step_loop import StepLoop
        self._loop = StepLoop(self.worker, name, **rings)
        threading.Thread(target=self._loop.run, name="swakv-step-loop", daemon=True).start()

    def execute(self, payload: bytes, hidden=None):
        """One step by a plain actor call (workers on other nodes than the engine's)."""
        from workers.wire import decode_step, encode_output
        started = time.perf_counter()
        out = self.worker.execute(decode_step(payload), hidden)
        if not isinstance(out, StepOutput):
            return out
        out.worker_time_s = time.perf_counter() - started
        return encode_output(out)
