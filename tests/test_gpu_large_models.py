"""What large models' diffs rest on, on the GPU: counter-based random weights made there are the CPU's, bit for bit
(tests/test_random_weights.py checks on the CPU that the hash uses only exact integer ops); the layer-at-a-time
reference on the GPU gives the whole model's taps; mkport diff passes with both and finds a fault."""

from __future__ import annotations

import math

import pytest
import torch

from mkport.check.diff import kernel_diff
from mkport.check.reference import Reference
from mkport.kernel.spec import load_spec, open_model
from mkport.runtime.weights import (Checkpoint, CounterCheckpoint, _init_rule, checkpoint_shapes, counter_bits,
                                    counter_key, counter_tensor, load_weights, random_weights_folder, weight_names)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_counter_weights_on_the_gpu_are_the_cpus():
    """The hash on counters up to 2^42, each of a spec's rules at 4M elements, and a layer in the kernel's layout (the
    CPU makes ~2M elements a second: a whole model on it would take minutes)."""
    counters = torch.randint(0, 2**42, (1 << 22,), generator=torch.Generator().manual_seed(0))
    for key in ((0, 0), (2**32 - 1, 2**32 - 1), counter_key(9, "model.embed_tokens.weight")):
        assert torch.equal(counter_bits(key, counters), counter_bits(key, counters.cuda()).cpu())
    spec = load_spec("qwen3-tts-1.7b-code-predictor")
    names = weight_names(spec)
    shapes = checkpoint_shapes(spec, names)
    rules = {_init_rule(spec, names, name, shape): name for name, shape in shapes.items()}
    rules[("uniform", math.log(0.05), 0.0)] = "model.layers.0.linear_attn.A_log"  # Qwen3.5's only uniform
    for rule, name in rules.items():
        a = counter_tensor(counter_key(5, name), (1 << 22,), rule, "cpu")
        b = counter_tensor(counter_key(5, name), (1 << 22,), rule, "cuda", chunk=1 << 20)
        assert torch.equal(a.view(torch.int16), b.cpu().view(torch.int16)), name
    layer = {n: s for n, s in shapes.items() if ".layers.2." in n}
    cpu = CounterCheckpoint(spec, seed=5, device="cpu").read(layer)
    gpu = CounterCheckpoint(spec, seed=5, device="cuda").read(layer)
    for name in layer:
        assert gpu[name].is_cuda and torch.equal(cpu[name].view(torch.int16), gpu[name].cpu().view(torch.int16)), name
    # the kernel layout straight from the GPU, as mkport diff loads a model past COUNTER_WEIGHTS_BYTES
    assert load_weights(spec, CounterCheckpoint(spec, seed=5, device="cuda")).layers[0].wqkv.is_cuda


def test_layered_reference_on_the_gpu_gives_the_whole_models_taps():
    source = open_model("qwen3-0.6b")
    checkpoint = Checkpoint.open(random_weights_folder(source.spec, seed=0))
    tokens = torch.randint(0, source.spec.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    whole = Reference(source, checkpoint, device="cuda").run(tokens=tokens)
    layered = Reference(source, checkpoint, device="cuda", layered=True).run(tokens=tokens)
    assert set(whole.taps) == set(layered.taps)
    for name in whole.taps:  # the same kernels on the same shapes: expected bit-equal, at most float rounding
        torch.testing.assert_close(layered.taps[name], whole.taps[name], rtol=1e-6, atol=0, msg=name)
    torch.testing.assert_close(layered.logits, whole.logits, rtol=1e-6, atol=0)


@pytest.mark.parametrize("inject_at", [None, (14, "attn_residual")])
def test_diff_with_counter_weights_and_the_layered_reference(inject_at):
    """The path of a model past both thresholds (weights made on the GPU, reference a layer at a time), on a bundled
    spec small enough to run here: PASS, and an injected fault found at its layer and op."""
    source = open_model("qwen3-0.6b")
    result = kernel_diff(source, CounterCheckpoint(source.spec, seed=0, device="cuda"), layered=True, inject_at=inject_at)
    if inject_at is None:
        assert result.report.passed, result.report.to_text()
        assert result.token_agreement >= result.steps - 1
    else:
        assert result.caught_injection, result.report.to_text()
