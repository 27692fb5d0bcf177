#!/usr/bin/env bash
# TCP_NODELAY A/B on the host alone: benchmark.api_host's server (real processes, an executor that answers each step after
# 2 ms) from this tree and from a copy without the fix; a client reusing one connection (seed_probe's) and SGLang's
# bench_serving.py (a connection per request) against each, interleaved.
set -u
cd "$(dirname "$0")/.."; ROOT=$PWD  # the repository root, with .whl/ (prepare-wheels.sh, make sglang-bench, make gpu-tokenizer-xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/sglbench/*.whl 2>/dev/null
python3 -c "import tarfile; tarfile.open('.whl/llama3-tokenizer.tar.xz').extractall('/tmp/llama3-tokenizer')"
rm -rf /tmp/nagle && mkdir /tmp/nagle && cp -r src benchmark /tmp/nagle/
sed -i 's/socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)/socket.socket(family, socket.SOCK_STREAM)/' /tmp/nagle/src/flashserve/entrypoints/serve.py
echo "IPPROTO_TCP in fixed / nagle: $(grep -c 'SOCK_STREAM, socket.IPPROTO_TCP' src/flashserve/entrypoints/serve.py) / $(grep -c 'SOCK_STREAM, socket.IPPROTO_TCP' /tmp/nagle/src/flashserve/entrypoints/serve.py)"
for round in 1 2; do for tree in fixed nagle; do
  d=$ROOT; [ $tree = nagle ] && d=/tmp/nagle
  (cd $d && PYTHONPATH=/tmp/site:$d/src:$d exec python3 -m benchmark.api_host --serve processes --port 8950 --step-ms 2 \
     --stats /tmp/st_$tree.json --tokenizer /tmp/llama3-tokenizer > /tmp/srv_$tree.log 2>&1) & S=$!
  until curl -sf 127.0.0.1:8950/health >/dev/null; do sleep 0.2; done
  PYTHONPATH=/tmp/site:$ROOT python3 - <<'PY'
import httpx, time, random, statistics, json
rng = random.Random(0); c = httpx.Client(timeout=60)
m = c.get("http://127.0.0.1:8950/v1/models").json()["data"][0]["id"]
for n in (16, 2048):
    firsts, gaps = [], []
    for _ in range(20):
        body = {"model": m, "prompt": [rng.randrange(1000, 120000) for _ in range(n)], "max_tokens": 32, "stream": True, "ignore_eos": True}
        t = time.perf_counter(); times = []
        with c.stream("POST", "http://127.0.0.1:8950/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                    times.append(time.perf_counter() - t)
        firsts.append(times[0] * 1e3); gaps += [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    print(f"  reused connection, {n}-token prompt: TTFT median {statistics.median(firsts):.1f} ms, ITL median {statistics.median(gaps):.2f} ms, p99 {sorted(gaps)[int(0.99 * len(gaps))]:.2f} ms")
PY
  HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site timeout 100 python3 .whl/sglbench/bench_serving.py --backend vllm --base-url http://127.0.0.1:8950 \
    --model host-bench --tokenizer /tmp/llama3-tokenizer --dataset-name random-ids --random-input-len 2048 --random-output-len 256 \
    --random-range-ratio 0.25 --request-rate 16 --num-prompts 128 --seed $round --disable-tqdm 2>&1 \
    | grep -E "Median TTFT|P99 TTFT|Median ITL|P99 ITL" | sed "s/^/  bench_serving 16 req\/s: /"
  echo "^ $tree, round $round"
  kill -TERM $S; wait $S 2>/dev/null
done; done
