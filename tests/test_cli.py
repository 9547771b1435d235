"""The command line: listing specs, rendering, and bad input ending in one `error:` line with exit code 2.

Error cases run `python -m mkport.cli` in a subprocess: the console script's entry point (main) is what turns
an MkportError into the one-line message, and CliRunner would call the Typer app without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mkport.cli import app
from mkport.spec import _bundled_path, bundled_names, load_spec

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
    "missing_config": (lambda tmp: ["generate", str(tmp / "nowhere" / "config.json")], "no such file or folder: "),
    "folder_without_config": (lambda tmp: ["generate", str(tmp)], "has no config.json"),
    "unsupported_field": (lambda tmp: ["generate", str(_moe_config(tmp))], "num_experts=128"),
    "not_json": (lambda tmp: ["generate", str(_not_json(tmp))], "not valid JSON"),
    "tts_without_part": (lambda tmp: ["generate", str(_tts_folder(tmp))], "MODEL:talker"),
    "bad_arch": (lambda tmp: ["generate", "qwen3-0.6b", "--arch", "sm_70"], "arch 'sm_70' is not supported"),
    "bad_arch_check": (
        lambda tmp: ["generate", "qwen3-0.6b", "--arch", "sm_7x", "--arch", "sm_90", "--check"],
        "arch 'sm_7x'",
    ),
    "bad_arch_after_good": (  # every --arch is checked before anything is rendered or compiled
        lambda tmp: ["generate", "qwen3-0.6b", "--arch", "sm_90", "--arch", "sm_7x", "--check"],
        "arch 'sm_7x'",
    ),
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
    "diff_unknown_model": (["diff", "no-such-model", "--random-weights"], "unknown model 'no-such-model'"),
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
