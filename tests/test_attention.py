"""paged_attention (torch backend), store_kv, slot_mapping and backend selection against a dense reference.

The cache each case builds is what swakv's manager leaves behind: blocks wholly before a sequence's first
needed key are dropped (table entry 0, or a stale id of a block now NaN or holding another sequence's
data), and every slot nobody wrote, the null block included, holds NaN. A read outside the window or
past ``seq_len`` would therefore show up as NaN or as a wrong value.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import math

import pytest
import torch

from workers.attention import BACKEND_ENV, paged_attention, select_backend, store_kv

from drivers import slot_mapping

NAN = float("nan")


def dense_attention(q, keys, values, seq_lens, query_lens, *, window=None, chunk_size=None, softcap=None,
                    scale=None):
    """Plain per-sequence masked softmax over contiguous K/V, in float64."""
    head_size = q.shape[2]
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    outs, t = [], 0
    for k, v, seq_len, query_len in zip(keys, values, seq_lens, query_lens):
        group = q.shape[1] // k.shape[1]
        qs = q[t:t + query_len].double()
        kk = k[:seq_len].double().repeat_interleave(group, dim=1)
        vv = v[:seq_len].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, kk) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(seq_len - query_len, seq_len)[:, None]
        kpos = torch.arange(seq_len)[None, :]
        visible = kpos <= qpos
        if window is not None:
            visible &= kpos >= qpos - window + 1
        if chunk_size is not None:
            visible &= kpos >= qpos // chunk_size * chunk_size
        probs = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vv))
        t += query_len
    return torch.cat(outs)


def build_case(seqs, *, block_size, num_heads, num_kv_heads, head_size=16, window=None, chunk_size=None,
               dtype=torch.float32, seed=0):
    """A paged cache holding only what the manager keeps, NaN everywhere else; plus contiguous K/V."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-seq_len // block_size) for seq_len, _ in seqs) + 2
    num_blocks = 2 + sum(-(-seq_len // block_size) for seq_len, _ in seqs)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_size), NAN, dtype=dtype)
    v_cache = torch.full_like(k_cache, NAN)
    stale = num_blocks - 1  # a block nobody holds any more: NaN
    # Columns past each sequence's last block hold garbage ids too; they must never be read.
    tables = torch.full((len(seqs), max_blocks), stale, dtype=torch.int32)
    order = torch.randperm(num_blocks - 2, generator=gen) + 1
    keys, values, next_free = [], [], 0
    for s, (seq_len, query_len) in enumerate(seqs):
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        keys.append(k)
        values.append(v)
        first_pos, lo = seq_len - query_len, 0  # lo: the first key the step's first query sees
        if window is not None:
            lo = max(lo, first_pos - window + 1)
        if chunk_size is not None:
            lo = max(lo, first_pos // chunk_size * chunk_size)
        for j in range(-(-seq_len // block_size)):
            block = int(order[next_free])
            next_free += 1
            if (j + 1) * block_size <= lo:
                # Dropped: the null block, a NaN block, or a block reused by the previous sequence.
                tables[s, j] = (0, stale, int(tables[s - 1, 0]) if s else 0)[j % 3]
                continue
            tables[s, j] = block
            for off in range(block_size):
                pos = j * block_size + off
                if lo <= pos < seq_len:
                    k_cache[block, off] = k[pos]
                    v_cache[block, off] = v[pos]
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    query_lens = torch.tensor([q for _, q in seqs], dtype=torch.int32)
    q = torch.randn(int(query_lens.sum()), num_heads, head_size, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, seq_lens, query_lens, keys, values


# (seq_len, query_len): a one-token sequence, a decode after a long context, a fresh prefill longer than
# most windows, a chunked-prefill step on top of context, a short prefill with a little context.
MIXED = [(1, 1), (77, 1), (50, 50), (70, 21), (9, 3)]


def run_case(seqs, *, block_size, group, window=None, chunk_size=None, softcap=None, scale=None,
             backend="torch", dtype=torch.float32, num_kv_heads=2, device="cpu"):
    """paged_attention on a built case, and the dense reference (float64, on CPU)."""
    case = build_case(seqs, block_size=block_size, num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                      window=window, chunk_size=chunk_size, dtype=dtype)
    q, k_cache, v_cache, tables, seq_lens, query_lens, keys, values = case
    inputs = [t.to(device) for t in (q, k_cache, v_cache, tables, seq_lens, query_lens)]
    out = paged_attention(*inputs, window=window, scale=scale, softcap=softcap, chunk_size=chunk_size,
                          backend=backend)
    ref = dense_attention(q, keys, values, seq_lens.tolist(), query_lens.tolist(), window=window,
                          chunk_size=chunk_size, softcap=softcap, scale=scale)
    return out.cpu(), ref


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [None, 1, 5, 19, 33, 1000])
def test_mixed_batch_matches_dense_reference(block_size, group, window):
    out, ref = run_case(MIXED, block_size=block_size, group=group, window=window)
    assert out.shape == (sum(q for _, q in MIXED), 2 * group, 16) and out.dtype == torch.float32
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("chunk_size", [8, 32])
def test_chunked_local_attention(window, chunk_size):
    out, ref = run_case(MIXED, block_size=16, group=4, window=window, chunk_size=chunk_size)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_softcap_and_scale(window):
    out, ref = run_case(MIXED, block_size=16, group=4, window=window, softcap=2.5, scale=0.7)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


def test_long_prefill_crosses_query_tiles():
    # 300 queries: three of the torch backend's 128-query tiles, each gathering only its own windows.
    out, ref = run_case([(300, 300), (260, 1)], block_size=16, group=4, window=40)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


# Decodes of many lengths (two as long as each other, a one-token sequence): the torch backend attends
# decodes together, padded to the longest one's keys, and the padding reads slots that hold NaN here.
DECODES = [(77, 1), (3, 1), (150, 1), (150, 1), (40, 1), (1, 1), (33, 1)]


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decodes_of_different_lengths_attended_together_read_no_padding(window, block_size):
    out, ref = run_case(DECODES, block_size=block_size, group=4, window=window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


def test_a_plan_over_its_budgets_builds_per_call_and_gives_the_same_figures(monkeypatch):
    """A long context's masks and decode positions are built at each call, and its decodes split into
    small batches, instead of kept in the step's plan: the outputs do not change."""
    from workers.attention import torch_paged
    seqs = MIXED + DECODES + [(300, 300)]
    monkeypatch.setattr(torch_paged, "PLAN_MASK_BYTES", 0)
    monkeypatch.setattr(torch_paged, "PLAN_DECODE_KEYS", 0)
    monkeypatch.setattr(torch_paged, "DECODE_BATCH_FLOATS", 100 * 2 * 16)   # 100 keys of 2 KV heads of 16
    torch_paged._plan.cache_clear()
    out, ref = run_case(seqs, block_size=16, group=4, window=40)
    plan = torch_paged._plan(16, 40, None, *(tuple(column) for column in zip(*seqs)), 4, 100, torch.device("cpu"))
    torch_paged._plan.cache_clear()
    assert all(t.bias is None for t in plan.tiles)      # every mask built at its call
    assert len(plan.decodes) > 1 and not any(isinstance(b, torch_paged._DecodeBatch) for b in plan.decodes)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


def test_one_plan_per_window_for_the_same_lengths():
    """Layers of two attention kinds in one step share the lengths, not the plan."""
    for window in (None, 5, None, 12):
        out, ref = run_case(MIXED, block_size=16, group=2, window=window)
        torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


def test_bfloat16_output_dtype_and_accuracy():
    out, ref = run_case(MIXED, block_size=16, group=4, window=19, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_query_transposed_from_heads_first(backend):
    """transformers hands queries over as [heads, tokens, head_size]; the transposed view is accepted as is."""
    q, k_cache, v_cache, tables, seq_lens, query_lens, keys, values = build_case(
        MIXED, block_size=16, num_heads=8, num_kv_heads=2, window=5)
    q_view = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not q_view.is_contiguous()
    out = paged_attention(q_view, k_cache, v_cache, tables, seq_lens, query_lens, window=5, backend=backend)
    ref = dense_attention(q, keys, values, seq_lens.tolist(), query_lens.tolist(), window=5)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


def test_nan_inside_the_window_does_reach_the_output():
    """The NaN poisoning above is not vacuous: a NaN in a slot the window covers does surface."""
    q, k_cache, v_cache, tables, seq_lens, query_lens, *_ = build_case(
        [(40, 1)], block_size=16, num_heads=2, num_kv_heads=2, window=10)
    assert not paged_attention(q, k_cache, v_cache, tables, seq_lens, query_lens, window=10).isnan().any()
    v_cache[tables[0, 1], 15] = NAN  # position 31: inside 30..39
    assert paged_attention(q, k_cache, v_cache, tables, seq_lens, query_lens, window=10).isnan().all()


def test_window_one_returns_own_value():
    q, k_cache, v_cache, tables, seq_lens, query_lens, keys, values = build_case(
        [(20, 4)], block_size=16, num_heads=4, num_kv_heads=2, window=1)
    out = paged_attention(q, k_cache, v_cache, tables, seq_lens, query_lens, window=1)
    expected = values[0][16:20].repeat_interleave(2, dim=1)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_slot_mapping_exact_slots():
    tables = torch.tensor([[5, 2, 9], [7, 3, 0]], dtype=torch.int32)
    slots = slot_mapping(tables, torch.tensor([10, 6]), torch.tensor([3, 1]), block_size=4)
    # seq 0 positions 7, 8, 9 -> block 2 offset 3, block 9 offsets 0, 1; seq 1 position 5 -> block 3 offset 1
    assert slots.tolist() == [11, 36, 37, 13]


def test_store_kv_writes_only_the_given_slots():
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros(4, 4, 2, 8)
    key = torch.arange(3 * 2 * 8, dtype=torch.float32).view(3, 2, 8) + 1
    value = -key
    store_kv(k_cache, v_cache, key, value, torch.tensor([11, 4, 15]))
    assert torch.equal(k_cache[2, 3], key[0]) and torch.equal(k_cache[1, 0], key[1])
    assert torch.equal(k_cache[3, 3], key[2]) and torch.equal(v_cache[3, 3], value[2])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 3 and int((v_cache != 0).any(dim=(2, 3)).sum()) == 3


def test_store_then_attend_like_a_worker():
    """Two steps of a sliding layer: prefill 20 tokens, then decode one, writing K/V through store_kv."""
    gen = torch.Generator().manual_seed(1)
    block_size, window = 8, 6
    k_all = torch.randn(21, 2, 16, generator=gen)
    v_all = torch.randn(21, 2, 16, generator=gen)
    q_all = torch.randn(21, 4, 16, generator=gen)
    k_cache = torch.full((8, block_size, 2, 16), NAN)
    v_cache = torch.full_like(k_cache, NAN)
    tables = torch.tensor([[3, 5, 2]], dtype=torch.int32)
    for seq_len, query_len in ((20, 20), (21, 1)):
        seq_lens, query_lens = torch.tensor([seq_len]), torch.tensor([query_len])
        new = slice(seq_len - query_len, seq_len)
        store_kv(k_cache, v_cache, k_all[new], v_all[new], slot_mapping(tables, seq_lens, query_lens, block_size))
        out = paged_attention(q_all[new], k_cache, v_cache, tables, seq_lens, query_lens, window=window)
        ref = dense_attention(q_all[new], [k_all], [v_all], [seq_len], [query_len], window=window)
        torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
        tables = torch.tensor([[0, 5, 2]], dtype=torch.int32)  # the manager drops block 0 (positions 0..7)
        k_cache[3] = NAN


def _small_inputs(**over):
    q, k_cache, v_cache, tables, seq_lens, query_lens, *_ = build_case(
        [(10, 2), (5, 1)], block_size=4, num_heads=4, num_kv_heads=2)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, seq_lens=seq_lens,
                query_lens=query_lens)
    args.update(over)
    return args


@pytest.mark.parametrize("over, kwargs, error, field", [
    ({}, {"window": 0}, ValueError, "window"),
    ({}, {"window": 2.5}, ValueError, "window"),
    ({}, {"chunk_size": -3}, ValueError, "chunk_size"),
    ({}, {"softcap": 0.0}, ValueError, "softcap"),
    ({}, {"scale": float("inf")}, ValueError, "scale"),
    ({}, {"backend": "cuda"}, ValueError, "backend"),
    ({"q": torch.zeros(3, 4)}, {}, ValueError, "q"),
    ({"q": torch.zeros(3, 3, 16)}, {}, ValueError, "num_heads"),
    ({"q": torch.zeros(3, 4, 8)}, {}, ValueError, "head_size"),
    ({"q": torch.zeros(3, 4, 16, dtype=torch.float64)}, {}, TypeError, "k_cache"),
    ({"v_cache": torch.zeros(9, 4, 2, 8)}, {}, ValueError, "v_cache"),
    ({"block_tables": torch.zeros(2, 5)}, {}, TypeError, "block_tables"),
    ({"seq_lens": torch.tensor([10, 5, 1])}, {}, ValueError, "seq_lens"),
    ({"query_lens": torch.tensor([1, 1])}, {}, ValueError, "query_lens"),
    ({"query_lens": torch.tensor([3, 0])}, {}, ValueError, "query_lens"),
    ({"seq_lens": torch.tensor([10, 0])}, {}, ValueError, "query_lens"),
    ({"seq_lens": torch.tensor([30, 5])}, {}, ValueError, "seq_lens"),
])
def test_bad_input_names_the_field(over, kwargs, error, field):
    with pytest.raises(error, match=field):
        paged_attention(**_small_inputs(**over), **kwargs)


def test_backend_selection(monkeypatch):
    q = torch.zeros(1, 2, 16)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_backend(q) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert select_backend(q) == "triton"  # TRITON_INTERPRET=1 is set, so CPU tensors may use it
    assert select_backend(q, "torch") == "torch"
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        select_backend(q)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_backend(q, "triton")


@pytest.mark.parametrize("args, error, field", [
    (dict(key=torch.zeros(2, 2, 4)), ValueError, "key"),
    (dict(value=torch.zeros(2, 2, 8, dtype=torch.float64)), TypeError, "value"),
    (dict(slot_mapping=torch.tensor([4])), ValueError, "slot_mapping"),
    (dict(slot_mapping=torch.tensor([4.0, 5.0])), TypeError, "slot_mapping"),
    (dict(slot_mapping=torch.tensor([4, 16])), ValueError, "slot_mapping"),
    (dict(slot_mapping=torch.tensor([3, 5])), ValueError, "null block"),
])
def test_store_kv_bad_input_changes_nothing(args, error, field):
    k_cache, v_cache = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    call = dict(key=torch.ones(2, 2, 8), value=torch.ones(2, 2, 8), slot_mapping=torch.tensor([4, 5]))
    call.update(args)
    with pytest.raises(error, match=field):
        store_kv(k_cache, v_cache, **call)
    assert not k_cache.any() and not v_cache.any()
