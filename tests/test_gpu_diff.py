"""`mkport diff` on the GPU for every bundled spec: the megakernel passes against the float32 reference,
and a fault injected into one layer's weights (kernel copy only) is reported at exactly that layer and op."""

from __future__ import annotations

import pytest
import torch

from mkport.diff import LAYER_OPS, kernel_diff
from mkport.spec import bundled_names, open_model
from mkport.weights import Checkpoint, random_weights_folder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("index,name", list(enumerate(bundled_names())))
def test_diff_passes_and_finds_the_injected_fault(index, name):
    source = open_model(name)
    spec = source.spec
    checkpoint = Checkpoint.open(random_weights_folder(spec, seed=0))
    clean = kernel_diff(source, checkpoint, prompt_len=16, steps=8, seed=0)
    assert clean.report.passed, clean.report.verdict()
    where = (spec.num_layers // 2, LAYER_OPS[index % len(LAYER_OPS)])
    faulty = kernel_diff(source, checkpoint, prompt_len=16, steps=8, seed=0, inject_at=where)
    assert not faulty.report.passed
    assert faulty.caught_injection, faulty.report.verdict()


@pytest.mark.parametrize("name,batch", [("qwen3-tts-0.6b-talker", 4), ("qwen3-tts-1.7b-talker", 8), ("qwen3-0.6b", 16)])
def test_batched_diff_passes_for_every_sequence_and_finds_the_fault(name, batch):
    """Each of `batch` sequences at its own position against its own reference run; a fault shows at its layer."""
    source = open_model(name)
    spec = source.spec
    checkpoint = Checkpoint.open(random_weights_folder(spec, seed=0))
    clean = kernel_diff(source, checkpoint, prompt_len=16, steps=4, seed=0, batch=batch)
    assert clean.report.passed, clean.report.verdict()
    assert clean.token_agreement >= 4 * batch - 1, f"greedy tokens agree on {clean.token_agreement}/{4 * batch}"
    where = (spec.num_layers // 2, "attn_residual")
    faulty = kernel_diff(source, checkpoint, prompt_len=16, steps=4, seed=0, inject_at=where, batch=batch)
    assert faulty.caught_injection, faulty.report.verdict()
