"""The megakernel for the families the plain-torch path ran first (issue 28): static yarn RoPE, Gemma 1/2/3 text,
OLMo 2/3. On the CPU: what the plan accepts and still refuses, what each feature renders, and nvcc compiles of
real-sized shapes for sm_90 without spills (normal and trace builds). Their GPU diffs are test_gpu_kernel_families.py."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import needs_nvcc

from mkport.kernel.build import compile_check
from mkport.kernel.gpu import target_for_arch
from mkport.kernel.launch_plan import plan_launch
from mkport.kernel.render import _float_literal, render, rope_tables
from mkport.kernel.spec import load_spec, spec_from_config

# Real-sized shapes (2 layers: the layer count changes no register or spill), compiled for sm_90
QWEN3_YARN = {"model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 2,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
              "max_position_embeddings": 131072, "rope_theta": 1e6, "tie_word_embeddings": True,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
COMPILED = {"qwen3-yarn": QWEN3_YARN}


def _rendered(config: dict, batch: int = 1) -> dict:
    spec = spec_from_config(config, "k")
    return render(spec, plan_launch(spec, target_for_arch("sm_90"), batch=batch)).files


# -- yarn ----------------------------------------------------------------------------------------------------------

def test_yarn_renders_its_static_table_and_attention_factor():
    """The kernel's RoPE table is render.rope_tables' (checked against transformers in test_rope_scaling.py) and cos/sin
    are scaled by the attention factor, 0.1 ln 4 + 1 here; a default RoPE renders no factor."""
    spec = spec_from_config(QWEN3_YARN, "k")
    rope = _rendered(QWEN3_YARN)["rope.cuh"]
    table = ", ".join(_float_literal(f) for f in rope_tables(spec)[0])
    assert f"ROPE_INV_FREQ[HD / 2] = {{ {table} }}" in rope
    assert spec.rope.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    assert f"constexpr float ROPE_ATTENTION_FACTOR = {_float_literal(spec.rope.attention_factor)};" in rope
    assert "cosf(angle) * ROPE_ATTENTION_FACTOR, s = sinf(angle) * ROPE_ATTENTION_FACTOR" in rope
    assert "ROPE_ATTENTION_FACTOR" not in _rendered(dict(QWEN3_YARN, rope_scaling=None))["rope.cuh"]


# -- compiles --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """Every shape of COMPILED for sm_90, normal and trace builds, in one pool."""
    root, target = tmp_path_factory.mktemp("families"), target_for_arch("sm_90")

    def job(name: str, trace: bool):
        spec = spec_from_config(COMPILED[name], name)
        plan = plan_launch(spec, target)
        return compile_check(render(spec, plan).write(root), plan, target, trace=trace)

    keys = [(name, trace) for name in COMPILED for trace in (False, True)]
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        futures = {key: pool.submit(job, *key) for key in keys}
    return {key: future.result() for key, future in futures.items()}


@needs_nvcc
@pytest.mark.parametrize("name", list(COMPILED))
@pytest.mark.parametrize("trace", [False, True], ids=["plain", "trace"])
def test_compiles_for_sm90_without_spills(compiled, name, trace):
    result = compiled[name, trace]
    assert result.ok, result.problems
    assert all(k.spill_stores == k.spill_loads == 0 for k in result.kernels), result.kernels
