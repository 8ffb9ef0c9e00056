"""A worker: one model shard, its paged K/V tensors and the append-only block-table mirrors.

The engine sends only block-table deltas (``ScheduledChunk.new_block_ids``). The worker appends them to
its mirror per request and KV-cache group, turns the step into packed tensors, runs its pipeline stage
and, on the last stage, samples. A step is checked whole before anything changes: a bad delta leaves
the mirrors and the cache as they were.

A group of width ``k > 1`` names each block by one id, a composite of ``k`` pool units; the worker keeps
its units in a members tensor ``[num_blocks, k]`` on the device, updated from the step's compositions.
Per step and group, one gather turns the composite table into ``k`` unit tables; the layer of member
``u`` and slot ``t`` reads and writes K/V tensor pair ``t`` through unit table ``u``.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import transformers

from kvmanager.planning import KVLayout, kv_layout
from kvmanager.specs import AttentionSpec
from workers.layer_kinds import LAYER_NAME, layer_specs
from workers.model_runner import (PagedKV, StageModel, StepBatch, check_tensor_parallel, shard_tensor_parallel,
                                  stage_range)
from workers.protocol import (RequestError, ScheduledChunk, StepInput, StepOutput, check_chunk_fields,
                              check_compositions)
from workers.sampling import Sampler
from workers.tiny_models import TINY_MODELS, build_tiny_model

NULL_BLOCK_ID = 0


def load_model(source: Any, seed: int = 0) -> transformers.PreTrainedModel:
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


class Worker:
    """One pipeline stage (all layers by default) of one model on one device."""

    def __init__(self, model: Any, *, block_size: int, num_blocks: int, layers: tuple[int, int] | None = None,
                 layout: KVLayout | None = None, stage: int | None = None, seed: int = 0,
                 device: str | None = None, tensor_parallel_size: int = 1, tensor_parallel_rank: int = 0,
                 tensor_parallel_group=None):
        """``layout``/``stage``: the engine's plan (``kvmanager.planning.kv_layout``); without them the
        worker derives the same plan from its own layer range (equal stages, as the engine splits)."""
        model = load_model(model, seed)
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an integer >= 2 (block 0 is the null block), got {num_blocks!r}")
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
        self._tables: dict[str, list[list[int]]] = {}
        # Per group wider than one unit: block id -> its units (row 0, the null block, stays all null).
        self._members = {g: torch.zeros(num_blocks, k, dtype=torch.int32, device=self.device)
                         for g, k in enumerate(self.widths) if k > 1}
        self._composed: dict[int, set[int]] = {g: set() for g in self._members}   # ids the members name
        self.sampler = Sampler(self.vocab_size, self.device) if self.stage.is_last else None

    @classmethod
    def from_kv_budget(cls, model: Any, *, block_size: int, kv_budget_bytes: int,
                       layers: tuple[int, int] | None = None, seed: int = 0, **kwargs) -> "Worker":
        """As many blocks as ``kv_budget_bytes`` holds for the layers this stage keeps."""
        model = load_model(model, seed)
        specs = _layer_specs(model, block_size)
        start, end = stage_range(len(specs), layers)
        layout, _ = _own_layout(specs, start, end, kwargs.get("tensor_parallel_size", 1))
        per_block = layout.block_bytes
        num_blocks = layout.num_blocks(kv_budget_bytes)
        if num_blocks < 2:
            raise ValueError(f"kv_budget_bytes={kv_budget_bytes} holds {num_blocks} blocks of {per_block} bytes; "
                             "at least 2 are needed (block 0 is the null block)")
        return cls(model, block_size=block_size, num_blocks=num_blocks, layers=layers, **kwargs)

    def kv_cache_bytes(self) -> int:
        tensors = {id(t): t for pair in self.kv.caches.values() for t in pair}   # slots are shared by groups
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def block_table(self, request_id: str) -> list[list[int]]:
        """The mirror of one request's block tables, one list per group (a copy)."""
        return [list(t) for t in self._tables[request_id]]

    @property
    def request_ids(self) -> list[str]:
        return list(self._tables)

    def execute(self, step: StepInput, hidden_states: torch.Tensor | None = None) -> StepOutput | torch.Tensor:
        """Run one step: a ``StepOutput`` from the last stage, hidden states for the next stage otherwise."""
        out = self.forward(step, hidden_states)
        if not self.stage.is_last:
            return out
        chunks = [c for c in step.chunks if c.sample]
        tokens, logprobs = self.sampler.sample(out, chunks)
        sampled, failed = {}, {}
        for chunk, token in zip(chunks, tokens):
            if token < 0:   # its row held NaN: that request fails, the step stands for the others
                failed[chunk.request_id] = "the model produced NaN logits for this request"
                logprobs.pop(chunk.request_id, None)
            else:
                sampled[chunk.request_id] = token
        return StepOutput(step_id=step.step_id, sampled=sampled, logprobs=logprobs, failed=failed)

    def forward(self, step: StepInput, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the sampling chunks' last tokens (last stage) or hidden states (other stages)."""
        tables, compositions = self._check(step)
        self._check_hidden(step, hidden_states)
        for request_id in step.forget:
            del self._tables[request_id]
            if self.sampler:
                self.sampler.forget(request_id)
        self._tables.update(tables)
        for g, composed in compositions.items():
            ids = torch.tensor(list(composed), dtype=torch.long)
            self._members[g][ids.to(self.device)] = torch.tensor(list(composed.values()), dtype=torch.int32,
                                                                 device=self.device)
            self._composed[g].update(composed)
        if self.sampler:
            self.sampler.observe(step.chunks)
        if not step.chunks:
            width = self.vocab_size if self.stage.is_last else self.stage.hidden_size
            return torch.zeros(0, width, device=self.device)
        batch = self._batch(step.chunks)
        input_ids = None
        if self.stage.is_first:
            input_ids = torch.tensor([t for c in step.chunks for t in c.token_ids], device=self.device)
        return self.stage.forward(self.kv, batch, input_ids=input_ids, hidden_states=hidden_states)

    def check(self, step: StepInput) -> None:
        """Validate a step without changing anything."""
        self._check(step)

    def _check(self, step: StepInput):
        """The tables the step's chunks will have, and its compositions per group (validated)."""
        if not isinstance(step, StepInput):
            raise TypeError(f"step must be a StepInput, got {type(step).__name__}")
        compositions = check_compositions(step.compositions, self.widths, self.num_blocks)
        forget = list(step.forget)
        for request_id in forget:
            if request_id not in self._tables:
                raise ValueError(f"forget: unknown request id {request_id!r}")
        if len(set(forget)) != len(forget):
            raise ValueError(f"forget: duplicate request ids in {forget}")
        tables: dict[str, list[list[int]]] = {}
        for chunk in step.chunks:
            if not isinstance(chunk, ScheduledChunk):
                raise TypeError(f"chunks must hold ScheduledChunk, got {type(chunk).__name__}")
            if chunk.request_id in tables:
                raise ValueError(f"request_id {chunk.request_id!r} appears twice in step {step.step_id}")
            check_chunk_fields(chunk, len(self.groups), self.num_blocks, self.vocab_size)
            known = chunk.request_id in self._tables and chunk.request_id not in forget
            if known and chunk.start is not None:
                raise RequestError(chunk.request_id, f"request {chunk.request_id!r}: start sent for a request this "
                                                     "worker already holds (only a request's first chunk on the "
                                                     "workers carries one)")
            base = self._tables[chunk.request_id] if known else [[] for _ in self.groups]
            tables[chunk.request_id] = [old + list(new) for old, new in zip(base, chunk.new_block_ids)]
            self._check_table(chunk, tables[chunk.request_id], known, compositions)
        return tables, compositions

    def _check_hidden(self, step: StepInput, hidden_states: torch.Tensor | None) -> None:
        num_tokens = sum(len(c.token_ids) for c in step.chunks)
        if self.stage.is_first != (hidden_states is None):
            raise ValueError("hidden_states must be given to every pipeline stage but the first, and only to them")
        if hidden_states is not None and tuple(hidden_states.shape) != (num_tokens, self.stage.hidden_size):
            raise ValueError(f"hidden_states must have shape ({num_tokens}, {self.stage.hidden_size}), "
                             f"got {tuple(hidden_states.shape)}")

    def _check_table(self, chunk: ScheduledChunk, table: list[list[int]], known: bool, compositions: dict) -> None:
        """The table must reach the step's last token and hold real (and composed) blocks wherever the step
        reads or writes."""
        bs, rid = self.block_size, chunk.request_id
        end = chunk.start_pos + len(chunk.token_ids)
        need = -(-end // bs)
        for g, spec in enumerate(self.groups):
            if len(table[g]) < need:
                hint = "" if known else " (the request is new to this worker, so its chunk must carry its whole table)"
                raise RequestError(rid, f"request {rid!r}: group {g} table has {len(table[g])} blocks "
                                        f"({len(table[g]) * bs} tokens) but the step reaches {end} tokens{hint}")
            first = spec.first_needed_token(chunk.start_pos) // bs
            read = table[g][first:need]
            if NULL_BLOCK_ID in read:
                nulls = [first + j for j, b in enumerate(read) if b == NULL_BLOCK_ID]
                raise RequestError(rid, f"request {rid!r}: group {g} has the null block at logical blocks "
                                        f"{nulls}, which positions {chunk.start_pos}..{end - 1} read or write")
            if g in self._composed:
                unknown = [b for b in read if b not in self._composed[g] and b not in compositions.get(g, ())]
                if unknown:
                    raise ValueError(f"request {chunk.request_id!r}: group {g} reads blocks {unknown}, which no "
                                     "composition has named")

    def _batch(self, chunks: list[ScheduledChunk]) -> StepBatch:
        """Per group, the unit tables ``[k, num_seqs, max_blocks]`` (one gather through the members) and the
        slots ``[k, num_tokens]`` of every member."""
        bs, dev = self.block_size, self.device
        query_lens = [len(c.token_ids) for c in chunks]
        seq_lens = [c.start_pos + n for c, n in zip(chunks, query_lens)]
        positions = torch.cat([torch.arange(c.start_pos, end) for c, end in zip(chunks, seq_lens)]).to(dev)
        seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(query_lens)).to(dev)
        width = max(-(-n // bs) for n in seq_lens)
        block_tables, slot_mappings = [], []
        for g in range(len(self.groups)):
            rows = [self._tables[c.request_id][g][:-(-n // bs)] for c, n in zip(chunks, seq_lens)]
            table = torch.tensor([row + [NULL_BLOCK_ID] * (width - len(row)) for row in rows],
                                 dtype=torch.int32).to(dev)
            if g in self._members:
                table = self._members[g][table.long()].permute(2, 0, 1).contiguous()
            else:
                table = table[None]
            slots = table[:, seq_of_token, positions // bs].long() * bs + positions % bs
            block_tables.append(table)
            slot_mappings.append(slots)
        sample_rows = torch.tensor(query_lens).cumsum(0) - 1
        wanted = torch.tensor([c.sample for c in chunks], dtype=torch.bool)
        return StepBatch(positions=positions, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                         query_lens=torch.tensor(query_lens, dtype=torch.int32, device=dev),
                         block_tables=block_tables, slot_mappings=slot_mappings,
                         logits_indices=sample_rows[wanted].to(dev))


def _own_layout(specs: list[AttentionSpec], start: int, end: int, tensor_parallel_size: int):
    """The engine's plan for a worker built alone: equal stages, this one holding layers [start, end)."""
    if len(specs) % (end - start):
        raise ValueError(f"layers {start}-{end - 1}: stages must split {len(specs)} layers evenly")
    layout = kv_layout({LAYER_NAME.format(i): s for i, s in enumerate(specs)}, len(specs) // (end - start),
                       tensor_parallel_size)
    return layout, start // (end - start)


def execute_pipeline(stages: Sequence, step: StepInput) -> StepOutput:
    """Run a step through consecutive stages (real or simulated workers) in one process, checking it on
    every stage first, so a bad step changes no stage (a single stage checks it as it executes)."""
    if len(stages) > 1:
        for stage in stages:
            stage.check(step)
    out = None
    for stage in stages:
        out = stage.execute(step, out)
    return out


def _layer_specs(model: transformers.PreTrainedModel, block_size: int) -> list[AttentionSpec]:
    """Specs by layer index, with the dtype the model (hence its cache) actually has."""
    dtype = str(model.dtype).removeprefix("torch.")
    return list(layer_specs(model.config.get_text_config(), block_size, dtype).values())
