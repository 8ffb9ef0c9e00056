"""A roofline model of one engine step: how long a batch would take on a given GPU, model, TP and PP.

Per pipeline stage, on one tensor-parallel rank (every rank does the same work):

    time_stage = max(flops / peak_flops, bytes / hbm_bandwidth) + tp_all_reduce_time
    bytes      = weights read + KV read + KV written
    step time  = sum over stages (one batch crosses them in turn) + (PP - 1) activation transfers

KV read is what the windows let attention read: a sequence computing ``n`` tokens from ``start`` reads
keys ``first_needed_token(start) .. start + n - 1`` of every layer once (a window or chunk caps it; a
full layer reads its whole context). Attention FLOPs count every (query, key) pair a query sees. The
equations and every constant's source are in docs/cost_model.md. Pure: same inputs, same numbers.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvmanager.checks import check_int
from kvmanager.planning import shard_spec, split_stages
from kvmanager.specs import DTYPE_BYTES, AttentionSpec

from .gpus import GpuPreset, get_gpu
from .presets import ModelPreset, get_model_preset


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage on one tensor-parallel rank."""

    flops: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    compute_s: float
    memory_s: float
    tp_comm_s: float

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.tp_comm_s


@dataclass(frozen=True)
class StepCost:
    stages: tuple[StageCost, ...]
    pp_transfer_s: float          # one stage-to-stage activation transfer

    @property
    def time_s(self) -> float:
        """The whole step: every stage in turn and the transfers between them."""
        return sum(s.time_s for s in self.stages) + (len(self.stages) - 1) * self.pp_transfer_s

    def stage_time_s(self, stage: int) -> float:
        """What stage ``stage`` spends: its compute plus sending its activations on (not the last)."""
        last = len(self.stages) - 1
        return self.stages[stage].time_s + (self.pp_transfer_s if stage < last else 0.0)


def attended_pairs(spec: AttentionSpec, start: int, num_tokens: int) -> int:
    """Sum over query positions ``p`` in ``start .. start+num_tokens-1`` of the keys ``p`` attends to."""
    end = start + num_tokens
    bounds = spec.kernel_bounds()
    window, chunk = bounds["window"], bounds["chunk_size"]
    if window is not None and chunk is not None:
        raise TypeError(f"{spec!r}: a window and a chunk together are not modelled")
    if window is not None:                   # keys(p) = min(p + 1, W)
        split = min(max(start, window - 1), end)
        return _tri(split) - _tri(start) + window * (end - split)
    if chunk is not None:                    # keys(p) = p mod C + 1
        total = 0
        for k in range(start // chunk, (end - 1) // chunk + 1):
            lo, hi = max(start, k * chunk) - k * chunk, min(end, (k + 1) * chunk) - k * chunk
            total += _tri(hi) - _tri(lo)
        return total
    return _tri(end) - _tri(start)           # full attention: keys(p) = p + 1


def keys_read(spec: AttentionSpec, start: int, num_tokens: int) -> int:
    """Distinct key positions a sequence's queries read: from the first one the first query needs."""
    return start + num_tokens - spec.first_needed_token(start)


def _tri(n: int) -> int:
    return n * (n + 1) // 2


class StepCostModel:
    """Step times for one model on one GPU type with a given TP x PP split. Holds no mutable state."""

    def __init__(self, model, gpu, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1):
        self.model: ModelPreset = get_model_preset(model)
        self.gpu: GpuPreset = get_gpu(gpu)
        tp = tensor_parallel_size
        check_int("tensor_parallel_size", tp, 1)
        if self.model.num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide num_attention_heads="
                             f"{self.model.num_attention_heads} of {self.model.name}")
        if self.model.active_params is None:
            raise ValueError(f"model {self.model.name!r}: its active parameter count is unknown, so its steps "
                             "cannot be costed")
        self.tp, self.pp = tp, pipeline_parallel_size
        specs = self.model.layer_specs()
        sharded = {name: shard_spec(s, tp) for name, s in specs.items()}
        # Per stage: (fraction of the model's layers, {spec: layer count}).
        self._stages = [(len(names) / len(specs), Counter(sharded[n] for n in names))
                        for names in split_stages(list(sharded), pipeline_parallel_size)]
        self._act_bytes = DTYPE_BYTES[self.model.dtype]
        self._specs = {spec for _, counts in self._stages for spec in counts}

    def knee_tokens(self, granule: int = 16, limit: int = 8192) -> int:
        """The fewest tokens (a multiple of ``granule``, at most ``limit``) at which one sequence's prefill
        step is compute-bound on every stage. Below it the weights' read sets the step's time, so a decode
        step has that many tokens' room for prefill before its time grows; above it a step's tokens cost the
        same per token at any size: the smallest step budget at which prefill runs at its peak rate."""
        return self.prefill_room((), granule, limit)

    def prefill_room(self, batch: Sequence[tuple[int, int]], granule: int = 16, limit: int = 8192) -> int:
        """The fewest tokens (a multiple of ``granule``, at most ``limit``) that one prefill from position 0
        added to ``batch`` makes compute-bound on every stage (0 if ``batch`` already is): what a step of
        decodes can take in prefill at about the decodes' own time. Decodes reading long contexts leave
        more room than the bare knee: their KV reads lengthen the memory time the prefill hides in."""
        check_int("granule", granule, 1)
        check_int("limit", limit, granule)
        batch = _checked(batch)
        tokens, base = sum(n for _, n in batch), self._totals(batch)

        def bound(t: int) -> bool:
            totals = {spec: (k + keys_read(spec, 0, t), p + attended_pairs(spec, 0, t)) if t else (k, p)
                      for spec, (k, p) in base.items()}
            return all(s.compute_s >= s.memory_s for s in self._cost(tokens + t, totals).stages)

        lo, hi = 0, limit // granule          # in granules; compute outgrows memory as a prefill grows
        if tokens and bound(0):
            return 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if bound(mid * granule) else (mid, hi)
        return hi * granule

    def step(self, batch: Sequence[tuple[int, int]]) -> StepCost:
        """Cost of a step computing, for each sequence, ``num_tokens`` tokens after ``start`` computed ones."""
        batch = _checked(batch)
        return self._cost(sum(n for _, n in batch), self._totals(batch))

    def _totals(self, batch: Sequence[tuple[int, int]]) -> dict[AttentionSpec, tuple[int, int]]:
        """Per (sharded) attention spec: keys read and attended pairs over the batch, the same on every stage."""
        return {spec: (sum(keys_read(spec, start, n) for start, n in batch),
                       sum(attended_pairs(spec, start, n) for start, n in batch)) for spec in self._specs}

    def _cost(self, tokens: int, totals: dict[AttentionSpec, tuple[int, int]]) -> StepCost:
        m, gpu, tp = self.model, self.gpu, self.tp
        weights_read = m.weight_bytes_read(tokens)
        q_heads = m.num_attention_heads // tp
        activation = m.hidden_size * tokens * self._act_bytes
        # Ring all-reduce: each rank sends and receives 2 (TP-1)/TP of the buffer.
        all_reduce_s = 2 * (tp - 1) / tp * activation / gpu.interconnect_bytes_per_s
        stages = []
        for fraction, counts in self._stages:
            flops = 2.0 * m.active_params * tokens * fraction / tp if tokens else 0.0
            kv_read = kv_write = 0
            for spec, layers in counts.items():
                token_bytes = 2 * spec.num_kv_heads * spec.head_size * DTYPE_BYTES[spec.dtype]
                keys, pairs = totals[spec]
                kv_read += layers * token_bytes * keys
                kv_write += layers * token_bytes * tokens
                flops += layers * 4 * q_heads * spec.head_size * pairs
            weight = weights_read * fraction / tp
            num_layers = sum(counts.values())
            stages.append(StageCost(
                flops=flops, weight_bytes=weight, kv_read_bytes=kv_read, kv_write_bytes=kv_write,
                compute_s=flops / gpu.bf16_flops_per_s,
                memory_s=(weight + kv_read + kv_write) / gpu.hbm_bytes_per_s,
                tp_comm_s=2 * num_layers * all_reduce_s))
        return StepCost(tuple(stages), activation / gpu.interconnect_bytes_per_s)


def _checked(batch: Sequence[tuple[int, int]]) -> Sequence[tuple[int, int]]:
    """``batch`` as it is when every entry is a (start >= 0, num_tokens >= 1) pair of ints (checked fast),
    else each entry checked with an error that names it."""
    if all(type(s) is tuple and len(s) == 2 and type(s[0]) is int and type(s[1]) is int  # noqa: E721
           and s[0] >= 0 and s[1] >= 1 for s in batch):
        return batch
    return [_check_seq(i, s) for i, s in enumerate(batch)]


def _check_seq(index: int, seq) -> tuple[int, int]:
    try:
        start, n = seq
    except (TypeError, ValueError):
        raise ValueError(f"batch[{index}] must be a (start, num_tokens) pair, got {seq!r}") from None
    for name, value, low in (("start", start, 0), ("num_tokens", n, 1)):
        check_int(f"batch[{index}]: {name}", value, low)
    return start, n
