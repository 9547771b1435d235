"""Issue 27's kept design, v20 (v16 with a post-norm model's norms made in the phase after each sublayer; v16 is v7
with the attention splits' counter one acquire-release atomic and the last split's
combine loading its partials in waves; docs/benchmarks.md), its bound on the splits a KV head takes, the designs
measured slower and removed, the profile timeline's attention events, and plan_variants' plan variants (the host
picks a step's splits, so the plan alone changes them)."""

from __future__ import annotations

import re

import pytest

from mkport.errors import MkportError
from mkport.kernel.build import compile_check
from mkport.kernel.gpu import target_for_arch
from mkport.kernel.launch_plan import ATTN_MAX_SPLITS, KERNELS, THREADS, plan_launch
from mkport.kernel.render import render
from mkport.kernel.spec import bundled_names, load_spec, open_model
from conftest import load_script
from test_generate_check import needs_nvcc

SM90 = target_for_arch("sm_90")
TALKER = "qwen3-tts-0.6b-talker"
LLAMA_1B = "scripts/llama-3.2-1b.json"


@pytest.mark.parametrize("name,max_splits,at_2048", [
    (TALKER, 16, 16),  # 8 KV heads: 132 // 8 blocks a head, as before the bound
    ("gemma-3-1b", 32, 32),  # one KV head: 132 splits a head without the bound, 128 of them at context 2048
    ("gemma-2-2b", 32, 32),
    ("tinyllama-1.1b", 16, 16),  # 8 query heads a KV head: the combine holds 128 // 8 splits' partials
    ("phi-3.5-mini", 4, 4),  # 32 KV heads: the grid bounds it first
])
def test_a_kv_head_takes_at_most_the_bound_of_splits(name, max_splits, at_2048):
    plan = plan_launch(load_spec(name), SM90)
    assert plan.attn_max_splits == max_splits
    assert plan.attention_splits(2048) == at_2048
    assert plan.attention_splits(129) == min(max_splits, 9)  # 16 positions a split at short contexts, as before


@pytest.mark.parametrize("name", bundled_names())
def test_the_combine_holds_every_split_on_every_bundled_spec(name):
    """attention.cuh's last block copies every split's partials into the K/V tiles' shared memory, and their maxima and
    sums into the PV sums' (its static_assert says the same at compile time)."""
    spec = load_spec(name)
    plan = plan_launch(spec, SM90)
    assert spec.gqa_ratio * plan.attn_max_splits * 2 <= THREADS
    assert spec.gqa_ratio * plan.attn_max_splits <= plan.attn_tile
    assert plan.attn_max_splits <= ATTN_MAX_SPLITS


@pytest.mark.parametrize("kernel,why", [("v7", "v16 replaced it"), ("v15", "combine in waves"), ("v16", "v20 replaced it"),
                                        ("v17", "paired gate/up rows were slower"), ("v18", "no faster than v16")])
def test_the_designs_measured_slower_are_refused_with_why(kernel, why):
    with pytest.raises(MkportError, match=f"kernel {kernel} was removed .*{why}"):
        plan_launch(load_spec(TALKER), SM90, kernel)


@needs_nvcc
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", [TALKER, "gemma-3-1b", "olmo-2-0425-1b", LLAMA_1B])
@pytest.mark.parametrize("trace", [False, True])
def test_the_designs_compile_without_spills(kernel, name, trace, tmp_path):
    spec = open_model(name).spec
    plan = plan_launch(spec, SM90, kernel)
    result = compile_check(render(spec, plan).write(tmp_path), plan, SM90, trace=trace)
    assert result.ok, result.problems
    assert all(k.spill_stores == k.spill_loads == 0 for k in result.kernels)


@pytest.mark.parametrize("name", ["gemma-3-1b", "gemma-2-2b", "olmo-2-0425-1b", TALKER])
def test_post_norms_have_no_phase_or_barrier_of_their_own(name):
    """v20 makes a post-norm at the start of the phase after its sublayer: five phases a layer whatever the norms, and
    a post-norm model's o_proj and down leave their outputs in p.sub for gate_up's and the next qkv's fold."""
    from mkport.kernel.interface import profile_phases

    spec = load_spec(name)
    files = render(spec, plan_launch(spec, SM90)).files
    assert len(profile_phases(spec)) == 1 + 5 * spec.num_layers + (2 if spec.output_mode == "logits" else 1)
    assert f"constexpr bool POST_NORMS = {str(spec.post_norms).lower()};" in files["constants.cuh"]
    loop = files["decode_step.cu"].split("for (int layer = 0; layer < L; ++layer)")[1].split("residual_input_to_smem")[0]
    assert loop.count("grid_barrier(grid") == 5


def test_attention_chain_is_stamped_in_order():
    """The attention events sit between the phase's start and end in the timeline and in attention_item's order."""
    from mkport.kernel.interface import TIMELINE_EVENTS

    chain = ["attention_start", "attn_tile_ready", "attn_computed", "attn_counted", "attention_end"]
    assert [TIMELINE_EVENTS.index(e) for e in chain] == sorted(TIMELINE_EVENTS.index(e) for e in chain)
    spec = load_spec(TALKER)
    attention = render(spec, plan_launch(spec, SM90)).files["attention.cuh"]
    stamped = re.findall(r"STAMP\(p, layer, (ATTN_[A-Z_]+)\)", attention)
    assert stamped == ["ATTN_TILE_READY", "ATTN_COMPUTED", "ATTN_COUNTED"]


def test_plan_variants_change_the_splits_alone():
    pv = load_script("plan_variants")
    spec = load_spec("gemma-3-1b")
    plans = pv.variants(spec, SM90, 1, [32, 64], [8, 32, 200])
    assert set(plans) == {*KERNELS, "v20-s32", "v20-s64", "v20-m8", "v20-m32", "v20-m200"}
    splits = {label: plan.attention_splits(2048) for label, plan in plans.items()}
    # at most the grid's blocks a KV head (132) and the partials the combine holds (tile 128 // 4 heads), whatever is
    # asked
    assert splits == {"v20": 32, "v20-s32": 32, "v20-s64": 32, "v20-m8": 8, "v20-m32": 32, "v20-m200": 32}
    assert plans["v20-s64"].attn_max_splits == plans["v20"].attn_max_splits  # the same build but for plan.json
    assert {label for label, plan in plans.items() if plan.attention_splits(129) != 9} == {"v20-s32", "v20-s64", "v20-m8"}


@needs_nvcc
@pytest.mark.parametrize("kernel", KERNELS)
def test_the_designs_batched_builds_compile_without_spills(kernel, tmp_path):
    """A design's batch-1 switches must leave the batched build compiling (the talker at 8 sequences)."""
    spec = load_spec(TALKER)
    plan = plan_launch(spec, SM90, kernel, batch=8)
    result = compile_check(render(spec, plan).write(tmp_path), plan, SM90)
    assert result.ok, result.problems


# Plan variants beside the plain plan until the H200 has timed them against v20 (docs/benchmarks.md), each a LaunchPlan
# field and a define: a matvec's short last round split over warp pairs (tail_split, matvec.cuh's TAIL_SPLITS;
# `plan_variants.py --tail-split`: `v20-t`, faster on phi-3.5-mini alone so far) and down's input read with 16-byte
# loads (vector_act, mlp.cuh's gated_to_smem_vec; `--vector-act`: `v20-a`).
VARIANTS = {"tail_split": ("MK_TAIL_SPLIT", "v20-t"), "vector_act": ("MK_VECTOR_ACT", "v20-a")}


@pytest.mark.parametrize("field", VARIANTS)
def test_a_plan_variant_is_a_plan_of_its_own(field):
    import dataclasses

    define, label = VARIANTS[field]
    spec = load_spec("phi-3.5-mini")
    plain = plan_launch(spec, SM90)
    varied = dataclasses.replace(plain, **{field: True})
    # a plain plan's plan.json and header, part of its build's digest, are what they were before the variant
    assert field not in plain.to_dict() and varied.to_dict()[field] is True
    assert define not in render(spec, plain).files["constants.cuh"]
    assert f"#define {define} 1" in render(spec, varied).files["constants.cuh"]
    pv = load_script("plan_variants")
    assert pv.variants(spec, SM90, 1, **{field: True})[label] == varied
    # a batch's matvecs are tiled: neither applies
    assert set(pv.variants(spec, SM90, 2, **{field: True})) == set(KERNELS)


@needs_nvcc
@pytest.mark.parametrize("field,name,trace", [
    ("tail_split", "gemma-3-1b", True),  # head_dim 256 and post-norms in a trace build: the tightest
    ("tail_split", "qwen3-30b-a3b", False),  # the experts' matvecs
    ("tail_split", "qwen3.5-0.8b", False),  # a hybrid's linear_in
    ("tail_split", "mistral-7b-v0.3", False),  # 4096 rows leave too many for the warp pairs: strided there
    ("tail_split", "phi-3.5-mini", True),  # qkv's, o_proj's and down's last rounds split
    ("vector_act", "gemma-3-1b", True),  # GeGLU, post-norms, a trace build
    ("vector_act", "mistral-7b-v0.3", False),  # I = 14336: two groups of 16-byte loads
    ("vector_act", "gemma-2-2b", False),  # I = 9216: a group's last pairs past the end for some threads
    ("vector_act", "phi-3.5-mini", True),
    ("vector_act", "qwen3-tts-0.6b-talker", False),
    ("vector_act", "qwen3.5-0.8b", False),
    ("vector_act", "qwen3-30b-a3b", True),  # a mixture of experts: the experts' inputs stay scalar (mlp.cuh)
])
def test_a_plan_variant_compiles_without_spills(field, name, trace, tmp_path):
    import dataclasses

    spec = load_spec(name)
    plan = dataclasses.replace(plan_launch(spec, SM90), **{field: True})
    result = compile_check(render(spec, plan).write(tmp_path), plan, SM90, trace=trace)
    assert result.ok, result.problems


# Batch 1's expert slices (LaunchPlan.expert_slice, moe_slices.cuh; `plan_variants.py --expert-slices`: `v20-e`,
# `moe_bench.py --expert-slices`): a sparse layer's gate/up and down in one phase, a block a slice of an expert's columns.

def test_expert_slices_take_the_narrowest_width_whose_slices_fit_the_grid():
    import dataclasses
    import json
    import pathlib

    from mkport.kernel.launch_plan import expert_slice_count, expert_slice_width, moe_act_floats, with_expert_slices
    from mkport.kernel.spec import spec_from_config

    widths = {name: expert_slice_width(load_spec(name), SM90.sm_count)
              for name in ("qwen3-30b-a3b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b", "mixtral-8x7b")}
    assert widths == {"qwen3-30b-a3b": 48, "olmoe-1b-7b": 64, "qwen1.5-moe-a2.7b": 88, "mixtral-8x7b": 224}
    for name, width in widths.items():
        spec = load_spec(name)
        assert expert_slice_count(spec, width) == 128 <= SM90.sm_count < expert_slice_count(spec, width - 8)
    published = pathlib.Path(__file__).parent / "published_configs" / "qwen3.5-35b-a3b.json"
    hybrid = spec_from_config(json.loads(published.read_text()), "q35")
    assert expert_slice_width(hybrid, SM90.sm_count) == 40 and expert_slice_count(hybrid, 40) == 8 * 13 + 13
    assert expert_slice_width(load_spec("qwen3-0.6b"), SM90.sm_count) == 0  # dense: no experts to slice
    spec = load_spec("qwen3-30b-a3b")
    plain = plan_launch(spec, SM90)
    sliced = dataclasses.replace(plain, expert_slice=48)
    assert with_expert_slices(plain, spec) == sliced and with_expert_slices(plan_launch(spec, SM90, batch=2), spec) is None
    assert "expert_slice" not in plain.to_dict() and sliced.to_dict()["expert_slice"] == 48
    constants = render(spec, sliced).files["constants.cuh"]
    assert "#define MK_EXPERT_SLICES 1" in constants and "constexpr int EXPERT_SLICE = 48;" in constants
    assert "MK_EXPERT_SLICES" not in render(spec, plain).files["constants.cuh"]
    # each slice's partial down rows after batch 1's act layout
    assert moe_act_floats(spec, 1, 48) == moe_act_floats(spec) + 128 * spec.hidden_size
    pv = load_script("plan_variants")
    assert pv.variants(spec, SM90, 1, expert_slices=True)["v20-e"] == sliced
    assert "v20-e" not in pv.variants(load_spec("qwen3-0.6b"), SM90, 1, expert_slices=True)
    assert "v20-e" not in pv.variants(spec, SM90, 2, expert_slices=True)  # a batch reads the union (moe_batch.cuh)


@needs_nvcc
@pytest.mark.parametrize("name,trace", [
    ("qwen3-30b-a3b", True),  # 48 columns: 6 pieces a down row, 8 lanes
    ("qwen3-30b-a3b", False),
    ("olmoe-1b-7b", False),  # 64: 8 pieces, the 128 registers' edge (8 loads in flight spilled it)
    ("qwen1.5-moe-a2.7b", True),  # the shared expert's slices
    ("mixtral-8x7b", False),  # 224: 28 pieces, a warp a row
])
def test_expert_slices_compile_without_spills(name, trace, tmp_path):
    from mkport.kernel.launch_plan import with_expert_slices

    spec = load_spec(name)
    plan = with_expert_slices(plan_launch(spec, SM90), spec)
    result = compile_check(render(spec, plan).write(tmp_path), plan, SM90, trace=trace)
    assert result.ok, result.problems


def test_a_slice_ring_follows_the_blocks_shared_memory_where_bulk_copies_and_room_allow():
    import dataclasses

    from mkport.kernel.launch_plan import SLICE_RING_BYTES, with_slice_ring, with_expert_slices

    spec = load_spec("qwen3-30b-a3b")
    plain = plan_launch(spec, SM90)
    sliced = with_expert_slices(plain, spec)
    ring = with_slice_ring(sliced, spec, SM90)
    assert ring.slice_ring_at == -(-sliced.smem_bytes // 128) * 128 and ring.smem_bytes == ring.slice_ring_at + SLICE_RING_BYTES
    assert ring.smem_bytes <= SM90.smem_per_block and ring.to_dict()["slice_ring_at"] == ring.slice_ring_at
    constants = render(spec, ring).files["constants.cuh"]
    assert "#define MK_SLICE_RING 1" in constants and f"constexpr int SLICE_RING_AT = {ring.slice_ring_at};" in constants
    assert "MK_SLICE_RING" not in render(spec, sliced).files["constants.cuh"]
    assert with_slice_ring(plain, spec, SM90) is None  # no slices, no ring
    sm80 = target_for_arch("sm_80")
    assert with_slice_ring(dataclasses.replace(plan_launch(spec, sm80), expert_slice=48), spec, sm80) is None  # no bulk copies
    pv = load_script("plan_variants")
    assert pv.variants(spec, SM90, 1, expert_slices=True)["v20-er"] == ring


@needs_nvcc
@pytest.mark.parametrize("name,trace", [
    ("qwen3-30b-a3b", True),  # hidden 2048: chunks of 8 rows, 2 warps a row
    ("qwen3-30b-a3b", False),
    ("olmoe-1b-7b", False),
    ("mixtral-8x7b", False),  # hidden 4096: chunks of 4 rows, 4 warps a row; 221 KB of shared memory
])
def test_a_slice_ring_compiles_without_spills(name, trace, tmp_path):
    from mkport.kernel.launch_plan import with_slice_ring, with_expert_slices

    spec = load_spec(name)
    plan = with_slice_ring(with_expert_slices(plan_launch(spec, SM90), spec), spec, SM90)
    result = compile_check(render(spec, plan).write(tmp_path), plan, SM90, trace=trace)
    assert result.ok, result.problems


# Batch 1's MLP slices (LaunchPlan.mlp_slice, mlp_slices.cuh; `plan_variants.py --mlp-slices`: `v20-d`, `v20-dr`): a
# dense MLP's gate/up and down in one phase, a block a slice of the intermediate columns, as the experts' slices.

def test_mlp_slices_take_the_narrowest_width_whose_slices_fit_the_grid():
    import dataclasses

    from mkport.kernel.launch_plan import mlp_act_floats, mlp_slice_count, mlp_slice_width, with_mlp_slices

    widths = {name: mlp_slice_width(load_spec(name), SM90.sm_count)
              for name in ("qwen3.5-0.8b", TALKER, "qwen3-tts-1.7b-talker", LLAMA_1B)}
    assert widths == {"qwen3.5-0.8b": 32, TALKER: 24, "qwen3-tts-1.7b-talker": 48, LLAMA_1B: 64}
    for name, width in widths.items():
        spec = load_spec(name)
        assert mlp_slice_count(spec, width) <= SM90.sm_count < mlp_slice_count(spec, width - 8)
    assert mlp_slice_count(load_spec("qwen3.5-0.8b"), 32) == 112
    assert mlp_slice_width(load_spec("gemma-3-1b"), SM90.sm_count) == 0  # post-norms: the whole output before the add
    assert mlp_slice_width(load_spec("qwen3-30b-a3b"), SM90.sm_count) == 0  # a mixture: expert_slice_width's
    spec = load_spec("qwen3.5-0.8b")
    plain = plan_launch(spec, SM90)
    sliced = dataclasses.replace(plain, mlp_slice=32)
    assert with_mlp_slices(plain, spec) == sliced and with_mlp_slices(plan_launch(spec, SM90, batch=2), spec) is None
    assert "mlp_slice" not in plain.to_dict() and sliced.to_dict()["mlp_slice"] == 32
    constants = render(spec, sliced).files["constants.cuh"]
    assert "#define MK_MLP_SLICES 1" in constants and "constexpr int MLP_SLICE = 32;" in constants
    assert "MK_MLP_SLICES" not in render(spec, plain).files["constants.cuh"]
    # each slice's partial down rows after the gate and up rows
    assert mlp_act_floats(spec) == 2 * 3584 and mlp_act_floats(spec, 32) == 2 * 3584 + 112 * 1024
    pv = load_script("plan_variants")
    assert pv.variants(spec, SM90, 1, mlp_slices=True)["v20-d"] == sliced
    assert "v20-d" not in pv.variants(load_spec("gemma-3-1b"), SM90, 1, mlp_slices=True)
    assert "v20-d" not in pv.variants(spec, SM90, 2, mlp_slices=True)  # a batch's MLP runs on tensor cores


def test_a_slice_ring_goes_where_the_mlp_phase_leaves_the_blocks_memory_free():
    """Between the MLP phase's vectors and the next norm's staged weights where it fits (Qwen3.5-0.8B: the attention
    and delta-rule phases' memory, no more shared memory a block), else after everything (the 0.6B talker)."""
    from mkport.kernel.launch_plan import SLICE_RING_BYTES, vectors_layout, with_mlp_slices, with_slice_ring

    spec = load_spec("qwen3.5-0.8b")
    sliced = with_mlp_slices(plan_launch(spec, SM90), spec)
    ring = with_slice_ring(sliced, spec, SM90)
    assert ring.slice_ring_at == 4 * vectors_layout(spec, 1)["floats"] == 14336
    assert ring.slice_ring_at + SLICE_RING_BYTES <= ring.norm_weights_at and ring.smem_bytes == sliced.smem_bytes
    talker = load_spec(TALKER)
    sliced = with_mlp_slices(plan_launch(talker, SM90), talker)
    ring = with_slice_ring(sliced, talker, SM90)
    assert ring.slice_ring_at == -(-sliced.smem_bytes // 128) * 128 and ring.smem_bytes == ring.slice_ring_at + SLICE_RING_BYTES
    assert with_slice_ring(with_mlp_slices(plan_launch(load_spec("qwen3.5-4b"), SM90), load_spec("qwen3.5-4b")),
                           load_spec("qwen3.5-4b"), SM90) is None  # hidden 2560: a chunk is not whole rows
    pv = load_script("plan_variants")
    assert pv.variants(talker, SM90, 1, mlp_slices=True)["v20-dr"] == ring


@needs_nvcc
@pytest.mark.parametrize("name,ring,trace", [
    ("qwen3.5-0.8b", False, True),  # 32 columns: 4 pieces a down row
    ("qwen3.5-0.8b", True, False),  # the ring inside the free memory
    ("qwen3.5-0.8b", True, True),
    (TALKER, False, False),  # 24: 3 pieces, a row's last lane idle
    (TALKER, True, False),
    ("qwen3-tts-1.7b-talker", True, False),  # hidden 2048: chunks of 8 rows, 2 warps a row
    (LLAMA_1B, False, False),  # 64: 8 pieces
    ("qwen3.5-4b", False, False),  # hidden 2560, 72 columns
])
def test_mlp_slices_compile_without_spills(name, ring, trace, tmp_path):
    from mkport.kernel.launch_plan import with_mlp_slices, with_slice_ring

    spec = load_spec(name)
    plan = with_mlp_slices(plan_launch(spec, SM90), spec)
    if ring:
        plan = with_slice_ring(plan, spec, SM90)
    result = compile_check(render(spec, plan).write(tmp_path), plan, SM90, trace=trace)
    assert result.ok, result.problems
