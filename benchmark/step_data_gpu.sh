#!/usr/bin/env bash
# The persistent input batch on one GPU: its GPU tests, then the host time of a 512-request decode
# step of the 1B shape and the cascade decode shape (4 x 128 behind 4,096 tokens), off / on / auto.
#
#   bash benchmark/step_data_gpu.sh                 # everything, at most 8.5 minutes on a fresh H100 (FlashInfer builds included)
#   CHECKS=step,cascade bash benchmark/step_data_gpu.sh
#
# Checks (CHECKS, comma-separated; default all, in this order):
#   tests    pytest tests/gpu/test_input_batch_gpu.py (requests joining and leaving graph decode
#            steps against teacher-forced logits; a decode step launched behind a busy device does
#            not wait for it)
#   step     python -m benchmark.step_profile at 512 x 512 in / 64 out, overlap on and off: the host
#            phases per step against the step's wall time (collect is the wait for the device)
#   cascade  python -m benchmark.batchllm_bench's cascade decode part: median all-decode step with
#            cascade off, on and auto
# Output (logs, JSON) goes to OUT (default benchmark/results/local/<GPU>/step_data).
set -u
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
CHECKS=${CHECKS:-tests,step,cascade}
if [ -d .whl ] && ! $PYTHON -c "import flashinfer" 2>/dev/null; then
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD/tests:$PWD${PYTHONPATH:+:$PYTHONPATH}" FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi}
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
OUT=${OUT:-benchmark/results/local/$(echo "$GPU" | tr ' ' '_')/step_data}
mkdir -p "$OUT"
status=0
run() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s): $*" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
}
case ",$CHECKS," in *,tests,*)
  run tests 240 $PYTHON -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_input_batch_gpu.py ;;
esac
case ",$CHECKS," in *,step,*)
  run step_profile 130 $PYTHON -m benchmark.step_profile --model llama-3.2-1b --batch 512 --prompt 512 --output 64 --top 30 ;;
esac
case ",$CHECKS," in *,cascade,*)
  run cascade 140 $PYTHON -m benchmark.batchllm_bench --model llama-3.2-1b --skip offline,sweep --max-num-seqs 512 \
    --decode-groups 4 --decode-requests 128 --decode-prefix 4096 --decode-out 128 --out "$OUT" ;;
esac
exit $status
