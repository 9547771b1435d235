"""The command line: listing specs, rendering, and bad input ending in one `error:` line with exit code 2.

Error cases run `python -m mkport.cli` in a subprocess: the console script's entry point (main) is what turns
an MkportError into the one-line message, and CliRunner would call the Typer app without it."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from mkport.cli import app
from mkport.errors import MkportError
from mkport.kernel.spec import _bundled_path, bundled_names, load_spec

runner = CliRunner()


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="400", NO_COLOR="1", TERM="dumb")
    return subprocess.run(
        [sys.executable, "-m", "mkport.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_specs_table():
    result = runner.invoke(app, ["specs"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    for name in bundled_names():
        assert name in result.output
    assert "887" in result.output  # the 0.6B talker's MB/step


def test_specs_json():
    result = runner.invoke(app, ["specs", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [d["name"] for d in data] == bundled_names()
    for d in data:
        spec = load_spec(d["name"])
        assert d["weight_bytes_per_step"] == spec.weight_bytes_per_step()
        assert d["hidden_size"] == spec.hidden_size and d["rope"]["variant"] == spec.rope.variant


def test_specs_subprocess():
    proc = run("specs")
    assert proc.returncode == 0 and proc.stderr == ""
    for name in bundled_names():
        assert name in proc.stdout


def test_no_args_shows_help():
    proc = run()
    assert "generate" in proc.stdout + proc.stderr and "specs" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_generate_renders_without_check(tmp_path):
    result = runner.invoke(
        app, ["generate", "qwen3-0.6b", "--arch", "sm_80", "--arch", "sm_120", "--out", str(tmp_path), "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["spec"] == "qwen3-0.6b" and [r["arch"] for r in data["results"]] == ["sm_80", "sm_120"]
    for r in data["results"]:
        out = Path(r["dir"])
        assert out.parent == tmp_path and "check" not in r
        assert json.loads((out / "plan.json").read_text())["arch"] == r["arch"]
        assert (out / "decode_step.cu").is_file()


def test_generate_a_batch_kernel(tmp_path):
    """--batch renders the batch decoder's kernel (its plan says so); a batch that does not fit is one line."""
    result = runner.invoke(app, ["generate", "qwen3-tts-0.6b-talker", "--batch", "8", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    out = Path(json.loads(result.stdout)["results"][0]["dir"])
    assert json.loads((out / "plan.json").read_text())["batch"] == 8
    assert "constexpr int BATCH = 8;" in (out / "constants.cuh").read_text()
    refused = runner.invoke(app, ["generate", "qwen3-tts-1.7b-talker", "--batch", "32", "--out", str(tmp_path)])
    assert "batch up to 24 fits" in str(refused.exception)


def test_generate_from_folder_with_part(tmp_path):
    folder = tmp_path / "Qwen3-TTS"
    folder.mkdir()
    (folder / "config.json").write_text(_bundled_path("qwen3-tts-12hz-0.6b-customvoice.json").read_text())
    proc = run("generate", f"{folder}:talker", "--out", str(tmp_path / "gen"))
    assert proc.returncode == 0, proc.stderr
    assert "Qwen3-TTS-talker" in proc.stdout and "rendered" in proc.stdout
    (out,) = (tmp_path / "gen").iterdir()
    assert out.name.startswith("Qwen3-TTS-talker-")


def _moe_config(tmp_path: Path) -> Path:
    cfg = json.loads(_bundled_path("qwen3-0.6b.json").read_text())
    cfg.update(num_experts=128, num_experts_per_tok=8)
    path = tmp_path / "moe" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    return path


def _deep_config(tmp_path: Path) -> Path:
    cfg = json.loads(_bundled_path("qwen3-0.6b.json").read_text())
    cfg.update(num_hidden_layers=10**9)  # rendering it hung
    path = tmp_path / "deep" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    return path


def _not_json(tmp_path: Path) -> Path:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    return path


def _tts_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "tts"
    folder.mkdir()
    (folder / "config.json").write_text(_bundled_path("qwen3-tts-12hz-0.6b-customvoice.json").read_text())
    return folder


BAD = {
    "unknown_model": (lambda tmp: ["generate", "no-such-model"], "unknown model 'no-such-model'"),
    "empty_model": (lambda tmp: ["generate", ""], "MODEL is empty: give a bundled spec name (mkport specs)"),
    "missing_config": (lambda tmp: ["generate", str(tmp / "nowhere" / "config.json")], "no such file or folder: "),
    "folder_without_config": (lambda tmp: ["generate", str(tmp)], "has no config.json"),
    "unsupported_field": (lambda tmp: ["generate", str(_moe_config(tmp))], "num_experts=128"),
    "not_json": (lambda tmp: ["generate", str(_not_json(tmp))], "not valid JSON"),
    "too_many_layers": (lambda tmp: ["generate", str(_deep_config(tmp))],
                        "num_hidden_layers=1000000000 is not supported; supported: 1 to 256"),
    "tts_without_part": (lambda tmp: ["generate", str(_tts_folder(tmp))], "MODEL:talker"),
    "tts_unknown_part": (lambda tmp: ["generate", f"{_tts_folder(tmp)}:decoder"],
                         "tts:decoder: model part 'decoder' is not supported; supported: talker, code_predictor"),
    "bad_arch": (lambda tmp: ["generate", "qwen3-0.6b", "--arch", "sm_70"], "arch 'sm_70' is not supported"),
    "bad_arch_check": (
        lambda tmp: ["generate", "qwen3-0.6b", "--arch", "sm_7x", "--arch", "sm_90", "--check"],
        "arch 'sm_7x'",
    ),
    "bad_arch_after_good": (  # every --arch is checked before anything is rendered or compiled
        lambda tmp: ["generate", "qwen3-0.6b", "--arch", "sm_90", "--arch", "sm_7x", "--check"],
        "arch 'sm_7x'",
    ),
    "bad_arch_in_a_list": (lambda tmp: ["generate", "qwen3-0.6b", "--arch", "sm_90,sm_7x"], "arch 'sm_7x'"),
    "empty_arch_in_a_list": (lambda tmp: ["generate", "qwen3-0.6b", "--arch", "sm_90,"], "--arch 'sm_90,': an empty item"),
    "kernel_v2": (lambda tmp: ["generate", "qwen3-0.6b", "--kernel", "v2"],
                  "--kernel v2: kernel v2 was removed (slower than v5 in every measurement"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_one_error_line(tmp_path, case):
    make_args, fragment = BAD[case]
    proc = run(*make_args(tmp_path), "--out", str(tmp_path / "gen"), cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:"), proc.stderr
    assert fragment in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_usage_error_exit_code():
    proc = run("generate")  # missing MODEL: Typer's own usage error, also exit code 2
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    proc = run("no-such-command")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_console_script_entry_point():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "mkport"]
    assert ep.value == "mkport.cli:main"


GPU_COMMANDS_BAD = {
    "diff_bad_inject": (["diff", "qwen3-0.6b", "--random-weights", "--inject", "99:q"], "--inject must be LAYER:OP"),
    "diff_bad_op": (["diff", "qwen3-0.6b", "--random-weights", "--inject", "3:mlp"], "--inject must be LAYER:OP"),
    "bench_bad_contexts": (["bench", "qwen3-0.6b", "--random-weights", "--contexts", "12a"], "--contexts '12a'"),
    "bench_bad_engine": (["bench", "qwen3-0.6b", "--random-weights", "--engines", "megakernel,vllm"],
                         "--engines: unknown vllm; supported: megakernel, hf_graph, hf_eager"),
    "bench_bad_kernel": (["bench", "qwen3-0.6b", "--random-weights", "--kernel", "v20,v9"],
                         "--kernel: unknown v9; supported: v20"),
    "diff_bad_kernel": (["diff", "qwen3-0.6b", "--random-weights", "--kernel", "v9"], "--kernel: unknown v9"),
    "diff_kernel_v2": (["diff", "qwen3-0.6b", "--random-weights", "--kernel", "v2"],
                       "--kernel v2: kernel v2 was removed (slower than v5 in every measurement; docs/benchmarks.md"),
    "bench_kernel_v2": (["bench", "qwen3-0.6b", "--random-weights", "--kernel", "v20,v2"], "kernel v2 was removed"),
    "diff_unknown_model": (["diff", "no-such-model", "--random-weights"], "unknown model 'no-such-model'"),
    # lengths are checked before the GPU (and before random weights are written)
    "diff_negative_steps": (["diff", "qwen3-0.6b", "--random-weights", "--steps", "-1"],
                            "--prompt-len 16 and --steps -1 must both be at least 1"),
    "diff_prompt_past_max_position": (["diff", "qwen3-0.6b", "--random-weights", "--prompt-len", "100000000"],
                                      "need 100000008 positions, past the model's 40960 positions (max_position_embeddings)"),
    "bench_zero_steps": (["bench", "qwen3-0.6b", "--random-weights", "--steps", "0"], "--steps >= 1"),
    "bench_context_past_max_position": (["bench", "qwen3-0.6b", "--random-weights", "--contexts", "100000"],
                                        "context 100000 plus 111 timed steps passes the model's 40960 positions (max_position_embeddings)"),
    # a report's file is checked before the run, which could take minutes, not written into nowhere after it
    "diff_json_nowhere": (["diff", "qwen3-0.6b", "--random-weights", "--json", "/nonexistent/r.json"],
                          "--json /nonexistent/r.json: the folder /nonexistent does not exist"),
    "bench_json_nowhere": (["bench", "qwen3-0.6b", "--random-weights", "--json", "/nonexistent/r.json"],
                           "--json /nonexistent/r.json: the folder /nonexistent does not exist"),
    "bench_json_a_folder": (["bench", "qwen3-0.6b", "--random-weights", "--json", "/tmp"],
                            "--json /tmp is a folder: give a file name"),
    "bench_plot_nowhere": (["bench", "qwen3-0.6b", "--random-weights", "--plot", "/nonexistent/p.png"],
                           "--plot /nonexistent/p.png: folder '/nonexistent' does not exist"),
    "bench_tts_json_nowhere": (["bench-tts", "--random-weights", "tiny", "--json", "/nonexistent/r.json"],
                               "--json /nonexistent/r.json: the folder /nonexistent does not exist"),
}


@pytest.mark.parametrize("case", list(GPU_COMMANDS_BAD))
def test_gpu_commands_reject_bad_input_before_needing_a_gpu(tmp_path, case):
    args, fragment = GPU_COMMANDS_BAD[case]
    proc = run(*args, cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], proc.stderr
    assert not (tmp_path / "generated").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("command", ["diff", "bench"])
def test_gpu_commands_without_gpu_say_so(tmp_path, command):
    proc = run(command, "qwen3-tts-0.6b-code-predictor", "--random-weights", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: no CUDA GPU is visible: this command runs the megakernel (generate --check needs none)"


# ---------------------------------------------------------------------------------------------------
# Tables: names whole at 80 columns and in pipes

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def terminal(monkeypatch, width: int = 80) -> io.StringIO:
    """The tables' console (mkport.cli.table.out) as a terminal `width` columns wide; returns what it prints."""
    import mkport.cli.table

    buf = io.StringIO()
    monkeypatch.setattr(mkport.cli.table, "out", Console(file=buf, width=width, force_terminal=True, color_system=None))
    return buf


def test_specs_in_a_pipe_keeps_every_name_and_column():
    env = dict(os.environ, COLUMNS="80", NO_COLOR="1", TERM="dumb")
    proc = subprocess.run([sys.executable, "-m", "mkport.cli", "specs"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name in bundled_names():
        assert any(f"│ {name} " in line for line in lines), proc.stdout
    for header in ("family", "q/kv heads", "head_dim", "vocab", "rope", "MB/step"):
        assert header in proc.stdout
    assert "…" not in proc.stdout and "mrope (interleaved)" in proc.stdout


def test_specs_on_an_80_column_terminal():
    """On a real terminal (a pty) of 80 columns: names whole, no line wider, and a line says what was left out."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 80, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([sys.executable, "-m", "mkport.cli", "specs"], stdout=slave, stderr=subprocess.PIPE,
                            env=dict(env, TERM="xterm"))
    os.close(slave)
    seen = b""
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:
            break
        if not data:
            break
        seen += data
    os.close(master)
    assert proc.wait(timeout=120) == 0
    text = ANSI.sub("", seen.decode()).replace("\r", "")
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for name in bundled_names():
        assert f"│ {name} " in text, text
    assert "not shown at 80 columns: rope" in text and "…" not in text


def test_generate_table_at_80_columns_keeps_archs_and_paths(tmp_path, monkeypatch):
    buf = terminal(monkeypatch)
    deep = tmp_path / ("a-rather-long-folder-name-" * 3)
    result = runner.invoke(app, ["generate", "qwen3-tts-0.6b-code-predictor", "--arch", "sm_90,sm_120", "--out", str(deep)])
    assert result.exit_code == 0, result.output
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "│ sm_90 " in text and "│ sm_120 " in text
    folded = "".join(line.split("│")[2].strip() for line in text.splitlines() if line.count("│") > 3)
    for out in deep.iterdir():  # each sources path is whole, folded over lines
        assert str(out) in folded, text


def _canned_bench() -> dict:
    row = dict(context=128, median_us=770.0, p10_us=760.0, p90_us=790.0, tokens_per_s=1298.0, ttft_ms=5.5,
               floor_fraction=0.27)
    return {
        "environment": {"gpu": "NVIDIA H200"},
        "results": [dict(row, engine="megakernel"), dict(row, engine="hf_graph", megakernel_speedup=5.7),
                    {"engine": "hf_eager", "context": 128, "error": "out of memory while timing this engine at 128"}],
        "floor_us": 210.0, "weight_bytes_per_step": 887e6, "copy_bandwidth_bytes_per_s": 4.25e12, "phases": None,
    }


def test_bench_lists_and_table(tmp_path, monkeypatch):
    """--contexts, --engines and --batch take comma lists, repeats, or both; the table keeps engine names at 80
    columns."""
    import mkport.bench.decode
    import mkport.cli.options
    import mkport.runtime.decoder

    asked = {}

    def fake_run_bench(source, checkpoint, contexts, steps, prompt_len, engines, phases, progress, kernels, batches):
        asked.update(contexts=contexts, engines=engines, kernels=kernels, batches=batches)
        return _canned_bench()

    monkeypatch.setattr(mkport.runtime.decoder, "require_gpu", lambda spec=None: None)
    monkeypatch.setattr(mkport.cli.options.LlmModel, "checkpoint", lambda self: tmp_path)
    monkeypatch.setattr(mkport.bench.decode, "run_bench", fake_run_bench)
    buf = terminal(monkeypatch)
    result = runner.invoke(app, ["bench", "qwen3-0.6b", "--random-weights", "--contexts", "128,512", "--contexts", "2048",
                                 "--engines", "megakernel", "--engines", "hf_graph,hf_eager", "--kernel", "v20",
                                 "--batch", "1,8", "--batch", "16"])
    assert result.exit_code == 0, result.output
    assert asked == {"contexts": [128, 512, 2048], "engines": ("megakernel", "hf_graph", "hf_eager"),
                     "kernels": ("v20",), "batches": (1, 8, 16)}
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for engine in ("megakernel", "hf_graph", "hf_eager"):
        assert f"│ {engine} " in text, text
    error_cells = [line.split("│")[3].strip() for line in text.splitlines() if line.count("│") > 3]
    assert "out of memory while timing this engine at 128" in " ".join(c for c in error_cells if c)  # wrapped, whole
    refused = runner.invoke(app, ["bench", "qwen3-0.6b", "--random-weights", "--batch", "3"])
    assert "--batch 3: supported batch sizes are 1, 2, 4, 8, 16, 24, 32" in str(refused.exception)


def test_bench_floor_is_the_chosen_experts_with_all_beside_it():
    """An MoE step's floor reads the experts it chose; the all-experts size is reported beside it, in the JSON and in
    one line of text. A dense spec gets neither."""
    from mkport.bench.decode import bandwidth_floor
    from mkport.cli.bench import floor_lines

    spec = load_spec("mixtral-8x7b")
    floor = bandwidth_floor(spec, 4e12)
    step, every = spec.weight_bytes_per_step(), spec.weight_bytes_per_step(all_experts=True)
    assert floor == {"weight_bytes_per_step": step, "floor_us": pytest.approx(step / 4e6),
                     "weight_bytes_all_experts": every, "floor_all_experts_us": pytest.approx(every / 4e6)}
    assert floor["weight_bytes_all_experts"] > 3 * floor["weight_bytes_per_step"]  # 8 experts, 2 chosen
    lines = floor_lines(dict(floor, copy_bandwidth_bytes_per_s=4e12))
    assert lines == ["bandwidth floor 6374.4 us: 25498 MB a step at 4.00 TB/s (device copy, measured in this run)",
                     "all experts: 93143 MB, 23285.9 us at 4.00 TB/s (the floor above reads the chosen ones)"]
    dense = bandwidth_floor(load_spec("qwen3-0.6b"), 4e12)
    assert set(dense) == {"weight_bytes_per_step", "floor_us"}
    assert len(floor_lines(dict(dense, copy_bandwidth_bytes_per_s=4e12))) == 1


def test_bench_floor_of_a_moe_batch_is_the_union_it_read():
    """A batch row of a mixture of experts: its floor is the bytes the step read, each sparse layer's union of its
    sequences' experts (Decoder.experts_read, added up over the timed steps), not batch 1's top-k; a line under the
    table says so. Qwen3-30B-A3B: 8 of 128 experts a token; a union of 52 reads 44 more experts' rows a layer."""
    from mkport.bench.decode import union_bytes
    from mkport.cli.bench import floor_lines

    spec = load_spec("qwen3-30b-a3b")
    steps, layers = 10, spec.num_layers
    read, mean = union_bytes(spec, [52 * steps] * layers, steps)
    expert = 3 * spec.hidden_size * spec.moe.expert_intermediate_size * 2
    assert mean == 52 and read == spec.weight_bytes_per_step() + layers * 44 * expert
    assert union_bytes(spec, [8 * steps] * layers, steps)[0] == spec.weight_bytes_per_step()
    row = {"engine": "megakernel-v16-b8", "context": 128, "weight_bytes_per_step": read, "experts_read": mean}
    floor = dict(weight_bytes_per_step=spec.weight_bytes_per_step(), floor_us=1.0, copy_bandwidth_bytes_per_s=4e12)
    lines = floor_lines(dict(floor, results=[row]))
    assert lines[-1] == (f"megakernel-v16-b8 at context 128: 52.0 experts a sparse layer (the union of its sequences'), "
                         f"{read / 1e6:.0f} MB a step, floor {read / 4e6:.1f} us (its 'of floor')")


# ---------------------------------------------------------------------------------------------------
# Lists: comma-separated, repeated, or both


def test_generate_arch_comma_list_and_repeats(tmp_path):
    result = runner.invoke(app, ["generate", "qwen3-0.6b", "--arch", "sm_90,sm_120", "--arch", "sm_80", "--arch", "sm_90",
                                 "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert [r["arch"] for r in json.loads(result.stdout)["results"]] == ["sm_90", "sm_120", "sm_80"]


@pytest.mark.parametrize(
    "values, error",
    [
        (["a,,b"], "--x 'a,,b': an empty item"),
        ([" , "], "an empty item"),
        (["a", ""], "--x '': an empty item"),
    ],
)
def test_split_list_errors(values, error):
    from mkport.cli.options import split_list

    with pytest.raises(MkportError, match=re.escape(error)):
        split_list(values, "--x")


def test_list_helpers():
    from mkport.cli.options import choose, int_list, split_list

    assert split_list(["a, b", "c", "a"], "--x") == ["a", "b", "c"] and split_list(None, "--x") == []
    assert choose(None, "--x", ("p", "q")) == ["p", "q"] and choose(["q"], "--x", ("p", "q")) == ["q"]
    with pytest.raises(MkportError, match="--x: unknown r; supported: p, q"):
        choose(["p,r"], "--x", ("p", "q"))
    assert int_list(["128,512", "2048"], "--c") == [128, 512, 2048]
    with pytest.raises(MkportError, match="--c '128,0': 0 is not an integer >= 1"):
        int_list(["128,0"], "--c")


def test_diff_and_bench_tts_tables_at_80_columns(tmp_path, monkeypatch):
    """The other two tables: diff's op names (what --inject takes) and bench-tts's engine names stay whole."""
    from types import SimpleNamespace

    import mkport.cli.options
    import mkport.check.diff
    import mkport.runtime.decoder
    import mkport.tts.bench_tts
    import mkport.tts.model
    from mkport.check.diff import DiffReport, DiffRow

    monkeypatch.setattr(mkport.runtime.decoder, "require_gpu", lambda spec=None: None)
    monkeypatch.setattr(mkport.cli.options.LlmModel, "checkpoint", lambda self: tmp_path)
    report = DiffReport([DiffRow(layer, op, 1e-3, 2e-3, 0.999999, 1e-2, True) for layer in range(2)
                         for op in ("attn_out", "mlp_out", "residual_post_attn")], steps=8)
    fake = SimpleNamespace(report=report, token_agreement=8, positions=24, caught_injection=None)
    monkeypatch.setattr(mkport.check.diff, "kernel_diff", lambda *args, **kwargs: fake)
    buf = terminal(monkeypatch)
    result = runner.invoke(app, ["diff", "qwen3-0.6b", "--random-weights"])
    assert result.exit_code == 0, result.output
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80 and "│ residual_post_attn " in text, text

    run = dict(first_chunk_ms=40.0, streamed=True, first_chunk_frames=1, frame_median_ms=4.0, frame_p10_ms=3.9,
               frame_p90_ms=4.2, rtf=0.06, frames=100, audio_s=8.0, frame_method="each frame")
    canned = {"environment": {"gpu": "NVIDIA H200"}, "folder": str(tmp_path), "speaker": "vivian",
              "results": [dict(run, engine="mkport", first_chunk_parts_ms=dict(setup=1.0, prefill=3.0, first_frame=4.5,
                                                                             codec=2.5)),
                          dict(run, engine="official", streamed=False),
                          dict(run, engine="faster-qwen3-tts")]}
    monkeypatch.setattr(mkport.tts.model, "random_model_folder", lambda which, seed=0: tmp_path)
    monkeypatch.setattr(mkport.tts.bench_tts, "run_tts_bench", lambda *args, **kwargs: canned)
    buf = terminal(monkeypatch)
    result = runner.invoke(app, ["bench-tts", "--random-weights", "0.6b"])
    assert result.exit_code == 0, result.output
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for engine in ("mkport", "official", "faster-qwen3-tts"):
        assert f"│ {engine} " in text, text
    parts_table = text[text.index("mkport: where its first chunk went (ms)"):]  # only mkport reports its parts
    assert all(f" {v} " in parts_table for v in ("1.0", "3.0", "4.5", "2.5", "40.0")), text
    assert "official: where" not in text


def test_unusable_cache_root_is_one_line(tmp_path, monkeypatch):
    """A cache root that cannot be made (here: below a file) ends in one line naming the path, exit 2."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MKPORT_CACHE", str(blocker / "cache"))
    proc = run("speak", "Hi.", "--backend", "reference", "--random-weights", "tiny", "--out", str(tmp_path / "x.wav"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and str(blocker) in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "x.wav").exists()


def test_a_batch_rows_tokens_a_second_count_every_sequence():
    """A batch row of `bench`: its tokens a second are every sequence's, and it says its batch; a batch-1 row
    neither multiplies nor says one."""
    from mkport.bench.decode import EngineTiming

    steps = [1000.0, 1200.0, 1100.0]
    eight = EngineTiming("megakernel-v20-b8", 128, steps, batch=8).summary()
    one = EngineTiming("megakernel-v20", 128, steps).summary()
    assert eight["batch"] == 8 and eight["tokens_per_s"] == pytest.approx(8 * one["tokens_per_s"])
    assert "batch" not in one and one["tokens_per_s"] == pytest.approx(1e6 / 1100.0)


# ---------------------------------------------------------------------------------------------------
# The model arguments: one resolver a kind, one wording for every command


@pytest.mark.parametrize("command, model", [(["speak", "hi"], ["--model", "somewhere"]),
                                            (["serve"], ["--model", "somewhere"]),
                                            (["bench-tts"], ["somewhere"]), (["plan"], ["somewhere"])])
def test_tts_commands_refuse_their_model_alike(command, model, monkeypatch):
    monkeypatch.delenv("MKPORT_SERVER", raising=False)  # speak: no server to fall back on
    option = "--model DIR" if model[0] == "--model" else "DIR"
    exactly = f"give exactly one of {option} (a Qwen3-TTS model folder) or --random-weights 0.6b|1.7b|tiny"
    for args, message in [([], exactly), ([*model, "--random-weights", "tiny"], exactly),
                          (["--random-weights", "9b"], "unknown --random-weights '9b'; supported: 0.6b, 1.7b, tiny")]:
        result = runner.invoke(app, [*command, *args])
        assert isinstance(result.exception, MkportError) and str(result.exception) == message, result.output


@pytest.mark.parametrize("command", [["diff", "qwen3-0.6b"], ["bench", "qwen3-0.6b"],
                                     ["run", "qwen3-0.6b", "--prompt", "hi"]])
def test_llm_commands_refuse_their_weights_alike(command, tmp_path):
    both = ["--weights", str(tmp_path), "--random-weights"]
    for args, message in [(both, "give exactly one of --weights DIR or --random-weights"),
                          (["--weights", str(tmp_path), "--weights-seed", "1"],
                           "--weights-seed is for --random-weights")]:
        result = runner.invoke(app, [*command, *args])
        assert isinstance(result.exception, MkportError) and str(result.exception) == message, result.output


def test_generate_out_a_file_is_refused_and_kept(tmp_path):
    """--out names the folder generate writes into: a file there is refused in one line, and left as it was."""
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    proc = run("generate", "qwen3-0.6b", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"error: --out {out} is a file: give a folder (<name>-<digest>/ is written into it)"
    assert out.read_text() == "mine"


@pytest.mark.parametrize("command", ["diff", "bench"])
def test_a_model_larger_than_the_gpus_free_memory_is_refused_before_loading(command, tmp_path, monkeypatch):
    """Mixtral-8x22B's 281 GB of weights on a GPU with 80 GB free (the CUDA calls stand in for one): one line that
    says so, before any weights are read or made."""
    from conftest import PUBLISHED_CONFIGS

    from mkport.runtime import weights

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80e9, 141e9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(weights.CounterCheckpoint, "__init__", lambda *a, **k: pytest.fail("weights were made"))
    config = tmp_path / "mixtral-8x22b" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(PUBLISHED_CONFIGS["mixtral-8x22b-instruct"]))
    result = runner.invoke(app, [command, str(config), "--random-weights"])
    assert isinstance(result.exception, MkportError), result.output
    assert str(result.exception) == (
        "mixtral-8x22b: its weights take 281.3 GB in bf16 with all 8 experts of a layer, more than the 80.0 GB free "
        "of 141.0 GB on NVIDIA H200; mkport runs a model on one GPU")
    # a model that fits goes on (to the kernel's build, which needs the GPU this test does not have)
    from mkport.runtime.decoder import require_gpu

    require_gpu(load_spec("qwen3-0.6b"))


def test_a_family_not_yet_validated_on_a_gpu_is_named_by_the_gpu_commands(monkeypatch, capsys):
    """A family that passes the CPU checks but not yet `mkport diff` on a GPU (granitemoe stands in for one): a GPU
    command says so (the CUDA calls stand in for one); a validated family's does not."""
    from conftest import PUBLISHED_CONFIGS

    from mkport.kernel.spec import spec_from_config
    from mkport.runtime import decoder
    from mkport.runtime.decoder import require_gpu

    monkeypatch.setattr(decoder, "GPU_UNVALIDATED_FAMILIES", ("granitemoe",))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (130e9, 141e9))
    require_gpu(spec_from_config(PUBLISHED_CONFIGS["granite-3.0-1b-a400m"], "granite-3.0-1b-a400m"))
    assert capsys.readouterr().err == ("note: granitemoe's megakernel has not passed mkport diff on a GPU yet (it is "
                                       "validated on the CPU only): run mkport diff on this model before trusting its "
                                       "output\n")
    require_gpu(load_spec("qwen3-30b-a3b"))
    assert capsys.readouterr().err == ""


def test_a_reference_too_large_for_the_gpu_is_refused_before_loading(tmp_path, monkeypatch):
    """A Qwen3-VL text decoder of 32B's shape (65.5 GB in bf16), whose family has no layer-at-a-time reference: its whole
    float32 reference beside its weights would not fit a GPU with 130 GB free (the CUDA calls stand in for one), so
    diff says so in one line before any weights are made."""
    from conftest import validation_config

    from mkport.runtime import weights

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (130e9, 141e9))
    monkeypatch.setattr(weights.CounterCheckpoint, "__init__", lambda *a, **k: pytest.fail("weights were made"))
    cfg, _ = validation_config("qwen3_vl")
    cfg["text_config"].update(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                              num_key_value_heads=8, head_dim=128, vocab_size=151936)
    config = tmp_path / "qwen3-vl-32b" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(cfg))
    result = runner.invoke(app, ["diff", str(config), "--random-weights"])
    assert isinstance(result.exception, MkportError), result.output
    assert str(result.exception) == (
        "qwen3-vl-32b: its whole float32 reference (131.0 GB) beside its bf16 weights (65.5 GB) needs more than the "
        "130.0 GB free on the GPU, and its model_type 'qwen3_vl' has no layer-at-a-time reference")
    # a model as large whose family has the layer-at-a-time reference goes on: Qwen3-30B-A3B's 61 GB
    from mkport.check.diff import check_reference_fits
    from mkport.check.reference import can_layer
    from mkport.kernel.spec import open_model

    source = open_model("qwen3-30b-a3b")
    assert can_layer(source)
    check_reference_fits(source)
