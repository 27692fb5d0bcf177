#!/usr/bin/env bash
# The seed protocol (FlashInfer's MLSys benchmark: SGLang's random workload, inputs 512-2,048 and
# outputs 64-256 tokens, Poisson arrivals, 256 prompts a rate, the server's prefix cache off) against
# one `flashserve serve` configuration, measured by SGLang's own bench_serving.py and by
# benchmark.serve_bench side by side, after a probe of the lone prompt and c1 ITL against their floors:
#
#   NAME=70b-tp4-bf16 MODEL=llama-3.1-70b TP=4 SGL_RATES="4 5 6" FS_RATES="4" bash benchmark/seed_protocol.sh
#   NAME=8b-fp8 MODEL=llama-3.1-8b GPUS=1 SERVER_ARGS="--quantization fp8 --kv-cache-dtype fp8" PORT=8001 \
#     SGL_RATES="16 24" FS_RATES="24" bash benchmark/seed_protocol.sh
#
# SGLang's client (`make sglang-bench`: bench_serving.py of sglang 0.5.2 and its aiohttp wheels in
# .whl/sglbench) runs as the seed protocol writes it, with `--backend vllm` (OpenAI completions) and
# its `random-ids` dataset (no download). Both clients draw prompts as text from the server's
# tokenizer (the Llama-3 tokenizer: `make gpu-tokenizer-xz`). Each rate's prompts have their own seed.
# Results under OUT (default benchmark/results/<GPU>/seed_protocol): probe_NAME.json, sgl_NAME.jsonl,
# serve_bench_NAME/*.json, server_NAME.log.gz (gzipped at the end: request logs are large), and the table in
# summary_NAME.md.
set -u
cd "$(dirname "$0")/.." || exit 2
T0=$(date +%s)
PYTHON=${PYTHON:-python3}
NAME=${NAME:?NAME names this configuration}
MODEL=${MODEL:-llama-3.1-70b}
TP=${TP:-1}
GPUS=${GPUS:-}
PORT=${PORT:-8000}
SERVER_ARGS=${SERVER_ARGS:-}
SGL_RATES=${SGL_RATES:-4}
FS_RATES=${FS_RATES:-}
NPROMPTS=${NPROMPTS:-256}
BUDGET=${BUDGET:-570}
PROBE=${PROBE:-1}  # 0: no floors and no lone-prompt probe (A/B runs of one rate)
# SEED0: the first rate draws seed SEED0 + 1, the next SEED0 + 2 (default 0)
if ! $PYTHON -c "import flashinfer, fastapi" 2>/dev/null; then
  flock /tmp/seed_pip.lock $PYTHON -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
$PYTHON -c "import aiohttp" 2>/dev/null || PYTHONPATH=/tmp/site $PYTHON -c "import aiohttp" 2>/dev/null || \
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/sglbench/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi}
export MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHINFER_USE_CUDA_NORM=1
[ -n "$GPUS" ] && export CUDA_VISIBLE_DEVICES=$GPUS
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr ' ' '_')
OUT=${OUT:-benchmark/results/$GPU/seed_protocol}
mkdir -p "$OUT"
TOKENIZER=${TOKENIZER:-.whl/llama3-tokenizer}
if [ ! -f "$TOKENIZER/tokenizer.json" ]; then
  TOKENIZER=/tmp/llama3-tokenizer
  flock /tmp/seed_tok.lock $PYTHON -c "import sys, os, tarfile; os.path.exists(sys.argv[2] + '/tokenizer.json') or tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
    .whl/llama3-tokenizer.tar.xz "$TOKENIZER" || exit 1
fi
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# Seconds a client's run needs at a rate: its prompts' arrivals, then 60 s for the last ones to finish
# and for the client to start (tokenizer) and stop.
need() { awk -v n="$NPROMPTS" -v r="$1" 'BEGIN { printf "%d", n / r + 60 }'; }
SUMMARY="$OUT/summary_$NAME.md"
echo "# $NAME: $MODEL, TP $TP, $GPU, server args: --no-enable-prefix-caching $SERVER_ARGS" | tee "$SUMMARY"

[ "$PROBE" = 0 ] || $PYTHON -m benchmark.floor --out "$OUT/rates_$NAME.json" >/dev/null 2>&1 || echo "floor rates: failed" | tee -a "$SUMMARY"
t=$(date +%s.%N)
$PYTHON -m flashserve serve --load-format dummy --model "$MODEL" --tokenizer "$TOKENIZER" --tp "$TP" --port "$PORT" \
  --no-enable-prefix-caching $SERVER_ARGS >"$OUT/server_$NAME.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
until curl -sf "127.0.0.1:$PORT/health" >/dev/null; do
  kill -0 $SERVER 2>/dev/null || { echo "server exited before /health" | tee -a "$SUMMARY"; tail -n 30 "$OUT/server_$NAME.log"; exit 1; }
  [ "$(left)" -gt 60 ] || { echo "not healthy within the budget" | tee -a "$SUMMARY"; exit 1; }
  sleep 0.25
done
echo "healthy after $(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $t }") s" | tee -a "$SUMMARY"
grep -i -E "all-reduce|allreduce|quantiz|kv cache|graph" "$OUT/server_$NAME.log" | head -n 8 | tee -a "$SUMMARY"

[ "$PROBE" = 0 ] || timeout -k 5 120 $PYTHON -m benchmark.seed_probe --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --tp "$TP" \
  --rates "$OUT/rates_$NAME.json" --out "$OUT/probe_$NAME.json" >/dev/null 2>&1 || echo "probe: failed" | tee -a "$SUMMARY"

seed=${SEED0:-0}  # the first rate draws seed SEED0 + 1
for rate in $SGL_RATES; do
  seed=$(( seed + 1 ))
  [ "$(left)" -gt "$(need "$rate")" ] || { echo "SGLang client at $rate req/s: no time left" | tee -a "$SUMMARY"; break; }
  HF_HUB_OFFLINE=1 timeout -k 5 $(( $(left) - 20 )) $PYTHON .whl/sglbench/bench_serving.py --backend vllm \
    --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --tokenizer "$TOKENIZER" --dataset-name random-ids \
    --random-input-len 2048 --random-output-len 256 --random-range-ratio 0.25 --request-rate "$rate" \
    --num-prompts "$NPROMPTS" --seed "$seed" --disable-tqdm --output-file "$OUT/sgl_$NAME.jsonl" \
    >"$OUT/sgl_${NAME}_$rate.txt" 2>&1 || echo "SGLang client at $rate req/s: exit $?" | tee -a "$SUMMARY"
done
for rate in $FS_RATES; do
  seed=$(( seed + 1 ))
  [ "$(left)" -gt "$(need "$rate")" ] || { echo "serve_bench at $rate req/s: no time left" | tee -a "$SUMMARY"; break; }
  timeout -k 5 $(( $(left) - 20 )) $PYTHON -m benchmark.serve_bench --base-url "http://127.0.0.1:$PORT" \
    --workload random --range-ratio 0.25 --text --tokenizer "$TOKENIZER" --request-rate "$rate" \
    --num-requests "$NPROMPTS" --seed "$seed" --out-dir "$OUT/serve_bench_$NAME" --no-summary --no-progress \
    >/dev/null 2>&1 || echo "serve_bench at $rate req/s: exit $?" | tee -a "$SUMMARY"
done
kill -TERM $SERVER; wait $SERVER; echo "server exit after SIGTERM: $?" | tee -a "$SUMMARY"
grep -h "late launches" "$OUT/server_$NAME.log" | tee -a "$SUMMARY"
gzip -f "$OUT/server_$NAME.log"
trap - EXIT
$PYTHON - "$OUT" "$NAME" <<'PY' | tee -a "$SUMMARY"
import json, sys, pathlib
out, name = pathlib.Path(sys.argv[1]), sys.argv[2]
f = lambda x, d=0: "-" if x is None else f"{x:.{d}f}"
probe = out / f"probe_{name}.json"
if probe.exists():
    p = json.loads(probe.read_text())
    print(f"\nlone {p['prompt_len']}-token prompt: TTFT median {f(p['lone_ttft_ms']['median'], 1)} ms, floor "
          f"{f(p.get('lone_floor_ms'), 1)} ms ({f(p.get('lone_over_floor'), 2)}x); first request after /health "
          f"{f(p['first_ttft_ms'], 1)} ms ({f(p['first_over_median'], 2)}x the median of the next {p['lone_ttft_ms']['n']}); "
          f"c1 {p['c1_len']}/{p['c1_len']} ITL median {f(p['c1_itl_ms']['median'], 2)} ms, floor "
          f"{f(p.get('c1_floor_ms'), 2)} ms ({f(p.get('c1_over_floor'), 2)}x)")
rows = []
sgl = out / f"sgl_{name}.jsonl"
if sgl.exists():
    for line in sgl.read_text().splitlines():
        m = json.loads(line)
        rows.append(("bench_serving.py", float(m["request_rate"]), m["completed"], m["median_ttft_ms"], m["p99_ttft_ms"],
                     m["median_itl_ms"], m["p99_itl_ms"], m.get("output_throughput")))
for path in sorted((out / f"serve_bench_{name}").glob("*.json")):
    for ph in json.loads(path.read_text())["phases"]:
        m = ph["metrics"]
        rows.append(("serve_bench", float(ph["request_rate"]), m["completed"], m["ttft_ms"]["median"], m["ttft_ms"]["p99"],
                     m["itl_ms"]["median"], m["itl_ms"]["p99"], m.get("output_token_throughput")))
print("\n| client | req/s | completed | median TTFT ms | P99 TTFT ms | median ITL ms | P99 ITL ms | output tok/s |")
print("|---|---|---|---|---|---|---|---|")
for r in sorted(rows, key=lambda r: (r[1], r[0])):
    print(f"| {r[0]} | {r[1]:g} | {r[2]} | {f(r[3])} | {f(r[4])} | {f(r[5], 1)} | {f(r[6], 1)} | {f(r[7])} |")
good = [r[1] for r in rows if r[0] == "bench_serving.py" and r[4] is not None and r[4] <= 200]
print(f"\ngoodput by bench_serving.py (highest rate run with P99 TTFT <= 200 ms): {max(good) if good else 0:g} req/s")
PY
