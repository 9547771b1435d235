#!/usr/bin/env bash
# Issue 29's warm-cache question in one call: does a server started from a warm cache (its kernels built and its
# random model written by an earlier server) give slower first audio at 1 req/s than one that builds them itself?
# Two servers one after another, each at 1 req/s for SECONDS_EACH (default 60) with the debug timeline: cold (an
# empty MKPORT_CACHE) and warm (the same cache again). (The thirty-fourth session found the warm one's prompts slow,
# their text rows gathered on the host, and a third server with glibc's mmap threshold raised no faster:
# docs/serving.md.) Writes OUT_DIR/{cold,warm}/ (the loadtest's files and serve.log) and prints each table and
# timeline (scripts/serve_timeline.py). ~250 s with start-ups. The cache (the random 1.7B model: GBs) is a temporary
# folder, removed at the end, not under OUT_DIR.
# Env: SECONDS_EACH; MAX_STREAMS (160; an 80 GB H100 holds 144 of the 1.7B's); SERVE_EXTRA (more serve flags, e.g.
# --no-compile-codec: a cold start without torch.compile's ~30 s a call shape).
# Usage: scripts/serve_cache_ab.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/serve_cache_ab.sh OUT_DIR}
SECONDS_EACH=${SECONDS_EACH:-60}
mkdir -p "$OUT"
CACHE=$(mktemp -d)
trap 'rm -rf "$CACHE"' EXIT
for run in cold warm; do
    MKPORT_CACHE="$CACHE" MAX_STREAMS=${MAX_STREAMS:-160} SERVE_ARGS="--batched ${SERVE_EXTRA:-}" SERVE_LOG_LEVEL=debug LOADTEST_ARGS="--max-frames 75" \
        RATE_RUNS="1:$SECONDS_EACH" STREAMS="" BURST="" KNEE_RATES="" \
        timeout --signal=INT --kill-after=10 $((SECONDS_EACH + 150)) scripts/serve_loadtest.sh "$OUT/$run" \
        > "$OUT/$run.out" 2> "$OUT/$run.err"
    echo "== $run (exit $?): $(grep -h 'ready:' "$OUT/$run/serve.log" | sed 's/.*; load/load/')"
    tail -n 1 "$OUT/$run.out"
    ${PYTHON:-python} scripts/serve_timeline.py "$OUT/$run/serve.log"
done
