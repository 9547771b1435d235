"""Where first audio's time went, from the debug log of `mkport serve --log-level debug` (serve_loadtest.sh with
SERVE_LOG_LEVEL=debug writes it to OUT_DIR/serve.log): for each stamp of the streams that completed (the scheduler
took it, its prompt was built, its join returned, its first chunk left the scheduler, and, where logged, was handed to
the HTTP response on the event loop; ms after arrival) the p50, p95 and max, and the same for each step between two
stamps in the order they happen: batched, the prompt is built in the join; by turns (a stream logs slot None), the
join gives it decoders and the prompt is built in its first frame.

    python3 scripts/serve_timeline.py SERVE_LOG [SERVE_LOG ...]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkport.serve.loadtest import percentiles

LINE = re.compile(r"stream completed \(\d+ active\): slot (\d+|None): admitted ([\d.]+) ms after arrival, "
                  r"prompt ([\d.]+), joined ([\d.]+), first audio ([\d.]+)(?:, sent ([\d.]+|-))?$")
STAMPS = ("admitted", "prompt", "joined", "first audio")  # as a line gives them, then "sent" where it has one
ORDER = {"batched": (*STAMPS, "sent"), "by turns": ("admitted", "joined", "prompt", "first audio", "sent")}


def read(text: str) -> dict[str, list[dict[str, float]]]:
    """The stamps of each completed stream whose every stamp was logged, in log order, by server mode."""
    rows: dict[str, list[dict[str, float]]] = {}
    for line in text.splitlines():
        if m := LINE.search(line):
            mode = "by turns" if m.group(1) == "None" else "batched"
            stamps = dict(zip(STAMPS, map(float, m.groups()[1:5])))
            if m.group(6) not in (None, "-"):  # a WebSocket's stream, or a log from before the stamp, has none
                stamps["sent"] = float(m.group(6))
            rows.setdefault(mode, []).append(stamps)
    return rows


def summary(rows: list[dict[str, float]], order=ORDER["batched"]) -> list[tuple[str, float, float, float]]:
    """(what, p50, p95, max) for each stamp, then each step between two stamps in `order` (those every row has):
    nearest-rank, as the loadtest's."""
    order = [name for name in order if all(name in r for r in rows)]
    columns = {name: [r[name] for r in rows] for name in order}
    for a, b in zip(order, order[1:]):
        columns[f"{a} -> {b}"] = [y - x for x, y in zip(columns[a], columns[b])]
    return [(name, (q := percentiles(values))["p50"], q["p95"], q["max"]) for name, values in columns.items()]


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python3 scripts/serve_timeline.py SERVE_LOG [SERVE_LOG ...]", file=sys.stderr)
        return 2
    for path in argv:
        modes = read(Path(path).read_text())
        if not modes:
            print(f"{path}: no timelines: was the server run with --log-level debug?")
        for mode, rows in modes.items():
            print(f"{path}: {len(rows)} streams, {mode}")
            for name, p50, p95, top in summary(rows, ORDER[mode]):
                print(f"  {name:<26} p50 {p50:6.1f} ms  p95 {p95:6.1f}  max {top:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
