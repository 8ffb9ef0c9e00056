"""End-to-end greedy generation on one GPU: swakv's engine in this process against transformers.

Model: a random Gemma-3-1B-shaped model (26 layers, 5 sliding W=512 : 1 full, hidden 1152, 4 heads / 1
KV head, head 256, vocab 262144; bf16), built once on the device from a seed. Workload: N prompts of P
random tokens, M new tokens each, all submitted at once, no EOS (every request makes M tokens).

Rows (JSON lines in --out, a table at the end):
  hf_generate_batch   transformers' continuous batching (paged), timed as one call; TTFT from its timestamps
  hf_generate         transformers' padded ``generate`` on the same prompts (equal lengths: no padding)
  swakv               the engine (``cluster.engine.build.build_engine``, no Ray) in four configurations: one step at a
                      time or overlapped (``async``), eager or CUDA-graph decode (``graphs``); then the
                      fastest at the other concurrencies and on prompts sharing a prefix (``--shared-prefix``)
Per row: output tok/s (output tokens / wall time from submission to the last token), TTFT (mean, p50,
max), and for swakv per decode step (after every request has its first token; medians) the wall time,
the host time (wall time in ``Engine.step`` not spent waiting for results), the device time (CUDA events
around the step's work), and ratios; tokens equal to transformers' (whole sequences, and the mean share
of the matching prefix). An ``exactness`` row compares swakv to ``generate`` in float32 on a 6-layer model
of the same widths, prompts longer than the window: bf16 runs of a random model diverge on near ties.
Ratios printed at the end are measured side by side in this run. Order, most telling first (a run past
``--time-budget`` skips what is left): swakv overlapped with graphs, ``generate_batch``, swakv's other
configurations, the exactness check, the other concurrencies and the shared prefix, padded ``generate``;
then a row of token equality between every swakv configuration and each baseline.

    python bench/e2e_gpu.py --out bench/results/e2e_gpu.jsonl          # on the GPU
    python bench/e2e_gpu.py --dry-run --out /tmp/e2e.jsonl             # CPU, tiny shapes (tests run it)

Only torch, transformers (and triton on the GPU) are needed: no Ray, no msgpack.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GEMMA3_1B = dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                 query_pre_attn_scalar=256, max_position_embeddings=32768, rope_theta=1_000_000.0)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=1, head_dim=32, sliding_window=16, query_pre_attn_scalar=32,
            max_position_embeddings=1024)
CONFIGS = [  # (async_scheduling, cuda_graphs)
    (False, False), (True, False), (False, True), (True, True)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU, float32")
    p.add_argument("--num-prompts", type=int, help="the compared workload (default 64; dry run 4)")
    p.add_argument("--prompt-len", type=int, help="default 1024 (dry run 40)")
    p.add_argument("--max-new", type=int, help="default 128 (dry run 8)")
    p.add_argument("--concurrency", type=int, nargs="*", help="more swakv runs, best config (default 16 256)")
    p.add_argument("--shared-prefix", type=int, help="tokens all prompts share in the extra run (default 768)")
    p.add_argument("--budget", type=int, help="max_num_batched_tokens (default 8192; dry run 64)")
    p.add_argument("--kv-gib", type=float, default=12.0, help="KV cache memory for swakv on the GPU (12 GiB: "
                   "393k units of 32 KiB, 3x what 256 requests of 1168 tokens hold; a bigger pool only costs "
                   "the manager's start-up)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' baselines")
    p.add_argument("--no-check", action="store_true", help="skip the float32 exactness check")
    p.add_argument("--time-budget", type=float, default=1e9, help="seconds; later runs are skipped past it")
    args = p.parse_args(argv)
    dry = args.dry_run
    for name, full, tiny in (("num_prompts", 64, 4), ("prompt_len", 1024, 40), ("max_new", 128, 8),
                             ("concurrency", [16, 256], [2]), ("shared_prefix", 768, 24), ("budget", 8192, 64)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if dry else full)
    return args


# -- model and prompts ----------------------------------------------------------------------------------
def build_model(fields: dict, dtype, device, seed: int = 0, **overrides):
    """A random Gemma-3 text model (5 sliding : 1 full), seeded, built on ``device``."""
    import torch
    import transformers
    config = transformers.Gemma3TextConfig(**{**fields, **overrides}, bos_token_id=None, eos_token_id=None,
                                           pad_token_id=0)
    config.layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                          for i in range(config.num_hidden_layers)]
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = transformers.Gemma3ForCausalLM(config)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def make_prompts(n: int, length: int, vocab: int, seed: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(1, vocab) for _ in range(shared)]
    return [head + [rng.randrange(1, vocab) for _ in range(length - shared)] for _ in range(n)]


def sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def free_memory(device) -> None:
    import torch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- transformers ---------------------------------------------------------------------------------------
def generation_config(max_new: int):
    from transformers import GenerationConfig
    return GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)


def run_hf_generate(model, prompts, max_new, device) -> tuple[dict, list[list[int]]]:
    import torch
    model.set_attn_implementation("sdpa")
    ids = torch.tensor(prompts, device=device)
    with torch.no_grad():
        model.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]),
                       generation_config=generation_config(2))          # warm-up
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=generation_config(max_new))
        sync(device)
        wall = time.perf_counter() - t0
    tokens = out[:, len(prompts[0]):].tolist()
    n_out = sum(len(t) for t in tokens)
    return {"system": "hf_generate", "attn": "sdpa", "wall_s": wall, "output_tokens": n_out,
            "tok_s": n_out / wall}, tokens


def run_hf_generate_batch(model, prompts, max_new, device) -> tuple[dict, list[list[int]]]:
    import torch
    model.set_attn_implementation("sdpa")
    kwargs = {}
    params = inspect.signature(model.generate_batch).parameters
    if "warmup" in params:
        kwargs["warmup"] = device.type == "cuda"     # CUDA graphs on the GPU; on CPU the warm-up only costs
    if "record_timestamps" in params:
        kwargs["record_timestamps"] = True
    if device.type == "cpu" and "continuous_batching_config" in params:
        # its automatic cache sizing costs seconds on CPU; on the GPU the defaults stand, as in the anchor
        from transformers.generation import ContinuousBatchingConfig
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512)
    with torch.no_grad():
        sync(device)
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=generation_config(max_new), progress_bar=False,
                                   **kwargs)
        sync(device)
        wall = time.perf_counter() - t0
    by_prompt = {tuple(o.prompt_ids): o for o in out.values()}
    results = [by_prompt.get(tuple(p)) for p in prompts]
    tokens = [list(r.generated_tokens) if r is not None else [] for r in results]
    n_out = sum(len(t) for t in tokens)
    row = {"system": "hf_generate_batch", "attn": model.config._attn_implementation, "wall_s": wall,
           "output_tokens": n_out, "tok_s": n_out / wall, "missing": sum(r is None for r in results)}
    stamps = [r for r in results if r is not None and getattr(r, "timestamps", None)]
    if stamps:   # generation only (its warm-up excluded): first request created -> last token
        start = min(r.created_time for r in stamps)
        end = max(r.timestamps[-1] for r in stamps)
        ttft = sorted(r.timestamps[0] - r.created_time for r in stamps)
        row.update(gen_wall_s=end - start, gen_tok_s=n_out / (end - start), ttft_mean_s=statistics.mean(ttft),
                   ttft_p50_s=statistics.median(ttft), ttft_max_s=ttft[-1])
    return row, tokens


# -- swakv ----------------------------------------------------------------------------------------------
def swakv_engine(model, args, n, max_len, async_scheduling, cuda_graphs, device):
    from cluster.engine.build import build_engine
    kv = int(args.kv_gib * (1 << 30)) if device.type == "cuda" else 64 << 20
    engine, info = build_engine(model, block_size=16, kv_cache_memory=kv, max_model_len=max_len,
                                max_num_batched_tokens=args.budget, max_num_seqs=max(n, 1),
                                async_scheduling=async_scheduling, cuda_graphs=cuda_graphs)
    worker = engine.executor.workers[0]
    captured = worker.capture_graphs([s for s in worker.graphs.sizes if s <= n], max_len) if cuda_graphs else {}
    return engine, captured


def generate(engine, prompts, max_new, device, label="q"):
    """Submit every prompt at once, step until done; tokens per prompt and per-step measurements."""
    from cluster.engine.types import SamplingParams
    m = engine.metrics
    sync(device)
    t0 = time.perf_counter()
    ids = [f"{label}{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_new))
    out = {rid: [] for rid in ids}
    first, steps = {}, []
    while engine.has_work():
        before = (m.host_time_s, m.wait_time_s, m.device_time_s, m.steps)
        s0 = time.perf_counter()
        updates = engine.step()
        now = time.perf_counter()
        steps.append((now - s0, m.host_time_s - before[0], m.device_time_s - before[2], now))
        for u in updates:
            out[u.request_id] += u.new_token_ids
            first.setdefault(u.request_id, now - t0)
    sync(device)
    wall = time.perf_counter() - t0
    return [out[rid] for rid in ids], wall, [first[rid] for rid in ids], steps, t0


def run_swakv(model, prompts, max_new, args, device, async_scheduling, cuda_graphs, warm_prompts):
    n = len(prompts)
    max_len = len(prompts[0]) + max_new + 16
    engine, captured = swakv_engine(model, args, n, max_len, async_scheduling, cuda_graphs, device)
    generate(engine, warm_prompts, 4, device, label="w")     # compile kernels; then forget the warm-up's cache
    engine.manager.reset_prefix_cache()
    queried, hit = engine.manager.stats.queried_tokens, engine.manager.stats.hit_tokens
    tokens, wall, ttft, steps, t0 = generate(engine, prompts, max_new, device)
    last_first = t0 + max(ttft)
    decode = [s for s in steps if s[3] - s[0] > last_first]   # steps begun after every request's first token
    n_out = sum(len(t) for t in tokens)
    stats = engine.stats()
    worker = engine.executor.workers[0]
    row = {"system": "swakv", "async": async_scheduling, "graphs": cuda_graphs, "wall_s": wall,
           "output_tokens": n_out, "tok_s": n_out / wall, "ttft_mean_s": statistics.mean(ttft),
           "ttft_p50_s": statistics.median(ttft), "ttft_max_s": max(ttft), "steps": len(steps),
           "decode_steps": len(decode), "preemptions": stats["preemptions"],
           "prefix_hit_rate": (engine.manager.stats.hit_tokens - hit) / max(1, engine.manager.stats.queried_tokens
                                                                              - queried),
           "num_blocks": engine.manager.num_blocks}
    if decode:
        wall_ms = statistics.median(s[0] for s in decode) * 1e3
        host_ms = statistics.median(s[1] for s in decode) * 1e3
        dev_ms = statistics.median(s[2] for s in decode) * 1e3
        row.update(decode_step_ms=wall_ms, decode_host_ms=host_ms, decode_device_ms=dev_ms,
                   host_share=host_ms / wall_ms, device_busy_share=(dev_ms / wall_ms) if dev_ms else None)
    if cuda_graphs:
        row.update(graph_runs=worker.graphs.runs, graph_replays=worker.graphs.replays,
                   graphs_captured=len(captured.get("captured", [])), graph_failures=captured.get("failures"))
    del engine, worker
    free_memory(device)
    return row, tokens


def compare(tokens, reference) -> dict:
    """Whole sequences equal, and the mean share of each sequence's prefix that matches."""
    if not reference:
        return {}
    equal = sum(a == b for a, b in zip(tokens, reference))
    prefix = []
    for a, b in zip(tokens, reference):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefix.append(k / max(1, len(b)))
    return {"equal_seqs": equal / len(reference), "matching_prefix": statistics.mean(prefix)}


# -- the run --------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    import torch
    import transformers
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        sys.exit("no CUDA device: use --dry-run to check the script on CPU")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = TINY if args.dry_run else GEMMA3_1B
    started = time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with args.out.open("w") as f:
        def emit(row):
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps(row), flush=True)

        def in_time(what: str) -> bool:
            if time.perf_counter() - started < args.time_budget:
                return True
            emit({"skipped": what, "reason": f"past --time-budget {args.time_budget:.0f} s"})
            return False

        emit({"env": True, "device": torch.cuda.get_device_name() if cuda else "cpu (dry run)",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "triton": _version("triton"), "python": platform.python_version(), "dtype": str(dtype),
              "model": "tiny gemma3" if args.dry_run else "random gemma-3-1b shape", "shape": shape})

        model = build_model(shape, dtype, device)
        n, P, M = args.num_prompts, args.prompt_len, args.max_new
        vocab = shape["vocab_size"]
        prompts = make_prompts(n, P, vocab, seed=1)
        warm = make_prompts(n, P, vocab, seed=2)
        workload = {"N": n, "P": P, "M": M, "shared_prefix": 0}
        reference, ours = {}, {}

        def baseline(name, fn):
            if args.no_hf or not in_time(name):
                return
            try:
                row, reference[name] = fn(model, prompts, M, device)
            except Exception as exc:  # noqa: BLE001 - a baseline that fails is a result
                row = {"system": name, "failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
            emit({**workload, **row})
            free_memory(device)

        def swakv(async_scheduling, cuda_graphs):
            if not in_time(f"swakv async={async_scheduling} graphs={cuda_graphs}"):
                return
            row, ours[(async_scheduling, cuda_graphs)] = run_swakv(model, prompts, M, args, device, async_scheduling,
                                                                   cuda_graphs, warm)
            emit({**workload, **row})

        # Most telling first: a device call may run out of time, and later runs are then skipped.
        swakv(*CONFIGS[-1])
        baseline("hf_generate_batch", run_hf_generate_batch)
        for config in CONFIGS[:-1]:
            swakv(*config)
        if not args.no_check and in_time("exactness"):
            emit(exactness(args, shape, device))
        best = max((r for r in rows if r.get("system") == "swakv"), key=lambda r: r["tok_s"], default=None)
        if best is not None:
            for count, shared in [(c, 0) for c in args.concurrency] + [(n, args.shared_prefix)]:
                if not in_time(f"swakv N={count} shared={shared}"):
                    continue
                ps = make_prompts(count, P, vocab, seed=3, shared=shared)
                ws = make_prompts(count, P, vocab, seed=4, shared=shared)
                row, _ = run_swakv(model, ps, M, args, device, best["async"], best["graphs"], ws)
                emit({"N": count, "P": P, "M": M, "shared_prefix": shared, **row})
        baseline("hf_generate", run_hf_generate)
        equality = {"tokens_equal": True, **workload}
        for (a, g), toks in ours.items():
            equality[f"async={int(a)},graphs={int(g)}"] = {f"vs_{name}": compare(toks, ref)
                                                           for name, ref in reference.items()}
        emit(equality)
        emit(summary(rows))
    print()
    print(format_table(rows))


def exactness(args, shape, device) -> dict:
    """swakv against ``generate`` in float32 (all four configurations), prompts longer than the window."""
    import torch
    fields = {**shape, "num_hidden_layers": 6}
    model = build_model(fields, torch.float32, device, seed=5)
    window = shape["sliding_window"]
    n, P, M = (3, window + 8, 6) if args.dry_run else (8, window + 88, 32)
    prompts = make_prompts(n, P, shape["vocab_size"], seed=6)
    _, ref = run_hf_generate(model, prompts, M, device)
    row = {"exactness": True, "dtype": "float32", "layers": 6, "N": n, "P": P, "M": M}
    small = argparse.Namespace(**{**vars(args), "budget": min(args.budget, 2 * P), "kv_gib": 2.0})
    for async_scheduling, cuda_graphs in CONFIGS:
        r, toks = run_swakv(model, prompts, M, small, device, async_scheduling, cuda_graphs, prompts[::-1])
        key = f"async={int(async_scheduling)},graphs={int(cuda_graphs)}"
        row[key] = compare(toks, ref)
        if cuda_graphs:
            row[key]["graph_replays"] = r.get("graph_replays")
    row["distinct_tokens"] = len({t for seq in ref for t in seq})
    del model
    free_memory(device)
    return row


def summary(rows) -> dict:
    """Ratios of this run: swakv's best at the compared workload over each transformers baseline."""
    base = [r for r in rows if r.get("system") == "swakv" and r.get("shared_prefix") == 0
            and r.get("N") == next((x["N"] for x in rows if x.get("system") == "swakv"), None)]
    out = {"summary": True}
    if not base:
        return out
    best = max(base, key=lambda r: r["tok_s"])
    out["best_config"] = {"async": best["async"], "graphs": best["graphs"]}
    out["best_tok_s"] = best["tok_s"]
    for r in rows:
        if r.get("system", "").startswith("hf_") and "tok_s" in r:
            out[f"over_{r['system']}"] = best["tok_s"] / r["tok_s"]
    plain = next((r for r in base if not r["async"] and not r["graphs"]), None)
    for r in base:
        if plain is not None and r is not plain:
            out[f"async={int(r['async'])},graphs={int(r['graphs'])}_over_plain"] = r["tok_s"] / plain["tok_s"]
    out["host_share_best"] = best.get("host_share")
    return out


def format_table(rows) -> str:
    cols = ("tok_s", "wall_s", "ttft_p50_s", "decode_step_ms", "decode_host_ms", "decode_device_ms", "host_share")
    lines = [f"{'system':<18}{'N':>5}{'shared':>7}{'async':>6}{'graphs':>7}" + "".join(f"{c:>17}" for c in cols)]
    for r in rows:
        if "system" not in r or "failed" in r:
            continue
        vals = "".join(f"{r[c]:>17.4g}" if isinstance(r.get(c), (int, float)) else f"{'-':>17}" for c in cols)
        lines.append(f"{r['system']:<18}{r.get('N', ''):>5}{r.get('shared_prefix', ''):>7}"
                     f"{str(r.get('async', '-')):>6}{str(r.get('graphs', '-')):>7}{vals}")
    return "\n".join(lines)


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    main()
