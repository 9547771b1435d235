"""The megakernel of the families the plain-torch path ran first (issue 28), on the GPU: tiny random models (the CPU
tests' configs, whose soft-caps, windows and RoPE scalings bite on random weights) pass `mkport diff` against
transformers' own classes in float32, a fault injected into one layer's weights is found at exactly that layer and
op, and each feature switched off or mis-set in the kernel (rendered from a mis-set spec; the reference is built from
the true config) fails at the layer and op where it bites."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mkport.check.diff import kernel_diff
from mkport.kernel.spec import open_model
from mkport.runtime.weights import Checkpoint, write_random_weights
from test_rope_scaling import _config as rope_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# yarn factor 4 from an original length of 16: 24 positions reach past it
CONFIGS = {"yarn-llama": rope_config("llama", "yarn"), "yarn-qwen2": rope_config("qwen2", "yarn")}
LAYER, OPS = 1, ("attn_norm", "q", "k", "attn", "attn_residual", "mlp_residual")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root, out = tmp_path_factory.mktemp("kernel_families"), {}
    for seed, (case, config) in enumerate(CONFIGS.items()):
        folder = root / case
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        write_random_weights(open_model(str(folder)).spec, folder, seed=seed)
        out[case] = str(folder)
    return out


def _diff(models, case: str, spec_changes: dict | None = None, **kwargs):
    source = open_model(models[case])
    if spec_changes:
        source = dataclasses.replace(source, spec=dataclasses.replace(source.spec, **spec_changes))
    return kernel_diff(source, Checkpoint.open(models[case]), prompt_len=16, steps=8, seed=0, **kwargs)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_diff_passes_and_tokens_agree(models, case):
    result = _diff(models, case)
    assert result.report.passed, result.report.verdict()
    assert result.token_agreement >= 7, f"greedy tokens agree on {result.token_agreement}/8"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", list(CONFIGS))
def test_injected_fault_is_found_at_its_layer_and_op(models, case, op):
    result = _diff(models, case, inject_at=(LAYER, op))
    assert not result.report.passed and result.caught_injection, result.report.verdict()


# name -> case, the spec fields replaced in the kernel ("rope": fields of the spec's own RopeSpec), the first traced
# state that must fail
ABLATIONS = {
    "yarn-without-attention-factor": ("yarn-llama", {"rope": {"attention_factor": 1.0}}, "layers.0.q"),
    "yarn-as-linear": ("yarn-qwen2", {"rope": {"variant": "linear"}}, "layers.0.q"),  # no ramp: every frequency / 4
}


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_ablation_fails_where_the_feature_bites(models, name):
    case, changes, first = ABLATIONS[name]
    rope = open_model(models[case]).spec.rope
    if "rope" in changes:
        changes = {**changes, "rope": dataclasses.replace(rope, **changes["rope"])}
    faulty = _diff(models, case, changes)
    assert not faulty.report.passed and faulty.report.first_failure.name == first, faulty.report.verdict()


@pytest.mark.parametrize("case", list(CONFIGS))
def test_batch_of_four_passes(models, case):
    """Four sequences at their own positions (prompts of 16 to 19 rows), each against its own reference run."""
    result = kernel_diff(open_model(models[case]), Checkpoint.open(models[case]), prompt_len=16, steps=4, seed=0,
                         batch=4)
    assert result.report.passed, result.report.verdict()
