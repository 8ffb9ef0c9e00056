"""``build_engine``: the composition root. Reads the model's layers, checks the layout, sizes the KV pool,
starts the workers through an executor class (in this process by default; the Ray runtime passes its
own) and returns the engine with its model info."""
from __future__ import annotations

import json
import os
from pathlib import Path

from kvmanager.planning import as_full_attention, kv_layout, split_stages

from .engine import Engine, EngineConfig
from .executor import LocalExecutor

DEFAULT_MODEL = str(Path(__file__).resolve().parents[2] / "models" / "swakv-tiny-hybrid")
DEFAULT_KV_CACHE_MEMORY = 256 << 20   # on CPU; a GPU run should pass what its memory leaves


def resolve_model(model: str) -> str:
    return DEFAULT_MODEL if model in (None, "default") else model


def model_config(model: str):
    """The model's (text) config without loading weights: a tiny-model name or a local directory."""
    from workers.models.tiny_models import TINY_MODELS, tiny_config
    model = resolve_model(model)
    if model in TINY_MODELS:
        return tiny_config(model)
    if not os.path.isdir(model):
        raise ValueError(f"model {model!r} is neither a local model directory nor one of {sorted(TINY_MODELS)}")
    import transformers
    return transformers.AutoConfig.from_pretrained(model, local_files_only=True).get_text_config()


def eos_token_ids(model: str, config) -> tuple[int, ...]:
    """The ids generation stops at, as transformers' ``generate`` reads them: ``generation_config.json``'s
    ``eos_token_id`` when the model directory has one, else the config's (an int or a list)."""
    ids = None
    path = os.path.join(model, "generation_config.json") if model else ""
    if path and os.path.isfile(path):
        with open(path) as f:
            ids = json.load(f).get("eos_token_id")
    if ids is None:
        ids = getattr(config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0)


def build_engine(model: str = "default", *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 block_size: int = 16, num_blocks: int | None = None, kv_cache_memory: int | None = None,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 512, max_num_seqs: int = 256,
                 enable_prefix_caching: bool = True, executor_cls: type = LocalExecutor, device: str | None = None,
                 seed: int = 0, num_gpus_per_worker: float = 0.0, num_cpus_per_worker: float = 1.0,
                 spread_stages: bool = False,
                 simulated_gpu: str | None = None, sleep_factor: float = 0.0, sliding_as_full: bool = False,
                 replica_set: str | None = None, async_scheduling: bool = False, cuda_graphs: bool = False):
    """Check the layout, size the pool, start the workers; return (Engine, model info).

    ``simulated_gpu`` (e.g. "H100-80GB") runs simulated workers for a preset or config.json ``model``,
    timed by the cost model. ``sliding_as_full`` gives every layer a full-attention table, as engines
    without window-aware memory do (the comparison baseline); attention still reads only the window.
    ``replica_set``: the engine-name prefix of a data-parallel deployment, whose replicas' workers are
    kept on different nodes when the cluster has them (Ray executor only). ``executor_cls`` runs the
    workers: ``LocalExecutor`` (this process) or ``cluster.ray.executors.RayExecutor`` (actors).
    ``async_scheduling``: schedule a step while the previous one runs (in-process workers; see
    ``engine.py``). ``cuda_graphs``: workers replay decode-only steps from CUDA graphs. ``model`` may also
    be a loaded transformers model (one stage, in this process: the benches use that).
    Bad layouts (stages with different layer-kind mixes, sizes that do not
    divide heads or layers) are refused here, before any worker loads weights.
    """
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if simulated_gpu:
        from workers.sim.gpus import default_kv_memory, get_gpu
        from workers.sim.presets import get_model_preset
        preset = get_model_preset(model)
        specs = preset.layer_specs(block_size)
        limit = preset.config.get("max_position_embeddings") or 131072
        vocab_size = preset.vocab_size
        eos = ()   # simulated workers draw tokens at random: an EOS would only cut load tests short
        default_memory = default_kv_memory(preset, get_gpu(simulated_gpu), tp, pp)
        common = dict(kind="simulated", model=model, gpu=simulated_gpu, tensor_parallel_size=tp,
                      pipeline_parallel_size=pp, sleep_factor=sleep_factor, seed=seed,
                      sliding_as_full=sliding_as_full)
        per_stage = [dict(pipeline_stage=i) for i in range(pp)]
    else:
        from workers.models.layer_kinds import check_parallel_sizes, layer_specs
        instance = not isinstance(model, (str, os.PathLike, type(None))) and hasattr(model, "config")
        if instance and (pp != 1 or tp != 1 or not executor_cls.in_process):
            raise ValueError("a loaded model runs as one stage in this process: pass a model directory to split it "
                             "or to run it on Ray workers")
        model = model if instance else resolve_model(model)
        config = model.config.get_text_config() if instance else model_config(model)
        check_parallel_sizes(config, tp, pp)
        if tp != 1 and executor_cls.in_process:
            raise ValueError("tensor_parallel_size > 1 runs one worker process per rank: use Ray workers "
                             "(executor_cls=RayExecutor, as `swakv serve` does)")
        specs = layer_specs(config, block_size)
        limit = getattr(config, "max_position_embeddings", None) or 4096
        vocab_size = config.vocab_size
        eos = eos_token_ids("" if instance else model, config)
        default_memory = DEFAULT_KV_CACHE_MEMORY
        common = dict(model=model, seed=seed, device=device, cuda_graphs=cuda_graphs)
        bounds, start = [], 0
        for names in split_stages(list(specs), pp):
            bounds.append((start, start + len(names)))
            start += len(names)
        per_stage = [dict(layers=b, stage=i, tensor_parallel_size=tp, tensor_parallel_rank=r)
                     for i, b in enumerate(bounds) for r in range(tp)]
    from .kv_events import group_metadata
    layout = kv_layout(as_full_attention(specs) if sliding_as_full else specs, pp, tp)
    kv_memory_bytes = kv_cache_memory or default_memory
    if num_blocks is None:
        num_blocks = layout.num_blocks(kv_memory_bytes)
    max_model_len = max_model_len or limit
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")
    stage_kwargs = [dict(common, **extra, block_size=block_size, num_blocks=num_blocks) for extra in per_stage]
    if not simulated_gpu:
        for kw in stage_kwargs:
            kw["layout"] = layout
    executor = executor_cls.create(stage_kwargs, ranks_per_stage=1 if simulated_gpu else tp,
                                   num_gpus_per_worker=num_gpus_per_worker, num_cpus_per_worker=num_cpus_per_worker,
                                   spread_stages=spread_stages, replica_set=replica_set)
    engine = Engine(executor, layout.group_specs, num_blocks,
                    EngineConfig(max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                                 max_num_seqs=max_num_seqs, enable_prefix_caching=enable_prefix_caching,
                                 vocab_size=vocab_size, async_scheduling=async_scheduling),
                    group_widths=layout.group_widths)
    name = model if isinstance(model, str) else type(model).__name__
    info = {"model": os.path.basename(name.rstrip("/")) if os.path.isdir(name) else name,
            "model_path": name, "max_model_len": max_model_len, "num_blocks": num_blocks,
            "num_groups": len(layout.group_specs), "group_widths": list(layout.group_widths),
            "block_size": block_size, "simulated_gpu": simulated_gpu,
            "vocab_size": vocab_size, "eos_token_ids": list(eos),
            "sliding_as_full": sliding_as_full, "kv_memory_bytes": kv_memory_bytes,
            "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
            "max_num_batched_tokens": max_num_batched_tokens, "kv_groups": group_metadata(layout.group_specs)}
    return engine, info
