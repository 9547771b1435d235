"""Qwen3.5 on the megakernel, the CPU half (issue 31): the plan (the delta rule's column split, a batch up to what
shared memory holds), the per-layer table with the linear layers' state pointers, a batch's states and their offsets,
the trace layout of the new ops, the rendered header, and compiles of the hybrid kernel without spills (tiny and 0.8B,
fast and trace builds, at every batch they plan). The GPU half is tests/test_gpu_qwen35.py."""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import QWEN3_5_0_8B, needs_nvcc, validation_config

from mkport.errors import MkportError
from mkport.kernel.build import compile_check
from mkport.kernel.gpu import target_for_arch
from mkport.kernel.interface import (LINEAR_PHASES, LINEAR_STATE_FIELDS, Tap, TraceLayout, layer_field_types,
                                     layer_fields, layer_writes, profile_phases, trace_layer_fields)
from mkport.kernel.launch_plan import BATCHES, largest_batch, linear_floats, plan_launch, vectors_layout
from mkport.kernel.render import render
from mkport.kernel.spec import load_spec, spec_from_config
from mkport.runtime.torch_model import LinearState


def _tiny():
    return spec_from_config(validation_config("qwen3_5")[0], "qwen3.5-tiny")


@pytest.fixture(params=["tiny", "0.8b"])
def spec(request):
    return _tiny() if request.param == "tiny" else load_spec("qwen3.5-0.8b")


def test_bundled_spec_is_the_published_config():
    assert load_spec("qwen3.5-0.8b") == spec_from_config(QWEN3_5_0_8B, "qwen3.5-0.8b")


def test_plan_at_batch_1(spec):
    plan = plan_launch(spec, target_for_arch("sm_90"))
    la = spec.linear_attention
    # the heads' column slices fill the grid without passing it where they can: 0.8B 16 heads x 8 slices of 16
    assert 8 <= plan.linear_columns <= 32 and la.value_head_dim % plan.linear_columns == 0
    if spec.name == "qwen3.5-0.8b":
        assert plan.linear_columns == 16 and la.num_value_heads * la.value_head_dim // 16 <= plan.grid
    assert "linear_out" in plan.split_k and plan.rows_per_warp["linear_in"] >= 1
    # shared memory holds the read-outs (out_proj's input) and the delta rule's scratch, the staged norm after both
    assert vectors_layout(spec, 1)["widest"] >= la.value_dim
    assert plan.norm_weights_at >= 4 * linear_floats(spec)


def test_plan_of_the_4b():
    """32 value heads of 128: 8 slices of 16 columns each (32 columns spilled), 256 items over the H200's 132 blocks;
    out_proj without split-K."""
    spec, target = load_spec("qwen3.5-4b"), target_for_arch("sm_90")
    plan = plan_launch(spec, target)
    assert plan.linear_columns == 16 and 32 * 128 // plan.linear_columns == 256
    assert vectors_layout(spec, 1)["widest"] == 9216 and plan.smem_bytes <= target.smem_per_block
    assert plan.split_k["linear_out"] == 1
    assert plan_launch(load_spec("qwen3.5-0.8b"), target).linear_columns == 16  # as before the cap


def test_plan_of_a_batch(spec):
    """Every batch up to what a block's shared memory holds (the 0.8B: the read-outs of 16 sequences, 2048 floats
    each, and the tiles' partials; its 32 do not fit); the vectors hold a sequence's read-outs for out_proj."""
    target = target_for_arch("sm_90")
    largest = largest_batch(spec, target)
    assert largest == (32 if spec.name == "qwen3.5-tiny" else 16)
    for batch in [b for b in BATCHES if b <= largest]:
        plan = plan_launch(spec, target, batch=batch)
        layout = vectors_layout(spec, batch)
        assert layout["widest"] >= spec.linear_attention.value_dim and layout["part"] == batch * layout["widest"]
        assert plan.batch == batch and plan.smem_bytes >= 4 * layout["floats"]


def test_a_batch_past_shared_memory_is_refused_in_one_line():
    with pytest.raises(MkportError, match="qwen3.5-0.8b at batch 32 needs .*: batch up to 24 fits") as e:
        plan_launch(load_spec("qwen3.5-0.8b"), target_for_arch("sm_90"), batch=32)
    assert "\n" not in str(e.value)


def test_a_batch_s_states_are_sequence_strided():
    """The decoder's states, [linear layer, sequence, ...]: sequence b's state of a layer starts b states (the header's
    LA_CONV_STATE, LA_DELTA_STATE floats) after sequence 0's, the pointer in the layer table, and sequence(b) views it
    (what the prefill advances is what the kernel reads)."""
    spec = _tiny()
    la, layers = spec.linear_attention, len(spec.linear_layers)
    state = LinearState.zeros(spec, "cpu", batch=3)
    conv_floats, delta_floats = (la.conv_kernel - 1) * la.conv_dim, la.num_value_heads * la.key_head_dim * la.value_head_dim
    header = render(spec, plan_launch(spec, target_for_arch("sm_90"), batch=4)).files["constants.cuh"]
    assert "constexpr int LA_CONV_STATE = (LA_CONV - 1) * LA_CONV_DIM;" in header
    assert "constexpr int LA_DELTA_STATE = LA_NV * LA_DK * LA_DV;" in header
    for slot in range(layers):
        for b in range(3):
            one = state.sequence(b)
            assert one.conv[slot].data_ptr() == state.conv[slot, 0].data_ptr() + 4 * b * conv_floats
            assert one.recurrent[slot].data_ptr() == state.recurrent[slot, 0].data_ptr() + 4 * b * delta_floats
    state.sequence(1).recurrent[0].fill_(2.0)  # a sequence's own, through the view
    assert state.recurrent[:, 1].eq(2.0).sum() == delta_floats and state.recurrent[:, [0, 2]].abs().sum() == 0
    state.sequence(1).reset()
    assert state.recurrent.abs().sum() == 0
    assert LinearState.zeros(spec, "cpu").conv.shape == (layers, la.conv_kernel - 1, la.conv_dim)  # one sequence's


@pytest.mark.parametrize("changes,words", [
    ({"rotary_dim": 63}, "partial rotary embeddings (RoPE on 63 of head_dim 256; it rotates an even number"),
    ("dk", "linear_key_head_dim=100"),
])
def test_shapes_the_ops_do_not_take_are_refused(changes, words):
    spec = load_spec("qwen3.5-0.8b")
    if changes == "dk":
        changes = {"linear_attention": dataclasses.replace(spec.linear_attention, key_head_dim=100)}
    with pytest.raises(MkportError, match=re.escape(words)):
        plan_launch(dataclasses.replace(spec, **changes), target_for_arch("sm_90"))


def test_layer_table_has_the_hybrid_fields_and_state(spec):
    fields = layer_fields(spec)
    assert fields[-len(LINEAR_STATE_FIELDS):] == LINEAR_STATE_FIELDS
    assert {"q_gate", "lin_in", "lin_conv", "lin_a_log", "lin_dt_bias", "lin_norm", "lin_out"} <= set(fields)
    types = dict((name, ctype) for ctype, name in layer_field_types(spec))
    assert types["conv_state"] == types["delta_state"] == "float*" and types["lin_in"] == "const bf16*"
    dense = load_spec("qwen3-0.6b")
    assert not set(LINEAR_STATE_FIELDS) & set(layer_fields(dense))
    assert all(ctype == "const bf16*" for ctype, _ in layer_field_types(dense))


def test_trace_layout_of_the_new_ops(spec):
    la, widths = spec.linear_attention, trace_layer_fields(spec)
    assert (widths[Tap.CONV], widths[Tap.GATES], widths[Tap.STATE_OUT], widths[Tap.GATED_NORM]) == (
        la.conv_dim, 2 * la.num_value_heads, la.value_dim, la.value_dim)
    layout = TraceLayout.of(spec)
    assert layout.layer_stride == sum(widths.values())
    for i in range(spec.num_layers):  # each layer kind's taps are written, the other kind's slots are not
        written = {op for op in widths if layer_writes(spec, i, op)}
        assert written == set(Tap.layer_ops(spec, i)), i
    assert all(layer_writes(load_spec("qwen3-0.6b"), 0, op) for op in Tap.LAYER)


def test_profile_phases_name_the_linear_layers(spec):
    phases = profile_phases(spec)
    first = spec.linear_layers[0]
    assert [p for p in phases if p.startswith(f"layers.{first}.")] == [f"layers.{first}.{x}" for x in LINEAR_PHASES]
    full = next(i for i in range(spec.num_layers) if not spec.is_linear(i))
    assert f"layers.{full}.attention" in phases


def test_header_has_the_hybrid_constants(spec):
    plan = plan_launch(spec, target_for_arch("sm_90"))
    header = render(spec, plan).files["constants.cuh"]
    la = spec.linear_attention
    assert "#define HAS_LINEAR_ATTENTION 1" in header and "#define HAS_Q_GATE 1" in header
    table = ", ".join(str(int(spec.is_linear(i))) for i in range(spec.num_layers))
    assert f"LINEAR_LAYER[L] = {{ {table} }};" in header
    assert f"constexpr int LA_COLS = {plan.linear_columns};" in header
    assert f"constexpr int ROPE_DIM = {spec.rope_dim};" in header and spec.rope_dim < spec.head_dim
    assert f"constexpr int LA_DK = {la.key_head_dim};" in header
    assert "float* conv_state;" in header and "float* delta_state;" in header
    # a full layer's qkv rows a sequence: q, k, v, then the output gate's rows
    assert "constexpr int QKV_STRIDE = QKV_ROWS + (HAS_Q_GATE ? Q_ROWS : 0);" in header
    dense = render(load_spec("qwen3-0.6b"), plan_launch(load_spec("qwen3-0.6b"), target_for_arch("sm_90")))
    text = dense.files["constants.cuh"]
    assert "#define HAS_LINEAR_ATTENTION 0" in text and "LINEAR_LAYER" not in text and "#define HAS_Q_GATE 0" in text


@needs_nvcc
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("trace", [False, True], ids=["fast", "trace"])
def test_compiles_without_spills(spec, trace, batch, tmp_path):
    """At every batch the spec plans for sm_90 (the tiny up to 32, the 0.8B up to 16): a batch's build reads its thread
    index where it uses it (common.cuh's thread_index), without which the 0.8B's spilled at every batch."""
    target = target_for_arch("sm_90")
    if batch > largest_batch(spec, target):
        pytest.skip(f"batch {batch} does not fit {spec.name}'s shared memory (test_a_batch_past_shared_memory_...)")
    plan = plan_launch(spec, target, batch=batch)
    result = compile_check(render(spec, plan).write(tmp_path), plan, target, trace=trace)
    kernel = next(k for k in result.kernels if k.kernel == "decode_step_kernel")
    assert result.ok and not kernel.spill_stores and not kernel.spill_loads, result.to_dict()
    assert kernel.registers <= plan.max_regs_per_thread
