"""Small drivers of the real manager and engine that several test files share (no logic under test here)."""
from __future__ import annotations

from cluster.engine.executor import LocalExecutor
from workers.sim.simulated import SimulatedWorker


def ids(hit):
    """A hit's block ids, per group."""
    return [[b.block_id for b in g] for g in hit]


def run_step(mgr, req, n):
    """Allocate ``n`` tokens for ``req`` (which must fit) and mark them computed, as the scheduler does."""
    new = mgr.allocate_slots(req, n)
    assert new is not None
    req.num_computed_tokens += n
    return new


def decode(mgr, req, token):
    """One decode step: the sampled ``token`` appended, then its slot allocated."""
    req.append_output_token_ids([token])
    return run_step(mgr, req, 1)


class SimulatedExecutor:
    """The executor interface over one simulated worker, which checks every step's block tables strictly
    (what ``LocalExecutor`` does for a preset); ``restart`` is a worker failure that loses its cache."""

    def __init__(self, specs, num_blocks, widths, vocab_size):
        self.specs, self.num_blocks, self.widths, self.vocab_size = specs, num_blocks, widths, vocab_size
        self.restart()

    def execute(self, step):
        return self.worker.execute(step)

    def restart(self):
        self.worker = SimulatedWorker(self.specs, self.num_blocks, vocab_size=self.vocab_size, widths=self.widths)


class CrashesOn(LocalExecutor):
    """Real workers, plus a crash that names nobody whenever a step (one at a time or overlapped) carries a
    request with ``marker`` in its id."""

    def __init__(self, stage_kwargs, marker: str):
        super().__init__(stage_kwargs)
        self.marker, self.restarts = marker, 0

    def submit(self, step):
        if any(self.marker in c.request_id for c in step.chunks):
            raise RuntimeError("segmentation fault in a kernel")
        return super().submit(step)

    def restart(self):
        self.restarts += 1
        super().restart()


def start_engine_actor(build_kwargs: dict, *, name: str, max_restarts: int = 1, timeout_s: float = 900.0,
                       rank: int = 0):
    """One named engine actor, started with its workers, as a deployment starts each of its replicas;
    returns (handle, info). Raises RuntimeError if it fails to start."""
    import ray

    from cluster.ray.launch import spawn_engine_actor
    handle = spawn_engine_actor(build_kwargs, name, rank=rank, max_restarts=max_restarts)
    try:
        info = ray.get(handle.ready.remote(), timeout=timeout_s)
    except ray.exceptions.RayActorError as exc:
        raise RuntimeError(f"the engine actor failed to start: {exc}") from None
    except BaseException:
        ray.kill(handle, no_restart=True)
        raise
    return handle, info


def stop_engine_actor(handle, timeout_s: float = 30.0) -> None:
    """Stop one engine for good, as a deployment stops its replicas (workers first, then the actor)."""
    from cluster.ray.launch import stop_engines
    stop_engines([handle], timeout_s)


def run_layout(cluster, cfg, layout: str, sessions, url_holder: dict) -> dict:
    """One layout's load-test run (one replica unless the config says more), routed by the default router."""
    from cluster.loadtest.run import run_one
    return run_one(cluster, cfg, layout, "prefix", sessions, url_holder)


def slot_mapping(block_tables, seq_lens, query_lens, block_size: int):
    """The K/V slots of each step token, in ``q``'s packed order: the last ``query_lens[s]`` positions of
    sequence ``s`` (the tests' reference; a worker computes its slots on the device itself)."""
    import torch
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables: expected [num_seqs, max_blocks], got {tuple(block_tables.shape)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: must be an integer >= 1, got {block_size!r}")
    num_seqs = block_tables.shape[0]
    for name, t in (("seq_lens", seq_lens), ("query_lens", query_lens)):
        if t.shape != (num_seqs,):
            raise ValueError(f"{name}: expected [{num_seqs}], got {tuple(t.shape)}")
    seq_lens, query_lens = seq_lens.long(), query_lens.long()
    if bool((query_lens < 0).any()) or bool((query_lens > seq_lens).any()):
        raise ValueError("query_lens: each must lie in 0..seq_len")
    if bool(((seq_lens + block_size - 1) // block_size > block_tables.shape[1]).any()):
        raise ValueError(f"seq_lens: a sequence needs more than the table's {block_tables.shape[1]} blocks")
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=seq_lens.device), query_lens)
    starts = torch.cumsum(query_lens, 0) - query_lens
    offset_in_step = torch.arange(seq_of_token.shape[0], device=seq_lens.device) - starts[seq_of_token]
    pos = seq_lens[seq_of_token] - query_lens[seq_of_token] + offset_in_step
    blocks = block_tables[seq_of_token, pos // block_size].long()
    return blocks * block_size + pos % block_size


def execute_pipeline(stages, step):
    """Run a step through consecutive stages in this process (``launch_pipeline`` checks it on every stage
    first, so a bad step changes no stage), waiting for the last stage's result."""
    from workers.runtime.worker import PendingStep, launch_pipeline
    out = launch_pipeline(stages, step)
    return stages[-1].collect(out) if isinstance(out, PendingStep) else out


def worker_from_kv_budget(model, *, block_size: int, kv_budget_bytes: int, layers=None, seed: int = 0, **kwargs):
    """A worker with as many blocks as ``kv_budget_bytes`` holds for the layers its stage keeps (equal
    stages, as the engine splits them)."""
    from kvmanager.planning import kv_layout
    from workers.models.layer_kinds import layer_specs
    from workers.runtime.model_runner import stage_range
    from workers.runtime.worker import Worker, load_hf_model
    model = load_hf_model(model, seed)
    specs = layer_specs(model.config.get_text_config(), block_size, str(model.dtype).removeprefix("torch."))
    start, end = stage_range(len(specs), layers)
    layout = kv_layout(specs, len(specs) // (end - start), kwargs.get("tensor_parallel_size", 1))
    num_blocks = layout.num_blocks(kv_budget_bytes)
    if num_blocks < 2:
        raise ValueError(f"kv_budget_bytes={kv_budget_bytes} holds {num_blocks} blocks of {layout.block_bytes} "
                         "bytes; at least 2 are needed (block 0 is the null block)")
    return Worker(model, block_size=block_size, num_blocks=num_blocks, layers=layers, **kwargs)
