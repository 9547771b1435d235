#!/usr/bin/env bash
# The GPU load-test table of docs/serving.md: `mkport serve` (random 1.7B weights, megakernel backend) and
# `mkport loadtest` against it at 1, 10 and 20 requests a second, in one process tree; prints a markdown table
# and keeps every JSON result, the server's log and its final metrics in OUT_DIR.
# Usage: scripts/serve_loadtest.sh [OUT_DIR]     (env: PORT, DURATION seconds a run, RATES, STREAMS (closed-loop runs,
#        e.g. "32": that many clients back to back), RAMP (seconds over which they start), MAX_STREAMS, MODEL_ARGS,
#        LOADTEST_ARGS, e.g. "--max-frames 75": random weights never say EOS, so each request runs to its limit;
#        SERVE_ARGS, e.g. "--batched")
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-serve-loadtest}
PORT=${PORT:-8765}
DURATION=${DURATION:-60}
RATES=${RATES:-"1 10 20"}
PY=${PYTHON:-python}
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"

# shellcheck disable=SC2086
$PY -m mkport.cli serve ${MODEL_ARGS:---random-weights 1.7b} --port "$PORT" --max-streams "${MAX_STREAMS:-32}" ${SERVE_ARGS:-} \
    --log-level warning > "$OUT/serve.log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
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
$PY -c "import httpx, json; print(json.dumps(httpx.get('$URL/ready').json()))" > "$OUT/ready.json"

for rate in $RATES; do
    echo "loadtest: $rate requests/s for $DURATION s" >&2
    # shellcheck disable=SC2086
    $PY -m mkport.cli loadtest "$URL" --rate "$rate" --duration "$DURATION" --concurrency 64 ${LOADTEST_ARGS:-} --json \
        > "$OUT/loadtest-$rate.json" || true  # exit 1 on errors: they are in the table
done
for n in ${STREAMS:-}; do
    echo "loadtest: $n streams back to back for $DURATION s" >&2
    # shellcheck disable=SC2086
    $PY -m mkport.cli loadtest "$URL" --streams "$n" --ramp "${RAMP:-0}" --duration "$DURATION" ${LOADTEST_ARGS:-} --json \
        > "$OUT/loadtest-streams-$n.json" || true
done
$PY -c "import httpx; print(httpx.get('$URL/metrics').text)" > "$OUT/metrics.txt"

$PY - "$OUT" "$RATES" "${STREAMS:-}" <<'PYEOF'
import json, sys
out, rates, streams = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
ready = json.load(open(f"{out}/ready.json"))
print(f"mkport serve {ready['model']}, backend {ready['backend']}, {ready['max_streams']} streams{', batched' if ready.get('batched') else ''}")
print("| load | sent | TTFA p50 ms | p95 | p99 | RTF p50 | p95 | underruns | errors | dropped |")
print("|---|---|---|---|---|---|---|---|---|---|")
runs = [(f"{rate} req/s", f"loadtest-{rate}") for rate in rates] + [(f"{n} streams", f"loadtest-streams-{n}") for n in streams]
for load, name in runs:
    s = json.load(open(f"{out}/{name}.json"))["summary"]
    t, r = s["ttfa_ms"], s["rtf"]
    print(f"| {load} | {s['sent']} | {t['p50']} | {t['p95']} | {t['p99']} | {r['p50']} | {r['p95']} | "
          f"{s['underruns']} | {s['errors']} | {s['dropped']} |")
PYEOF
