#!/usr/bin/env bash
# Issue 29's serving runs: the default server (sized frames, codec calls sized to their streams and compiled) at
# 1 req/s from ~200 requests, 10 and 20 req/s; `plain`, the same with --no-compile-codec (the sized calls alone); and
# `batch-8`, --batch-size 8 at 10 and 20 req/s (docs/serving.md: what each should move). Random 1.7B weights,
# 75-frame requests, --max-streams 160, the debug timeline in each serve.log. Writes OUT_DIR/<run>/ and prints each
# table and timeline. RUNS picks the runs (default: default plain, ~8 minutes with start-ups when torch.compile's cache
# is filled, LOW_SECONDS, default 210, being each 1 req/s run; an empty cache adds ~3 minutes to the default's start).
# MAX_STREAMS: the slots (160, the H200's measured server; on an 80 GB H100 fewer: the server says how many fit).
# Usage: [RUNS="default plain batch-8"] [MAX_STREAMS=N] scripts/serve_batch_ab.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/serve_batch_ab.sh OUT_DIR}
mkdir -p "$OUT"
for run in ${RUNS:-default plain}; do
    case "$run" in
        default) rates="1:${LOW_SECONDS:-210} 10:20 20:15"; args="--batched" ;;
        plain) rates="1:${LOW_SECONDS:-210} 10:20 20:15"; args="--batched --no-compile-codec" ;;
        batch-8) rates="10:20 20:15"; args="--batched --batch-size 8" ;;
        *) echo "unknown run '$run'; runs: default plain batch-8" >&2; exit 2 ;;
    esac
    MAX_STREAMS=${MAX_STREAMS:-160} SERVE_ARGS="$args" SERVE_LOG_LEVEL=debug LOADTEST_ARGS="--max-frames 75" RATE_RUNS="$rates" \
        STREAMS="" BURST="" KNEE_RATES="" scripts/serve_loadtest.sh "$OUT/$run" > "$OUT/$run.out" 2> "$OUT/$run.err"
    echo "== $run (exit $?): $(grep -h 'ready:' "$OUT/$run/serve.log" | sed 's/.*ready: //')"
    tail -n 5 "$OUT/$run.out"
    ${PYTHON:-python} scripts/serve_timeline.py "$OUT/$run/serve.log"
done
