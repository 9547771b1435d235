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
