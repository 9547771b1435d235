"""ERNIE 4.5, Helium, Seed-OSS, GLM, GLM-4 and EXAONE 4 on the megakernel (test_llama_variants.py: ERNIE's, Helium's
and GLM's RoPE on adjacent pairs, q and k rows reordered at load into the kernel's halves; Seed-OSS's and GLM's q/k/v
bias; GLM-4's sandwich norms; test_exaone4.py: post-norm layers with per-head q/k norms, sliding layers and an unrotated
full one), on the GPU: their tiny random models pass `mkport diff` against transformers' own classes in float32, alone
and as a batch of four; a fault in one layer's q, k or attention is found at that layer and op; the adjacent-pair
families run on the rows as the checkpoint has them (the reorder left out) fail at layer 0's q, EXAONE 4 with RoPE on
its full layer fails at that layer's q, and a fault in one of GLM-4's sandwich norms at the residual it makes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mkport.check.diff import kernel_diff
from mkport.kernel.spec import open_model
from mkport.runtime.weights import Checkpoint
from test_exaone4 import CONFIGS as EXAONES
from test_llama_variants import ADJACENT, CONFIGS as VARIANTS
from test_gpu_kernel_families import _diff, write_models

CONFIGS = {**VARIANTS, **EXAONES}

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return write_models(tmp_path_factory.mktemp("llama_variants"), CONFIGS)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_diff_passes_and_tokens_agree(models, case):
    result = _diff(models, case)
    assert result.report.passed, result.report.verdict()
    assert result.token_agreement >= 6, f"greedy tokens agree on {result.token_agreement}/8"


@pytest.mark.parametrize("case", list(CONFIGS))
def test_batch_of_four_passes(models, case):
    result = kernel_diff(open_model(models[case]), Checkpoint.open(models[case]), prompt_len=16, steps=4, seed=0,
                         batch=4)
    assert result.report.passed, result.report.verdict()


@pytest.mark.parametrize("case,op", [(c, op) for c in CONFIGS for op in ("q", "k", "attn")])
def test_injected_fault_is_found_at_its_layer_and_op(models, case, op):
    result = _diff(models, case, inject_at=(1, op))
    assert not result.report.passed and result.caught_injection, result.report.verdict()


@pytest.mark.parametrize("case", ADJACENT)
def test_without_the_reorder_q_fails_at_layer_0(models, case):
    rope = open_model(models[case]).spec.rope
    result = _diff(models, case, {"rope": dataclasses.replace(rope, adjacent_pairs=False)})
    assert not result.report.passed and result.report.first_failure.name == "layers.0.q", result.report.verdict()


def test_exaone4_with_rope_on_its_full_layer_fails_there(models):
    result = _diff(models, "exaone4", {"nope_layers": ()})
    assert not result.report.passed and result.report.first_failure.name == "layers.3.q", result.report.verdict()


@pytest.mark.parametrize("field,op", [("post_attn_norm", "attn_residual"), ("post_mlp_norm", "mlp_residual")])
def test_a_fault_in_a_glm4_post_norm_is_found_at_its_residual(models, monkeypatch, field, op):
    """Layer 1's post_self_attn_layernorm or post_mlp_layernorm (the kernel's copy only) moved by 0.5: found at the
    residual it makes. (A spec without the sandwich norms loads none of them, which the reference's mapping refuses.)"""
    import mkport.runtime.weights

    real = mkport.runtime.weights.load_weights

    def faulty(spec, checkpoint):
        w = real(spec, checkpoint)
        layers = list(w.layers)
        layers[1] = dataclasses.replace(layers[1], **{field: getattr(layers[1], field) + 0.5})
        return dataclasses.replace(w, layers=layers)

    monkeypatch.setattr(mkport.runtime.weights, "load_weights", faulty)
    result = _diff(models, "glm4")
    assert not result.report.passed and result.report.first_failure.name == f"layers.1.{op}", result.report.verdict()
