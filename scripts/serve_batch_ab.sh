#!/usr/bin/env bash
# Issue 29's next serving calls: the default server (sized frames, and now codec calls sized to their streams) at
# 1 req/s from ~200 requests, 10 and 20 req/s; the same server with --batch-size 8 at 10 and 20 req/s; and with
# --compile-codec at 1 req/s for 60 s, 10 and 20 req/s (docs/serving.md: what each should move). Random 1.7B weights,
# 75-frame requests, --max-streams 160, the debug timeline in each serve.log. Writes OUT_DIR/<run>/ and prints each
# table and timeline. RUNS picks the runs (default: default batch-8, ~7 minutes with start-ups, LOW_SECONDS, default
# 210, being the 1 req/s run; `RUNS=compiled`, ~4-6 minutes with the codec's first compiles, fits a call of its own).
# Usage: [RUNS="default batch-8 compiled"] scripts/serve_batch_ab.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/serve_batch_ab.sh OUT_DIR}
mkdir -p "$OUT"
for run in ${RUNS:-default batch-8}; do
    case "$run" in
        default) rates="1:${LOW_SECONDS:-210} 10:20 20:15"; args="--batched" ;;
        batch-8) rates="10:20 20:15"; args="--batched --batch-size 8" ;;
        compiled) rates="1:60 10:20 20:15"; args="--batched --compile-codec" ;;
        *) echo "unknown run '$run'; runs: default batch-8 compiled" >&2; exit 2 ;;
    esac
    MAX_STREAMS=160 SERVE_ARGS="$args" SERVE_LOG_LEVEL=debug LOADTEST_ARGS="--max-frames 75" RATE_RUNS="$rates" \
        STREAMS="" BURST="" KNEE_RATES="" scripts/serve_loadtest.sh "$OUT/$run" > "$OUT/$run.out" 2> "$OUT/$run.err"
    echo "== $run (exit $?): $(grep -h 'ready:' "$OUT/$run/serve.log" | sed 's/.*ready: //')"
    tail -n 5 "$OUT/$run.out"
    ${PYTHON:-python} scripts/serve_timeline.py "$OUT/$run/serve.log"
done
