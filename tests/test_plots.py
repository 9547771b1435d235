"""The --plot pictures of diff and bench-tts: the numbers drawn are the JSON's numbers (the data path, not the
pixels), the PNG is written at its size, and a bad --plot path is one error line before any work."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from mkport.check.diff import DiffReport, DiffRow, tolerance
from mkport.bench.plots import diff_heatmap, tts_timeline

LAYERS = 3
OPS = ("attn_norm", "q", "attn", "mlp_residual")


def png_size(path) -> tuple[int, int]:
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", raw[16:24])


def diff_json(fail_at=()) -> dict:
    """What `mkport diff --json` writes for a 3-layer report (through JSON: inf becomes "inf"), with rows
    `fail_at` out of tolerance."""
    gen = np.random.default_rng(0)
    rows = [DiffRow(None, "embed", 0.0, 0.0, 1.0, tolerance(0), True)]
    for layer in range(LAYERS):
        for op in OPS:
            bad = (layer, op) in fail_at
            rel = math.inf if bad and op == "attn" else float(gen.uniform(1e-4, 1e-2)) * (30 if bad else 1)
            rows.append(DiffRow(layer, op, rel, rel, 0.99, tolerance(layer), not bad))
    rows += [DiffRow(None, op, 1e-3, 2e-3, 0.99, tolerance(LAYERS), True) for op in ("final_norm", "logits")]
    return json.loads(json.dumps({"spec": "test-3l", **DiffReport(rows, steps=4).to_dict()}))


@pytest.mark.parametrize("fail_at", [(), ((1, "q"), (2, "attn")), ((0, "attn"),)])
def test_heatmap_is_rel_l2_over_tol_with_the_first_failure_marked(tmp_path, fail_at):
    report = diff_json(fail_at)
    path = tmp_path / "diff.png"
    heat = diff_heatmap(report, path)
    assert heat.rows == ["in", "0", "1", "2", "out"]
    assert heat.ops == ["embed", *OPS, "final_norm", "logits"]
    expected = {}
    for r in report["rows"]:
        row = {None: "in" if r["op"] == "embed" else "out"}.get(r["layer"], str(r["layer"]))
        expected[heat.rows.index(row), heat.ops.index(r["op"])] = float(r["rel_l2"]) / r["tol"]
    assert len(expected) == len(report["rows"])  # every (layer, op) its own cell
    for (i, j), value in np.ndenumerate(heat.ratio):
        if (i, j) in expected:
            assert value == expected[i, j]
        else:
            assert np.isnan(value)  # an op not traced in that row
    if fail_at:
        first = report["first_failure"]
        assert (first["layer"], first["op"]) == fail_at[0]
        assert heat.marked == (heat.rows.index(str(fail_at[0][0])), heat.ops.index(fail_at[0][1]))
        assert heat.ratio[heat.marked] > 1
    else:
        assert report["first_failure"] is None and heat.marked is None
    assert png_size(path) == heat.size_px and heat.size_px[0] == 800


def test_heatmap_marks_a_failure_outside_the_layers():
    report = diff_json()
    report["first_failure"] = {"layer": None, "op": "logits"}
    heat = diff_heatmap(report)
    assert heat.marked == (4, heat.ops.index("logits")) and heat.size_px is None  # no path: nothing drawn


def bench_json(frame_ms, codec_ms, chunk_frames, gap_ms=0.0) -> dict:
    """A bench-tts result for mkport's request: frames back to back, a codec call after the frames of each
    chunk, `gap_ms` of other work after each codec call."""
    t, frame_end, chunk_end, samples = 2.0, [], [], []
    chunk_ends_after = np.cumsum(chunk_frames)
    for i, d in enumerate(frame_ms):
        t += d
        frame_end.append(t)
        if i + 1 in chunk_ends_after:
            k = len(chunk_end)
            t += codec_ms[k]
            chunk_end.append(t)
            samples.append(1920 * chunk_frames[k])
            t += gap_ms
    run = dict(engine="mkport", first_chunk_ms=chunk_end[0], first_frame_ms=frame_ms[0], frame_ms=frame_ms[1:],
               setup_ms=2.0, codec_ms=codec_ms, frame_end_ms=frame_end, chunk_end_ms=chunk_end,
               chunk_samples=samples, sample_rate=24000, frames=len(frame_ms), audio_s=sum(samples) / 24000,
               rtf=t / 1e3 / (sum(samples) / 24000), backend="reference")
    return {"environment": {"gpu": None}, "results": [run]}


def test_timeline_bars_and_curves_come_from_the_json(tmp_path):
    frame_ms = [50.0] + [10.0] * 9
    result = bench_json(frame_ms, codec_ms=[5.0, 6.0, 7.0], chunk_frames=[1, 3, 6])
    run = result["results"][0]
    path = tmp_path / "timeline.png"
    line = tts_timeline(result, path)
    assert line.bars["set-up"] == [(0.0, 0.002)]
    ends = np.array(run["frame_end_ms"]) / 1e3
    assert np.allclose([b for _, b in line.bars["frames"]], ends)
    assert np.allclose([b - a for a, b in line.bars["frames"]], np.array(frame_ms) / 1e3)
    assert np.allclose([a for a, _ in line.bars["codec"]], ends[[0, 3, 9]])  # each right after its chunk's frames
    assert np.allclose(line.written_t, np.array(run["chunk_end_ms"]) / 1e3)
    assert np.allclose(line.written_audio, np.cumsum(run["chunk_samples"]) / 24000)
    # 80 ms of audio a frame, made at 10 ms a frame: playback starts with the first chunk and never waits
    assert line.stalls == [] and line.played_t[0] == line.written_t[0] and line.played_audio[0] == 0
    assert np.allclose(np.diff(line.played_audio), np.diff(line.played_t))
    assert line.played_audio[-1] == pytest.approx(run["audio_s"])
    assert png_size(path) == line.size_px == (900, 600)


def test_timeline_shows_where_the_audio_ran_dry():
    """Frames slower than real time: each chunk's audio is played out before the next one is written."""
    result = bench_json([100.0] * 6, codec_ms=[10.0, 10.0, 10.0], chunk_frames=[1, 2, 3])
    line = tts_timeline(result)
    arrivals = line.written_t
    # chunk 0 (80 ms of audio) runs dry 80 ms after it arrived, until chunk 1 arrives; likewise chunk 1 (160 ms)
    assert line.stalls == [pytest.approx((arrivals[0] + 0.08, arrivals[1])),
                           pytest.approx((arrivals[1] + 0.16, arrivals[2]))]
    assert all(b - a > 0 for a, b in line.stalls)
    for t, pos in zip(line.played_t, line.played_audio):  # never plays audio not yet written
        written = line.written_audio[np.searchsorted(arrivals, t + 1e-12, side="right") - 1]
        assert pos <= written + 1e-12


def test_timeline_of_a_real_cpu_request(tmp_path, monkeypatch):
    """bench-tts's mkport run on CPU (tiny random model, reference backend) records a consistent timeline."""
    from mkport.tts.bench_tts import run_tts_bench
    from mkport.tts.model import write_random_tts_model

    folder = tmp_path / "tiny"
    write_random_tts_model(folder, "tiny", seed=0)
    result = json.loads(json.dumps(run_tts_bench(folder, "Hello there.", 5, 0, ("mkport",), device="cpu",
                                                 mkport_backend="reference")))
    run = result["results"][0]
    assert "error" not in run, run
    line = tts_timeline(result, tmp_path / "t.png")
    assert len(line.bars["frames"]) == run["frames"] == 5 and len(line.bars["codec"]) == len(run["chunk_samples"])
    starts = [a for a, _ in line.bars["frames"]]
    assert starts[0] >= line.bars["set-up"][0][1] and starts == sorted(starts)
    assert line.written_audio[-1] == pytest.approx(run["audio_s"]) and run["audio_s"] == 5 * 1920 / 24000
    assert line.written_t[0] * 1e3 <= run["first_chunk_ms"]  # measured inside the call vs. by the caller
    assert png_size(tmp_path / "t.png") == line.size_px


def test_timeline_needs_mkports_run():
    with pytest.raises(Exception, match="mkport"):
        tts_timeline({"environment": {}, "results": [{"engine": "official", "error": "not available"}]})


def cli(*args):
    env = dict(os.environ, COLUMNS="400", NO_COLOR="1", TERM="dumb")
    return subprocess.run([sys.executable, "-m", "mkport.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("command", [["diff", "qwen3-0.6b", "--random-weights"],
                                     ["bench-tts", "--random-weights", "tiny"]])
@pytest.mark.parametrize("plot, message", [("no/such/folder/x.png", "folder 'no/such/folder' does not exist"),
                                           ("picture.jpg", "give a file name ending in .png")])
def test_bad_plot_path_is_one_error_line(tmp_path, command, plot, message):
    proc = cli(*command, "--plot", str(plot))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: --plot") and message in proc.stderr, proc.stderr


def test_bench_tts_plot_needs_mkport_among_the_engines(tmp_path):
    proc = cli("bench-tts", "--random-weights", "tiny", "--engines", "official", "--plot", str(tmp_path / "t.png"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--plot draws mkport's request: add mkport to --engines" in proc.stderr


def test_diff_and_bench_tts_write_the_plot_of_their_json(tmp_path, monkeypatch):
    """The commands' --plot draws what their --json writes (GPU work replaced by canned results)."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    import mkport.cli as cli
    import mkport.cli.options
    import mkport.check.diff
    import mkport.runtime.decoder
    import mkport.tts.bench_tts
    import mkport.tts.model

    runner = CliRunner()
    monkeypatch.setattr(mkport.runtime.decoder, "require_gpu", lambda spec=None: None)
    monkeypatch.setattr(mkport.cli.options.LlmModel, "checkpoint", lambda self: tmp_path)
    report = DiffReport([DiffRow(layer, op, 1e-3, 2e-3 * (layer + 1), 0.99, 1e-2, layer < 1)
                         for layer in range(2) for op in OPS], steps=8)
    fake = SimpleNamespace(report=report, token_agreement=8, positions="equal", caught_injection=None,
                           to_dict=report.to_dict)
    monkeypatch.setattr(mkport.check.diff, "kernel_diff", lambda *args, **kwargs: fake)
    result = runner.invoke(cli.app, ["diff", "qwen3-0.6b", "--random-weights", "--json", str(tmp_path / "d.json"),
                                     "--plot", str(tmp_path / "d.png")])
    assert result.exit_code == 1, result.output  # layer 1 is out of tolerance
    heat = diff_heatmap(json.loads((tmp_path / "d.json").read_text()))
    assert heat.marked == (heat.rows.index("1"), heat.ops.index(OPS[0]))
    assert png_size(tmp_path / "d.png")[0] == 800

    canned = bench_json([50.0] + [10.0] * 3, codec_ms=[5.0, 6.0], chunk_frames=[1, 3])
    canned["results"][0].update(first_chunk_frames=1, streamed=True, frame_median_ms=10.0, frame_p10_ms=10.0,
                                frame_p90_ms=10.0, frame_method="each frame")
    canned.update(folder=str(tmp_path), speaker="vivian", environment={"gpu": "NVIDIA H200"})
    monkeypatch.setattr(mkport.tts.model, "random_model_folder", lambda which, seed=0: tmp_path)
    monkeypatch.setattr(mkport.tts.bench_tts, "run_tts_bench", lambda *args, **kwargs: canned)
    result = runner.invoke(cli.app, ["bench-tts", "--random-weights", "0.6b", "--plot", str(tmp_path / "t.png")])
    assert result.exit_code == 0, result.output
    assert png_size(tmp_path / "t.png") == (900, 600)
