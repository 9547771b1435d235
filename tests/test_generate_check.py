"""`mkport generate --check`: every bundled spec compiles for every target with nvcc, without spills, and the
resource check itself can fail. The compile tests skip (visibly) where nvcc is absent; CI has it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from mkport import build
from mkport.build import CheckResult, compile_check, parse_ptxas
from mkport.errors import MkportError
from mkport.gpu import KNOWN_TARGETS, target_for_arch
from mkport.render import render
from mkport.spec import bundled_names, load_spec, spec_from_config
from mkport.tiling import plan_launch

ARCHS = ("sm_80", "sm_89", "sm_90", "sm_120")
WORKERS = 2  # CI has two cores; nvcc is single-threaded


def _have_nvcc() -> bool:
    try:
        build.nvcc()
        return True
    except MkportError:
        return False


needs_nvcc = pytest.mark.skipif(not _have_nvcc(), reason="nvcc not found (CUDA toolkit absent): compile checks skipped")


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="400", NO_COLOR="1", TERM="dumb")
    return subprocess.run(
        [sys.executable, "-m", "mkport.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def table_rows(stdout: str) -> dict[str, list[str]]:
    """arch -> cells of its row in the rich table."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0] in KNOWN_TARGETS:
            rows[cells[0]] = cells
    return rows


# ---------------------------------------------------------------------------------------------------
# The resource check (no nvcc needed)

PTXAS_OK = """\
ptxas info    : 24 bytes gmem
ptxas info    : Compiling entry function 'decode_step_kernel' for 'sm_90'
ptxas info    : Function properties for decode_step_kernel
    32 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 108 registers, used 1 barriers, 32 bytes cumulative stack size, 224 bytes smem
ptxas info    : Compile time = 429.470 ms
"""

PTXAS_SPILLS = """\
ptxas info    : Compiling entry function 'decode_step_kernel' for 'sm_80'
ptxas info    : Function properties for decode_step_kernel
    152 bytes stack frame, 96 bytes spill stores, 88 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 152 bytes cumulative stack size, 256 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'helper_kernel' for 'sm_80'
ptxas info    : Function properties for helper_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, 380 bytes cmem[0]
"""


def test_parse_ptxas():
    (k,) = parse_ptxas(PTXAS_OK)
    assert (k.kernel, k.registers, k.spill_stores, k.spill_loads, k.stack_bytes, k.static_smem) == (
        "decode_step_kernel", 108, 0, 0, 32, 224
    )
    spill, helper = parse_ptxas(PTXAS_SPILLS)
    assert (spill.kernel, spill.registers, spill.spill_stores, spill.spill_loads) == ("decode_step_kernel", 128, 96, 88)
    assert spill.static_smem == 256 and spill.stack_bytes == 152
    assert (helper.kernel, helper.registers, helper.static_smem) == ("helper_kernel", 32, 0)
    assert parse_ptxas("nothing here\n") == []


def _fake_compile(monkeypatch, tmp_path, stderr: str, returncode: int = 0) -> CheckResult:
    spec = load_spec("qwen3-0.6b")
    target = target_for_arch("sm_80")
    plan = plan_launch(spec, target)
    monkeypatch.setattr(build, "nvcc", lambda: "nvcc")
    monkeypatch.setattr(
        build.subprocess, "run", lambda cmd, **kw: SimpleNamespace(returncode=returncode, stdout="", stderr=stderr)
    )
    return compile_check(tmp_path, plan, target)


def test_check_fails_on_spills(monkeypatch, tmp_path):
    result = _fake_compile(monkeypatch, tmp_path, PTXAS_SPILLS)
    assert not result.ok
    assert any("spills 96 bytes stored, 88 loaded" in p for p in result.problems)
    assert result.to_dict()["ok"] is False


def test_check_passes_clean_report(monkeypatch, tmp_path):
    result = _fake_compile(monkeypatch, tmp_path, PTXAS_OK.replace("sm_90", "sm_80"))
    assert result.ok and result.problems == [] and result.kernels[0].registers == 108


def test_check_fails_on_registers_and_smem(monkeypatch, tmp_path):
    limit = plan_launch(load_spec("qwen3-0.6b"), target_for_arch("sm_80")).max_regs_per_thread
    over = limit + 8
    text = PTXAS_OK.replace("Used 108 registers", f"Used {over} registers").replace("224 bytes smem", "200000 bytes smem")
    result = _fake_compile(monkeypatch, tmp_path, text)
    assert any(f"{over} registers a thread, the plan allows {limit}" in p for p in result.problems)
    assert any("bytes of shared memory" in p for p in result.problems)


def test_check_errors(monkeypatch, tmp_path):
    with pytest.raises(MkportError, match="no resource report"):
        _fake_compile(monkeypatch, tmp_path, "ptxas info    : 0 bytes gmem\n")
    with pytest.raises(MkportError, match="nvcc failed for sm_80: .*error: identifier"):
        _fake_compile(monkeypatch, tmp_path, 'decode_step.cu(3): error: identifier "x" is undefined\n', returncode=1)


# ---------------------------------------------------------------------------------------------------
# Real compiles


@needs_nvcc
def test_generate_check_every_spec_every_arch(tmp_path):
    """24 nvcc compiles (6 specs x 4 archs), one CLI process per spec, two at a time."""
    arch_args = [x for a in ARCHS for x in ("--arch", a)]

    def one(name: str):
        return name, run_cli("generate", name, "--check", *arch_args, "--out", str(tmp_path / "gen"), cwd=tmp_path)

    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(one, bundled_names()))
    failures = []
    for name, proc in results:
        if proc.returncode != 0:
            failures.append(f"{name}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
            continue
        assert "decode step megakernel" in proc.stdout, proc.stdout
        rows = table_rows(proc.stdout)
        assert sorted(rows) == sorted(ARCHS), proc.stdout
        for arch, cells in rows.items():
            arch_col, sources, grid, regs, spills, smem, status = cells
            plan = plan_launch(load_spec(name), KNOWN_TARGETS[arch])
            assert grid == f"{plan.grid} x {plan.threads}" and plan.grid == KNOWN_TARGETS[arch].sm_count
            assert int(regs) <= plan.max_regs_per_thread
            if spills != "0+0 B" or status != "ok":
                failures.append(f"{name} {arch}: regs {regs}, spills {spills}, status {status}")
            assert Path(sources).name.startswith(name + "-")
            assert (Path(sources) / "spec.json").is_file() and (Path(sources) / "plan.json").is_file()
    assert not failures, "\n".join(failures)
    assert len(list((tmp_path / "gen").iterdir())) == len(bundled_names()) * len(ARCHS)


@needs_nvcc
def test_generate_check_json(tmp_path):
    proc = run_cli("generate", "qwen3-tts-0.6b-code-predictor", "--check", "--json", "--out", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["spec"] == "qwen3-tts-0.6b-code-predictor"
    (entry,) = data["results"]
    assert entry["arch"] == "sm_90" and entry["grid"] == 132
    check = entry["check"]
    assert check["ok"] and check["problems"] == []
    (kernel,) = check["kernels"]
    assert kernel["kernel"] == "decode_step_kernel"
    assert kernel["spill_stores"] == kernel["spill_loads"] == 0
    plan = plan_launch(load_spec("qwen3-tts-0.6b-code-predictor"), target_for_arch("sm_90"))
    assert entry["threads"] == plan.threads
    assert 0 < kernel["registers"] <= plan.max_regs_per_thread


def _envelope_specs():
    """Shapes no bundled spec covers: q/k/v bias with 14 heads, llama3 rope with 15 heads, head_dim 256 at
    GQA 16, contiguous MRoPE, and an untied decoder whose hidden state is the output."""
    qwen2 = {
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 2,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "rope_theta": 1e6,
        "tie_word_embeddings": True,
    }
    llama3 = {
        "model_type": "llama", "hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 2,
        "num_attention_heads": 15, "num_key_value_heads": 5, "vocab_size": 49152,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    }
    wide = {
        "model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 2,
        "num_attention_heads": 16, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 32000,
    }
    mrope = dict(wide, head_dim=128, num_key_value_heads=2,
                 rope_scaling={"rope_type": "default", "mrope_section": [16, 24, 24]})
    return [spec_from_config(c, n) for n, c in
            (("qwen2-14h", qwen2), ("llama3-15h", llama3), ("hd256-gqa16", wide), ("mrope-contig", mrope))]


@needs_nvcc
def test_envelope_compiles(tmp_path):
    target = target_for_arch("sm_90")

    def one(spec):
        plan = plan_launch(spec, target)
        return spec.name, compile_check(render(spec, plan).write(tmp_path), plan, target)

    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(one, _envelope_specs()))
    bad = [f"{name}: {res.problems}" for name, res in results if not res.ok]
    assert not bad, bad


@needs_nvcc
def test_trace_variant_compiles(tmp_path):
    spec = load_spec("qwen3-tts-1.7b-code-predictor")  # input projection, 15 tables and heads
    target = target_for_arch("sm_90")
    plan = plan_launch(spec, target)
    result = compile_check(render(spec, plan).write(tmp_path), plan, target, trace=True)
    assert result.ok, result.problems
    assert result.kernels and all(k.spill_stores == k.spill_loads == 0 for k in result.kernels)


def test_nvcc_absent_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    with pytest.raises(MkportError, match="nvcc not found"):
        build.nvcc()
