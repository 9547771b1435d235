"""Pictures of what `mkport diff --json` and `mkport bench-tts --json` report (the --plot options).

Each function takes the JSON dict, returns the numbers it draws (so tests check the data path, not pixels)
and writes a PNG when given a path. matplotlib (Agg, no display) is imported only when drawing.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import MkportError

DPI = 100
# error / tolerance colour scale: 1 (the tolerance) in the middle, a factor 100 either side
RATIO_RANGE = (1e-2, 1e2)


def check_plot_path(path: Path, png: bool = True) -> None:
    """Before any work: --plot writes into a folder that exists, a PNG (`png`) or any format matplotlib writes."""
    if png and path.suffix.lower() != ".png":
        raise MkportError(f"--plot {path}: the picture is written as PNG; give a file name ending in .png")
    if not path.parent.is_dir():
        raise MkportError(f"--plot {path}: folder '{path.parent}' does not exist")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MkportError("--plot needs matplotlib: pip install matplotlib") from None
    return plt


def _save(fig, path) -> tuple[int, int]:
    fig.savefig(path, dpi=DPI)
    width, height = fig.get_size_inches() * DPI
    return round(width), round(height)


# -- mkport diff ----------------------------------------------------------------------------------------
@dataclass
class Heatmap:
    rows: list[str]  # layers down: "in" (states before layer 0), 0, 1, ..., "out" (after the last layer)
    ops: list[str]  # traced ops across, in schedule order
    ratio: np.ndarray  # [rows, ops] rel_l2 / tol; NaN where the op is not traced in that row
    marked: tuple[int, int] | None  # (row, op) of the first state out of tolerance
    size_px: tuple[int, int] | None = None  # of the PNG written


def diff_heatmap(report: dict, path=None) -> Heatmap:
    """Error over tolerance of every traced state of a `mkport diff --json` report."""
    rows, ops, cells, row_of = [], [], {}, {}
    seen_layer = False
    for r in report["rows"]:
        if r["layer"] is None:
            row = "out" if seen_layer else "in"
        else:
            row, seen_layer = str(r["layer"]), True
        if row not in rows:
            rows.append(row)
        row_of[r["layer"], r["op"]] = row
        if r["op"] not in ops:
            ops.append(r["op"])
        cells[row, r["op"]] = float(r["rel_l2"]) / float(r["tol"])  # rel_l2 may be "inf" / "nan" (JSON)
    ratio = np.full((len(rows), len(ops)), np.nan)
    for (row, op), value in cells.items():
        ratio[rows.index(row), ops.index(op)] = value
    marked = None
    if (bad := report["first_failure"]) is not None:
        marked = (rows.index(row_of[bad["layer"], bad["op"]]), ops.index(bad["op"]))
    heatmap = Heatmap(rows, ops, ratio, marked)
    if path is not None:
        heatmap.size_px = _draw_heatmap(heatmap, report, path)
    return heatmap


def _draw_heatmap(heatmap: Heatmap, report: dict, path) -> tuple[int, int]:
    plt = _pyplot()
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    n_rows, n_ops = heatmap.ratio.shape
    fig, ax = plt.subplots(figsize=(8, 2.6 + 0.2 * n_rows))
    low, high = RATIO_RANGE
    shown = np.ma.masked_invalid(np.clip(heatmap.ratio, low, high))  # zero error shows at the low end
    cmap = plt.get_cmap("coolwarm").with_extremes(bad="white")  # white: an op not traced in that row
    image = ax.imshow(shown, cmap=cmap, norm=LogNorm(low, high), aspect="auto", interpolation="nearest")
    bar = fig.colorbar(image, ax=ax, extend="both")
    bar.set_label("rel L2 / tol  (1 = tolerance)")
    ax.set_xticks(range(n_ops), heatmap.ops, rotation=40, ha="right")
    ax.set_yticks(range(n_rows), heatmap.rows, fontsize=7 if n_rows > 40 else 8)
    ax.set_xlabel("traced op")
    ax.set_ylabel("layer")
    if heatmap.marked is not None:
        row, op = heatmap.marked
        ax.add_patch(Rectangle((op - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2.5))
        ax.annotate("first out of tolerance", (op, row), xytext=(op + 0.7 if op < n_ops / 2 else op - 0.7, row),
                    ha="left" if op < n_ops / 2 else "right", va="center", fontsize=9, fontweight="bold")
    title = f"{report.get('spec', 'mkport diff')}: {report['verdict']}"
    ax.set_title(textwrap.fill(title, 80), fontsize=10)
    policy = report["policy"]
    caption = (f"tolerance: rel L2 <= {policy['rel_l2_base']:g} x (1 + {policy['depth_growth']:g} x depth) "
               f"(depth: layer index; embed 0; final_norm, logits: number of layers); "
               f"min cosine >= 1 - ({policy['cosine_factor']:g} tol)^2 / 2. White: not traced.")
    fig.text(0.5, 0.01, textwrap.fill(caption, 110), ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    size = _save(fig, path)
    plt.close(fig)
    return size


# -- mkport bench-tts -----------------------------------------------------------------------------------
@dataclass
class Timeline:
    bars: dict[str, list[tuple[float, float]]]  # lane -> (start s, end s) since the request started
    written_t: list[float]  # when each chunk reached the host (s)
    written_audio: list[float]  # audio seconds written by then
    played_t: list[float]  # playback clock: starts at the first chunk, waits when the audio runs dry
    played_audio: list[float]
    stalls: list[tuple[float, float]] = field(default_factory=list)  # (ran dry, next chunk) in s
    size_px: tuple[int, int] | None = None


def _playback(arrivals: list[float], lengths: list[float]):
    """Position of a player that starts at the first chunk and plays in real time, waiting for the next chunk
    whenever it has played all written audio: (times, positions, stalls)."""
    t, pos, written = arrivals[0], 0.0, lengths[0]
    times, positions, stalls = [t], [pos], []
    for arrival, length in zip(arrivals[1:], lengths[1:]):
        if pos + (arrival - t) <= written:
            pos += arrival - t
        else:
            dry = t + (written - pos)
            times.append(dry), positions.append(written)
            stalls.append((dry, arrival))
            pos = written
        t = arrival
        times.append(t), positions.append(pos)
        written += length
    times.append(t + (written - pos)), positions.append(written)
    return times, positions, stalls


def _mkport_run(result: dict) -> dict:
    run = next((r for r in result["results"] if r["engine"] == "mkport"), None)
    if run is None or "error" in run:
        raise MkportError("--plot draws mkport's request: the result has no timed mkport run"
                          + (f" ({run['error']})" if run else " (add mkport to --engines)"))
    if "frame_end_ms" not in run:
        raise MkportError("--plot: this mkport run has no timeline (frame_end_ms); it was made by an older mkport")
    return run


def tts_timeline(result: dict, path=None) -> Timeline:
    """mkport's request of a `mkport bench-tts --json` result as a timeline."""
    run = _mkport_run(result)
    frame_ms = ([run["first_frame_ms"]] if run["first_frame_ms"] is not None else []) + run["frame_ms"]
    bars = {
        "set-up": [(0.0, run["setup_ms"] / 1e3)],
        "frames": [((end - d) / 1e3, end / 1e3) for end, d in zip(run["frame_end_ms"], frame_ms)],
        "codec": [((end - d) / 1e3, end / 1e3) for end, d in zip(run["chunk_end_ms"], run["codec_ms"])],
    }
    arrivals = [end / 1e3 for end in run["chunk_end_ms"]]
    lengths = [n / run["sample_rate"] for n in run["chunk_samples"]]
    played_t, played_audio, stalls = _playback(arrivals, lengths)
    timeline = Timeline(bars, arrivals, list(np.cumsum(lengths)), played_t, played_audio, stalls)
    if path is not None:
        timeline.size_px = _draw_timeline(timeline, result, run, path)
    return timeline


def _draw_timeline(timeline: Timeline, result: dict, run: dict, path) -> tuple[int, int]:
    plt = _pyplot()
    fig, (lanes, audio) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=(1, 2))
    colours = {"set-up": "tab:gray", "frames": "tab:blue", "codec": "tab:orange"}
    names = list(timeline.bars)
    for y, name in enumerate(names):
        spans = [(start, end - start) for start, end in timeline.bars[name]]
        # white edges part the frames; a short codec call would vanish under them
        lanes.broken_barh(spans, (y - 0.35, 0.7), facecolors=colours[name],
                          edgecolor="white" if name == "frames" else "none", linewidth=0.5)
    first = timeline.bars["frames"][:1]
    if first:  # frame 0 carries the prompt's prefill
        lanes.broken_barh([(first[0][0], first[0][1] - first[0][0])], (names.index("frames") - 0.35, 0.7),
                          facecolors="tab:purple", edgecolor="white", linewidth=0.5)
        lanes.annotate("prefill + frame 0", (first[0][0], names.index("frames") - 0.4), fontsize=8, va="bottom")
    setup_end = timeline.bars["set-up"][0][1]
    lanes.annotate(f"{setup_end * 1e3:.1f} ms", (setup_end, names.index("set-up")), xytext=(4, 0),
                   textcoords="offset points", fontsize=8, va="center")
    lanes.set_yticks(range(len(names)), names)
    lanes.set_ylim(len(names) - 0.5, -0.5)
    lanes.set_title("what ran when", fontsize=10, loc="left")

    audio.step(timeline.written_t, timeline.written_audio, where="post", color="tab:green", label="audio written")
    audio.plot(timeline.played_t, timeline.played_audio, color="black", label="playback position")
    for i, (start, end) in enumerate(timeline.stalls):
        audio.axvspan(start, end, color="tab:red", alpha=0.25, label="stall (audio ran dry)" if i == 0 else None)
    audio.set_xlabel("wall time since the request (s)")
    audio.set_ylabel("audio (s)")
    audio.legend(loc="upper left", fontsize=8)
    audio.grid(alpha=0.3)

    gpu = result["environment"].get("gpu") or "CPU"
    rtf = "-" if run["rtf"] is None else f"{run['rtf']:.2f}"
    fig.suptitle(f"mkport request on {gpu} ({run['backend']} backend): {run['frames']} frames, "
                 f"{run['audio_s']:.2f} s audio, first chunk {run['first_chunk_ms']:.0f} ms, RTF {rtf}, "
                 f"{len(timeline.stalls)} stalls", fontsize=10)
    fig.tight_layout()
    size = _save(fig, path)
    plt.close(fig)
    return size
