"""Issue 27's designs, to be measured on the GPU against v7 (each bit-identical to it): v15 (the attention splits'
counter one acquire-release atomic instead of two sequentially consistent fences around a relaxed one), v16 (v15, and
the last split's combine loading the partials in waves), v17 (v7 with a warp's gate and up rows of one i paired and
act stored by gate/up: down reads I floats, not 2 I); the profile timeline's attention events; plan_variants'
split-position variants of v7 (the host picks a step's splits, so the plan alone changes them)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from mkport.kernel.build import compile_check
from mkport.kernel.gpu import target_for_arch
from mkport.kernel.launch_plan import pairs_deal_evenly, plan_launch
from mkport.kernel.render import render
from mkport.kernel.spec import load_spec, open_model
from test_generate_check import needs_nvcc

SM90 = target_for_arch("sm_90")
TALKER = "qwen3-tts-0.6b-talker"


def _plan_variants():
    path = Path(__file__).resolve().parents[1] / "scripts" / "plan_variants.py"
    module_spec = importlib.util.spec_from_file_location("plan_variants", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


LLAMA_1B = "scripts/llama-3.2-1b.json"


@pytest.mark.parametrize("kernel,name,on", [
    ("v15", TALKER, {"ATTN_ACQ_REL"}),
    ("v16", TALKER, {"ATTN_ACQ_REL", "ATTN_COMBINE_IN_WAVES"}),
    ("v17", LLAMA_1B, {"PAIRED_GATE_UP"}),
    ("v17", TALKER, set()),  # 3072 pairs would give a warp 4 rows where 6144 rows give it 3: not paired
])
def test_the_designs_differ_from_v7_in_their_switches_alone(kernel, name, on):
    spec = open_model(name).spec
    v7, design = (render(spec, plan_launch(spec, SM90, k)).files for k in ("v7", kernel))
    for switch in ("ATTN_ACQ_REL", "ATTN_COMBINE_IN_WAVES", "PAIRED_GATE_UP"):
        assert re.search(rf"constexpr bool {switch} = {'true' if switch in on else 'false'};", design["constants.cuh"])
    changed = [line for line in design["constants.cuh"].splitlines() if line not in v7["constants.cuh"].splitlines()]
    assert sorted(line.split(" = ")[0].removeprefix("constexpr bool ") for line in changed) == sorted(on)
    assert {f for f in v7 if v7[f] != design[f]} == ({"constants.cuh"} if on else set()) | {"plan.json"}


def test_pairs_deal_evenly_where_the_busiest_warp_gets_no_more_rows():
    warps = 132 * 16
    assert pairs_deal_evenly(8192, warps)  # Llama-1B: 8 rows either way
    assert pairs_deal_evenly(6144, warps)  # the 1.7B talker: 6
    assert not pairs_deal_evenly(3072, warps)  # the 0.6B talker and Qwen3-0.6B: 4 against 3
    assert plan_launch(open_model(LLAMA_1B).spec, SM90, "v17", batch=2).paired_gate_up is False  # a batch pairs tiles


@needs_nvcc
@pytest.mark.parametrize("kernel,name", [("v15", TALKER), ("v16", TALKER), ("v16", "gemma-3-1b"), ("v16", LLAMA_1B),
                                         ("v17", LLAMA_1B), ("v17", "qwen3-tts-1.7b-talker")])
@pytest.mark.parametrize("trace", [False, True])
def test_the_designs_compile_without_spills(kernel, name, trace, tmp_path):
    spec = open_model(name).spec
    plan = plan_launch(spec, SM90, kernel)
    result = compile_check(render(spec, plan).write(tmp_path), plan, SM90, trace=trace)
    assert result.ok, result.problems
    assert all(k.spill_stores == k.spill_loads == 0 for k in result.kernels)


def test_attention_chain_is_stamped_in_order():
    """The attention events sit between the phase's start and end in the timeline and in attention_item's order."""
    from mkport.kernel.interface import TIMELINE_EVENTS

    chain = ["attention_start", "attn_tile_ready", "attn_computed", "attn_counted", "attention_end"]
    assert [TIMELINE_EVENTS.index(e) for e in chain] == sorted(TIMELINE_EVENTS.index(e) for e in chain)
    spec = load_spec(TALKER)
    attention = render(spec, plan_launch(spec, SM90)).files["attention.cuh"]
    stamped = re.findall(r"STAMP\(p, layer, (ATTN_[A-Z_]+)\)", attention)
    assert stamped == ["ATTN_TILE_READY", "ATTN_COMPUTED", "ATTN_COUNTED"]


def test_split_position_variants_take_fewer_longer_splits():
    pv = _plan_variants()
    spec = load_spec(TALKER)
    plans = pv.variants(spec, SM90, 1, [32, 64, 256])
    assert set(plans) == {"v7", "v15", "v16", "v17", "v7-s32", "v7-s64", "v7-s256"}
    splits = {label: plan.attention_splits(129) for label, plan in plans.items()}
    assert splits == {"v7": 9, "v15": 9, "v16": 9, "v17": 9, "v7-s32": 5, "v7-s64": 3, "v7-s256": 1}
    assert plans["v7-s64"].attn_max_splits == plans["v7"].attn_max_splits  # the same build but for plan.json
