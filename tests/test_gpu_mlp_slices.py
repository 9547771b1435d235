"""Batch 1's MLP slices on the GPU (mlp_slices.cuh, the plan variants `v20-d` and `v20-dr` of `plan_variants.py
--mlp-slices`): a dense MLP's gate/up and down in one phase, a block a slice of the intermediate columns, then the
slices' partials summed in a fixed order; with the ring, each slice's gate and up rows by bulk copies. On small random
models whose rows fill a ring's chunks (hidden size 1024): a Qwen3 and a Qwen3.5 hybrid (its linear layers' MLPs too).
The diff passes and a fault in down is found at its layer's mlp_residual; the greedy tokens are the two phases' and the
hidden states theirs within float32 rounding (the sums go in another order); the same bits twice."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import validation_config
from mkport.kernel.interface import Tap
from mkport.kernel.spec import load_spec, open_model
from mkport.runtime.weights import write_random_weights
from test_gpu_moe import (assert_slices_pass_the_diff_and_find_a_fault, assert_slices_step_as_the_two_phases,
                          build_slice_variants, slice_variant)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = ("qwen3", "qwen3_5")
# (variant, width: None the rule's, 24 for these models); 48 of 2600 columns leaves a last slice of 8, whose gate rows
# are one chunk of a ring of 8 rows where the others' are three of 16
VARIANTS = [("slices", None), ("slices", 48), ("ring", 48)]


def _model(root, case: str) -> str:
    """The validation config of `case` at hidden size 1024 and 2600 intermediate columns (not a multiple of the rule's
    width), its random weights written as a checkpoint."""
    cfg, _ = validation_config(case)
    text = cfg.get("text_config", cfg)
    text.update(hidden_size=1024, intermediate_size=2600)
    folder = root / f"{case}-mlp-sliced"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    write_random_weights(load_spec(str(folder)), folder, seed=7)
    return str(folder)


def _variant(spec, kind: str, width: int | None):
    """slice_variant with MLP slices: the rule's width (mlp_slice_width) or `width`."""
    from mkport.kernel.launch_plan import with_mlp_slices

    return slice_variant(spec, kind, width, "mlp_slice", with_mlp_slices)


@pytest.fixture(scope="module")
def sliced_models(tmp_path_factory) -> dict[str, str]:
    """A _model of each case, and the builds the tests load."""
    root = tmp_path_factory.mktemp("mlp-sliced")
    models = {case: _model(root, case) for case in CASES}
    build_slice_variants(models.values(), _variant, VARIANTS)
    return models


@pytest.mark.parametrize("kind,width", VARIANTS, ids=["slices", "slices-w48", "ring-w48"])
@pytest.mark.parametrize("case", CASES)
def test_mlp_slices_pass_the_diff_and_find_a_fault_in_down(sliced_models, case, kind, width):
    spec = open_model(sliced_models[case]).spec
    plan = _variant(spec, kind, width)
    assert plan.mlp_slice and bool(plan.slice_ring_at) == (kind == "ring")
    layer = spec.num_layers // 2  # qwen3_5's layer 3: a full-attention layer
    assert_slices_pass_the_diff_and_find_a_fault(sliced_models[case], plan, layer, Tap.MLP_RESIDUAL)


@pytest.mark.parametrize("case", CASES)
def test_mlp_slices_step_as_the_two_phases_do_and_the_same_bits_twice(sliced_models, case):
    assert_slices_step_as_the_two_phases(sliced_models[case], _variant)
