"""The CPU backend of ``paged_attention``: plain torch ops, planned once per step.

On CPU a small model's matmuls are small and every torch op costs microseconds of dispatch, so what a
layer costs is mostly how many ops it issues. Everything that depends only on the step's lengths and the
layer's window (which keys each query tile sees, its mask, a decode batch's gather positions) is a
*plan*, built by the first layer of a step and reused by every other layer of the same attention kind;
a layer then gathers its keys and values and runs one matmul, softmax and matmul per query tile. Sequences
that add one token (decodes) are attended together, padded to the longest one's keys.

Nothing outside a query's window reaches a result: a prefill tile gathers only the keys from its first
query's window start to its last query, and a decode batch's padding is masked out of the scores and
zeroed in the values, so a NaN in a slot the manager freed (or never wrote) cannot leak into an output.
Within a tile every key is one the model computed, so its mask is added (-inf), as transformers' eager
attention does, inside the score matmul (``baddbmm``): a tenth of what a ``masked_fill`` costs here.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Queries of one sequence attended at a time: a tile's score matrix stays within the CPU's caches (tiles
# of 256 or 512 queries ran 1.3-1.9x slower than tiles of 128 here, on prompts of 600-2,000 tokens). A
# remainder under half a tile joins the tile before it, so a 140-token prompt is one tile, not two.
QUERY_TILE = 128
# A plan keeps masks up to this many bytes and decode positions up to this many padded keys; beyond
# them (a long context) the rest is built at each call, so a kept plan stays small.
PLAN_MASK_BYTES = 8 << 20
PLAN_DECODE_KEYS = 1 << 20
# Floats of keys gathered at once for a decode batch (2 MiB): larger gathers ran slower, not faster (64
# decodes of 100-600 keys: 1.4 ms a call in batches this size, 6.9 ms in one).
DECODE_BATCH_FLOATS = 1 << 19
# Plans kept: a step needs one per attention kind (window, chunk) of its layers.
PLANS_KEPT = 8


def first_key_position(pos: int, window: int | None, chunk_size: int | None) -> int:
    """Earliest key position a query at ``pos`` attends to."""
    lo = 0
    if window is not None:
        lo = max(lo, pos - window + 1)
    if chunk_size is not None:
        lo = max(lo, (pos // chunk_size) * chunk_size)
    return lo


@dataclass(frozen=True)
class _Tile:
    seq: int
    rows: slice            # this tile's rows of the packed queries
    first_block: int       # block_tables columns [first_block, end_block) hold its keys
    end_block: int
    keys: slice            # its keys among those blocks' slots
    first_key: int         # the position of its first key, and of its first query
    first_query: int
    bias: torch.Tensor | None     # [queries * group, keys]: -inf where a query must not see a key, else 0;
                                  # None: a single query, which sees every key of its tile, or a mask over
                                  # the plan's budget, built at each call


@dataclass(frozen=True)
class _DecodeBatch:
    rows: torch.Tensor     # [n] rows of the packed queries, one per sequence
    seqs: torch.Tensor     # [n] their block_tables rows
    blocks: torch.Tensor   # [n, keys] block_tables column of each key
    offsets: torch.Tensor  # [n, keys] its slot within that block
    padding: torch.Tensor  # [n, keys] True past a sequence's own keys
    padded: torch.Tensor | None   # the padding's flat indices (row * keys + key); None: all as long


@dataclass(frozen=True)
class _Plan:
    tiles: tuple[_Tile, ...]
    decodes: tuple   # _DecodeBatch, or the (row, seq, first key, seq_len) of one to build per call


def torch_paged_attention(q, k_cache, v_cache, block_tables, seq_lens: list[int], query_lens: list[int],
                          window, scale, softcap, chunk_size) -> torch.Tensor:
    """``paged_attention`` on torch ops; the lengths come as lists, already read and checked."""
    _, block_size, num_kv_heads, head_size = k_cache.shape
    group = q.shape[1] // num_kv_heads
    plan = _plan(block_size, window, chunk_size, tuple(seq_lens), tuple(query_lens), group,
                 DECODE_BATCH_FLOATS // (num_kv_heads * head_size), q.device)
    out = torch.empty_like(q)
    queries = q.view(-1, num_kv_heads, group, head_size)
    out_grouped = out.view(-1, num_kv_heads, group, head_size)
    for tile in plan.tiles:
        ids = block_tables[tile.seq, tile.first_block:tile.end_block].long()
        k = k_cache.index_select(0, ids).flatten(0, 1)[tile.keys].float()    # [keys, kv heads, head]
        v = v_cache.index_select(0, ids).flatten(0, 1)[tile.keys].float()
        n = tile.rows.stop - tile.rows.start
        bias = tile.bias
        if bias is None and n > 1:
            bias = _bias(tile.first_key, tile.first_query, n, k.shape[0], window, chunk_size, group, q.device)
        # Query-major rows within each KV head: [kv heads, n * group, head].
        qs = queries[tile.rows].float().permute(1, 0, 2, 3).reshape(num_kv_heads, n * group, head_size)
        if softcap is not None:
            scores = _capped(torch.bmm(qs, k.permute(1, 2, 0)), scale, softcap)
            if bias is not None:
                scores.add_(bias)
        elif bias is not None:
            scores = torch.baddbmm(bias, qs, k.permute(1, 2, 0), alpha=scale)
        else:
            scores = torch.bmm(qs, k.permute(1, 2, 0)).mul_(scale)
        probs = torch.softmax(scores, dim=-1)
        o = torch.bmm(probs, v.transpose(0, 1))                               # [kv heads, n * group, head]
        out_grouped[tile.rows] = o.view(num_kv_heads, n, group, head_size).transpose(0, 1)
    keys_flat = k_cache.view(-1, num_kv_heads, head_size)
    values_flat = v_cache.view(-1, num_kv_heads, head_size)
    for batch in plan.decodes:
        if not isinstance(batch, _DecodeBatch):
            batch = _decode_batch(batch, block_size, q.device)
        # The padding points at column 0's first slot: a real slot, read and then hidden.
        slots = block_tables[batch.seqs].long().gather(1, batch.blocks).mul_(block_size).add_(batch.offsets)
        n, num_keys = slots.shape
        k = keys_flat.index_select(0, slots.view(-1)).float().view(n, num_keys, num_kv_heads, head_size)
        v = values_flat.index_select(0, slots.view(-1)).float()
        if batch.padded is not None:      # zero the padding's values: 0 * NaN would survive a zero weight
            v.index_fill_(0, batch.padded, 0.0)
        v = v.view(n, num_keys, num_kv_heads, head_size)
        qs = queries[batch.rows].float()                                      # [n, kv heads, group, head]
        # One matmul per KV head over strided views: cheaper than copying the keys head-major.
        scores = torch.stack([torch.bmm(qs[:, h], k[:, :, h].transpose(1, 2)) for h in range(num_kv_heads)], 1)
        scores = _capped(scores, scale, softcap) if softcap is not None else scores.mul_(scale)
        # masked_fill, not an added -inf: the padding read slots nobody wrote, whose NaN would survive an add.
        probs = torch.softmax(scores.masked_fill_(batch.padding[:, None, None, :], float("-inf")), dim=-1)
        o = torch.stack([torch.bmm(probs[:, h], v[:, :, h]) for h in range(num_kv_heads)], 1)
        out_grouped.index_copy_(0, batch.rows, o.to(q.dtype))
    return out


def _capped(scores, scale, softcap):
    """``softcap * tanh(scale * scores / softcap)`` (Gemma-2), in place where it can be."""
    return torch.tanh(scores.mul_(scale / softcap)).mul_(softcap)


@functools.lru_cache(maxsize=PLANS_KEPT)
def _plan(block_size: int, window, chunk_size, seq_lens: tuple, query_lens: tuple, group: int,
          batch_keys: int, device: torch.device) -> _Plan:
    tiles, decodes, mask_bytes, row = [], [], 0, 0

    def tile(s: int, row: int, context: int, t0: int, t1: int) -> _Tile:
        nonlocal mask_bytes
        first_pos, end_pos = context + t0, context + t1
        lo = first_key_position(first_pos, window, chunk_size)
        b0 = lo // block_size
        bias = None                           # one query sees all its keys: nothing to hide
        if t1 - t0 > 1 and mask_bytes + 4 * (t1 - t0) * group * (end_pos - lo) <= PLAN_MASK_BYTES:
            bias = _bias(lo, first_pos, t1 - t0, end_pos - lo, window, chunk_size, group, device)
            mask_bytes += 4 * bias.numel()
        return _Tile(s, slice(row + t0, row + t1), b0, (end_pos - 1) // block_size + 1,
                     slice(lo - b0 * block_size, end_pos - b0 * block_size), lo, first_pos, bias)

    for s, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        context = seq_len - query_len
        if query_len == 1:
            decodes.append((row, s, first_key_position(context, window, chunk_size), seq_len))
        bounds = [] if query_len == 1 else [*range(0, query_len, QUERY_TILE), query_len]
        if len(bounds) > 2 and bounds[-1] - bounds[-2] < QUERY_TILE // 2:
            del bounds[-2]
        tiles += [tile(s, row, context, t0, t1) for t0, t1 in zip(bounds, bounds[1:])]
        row += query_len
    batches, kept = [], 0
    for part in _decode_parts(decodes, batch_keys):
        if len(part) == 1:                    # a lone decode is a one-query tile: nothing to batch
            r, s, _, seq_len = part[0]
            tiles.append(tile(s, r, seq_len - 1, 0, 1))
            continue
        padded = len(part) * (part[0][3] - part[0][2])
        batches.append(_decode_batch(part, block_size, device) if kept + padded <= PLAN_DECODE_KEYS else part)
        kept += padded
    return _Plan(tuple(tiles), tuple(batches))


def _bias(lo: int, first_pos: int, queries: int, keys: int, window, chunk_size, group: int,
          device: torch.device) -> torch.Tensor:
    """[queries * group, keys]: -inf where query ``first_pos + i`` (each of its ``group`` heads) must not see
    key ``lo + j``, else 0."""
    qpos = torch.arange(first_pos, first_pos + queries, device=device)[:, None]
    kpos = torch.arange(lo, lo + keys, device=device)[None, :]
    hidden = kpos > qpos
    if window is not None:
        hidden |= kpos <= qpos - window
    if chunk_size is not None:
        hidden |= kpos < qpos // chunk_size * chunk_size
    bias = torch.zeros(queries, keys, device=device).masked_fill_(hidden, float("-inf"))
    return bias.repeat_interleave(group, dim=0)


def _decode_parts(decodes: list[tuple[int, int, int, int]], batch_keys: int) -> list[list]:
    """Decodes ``(row, seq, first key, seq_len)`` split into batches, longest first. A batch closes before
    its padded keys would pass ``batch_keys`` or half again its real ones: padding costs what real keys
    cost, so at most a third of a batch's work is padding."""
    decodes = sorted(decodes, key=lambda d: d[2] - d[3])
    parts, start = [], 0
    while start < len(decodes):
        longest = decodes[start][3] - decodes[start][2]
        end, real = start + 1, longest
        while end < len(decodes):
            keys = decodes[end][3] - decodes[end][2]
            padded = (end - start + 1) * longest
            if padded > batch_keys or 2 * padded > 3 * (real + keys):
                break
            end, real = end + 1, real + keys
        parts.append(decodes[start:end])
        start = end
    return parts


def _decode_batch(part: list[tuple[int, int, int, int]], block_size: int, device: torch.device) -> _DecodeBatch:
    """Gather positions for decodes ``(row, seq, first key, seq_len)``: each sees exactly its keys
    ``first key .. seq_len - 1`` (all of a decode's window is visible)."""
    counts = [seq_len - lo for _, _, lo, seq_len in part]
    first = torch.tensor([lo for _, _, lo, _ in part], device=device)[:, None]
    j = torch.arange(max(counts), device=device)[None, :]
    padding = j >= torch.tensor(counts, device=device)[:, None]
    pos = (first + j).masked_fill_(padding, 0)
    padded = padding.view(-1).nonzero().view(-1) if min(counts) < max(counts) else None
    return _DecodeBatch(torch.tensor([r for r, *_ in part], device=device),
                        torch.tensor([s for _, s, *_ in part], device=device),
                        pos // block_size, pos % block_size, padding, padded)
