"""Window-aware paged attention over swakv's block-table KV cache, and the K/V write that feeds it.

Cache layout, per layer: ``k_cache`` and ``v_cache`` are ``[num_blocks, block_size, num_kv_heads,
head_size]``; block 0 is the null block and may hold garbage. Logical block ``j`` of sequence ``s`` is
``block_tables[s, j]``. Entries before a query's window (dropped by the manager: 0 or stale ids) and
slots past ``seq_len`` are never read, so nothing the manager frees can leak into a result.

Two backends compute the same function: a Triton kernel (``workers.attention.triton_paged``) for CUDA tensors
and torch ops for CPU (``workers.attention.torch_paged``), which the bundled model and the CPU test-suite use.
"""
from __future__ import annotations

import math
import os

import torch

from kvmanager.checks import is_int, is_number
from workers.attention.torch_paged import torch_paged_attention

BACKENDS = ("torch", "triton")
BACKEND_ENV = "SWAKV_ATTENTION_BACKEND"

def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_lens: torch.Tensor, *, window: int | None = None,
                    scale: float | None = None, softcap: float | None = None, chunk_size: int | None = None,
                    backend: str | None = None) -> torch.Tensor:
    """Attention of packed varlen queries over their paged K/V, causal, limited to a window.

    ``q`` is ``[num_tokens, num_heads, head_size]``, sequences concatenated in order; sequence ``s`` owns
    the last ``query_lens[s]`` of its ``seq_lens[s]`` positions. A query at position ``p`` sees keys
    ``max(0, p - window + 1) .. p`` and, with ``chunk_size``, none before ``(p // chunk_size) * chunk_size``.
    ``softcap`` applies ``softcap * tanh(score / softcap)`` before the softmax (Gemma-2). Query head ``h``
    reads KV head ``h // (num_heads // num_kv_heads)``. Returns ``[num_tokens, num_heads, head_size]``
    in ``q``'s dtype. The K/V of this step's tokens must already be stored (``store_kv``).
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_lens)
    window = _check_positive_int("window", window)
    chunk_size = _check_positive_int("chunk_size", chunk_size)
    scale = _check_scale(scale, q.shape[2])
    softcap = _check_softcap(softcap)
    name = select_backend(q, backend)
    if name == "torch":
        seq_lens_l, query_lens_l = seq_lens.tolist(), query_lens.tolist()
        _check_lengths(seq_lens_l, query_lens_l, q.shape[0], k_cache.shape[1], block_tables.shape[1])
        return torch_paged_attention(q, k_cache, v_cache, block_tables, seq_lens_l, query_lens_l,
                                     window, scale, softcap, chunk_size)
    from workers.attention import triton_paged
    if not q.is_cuda:
        # On CPU only the interpreter can run the kernel; read the sizes here, where it costs no sync.
        _check_lengths(seq_lens.tolist(), query_lens.tolist(), q.shape[0], k_cache.shape[1],
                       block_tables.shape[1])
    return triton_paged.triton_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_lens,
                                                   window=window, scale=scale, softcap=softcap,
                                                   chunk_size=chunk_size)


def select_backend(q: torch.Tensor, backend: str | None = None) -> str:
    """The ``backend`` argument, else ``$SWAKV_ATTENTION_BACKEND``, else Triton on CUDA and torch elsewhere."""
    source = "backend"
    if backend is None:
        backend = os.environ.get(BACKEND_ENV) or None
        source = BACKEND_ENV
    if backend is None:
        return "triton" if q.is_cuda else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"{source}: unknown attention backend {backend!r}; choose one of {BACKENDS}")
    if backend == "triton" and not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{source}: the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                         "triton is imported to run it on CPU tensors")
    return backend


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, *, null_ok: bool = False) -> None:
    """Write this step's K/V: token ``i`` goes to slot ``slot_mapping[i] = block_id * block_size + offset``.

    ``null_ok``: slots in the null block are allowed; the padding rows of a captured decode batch write
    their (never read) K/V there. Otherwise a slot there is a table bug and is refused (on CPU)."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache: expected two equal [num_blocks, block_size, num_kv_heads, head_size] "
                         f"shapes, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_size):
            raise ValueError(f"{name}: expected [num_tokens, {num_kv_heads}, {head_size}], got {tuple(t.shape)}")
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from the cache's {k_cache.dtype}")
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"value: {value.shape[0]} tokens but key has {key.shape[0]}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping: expected [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping: expected int32 or int64, got {slot_mapping.dtype}")
    if not slot_mapping.is_cuda and slot_mapping.numel():
        # On CUDA a range check would cost a device sync per layer; torch's indexing asserts instead.
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < (0 if null_ok else block_size) or hi >= num_blocks * block_size:
            raise ValueError(f"slot_mapping: slots must lie in [{block_size}, {num_blocks * block_size}) "
                             f"(block 0 is the null block), got {lo}..{hi}")
    slots = slot_mapping.long()
    k_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slots, key)
    v_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slots, value)


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_lens) -> None:
    """Shapes, dtypes and devices; sizes inside the tensors are checked where reading them costs no sync."""
    if q.dim() != 3:
        raise ValueError(f"q: expected [num_tokens, num_heads, head_size], got {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache: expected [num_blocks, block_size, num_kv_heads, head_size], "
                         f"got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache's {tuple(k_cache.shape)}")
    num_heads, head_size = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_size:
        raise ValueError(f"k_cache: head_size {k_cache.shape[3]} differs from q's {head_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"q: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device} but q is on {q.device}")
    if not q.is_floating_point():
        raise TypeError(f"q: expected a floating dtype, got {q.dtype}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables: expected [num_seqs, max_blocks], got {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_lens", query_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name}: expected int32 or int64, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device} but q is on {q.device}")
    for name, t in (("seq_lens", seq_lens), ("query_lens", query_lens)):
        if t.shape != (num_seqs,):
            raise ValueError(f"{name}: expected [{num_seqs}] (one per block_tables row), got {tuple(t.shape)}")


def _check_lengths(seq_lens: list[int], query_lens: list[int], num_tokens: int, block_size: int,
                   max_blocks: int) -> None:
    if sum(query_lens) != num_tokens:
        raise ValueError(f"query_lens: they sum to {sum(query_lens)} but q holds {num_tokens} tokens")
    for s, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        if query_len < 1 or query_len > seq_len:
            raise ValueError(f"query_lens: sequence {s} has query_len {query_len}; need 1 <= query_len <= "
                             f"seq_len ({seq_len})")
        if -(-seq_len // block_size) > max_blocks:
            raise ValueError(f"seq_lens: sequence {s} has {seq_len} tokens, more than block_tables' "
                             f"{max_blocks} blocks of {block_size} hold")


def _check_positive_int(name: str, value):
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise ValueError(f"{name}: must be an integer >= 1 or None, got {value!r}")
    return value


def _check_scale(scale, head_size: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_size)
    if not is_number(scale) or scale <= 0:
        raise ValueError(f"scale: must be a finite number > 0 or None, got {scale!r}")
    return float(scale)


def _check_softcap(softcap):
    if softcap is None:
        return None
    if not is_number(softcap) or softcap <= 0:
        raise ValueError(f"softcap: must be a finite number > 0 or None, got {softcap!r}")
    return float(softcap)
