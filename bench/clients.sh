#!/usr/bin/env bash
# Third-party clients against `swakv serve` on the bundled model (as `make serve` runs it): guidellm's
# streaming benchmark (chat and completions) and lm-eval's local-completions on the tiny local tasks in
# bench/lmeval/ (loglikelihood, multiple choice; its venv needs lm-eval[api] and transformers). Prints each tool's summary; exits non-zero if any
# request failed. Usage (from the repository root, each tool in its own venv):
#   GUIDELLM=/path/to/guidellm-venv/bin/guidellm LMEVAL=/path/to/lmeval-venv/bin/lm_eval bench/clients.sh [PORT]
set -u
PORT=${1:-8000}
URL=http://127.0.0.1:$PORT
MODEL=swakv-tiny-hybrid
TOKENIZER=$PWD/models/$MODEL
OUT=${OUT:-/tmp/swakv-clients}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

PYTHONPATH=$PWD python -m cluster serve --port "$PORT" > "$OUT/serve.log" 2>&1 &
SERVER=$!
stop() { kill -INT "$SERVER" 2>/dev/null; wait "$SERVER"; echo "server stopped (exit $?)"; }
trap stop EXIT
until grep -q "swakv: serving" "$OUT/serve.log"; do
    kill -0 "$SERVER" 2>/dev/null || { cat "$OUT/serve.log"; exit 1; }
    sleep 1
done
grep "swakv: serving" "$OUT/serve.log"
curl -s "$URL/health"; echo

status=0
for format in ${GUIDELLM:+/v1/chat/completions /v1/completions}; do   # GUIDELLM unset: skipped
    echo "== guidellm, streaming $format"
    "$GUIDELLM" run --backend kind=openai_http,target=$URL,model=$MODEL,request_format=$format \
        --profile kind=concurrent,streams=4 --constraint kind=max_requests,count=40 \
        --data kind=synthetic_text,prompt_tokens=128,output_tokens=64 \
        --tokenizer kind=huggingface_auto,model=$TOKENIZER \
        --output kind=json,path=$OUT/guidellm${format//\//_}.json --disable-console-interactive \
        > "$OUT/guidellm${format//\//_}.log" 2>&1 || status=1
    python - "$OUT/guidellm${format//\//_}.json" <<'PY' || status=1
import json, sys
report = json.load(open(sys.argv[1]))
for b in report["benchmarks"]:
    totals = b["metrics"]["request_totals"] if "request_totals" in b["metrics"] else b["request_totals"]
    print("requests:", {k: totals[k] for k in ("successful", "errored", "incomplete", "total") if k in totals})
    for name in ("time_to_first_token_ms", "inter_token_latency_ms", "output_tokens_per_second"):
        summary = b["metrics"].get(name, {}).get("successful") or {}
        print(f"  {name}: median {summary.get('median', float('nan')):.1f}, p95 "
              f"{(summary.get('percentiles') or {}).get('p95', float('nan')):.1f}")
    sys.exit(1 if totals.get("errored") else 0)
PY
done

if [ -n "${LMEVAL:-}" ]; then   # LMEVAL unset: skipped
echo "== lm-eval local-completions: loglikelihood + multiple choice"
"$LMEVAL" run --model local-completions \
    --model_args model=$MODEL,base_url=$URL/v1/completions,tokenizer=$TOKENIZER,tokenizer_backend=huggingface,num_concurrent=2,max_retries=1 \
    --tasks swakv_tiny_loglikelihood swakv_tiny_mc --include_path bench/lmeval \
    --output_path "$OUT/lmeval" > "$OUT/lmeval.log" 2>&1 || status=1
grep -E "^\|" "$OUT/lmeval.log" || tail -30 "$OUT/lmeval.log"
fi
echo "errors in the server log: $(grep -ci 'error\|traceback' "$OUT/serve.log")"
exit $status
