"""Sliding-window attention on one GPU, side by side: swakv's Triton kernel against the dense ideals.

Decode (one query per sequence, window W over a context of L tokens), for B sequences:
  triton        workers.attention.triton_paged on a paged cache (block 16); the table's dropped entries are the
                null block, filled with NaN, as swakv's manager leaves them; the pool holds the window
  triton_graph  the same, replayed from a CUDA graph (no Python launch overhead)
  sdpa_slice    SDPA over a contiguous view of the last W tokens: the dense ideal, O(W)
  sdpa_masked   SDPA over the whole contiguous context with a window mask: O(L)
  flex          FlexAttention with a sliding-window BlockMask (compile failures are recorded, not hidden)
  bound_ms      bytes of the window's K and V / 4.8 TB/s (and / the measured copy bandwidth)
Prefill of one prompt of P tokens with window W: the kernel against full causal SDPA (flash) and
FlexAttention with a causal sliding BlockMask; TFLOP/s counts only the in-window work.

Each row is a JSON line in --out; a table of times and ratios follows. Use --dry-run on CPU (tiny shapes,
Triton interpreter) to check the script itself.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

HBM_TBPS = 4.8  # H200 datasheet


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON lines go here")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, kernel under the interpreter")
    p.add_argument("--batches", type=int, nargs="+", help="default 1 32 128 (dry run: 1 3)")
    p.add_argument("--contexts", type=int, nargs="+", help="default 8192 32768 131072 (dry run: 128 256)")
    p.add_argument("--window", type=int, help="default 4096 (dry run: 64)")
    p.add_argument("--prefill", type=int, help="prompt length, default 32768 (dry run: 200); 0 skips prefill")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (each shape compiles anew)")
    p.add_argument("--sweep", action="store_true", help="also time other kernel tile configurations")
    p.add_argument("--max-contiguous-gb", type=float, default=80.0,
                   help="skip the contiguous baselines when their K+V would exceed this")
    args = p.parse_args(argv)
    defaults = ([1, 3], [128, 256], 64, 200) if args.dry_run else ([1, 32, 128], [8192, 32768, 131072], 4096, 32768)
    for name, value in zip(("batches", "contexts", "window", "prefill"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


class Shapes:
    """Head layout of the measured model; tiny under --dry-run."""

    def __init__(self, dry_run: bool):
        self.num_heads, self.num_kv_heads, self.head_size = (4, 2, 16) if dry_run else (32, 8, 128)
        self.block_size = 16


def window_blocks(context: int, window: int, block_size: int) -> range:
    """Logical blocks the decode query at position ``context - 1`` reads."""
    first = max(0, context - window) // block_size
    return range(first, (context - 1) // block_size + 1)


def window_kv_bytes(batch: int, context: int, window: int, num_kv_heads: int, head_size: int,
                    elem_bytes: int) -> int:
    """Bytes of K and V one decode step must read: min(W, L) tokens per sequence, each K and V once."""
    return 2 * batch * min(window, context) * num_kv_heads * head_size * elem_bytes


def window_prefill_flops(prompt: int, window: int, num_heads: int, head_size: int) -> int:
    """FLOPs of QK^T and PV over the in-window keys only: query p sees min(p + 1, W) keys."""
    full = min(prompt, window)
    keys = full * (full + 1) // 2 + (prompt - full) * window
    return 4 * keys * num_heads * head_size


def build_paged_decode(k, v, context: int, window: int, block_size: int, gen):
    """A pool holding each sequence's window blocks at shuffled ids, a table with nulls elsewhere, and a
    NaN null block: what swakv's manager leaves for a sliding layer in steady decode. ``k``/``v`` hold the
    last ``k.shape[2]`` positions of the context; slots they do not cover (before the window in its first
    block, past the context in its last) are NaN, so a read there would show."""
    import torch

    batch, num_kv_heads, held, head_size = k.shape
    blocks = window_blocks(context, window, block_size)
    n = len(blocks)
    first_pos, offset = blocks.start * block_size, context - held
    lo = max(first_pos, offset)
    ids = torch.randperm(batch * n, generator=gen).to(k.device) + 1
    pools = []
    for src in (k, v):
        span = torch.full((batch, num_kv_heads, n * block_size, head_size), float("nan"), dtype=k.dtype,
                          device=k.device)
        span[:, :, lo - first_pos:context - first_pos] = src[:, :, lo - offset:]
        pool = torch.full((1 + batch * n, block_size, num_kv_heads, head_size), float("nan"), dtype=k.dtype,
                          device=k.device)
        pool[ids] = span.transpose(1, 2).reshape(batch * n, block_size, num_kv_heads, head_size)
        pools.append(pool)
        del span
    tables = torch.zeros(batch, -(-context // block_size), dtype=torch.int32, device=k.device)
    tables[:, blocks.start:blocks.stop] = ids.view(batch, n).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=k.device)
    query_lens = torch.ones(batch, dtype=torch.int32, device=k.device)
    return pools[0], pools[1], tables, seq_lens, query_lens


class Timer:
    """do_bench on CUDA (as the anchor did); a few wall-clock repetitions on CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __call__(self, fn) -> float:
        if self.cuda:
            from triton.testing import do_bench
            return do_bench(fn, warmup=10, rep=60)
        fn()
        start = time.perf_counter()
        for _ in range(2):
            fn()
        return (time.perf_counter() - start) / 2 * 1e3

    def graph(self, fn) -> float | None:
        if not self.cuda:
            return None
        from triton.testing import do_bench_cudagraph
        return do_bench_cudagraph(fn, rep=60)


def measured_copy_tbps(cuda: bool) -> float | None:
    if not cuda:
        return None
    import torch
    from triton.testing import do_bench
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x))
    del x, y
    return 2 * (2 << 30) / (ms * 1e-3) / 1e12


def attempt(fn):
    """Run ``fn``; on failure return the error as a short string so the row records it."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  (recorded in the row: compile failures are a result)
        return f"failed: {type(e).__name__}: {str(e)[:200]}"


def decode_row(batch, context, args, shapes, env):
    import torch
    import torch.nn.functional as F
    from workers.attention.triton_paged import triton_paged_attention

    dev, dt, timer = env["device"], env["dtype"], env["timer"]
    hq, hkv, d, w = shapes.num_heads, shapes.num_kv_heads, shapes.head_size, args.window
    gen = torch.Generator().manual_seed(batch * 7 + context)
    q = torch.randn(batch, hq, 1, d, generator=gen).to(dev, dt)
    contiguous_gb = 2 * batch * context * hkv * d * dt.itemsize / 1e9
    with_contiguous = contiguous_gb <= args.max_contiguous_gb
    # Full contiguous K/V for the masked baselines; otherwise only the window (paged pool and slice need it).
    length = context if with_contiguous else min(w, context)
    k = torch.randn(batch, hkv, length, d, device=dev, dtype=dt)
    v = torch.randn(batch, hkv, length, d, device=dev, dtype=dt)
    start = length - min(w, context)
    ks, vs = k[:, :, start:], v[:, :, start:]
    ref = F.scaled_dot_product_attention(q.float(), ks.float(), vs.float(), enable_gqa=True)[:, :, 0]
    row = {"kind": "decode", "B": batch, "L": context, "W": w, "Hq": hq, "Hkv": hkv, "D": d,
           "dtype": str(dt).removeprefix("torch."), "contiguous_gb": round(contiguous_gb, 2)}

    pool_k, pool_v, tables, seq_lens, query_lens = build_paged_decode(k, v, context, w, shapes.block_size, gen)
    qp = q[:, :, 0].contiguous()
    scale = d ** -0.5

    def kernel(**knobs):
        return lambda: triton_paged_attention(qp, pool_k, pool_v, tables, seq_lens, query_lens, window=w,
                                              scale=scale, **knobs)

    out = kernel()()
    row["triton_err"] = (out.float() - ref).abs().max().item()
    row["triton"] = timer(kernel())
    row["triton_graph"] = attempt(lambda: timer.graph(kernel()))
    row["sdpa_slice"] = timer(lambda: F.scaled_dot_product_attention(q, ks, vs, enable_gqa=True))
    row["sdpa_slice_graph"] = attempt(lambda: timer.graph(
        lambda: F.scaled_dot_product_attention(q, ks, vs, enable_gqa=True)))
    if with_contiguous:
        mask = torch.zeros(1, 1, 1, context, dtype=torch.bool, device=dev)
        mask[..., start:] = True
        row["sdpa_masked"] = timer(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
        if not args.no_flex:
            row.update(flex_decode(q, k, v, start, ref, env))
    if args.sweep and env["cuda"]:
        row["sweep"] = {f"n{bn}_s{st}_w{nw}": attempt(lambda: timer(kernel(block_n=bn, num_stages=st, num_warps=nw)))
                        for bn in (32, 64, 128) for st in (2, 3) for nw in (4,)}
    nbytes = window_kv_bytes(batch, context, w, hkv, d, dt.itemsize)
    row["bound_ms"] = nbytes / (HBM_TBPS * 1e12) * 1e3
    if env["copy_tbps"]:
        row["bound_copy_ms"] = nbytes / (env["copy_tbps"] * 1e12) * 1e3
    return row


def flex_decode(q, k, v, start, ref, env):
    from torch.nn.attention.flex_attention import create_block_mask

    def in_window(b, h, qi, kv):
        return kv >= start

    def run():
        bm = create_block_mask(in_window, B=None, H=None, Q_LEN=1, KV_LEN=k.shape[2], device=str(q.device))
        out = env["flex"](q, k, v, block_mask=bm, enable_gqa=True)
        err = (out[:, :, 0].float() - ref).abs().max().item()
        return {"flex": env["timer"](lambda: env["flex"](q, k, v, block_mask=bm, enable_gqa=True)), "flex_err": err}

    result = attempt(run)
    return result if isinstance(result, dict) else {"flex": result}


def prefill_row(prompt, args, shapes, env):
    import torch
    import torch.nn.functional as F
    from workers.attention.triton_paged import triton_paged_attention

    dev, dt, timer = env["device"], env["dtype"], env["timer"]
    hq, hkv, d, w, bs = shapes.num_heads, shapes.num_kv_heads, shapes.head_size, args.window, shapes.block_size
    gen = torch.Generator().manual_seed(prompt)
    q = torch.randn(1, hq, prompt, d, device=dev, dtype=dt)
    k = torch.randn(1, hkv, prompt, d, device=dev, dtype=dt)
    v = torch.randn(1, hkv, prompt, d, device=dev, dtype=dt)
    pool_k, pool_v, tables, seq_lens, _ = build_paged_decode(k, v, prompt, prompt, bs, gen)
    query_lens = seq_lens.clone()
    qp = q[0].transpose(0, 1).contiguous()
    scale = d ** -0.5

    def kernel(**knobs):
        return lambda: triton_paged_attention(qp, pool_k, pool_v, tables, seq_lens, query_lens, window=w,
                                              scale=scale, **knobs)

    out = kernel()()
    flops = window_prefill_flops(prompt, w, hq, d)
    row = {"kind": "prefill", "P": prompt, "W": w, "Hq": hq, "Hkv": hkv, "D": d,
           "dtype": str(dt).removeprefix("torch."), "window_tflop": flops / 1e12,
           "triton_err": sampled_prefill_error(out, q, k, v, w, scale)}
    row["triton"] = timer(kernel())
    row["triton_tflops"] = flops / (row["triton"] * 1e-3) / 1e12
    row["sdpa_causal_full"] = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    if not args.no_flex:
        from torch.nn.attention.flex_attention import create_block_mask

        def sliding_causal(b, h, qi, kv):
            return (kv <= qi) & (qi - kv < w)

        def run():
            bm = create_block_mask(sliding_causal, B=None, H=None, Q_LEN=prompt, KV_LEN=prompt, device=str(dev))
            return timer(lambda: env["flex"](q, k, v, block_mask=bm, enable_gqa=True))
        row["flex"] = attempt(run)
    if args.sweep and env["cuda"]:
        row["sweep"] = {f"m{bm}_n{bn}_s{st}_w{nw}": attempt(lambda: timer(kernel(block_m=bm, block_n=bn,
                                                                                 num_stages=st, num_warps=nw)))
                        for bm in (64, 128) for bn in (32, 64) for st in (2,) for nw in (4, 8)}
    return row


def sampled_prefill_error(out, q, k, v, window, scale, samples=48):
    """Max error over a few query positions (ends, window edges, random), each against SDPA on its slice."""
    import torch
    import torch.nn.functional as F

    prompt = q.shape[2]
    picks = {0, 1, window - 1, window, window + 1, prompt - 1}
    picks |= set(torch.randint(0, prompt, (samples,), generator=torch.Generator().manual_seed(1)).tolist())
    err = 0.0
    for p in sorted(x for x in picks if 0 <= x < prompt):
        lo = max(0, p - window + 1)
        ref = F.scaled_dot_product_attention(q[:, :, p:p + 1].float(), k[:, :, lo:p + 1].float(),
                                             v[:, :, lo:p + 1].float(), scale=scale, enable_gqa=True)
        err = max(err, (out[p].float() - ref[0, :, 0]).abs().max().item())
    return err


def ratios(row) -> dict:
    """Times relative to the kernel's: > 1 means the kernel is that many times faster."""
    def num(key):
        value = row.get(key)
        return value if isinstance(value, float) and math.isfinite(value) else None

    t = num("triton")
    out = {}
    if row["kind"] == "decode":
        for key, name in (("sdpa_slice", "triton_vs_slice"), ("bound_ms", "triton_vs_bound"),
                          ("bound_copy_ms", "triton_vs_copy_bound")):
            if t and num(key):
                out[name] = t / num(key)
        if num("triton_graph") and num("sdpa_slice_graph"):
            out["graph_vs_slice_graph"] = num("triton_graph") / num("sdpa_slice_graph")
        for key in ("sdpa_masked", "flex"):
            if t and num(key):
                out[f"{key}_over_triton"] = num(key) / t
    else:
        for key in ("sdpa_causal_full", "flex"):
            if t and num(key):
                out[f"{key}_over_triton"] = num(key) / t
    return out


def format_table(rows) -> str:
    """One line per row: shape, the times in ms, then the ratios."""
    def cell(value):
        if isinstance(value, float):
            return f"{value:.4g}"
        return "fail" if isinstance(value, str) and value.startswith("failed") else str(value)

    lines = []
    for row in rows:
        if row.get("kind") not in ("decode", "prefill"):
            continue
        shape = f"B={row['B']:<4} L={row['L']:<7}" if row["kind"] == "decode" else f"prefill P={row['P']:<8}"
        times = ["triton", "triton_graph", "sdpa_slice", "sdpa_masked", "sdpa_causal_full", "flex", "bound_ms"]
        parts = [f"{k}={cell(row[k])}" for k in times if k in row]
        parts += [f"{k}={cell(v)}" for k, v in row.get("ratios", {}).items()]
        lines.append(f"{row['kind']:8} {shape} " + " ".join(parts))
    return "\n".join(lines)


def make_env(args):
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        sys.exit("no CUDA device: use --dry-run to check the script on CPU")
    env = {"cuda": cuda, "device": "cuda" if cuda else "cpu", "dtype": torch.bfloat16 if cuda else torch.float32,
           "timer": Timer(cuda), "copy_tbps": measured_copy_tbps(cuda)}
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention
        if cuda:
            for knob in ("recompile_limit", "cache_size_limit"):  # one compile per shape; keep them all
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, 64)
            env["flex"] = torch.compile(flex_attention, dynamic=False)
        else:
            env["flex"] = flex_attention
    return env


def main(argv=None):
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    env = make_env(args)
    import torch
    import triton

    shapes = Shapes(args.dry_run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with args.out.open("w") as f:
        def emit(row):
            row["ratios"] = ratios(row) if "kind" in row else {}
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps(row), flush=True)

        for context in args.contexts:
            for batch in args.batches:
                emit(decode_row(batch, context, args, shapes, env))
                if env["cuda"]:
                    torch.cuda.empty_cache()
        if args.prefill:
            emit(prefill_row(args.prefill, args, shapes, env))
        emit({"device": torch.cuda.get_device_name() if env["cuda"] else "cpu (dry run)",
              "torch": torch.__version__, "triton": triton.__version__, "copy_bw_TBps": env["copy_tbps"],
              "hbm_TBps_assumed": HBM_TBPS})
    print()
    print(format_table(rows))


if __name__ == "__main__":
    main()
