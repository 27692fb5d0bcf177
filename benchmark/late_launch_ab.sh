#!/usr/bin/env bash
# Late launches A/B (`--late-launch` against without) on the same GPU(s), one server after the other,
# ROUNDS rounds, the order of the two sides swapped every round; each round the seed protocol's
# workload at RATE by SGLang's client (`benchmark/seed_protocol.sh` with PROBE=0), both sides of round
# i drawing the same prompts and arrival times (seed i). Then `benchmark.ab_pairs` prints each round's
# pair and the mean of the differences:
#
#   MODEL=llama-3.1-8b SERVER_ARGS="--quantization fp8 --kv-cache-dtype fp8" RATE=24 ROUNDS=3 bash benchmark/late_launch_ab.sh
#   MODEL=llama-3.1-70b TP=4 RATE=4 NPROMPTS=128 ROUNDS=2 SIDE_BUDGET=280 bash benchmark/late_launch_ab.sh
#
# A round is skipped when less than two sides' SIDE_BUDGET (seconds, default 150) is left of BUDGET
# (default 570). Results under OUT (default benchmark/results/<GPU>/late_launch/ab-<TAG>), TAG
# naming the configuration (default the model's name).
set -u
cd "$(dirname "$0")/.." || exit 2
T0=$(date +%s)
MODEL=${MODEL:-llama-3.1-8b}
TAG=${TAG:-$MODEL}
RATE=${RATE:-24}
ROUNDS=${ROUNDS:-3}
BUDGET=${BUDGET:-570}
SIDE_BUDGET=${SIDE_BUDGET:-150}
SERVER_ARGS=${SERVER_ARGS:-}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr ' ' '_')
OUT=${OUT:-benchmark/results/$GPU/late_launch/ab-$TAG}
mkdir -p "$OUT"
for round in $(seq 1 "$ROUNDS"); do
  if [ $(( BUDGET - ($(date +%s) - T0) )) -lt $(( 2 * SIDE_BUDGET )) ]; then
    echo "round $round: skipped, the budget is spent"; break
  fi
  sides="late nolate"; [ $(( round % 2 )) = 0 ] && sides="nolate late"
  for side in $sides; do
    args="$SERVER_ARGS"; [ "$side" = late ] && args="$args --late-launch"
    NAME=$TAG-r$round-$side MODEL=$MODEL SERVER_ARGS="$args" SGL_RATES=$RATE FS_RATES="" PROBE=0 \
      SEED0=$(( round - 1 )) BUDGET=$SIDE_BUDGET OUT=$OUT bash benchmark/seed_protocol.sh > "$OUT/run_r${round}_$side.txt" 2>&1
    echo "round $round $side: done at $(( $(date +%s) - T0 )) s"
  done
done
zgrep -h "late launches" "$OUT"/server_*.log.gz
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" ${PYTHON:-python3} -m benchmark.ab_pairs "$OUT" --a late --b nolate | tee "$OUT/ab.md"
