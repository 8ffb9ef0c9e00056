"""Planning: from layer specs and a memory budget to KV-cache groups, pool size and concurrency.

Memory layout without padding. Layers of one kind may outnumber another's (gemma-3-27b: 52 sliding,
10 full). The pool counts units; a unit is ``S`` layers' pages for one block of tokens, ``S`` the gcd of
the per-kind layer counts of a stage, so a unit fits any kind. Each kind is one KV-cache group (one
table per request) of width ``k = count / S``: its block is a composite of ``k`` units. A stage allocates
``S`` K/V tensors of ``num_blocks`` pages each; the layer of member ``u`` and slot ``t`` of a group (its
``u * S + t``-th layer of that kind) reads and writes tensor ``t`` at unit ``u`` of its block. Every byte
is used by whichever group holds the unit; nothing is padded.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from functools import reduce
from math import gcd, lcm

from .checks import check_int
from .specs import AttentionSpec, FullAttention


@dataclass(frozen=True)
class StageLayout:
    """One pipeline stage: which group, member unit and tensor slot each of its layers uses."""

    layers: tuple[str, ...]
    layer_slots: dict           # layer name -> (group index, member unit, slot)
    layers_per_group: int       # S: layers per unit, the K/V tensors this stage allocates
    block_bytes: int            # one pool unit on this stage: S layers' pages


@dataclass(frozen=True)
class KVLayout:
    group_specs: tuple[AttentionSpec, ...]   # one per attention kind, as the manager takes them
    group_widths: tuple[int, ...]            # pool units per block of each group (the same on every stage)
    stages: tuple[StageLayout, ...]

    @property
    def block_bytes(self) -> int:
        """Bytes one pool unit costs on the most loaded stage (every stage holds num_blocks of them)."""
        return max(s.block_bytes for s in self.stages)

    def num_blocks(self, kv_memory_bytes: int) -> int:
        """Pool units that fit the per-device budget, the null unit included."""
        return kv_memory_bytes // self.block_bytes

    def blocks_per_request(self, context_len: int, num_new_tokens: int = 1) -> int:
        """Pool units one request holds at most while computing ``num_new_tokens`` within ``context_len``."""
        return sum(max_blocks_held(s, context_len, num_new_tokens) * w
                   for s, w in zip(self.group_specs, self.group_widths))

    def kv_bytes_per_request(self, context_len: int, num_new_tokens: int = 1) -> int:
        return self.blocks_per_request(context_len, num_new_tokens) * self.block_bytes

    def max_concurrency(self, kv_memory_bytes: int, context_len: int, num_new_tokens: int = 1) -> int:
        usable = self.num_blocks(kv_memory_bytes) - 1  # the null block
        return max(0, usable) // self.blocks_per_request(context_len, num_new_tokens)


def max_blocks_held(spec: AttentionSpec, context_len: int, num_new_tokens: int = 1) -> int:
    """Most real blocks one group holds for a request of ``context_len`` tokens computing
    ``num_new_tokens`` per step (1: steady decode; a prefill chunk: the prefill peak).

    The tokens held are the ones the first new token still sees plus the new ones; ``T`` consecutive
    tokens touch at most ``ceil((T - 1) / B) + 1`` blocks, and never more than the context has.
    """
    b = spec.block_size
    visible_before = max(n - spec.first_needed_token(n) for n in _probe_points(spec, context_len))
    span = min(context_len, visible_before + num_new_tokens)
    return min(-(-context_len // b), -(-(span - 1) // b) + 1)


def _probe_points(spec: AttentionSpec, context_len: int):
    """Computed-token counts where a kind sees the most history: the end, or just before a reset."""
    yield max(0, context_len - 1)
    chunk = getattr(spec, "chunk_size", None)
    if chunk and context_len > chunk:
        yield chunk - 1


def peak_blocks(specs, num_positions: int, widths=None) -> int:
    """Most pool units one request holds, all groups together, while positions ``0 .. num_positions - 1``
    are computed one per step: the max over ``c`` of the blocks covering ``first_needed_token(c) .. c``,
    each weighted by its group's width (units per block; 1 by default).

    Exact without scanning every ``c``: with ``P`` the lcm of the block sizes and chunk sizes, each
    group holds at least as much at ``c + P`` as at ``c`` (full attention grows, a sliding window is
    periodic in ``B`` once filled and grows while filling, a chunk is periodic in ``lcm(C, B)``), so the
    max lies in the last ``P`` positions; there it lies just before some group drops a block, or at the end.
    """
    if num_positions <= 0:
        return 0
    period = lcm(*(lcm(s.block_size, getattr(s, "chunk_size", 1)) for s in specs))
    low = max(0, num_positions - period)
    candidates = {num_positions - 1}
    for s in specs:
        b = s.block_size
        k = s.first_needed_token(low) // b + 1
        while (drop := s.computed_to_reach(k * b)) < num_positions:   # first c whose window starts in block k
            if drop - 1 >= low:
                candidates.add(drop - 1)
            k = max(k + 1, s.first_needed_token(drop) // b + 1)   # the next block whose start drops something
    widths = widths or [1] * len(specs)
    return max(sum(w * (c // s.block_size - s.first_needed_token(c) // s.block_size + 1)
                   for s, w in zip(specs, widths))
               for c in candidates)


def split_stages(layer_names: list[str], pipeline_parallel_size: int) -> list[list[str]]:
    """Contiguous stages, as even as possible, earlier stages taking the remainder."""
    n, pp = len(layer_names), pipeline_parallel_size
    check_int("pipeline_parallel_size", pp, 1)
    if pp > n:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {n} layers")
    sizes = [n // pp + (1 if i < n % pp else 0) for i in range(pp)]
    out, start = [], 0
    for size in sizes:
        out.append(layer_names[start:start + size])
        start += size
    return out


def shard_spec(spec: AttentionSpec, tensor_parallel_size: int) -> AttentionSpec:
    """The spec as one tensor-parallel rank holds it: KV heads split, or replicated when fewer than ranks."""
    tp, h = tensor_parallel_size, spec.num_kv_heads
    check_int("tensor_parallel_size", tp, 1)
    if h % tp == 0:
        return replace(spec, num_kv_heads=h // tp)
    if tp % h == 0:
        return replace(spec, num_kv_heads=1)
    raise ValueError(f"tensor_parallel_size={tp} does not divide num_kv_heads={h} (nor the reverse)")


def _describe(counts: Counter) -> str:
    return ", ".join(f"{n} x {s.label}" for s, n in counts.items())


def kv_layout(layer_specs: dict, pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1) -> KVLayout:
    """Groups (one per kind, with widths) and per-stage slots for ``layer_specs`` (name -> spec, model order).

    Raises ``ValueError`` naming the stages and their kinds when stages hold different mixes: one
    manager serves every stage, so every stage must hold the same groups.
    """
    if not layer_specs:
        raise ValueError("layer_specs is empty: the model has no attention layers")
    for name, spec in layer_specs.items():
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"layer {name!r}: expected an attention spec, got {spec!r}")
    specs = {name: shard_spec(s, tensor_parallel_size) for name, s in layer_specs.items()}
    stage_names = split_stages(list(specs), pipeline_parallel_size)
    stage_counts = [Counter(specs[n] for n in names) for names in stage_names]
    ratios = []
    for counts in stage_counts:
        g = reduce(gcd, counts.values())
        ratios.append({s: n // g for s, n in counts.items()})
    if any(r != ratios[0] for r in ratios[1:]):
        detail = "; ".join(f"stage {i} (layers {names[0]}..{names[-1]}): {_describe(c)}"
                           for i, (names, c) in enumerate(zip(stage_names, stage_counts)))
        raise ValueError("pipeline stages hold different mixes of layer kinds, but one KV-cache manager "
                         f"serves them all; choose another pipeline_parallel_size. {detail}")
    kinds = list(ratios[0])                      # model order of first appearance
    group = {s: i for i, s in enumerate(kinds)}
    stages = []
    for names, counts in zip(stage_names, stage_counts):
        per_unit = counts[kinds[0]] // ratios[0][kinds[0]]
        seen: Counter = Counter()
        slots = {}
        for name in names:
            spec = specs[name]
            k = seen[spec]
            seen[spec] += 1
            slots[name] = (group[spec], k // per_unit, k % per_unit)
        page = max(s.page_size_bytes for s in counts)
        stages.append(StageLayout(tuple(names), slots, per_unit, per_unit * page))
    return KVLayout(tuple(kinds), tuple(ratios[0][s] for s in kinds), tuple(stages))


def as_full_attention(layer_specs: dict) -> dict:
    """The same model with every layer treated as full attention (the layout peers fall back to)."""
    return {name: FullAttention(block_size=s.block_size, num_kv_heads=s.num_kv_heads, head_size=s.head_size,
                                dtype=s.dtype) for name, s in layer_specs.items()}


def capacity_report(layer_specs: dict, kv_memory_bytes: int, context_len: int, *, prefill_chunk: int = 512,
                    pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1) -> dict:
    """Concurrency at ``context_len`` for the window-aware layout and for sliding-as-full, side by side."""
    for name, value in (("kv_memory_bytes", kv_memory_bytes), ("context_len", context_len),
                        ("prefill_chunk", prefill_chunk)):
        check_int(name, value, 1)
    out = {}
    for label, specs in (("window_aware", layer_specs), ("sliding_as_full", as_full_attention(layer_specs))):
        layout = kv_layout(specs, pipeline_parallel_size, tensor_parallel_size)
        chunk = min(prefill_chunk, context_len)
        out[label] = {
            "num_groups": len(layout.group_specs),
            "group_widths": list(layout.group_widths),
            "layers_per_group": [s.layers_per_group for s in layout.stages],
            "block_bytes": layout.block_bytes,
            "num_blocks": layout.num_blocks(kv_memory_bytes),
            "blocks_per_request": layout.blocks_per_request(context_len),
            "kv_bytes_per_request": layout.kv_bytes_per_request(context_len),
            "max_concurrency": layout.max_concurrency(kv_memory_bytes, context_len),
            "prefill_peak_kv_bytes_per_request": layout.kv_bytes_per_request(context_len, chunk),
            "max_concurrency_prefill_peak": layout.max_concurrency(kv_memory_bytes, context_len, chunk),
        }
    full = out["sliding_as_full"]["max_concurrency"]
    out["concurrency_ratio"] = out["window_aware"]["max_concurrency"] / full if full else float("inf")
    return out
