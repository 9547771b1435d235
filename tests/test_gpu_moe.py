"""Mixture of experts on the megakernel (moe.cuh), on the GPU: tiny random models of the four families (conftest's
moe_config: qwen3_moe with a dense layer among sparse ones, qwen2_moe's shared expert and sparse step, olmoe's q/k norm
over the projection, mixtral's top-2) pass `mkport diff` against transformers' own classes in float32 with the
kernel applying the reference's experts and its own router compared as flips; a fault in a sparse layer's experts
shows at that layer's expert block, one in attention at its op; the routing's family rule, switched in the kernel
alone, fails at the expert weights; a fast build's steps give the same bits twice."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import MOE_CASES
from mkport.kernel.interface import Tap
from mkport.kernel.spec import open_model
from mkport.runtime.decoder import Decoder
from mkport.runtime.weights import Checkpoint, load_weights
from test_gpu_diff import prebuild
from test_gpu_kernel_families import _diff

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SPARSE = {"qwen3_moe": 2, "qwen2_moe": 3, "olmoe": 1, "mixtral": 1}  # a sparse layer of each tiny model


@pytest.fixture(scope="module")
def models(moe_models) -> dict[str, str]:
    prebuild(moe_models.values())
    return moe_models


@pytest.mark.parametrize("case", MOE_CASES)
def test_diff_passes_on_the_reference_experts(models, case):
    result = _diff(models, case)
    assert result.forced_routing and result.report.passed, result.report.verdict()
    names = {r.name for r in result.report.rows}
    layer = SPARSE[case]
    assert {Tap.layer(layer, op) for op in Tap.MOE_LAYER} <= names  # every expert tap was compared
    assert result.token_agreement >= 6, f"greedy tokens agree on {result.token_agreement}/8"


@pytest.mark.parametrize("case,op", [(c, op) for c in MOE_CASES for op in ("q", "mlp_residual")])
def test_fault_is_found_at_its_layer(models, case, op):
    layer = SPARSE[case]
    result = _diff(models, case, inject_at=(layer, op))
    assert not result.report.passed and result.caught_injection, result.report.verdict()
    if op == "mlp_residual":
        assert result.report.first_failure.name == Tap.layer(layer, Tap.MOE)


def test_a_dense_layer_among_sparse_ones_keeps_its_mlp(models):
    result = _diff(models, "qwen3_moe", inject_at=(1, "mlp_residual"))  # layer 1: mlp_only_layers
    assert result.caught_injection and result.report.first_failure.name == "layers.1.mlp_residual"


@pytest.mark.parametrize("case", ["qwen3_moe", "olmoe"])
def test_the_wrong_renormalisation_fails_at_the_expert_weights(models, case):
    """qwen3_moe renormalises its top-k weights, olmoe does not: the kernel built with the other rule fails there."""
    spec = open_model(models[case]).spec
    moe = dataclasses.replace(spec.moe, norm_topk_prob=not spec.moe.norm_topk_prob)
    result = _diff(models, case, {"moe": moe})
    first = result.report.first_failure
    assert first is not None and first.name == Tap.layer(min(spec.moe.sparse_layers), Tap.EXPERT_WEIGHTS), \
        result.report.verdict()


@pytest.mark.parametrize("case", ["qwen2_moe", "mixtral"])
def test_steps_give_the_same_bits_twice(models, case):
    source = open_model(models[case])
    dec = Decoder(source.spec, load_weights(source.spec, Checkpoint.open(models[case])), max_seq=64)
    runs = []
    for _ in range(2):
        dec.reset()
        dec.prefill(torch.arange(10) % source.spec.vocab_size)
        steps = []
        for t in range(12):
            dec.step(int(t * 7 % source.spec.vocab_size))
            steps.append(dec.logits.clone())
        runs.append(torch.stack(steps))
    assert torch.equal(runs[0], runs[1])
    assert torch.isfinite(runs[0]).all()
