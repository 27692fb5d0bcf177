#!/usr/bin/env bash
# Tensor parallelism on a machine with two GPUs, each check in its own time limit:
#
#   bash benchmark/tp_gpu.sh                     # every check, about 10 minutes on a fresh machine
#   CHECKS=decode8b,decode70b bash benchmark/tp_gpu.sh
#
# Checks (CHECKS, comma-separated; default all, in this order):
#   build      loads FlashInfer's fused all-reduce module (--enable-flashinfer-allreduce-fusion), which
#              the tests and decode checks use: seconds when `make comm-prebuilt` put it in the wheel,
#              else FlashInfer's JIT build, more than 5 minutes on a fresh machine (a call of its own)
#   tests      pytest -m gpu tests/gpu/test_tp_gpu.py (TP=2 logits against one GPU, eager and from
#              graphs; greedy tokens; close)
#   decode8b   python -m benchmark.tp_decode: the 8B shape's decode step at TP=1, TP=2 and TP=2 with
#              the fused all-reduce, batch 1 and 64 (in turn, kernel time, and in the engine with
#              overlap scheduling)
#   decode70b  the same for the 70B shape at TP=2, NCCL and fused (batch 1 and 16), nearly all GPU memory
#   serve70b   `flashserve serve` of the 70B shape at TP=2 with the Llama-3 tokenizer, under
#              benchmark.serve_bench's random workload (2048/256) at RATE70B req/s (default 4)
#   stress     benchmark/gpu_stress.sh on the 8B shape at TP=2, then SIGTERM: exit 0, no process
#              or /dev/shm file left
# Results (tables, JSON, logs) go to OUT (default benchmark/results/local/<GPU>/tensor_parallel, git-ignored).
# What the machine lacks travels in .whl/ (see benchmark/run_suite.sh); the tokenizer in
# .whl/llama3-tokenizer (`make gpu-tokenizer`), locust in .whl/stress (`make stress-wheels`),
# the fused all-reduce's CUDA source, or the module prebuilt, in the slimmed flashinfer wheel
# (`make comm-source`, `make comm-prebuilt`).
set -u
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
CHECKS=${CHECKS:-build,tests,decode8b,decode70b,serve70b,stress}
RATE70B=${RATE70B:-4}
if [ -d .whl ] && ! $PYTHON -c "import flashinfer, fastapi" 2>/dev/null; then
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi}
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
COUNT=$($PYTHON -c 'import torch; print(torch.cuda.device_count())')
OUT=${OUT:-benchmark/results/local/$(echo "$GPU" | tr ' ' '_')/tensor_parallel}
mkdir -p "$OUT"
echo "$COUNT x $GPU; results in $OUT"
[ "$COUNT" -ge 2 ] || { echo "needs two GPUs"; exit 2; }
want() { [[ ",$CHECKS," == *",$1,"* ]]; }
quiet() { grep -v -E "JIT|UserWarning|warn_once|set_sync_debug_mode|^\s*$"; }
RC=0

if want build; then
  start=$(date +%s)
  timeout ${BUILD_TIMEOUT:-590} $PYTHON -c "from flashinfer.comm.trtllm_ar import get_trtllm_comm_module as g; g()" \
    >"$OUT/build.log" 2>&1
  rc=$?; echo "build: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/build.log"; [ $rc -eq 0 ] || RC=1
fi
if want tests; then
  timeout 420 $PYTHON -m pytest -v -m gpu tests/gpu/test_tp_gpu.py -p no:cacheprovider --durations=0 >"$OUT/tp_gpu_tests.log" 2>&1
  rc=$?; echo "tests: exit $rc" | tee -a "$OUT/tp_gpu_tests.log"; [ $rc -eq 0 ] || RC=1
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tp_gpu_tests.log" | tail -n 8
fi
decode() {  # name, then tp_decode's arguments
  local name=$1; shift
  timeout 420 $PYTHON -m benchmark.tp_decode --out "$OUT/.raw" "$@" 2>&1 | quiet | tee "$OUT/tp_decode_$name.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || RC=1
  mv "$OUT"/.raw/*/tp_decode.json "$OUT/tp_decode_$name.json" 2>/dev/null
  mv "$OUT"/.raw/*/tp_decode.png "$OUT/tp_decode_$name.png" 2>/dev/null; rm -rf "$OUT/.raw"
}
want decode8b && decode 8b --tp 1,2,2+fused --batches 1,64
want decode70b && decode 70b --model llama-3.1-70b --tp 2,2+fused --batches 1,16 --steps 20 --gpu-memory-utilization 0.95
if want serve70b; then
  PORT=$($PYTHON -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  $PYTHON -m flashserve serve --load-format dummy --model llama-3.1-70b --tokenizer .whl/llama3-tokenizer --tp 2 \
    --gpu-memory-utilization 0.95 --port "$PORT" >"$OUT/serve_70b.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 240); do curl -sf "127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
  timeout 300 $PYTHON -m benchmark.serve_bench --base-url "http://127.0.0.1:$PORT" --workload random \
    --request-rate "$RATE70B" --num-requests 80 --token-ids --out-dir "$OUT" --no-summary --no-progress \
    2>&1 | tee "$OUT/serve_70b.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || RC=1
  kill -TERM $SERVER; wait $SERVER; echo "70B server exit after SIGTERM: $?" | tee -a "$OUT/serve_70b.txt"
fi
if want stress; then
  MODEL=llama-3.1-8b USERS=${USERS:-64} RUN_TIME=${RUN_TIME:-30s} SERVER_ARGS="--tensor-parallel-size 2" \
    LOG="$OUT/stress_8b_tp2_server.log" timeout 300 bash benchmark/gpu_stress.sh >"$OUT/stress_8b_tp2.txt" 2>&1
  rc=$?; [ $rc -eq 0 ] || RC=1
  sleep 2
  { echo "stress: exit $rc"; echo "processes left:"; pgrep -af "flashserve|multiprocessing" | grep -v pgrep
    echo "/dev/shm:"; ls /dev/shm; } >>"$OUT/stress_8b_tp2.txt"
  grep -E "failures|P99 TTFT|KV pages|exit code|stress:|left|shm" -A1 "$OUT/stress_8b_tp2.txt" | tail -n 12
fi
exit $RC
