#!/usr/bin/env bash
# The whole benchmark suite on a GPU machine, in one command of under 10 minutes:
#
#   export PYTHONPATH=/tmp/site:$PWD/src && bash benchmark/run_suite.sh OUT [benchmark.suite options]
#
# Installs the packages of .whl/ into /tmp/site when they are not importable yet (the GPU machine
# has no pip index), sets FlashInfer's build cache and job count, and runs `python3 -m
# benchmark.suite OUT` (see its --help: --preset full, --phases, --set KEY=VALUE, --budget-s).
set -u
if [ $# -lt 1 ]; then
  echo "usage: bash benchmark/run_suite.sh OUT [benchmark.suite options]" >&2
  exit 2
fi
mkdir -p "$1" && out=$(cd "$1" && pwd) || exit 2
shift
cd "$(dirname "$0")/.." || exit 2
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
export PYTHONPATH="/tmp/site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ! python3 -c "import fastapi, uvicorn, flashinfer" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available())"
exec python3 -m benchmark.suite "$out" "$@"
