"""The families after the Llama lineage on the GPU: each feature switched off or mis-set in the megakernel (rendered
from a mis-set spec; the reference is built from the true config) fails `mkport diff` at the layer and op where it
bites; sliding windows checked in a batch and, at the bundled scale, at a context past the window. The clean runs
and injected faults of these configs are in test_gpu_diff.py (VALIDATION_CASES and the bundled specs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import FEATURE_ABLATIONS, make_validation_model

from mkport.check.diff import kernel_diff
from mkport.kernel.spec import open_model
from mkport.runtime.weights import Checkpoint, random_weights_folder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("family_models")
    return {case: make_validation_model(root, case, seed=i)
            for i, case in enumerate(sorted({case for case, _, _ in FEATURE_ABLATIONS.values()}))}


@pytest.mark.parametrize("name", list(FEATURE_ABLATIONS))
def test_kernel_ablation_fails_where_the_feature_bites(family_models, name):
    """16 prompt rows and 8 steps past a window of 5: the clean kernel passes, the mis-set one fails first at the
    feature's own layer and op."""
    case, changes, first = FEATURE_ABLATIONS[name]
    source = open_model(family_models[case])
    checkpoint = Checkpoint.open(family_models[case])
    clean = kernel_diff(source, checkpoint, prompt_len=16, steps=8, seed=0)
    assert clean.report.passed, clean.report.verdict()
    wrong = dataclasses.replace(source, spec=dataclasses.replace(source.spec, **changes))
    faulty = kernel_diff(wrong, checkpoint, prompt_len=16, steps=8, seed=0)
    assert not faulty.report.passed
    assert faulty.report.first_failure.name == first, faulty.report.verdict()


@pytest.mark.parametrize("case", ["mistral", "smollm3"])
def test_batched_sliding_windows(family_models, case):
    """Four sequences at their own positions, each past the window, against their own reference runs."""
    source = open_model(family_models[case])
    result = kernel_diff(source, Checkpoint.open(family_models[case]), prompt_len=16, steps=4, seed=0, batch=4)
    assert result.report.passed, result.report.verdict()


@pytest.mark.parametrize("batch", [1, 2])
def test_window_shorter_than_the_splits(family_models, batch):
    """600 positions: a step splits each KV head's sequence over 32 blocks (launch_plan.ATTN_MAX_SPLITS) of ~19
    positions (a batch of 2: 16 each), and a window of 5 leaves all but one or two splits empty (no rows: max -inf,
    sum 0, a zero weight in the combination)."""
    model = family_models["mistral"]
    result = kernel_diff(open_model(model), Checkpoint.open(model), prompt_len=600, steps=4, seed=0, batch=batch)
    assert result.report.passed, result.report.verdict()


@pytest.mark.serial  # a 14.5 GB checkpoint and its float32 reference (conftest.LARGE_CHECKPOINT_BYTES)
def test_bundled_sliding_spec_past_its_window():
    """Mistral-7B-v0.1 (a window of 4096 on all 32 layers) decoding at positions 4100-4103: every layer's attention
    starts 5 to 8 rows in."""
    source = open_model("mistral-7b-v0.1")
    checkpoint = Checkpoint.open(random_weights_folder(source.spec, seed=0))
    result = kernel_diff(source, checkpoint, prompt_len=4100, steps=4, seed=0)
    assert result.report.passed, result.report.verdict()
    assert result.token_agreement >= 3


@pytest.mark.parametrize("what,first", [("kv", "layers.0.k"), ("gate_up", "layers.0.mlp_residual")])
def test_phi3_wrong_split_fails_in_the_kernel(family_models, what, first, monkeypatch):
    """phi3's fused q/k/v and gate/up split in the wrong order at load: the megakernel fails at that op."""
    import mkport.runtime.weights
    from test_families import swapped_split

    real = mkport.runtime.weights.load_weights
    monkeypatch.setattr(mkport.runtime.weights, "load_weights", lambda spec, ck: swapped_split(real(spec, ck), spec, what))
    model = family_models["phi3"]
    faulty = kernel_diff(open_model(model), Checkpoint.open(model), prompt_len=16, steps=8, seed=0)
    assert not faulty.report.passed and faulty.report.first_failure.name == first, faulty.report.verdict()
