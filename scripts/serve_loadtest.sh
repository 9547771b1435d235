#!/usr/bin/env bash
# The GPU load-test table of docs/serving.md: `mkport serve` (random 1.7B weights, megakernel backend) and
# `mkport loadtest` against it, one server for every load, in one process tree; prints a markdown table
# (scripts/serve_table.py) and keeps every JSON result, the server's log and its final metrics in OUT_DIR.
# Usage: scripts/serve_loadtest.sh [OUT_DIR]
#   env: PORT; RATES ("1 10 20") at DURATION seconds each, or RATE_RUNS ("1:80 10:25": rate:seconds each; empty: none);
#        STREAMS (closed-loop runs, e.g. "64", or "64 64" for two: that many clients back to back) with RAMP
#        (seconds over which they start) and STREAMS_DURATION; BURST (e.g. "32": that many clients at once) with
#        BURST_DURATION;
#        KNEE_RATES (e.g. "25 30 35 40": rising rates at KNEE_DURATION seconds, stopping after the first that fails
#        p95 <= 100 ms with no underrun, error or drop); CONCURRENCY (the loadtest's, 256); MAX_STREAMS; MODEL_ARGS;
#        LOADTEST_ARGS, e.g. "--max-frames 75": random weights never say EOS, so each request runs to its limit;
#        SERVE_ARGS, e.g. "--batched"; SERVE_LOG_LEVEL (debug: each stream's path to first audio in serve.log);
#        DEADLINE (epoch seconds): a run that would end past it is skipped (listed).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-serve-loadtest}
PORT=${PORT:-8765}
DURATION=${DURATION:-60}
RATES=${RATES:-"1 10 20"}
# unset: RATES at DURATION; set but empty: no open-loop run (as an empty STREAMS, BURST or KNEE_RATES)
RATE_RUNS=${RATE_RUNS-$(for r in $RATES; do printf '%s:%s ' "$r" "$DURATION"; done)}
CONCURRENCY=${CONCURRENCY:-256}
DRAIN=${DRAIN:-10}  # seconds a run's last requests may take after its arrivals (75 frames: 6 s of audio)
PY=${PYTHON:-python}
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"
: > "$OUT/runs.tsv"

# shellcheck disable=SC2086
$PY -m mkport.cli serve ${MODEL_ARGS:---random-weights 1.7b} --port "$PORT" --max-streams "${MAX_STREAMS:-32}" ${SERVE_ARGS:-} \
    --log-level "${SERVE_LOG_LEVEL:-warning}" > "$OUT/serve.log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
start=$(date +%s)
$PY - "$URL" "$server" <<'PYEOF'
import os, sys, time, httpx
url, pid = sys.argv[1], int(sys.argv[2])
for _ in range(1200):  # the first run builds the kernels and writes the random model: minutes
    try:
        if httpx.get(url + "/ready").status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("mkport serve exited; see its log")
    time.sleep(1)
sys.exit("mkport serve was not ready after 20 minutes")
PYEOF
echo "server ready after $(( $(date +%s) - start )) s" >&2
$PY -c "import httpx, json; print(json.dumps(httpx.get('$URL/ready').json()))" > "$OUT/ready.json"

# run LABEL FILE KIND SECONDS LOADTEST-ARGS...: one load, or a line saying it was skipped for time
run() {
    local label=$1 file=$2 kind=$3 seconds=$4
    shift 4
    if [ -n "${DEADLINE:-}" ] && [ $(( $(date +%s) + seconds + DRAIN )) -gt "$DEADLINE" ]; then
        echo "loadtest: $label skipped: it would end past the deadline" >&2
        printf '%s\t-\t%s\t%s\n' "$label" "$kind" "$seconds" >> "$OUT/runs.tsv"
        return 1
    fi
    echo "loadtest: $label for $seconds s" >&2
    printf '%s\t%s\t%s\t%s\n' "$label" "$file" "$kind" "$seconds" >> "$OUT/runs.tsv"
    # shellcheck disable=SC2086
    $PY -m mkport.cli loadtest "$URL" "$@" --duration "$seconds" --timeout "$DRAIN" ${LOADTEST_ARGS:-} --json \
        > "$OUT/$file" || true  # exit 1 on errors: they are in the table
}

for item in $RATE_RUNS; do
    rate=${item%%:*}
    run "$rate req/s" "loadtest-$rate.json" rate "${item##*:}" --rate "$rate" --concurrency "$CONCURRENCY" || true
done
# unused FILE.json for a run's results: FILE.json, else FILE-2.json, ... (a load given twice, e.g. STREAMS="64 64")
fresh() {
    local name=$1.json k=2
    while [ -e "$OUT/$name" ]; do name=$1-$k.json; k=$((k + 1)); done
    echo "$name"
}
for n in ${STREAMS:-}; do
    run "$n streams, ${RAMP:-0} s ramp" "$(fresh "loadtest-streams-$n")" streams "${STREAMS_DURATION:-$DURATION}" \
        --streams "$n" --ramp "${RAMP:-0}" || true
done
for n in ${BURST:-}; do
    run "$n-stream burst" "$(fresh "loadtest-burst-$n")" streams "${BURST_DURATION:-$DURATION}" --streams "$n" \
        --ramp 0 || true
done
for rate in ${KNEE_RATES:-}; do
    run "knee: $rate req/s" "loadtest-knee-$rate.json" knee "${KNEE_DURATION:-$DURATION}" --rate "$rate" \
        --concurrency "$CONCURRENCY" || break
    $PY - "$OUT/loadtest-knee-$rate.json" <<'PYEOF' || break
import json, sys
sys.path.insert(0, "scripts")
from serve_table import passes
sys.exit(0 if passes(json.load(open(sys.argv[1]))["summary"]) else 1)
PYEOF
done
$PY -c "import httpx; print(httpx.get('$URL/metrics').text)" > "$OUT/metrics.txt" || true
$PY scripts/serve_table.py "$OUT"
