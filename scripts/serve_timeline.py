"""Where first audio's time went, from the debug log of `mkport serve --log-level debug` (serve_loadtest.sh with
SERVE_LOG_LEVEL=debug writes it to OUT_DIR/serve.log): for each stamp of the streams that completed (the scheduler
took it, its prompt was built, its join returned, its first chunk left; ms after arrival) the p50, p95 and max,
and the same for each step between two stamps.

    python3 scripts/serve_timeline.py SERVE_LOG [SERVE_LOG ...]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkport.serve.loadtest import percentiles

LINE = re.compile(r"stream completed \(\d+ active\): slot \d+: admitted ([\d.]+) ms after arrival, prompt ([\d.]+), "
                  r"joined ([\d.]+), first audio ([\d.]+)$")
STAMPS = ("admitted", "prompt", "joined", "first audio")


def read(text: str) -> list[tuple[float, ...]]:
    """The stamps of each completed stream whose every stamp was logged, in log order."""
    return [tuple(map(float, m.groups())) for line in text.splitlines() if (m := LINE.search(line))]


def summary(rows: list[tuple[float, ...]]) -> list[tuple[str, float, float, float]]:
    """(what, p50, p95, max) for each stamp, then each step between two stamps: nearest-rank, as the loadtest's."""
    columns = {name: [r[i] for r in rows] for i, name in enumerate(STAMPS)}
    for a, b in zip(STAMPS, STAMPS[1:]):
        columns[f"{a} -> {b}"] = [y - x for x, y in zip(columns[a], columns[b])]
    return [(name, (q := percentiles(values))["p50"], q["p95"], q["max"]) for name, values in columns.items()]


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python3 scripts/serve_timeline.py SERVE_LOG [SERVE_LOG ...]", file=sys.stderr)
        return 2
    for path in argv:
        rows = read(Path(path).read_text())
        print(f"{path}: {len(rows)} streams")
        if not rows:
            print("  no timelines: was the server run with --log-level debug?")
            continue
        for name, p50, p95, top in summary(rows):
            print(f"  {name:<26} p50 {p50:6.1f} ms  p95 {p95:6.1f}  max {top:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
