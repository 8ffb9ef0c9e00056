"""The Triton kernel, run by Triton's interpreter on CPU tensors, against the dense reference.

Cases and reference come from test_attention: the same NaN-poisoned caches, so a load outside the window,
from the null block, from a stale table entry or past ``seq_len`` shows up as NaN or a wrong value.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    from test_attention import MIXED, build_case, dense_attention, run_case
except ImportError:  # tests/ became a package
    from tests.test_attention import MIXED, build_case, dense_attention, run_case

from workers.attention.triton_paged import choose_num_splits, triton_paged_attention

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a GPU")

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _close(out, ref):
    assert not out.isnan().any()
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-6, rtol=1e-5)


def _case(seqs, *, block_size=16, group=4, num_kv_heads=2, head_size=16, window=None, chunk_size=None,
          softcap=None, dtype=torch.float32):
    """Kernel inputs on DEVICE and the dense reference."""
    case = build_case(seqs, block_size=block_size, num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                      head_size=head_size, window=window, chunk_size=chunk_size, dtype=dtype)
    q, k_cache, v_cache, tables, seq_lens, query_lens, keys, values = case
    ref = dense_attention(q, keys, values, seq_lens.tolist(), query_lens.tolist(), window=window,
                          chunk_size=chunk_size, softcap=softcap)  # scale 1/sqrt(head_size)
    return [t.to(DEVICE) for t in (q, k_cache, v_cache, tables, seq_lens, query_lens)], ref


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [None, 1, 5, 33, 1000])
def test_mixed_prefill_and_decode_in_one_launch(block_size, group, window):
    out, ref = run_case(MIXED, block_size=block_size, group=group, window=window, backend="triton",
                        device=DEVICE)
    assert out.shape == (sum(q for _, q in MIXED), 2 * group, 16) and out.dtype == torch.float32
    _close(out, ref)


@pytest.mark.parametrize("window, chunk_size, softcap", [(None, 8, None), (6, 32, None), (7, None, 2.5),
                                                         (None, 16, 2.5)])
def test_chunked_local_and_softcap(window, chunk_size, softcap):
    out, ref = run_case(MIXED, block_size=16, group=4, window=window, chunk_size=chunk_size, softcap=softcap,
                        scale=0.7, backend="triton", device=DEVICE)
    _close(out, ref)


@pytest.mark.parametrize("block_size, block_n", [(32, 16), (16, 64), (16, 16)])
def test_key_tiles_smaller_and_larger_than_pages(block_size, block_n):
    args, ref = _case(MIXED, block_size=block_size, window=19)
    _close(triton_paged_attention(*args, window=19, scale=0.25, block_n=block_n), ref)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("window", [None, 33])
def test_split_decode_combines_partials(num_splits, window):
    # 7 splits of a window of 3 key tiles leave some programs with nothing: their weight must be zero.
    seqs = [(77, 1), (1, 1), (40, 1), (200, 1)]
    args, ref = _case(seqs, window=window)
    _close(triton_paged_attention(*args, window=window, scale=0.25, num_splits=num_splits, block_n=16), ref)


def test_split_decode_with_softcap_and_chunks():
    args, ref = _case([(77, 1), (40, 1), (100, 1)], window=30, chunk_size=48, softcap=3.0)
    out = triton_paged_attention(*args, window=30, chunk_size=48, softcap=3.0, scale=0.25, num_splits=3,
                                 block_n=16)
    _close(out, ref)


def test_odd_group_and_head_size():
    # 3 query heads per KV head and head size 24: padded rows and columns must stay out of the result.
    args, ref = _case(MIXED, group=3, head_size=24, window=9)
    _close(triton_paged_attention(*args, window=9, scale=24 ** -0.5), ref)


def test_float16():
    args, ref = _case(MIXED, window=19, dtype=torch.float16)
    out = triton_paged_attention(*args, window=19, scale=0.25)
    assert out.dtype == torch.float16 and not out.isnan().any()
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("num_seqs, num_kv_heads, key_span, num_sms, expected", [
    (1, 8, 4096, 132, 16),      # one sequence: the window's 256-token pieces bound it
    (32, 8, 4096, 132, 2),      # 256 programs already: split once more to fill 2 per SM
    (128, 8, 4096, 132, 1),     # plenty of programs: no split
    (1, 8, 100, 132, 1),        # a short window is not worth splitting
    (1, 1, 1 << 20, 132, 32),   # capped
    (4, 2, 1 << 20, 1, 1),      # the interpreter's one "SM"
])
def test_choose_num_splits(num_seqs, num_kv_heads, key_span, num_sms, expected):
    assert choose_num_splits(num_seqs, num_kv_heads, key_span, num_sms) == expected


_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from workers.attention import triton_paged as ta

def compile(fn, types, constexprs):
    sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "num_stages": 2})
    assert kernel.metadata.shared <= 232448, kernel.metadata.shared   # sm_90's shared memory per block

ints = {n: "i32" for n in ta._paged_attention_kernel.arg_names if n.startswith("stride") or n in
        ("num_seqs", "window", "chunk_size")}
types = dict(ints, q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*fp32", lse_ptr="*fp32",
             block_tables_ptr="*i32", seq_lens_ptr="*i32", cu_q_ptr="*i32", scale="fp32", softcap="fp32")
for decode, splits in ((True, 16), (False, 1)):
    compile(ta._paged_attention_kernel, types, dict(
        HEAD=128, HEAD_PAD=128, PAGE=16, GROUP=4, BLOCK_Q=1 if decode else 16, BLOCK_M=16 if decode else 64,
        BLOCK_N=64, NUM_SPLITS=splits, IS_DECODE=decode, HAS_WINDOW=True, HAS_CHUNK=not decode,
        HAS_SOFTCAP=not decode, DOT_PRECISION="tf32"))
# bench/e2e_gpu.py's model: head 256, 4 query heads per KV head; bf16, and float32 for its exactness check
for dt, precision in (("bf16", "tf32"), ("fp32", "ieee")):
    for decode, splits in ((True, 4), (False, 1)):
        compile(ta._paged_attention_kernel, dict(types, q_ptr=f"*{dt}", k_ptr=f"*{dt}", v_ptr=f"*{dt}"), dict(
            HEAD=256, HEAD_PAD=256, PAGE=16, GROUP=4, BLOCK_Q=1 if decode else 16, BLOCK_M=16 if decode else 64,
            BLOCK_N=32, NUM_SPLITS=splits, IS_DECODE=decode, HAS_WINDOW=True, HAS_CHUNK=False,
            HAS_SOFTCAP=False, DOT_PRECISION=precision))
types = {n: "i32" for n in ta._combine_splits_kernel.arg_names if n.startswith("stride")}
types.update(part_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16")
compile(ta._combine_splits_kernel, types, dict(HEAD=128, HEAD_PAD=128, NUM_SPLITS=16, SPLITS_PAD=16))
print("compiled")
"""


def test_kernels_compile_for_hopper():
    """The interpreter is laxer than the compiler: build both kernels for sm_90 offline (bf16, head 128; and the
    end-to-end bench's head 256 in bf16 and float32), within sm_90's shared memory."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "compiled"
