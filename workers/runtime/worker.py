"""A worker: one model shard, its paged K/V tensors and the append-only block-table mirrors.

The engine sends only block-table deltas (``ScheduledChunk.new_block_ids``). The worker appends them to
its mirrors (``workers.runtime.mirrors``), packs the step's integer inputs into one buffer and uploads it in one
copy (``workers.runtime.step_inputs``), runs its pipeline stage and, on the last stage, samples. A step is
checked whole before anything changes: a bad delta leaves the mirrors and the cache as they were.

Nothing waits on the device between the step's arrival and the launch of its last kernel: ``launch``
queues the step and returns a ``PendingStep``; ``collect`` waits for that step's draws alone. So an
engine can schedule and launch step N+1 while step N runs; a chunk of N+1 marked ``from_last_step``
takes as its input the token step N drew for its request, straight from the device. ``execute`` is
``collect(launch(step))``. Decode-only steps can replay CUDA graphs (``workers.runtime.cuda_graphs``).

A group of width ``k > 1`` names each block by one id, a composite of ``k`` pool units; the worker keeps
its units in a members tensor ``[num_blocks, k]`` on the device, updated from the step's compositions.
Per step and group, one gather turns the composite table into ``k`` unit tables; the layer of member
``u`` and slot ``t`` reads and writes K/V tensor pair ``t`` through unit table ``u``.

With ``num_host_blocks``, the worker keeps its share of the host KV tier (``workers.runtime.host_pool``)
and runs each step's stores and loads after its compositions, before its compute; the last stage
reports them in the step's output.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers

from kvmanager.checks import check_int
from kvmanager.planning import KVLayout, kv_layout
from kvmanager.specs import AttentionSpec
from workers.models.layer_kinds import LAYER_NAME, layer_specs
from workers.runtime.model_runner import (PagedKV, StageModel, StepBatch, check_tensor_parallel, shard_tensor_parallel,
                                  stage_range)
from workers.runtime.cuda_graphs import BATCH_SIZES, DecodeGraphs
from workers.runtime.mirrors import BlockTableMirrors
from workers.protocol import (WARM_UP_PREFIX, RequestError, StepInput, StepOutput, check_chunk_fields,
                              check_compositions, check_transfers)
from workers.runtime.host_pool import HostKVPool
from workers.runtime.sampling import Sampled, Sampler, to_device
from workers.runtime.step_inputs import Inputs, Layout, StepInputs
from workers.models.tiny_models import TINY_MODELS, build_tiny_model


def load_hf_model(source: Any, seed: int = 0) -> transformers.PreTrainedModel:
    """A model instance from itself, a tiny-model name, a local model dir, or a config (random, seeded)."""
    if isinstance(source, transformers.PreTrainedModel):
        return source
    if isinstance(source, str) and source in TINY_MODELS:
        return build_tiny_model(source, seed=seed)
    if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
        has_weights = any(f.endswith((".safetensors", ".bin")) for f in os.listdir(source))
        if has_weights:
            return transformers.AutoModelForCausalLM.from_pretrained(source, dtype="auto", local_files_only=True)
        source = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    if isinstance(source, dict):
        if "model_type" not in source:
            raise ValueError("model config dict needs a model_type")
        fields = {k: v for k, v in source.items() if k != "model_type"}
        source = transformers.AutoConfig.for_model(source["model_type"], **fields)
    if isinstance(source, transformers.PretrainedConfig):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return transformers.AutoModelForCausalLM.from_config(source).eval()
    raise ValueError(f"model must be a PreTrainedModel, one of {sorted(TINY_MODELS)}, a local model directory or "
                     f"a config; got {source!r}")


@dataclass
class PendingStep:
    """A launched step of the last stage: its draws on their way to the host, and its device time."""

    step_id: int
    sampled: Sampled
    started: Any = None                # CUDA events around the step's device work (None on CPU)
    ended: Any = None
    copies: tuple[list[int], list[int]] = ([], [])   # host-tier copies: device block ids (done, failed)


class Worker:
    """One pipeline stage (all layers by default) of one model on one device."""

    def __init__(self, model: Any, *, block_size: int, num_blocks: int, layers: tuple[int, int] | None = None,
                 layout: KVLayout | None = None, stage: int | None = None, seed: int = 0,
                 device: str | None = None, tensor_parallel_size: int = 1, tensor_parallel_rank: int = 0,
                 tensor_parallel_group=None, cuda_graphs: bool = False, graph_batch_sizes=BATCH_SIZES,
                 num_host_blocks: int = 0, compile_model: bool = False):
        """``layout``/``stage``: the engine's plan (``kvmanager.planning.kv_layout``); without them the
        worker derives the same plan from its own layer range (equal stages, as the engine splits).
        ``cuda_graphs``: replay decode-only steps of up to ``max(graph_batch_sizes)`` sequences from CUDA
        graphs (a single stage without tensor parallelism); without CUDA the padded batch runs eagerly.
        ``num_host_blocks``: host units of the host KV tier (0: none), this worker's layers' share of each.
        ``compile_model``: run the forward through ``torch.compile`` (``StageModel.compile``; the whole
        model on one rank, without CUDA graphs)."""
        if compile_model and (cuda_graphs or tensor_parallel_size != 1):
            raise ValueError("compile_model runs the whole model on one rank without CUDA graphs: it cannot go "
                             "with cuda_graphs or tensor_parallel_size > 1")
        model = load_hf_model(model, seed)
        check_int("num_blocks", num_blocks, 2, "block 0 is the null block")
        check_int("num_host_blocks", num_host_blocks, 0)
        check_tensor_parallel(model, tensor_parallel_size, tensor_parallel_rank)
        config = model.config.get_text_config()
        specs = _layer_specs(model, block_size)
        start, end = stage_range(len(specs), layers)
        if layout is None:
            layout, stage = _own_layout(specs, start, end, tensor_parallel_size)
        plan = layout.stages[stage or 0]
        held = range(start, end)
        if plan.layers != tuple(LAYER_NAME.format(i) for i in held):
            raise ValueError(f"layers {start}-{end - 1} are not stage {stage} of the layout "
                             f"({plan.layers[0]}..{plan.layers[-1]})")
        shapes = {(specs[i].num_kv_heads // tensor_parallel_size, specs[i].head_size) for i in held}
        if len(shapes) != 1:
            raise ValueError(f"layers {start}-{end - 1} have different KV shapes {sorted(shapes)}; layers of one "
                             "stage share K/V tensors, so they must agree")
        self.groups = list(layout.group_specs)
        self.widths = tuple(layout.group_widths)
        if device is not None:
            model = model.to(device)
        self.stage = StageModel(model, layers)
        self._warming = compile_model          # compiling step shapes until the engine's warm-up requests end
        if compile_model:
            self.stage.compile()
        shard_tensor_parallel(self.stage, tensor_parallel_size, tensor_parallel_rank, tensor_parallel_group)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.vocab_size = config.vocab_size
        self.device = next(model.parameters()).device
        (kv_heads, head_size), = shapes
        # One K/V tensor pair per slot; the layer at (member u, slot t) of a group uses pair t at unit u.
        pairs = [tuple(torch.zeros(num_blocks, block_size, kv_heads, head_size, dtype=model.dtype,
                                   device=self.device) for _ in "kv") for _ in range(plan.layers_per_group)]
        slots = {i: plan.layer_slots[LAYER_NAME.format(i)] for i in held}
        self.kv = PagedKV(caches={i: pairs[slots[i][2]] for i in held},
                          specs={i: specs[i] for i in held},
                          groups={i: slots[i][0] for i in held},
                          members={i: slots[i][1] for i in held})
        self.host = HostKVPool(pairs, num_host_blocks, self.widths) if num_host_blocks else None
        self.mirrors = BlockTableMirrors(self.groups, block_size, self.widths)
        self.inputs = StepInputs(self.device, block_size, len(self.groups))
        # Per group wider than one unit: block id -> its units (row 0, the null block, stays all null).
        self._members = {g: torch.zeros(num_blocks, k, dtype=torch.int32, device=self.device)
                         for g, k in enumerate(self.widths) if k > 1}
        self.sampler = Sampler(self.vocab_size, self.device) if self.stage.is_last else None
        self._last_sampled: Sampled | None = None     # the draws fed chunks of the next step read
        self._prompt_plan = None                       # the prompt rows ``forward`` computed logits for
        self._copies: tuple[list[int], list[int]] = ([], [])   # the last step's host-tier copies (done, failed)
        self.graphs = None
        if cuda_graphs and self.stage.is_first and self.stage.is_last and tensor_parallel_size == 1:
            self.graphs = DecodeGraphs(self._run_padded, self._padding, lambda: self.inputs.generation,
                                       sizes=tuple(graph_batch_sizes), capture=self.device.type == "cuda")

    def kv_cache_bytes(self) -> int:
        """Bytes of this worker's K/V tensors (introspection: slots shared by groups count once)."""
        tensors = {id(t): t for pair in self.kv.caches.values() for t in pair}   # slots are shared by groups
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def block_table(self, request_id: str) -> list[list[int]]:
        """The mirror of one request's block tables, one list per group (a copy)."""
        return self.mirrors.table(request_id)

    @property
    def request_ids(self) -> list[str]:
        return list(self.mirrors.rows)

    # -- a step ---------------------------------------------------------------------------------------
    def execute(self, step: StepInput, hidden_states: torch.Tensor | None = None,
                on_checked=None) -> StepOutput | torch.Tensor:
        """Run one step: a ``StepOutput`` from the last stage, hidden states for the next stage otherwise.
        ``on_checked``: called once the step passed its checks, before it changes anything."""
        out = self.launch(step, hidden_states, on_checked=on_checked)
        return self.collect(out) if self.stage.is_last else out

    def launch(self, step: StepInput, hidden_states: torch.Tensor | None = None,
               feedback: Sampled | None = None, on_checked=None) -> PendingStep | torch.Tensor:
        """Queue one step on the device without waiting for it: a ``PendingStep`` from the last stage, the
        hidden states for the next stage otherwise. ``feedback``: the draws a ``from_last_step`` chunk
        reads (by default this worker's own latest; an earlier pipeline stage gets the last stage's)."""
        started = ended = None
        if self.device.type == "cuda" and self.stage.is_last:
            started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            started.record()
        out = self.forward(step, hidden_states, feedback, on_checked)
        if not self.stage.is_last:
            return out
        sampling = [c for c in step.chunks if c.sample]
        plan, self._prompt_plan = self._prompt_plan, None
        prompt = None if plan is None else (out[len(sampling):], plan)
        sampled = self.sampler.sample_async(out[:len(sampling)], sampling, prompt)
        self._last_sampled = sampled
        if ended is not None:
            ended.record()
        return PendingStep(step.step_id, sampled, started, ended, self._copies)

    def collect(self, pending: PendingStep) -> StepOutput:
        """Wait for a launched step's draws (only its own) and report them."""
        tokens, logprobs = pending.sampled.result()
        prompt_logprobs = pending.sampled.prompt_result()
        sampled, failed = {}, {}
        for rid, token in zip(pending.sampled.request_ids, tokens):
            if token < 0:   # its row held NaN: that request fails, the step stands for the others
                failed[rid] = "the model produced NaN logits for this request"
                logprobs.pop(rid, None)
            else:
                sampled[rid] = token
        for rid, entry in list(prompt_logprobs.items()):
            if rid in failed or any(v != v for v in entry[1]):   # NaN
                failed[rid] = "the model produced NaN logits for this request"
                del prompt_logprobs[rid]
                sampled.pop(rid, None)
                logprobs.pop(rid, None)
        device_time_s = 0.0
        if pending.ended is not None:
            pending.ended.synchronize()
            device_time_s = pending.started.elapsed_time(pending.ended) / 1e3
        return StepOutput(step_id=pending.step_id, sampled=sampled, logprobs=logprobs, failed=failed,
                          device_time_s=device_time_s, prompt_logprobs=prompt_logprobs,
                          transfers_done=pending.copies[0], transfers_failed=pending.copies[1])

    def forward(self, step: StepInput, hidden_states: torch.Tensor | None = None,
                feedback: Sampled | None = None, on_checked=None) -> torch.Tensor:
        """Logits of the sampling chunks' last tokens, then of the prompt rows to score (last stage; see
        ``Sampler.prompt_plan``), or hidden states (other stages)."""
        source = feedback if feedback is not None else self._last_sampled
        updates, compositions, fed = self._check(step, source)
        self._check_hidden(step, hidden_states)
        if on_checked is not None:
            on_checked()
        for request_id in step.forget:
            self.mirrors.forget(request_id)
            if self.sampler:
                self.sampler.forget(request_id)
        self.mirrors.apply(updates, compositions)
        self._copies = ([], [])
        if self.host is not None:
            self.host.compose(compositions)
            self.host.before_compute()
            self._copies = self.host.run(step.kv_stores, step.kv_loads)
        chunks = step.chunks
        if self._warming and chunks and not any(c.request_id.startswith(WARM_UP_PREFIX) for c in chunks):
            self._warming = False
            self.stage.freeze()
        rows = np.fromiter((self.mirrors.rows[c.request_id] for c in chunks), dtype=np.int64, count=len(chunks))
        key = None
        if self.graphs is not None and chunks and not self.sampler.scores_prompts(chunks):
            num_tokens = sum(len(c.token_ids) for c in chunks)
            width = max(-(-(c.start_pos + len(c.token_ids)) // self.block_size) for c in chunks)
            key = self.graphs.key(len(chunks), num_tokens, width)
            if key is not None:
                self.graphs.prepare(key)
        inputs = self.inputs.pack(chunks, rows, self.mirrors, fed=fed,
                                  compositions={g: c for g, c in compositions.items() if g in self._members},
                                  pad_to=key[0] if key else None, width=key[1] if key else None)
        for g, (ids, units) in inputs.compositions.items():
            self._members[g][ids.long()] = units
        if fed[0] and source is not None:
            inputs.input_ids[inputs.fed_at.long()] = source.tokens[inputs.fed_from.long()].to(torch.int32)
        if self.sampler:
            self.sampler.observe(chunks, inputs.input_ids)
        self._prompt_plan = self.sampler.prompt_plan(chunks) if self.sampler and self.sampler.scoring else None
        if not chunks:
            width = self.vocab_size if self.stage.is_last else self.stage.hidden_size
            return torch.zeros(0, width, device=self.device)
        if key is not None:
            return self.graphs.replay(key, inputs)[inputs.logits_indices.long()]
        rows = inputs.logits_indices.long()
        if self._prompt_plan is not None:
            rows = torch.cat([rows, to_device(torch.tensor(self._prompt_plan.rows, dtype=torch.long), self.device)])
        batch = self._device_batch(inputs, rows)
        input_ids = inputs.input_ids if self.stage.is_first else None
        return self.stage.forward(self.kv, batch, input_ids=input_ids, hidden_states=hidden_states)

    def check(self, step: StepInput, feedback: Sampled | None = None) -> None:
        """Validate a step without changing anything."""
        self._check(step, feedback if feedback is not None else self._last_sampled)

    # -- checks ---------------------------------------------------------------------------------------
    def _check(self, step: StepInput, source: Sampled | None):
        """Per chunk its mirror update, the step's compositions per group, and where fed tokens go (checked)."""
        if not isinstance(step, StepInput):
            raise TypeError(f"step must be a StepInput, got {type(step).__name__}")
        compositions = check_compositions(step.compositions, self.widths, self.num_blocks)
        check_transfers(step.kv_stores, step.kv_loads, self.widths, self.num_blocks,
                        self.host.num_units if self.host is not None else 0)
        unknown = self.host.unknown_blocks(step.kv_stores, step.kv_loads, compositions) if self.host else []
        if unknown:
            raise ValueError(f"host-tier copies name blocks no composition has named: {unknown} (group, block)")
        forget = list(step.forget)
        for request_id in forget:
            if request_id not in self.mirrors:
                raise ValueError(f"forget: unknown request id {request_id!r}")
        if len(set(forget)) != len(forget):
            raise ValueError(f"forget: duplicate request ids in {forget}")
        forgotten = set(forget)
        updates, seen, fed_at, fed_from = [], set(), [], []
        needs_tokens = self.stage.is_first or self.stage.is_last
        offset = 0
        for chunk in step.chunks:
            check_chunk_fields(chunk, step.step_id, seen, len(self.groups), self.num_blocks, self.vocab_size)
            rid = chunk.request_id
            known = rid in self.mirrors and rid not in forgotten
            if known and chunk.start is not None:
                raise RequestError(rid, f"request {rid!r}: start sent for a request this worker already holds (only "
                                        "a request's first chunk on the workers carries one)")
            if chunk.from_last_step and needs_tokens:
                if source is None or rid not in source.index:
                    raise RequestError(rid, f"request {rid!r}: its chunk takes the token the previous step drew, but "
                                            "that step drew none for it on this worker")
                fed_at.append(offset)
                fed_from.append(source.index[rid])
            updates.append(self.mirrors.check(chunk, known, compositions))
            offset += len(chunk.token_ids)
        return updates, compositions, (fed_at, fed_from)

    def _check_hidden(self, step: StepInput, hidden_states: torch.Tensor | None) -> None:
        num_tokens = sum(len(c.token_ids) for c in step.chunks)
        if self.stage.is_first != (hidden_states is None):
            raise ValueError("hidden_states must be given to every pipeline stage but the first, and only to them")
        if hidden_states is not None and tuple(hidden_states.shape) != (num_tokens, self.stage.hidden_size):
            raise ValueError(f"hidden_states must have shape ({num_tokens}, {self.stage.hidden_size}), "
                             f"got {tuple(hidden_states.shape)}")

    # -- the device side of the inputs ------------------------------------------------------------------
    def _device_batch(self, inputs: Inputs, logits_indices: torch.Tensor | None, padded: bool = False) -> StepBatch:
        """Per group, the unit tables ``[k, num_seqs, width]`` (one gather through the members) and the
        slots ``[k, num_tokens]`` of every member, from the uploaded inputs alone (no host data: a graph
        captures this too)."""
        bs = self.block_size
        positions = inputs.positions.long()
        seq_of_token = inputs.seq_of_token.long()
        in_block, block_index = positions % bs, positions // bs
        block_tables, slot_mappings = [], []
        for g, table in enumerate(inputs.tables):
            if g in self._members:
                table = self._members[g][table.long()].permute(2, 0, 1)
            else:
                table = table[None]
            block_tables.append(table)
            slot_mappings.append(table[:, seq_of_token, block_index].long() * bs + in_block)
        return StepBatch(positions=positions, seq_lens=inputs.seq_lens, query_lens=inputs.query_lens,
                         block_tables=block_tables, slot_mappings=slot_mappings, logits_indices=logits_indices,
                         padded=padded)

    def _run_padded(self, inputs: Inputs) -> torch.Tensor:
        """Every row's logits of a padded decode batch (what a decode graph captures)."""
        batch = self._device_batch(inputs, None, padded=True)
        return self.stage.forward(self.kv, batch, input_ids=inputs.input_ids)

    def _padding(self, batch_size: int, width: int) -> Inputs:
        """Room for any decode step of this bucket (and its extras) first, so that packing one later does
        not move the buffer a graph reads; then a batch of padding rows."""
        layout = Layout(batch_size, batch_size, width, len(self.groups))
        self.inputs.reserve(2 * layout.size + (1 << 16))
        return self.inputs.padding_views(batch_size, width)

    def capture_graphs(self, batch_sizes=None, max_model_len: int | None = None) -> dict:
        """Capture decode graphs ahead of time for tables up to ``max_model_len`` tokens; returns
        ``{"captured": [(batch, width)...], "failures": {...}}``."""
        if self.graphs is None:
            return {"captured": [], "failures": {}}
        width = -(-(max_model_len or self.block_size) // self.block_size)
        self.graphs.capture(batch_sizes, width)
        return {"captured": sorted(self.graphs.graphs), "failures": dict(self.graphs.failures)}


def _own_layout(specs: list[AttentionSpec], start: int, end: int, tensor_parallel_size: int):
    """The engine's plan for a worker built alone: equal stages, this one holding layers [start, end)."""
    if len(specs) % (end - start):
        raise ValueError(f"layers {start}-{end - 1}: stages must split {len(specs)} layers evenly")
    layout = kv_layout({LAYER_NAME.format(i): s for i, s in enumerate(specs)}, len(specs) // (end - start),
                       tensor_parallel_size)
    return layout, start // (end - start)


def launch_pipeline(stages: Sequence, step: StepInput, feedback: Sampled | None = None):
    """Queue a step through the stages: the last stage's ``PendingStep`` (a ``StepOutput`` from simulated
    workers, which run at once). ``feedback``: the draws the first stage feeds (the last stage's own by
    default)."""
    if feedback is None and len(stages) > 1 and isinstance(stages[-1], Worker):
        feedback = stages[-1]._last_sampled
    if len(stages) > 1:
        for i, stage in enumerate(stages):
            if i == 0 and isinstance(stage, Worker):
                stage.check(step, feedback)
            else:
                stage.check(step)
    out = None
    for i, stage in enumerate(stages):
        if isinstance(stage, Worker):
            out = stage.launch(step, out, feedback if i == 0 else None)
        else:
            out = stage.execute(step, out)
    return out


def _layer_specs(model: transformers.PreTrainedModel, block_size: int) -> list[AttentionSpec]:
    """Specs by layer index, with the dtype the model (hence its cache) actually has."""
    dtype = str(model.dtype).removeprefix("torch.")
    return list(layer_specs(model.config.get_text_config(), block_size, dtype).values())
