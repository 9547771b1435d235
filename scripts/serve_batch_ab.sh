#!/usr/bin/env bash
# Issue 29's next serving call: the default server (sized frames, and now codec calls sized to their streams) at
# 1 req/s from ~200 requests, 10 and 20 req/s; then the same server with --batch-size 8 at 10 and 20 req/s
# (docs/serving.md: what each should move). Random 1.7B weights, 75-frame requests, --max-streams 160, the debug
# timeline in each serve.log. Writes OUT_DIR/{default,batch-8}/ and prints each table and timeline. ~7 minutes with
# start-ups (LOW_SECONDS, default 210: the 1 req/s run).
# Usage: scripts/serve_batch_ab.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/serve_batch_ab.sh OUT_DIR}
mkdir -p "$OUT"
for run in default batch-8; do
    rates="1:${LOW_SECONDS:-210} 10:20 20:15"
    args="--batched"
    [ "$run" = batch-8 ] && { rates="10:20 20:15"; args="--batched --batch-size 8"; }
    MAX_STREAMS=160 SERVE_ARGS="$args" SERVE_LOG_LEVEL=debug LOADTEST_ARGS="--max-frames 75" RATE_RUNS="$rates" \
        STREAMS="" BURST="" KNEE_RATES="" scripts/serve_loadtest.sh "$OUT/$run" > "$OUT/$run.out" 2> "$OUT/$run.err"
    echo "== $run (exit $?): $(grep -h 'ready:' "$OUT/$run/serve.log" | sed 's/.*ready: //')"
    tail -n 5 "$OUT/$run.out"
    ${PYTHON:-python} scripts/serve_timeline.py "$OUT/$run/serve.log"
done
