"""The GPU suite's `serial` mark (conftest.is_large_checkpoint_test): the GPU tests of bundled specs with large
checkpoints, and the timing comparisons, are marked so the suite runs them one at a time and the rest in parallel;
checked through pytest's own collection and selection, as the suite's command uses it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import LARGE_CHECKPOINT_BYTES, is_large_checkpoint_test
from mkport.kernel.spec import load_spec
from mkport.runtime.weights import checkpoint_bytes

ROOT = Path(__file__).resolve().parents[1]


def test_large_bundled_specs_are_told_apart():
    assert checkpoint_bytes(load_spec("mistral-7b-v0.1")) > LARGE_CHECKPOINT_BYTES > checkpoint_bytes(load_spec("qwen3-0.6b"))
    assert is_large_checkpoint_test({"name": "qwen3-30b-a3b", "kernel": "v20"}, gpu=True)
    assert is_large_checkpoint_test({"index": 3, "name": "mistral-7b-v0.1"}, gpu=True)
    assert not is_large_checkpoint_test({"name": "qwen3-tts-0.6b-talker", "kernel": "v20"}, gpu=True)
    assert not is_large_checkpoint_test({"name": "qwen3-30b-a3b"}, gpu=False)  # a CPU test of it runs anywhere
    assert not is_large_checkpoint_test({"case": "qwen3"}, gpu=True)  # a tiny model's case name, not a bundled spec


def _selected(expression: str, *files: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", expression,
                          *files], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {line for line in out.splitlines() if "::" in line}


def test_the_suite_selects_the_serial_tests_apart():
    files = ("tests/test_gpu_decode.py", "tests/test_gpu_families.py", "tests/test_gpu_plan.py")
    serial, rest = _selected("gpu and serial", *files), _selected("gpu and not serial", *files)
    greedy = "tests/test_gpu_decode.py::test_greedy_tokens_and_hidden_match_reference[{}]"
    assert greedy.format("mistral-7b-v0.3") in serial and greedy.format("phi-3.5-mini") in serial
    assert greedy.format("qwen3-0.6b") in rest and greedy.format("olmo-2-0425-1b") in rest
    assert "tests/test_gpu_families.py::test_bundled_sliding_spec_past_its_window" in serial  # no parameters: by hand
    assert "tests/test_gpu_plan.py::test_the_model_is_near_what_runs_measure" in serial
    assert not serial & rest
