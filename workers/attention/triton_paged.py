"""Triton kernel for ``workers.attention.paged_attention``: it reads only the K/V a query's window sees.

Plan. One program owns a tile of query rows and one KV head: ``BLOCK_Q`` tokens of one sequence times the
``GROUP`` query heads that share the KV head (GQA), so every K/V tile is loaded once for the whole group.
Its key range is ``[first key of the tile's first query, last query + 1)``; it walks that range in tiles of
``BLOCK_N`` positions, gathering each position's physical block from the block table in-kernel. Loads are
masked at both ends (the window's first block may start with dropped or garbage slots, the last one runs
past ``seq_len``), so block-table entries and slots outside the range are never read. The causal, window
and chunk masks are applied per row; the softmax is the usual online one in base 2.

Prefill and decode rows of any mix share one launch: program ``i`` finds its sequence by binary search
over ``cu_q[s] // BLOCK_Q + s``, an upper bound on the tiles before sequence ``s`` that needs no host sync.
A batch made only of decode rows (one token each) with few sequences splits each window, not the whole
sequence, across ``num_splits`` programs; each writes a partial output and its log-sum-exp, and a small
kernel combines them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Fewest window tokens worth a program of their own in a split decode: below this, launch and combine
# overheads outweigh the extra memory parallelism.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32
# Programs per SM a decode aims for before it stops splitting windows.
PROGRAMS_PER_SM = 2

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _find_seq(cu_q_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Last sequence ``s`` whose first tile ``cu_q[s] // BLOCK_Q + s`` is at most ``tile``."""
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.zeros([], dtype=tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, block_tables_ptr, seq_lens_ptr, cu_q_ptr,
        num_seqs, scale, softcap, window, chunk_size,
        stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_bs, stride_bj,
        stride_ot, stride_oh, stride_os,
        stride_lt, stride_lh,
        HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        IS_DECODE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if IS_DECODE:
        seq = tile
        q_off = 0
    else:
        seq = _find_seq(cu_q_ptr, num_seqs, tile, BLOCK_Q)
        q_off = (tile - (tl.load(cu_q_ptr + seq) // BLOCK_Q + seq)) * BLOCK_Q
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if q_off >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    # Rows: query token qi of the tile times query head g of the group.
    rows = tl.arange(0, BLOCK_M)
    qi = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (qi < BLOCK_Q) & (q_off + qi < q_len)
    q_pos = context + q_off + qi
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD
    token = (q_start + q_off + qi).to(tl.int64)  # token * stride can pass 2**31 in a long prefill
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # First key each row sees; the tile's key range runs from its first row's to its last row + 1.
    row_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
    if HAS_WINDOW:
        row_lo = tl.maximum(row_lo, q_pos - window + 1)
    if HAS_CHUNK:
        row_lo = tl.maximum(row_lo, (q_pos // chunk_size) * chunk_size)
    first_pos = context + q_off
    key_lo = tl.zeros([], dtype=tl.int32)
    if HAS_WINDOW:
        key_lo = tl.maximum(key_lo, first_pos - window + 1)
    if HAS_CHUNK:
        key_lo = tl.maximum(key_lo, (first_pos // chunk_size) * chunk_size)
    key_hi = tl.minimum(first_pos + BLOCK_Q, seq_len)
    tile_lo = key_lo // BLOCK_N
    tile_hi = (key_hi + BLOCK_N - 1) // BLOCK_N
    if NUM_SPLITS > 1:
        per_split = (tile_hi - tile_lo + NUM_SPLITS - 1) // NUM_SPLITS
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bs
    for t in range(tile_lo, tile_hi):
        kpos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = (kpos >= key_lo) & (kpos < key_hi)
        block = tl.load(table + (kpos // PAGE) * stride_bj, mask=k_ok, other=0).to(tl.int64)
        in_page = kpos % PAGE
        k = tl.load(k_ptr + (block * stride_kb + in_page * stride_kt + kv_head * stride_kh)[None, :] + d[:, None],
                    mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, k, input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:
            s = softcap * _tanh(s * (scale / softcap)) * LOG2E
        else:
            s = s * (scale * LOG2E)
        visible = (k_ok[None, :] & (kpos[None, :] <= q_pos[:, None]) & (kpos[None, :] >= row_lo[:, None]))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + (block * stride_vb + in_page * stride_vt + kv_head * stride_vh)[:, None] + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + token * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _combine_splits_kernel(part_ptr, lse_ptr, out_ptr,
                           stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
                           HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           SPLITS_PAD: tl.constexpr):
    """Merge one (token, head)'s split partials, weighting each by its share of the softmax mass."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD
    lse = tl.load(lse_ptr + token * stride_lt + head * stride_lh + sp, mask=sp_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    part = tl.load(part_ptr + token * stride_pt + head * stride_ph + sp[:, None] * stride_ps + d[None, :],
                   mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(part * w[:, None], 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def choose_num_splits(num_seqs: int, num_kv_heads: int, key_span: int, num_sms: int) -> int:
    """Programs per decode window: enough to give every SM ``PROGRAMS_PER_SM`` programs, no more than the
    window's ``MIN_SPLIT_TOKENS``-token pieces (``key_span`` bounds what one query can see)."""
    programs = num_seqs * num_kv_heads
    wanted = -(-PROGRAMS_PER_SM * num_sms // programs)
    pieces = -(-key_span // MIN_SPLIT_TOKENS)
    return max(1, min(wanted, pieces, MAX_SPLITS))


def triton_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_lens, *, window=None, scale,
                           softcap=None, chunk_size=None, num_splits=None, block_n=None, block_m=64,
                           num_warps=4, num_stages=2):
    """Launch the kernel; inputs are checked by ``paged_attention``. ``num_splits``, ``block_n``,
    ``block_m``, ``num_warps`` and ``num_stages`` are tuning knobs for the tests and the bench."""
    num_tokens, num_heads, head = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    group = num_heads // num_kv_heads
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head dimension must be contiguous (stride 1), got {t.stride()}")
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    cu_q = torch.zeros(num_seqs + 1, dtype=torch.int32, device=q.device)
    torch.cumsum(query_lens, 0, dtype=torch.int32, out=cu_q[1:])
    is_decode = num_tokens == num_seqs  # every query_len is >= 1, so all of them are 1
    if is_decode:
        block_q = 1
        block_m = max(16, triton.next_power_of_2(group))
        grid_tiles = num_seqs
        if num_splits is None:
            key_span = max_blocks * page
            for limit in (window, chunk_size):
                key_span = min(key_span, limit) if limit is not None else key_span
            num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
            num_splits = choose_num_splits(num_seqs, num_kv_heads, key_span, num_sms)
    else:
        block_m = max(block_m, triton.next_power_of_2(group))
        block_q = block_m // group
        grid_tiles = num_tokens // block_q + num_seqs
        num_splits = 1 if num_splits is None else num_splits
    if num_splits < 1:
        raise ValueError(f"num_splits: must be >= 1, got {num_splits}")
    block_n = block_n or (64 if head <= 128 else 32)
    if num_splits > 1:
        target = torch.empty(num_tokens, num_heads, num_splits, head, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        o_strides = (target.stride(0), target.stride(1), target.stride(2))
        l_strides = (lse.stride(0), lse.stride(1))
    else:
        target, lse = out, out  # lse is not written with one split
        o_strides = (out.stride(0), out.stride(1), 0)
        l_strides = (0, 0)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _paged_attention_kernel[(grid_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, target, lse, block_tables, seq_lens, cu_q,
        num_seqs, float(scale), float(softcap or 0.0), int(window or 0), int(chunk_size or 0),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        *o_strides, *l_strides,
        HEAD=head, HEAD_PAD=max(16, triton.next_power_of_2(head)), PAGE=page, GROUP=group,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        IS_DECODE=is_decode, HAS_WINDOW=window is not None, HAS_CHUNK=chunk_size is not None,
        HAS_SOFTCAP=softcap is not None, DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            target, lse, out,
            target.stride(0), target.stride(1), target.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD=head, HEAD_PAD=triton.next_power_of_2(head), NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4)
    return out
