"""Qwen3.5 on the megakernel (linear_attention.cuh, the full layers' output gate and partial RoPE), on the GPU, batch 1:
the tiny random model of the CPU tests (conftest's qwen3_5: layers L L L F L F, two value heads to a q/k head, head_dim
64 with 16 rotated, MRoPE sections) passes `mkport diff` against transformers' own Qwen3.5 classes in float32 at every
tap, the Gated DeltaNet's included; a fault in a linear layer's op or a full layer's q is found at its layer and op; each
feature mis-set in the kernel alone (the reference and the prefill keep the true spec) fails where it bites; a state the
kernel did not read fails at that layer's conv or state read-out; two runs give the same bits; a prompt prefilled
(torch_model's chunked scan) then stepped equals one token prefilled and the rest stepped on the kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_validation_model
from mkport.check.diff import kernel_diff
from mkport.kernel.interface import Tap
from mkport.kernel.spec import open_model
from mkport.runtime.decoder import Decoder
from mkport.runtime.weights import Checkpoint, load_weights
from test_gpu_diff import prebuild
from tolerances import rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FULL = 3  # the tiny model's first full-attention layer; 0, 1, 2 and 4 are linear


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = make_validation_model(tmp_path_factory.mktemp("qwen35"), "qwen3_5", seed=3)
    prebuild([path])
    return path


def _diff(model: str, **kwargs):
    return kernel_diff(open_model(model), Checkpoint.open(model), prompt_len=16, steps=8, seed=0, **kwargs)


def test_diff_passes_at_every_tap(model):
    result = _diff(model)
    assert result.report.passed, result.report.verdict()
    names = {r.name for r in result.report.rows}
    for op in Tap.LINEAR_LAYER:
        assert Tap.layer(0, op) in names and Tap.layer(4, op) in names
    for op in Tap.LAYER:
        assert Tap.layer(FULL, op) in names
    assert result.token_agreement >= 6, f"greedy tokens agree on {result.token_agreement}/8"


@pytest.mark.parametrize("layer,op", [(0, "conv"), (1, "gates"), (4, "gated_norm"), (0, "attn_residual"),
                                      (FULL, "q"), (FULL, "k"), (FULL, "attn")])
def test_fault_is_found_at_its_layer_and_op(model, layer, op):
    result = _diff(model, inject_at=(layer, op))
    assert not result.report.passed and result.caught_injection, result.report.verdict()


# the spec fields replaced in the kernel alone (render), and the first traced state that must fail
ABLATIONS = {
    "plain-norm-weights": ({"norm_weight_offset": 0.0}, Tap.layer(0, Tap.ATTN_NORM)),  # w, not 1 + w
    "no-output-gate": ({"attn_output_gate": False}, Tap.layer(FULL, Tap.ATTN)),
    "full-rope": ({"rotary_dim": 0}, Tap.layer(FULL, Tap.Q)),  # all of head_dim rotated, not a quarter
}


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_kernel_ablation_fails_where_it_bites(model, monkeypatch, name):
    import mkport.runtime.decoder

    changes, first = ABLATIONS[name]
    real = mkport.runtime.decoder.render
    monkeypatch.setattr(mkport.runtime.decoder, "render",
                        lambda spec, plan: real(dataclasses.replace(spec, **changes), plan))
    result = _diff(model)
    assert not result.report.passed and result.report.first_failure.name == first, result.report.verdict()


@pytest.mark.parametrize("field,first", [("conv", Tap.CONV), ("recurrent", Tap.STATE_OUT)])
def test_the_prefilled_state_is_what_the_steps_read(model, monkeypatch, field, first):
    """Layer 0's conv or delta-rule state zeroed after the prompt's prefill: the first step fails at that op."""
    real = Decoder.prefill

    def prefill_then_forget(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        getattr(self.linear_state, field)[0].zero_()
        return out

    monkeypatch.setattr(Decoder, "prefill", prefill_then_forget)
    result = _diff(model)
    assert not result.report.passed and result.report.first_failure.name == Tap.layer(0, first), result.report.verdict()


def _decoder(model: str) -> tuple:
    spec = open_model(model).spec
    return spec, Decoder(spec, load_weights(spec, Checkpoint.open(model)), max_seq=64)


def test_steps_give_the_same_bits_twice(model):
    spec, dec = _decoder(model)
    runs = []
    for _ in range(2):
        dec.reset()
        dec.prefill(torch.arange(10) % spec.vocab_size)
        steps = []
        for t in range(12):
            dec.step(int(t * 7 % spec.vocab_size))
            steps.append(torch.cat([dec.logits, dec.linear_state.recurrent.flatten(), dec.linear_state.conv.flatten()]))
        runs.append(torch.stack(steps))
    assert torch.equal(runs[0], runs[1])
    assert torch.isfinite(runs[0]).all()


def test_prefill_then_steps_equals_stepping(model):
    """12 tokens prefilled (the chunked scan) against 1 prefilled and 11 stepped on the kernel, and against 5 then 7
    prefilled (the second part continuing the first's states): the same linear states and KV cache, then the same next
    steps. The states are fp32 but are fed by bf16 projections that cuBLAS (prefill) and the kernel's matvec (steps)
    round differently, so they agree at the steps' tolerance, not the scan's (measured on the H200: 3.1e-4)."""
    spec, one = _decoder(model)
    _, stepped = _decoder(model)
    _, parts = _decoder(model)
    tokens = (torch.arange(20) * 37 + 5) % spec.vocab_size
    one.prefill(tokens[:12])
    parts.prefill(tokens[:5])
    parts.prefill(tokens[5:12])
    stepped.prefill(tokens[:1])
    for t in tokens[1:12]:
        stepped.step(int(t))
    for other in (stepped, parts):
        assert rel(other.linear_state.recurrent, one.linear_state.recurrent) < 5e-3
        assert rel(other.linear_state.conv, one.linear_state.conv) < 5e-3
        assert rel(other.kv.k_layers[FULL][0, :, :12].float(), one.kv.k_layers[FULL][0, :, :12].float()) < 1e-2
    for t in tokens[12:]:
        for dec in (one, stepped, parts):
            dec.step(int(t))
        for other in (stepped, parts):
            assert rel(other.logits, one.logits) < 5e-3 and rel(other.hidden, one.hidden) < 5e-3
