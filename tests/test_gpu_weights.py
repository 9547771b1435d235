"""Counter-based random weights made on the GPU are the CPU's, bit for bit (tests/test_random_weights.py checks on
the CPU that the hash uses only exact integer ops; this is the check on a device)."""

from __future__ import annotations

import pytest
import torch

from mkport.kernel.spec import load_spec
from mkport.runtime.weights import CounterCheckpoint, checkpoint_shapes, load_weights, weight_names

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("name", ["qwen3-tts-1.7b-code-predictor", "qwen3-0.6b"])
def test_counter_weights_on_the_gpu_are_the_cpus(name):
    spec = load_spec(name)
    shapes = checkpoint_shapes(spec, weight_names(spec))
    cpu, gpu = CounterCheckpoint(spec, seed=5, device="cpu"), CounterCheckpoint(spec, seed=5, device="cuda")
    for tensor, shape in shapes.items():
        a, b = cpu.read({tensor: shape})[tensor], gpu.read({tensor: shape})[tensor]
        assert b.is_cuda
        assert torch.equal(a.view(torch.int16), b.cpu().view(torch.int16)), tensor
    # the kernel layout straight from the GPU, as mkport diff loads a model past COUNTER_WEIGHTS_BYTES
    weights = load_weights(spec, gpu)
    assert weights.layers[0].wqkv.is_cuda
    assert torch.equal(weights.layers[0].wqkv.cpu(), load_weights(spec, cpu).layers[0].wqkv)
