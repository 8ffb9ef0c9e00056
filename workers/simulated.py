"""A worker without a model: it executes the step protocol, checks it, and reports how long it would take.

Load tests and capacity studies need the whole cluster (scheduler, manager, deltas, actors) at scale on
machines without GPUs. ``SimulatedWorker`` keeps the same append-only block-table mirrors a real worker
keeps and checks every step against them more strictly than a real worker can afford to: positions must
continue where the request's last step ended, every block a step reads or writes must be real, and no
block may be written by two requests or hold two places of one table. It keeps each request's sampling
spec with its mirror, as a real last stage does, and samples tokens from a hash of (seed, request seed,
request id, position), so a replay after a fault yields the same tokens; asked for logprobs, it reports
those of a uniform distribution (its tokens are not drawn from any model's). It takes
the step's time from the roofline cost model (optionally sleeping it, scaled, so load tests feel real).
"""
from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from typing import Any

from kvmanager.planning import as_full_attention, kv_layout
from kvmanager.specs import AttentionSpec

from .cost_model import StepCostModel
from .presets import load_model
from .protocol import GREEDY, ScheduledChunk, SamplingSpec, StepInput, StepOutput, check_chunk_fields, is_int

NULL_BLOCK_ID = 0


class SimulatedWorker:
    """Mirrors and checks of one worker (or a whole TP x PP replica), with modelled step times.

    ``group_specs``: the KV-cache groups in the engine's order (``kv_layout(...).group_specs``).
    ``pipeline_stage``: None sleeps the whole replica's step time; an index, that stage's share. Either
    way the step reports the whole replica's time (``StepOutput.simulated_time_s``).
    """

    def __init__(self, group_specs: Sequence[AttentionSpec], num_blocks: int, *, vocab_size: int, seed: int = 0,
                 cost_model: StepCostModel | None = None, pipeline_stage: int | None = None,
                 sleep_factor: float = 0.0):
        self.groups = list(group_specs)
        if not self.groups or not all(isinstance(s, AttentionSpec) for s in self.groups):
            raise ValueError(f"group_specs must be a non-empty list of attention specs, got {group_specs!r}")
        for name, value, low in (("num_blocks", num_blocks, 2), ("vocab_size", vocab_size, 1)):
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not is_int(seed):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if isinstance(sleep_factor, bool) or not isinstance(sleep_factor, (int, float)) \
                or not math.isfinite(sleep_factor) or sleep_factor < 0:
            raise ValueError(f"sleep_factor must be a finite number >= 0, got {sleep_factor!r}")
        if pipeline_stage is not None and (cost_model is None or not is_int(pipeline_stage)
                                           or not 0 <= pipeline_stage < cost_model.pp):
            raise ValueError(f"pipeline_stage must be None or a stage index of the cost model's pipeline, "
                             f"got {pipeline_stage!r}")
        self.num_blocks, self.vocab_size, self.seed = num_blocks, vocab_size, seed
        self.cost_model, self.pipeline_stage, self.sleep_factor = cost_model, pipeline_stage, sleep_factor
        self._tables: dict[str, list[list[int]]] = {}
        self._computed: dict[str, int] = {}       # tokens computed through the request's last step
        self._in_use: dict[str, list[list[int]]] = {}
        self._specs: dict[str, SamplingSpec] = {}

    @classmethod
    def for_model(cls, model: Any, gpu: Any, *, num_blocks: int, block_size: int = 16,
                  tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, sliding_as_full: bool = False,
                  **kwargs) -> "SimulatedWorker":
        """A worker for a preset name or config.json path, with the groups the engine builds for it.

        ``sliding_as_full``: the engine's manager treats every layer as full attention; the cost model
        keeps the real windows (attention still reads only the window, the memory is what changes)."""
        preset = load_model(model)
        specs = preset.layer_specs(block_size)
        layout = kv_layout(as_full_attention(specs) if sliding_as_full else specs, pipeline_parallel_size,
                           tensor_parallel_size)
        cost = StepCostModel(preset, gpu, tensor_parallel_size, pipeline_parallel_size)
        return cls(layout.group_specs, num_blocks, vocab_size=preset.vocab_size, cost_model=cost, **kwargs)

    # -- queries -------------------------------------------------------------------------------
    @property
    def request_ids(self) -> list[str]:
        return list(self._tables)

    def block_table(self, request_id: str) -> list[list[int]]:
        """The append-only mirror of one request's tables, one list per group (a copy; stale ids included)."""
        return [list(t) for t in self._tables[request_id]]

    def blocks_in_use(self, request_id: str) -> list[list[int]]:
        """Per group, the real blocks the request's last step read or wrote: what the manager must hold."""
        return [list(ids) for ids in self._in_use[request_id]]

    # -- the step ------------------------------------------------------------------------------
    def execute(self, step: StepInput, hidden_states: Any = None) -> StepOutput:
        """Check and apply one step; sample for chunks that ask. ``hidden_states`` (from an earlier
        pipeline stage, when executors chain stages) carries nothing here and is ignored."""
        tables, in_use = self.check(step)
        for request_id in step.forget:
            del self._tables[request_id], self._computed[request_id], self._in_use[request_id]
            self._specs.pop(request_id, None)
        self._tables.update(tables)
        self._in_use.update(in_use)
        for chunk in step.chunks:
            self._computed[chunk.request_id] = chunk.start_pos + len(chunk.token_ids)
            if chunk.start is not None:
                self._specs[chunk.request_id] = chunk.start.sampling
        sampled = {c.request_id: self.sample(c) for c in step.chunks if c.sample}
        logprobs = {}
        for rid, token in sampled.items():
            k = self._specs.get(rid, GREEDY).logprobs
            if k is not None:
                uniform = -math.log(self.vocab_size)
                logprobs[rid] = (uniform, [(token + j) % self.vocab_size for j in range(min(k, self.vocab_size))],
                                 [uniform] * min(k, self.vocab_size))
        seconds = 0.0
        if self.cost_model is not None and step.chunks:
            cost = self.cost_model.step([(c.start_pos, len(c.token_ids)) for c in step.chunks])
            seconds = cost.time_s
            if self.sleep_factor:
                own = seconds if self.pipeline_stage is None else cost.stage_time_s(self.pipeline_stage)
                time.sleep(own * self.sleep_factor)
        return StepOutput(step_id=step.step_id, sampled=sampled, logprobs=logprobs, simulated_time_s=seconds)

    def sample(self, chunk: ScheduledChunk) -> int:
        """The token after the chunk: a function of (seed, request seed, request id, its position) only."""
        position = chunk.start_pos + len(chunk.token_ids)
        spec = chunk.start.sampling if chunk.start is not None else self._specs.get(chunk.request_id, GREEDY)
        key = f"{self.seed}\x00{spec.seed or 0}\x00{chunk.request_id}\x00{position}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % self.vocab_size

    # -- checks (nothing changes until all pass) -----------------------------------------------
    def check(self, step: StepInput) -> tuple[dict[str, list[list[int]]], dict[str, list[list[int]]]]:
        """Validate a step against the mirrors; return the tables and in-use blocks it leaves."""
        if not isinstance(step, StepInput):
            raise TypeError(f"step must be a StepInput, got {type(step).__name__}")
        forget = list(step.forget)
        unknown = [r for r in forget if r not in self._tables]
        if unknown:
            raise ValueError(f"step {step.step_id}: forget names request ids this worker does not hold: {unknown}")
        if len(set(forget)) != len(forget):
            raise ValueError(f"step {step.step_id}: forget holds duplicate request ids: {forget}")
        tables: dict[str, list[list[int]]] = {}
        in_use: dict[str, list[list[int]]] = {}
        writers: dict[int, tuple[str, int]] = {}    # block id -> (request, group) writing it this step
        for chunk in step.chunks:
            if not isinstance(chunk, ScheduledChunk):
                raise TypeError(f"step {step.step_id}: chunks must hold ScheduledChunk, got {type(chunk).__name__}")
            rid = chunk.request_id
            if rid in tables:
                raise ValueError(f"step {step.step_id}: request_id {rid!r} appears twice")
            check_chunk_fields(chunk, len(self.groups), self.num_blocks, self.vocab_size)
            known = rid in self._tables and rid not in forget
            if known and chunk.start is not None:
                raise ValueError(f"request {rid!r}: start sent for a request this worker already holds (only a "
                                 "request's first chunk on the workers carries one)")
            if known and chunk.start_pos != self._computed[rid]:
                raise ValueError(f"request {rid!r}: start_pos={chunk.start_pos} does not continue its previous "
                                 f"steps, which computed positions 0..{self._computed[rid] - 1}")
            base = self._tables[rid] if known else [[] for _ in self.groups]
            tables[rid] = [old + new for old, new in zip(base, chunk.new_block_ids)]
            in_use[rid] = self._check_table(chunk, tables[rid], known, writers)
        return tables, in_use

    def _check_table(self, chunk: ScheduledChunk, table: list[list[int]], known: bool,
                     writers: dict[int, tuple[str, int]]) -> list[list[int]]:
        """Real, distinct blocks wherever the chunk reads or writes; none written by another request."""
        rid, start = chunk.request_id, chunk.start_pos
        end = start + len(chunk.token_ids)
        in_use = []
        for g, spec in enumerate(self.groups):
            bs = spec.block_size
            need = -(-end // bs)
            if len(table[g]) < need:
                hint = "" if known else " (its first chunk on this worker must carry a table covering its tokens)"
                raise ValueError(f"request {rid!r}: group {g} table has {len(table[g])} blocks ({len(table[g]) * bs} "
                                 f"tokens) but the step reaches position {end - 1}{hint}")
            first = spec.first_needed_token(start) // bs
            live = table[g][first:need]
            nulls = [first + j for j, b in enumerate(live) if b == NULL_BLOCK_ID]
            if nulls:
                raise ValueError(f"request {rid!r}: group {g} ({spec.kind}) has the null block at logical blocks "
                                 f"{nulls}, which positions {start}..{end - 1} read or write")
            if len(set(live)) != len(live):
                twice = sorted({b for b in live if live.count(b) > 1})
                raise ValueError(f"request {rid!r}: group {g} holds blocks {twice} at two places of the window "
                                 f"positions {start}..{end - 1} read")
            for b in table[g][start // bs:need]:
                other = writers.setdefault(b, (rid, g))
                if other != (rid, g):
                    raise ValueError(f"step writes block {b} for request {rid!r} group {g} and for request "
                                     f"{other[0]!r} group {other[1]}")
            in_use.append(live)
        return in_use
