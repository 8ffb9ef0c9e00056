"""``build_engine``: the composition root. Reads the model's layers, checks the layout, sizes the KV pool,
starts the workers through an executor class (in this process by default; the Ray runtime passes its
own) and returns the engine with its model info."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from kvmanager.checks import is_int
from kvmanager.planning import KVLayout, as_full_attention, kv_layout, split_stages
from workers.protocol import WARM_UP_PREFIX

from .args import EngineArgs
from .engine import Engine, EngineConfig, EngineMetrics
from .executor import LocalExecutor
from .kv_events import group_metadata
from .types import SamplingParams

log = logging.getLogger("swakv.engine")
DEFAULT_MODEL = str(Path(__file__).resolve().parents[2] / "models" / "swakv-tiny-hybrid")
DEFAULT_KV_CACHE_MEMORY = 256 << 20   # on CPU; a GPU run should pass what its memory leaves
# The default step budget where no roofline times the steps: real workers (none of their device here) and
# simulated ones that take no time (no step is compute-bound; bigger steps only spread the host's cost per step).
# Simulated workers that sleep the modelled time fill each step to its knee instead: the running decodes and the
# prefill that fits beside them at their own time (``StepCostModel.prefill_room``), at least the bare knee.
DEFAULT_STEP_TOKENS = 512


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
    return tuple(i for i in ids if is_int(i) and i >= 0)


def build_engine(args: EngineArgs | Any = "default", /, *, executor_cls: type = LocalExecutor,
                 executor_options: dict | None = None, **fields) -> tuple[Engine, dict]:
    """Check the layout, size the pool, start the workers; return (Engine, model info).

    ``args``: an ``EngineArgs``, or the model followed by ``EngineArgs``' fields as keywords
    (``build_engine("tiny-llama", block_size=4)``). ``executor_cls`` runs the workers: ``LocalExecutor``
    (this process) or ``cluster.ray.executors.RayExecutor`` (actors), made with ``executor_options``
    (the Ray one's ``replica_set``: keep a data-parallel deployment's replicas on different nodes).
    ``simulated_gpu`` runs simulated workers for a preset or config.json model, timed by the cost model;
    ``sliding_as_full`` gives every layer a full-attention table, as engines without window-aware memory
    do (the comparison baseline; attention still reads only the window). The model may also be a loaded
    transformers model (one stage, in this process: the benches use that). Bad layouts (stages with
    different layer-kind mixes, sizes that do not divide heads or layers) are refused here, before any
    worker loads weights.
    """
    if not isinstance(args, EngineArgs):
        args = EngineArgs(model=args, **fields)
    elif fields:
        args = args.replace(**fields)
    plan = _simulated_plan(args) if args.simulated_gpu else _model_plan(args, executor_cls.in_process)
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    specs = plan["specs"]
    layout = kv_layout(as_full_attention(specs) if args.sliding_as_full else specs, pp, tp)
    kv_memory_bytes = args.kv_cache_memory or plan["default_memory"]
    num_blocks = args.num_blocks if args.num_blocks is not None else layout.num_blocks(kv_memory_bytes)
    limit = plan["limit"]
    max_model_len = args.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")
    # every running sequence can decode in each step; a budget given is kept as given
    step_tokens = args.max_num_batched_tokens or max(plan["step_tokens"], args.max_num_seqs)
    prefill_room = plan["prefill_room"] if args.max_num_batched_tokens is None else None
    ranks = 1 if args.simulated_gpu else tp     # workers per stage
    num_host_blocks, host_block_bytes = host_tier_size(layout, args.kv_host_memory or 0, tp)
    if args.num_host_blocks is not None:
        num_host_blocks = args.num_host_blocks
    stage_kwargs = [dict(plan["common"], **extra, block_size=args.block_size, num_blocks=num_blocks,
                         num_host_blocks=num_host_blocks) for extra in plan["per_stage"]]
    if not args.simulated_gpu:
        for kw in stage_kwargs:
            kw["layout"] = layout
    executor = executor_cls.create(stage_kwargs, args, ranks, **(executor_options or {}))
    engine = Engine(executor, layout.group_specs, num_blocks,
                    EngineConfig(max_model_len=max_model_len, max_num_batched_tokens=step_tokens,
                                 max_num_seqs=args.max_num_seqs, enable_prefix_caching=args.enable_prefix_caching,
                                 vocab_size=plan["vocab_size"], async_scheduling=args.async_scheduling,
                                 num_host_blocks=num_host_blocks, host_block_bytes=host_block_bytes,
                                 host_speculative_stores=args.kv_host_speculative_stores,
                                 prefill_room=prefill_room),
                    group_widths=layout.group_widths)
    if args.compile_model:
        _warm_up_compiled(engine, args.block_size, plan["vocab_size"])
    model = plan["model"]
    path = model if isinstance(model, str) else type(model).__name__
    info = {"model": os.path.basename(path.rstrip("/")) if os.path.isdir(path) else path,
            "model_path": path, "max_model_len": max_model_len, "num_blocks": num_blocks,
            "num_groups": len(layout.group_specs), "group_widths": list(layout.group_widths),
            "block_size": args.block_size, "simulated_gpu": args.simulated_gpu,
            "vocab_size": plan["vocab_size"], "eos_token_ids": list(plan["eos"]),
            "sliding_as_full": args.sliding_as_full, "kv_memory_bytes": kv_memory_bytes,
            "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
            "max_num_batched_tokens": step_tokens, "kv_groups": group_metadata(layout.group_specs),
            "num_host_blocks": num_host_blocks, "kv_host_memory_bytes": args.kv_host_memory or 0}
    return engine, info


def _warm_up_compiled(engine: Engine, block_size: int, vocab_size: int) -> None:
    """Serve the step shapes torch.compile tells apart (one sequence or several, one token or several, a table
    of one block or more) before any client, so that none waits seconds on a compile; then forget their
    KV. Workers started again after a fault get no warm-up: they run eagerly (correct, never stalled)."""
    log.info("compile_model: compiling the step shapes before serving (seconds per shape)")
    started = time.perf_counter()
    tokens = [1 + i % (vocab_size - 1) for i in range(3 * block_size)]
    params = SamplingParams(max_tokens=3)
    for n, prompts in enumerate(([tokens], [tokens[::-1], tokens[1:]], [tokens[:block_size // 2]])):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{WARM_UP_PREFIX}{n}.{i}", prompt, params)
        while engine.has_work():
            engine.step()
    if not engine.scheduler.manager.reset_prefix_cache():
        raise RuntimeError("compile_model: the warm-up's requests still hold blocks after they finished")
    engine.metrics = EngineMetrics()       # the operator's counters start with the first client
    log.info("compile_model: warm-up done in %.1f s", time.perf_counter() - started)


def host_unit_bytes(layout: KVLayout, tensor_parallel_size: int) -> int:
    """Host bytes one host unit takes: a pool unit's pages on every stage and tensor-parallel rank (each
    worker keeps its own layers' share, as on the device)."""
    return sum(s.block_bytes for s in layout.stages) * tensor_parallel_size


def host_tier_size(layout: KVLayout, kv_host_memory: int, tensor_parallel_size: int) -> tuple[int, tuple[int, ...]]:
    """Host units that fit ``kv_host_memory`` bytes (0: no tier), and per group the bytes one of its
    blocks moves between tiers (every worker's share together). ValueError if not one block fits."""
    per_unit = host_unit_bytes(layout, tensor_parallel_size)
    sizes = tuple(w * sum(s.layers_per_group for s in layout.stages) * spec.page_size_bytes * tensor_parallel_size
                  for spec, w in zip(layout.group_specs, layout.group_widths))
    if not kv_host_memory:
        return 0, sizes
    units, widest = kv_host_memory // per_unit, max(layout.group_widths)
    if units < widest:
        raise ValueError(f"kv_host_memory={kv_host_memory} bytes holds {units} host units of {per_unit} bytes (every "
                         f"worker's share together); one block of the widest group takes {widest}: give at least "
                         f"{widest * per_unit} bytes, or 0 for no host tier")
    return units, sizes


def _simulated_plan(args: EngineArgs) -> dict:
    """Layers, limits and worker arguments of simulated workers for a preset or config.json model."""
    from workers.sim.cost_model import StepCostModel
    from workers.sim.gpus import default_kv_memory, get_gpu
    from workers.sim.presets import get_model_preset
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    preset = get_model_preset(args.model)
    cost = StepCostModel(preset, args.simulated_gpu, tp, pp)   # refuses a model whose steps cannot be timed
    return dict(
        model=args.model, specs=preset.layer_specs(args.block_size),
        limit=preset.config.get("max_position_embeddings") or 131072, vocab_size=preset.vocab_size,
        eos=(),   # simulated workers draw tokens at random: an EOS would only cut load tests short
        default_memory=default_kv_memory(preset, get_gpu(args.simulated_gpu), tp, pp),
        common=dict(kind="simulated", model=args.model, gpu=args.simulated_gpu, tensor_parallel_size=tp,
                    pipeline_parallel_size=pp, sleep_factor=args.sleep_factor, seed=args.seed,
                    sliding_as_full=args.sliding_as_full),
        per_stage=[dict(pipeline_stage=i) for i in range(pp)],
        step_tokens=cost.knee_tokens() if args.sleep_factor else DEFAULT_STEP_TOKENS,
        prefill_room=cost.prefill_room if args.sleep_factor else None)


def _model_plan(args: EngineArgs, in_process: bool) -> dict:
    """Layers, limits and worker arguments of real workers: one per (stage, tensor-parallel rank)."""
    from workers.models.layer_kinds import check_parallel_sizes, layer_specs
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    model = args.model
    instance = not isinstance(model, str)
    if instance and (pp != 1 or tp != 1 or not in_process):
        raise ValueError("a loaded model runs as one stage in this process: pass a model directory to split it "
                         "or to run it on Ray workers")
    model = model if instance else resolve_model(model)
    config = model.config.get_text_config() if instance else model_config(model)
    check_parallel_sizes(config, tp, pp)
    if tp != 1 and in_process:
        raise ValueError("tensor_parallel_size > 1 runs one worker process per rank: use Ray workers "
                         "(executor_cls=RayExecutor, as `swakv serve` does)")
    specs = layer_specs(config, args.block_size)
    bounds, start = [], 0
    for names in split_stages(list(specs), pp):
        bounds.append((start, start + len(names)))
        start += len(names)
    return dict(
        model=model, specs=specs, limit=getattr(config, "max_position_embeddings", None) or 4096,
        vocab_size=config.vocab_size, eos=eos_token_ids("" if instance else model, config),
        default_memory=DEFAULT_KV_CACHE_MEMORY,
        common=dict(model=model, seed=args.seed, device=args.device, cuda_graphs=args.cuda_graphs,
                    compile_model=args.compile_model),
        per_stage=[dict(layers=b, stage=i, tensor_parallel_size=tp, tensor_parallel_rank=r)
                   for i, b in enumerate(bounds) for r in range(tp)],
        step_tokens=DEFAULT_STEP_TOKENS, prefill_room=None)
