"""The megakernel for the families the plain-torch path ran first (issue 28): static yarn RoPE, Gemma 1/2/3 text,
OLMo 2/3. On the CPU: what the plan accepts and still refuses, what each feature renders, and nvcc compiles of
real-sized shapes for sm_90 without spills (normal and trace builds). Their GPU diffs are test_gpu_kernel_families.py."""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import KERNEL_COMMANDS, assert_kernel_command_refuses, needs_nvcc

from mkport.errors import MkportError
from mkport.kernel.build import compile_check
from mkport.kernel.gpu import target_for_arch
from mkport.kernel.interface import profile_phases
from mkport.kernel.launch_plan import plan_launch
from mkport.kernel.render import _float_literal, render, rope_tables
from mkport.kernel.spec import load_spec, spec_from_config
from mkport.runtime import prefill
from test_gemma import CONFIGS as GEMMAS, GEMMA3_LOCAL_YARN, GEMMA_2_2B, GEMMA_3_1B
from test_olmo2 import OLMO2, OLMO3, OLMO3_LOCAL_YARN, OLMO_2_1B

# Real-sized shapes (2 layers: the layer count changes no register or spill), compiled for sm_90
QWEN3_YARN = {"model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 2,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
              "max_position_embeddings": 131072, "rope_theta": 1e6, "tie_word_embeddings": True,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
COMPILED = {"qwen3-yarn": QWEN3_YARN, "gemma-2-2b": dict(GEMMA_2_2B, num_hidden_layers=2),
            "gemma-3-1b": dict(GEMMA_3_1B, num_hidden_layers=2), "olmo-2-1b": dict(OLMO_2_1B, num_hidden_layers=2),
            "olmo2-tiny": OLMO2, "olmo3-tiny": OLMO3}


def _rendered(config: dict, batch: int = 1) -> dict:
    spec = spec_from_config(config, "k")
    return render(spec, plan_launch(spec, target_for_arch("sm_90"), batch=batch)).files


# -- yarn ----------------------------------------------------------------------------------------------------------

def test_yarn_renders_its_static_table_and_attention_factor():
    """The kernel's RoPE table is render.rope_tables' (checked against transformers in test_rope_scaling.py) and cos/sin
    are scaled by the attention factor, 0.1 ln 4 + 1 here; a default RoPE applies no factor."""
    spec = spec_from_config(QWEN3_YARN, "k")
    files = _rendered(QWEN3_YARN)
    constants = files["constants.cuh"]
    table = ", ".join(_float_literal(f) for f in rope_tables(spec)[0])
    assert f"ROPE_INV_FREQ[HD / 2] = {{ {table} }}" in constants
    assert spec.rope.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    assert f"constexpr float ROPE_ATTENTION_FACTOR = {_float_literal(spec.rope.attention_factor)};" in constants
    assert "constexpr bool HAS_ROPE_ATTENTION_FACTOR = true;" in constants
    assert "c = cosf(angle) * ROPE_ATTENTION_FACTOR;" in files["rope.cuh"]
    plain = _rendered(dict(QWEN3_YARN, rope_scaling=None))["constants.cuh"]
    assert "constexpr bool HAS_ROPE_ATTENTION_FACTOR = false;" in plain


# -- Gemma -------------------------------------------------------------------------------------------------------------

def test_gemma_renders_offset_norms_geglu_and_the_embedding_scale():
    constants = _rendered(GEMMAS["gemma"])["constants.cuh"]
    assert "constexpr bool NORM_WEIGHT_OFFSET = true;" in constants and "constexpr bool GEGLU = true;" in constants
    assert "constexpr bool HAS_EMBEDDING_MULTIPLIER = true;" in constants
    assert f"EMBEDDING_MULTIPLIER = {_float_literal(128 ** 0.5)};" in constants
    assert "constexpr bool POST_NORMS = false;" in constants  # Gemma 1 has no sandwich norms
    llama = _rendered(dict(GEMMAS["gemma"], model_type="llama", hidden_act="silu"))["constants.cuh"]
    assert "constexpr bool NORM_WEIGHT_OFFSET = false;" in llama and "constexpr bool GEGLU = false;" in llama


def test_gemma2_renders_soft_caps_its_scale_and_its_post_norms_in_the_next_phases():
    """Soft-caps 2 and 5, scale 48^-0.5, the window of 6 on layers 0 and 2; o_proj and down leave their outputs in
    p.sub, whose post-norms gate_up and the next layer's qkv (or the final norm) make (post_norm.cuh); the profile
    names a phase for every barrier."""
    spec = spec_from_config(GEMMAS["gemma2"], "k")
    files = _rendered(GEMMAS["gemma2"])
    constants = files["constants.cuh"]
    assert f"ATTN_SCALE = {_float_literal(48 ** -0.5)};" in constants
    assert f"ATTN_SOFTCAP = {_float_literal(2.0)};" in constants and f"FINAL_SOFTCAP = {_float_literal(5.0)};" in constants
    assert "HAS_ATTN_SOFTCAP = true;" in constants and "HAS_FINAL_SOFTCAP = true;" in constants
    assert "ATTN_WINDOW[L] = { 6, 0, 6, 0 }" in constants and "constexpr bool POST_NORMS = true;" in constants
    step = files["decode_step.cu"]
    assert "lw.post_attn_norm, lw.mlp_norm, layer, TRACE_ATTN_RESIDUAL" in files["mlp.cuh"]
    assert "p.layers[before].post_mlp_norm, w, before,\n" in files["post_norm.cuh"]
    per_layer = step[step.index("for (int layer"):step.index("residual_input_to_smem<true>(p, L, p.final_norm")].count("grid_barrier")
    barriers = step.count("grid_barrier(grid")
    # a phase between consecutive marks: the start, each barrier, the end
    assert per_layer == 5 and len(profile_phases(spec)) == barriers - per_layer + per_layer * spec.num_layers + 1
    plain = _rendered(dict(GEMMAS["gemma2"], attn_logit_softcapping=None, final_logit_softcapping=None))["constants.cuh"]
    assert "HAS_ATTN_SOFTCAP = false;" in plain and "HAS_FINAL_SOFTCAP = false;" in plain


def test_gemma3_renders_the_sliding_layers_own_rope():
    """Layers 0, 1 and 3 slide and rotate with theta 1e4; layer 2 with 1e6 and linear scaling 8."""
    spec = spec_from_config(GEMMAS["gemma3"], "k")
    rope = _rendered(GEMMAS["gemma3"])["constants.cuh"]
    local = ", ".join(_float_literal(f) for f in rope_tables(dataclasses.replace(spec, rope=spec.local_rope))[0])
    full = ", ".join(_float_literal(f) for f in rope_tables(spec)[0])
    assert f"ROPE_LOCAL_INV_FREQ[HD / 2] = {{ {local} }}" in rope and f"ROPE_INV_FREQ[HD / 2] = {{ {full} }}" in rope
    assert local != full and "ROPE_LOCAL_LAYER[L] = { 1, 1, 0, 1 }" in rope and "#define HAS_LOCAL_ROPE 1" in rope


# -- OLMo 2/3 --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 4])
def test_olmo2_renders_no_input_norms_post_norms_and_projection_qk_norms(batch):
    """No input norm: qkv and gate/up copy x itself (PRE_NORMS false), nothing staged but the final norm's weights;
    post-norms made by the phases after o_proj and after down; q/k normed over the whole projection (QK_NORM_PROJECTION), the
    head's weights at its offset in the projection's."""
    spec = spec_from_config(OLMO2, "k")
    plan = plan_launch(spec, target_for_arch("sm_90"), batch=batch)
    assert (plan.norm_weights_at > 0) == (batch == 1)  # the final norm's weights, staged at batch 1
    files = render(spec, plan).files
    constants = files["constants.cuh"]
    assert "constexpr bool PRE_NORMS = false;" in constants and "constexpr bool POST_NORMS = true;" in constants
    assert "constexpr bool QK_NORM_PROJECTION = true;" in constants
    assert "constexpr bool HAS_QK_NORM = true;" in constants
    assert "residual_input_to_smem<PRE_NORMS>(p, layer, lw.attn_norm, smem, scratch);" in files["qkv.cuh"]
    assert "else vector_to_smem<H>(x, out);" in files["matvec.cuh"]  # what sublayer_input_to_smem<false> does
    assert "sublayer_input_to_smem<PRE_NORMS>(p.x, lw.mlp_norm, smem, scratch);" in files["mlp.cuh"]
    step = files["decode_step.cu"]
    assert "folded_post_norm_to_smem<PRE_NORMS>(p, p.x, p.x_alt, lw.post_attn_norm" in files["mlp.cuh"]
    assert "if constexpr (PRE_NORMS) stage_norm_weights(p.layers[0].attn_norm);" in step
    assert "else if (layer + 1 == L) stage_norm_weights(p.final_norm);" in step
    attention = files["attention.cuh"]
    assert "prepare_projection_head<Q_ROWS>(qkv + head * HD, qkv, lw.q_norm + head * HD," in attention
    assert "prepare_projection_head<KV_ROWS>(qkv + Q_ROWS + kvh * HD, qkv + Q_ROWS, lw.k_norm + kvh * HD," in attention
    for other in (QWEN3_YARN, GEMMAS["gemma3"]):  # per-head q/k norms, input norms
        c = _rendered(other)["constants.cuh"]
        assert "constexpr bool QK_NORM_PROJECTION = false;" in c and "constexpr bool PRE_NORMS = true;" in c


def test_olmo3_renders_its_windows_and_the_sliding_layers_own_rope():
    """Gemma 3's mechanism: layers 0-2 slide (window 6) with plain theta 5e5, layer 3 with linear scaling 8."""
    spec = spec_from_config(OLMO3, "k")
    constants = _rendered(OLMO3)["constants.cuh"]
    local = ", ".join(_float_literal(f) for f in rope_tables(dataclasses.replace(spec, rope=spec.local_rope))[0])
    full = ", ".join(_float_literal(f) for f in rope_tables(spec)[0])
    assert local != full and f"ROPE_LOCAL_INV_FREQ[HD / 2] = {{ {local} }}" in constants
    assert f"ROPE_INV_FREQ[HD / 2] = {{ {full} }}" in constants
    assert "ROPE_LOCAL_LAYER[L] = { 1, 1, 1, 0 }" in constants and "ATTN_WINDOW[L] = { 6, 6, 6, 0 }" in constants
    assert "constexpr bool QK_NORM_PROJECTION = true;" in constants and "constexpr bool PRE_NORMS = false;" in constants


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


def test_a_prefill_given_device_tables_copies_no_rope_table(monkeypatch):
    """The megakernel's decoder prefills in a CUDA graph, which cannot copy from the host: given the device tables,
    gemma3's forward takes its sliding layers' RoPE from them too (no rope_device_tables call), with the same result."""
    import torch

    from mkport.runtime import torch_model
    from mkport.runtime.weights import random_checkpoint, to_kernel_layout

    spec = spec_from_config(GEMMAS["gemma3"], "k")
    w = to_kernel_layout(spec, random_checkpoint(spec, 0))
    x, positions = torch.randn(10, spec.hidden_size), torch.arange(10).expand(3, 10)
    tables = torch_model.rope_device_tables(spec, "cpu")
    expected = torch_model.forward(spec, w, x, positions)

    def copies(*args):
        raise AssertionError("a RoPE table copied from the host")

    monkeypatch.setattr(torch_model, "rope_device_tables", copies)
    assert torch.equal(torch_model.forward(spec, w, x, positions, rope_tables=tables), expected)


# -- the fused prefill -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gemma-2-2b", "gemma-3-1b", "olmo-2-0425-1b"])
def test_the_fused_prefill_runs_the_bundled_gemma_and_olmo(name):
    """Their features are built into prefill.cuh (GeGLU, (1 + w) norms, post-norms, soft-caps, q/k norms over the
    projection, the sliding layers' own RoPE): their prompts take the fused kernels, not torch_model's prefill."""
    assert prefill.runs(load_spec(name))


@pytest.mark.parametrize("case", list(GEMMAS) + ["olmo2", "olmo3"])
def test_the_fused_prefill_runs_the_tiny_gemma_and_olmo(case):
    """The tiny configs of test_gpu_prefill's family test: Gemma 1 and OLMo 3 have no feature the others lack."""
    assert prefill.runs(spec_from_config({**GEMMAS, "olmo2": OLMO2, "olmo3": OLMO3}[case], case))


@pytest.mark.parametrize("name", ["olmoe-1b-7b", "mixtral-8x7b", "qwen3.5-0.8b", "phi-3.5-mini"])
def test_the_fused_prefill_still_refuses_experts_hybrids_and_longrope(name):
    assert not prefill.runs(load_spec(name))


# A sliding layers' RoPE with an attention factor (yarn here) is refused by the megakernel in one line, in both
# families that have a sliding layers' RoPE of their own
LOCAL_YARN_REFUSED = "megakernel is not built yet for yarn RoPE on the sliding layers"
LOCAL_YARN = {"gemma3": GEMMA3_LOCAL_YARN, "olmo3": OLMO3_LOCAL_YARN}


@pytest.mark.parametrize("case", list(LOCAL_YARN))
def test_the_kernel_plan_refuses_a_yarn_rope_on_the_sliding_layers(case):
    with pytest.raises(MkportError, match=LOCAL_YARN_REFUSED):
        plan_launch(spec_from_config(LOCAL_YARN[case], case), target_for_arch("sm_90"))


@pytest.mark.parametrize("command", KERNEL_COMMANDS)
@pytest.mark.parametrize("case", list(LOCAL_YARN))
def test_kernel_commands_refuse_a_yarn_rope_on_the_sliding_layers_in_one_line(tmp_path, monkeypatch, case, command):
    assert_kernel_command_refuses(tmp_path, monkeypatch, LOCAL_YARN[case], command, LOCAL_YARN_REFUSED)


def test_prompts_prefilled_together_have_a_row_table_whose_padding_continues_the_last_prompt():
    """prefill.prompt_rows: each row's prompt's first row and its sequence's K and V addresses, the padding rows the
    last prompt's (so they write only its cache, past its rows); prompts that do not fit the bucket are refused."""
    table = prefill.prompt_rows([3, 1, 2], [(100, 200), (300, 400), (500, 600)], 8)
    assert table.dtype == torch.int64 and table.tolist() == [[0, 0, 0, 3, 4, 4, 4, 4],
                                                             [100, 100, 100, 300, 500, 500, 500, 500],
                                                             [200, 200, 200, 400, 600, 600, 600, 600]]
    assert prefill.prompt_rows([4], [(1, 2)], 4).tolist() == [[0] * 4, [1] * 4, [2] * 4]
    for sizes, caches in (([5, 4], [(1, 2), (3, 4)]), ([2, 0], [(1, 2), (3, 4)]), ([2], [(1, 2), (3, 4)]), ([], [])):
        with pytest.raises(ValueError, match="do not fit"):
            prefill.prompt_rows(sizes, caches, 8)
