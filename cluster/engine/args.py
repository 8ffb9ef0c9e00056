"""``EngineArgs``: everything an engine is built from, in one place, checked once.

``swakv serve``'s flags, ``ray_configs/serve.yaml``'s ``args``, the load test and ``LLM`` all make one;
``build_engine`` takes it. A bad value raises ValueError naming the field before anything loads or starts.
A field with ``help`` is also a ``swakv serve`` flag (``cluster/cli.py`` reads the fields); the others
are for code (benches, tests, the load test).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from kvmanager.checks import check_int, check_number


def _arg(default, help: str | None = None, *, flag: str | None = None, size: bool = False, auto: bool = False):
    """A field; with ``help``, a ``swakv serve`` flag (``flag`` overrides its name; ``size``: '2GiB' parses;
    ``auto``: ``swakv serve`` decides when neither --name nor --no-name is given, ``EngineArgs.for_serve``)."""
    return field(default=default, metadata={"help": help, "flag": flag, "size": size, "auto": auto})


@dataclass(frozen=True)
class EngineArgs:
    """How to build one engine (one data-parallel replica): the model, its split, its KV pool, its batch."""

    model: Any = _arg("default", "local model directory, a tiny test model name, or 'default' (the bundled tiny "
                                 "hybrid model); with --simulated-gpu, a model preset or config.json")
    tensor_parallel_size: int = _arg(1, "tensor-parallel ranks per pipeline stage (one worker process each)")
    pipeline_parallel_size: int = _arg(1, "pipeline stages, one worker each (times the tensor-parallel ranks)")
    block_size: int = _arg(16, "tokens per KV block")
    num_blocks: int | None = _arg(None, "KV pool size (default: from memory)")
    kv_cache_memory: int | None = _arg(None, "KV memory per device, e.g. 2GiB", size=True)
    kv_host_memory: int | None = _arg(None, "host memory for the host KV tier, this replica's workers together, "
                                            "e.g. 8GiB (pinned on GPUs; default: no host tier)", size=True)
    kv_host_speculative_stores: bool = _arg(True, "host tier: store only the blocks a known hit needs (fewer "
                                                  "bytes over PCIe); by default free host memory is also filled "
                                                  "with the other cached blocks, which go first when room is "
                                                  "needed", flag="--kv-host-known-hits-only")
    max_model_len: int | None = _arg(None, "longest prompt + output (default: the model's)")
    max_num_batched_tokens: int | None = _arg(None, "tokens computed per engine step (the chunked-prefill "
                                                    "budget; default 512; for simulated workers that sleep "
                                                    "the modelled time, each step its decodes and the prefill "
                                                    "that keeps it from turning compute-bound, at least that "
                                                    "GPU's knee and --max-num-seqs)")
    max_num_seqs: int = _arg(256, "requests running at once")
    enable_prefix_caching: bool = _arg(True, "turn the prefix cache off", flag="--no-prefix-caching")
    device: str | None = _arg(None, "torch device for the workers (default: the model's)")
    num_gpus_per_worker: float = _arg(0.0, "GPUs each worker actor reserves (1 on GPU nodes)")
    spread_stages: bool = _arg(False, "place pipeline stages on different nodes")
    simulated_gpu: str | None = _arg(None, "serve a preset with simulated workers timed as on this GPU "
                                           "(e.g. H100-80GB)")
    num_host_blocks: int | None = None     # host-tier units directly (tests, benches); instead of kv_host_memory
    num_cpus_per_worker: float = 1.0
    seed: int = 0                          # the workers' sampling seed for unseeded requests
    sleep_factor: float = _arg(0.0, "with --simulated-gpu: the workers sleep the modelled step time x this "
                                    "(default 0: no sleep)")
    sliding_as_full: bool = False          # every layer allocated as full attention (the comparison baseline)
    async_scheduling: bool = _arg(True, "schedule step N+1 while step N runs on the workers (executors that "
                                        "can submit a step and collect it later; others run one step at a time)")
    cuda_graphs: bool = _arg(False, "replay decode-only steps from CUDA graphs (CUDA devices)")
    compile_model: bool = _arg(False, "run the model's forward through torch.compile (one stage, one rank, no CUDA "
                                      "graphs; start-up first compiles the step shapes a server meets: 30-60 s on "
                                      "a small CPU)", auto=True)

    def __post_init__(self) -> None:
        model = self.model
        if model is None:
            object.__setattr__(self, "model", "default")
        elif isinstance(model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(model))
        elif not (isinstance(model, str) and model) and not hasattr(model, "config"):
            raise ValueError(f"model must be a model directory, a model name or a loaded model, got {model!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "block_size", "max_num_seqs"):
            check_int(name, getattr(self, name), 1)
        for name, low in (("num_blocks", 2), ("kv_cache_memory", 1), ("kv_host_memory", 0), ("max_model_len", 1),
                          ("max_num_batched_tokens", 1)):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), low)
        check_int("seed", self.seed)
        if self.num_host_blocks is not None:
            check_int("num_host_blocks", self.num_host_blocks, 0)
            if self.kv_host_memory:
                raise ValueError("give kv_host_memory or num_host_blocks, not both")
        for name in ("enable_prefix_caching", "kv_host_speculative_stores", "spread_stages", "sliding_as_full",
                     "async_scheduling", "cuda_graphs", "compile_model"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("num_gpus_per_worker", "num_cpus_per_worker", "sleep_factor"):
            check_number(name, getattr(self, name), 0)
        for name in ("device", "simulated_gpu"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"{name} must be None or a non-empty string, got {value!r}")
        if self.compile_model and not self._one_real_worker_without_graphs():
            raise ValueError("compile_model compiles one real worker holding the whole model: it cannot go with "
                             "simulated_gpu, cuda_graphs, tensor_parallel_size > 1 or pipeline_parallel_size > 1")
        if self.sleep_factor and self.simulated_gpu is None:
            raise ValueError("sleep_factor needs simulated_gpu (only simulated workers sleep)")
        if self.simulated_gpu is not None:
            from workers.sim.gpus import get_gpu
            get_gpu(self.simulated_gpu)          # an unknown GPU is named with the known ones

    @classmethod
    def for_serve(cls, values: dict) -> EngineArgs:
        """A server's arguments (``swakv serve``'s flags, ``serve.yaml``'s ``args``): ``compile_model`` left
        out or None is decided for a server, on where it can run (``compiles_by_default``): start-up is paid
        once, every token after it is served faster (the bundled model's ITL 0.7x transformers' against
        eager's 0.9x). Code that builds engines (``LLM``, tests, benches) starts eagerly unless it asks."""
        if values.get("compile_model") is not None:
            return cls.from_dict(values)
        args = cls.from_dict({**values, "compile_model": False})
        return args.replace(compile_model=compiles_by_default(args))

    @classmethod
    def from_dict(cls, values: dict) -> EngineArgs:
        """From a mapping (a config file's ``args``): an unknown key is a ValueError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}")
        return cls(**values)

    def replace(self, **changes) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    def _one_real_worker_without_graphs(self) -> bool:
        """What compiling the forward needs: one real worker holding the whole model, no CUDA graphs."""
        return (self.simulated_gpu is None and not self.cuda_graphs and self.tensor_parallel_size == 1
                and self.pipeline_parallel_size == 1)

    @property
    def model_name(self) -> str:
        """How the model is called in logs and in the API: a directory's last component, else as given."""
        model = self.model
        if not isinstance(model, str):
            return type(model).__name__
        return os.path.basename(model.rstrip("/")) if os.path.isdir(model) else model


def compiles_by_default(args: EngineArgs) -> bool:
    """Whether a server compiles the forward when not told: one real worker on the CPU holding the whole model
    (not simulated, no CUDA graphs, no tensor or pipeline split; on a GPU, CUDA graphs are the measured way),
    and what inductor's CPU kernels are built with: ``g++`` (the compiler it looks for) and Python's headers.
    A compile that fails all the same leaves the forward eager (``StageModel.forward``)."""
    import shutil
    import sysconfig
    if not args._one_real_worker_without_graphs() or (args.device or "cpu").split(":")[0] != "cpu":
        return False
    return shutil.which("g++") is not None and os.path.isfile(os.path.join(sysconfig.get_paths()["include"],
                                                                           "Python.h"))
