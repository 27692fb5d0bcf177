#!/usr/bin/env bash
# Tensor parallelism on a machine with several GPUs (TP ranks, default 4), each check in its own
# time limit and all of them within BUDGET seconds (default 570), results under OUT:
#
#   bash benchmark/tp_gpu.sh                                          # every check (more than 10 minutes)
#   CHECKS=kernels,tests,allreduce,prefill bash benchmark/tp_gpu.sh       # about 7 minutes
#   CHECKS=start,decode70b,serve70b,decode8b bash benchmark/tp_gpu.sh     # about 9 minutes
#
# Checks (CHECKS, comma-separated, run in this order; default all but stress):
#   kernels    every prebuilt FlashInfer module (`make kernels-prebuilt`) loaded and timed; those the
#              wheel lacks, and the FP8 GEMM module that is never prebuilt (it needs cuBLAS headers), are
#              named, then compiled by FlashInfer's JIT all at once (seconds to
#              minutes: the fused all-reduce's module alone takes over 5) into the cache that the
#              later checks use; a prebuilt module that fails to load fails the check
#   start      start-up to /health on this machine: the 8B on one GPU, then the 70B at TP ranks
#              twice (the first start of a 70B here, then a restart), each stopped with SIGTERM;
#              the server's own log lines say where its time went
#   tests      pytest tests/gpu/test_tp_gpu.py at TP ranks (logits against one GPU, eager and from
#              graphs, with NCCL and with the fused all-reduce; greedy tokens; close); TESTS_K: pytest's -k;
#              up to 540 s (the whole file took 408 s at TP 2 on two H200s)
#   allreduce  python -m benchmark.tp_allreduce: NCCL + norm against FlashInfer's fused all-reduce +
#              add + RMSNorm at TP ranks, [tokens, 8192] bf16, decode- to prefill-sized
#   prefill    python -m benchmark.tp_prefill: the 70B's lone-prompt step and TTFT at 512/2,048/8,192
#              tokens against the compute floor measured here, and rank 0's profile of a 2,048-token
#              step (kernel time by category, GEMMs by per-rank shape, host gap)
#   overlap    the 70B's 2,048- and 8,192-token prompts (tp_prefill, profiled at 2,048) run whole, then with
#              --tp-overlap-min-tokens 1024 over NCCL, then over the copy engines (--tp-overlap-comm
#              copy-engine): whether hiding the all-reduces behind the other chunk's GEMMs pays
#   decode70b  python -m benchmark.tp_decode: the 70B's decode step at TP ranks, NCCL and fused,
#              batch 1 and 16, against the per-GPU weight floor
#   serve70b   `flashserve serve` of the 70B at TP ranks with the Llama-3 tokenizer, under
#              benchmark.serve_bench's random workload (2048/256, text prompts) at RATES req/s
#              (default 2,3,4,5,6; NREQ requests each, default 60): P99 TTFT, median ITL, goodput
#   decode8b   the 8B's decode step on one GPU (batch 1 and 64), the figures TP is compared with
#   stress     benchmark/gpu_stress.sh on the 8B at TP ranks, then SIGTERM: exit 0, nothing left
# What the machine lacks travels in .whl/: the slimmed flashinfer wheel with the prebuilt modules
# (prepare-wheels.sh, then `make kernels-prebuilt`), the Llama-3 tokenizer (`make gpu-tokenizer`;
# or its archive .whl/llama3-tokenizer.tar.xz, `make gpu-tokenizer-xz`), locust (`make stress-wheels`).
set -u
cd "$(dirname "$0")/.." || exit 2
T0=$(date +%s)
PYTHON=${PYTHON:-python3}
CHECKS=${CHECKS:-kernels,start,tests,allreduce,prefill,overlap,decode70b,serve70b,decode8b}  # run in this order
BUDGET=${BUDGET:-570}
RATES=${RATES:-2,3,4,5,6}
NREQ=${NREQ:-60}
if [ -d .whl ] && ! $PYTHON -c "import flashinfer, fastapi" 2>/dev/null; then
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi}
export MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHINFER_USE_CUDA_NORM=1  # the prebuilt norm module, not CuTe-DSL kernels compiled at first use
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
COUNT=$($PYTHON -c 'import torch; print(torch.cuda.device_count())')
TP=${TP:-$(( COUNT >= 4 ? 4 : COUNT ))}
OUT=${OUT:-benchmark/results/local/$(echo "$GPU" | tr ' ' '_')/tensor_parallel_$TP}
mkdir -p "$OUT"
TOKENIZER=${TOKENIZER:-.whl/llama3-tokenizer}
if [ ! -f "$TOKENIZER/tokenizer.json" ] && [ -f .whl/llama3-tokenizer.tar.xz ]; then
  $PYTHON -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" .whl/llama3-tokenizer.tar.xz \
    /tmp/llama3-tokenizer && TOKENIZER=/tmp/llama3-tokenizer
fi
SUMMARY="$OUT/summary.txt"
echo "$COUNT x $GPU, TP=$TP, checks $CHECKS; results in $OUT (setup $(( $(date +%s) - T0 )) s)" | tee "$SUMMARY"
[ "$COUNT" -ge 2 ] && [ "$TP" -ge 2 ] || { echo "needs two GPUs or more" | tee -a "$SUMMARY"; exit 2; }
want() { [[ ",$CHECKS," == *",$1,"* ]]; }
quiet() { grep -v -E "JIT|UserWarning|warn_once|set_sync_debug_mode|^\s*$"; }
RC=0
SERVER=
cleanup() { if [ -n "$SERVER" ]; then kill -TERM "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; fi; }
trap cleanup EXIT

# limit NAME SECONDS: the check's time limit, cut to what is left of BUDGET (0: skip it).
limit() {
  local left=$(( BUDGET - ($(date +%s) - T0) - 5 ))
  if [ "$left" -lt 30 ]; then echo "$1: skipped, $left s of the budget left" | tee -a "$SUMMARY" >&2; echo 0; return; fi
  echo $(( $2 < left ? $2 : left ))
}
# phase NAME RC START: one summary line per check.
phase() {
  echo "$1: exit $2 in $(( $(date +%s) - $3 )) s" | tee -a "$SUMMARY"
  [ "$2" -eq 0 ] || RC=1
}
free_port() { $PYTHON -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# serve NAME SECONDS ARGS...: starts `flashserve serve` in the background (SERVER, PORT) and waits
# up to SECONDS for /health; UP is the seconds that took, or "failed".
serve() {
  local name=$1 wait_s=$2 t; shift 2
  PORT=$(free_port); t=$(date +%s.%N); UP=failed
  $PYTHON -m flashserve serve --load-format dummy --port "$PORT" "$@" >"$OUT/server_$name.log" 2>&1 &
  SERVER=$!
  local deadline=$(( $(date +%s) + wait_s ))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    if curl -sf "127.0.0.1:$PORT/health" >/dev/null; then UP=$(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $t }"); return 0; fi
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 0.25
  done
  return 1
}
stop() {  # SIGTERM the server, SIGKILL it after 45 s; STOPPED is its exit status
  kill -TERM "$SERVER" 2>/dev/null
  for _ in $(seq 1 90); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$SERVER" 2>/dev/null; wait "$SERVER"; STOPPED=$?; SERVER=
}

if want kernels && [ "$(limit kernels 400)" -gt 0 ]; then
  s=$(date +%s)
  timeout -k 5 "$(limit kernels 400)" $PYTHON benchmark/prebuild_kernels.py --check --build-missing 2>&1 \
    | quiet | tee "$OUT/kernels.txt" | tail -n 14
  phase kernels "${PIPESTATUS[0]}" "$s"
fi
if want start && [ "$(limit start 200)" -gt 0 ]; then
  s=$(date +%s); rc=0
  {
    serve start_8b_tp1 60 --model llama-3.1-8b || rc=1; stop
    echo "8B, 1 GPU: healthy after $UP s; exit $STOPPED after SIGTERM"
    serve start_70b_first 120 --model llama-3.1-70b --tp "$TP" --gpu-memory-utilization 0.9 || rc=1; stop
    echo "70B, TP=$TP, first start here: healthy after $UP s; exit $STOPPED after SIGTERM"
    serve start_70b_again 120 --model llama-3.1-70b --tp "$TP" --gpu-memory-utilization 0.9 || rc=1; stop
    echo "70B, TP=$TP, restart: healthy after $UP s; exit $STOPPED after SIGTERM"
    echo "where the time went (the servers' logs):"
    grep -H -E "start-up|warm-up|captured|KV cache|FlashInfer|all-reduce" "$OUT"/server_start_*.log | cut -c1-240
  } > >(tee "$OUT/start.txt") 2>&1
  phase start $rc "$s"
fi
if want tests && [ "$(limit tests 540)" -gt 0 ]; then
  s=$(date +%s)
  FLASHSERVE_TEST_TP=$TP timeout -k 10 "$(limit tests 540)" $PYTHON -m pytest -v -m gpu tests/gpu/test_tp_gpu.py \
    ${TESTS_K:+-k "$TESTS_K"} -p no:cacheprovider --durations=0 >"$OUT/tp_gpu_tests.log" 2>&1
  rc=$?; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tp_gpu_tests.log" | tail -n 12; phase tests $rc "$s"
fi
if want allreduce && [ "$(limit allreduce 120)" -gt 0 ]; then
  s=$(date +%s)
  timeout -k 10 "$(limit allreduce 120)" $PYTHON -m benchmark.tp_allreduce --tp "$TP" --out "$OUT" 2>&1 | quiet \
    | tee "$OUT/tp_allreduce.txt"
  phase allreduce "${PIPESTATUS[0]}" "$s"
fi
if want prefill && [ "$(limit prefill 200)" -gt 0 ]; then
  s=$(date +%s)
  timeout -k 10 "$(limit prefill 200)" $PYTHON -m benchmark.tp_prefill --tp "$TP" --out "$OUT" 2>&1 | quiet \
    | tee "$OUT/tp_prefill.txt"
  phase prefill "${PIPESTATUS[0]}" "$s"
fi
if want overlap; then
  for comm in none nccl copy-engine; do
    [ "$(limit overlap 120)" -gt 0 ] || break
    s=$(date +%s)
    args=(); [ "$comm" = none ] || args=(--overlap-min-tokens 1024 --overlap-comm "${comm}")
    timeout -k 10 "$(limit overlap 120)" $PYTHON -m benchmark.tp_prefill --tp "$TP" --lens 2048,8192 \
      ${args[@]+"${args[@]}"} --out "$OUT/overlap_$comm" 2>&1 | quiet | tee "$OUT/overlap_$comm.txt"
    phase "overlap ($comm)" "${PIPESTATUS[0]}" "$s"
  done
fi
decode() {  # name, then tp_decode's arguments
  local name=$1 lim=$2; shift 2
  timeout -k 10 "$lim" $PYTHON -m benchmark.tp_decode --out "$OUT/.raw" "$@" 2>&1 | quiet | tee "$OUT/tp_decode_$name.txt"
  local rc=${PIPESTATUS[0]}
  mv "$OUT"/.raw/*/tp_decode.json "$OUT/tp_decode_$name.json" 2>/dev/null
  mv "$OUT"/.raw/*/tp_decode.png "$OUT/tp_decode_$name.png" 2>/dev/null; rm -rf "$OUT/.raw"
  return "$rc"
}
if want decode70b && [ "$(limit decode70b 200)" -gt 0 ]; then
  s=$(date +%s)
  decode 70b "$(limit decode70b 200)" --model llama-3.1-70b --tp "$TP,$TP+fused" --batches 1,16 --steps 20 \
    --engine-tokens 32 --gpu-memory-utilization 0.9
  phase decode70b $? "$s"
fi
if want serve70b && [ "$(limit serve70b 330)" -gt 0 ]; then
  s=$(date +%s); lim=$(limit serve70b 330)
  serve serve_70b 120 --model llama-3.1-70b --tokenizer "$TOKENIZER" --tp "$TP" --gpu-memory-utilization 0.9
  echo "70B at TP=$TP healthy after $UP s" | tee "$OUT/serve_70b.txt"
  rc=0; seed=0
  # One run per rate, each with prompts of its own seed: a rate run after another on the same
  # prompts would find them in the prefix cache.
  for rate in ${RATES//,/ }; do
    seed=$(( seed + 1 )); left=$(( lim - ($(date +%s) - s) - 15 ))
    [ "$left" -gt 20 ] || { echo "rate $rate: no time left" | tee -a "$OUT/serve_70b.txt"; rc=1; break; }
    timeout -k 10 "$left" $PYTHON -m benchmark.serve_bench --base-url "http://127.0.0.1:$PORT" --workload random \
      --text --tokenizer "$TOKENIZER" --request-rate "$rate" --num-requests "$NREQ" --seed "$seed" \
      --out-dir "$OUT/serve_70b" --no-summary --no-progress 2>&1 | tee -a "$OUT/serve_70b.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  done
  stop; echo "70B server exit after SIGTERM: $STOPPED" | tee -a "$OUT/serve_70b.txt"
  $PYTHON - "$OUT/serve_70b" <<'PY' | tee -a "$OUT/serve_70b.txt"
import json, sys, pathlib
rows = sorted((p["request_rate"], p["metrics"]) for path in pathlib.Path(sys.argv[1]).glob("*.json")
              for p in json.loads(path.read_text())["phases"])
print("| req/s | completed | failed | median TTFT ms | P99 TTFT ms | median ITL ms | output tok/s |")
print("|---|---|---|---|---|---|---|")
f = lambda x, d=0: "-" if x is None else f"{x:.{d}f}"
for rate, m in rows:
    print(f"| {rate:g} | {m['completed']} | {m['failed']} | {f(m['ttft_ms']['median'])} | {f(m['ttft_ms']['p99'])} | "
          f"{f(m['itl_ms']['median'], 1)} | {f(m['output_token_throughput'])} |")
good = [rate for rate, m in rows if m["failed"] == 0 and (m["ttft_ms"]["p99"] or 1e9) <= 200]
print(f"goodput (highest rate run with P99 TTFT <= 200 ms): {max(good) if good else 0:g} req/s")
PY
  phase serve70b "$rc" "$s"
fi
if want decode8b && [ "$(limit decode8b 150)" -gt 0 ]; then
  s=$(date +%s)
  decode 8b "$(limit decode8b 150)" --tp 1 --batches 1,64 --engine-tokens 32
  phase decode8b $? "$s"
fi
if want stress && [ "$(limit stress 300)" -gt 0 ]; then
  s=$(date +%s)
  MODEL=llama-3.1-8b USERS=${USERS:-64} RUN_TIME=${RUN_TIME:-30s} SERVER_ARGS="--tensor-parallel-size $TP" \
    LOG="$OUT/stress_8b_tp${TP}_server.log" timeout -k 10 "$(limit stress 300)" bash benchmark/gpu_stress.sh \
    >"$OUT/stress_8b_tp$TP.txt" 2>&1
  rc=$?; sleep 2
  { echo "stress: exit $rc"; echo "processes left:"; pgrep -af "flashserve|multiprocessing" | grep -v pgrep
    echo "/dev/shm:"; ls /dev/shm; } >>"$OUT/stress_8b_tp$TP.txt"
  grep -E "failures|P99 TTFT|KV pages|exit code|stress:|left|shm" -A1 "$OUT/stress_8b_tp$TP.txt" | tail -n 12
  phase stress $rc "$s"
fi
# Modules FlashInfer built here instead of loading them prebuilt (none, when the wheel has them all).
built=$(find "$FLASHINFER_WORKSPACE_BASE" -name "*.so" -path "*cached_ops*" 2>/dev/null | xargs -r -n1 basename)
echo "FlashInfer modules JIT-built on this machine: ${built:-none}" | tee -a "$SUMMARY"
echo "total: $(( $(date +%s) - T0 )) s, exit $RC" | tee -a "$SUMMARY"
exit $RC
