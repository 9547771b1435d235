"""`mkport generate --check`: every bundled spec compiles for every target with nvcc, without spills, and the
resource check itself can fail. The compile tests skip (visibly) where nvcc is absent; CI has it. All the
compiles run in one pool at the first compile test (the `compiled` fixture), as many at once as there are
cores."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ENVELOPE_CONFIGS, PUBLISHED_CONFIGS, needs_nvcc

from mkport.kernel import build
from mkport.kernel.build import CheckResult, compile_check, parse_ptxas
from mkport.errors import MkportError
from mkport.kernel.gpu import KNOWN_TARGETS, target_for_arch
from mkport.kernel.render import render
from mkport.kernel.spec import bundled_names, load_spec, spec_from_config
from mkport.kernel.launch_plan import plan_launch

ARCHS = ("sm_80", "sm_89", "sm_90", "sm_100", "sm_120")
WORKERS = os.cpu_count() or 2  # nvcc is single-threaded; CI has two cores




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


def test_check_table(monkeypatch, tmp_path):
    """generate --check's table: registers, spills, shared memory and the verdict of each arch; exit 1 on a
    problem (nvcc's report is canned here; the real compiles are below)."""
    from typer.testing import CliRunner

    from mkport.cli import app

    reports = {"sm_80": PTXAS_OK.replace("sm_90", "sm_80"), "sm_90": PTXAS_OK, "sm_120": PTXAS_SPILLS}
    monkeypatch.setattr(build, "nvcc", lambda: "nvcc")
    monkeypatch.setattr(build.subprocess, "run", lambda cmd, **kw: SimpleNamespace(
        returncode=0, stdout="", stderr=reports[next(a for a in cmd if a.startswith("-arch=")).split("=")[1]]))
    result = CliRunner().invoke(app, ["generate", "qwen3-0.6b", "--check", "--arch", "sm_80,sm_90", "--out", str(tmp_path)],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    rows = table_rows(result.stdout)
    assert sorted(rows) == ["sm_80", "sm_90"]
    for arch, (_, sources, grid, regs, spills, smem, status) in rows.items():
        plan = plan_launch(load_spec("qwen3-0.6b"), KNOWN_TARGETS[arch])
        assert (grid, regs, spills, status) == (f"{plan.grid} x {plan.threads}", "108", "0+0 B", "ok")
        assert smem == f"{plan.smem_bytes}+224 B" and Path(sources).parent == tmp_path
    result = CliRunner().invoke(app, ["generate", "qwen3-0.6b", "--check", "--arch", "sm_120", "--out", str(tmp_path)],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 1
    assert "spills 96 bytes stored, 88 loaded" in table_rows(result.stdout)["sm_120"][-1]


# ---------------------------------------------------------------------------------------------------
# Real compiles: every nvcc run of this file in one pool, longest first, so that no core idles between tests


def _envelope_specs():
    """Shapes no bundled spec covers (conftest.ENVELOPE_CONFIGS)."""
    return [spec_from_config(c, n) for n, c in ENVELOPE_CONFIGS.items()]


def _published_specs():
    """The published configs outside the bundle that mkport takes (test_published_configs.py: which, and the rest's
    refusals)."""
    specs = []
    for name, config in PUBLISHED_CONFIGS.items():
        try:
            specs.append(spec_from_config(config, name))
        except MkportError:
            continue
    return specs


def _compile(spec, root: Path, trace: bool = False, batch: int = 1) -> CheckResult:
    target = target_for_arch("sm_90")
    plan = plan_launch(spec, target, batch=batch)
    return compile_check(render(spec, plan).write(root), plan, target, trace=trace)


def one_spec_a_family() -> list[str]:
    """The bundled specs compiled for every arch: the first of each family, and the Qwen3-TTS decoders (input
    embeddings, the 1.7B predictor's input projection and 15 heads). Every other spec is compiled for sm_90 only, so
    CI's compiles grow by one a spec, not one an arch (issue 26)."""
    names = bundled_names()
    first = {}
    for name in names:
        first.setdefault(load_spec(name).family, name)
    return [n for n in names if n in first.values() or n in ("qwen3-tts-1.7b-talker", "qwen3-tts-1.7b-code-predictor")]


# Mixtral's two experts' down input (28672 floats) does not fit the 99 KB of shared memory a block has on sm_89 and
# sm_120 (GPUs whose memory would not hold its 93 GB either): refused there (test_too_wide_for_a_block_is_refused)
SMEM_REFUSED = {"mixtral-8x7b": ("sm_89", "sm_120")}


def archs_of(name: str) -> tuple[str, ...]:
    archs = ARCHS if name in one_spec_a_family() else ("sm_90",)
    return tuple(a for a in archs if a not in SMEM_REFUSED.get(name, ()))


@pytest.mark.parametrize("name,arch", [(n, a) for n, archs in SMEM_REFUSED.items() for a in archs])
def test_too_wide_for_a_block_is_refused(name, arch, tmp_path):
    proc = run_cli("generate", name, "--arch", arch, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{name} at batch 1 needs" in proc.stderr and f"{arch} allows" in proc.stderr
    # a batch reads the experts' down input from global memory: batches of 2 and up fit where batch 1 does not
    assert "fits" not in proc.stderr or ": batch 2 to" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """Runs every compile at once: `generate NAME --check --json` for each bundled spec, for all of ARCHS where it
    is its family's representative and for sm_90 otherwise (through the CLI), the envelope specs, the published
    configs outside the bundle and the trace variant (the library)."""
    root = tmp_path_factory.mktemp("compiled")
    jobs = {("cli", name): lambda name=name: run_cli("generate", name, "--check", "--arch", ",".join(archs_of(name)),
                                                      "--json", "--out", str(root / "gen"), cwd=root)
            for name in bundled_names()}
    jobs.update({("envelope", spec.name): lambda spec=spec: _compile(spec, root / "envelope")
                 for spec in _envelope_specs()})
    jobs.update({("published", spec.name): lambda spec=spec: _compile(spec, root / "published")
                 for spec in _published_specs()})
    jobs[("trace", "qwen3-tts-1.7b-code-predictor")] = lambda: _compile(  # input projection, 15 tables and heads
        load_spec("qwen3-tts-1.7b-code-predictor"), root / "trace", trace=True)
    jobs[("batch", "qwen3-tts-1.7b-talker")] = lambda: _compile(  # the batch decoder: tensor-core matvecs, 8 sequences
        load_spec("qwen3-tts-1.7b-talker"), root / "batch", batch=8)
    for name in ("qwen3-tts-1.7b-talker", "qwen3-tts-1.7b-code-predictor"):  # 24, asked (launch_plan.BATCH_SIZES)
        jobs[("batch 24", name)] = lambda name=name: _compile(load_spec(name), root / "batch24", batch=24)
    jobs[("batch 24 trace", "qwen3-tts-1.7b-talker")] = lambda: _compile(  # what a batched diff at 24 runs
        load_spec("qwen3-tts-1.7b-talker"), root / "batch24", trace=True, batch=24)
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
    return {key: future.result() for key, future in futures.items()} | {"root": root}


def generated_problems(compiled: dict, name: str) -> list[str]:
    """What is wrong with `generate NAME --check --json` (the compiled fixture's run): within the plan's registers, no
    spills, the --json report, one sources folder an arch."""
    proc = compiled[("cli", name)]
    if proc.returncode != 0:
        return [f"{name}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"]
    failures = []
    data = json.loads(proc.stdout)
    assert data["spec"] == name and [r["arch"] for r in data["results"]] == list(archs_of(name))
    for entry in data["results"]:
        plan = plan_launch(load_spec(name), KNOWN_TARGETS[entry["arch"]])
        assert (entry["grid"], entry["threads"], entry["smem_bytes"]) == (plan.grid, plan.threads, plan.smem_bytes)
        assert plan.grid == KNOWN_TARGETS[entry["arch"]].sm_count
        kernels = {re.sub(r"^_Z\d+|_kernel.*$", "", k["kernel"]): k for k in entry["check"]["kernels"]}
        kernel = kernels.pop("decode_step")
        assert 0 < kernel["registers"] <= plan.max_regs_per_thread
        # the prefill's fused kernels (cuda/prefill.cuh; a hybrid's gated_delta_net_prefill.cuh and
        # delta_rule_prefill.cuh), spill-free too
        hybrid = ["conv_state", "delta_chunk", "delta_scan", "gated_norm", "linear_inputs"]
        assert sorted(kernels) == [*(hybrid if load_spec(name).linear_layers else []), "prefill_act", "prefill_attn",
                                   "prefill_attn_split", "prefill_norm", "prefill_qkv"]
        assert not any(k["spill_stores"] or k["spill_loads"] for k in kernels.values()), kernels
        if not entry["check"]["ok"] or kernel["spill_stores"] or kernel["spill_loads"]:
            failures.append(f"{name} {entry['arch']}: {entry['check']}")
        sources = Path(entry["dir"])
        assert sources.name.startswith(name + "-")
        assert (sources / "spec.json").is_file() and (sources / "plan.json").is_file()
    folders = [d for d in (compiled["root"] / "gen").iterdir() if d.name.rsplit("-", 1)[0] == name]
    assert len(folders) == len(archs_of(name)), folders
    return failures


@needs_nvcc
def test_generate_check_every_spec_every_arch(compiled):
    """Every bundled spec for sm_90 (the MoE ones at batch 1, the megakernel's only batch for them), one a family for
    every arch."""
    failures = [f for name in bundled_names() for f in generated_problems(compiled, name)]
    assert not failures, "\n".join(failures)


def test_every_family_and_arch_is_compiled():
    """The representatives cover every family of the bundle, and more than one spec is left at sm_90 alone."""
    families = {load_spec(n).family for n in bundled_names()}
    assert {load_spec(n).family for n in one_spec_a_family()} == families
    assert len(one_spec_a_family()) < len(bundled_names())


@needs_nvcc
def test_envelope_compiles(compiled):
    bad = [f"{spec.name}: {compiled[('envelope', spec.name)].problems}" for spec in _envelope_specs()
           if not compiled[("envelope", spec.name)].ok]
    assert not bad, bad


@needs_nvcc
def test_published_configs_outside_the_bundle_compile(compiled):
    """A new user's configs (tests/published_configs/) at full size for sm_90: no spills, within the plan."""
    specs = _published_specs()
    assert len(specs) >= 15
    bad = [f"{spec.name}: {compiled[('published', spec.name)].problems}" for spec in specs
           if not compiled[("published", spec.name)].ok]  # a spill is a problem (test_check_fails_on_spills)
    assert not bad, bad


@needs_nvcc
def test_trace_variant_compiles(compiled):
    result = compiled[("trace", "qwen3-tts-1.7b-code-predictor")]
    assert result.ok, result.problems
    assert result.kernels and all(k.spill_stores == k.spill_loads == 0 for k in result.kernels)


def test_nvcc_absent_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    with pytest.raises(MkportError, match="nvcc not found"):
        build.nvcc()


@needs_nvcc
def test_batch_decoder_compiles_within_the_plan(compiled):
    """Batch 8 of the 1.7B talker: no spills, registers and shared memory within the plan, which holds the 8
    sequences' 2048-float normed residuals but not their 6144-float MLP activations (read from global memory)."""
    result = compiled[("batch", "qwen3-tts-1.7b-talker")]
    assert result.ok, result.problems
    assert 8 * 4 * 2048 <= result.dynamic_smem < 8 * 4 * 6144


@needs_nvcc
def test_batch_24_of_the_1_7b_compiles_without_spills(compiled):
    """The 1.7B's decoders at batch 24, the most sequences whose 2048-float normed residuals fit a block on sm_90 (32
    do not): no spills, within the plan. 512 threads are not a multiple of 24, so the tiles' outputs are stored by the
    first 504 (a thread keeps one sequence's, as the head's best needs). The trace build, which a batched diff runs
    and nobody times, compiles within the plan, its spills the only problem allowed (16 bytes at nvcc 13.0)."""
    for key in [("batch 24", "qwen3-tts-1.7b-talker"), ("batch 24", "qwen3-tts-1.7b-code-predictor")]:
        result = compiled[key]
        assert result.ok, (key, result.problems)
        assert all(k.spill_stores == k.spill_loads == 0 for k in result.kernels), key
        assert 24 * 4 * 2048 <= result.dynamic_smem <= 232448, key
    trace = compiled[("batch 24 trace", "qwen3-tts-1.7b-talker")]
    assert trace.kernels and all("spills" in problem for problem in trace.problems), trace.problems
