#!/usr/bin/env bash
# Every GPU measurement of issue 11 in one device call (about 280 s: run it with timeout_s=300, which leaves
# room to run it again within a 15-minute device budget). Needs torch, triton and transformers only.
#
#   bash bench/gpu_run.sh                 # on the GPU machine: results under $OUT (or ./out/gpu)
#   DRY_RUN=1 bash bench/gpu_run.sh       # on CPU: the same script with tiny shapes (tests run this)
#
# Parts, most important first, each under its own time limit (a part that runs out leaves its JSON lines
# so far); the summary at the end is printed to stdout too:
#   1. bench/attention_gpu.py     decode B in {1, 32, 128} x L in {8k, 32k, 128k}, W = 4096, and a 32k
#                                  prefill: the kernel (also replayed from a CUDA graph) vs the contiguous
#                                  last-W slice, the HBM bound and full causal SDPA (no FlexAttention: the
#                                  anchor has it; masked baselines only where K/V fits 8 GB)
#   2. bench/e2e_gpu.py           swakv's engine vs transformers' generate_batch and generate, 64 x 1024
#                                  prompts, 128 new tokens: four swakv configurations, a float32 exactness
#                                  check, 16 and 256 sequences and a shared prefix (its own order and time
#                                  budget: what does not fit is skipped, and says so)
#   3. bench/step_overhead.py     the real worker's host time per decode step on the GPU (packing, launch
#                                  eager or from graphs, waiting, device time)
#   4. bench/attention_gpu.py     --sweep of kernel tile sizes at 32k, B = 32 and 128
#   5. bench/host_tier_gpu.py     the host KV tier's CUDA path (pinned pages, side stream, events): greedy
#                                  tokens after a restore equal recomputation, synchronous and asynchronous
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-out/gpu}"
mkdir -p "$OUT"
DRY="${DRY_RUN:-}"
PY="${PYTHON:-python}"

part() {   # part NAME SECONDS COMMAND...: run it with a time limit, log to $OUT/NAME.log, note its status
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/status.txt"
}

{
    date -u +%FT%TZ
    nvidia-smi 2>&1 || echo "no nvidia-smi"
    $PY -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'triton', triton.__version__); \
print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
    git log -1 --format='commit %H' 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
: > "$OUT/status.txt"

if [ -n "$DRY" ]; then
    part attention 120 $PY bench/attention_gpu.py --dry-run --no-flex --out "$OUT/attention_gpu.jsonl"
    part e2e 300 $PY bench/e2e_gpu.py --dry-run --out "$OUT/e2e_gpu.jsonl"
    part step_overhead 300 $PY bench/step_overhead.py --worker --requests 8 --prompt-len 64 --steps 4 \
        --out "$OUT/step_overhead.jsonl"
    part attention_sweep 120 $PY bench/attention_gpu.py --dry-run --no-flex --batches 3 --contexts 128 \
        --prefill 0 --sweep --out "$OUT/attention_sweep.jsonl"
    part host_tier 120 $PY bench/host_tier_gpu.py --dry-run --models tiny-mistral --out "$OUT/host_tier_gpu.jsonl"
else
    part attention 55 $PY bench/attention_gpu.py --no-flex --max-contiguous-gb 8 --out "$OUT/attention_gpu.jsonl"
    part e2e 130 $PY bench/e2e_gpu.py --time-budget 100 --out "$OUT/e2e_gpu.jsonl"
    part step_overhead 40 $PY bench/step_overhead.py --worker --device cuda --requests 64 256 --prompt-len 1024 \
        --steps 16 --out "$OUT/step_overhead.jsonl"
    part attention_sweep 30 $PY bench/attention_gpu.py --no-flex --sweep --contexts 32768 --batches 32 128 \
        --prefill 0 --max-contiguous-gb 8 --out "$OUT/attention_sweep.jsonl"
    part host_tier 30 $PY bench/host_tier_gpu.py --out "$OUT/host_tier_gpu.jsonl"
fi

{
    echo "== status"; cat "$OUT/status.txt"
    for name in attention e2e step_overhead attention_sweep host_tier; do
        echo "== $name (tail)"
        tail -n 25 "$OUT/$name.log" 2>/dev/null
    done
} | tee "$OUT/summary.txt"
