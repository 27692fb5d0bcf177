#!/usr/bin/env bash
# Stress test on the GPU machine, in one command of about 6 minutes (10 at most):
#
#   bash benchmark/gpu_stress.sh            # 300 users for 3 minutes on Llama-3.2-1B with dummy weights
#   USERS=500 RUN_TIME=2m bash benchmark/gpu_stress.sh
#
# Starts `flashserve serve --load-format dummy --model llama-3.2-1b` (no tokenizer: the users send
# token-id prompts; with TOKENIZER=dir, e.g. .whl/llama3-tokenizer from `make gpu-tokenizer`, the
# server tokenizes and the users send text completions), warms up the FlashInfer kernels, runs stress_test.py (locust, headless) and
# prints requests served, failures by kind, P99 TTFT and the KV pages free at the end, then stops
# the server with SIGTERM. Exit code: locust's (0: no failures and every page free).
#
# The machine has no network. What it lacks travels in .whl/ (carry it):
#   .whl/*.whl        the server's packages, as for run_suite.sh (fastapi, uvicorn, sse-starlette,
#                     pydantic, flashinfer-python, ...), installed into /tmp/site
#   .whl/stress/*.whl locust and its dependencies for CPython 3.12 (`make stress-wheels` fetches
#                     them), installed into /tmp/stress-site and seen by the locust process only
# Knobs (environment): USERS, SPAWN_RATE, RUN_TIME, PROCESSES (locust worker processes), MODEL,
# PROMPT (min:max tokens, or words with TOKENIZER), OUTPUT (min:max tokens), TOKENIZER, SERVER_ARGS (extra `flashserve serve` flags),
# PYTHON, LOG (the server's log file).
set -u
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
USERS=${USERS:-300} SPAWN_RATE=${SPAWN_RATE:-50} RUN_TIME=${RUN_TIME:-3m} PROCESSES=${PROCESSES:-4}
MODEL=${MODEL:-llama-3.2-1b} PROMPT=${PROMPT:-32:1024} OUTPUT=${OUTPUT:-16:256} SERVER_ARGS=${SERVER_ARGS:-}
LOG=${LOG:-$(mktemp /tmp/gpu_stress_server.XXXXXX)}
TOKENIZER=${TOKENIZER:-}
PROMPTS=(--token-ids)
if [ -n "$TOKENIZER" ]; then
  SERVER_ARGS="$SERVER_ARGS --tokenizer $TOKENIZER"
  PROMPTS=(--text-completions)
fi
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
SERVER_PATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
STRESS_PATH="/tmp/stress-site${PYTHONPATH:+:$PYTHONPATH}"

if [ -d .whl ] && ! PYTHONPATH=$SERVER_PATH $PYTHON -c "import fastapi, uvicorn, sse_starlette" 2>/dev/null; then
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
if ! PYTHONPATH=$STRESS_PATH $PYTHON -c "import locust" 2>/dev/null; then
  ls .whl/stress/*.whl >/dev/null 2>&1 || { echo "no locust: put its wheels in .whl/stress (make stress-wheels)" >&2; exit 2; }
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --target /tmp/stress-site .whl/stress/*.whl || exit 1
fi
PORT=$($PYTHON -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL=http://127.0.0.1:$PORT

echo "server: --load-format dummy --model $MODEL on port $PORT, log $LOG"
# shellcheck disable=SC2086  # SERVER_ARGS is a list of flags
PYTHONPATH=$SERVER_PATH $PYTHON -m flashserve serve --load-format dummy --model "$MODEL" --port "$PORT" \
  --shutdown-timeout 10 $SERVER_ARGS >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -9 $SERVER 2>/dev/null' EXIT

# Healthy, then a few requests so that kernels compile before the clock starts.
if ! $PYTHON - "$URL" <<'EOF'
import json, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
url = sys.argv[1]
deadline = time.monotonic() + 300
while True:
    try:
        if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
            break
    except Exception:
        if time.monotonic() > deadline:
            sys.exit("the server did not become healthy in 300 s")
        time.sleep(1)
def complete(n_in, n_out):
    body = json.dumps({"prompt": [100 + i % 900 for i in range(n_in)], "max_tokens": n_out, "ignore_eos": True})
    req = urllib.request.Request(f"{url}/v1/completions", body.encode(), {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=300).read()
t0 = time.monotonic()
complete(16, 4); complete(1024, 4)
with ThreadPoolExecutor(16) as pool:
    list(pool.map(lambda _: complete(64, 32), range(32)))
print(f"warm-up done in {time.monotonic() - t0:.0f} s")
EOF
then
  echo "---- server log (tail) ----"; tail -n 40 "$LOG"; exit 1
fi

PYTHONPATH=$STRESS_PATH $PYTHON stress_test.py --host "$URL" -u "$USERS" -r "$SPAWN_RATE" -t "$RUN_TIME" \
  --processes "$PROCESSES" "${PROMPTS[@]}" --min-prompt "${PROMPT%%:*}" --max-prompt "${PROMPT##*:}" \
  --min-output "${OUTPUT%%:*}" --max-output "${OUTPUT##*:}"
RC=$?

kill -TERM $SERVER
wait $SERVER
echo "server exit code after SIGTERM: $? (0 expected)"
grep -E "ERROR|Traceback" "$LOG" | head -n 20
exit $RC
