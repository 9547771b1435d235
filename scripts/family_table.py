"""Issue 28's closing table from `scripts/gpu_validate.sh family-specs`' results: for each spec, its clean diff (states,
greedy tokens, the worst state against its tolerance), the injected fault (where it was found), the diff past the
window where one ran, and the decode step against transformers with CUDA graphs at context 128.

    python3 scripts/family_table.py RESULTS_DIR SPEC [SPEC ...]

Reads RESULTS_DIR/diff-SPEC.json, inject-SPEC.json, diff-SPEC-past-window.json (if any) and bench-SPEC.json; a file
that is missing or unreadable leaves its cells as "not run". Prints a markdown table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

NOT_RUN = "not run"


def read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def clean_cells(d: dict | None) -> tuple[str, str]:
    """(verdict with states and tokens, the worst state's rel L2 and its ratio to the tolerance)."""
    if d is None:
        return NOT_RUN, NOT_RUN
    rows = d["rows"]
    verdict = "PASS" if d["passed"] else "FAIL"
    worst = max(rows, key=lambda r: r["rel_l2"] / r["tol"])
    where = worst["op"] if worst["layer"] is None else f"{worst['layer']}:{worst['op']}"
    tokens = f"{d['token_agreement']}/{d['steps'] * d.get('batch', 1)}"
    return (f"{verdict}, {len(rows)} states, tokens {tokens}",
            f"{worst['rel_l2']:.2e} at {where} ({worst['rel_l2'] / worst['tol']:.2f} of tol)")


def fault_cell(d: dict | None) -> str:
    if d is None or d.get("injected") is None:
        return NOT_RUN
    at = f"{d['injected']['layer']}:{d['injected']['op']}"
    return f"`{at}`: found there" if d["caught_injection"] else f"`{at}`: NOT found there"


def past_cell(d: dict | None) -> str:
    if d is None:
        return ""
    return f"prompt {d['prompt_len']}: {'PASS' if d['passed'] else 'FAIL'}, tokens {d['token_agreement']}/{d['steps']}"


def bench_cells(d: dict | None) -> tuple[str, str]:
    """(the megakernel's step and fraction of floor, transformers + CUDA graphs and the ratio) at the first context."""
    if d is None:
        return NOT_RUN, NOT_RUN
    rows = [r for r in d["results"] if "error" not in r and "batch" not in r]
    mk = next((r for r in rows if r["engine"].startswith("megakernel")), None)
    hf = next((r for r in rows if r["engine"] == "hf_graph" and mk and r["context"] == mk["context"]), None)
    step = NOT_RUN if mk is None else f"{mk['median_us']:.1f} us ({mk['floor_fraction']:.0%} of {d['floor_us']:.0f})"
    graph = NOT_RUN if hf is None else f"{hf['median_us']:.1f} us ({hf['megakernel_speedup']:.2f}x)"
    return step, graph


def table(results: Path, specs: list[str]) -> str:
    lines = ["| spec | clean diff | worst state | fault | past the window | step at context 128 | transformers + CUDA "
             "graphs |", "|---|---|---|---|---|---|---|"]
    for spec in specs:
        clean, worst = clean_cells(read(results / f"diff-{spec}.json"))
        fault = fault_cell(read(results / f"inject-{spec}.json"))
        past = past_cell(read(results / f"diff-{spec}-past-window.json"))
        step, graph = bench_cells(read(results / f"bench-{spec}.json"))
        lines.append(f"| {spec} | {clean} | {worst} | {fault} | {past} | {step} | {graph} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python3 scripts/family_table.py RESULTS_DIR SPEC [SPEC ...]", file=sys.stderr)
        return 2
    print(table(Path(argv[0]), argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
