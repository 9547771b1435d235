"""Random weights: today's sequential generator pinned byte for byte (every recorded number rests on it), and the
counter-based one (a tensor's values a function of seed, name and element index only) that large models use."""

from __future__ import annotations

import hashlib

import torch

from mkport.kernel.spec import load_spec
from mkport.runtime.weights import random_checkpoint

# sha256 over (name, shape, bf16 bits) of random_checkpoint(qwen3-tts-1.7b-code-predictor, seed 0), computed on main
# at 6e27806 before the counter-based generator was added beside it
PINNED_SEQUENTIAL = "67ca0a19c476eb046aeeb669b42e5dfaddd2eb48f9235351f8064f2dacabe56f"


def _digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def test_sequential_random_weights_are_unchanged():
    assert _digest(random_checkpoint(load_spec("qwen3-tts-1.7b-code-predictor"), seed=0)) == PINNED_SEQUENTIAL
