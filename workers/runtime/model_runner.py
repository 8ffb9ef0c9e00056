"""Run a Hugging Face causal LM, or one pipeline stage of it, over a packed batch on a paged KV cache.

transformers' own model code does everything except attention: we register an attention function with
its ``AttentionInterface``, feed all of a step's tokens as one row ``[1, num_tokens]`` with explicit
per-token ``position_ids`` (so RoPE sees each request's true positions), and the function, which gets
the layer module and its query/key/value after RoPE, stores the new K/V in that layer's pages and
attends through the block tables. Within a layer every token of the step is stored before any token
attends, so a request may read a block another request of the same step writes. Masks are never
built: transformers skips mask creation for an implementation it does not know, and the window, chunk
and softcap go to the kernel instead. The step's tensors reach the function as a keyword argument,
which transformers forwards from the model call down to attention.

A stage holds decoder layers ``[start, end)``; the others become pass-throughs, so transformers' loop
over layers (and its per-layer-type RoPE and masks bookkeeping) still sees every index. The first stage
embeds token ids, the last applies the final norm, the LM head and any final-logit softcap.
Tensor parallelism splits the held layers' heads and MLP columns across ranks (``shard_tensor_parallel``).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface, PreTrainedModel

from kvmanager.checks import check_int
from kvmanager.specs import AttentionSpec
from workers.attention import paged_attention, store_kv

log = logging.getLogger("swakv.worker")

ATTN_IMPLEMENTATION = "swakv_paged"
_NOT_PASSED = object()


@dataclass
class PagedKV:
    """The cache of the layers one stage holds, keyed by global layer index."""

    caches: dict[int, tuple[torch.Tensor, torch.Tensor]]  # [num_blocks, block_size, num_kv_heads, head_size]
    specs: dict[int, AttentionSpec]
    groups: dict[int, int]                                 # layer -> KV-cache group (its block table)
    members: dict[int, int]                                # layer -> unit of its group's blocks it uses


@dataclass
class StepBatch:
    """One step's packed tokens and, per KV-cache group, where they live."""

    positions: torch.Tensor            # [num_tokens] int64
    seq_lens: torch.Tensor             # [num_seqs] int32, tokens after the step
    query_lens: torch.Tensor           # [num_seqs] int32, new tokens this step
    block_tables: list[torch.Tensor]   # per group [width, num_seqs, max_blocks] int32: unit ids per member
    slot_mappings: list[torch.Tensor]  # per group [width, num_tokens] int64
    logits_indices: torch.Tensor | None   # [k] int64: rows of the packed batch whose logits are wanted; None: all
    padded: bool = False               # padding rows (a captured decode batch) write into the null block


def _paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask, scaling=None, sliding_window=_NOT_PASSED, softcap=None,
                             s_aux=None, swakv=None, **_):
    """transformers hands over [1, heads, tokens, head_size]; it wants back [1, tokens, heads, head_size]."""
    if swakv is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention called without a step batch: run the model through "
                           "StageModel.forward")
    if s_aux is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by the paged kernel")
    if attention_mask is not None:
        raise RuntimeError("unexpected attention mask: masking is done by the paged kernel")
    kv, batch = swakv
    layer = module.layer_idx
    spec = kv.specs[layer]
    bounds = spec.kernel_bounds()
    window = bounds["window"]
    if sliding_window is not _NOT_PASSED and sliding_window != window:
        raise RuntimeError(f"layer {layer}: model code uses sliding_window={sliding_window} but the KV spec says "
                           f"{window}; the config and the model class disagree")
    k_cache, v_cache = kv.caches[layer]
    group, member = kv.groups[layer], kv.members[layer]
    args = (query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache,
            batch.slot_mappings[group][member], batch.block_tables[group][member], batch.seq_lens, batch.query_lens)
    if torch.compiler.is_compiling():   # one opaque op: the kernel's per-step planning is Python, not a graph
        out = torch.ops.swakv.store_and_attend(*args, window or 0, float(scaling), float(softcap or 0.0),
                                               bounds["chunk_size"] or 0, batch.padded)
    else:
        out = _store_and_attend(*args, window, scaling, softcap, bounds["chunk_size"], batch.padded)
    return out.unsqueeze(0), None


def _store_and_attend(query, key, value, k_cache, v_cache, slots, table, seq_lens, query_lens, window, scale,
                      softcap, chunk_size, null_ok):
    store_kv(k_cache, v_cache, key, value, slots, null_ok=null_ok)
    return paged_attention(query, k_cache, v_cache, table, seq_lens, query_lens, window=window, scale=scale,
                           softcap=softcap, chunk_size=chunk_size)


@torch.library.custom_op("swakv::store_and_attend", mutates_args=("k_cache", "v_cache"))
def _store_and_attend_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor,
                         query_lens: torch.Tensor, window: int, scale: float, softcap: float, chunk_size: int,
                         null_ok: bool) -> torch.Tensor:
    """A layer's K/V write and paged attention as one op a compiled forward calls (0: no window, softcap, chunk)."""
    return _store_and_attend(query, key, value, k_cache, v_cache, slots, table, seq_lens, query_lens, window or None,
                             scale, softcap or None, chunk_size or None, null_ok)


@_store_and_attend_op.register_fake
def _(query, key, value, k_cache, v_cache, slots, table, seq_lens, query_lens, window, scale, softcap, chunk_size,
      null_ok):
    return torch.empty_like(query)


AttentionInterface.register(ATTN_IMPLEMENTATION, _paged_attention_forward)


class _PassThrough(nn.Module):
    """Stands in for a decoder layer another stage holds."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class _NotHeld(nn.Module):
    """Stands in for a module another stage holds; calling it is a bug."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"this pipeline stage does not hold {self.name}")


def stage_range(num_layers: int, layers: tuple[int, int] | None) -> tuple[int, int]:
    """``layers`` checked, or every layer when it is None."""
    if layers is None:
        return 0, num_layers
    if not (isinstance(layers, (tuple, list)) and len(layers) == 2 and all(type(x) is int for x in layers)
            and 0 <= layers[0] < layers[1] <= num_layers):
        raise ValueError(f"layers must be (start, end) with 0 <= start < end <= {num_layers}, got {layers!r}")
    return layers[0], layers[1]


class StageModel:
    """A transformers causal LM restricted to decoder layers ``[start, end)``; takes ownership of ``model``."""

    def __init__(self, model: PreTrainedModel, layers: tuple[int, int] | None = None):
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
            raise ValueError(f"{type(model).__name__} is not a decoder-only *ForCausalLM with model.layers")
        num_layers = len(base.layers)
        start, end = stage_range(num_layers, layers)
        _refuse_unsupported(model)
        self.model = model.eval()
        self.start, self.end = start, end
        self.is_first, self.is_last = start == 0, end == num_layers
        self.hidden_size = model.config.get_text_config().hidden_size
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self._prune(base, num_layers)
        self._call = self.model
        self._frozen = False

    def compile(self) -> None:
        """Run the model's forward through ``torch.compile`` (dynamic shapes): transformers' per-layer Python
        and small ops become a few fused kernels; attention stays one opaque op per layer. Each class of
        step shape (one sequence or several, one token or several, tables of one block or more) compiles on
        its first step, seconds each, until ``freeze``. If a compile fails (no working C++ compiler, code
        Dynamo cannot handle), the forward runs eagerly from then on, said once in the log: a server that
        compiles by default still starts and serves the same tokens."""
        if not (self.is_first and self.is_last):
            raise ValueError("compiling the model's forward needs the whole model in one stage")
        self._call = torch.compile(self.model, dynamic=True)

    def freeze(self) -> None:
        """From now on a step shape no graph fits runs eagerly instead of stalling its step on a compile."""
        self._frozen = True

    @property
    def layer_indices(self) -> range:
        return range(self.start, self.end)

    def _prune(self, base: nn.Module, num_layers: int) -> None:
        for i in range(num_layers):
            if i not in self.layer_indices:
                base.layers[i] = _PassThrough()
        tied = self.model.lm_head.weight is base.embed_tokens.weight
        if not self.is_first and not tied:
            base.embed_tokens = _NotHeld("the token embeddings")
        if not self.is_last:
            base.norm = nn.Identity()
            if not tied:
                self.model.lm_head = _NotHeld("the LM head")

    @torch.inference_mode()
    def forward(self, kv: PagedKV, batch: StepBatch, input_ids: torch.Tensor | None = None,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` on the last stage, else hidden states ``[num_tokens, hidden]``.

        The first stage takes ``input_ids [num_tokens]``; the others take the previous stage's output.
        """
        if self.is_first:
            if input_ids is None or hidden_states is not None:
                raise ValueError("the first pipeline stage takes input_ids and no hidden_states")
            inputs = {"input_ids": input_ids[None]}
        else:
            if hidden_states is None or input_ids is not None:
                raise ValueError("a later pipeline stage takes hidden_states and no input_ids")
            inputs = {"inputs_embeds": hidden_states[None]}
        common = {"position_ids": batch.positions[None], "use_cache": False, "swakv": (kv, batch)}
        if self.is_last:
            keep = 0 if batch.logits_indices is None else batch.logits_indices   # 0: every row
            try:
                with torch.compiler.set_stance("eager_on_recompile") if self._frozen else contextlib.nullcontext():
                    return self._call(**inputs, **common, logits_to_keep=keep).logits[0]
            except torch._dynamo.exc.TorchDynamoException as exc:   # a compile failed, not the model
                if self._call is self.model:
                    raise
                log.warning("compile_model: the forward failed to compile, it runs eagerly from now on: %s",
                            str(exc).strip().splitlines()[0][:300])
                self._call = self.model   # the whole step again, eagerly: any K/V a graph before it wrote
                #                           is written again, the same values to the same slots
            return self._call(**inputs, **common, logits_to_keep=keep).logits[0]
        return self.model.model(**inputs, **common).last_hidden_state[0]


def check_tensor_parallel(model: PreTrainedModel, size: int, rank: int = 0) -> None:
    """Heads, KV heads and MLP width must split evenly, and the MLPs must be splittable: ValueError otherwise."""
    for name, value in (("tensor_parallel_size", size), ("tensor_parallel_rank", rank)):
        check_int(name, value)
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"need tensor_parallel_size >= 1 and 0 <= tensor_parallel_rank < size, got {size}, {rank}")
    config = model.config.get_text_config()
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, field, None)
        if not isinstance(value, int) or value % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide {field}={value}")
    if size == 1:
        return
    for i, layer in enumerate(getattr(getattr(model, "model", None), "layers", [])):
        mlp = getattr(layer, "mlp", None)
        if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"layer {i}: tensor parallelism supports gated dense MLPs only, not "
                             f"{type(getattr(layer, 'feed_forward', mlp)).__name__}")
    if not dist.is_initialized():
        raise ValueError("tensor_parallel_size > 1 needs torch.distributed initialised (e.g. gloo on CPU)")


def shard_tensor_parallel(stage: StageModel, size: int, rank: int, group=None) -> None:
    """Megatron-style split of each held layer: rank ``r`` keeps its share of the attention heads (and the
    KV heads they read) and of the MLP columns; the row-split output projections are summed across ranks
    with an all-reduce. Embeddings, norms and the LM head stay replicated, so every rank ends each layer
    with the same hidden states and samples the same token. Call ``check_tensor_parallel`` first.
    """
    if size == 1:
        return
    for i in stage.layer_indices:
        layer = stage.model.model.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        for column in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _keep_shard(column, 0, rank, size)
        for row in (attn.o_proj, mlp.down_proj):
            _keep_shard(row, 1, rank, size)
            if row.bias is not None and rank != 0:
                row.bias = None  # added once, by rank 0, before the sum
            row.register_forward_hook(lambda module, args, out: dist.all_reduce(out, group=group))


def _keep_shard(linear: nn.Linear, dim: int, rank: int, size: int) -> None:
    """Keep this rank's slice of a Linear's outputs (dim 0) or inputs (dim 1)."""
    weight = linear.weight.data.chunk(size, dim=dim)[rank].clone()
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if dim == 0 and linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data.chunk(size)[rank].clone(), requires_grad=False)
    linear.out_features, linear.in_features = weight.shape


def _refuse_unsupported(model: PreTrainedModel) -> None:
    """Model features the paged path would silently get wrong."""
    config = model.config.get_text_config()
    if any(hasattr(m, "sinks") for m in model.modules()):
        raise ValueError(f"{type(model).__name__} uses attention sinks, which the paged kernel does not support")
    if getattr(config, "attn_temperature_tuning", False) and not all(getattr(config, "no_rope_layers", [1])):
        # transformers scales NoPE queries by arange(num_tokens), not by each token's position.
        raise ValueError("config field attn_temperature_tuning=True is not supported on packed batches")
