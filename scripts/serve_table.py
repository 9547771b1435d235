"""The markdown table of a serve_loadtest.sh run: one row a load of OUT/runs.tsv (label, JSON file, what it is), in
the order run; runs skipped for time are listed as such; the knee search's verdict. Usage: serve_table.py OUT_DIR"""

import json
import sys
from pathlib import Path

KNEE_P95_MS = 100.0  # issue 29's knee: p95 first audio at most this, no underrun (and no error)


def passes(s: dict) -> bool:
    p95 = s["ttfa_ms"]["p95"]
    return p95 is not None and p95 <= KNEE_P95_MS and s["underruns"] == 0 and s["errors"] == 0 and s["dropped"] == 0


def main(out: Path) -> None:
    ready = json.loads((out / "ready.json").read_text()) if (out / "ready.json").exists() else {}
    if ready:
        print(f"mkport serve {ready['model']}, {ready['composition']}, {ready['max_streams']} streams, batches "
              f"{ready.get('batches')}; load {ready.get('load_s')} s, warm-up {ready.get('warm_s')} s")
    print("| load | run s | sent | TTFA p50 ms | p95 | p99 | RTF p50 | p95 | underruns | errors | dropped "
          "| the server's TTFA p50 / p95 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    knee, failed = [], None
    runs = (out / "runs.tsv").read_text().splitlines() if (out / "runs.tsv").exists() else []
    for line in runs:
        label, name, kind, seconds = line.split("\t")
        path = out / name
        if not path.exists() or not path.stat().st_size:
            print(f"| {label} | {seconds} | {'skipped: no time left' if name == '-' else 'no result (cut off)'} |")
            continue
        s = json.loads(path.read_text())["summary"]
        t, r, own = s["ttfa_ms"], s["rtf"], s.get("server_ttfa_ms") or {}  # own: its Server-Timing header's
        # underruns within a stream's first second of audio (its start), where the run recorded them
        early = f" ({s['underruns_in_first_second']} early)" if s["underruns"] and "underruns_in_first_second" in s else ""
        print(f"| {label} | {seconds} | {s['sent']} | {t['p50']} | {t['p95']} | {t['p99']} | {r['p50']} | {r['p95']} | "
              f"{s['underruns']}{early} | {s['errors']} | {s['dropped']} | {own.get('p50') or '-'} / {own.get('p95') or '-'} |")
        if kind == "knee":
            if passes(s):
                knee.append(label)
            elif failed is None:
                why = [f"p95 {t['p95']} ms" if (t["p95"] or 1e9) > KNEE_P95_MS else "",
                       f"{s['underruns']} underruns" if s["underruns"] else "",
                       f"{s['errors']} errors {s['error_kinds']}" if s["errors"] else "",
                       f"{s['dropped']} dropped" if s["dropped"] else ""]
                failed = f"{label}: " + ", ".join(w for w in why if w)
    if any(line.split("\t")[2] == "knee" for line in runs):
        print(f"\nknee (p95 <= {KNEE_P95_MS:g} ms, no underrun, error or drop): "
              f"{knee[-1] if knee else 'none of the rates tried'}; first failing: {failed or 'none'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
