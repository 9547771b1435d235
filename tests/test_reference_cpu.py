"""mkport.runtime.torch_model (the kernel's schedule, in the kernel's weight layout) against the transformers
reference (mkport.check.reference), tap by tap, for every family and role, on CPU with tiny random models."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from conftest import VALIDATION_CASES, validation_inputs
from mkport.runtime import torch_model
from mkport.check.diff import LAYER_OPS, compare, cpu_decode_taps, schedule
from mkport.errors import MkportError
from mkport.check.reference import Reference
from mkport.kernel.interface import Tap, TraceLayout, trace_layer_fields
from mkport.kernel.spec import load_spec, open_model
from mkport.runtime.weights import Checkpoint, load_weights


def _folder(model: str) -> str:
    return model.rsplit(":", 1)[0] if model.endswith((":talker", ":code_predictor")) else model


_CACHE: dict = {}


def _setup(validation_models, case):
    """(spec, kernel weights, Reference) per case, built once per session."""
    if case not in _CACHE:
        model = validation_models[case]
        source, checkpoint = open_model(model), Checkpoint.open(_folder(model))
        _CACHE[case] = (source.spec, load_weights(source.spec, checkpoint), Reference(source, checkpoint))
    return _CACHE[case]


def _kernel_prefill(spec, w, inp):
    taps: dict = {}
    x = torch_model.embed_inputs(spec, w, tokens=inp["tokens"], table=inp["table"])
    hidden = torch_model.forward(spec, w, x, inp["positions"], taps=taps)
    taps["logits"] = torch_model.logits(spec, w, hidden, inp["head"])
    return taps


def _reference(ref, inp):
    out = ref.run(tokens=inp["tokens"], positions=inp["positions"], table=inp["table"], head=inp["head"])
    return dict(out.taps, logits=out.logits), out


@pytest.mark.parametrize("case", VALIDATION_CASES)
def test_torch_model_matches_transformers(validation_models, case):
    """fp32 vs fp32 from the same bf16 weights: the weight mapping, RoPE variant, MRoPE streams, q/k norm,
    biases, input projection and heads must all agree to float32 rounding."""
    spec, w, ref = _setup(validation_models, case)
    inp = validation_inputs(spec, case, seed=1)
    kernel = _kernel_prefill(spec, w, inp)
    reference, out = _reference(ref, inp)
    assert set(kernel) == set(reference)
    report = compare(kernel, reference, spec)
    assert report.passed, report.to_text()
    assert len(report.rows) == 3 + 6 * spec.num_layers
    worst = max(report.rows, key=lambda r: r.rel_l2)
    assert worst.rel_l2 < 2e-4, f"{worst.name}: rel_l2 {worst.rel_l2:.3g} is more than fp32 rounding"
    assert out.hidden.shape == (inp["tokens"].shape[0], spec.hidden_size)
    assert out.logits.shape == (inp["tokens"].shape[0], spec.vocab_size)


@pytest.mark.parametrize("case", VALIDATION_CASES)
def test_bf16_kv_decode_within_tolerance(validation_models, case):
    """The kernel's numerics (token-by-token decode, bf16 KV cache) stay inside the tolerance policy."""
    spec, w, ref = _setup(validation_models, case)
    inp = validation_inputs(spec, case, seed=2)
    x = torch_model.embed_inputs(spec, w, tokens=inp["tokens"], table=inp["table"])
    kernel = cpu_decode_taps(spec, w, x, inp["positions"])
    kernel["logits"] = torch_model.logits(spec, w, kernel["final_norm"], inp["head"])
    reference, _ = _reference(ref, inp)
    report = compare(kernel, reference, spec)
    assert report.passed, report.to_text()
    # the bf16 cache is visible: attention outputs are not bit-equal to the fp32 reference
    assert max(r.rel_l2 for r in report.rows if r.op == "attn") > 1e-4


@pytest.mark.parametrize("case", ["qwen3", "tts_talker", "tts_code_predictor"])
def test_tap_widths_match_trace_layout(validation_models, case):
    spec, _, ref = _setup(validation_models, case)
    inp = validation_inputs(spec, case)
    _, out = _reference(ref, inp)
    fields = trace_layer_fields(spec)
    layout = TraceLayout.of(spec)
    n = inp["tokens"].shape[0]
    assert out.taps["embed"].shape == (n, layout.hidden)
    assert out.taps["final_norm"].shape == (n, layout.hidden)
    for i in range(spec.num_layers):
        for op, width in fields.items():
            assert out.taps[f"layers.{i}.{op}"].shape == (n, width), (i, op)
    assert sum(fields.values()) == layout.layer_stride


@pytest.mark.parametrize("case", ["qwen3", "tts_code_predictor"])
def test_every_side_names_the_same_taps(validation_models, case):
    """One list of names (interface.Tap): the trace layout, torch_model, the reference and the diff schedule."""
    spec, w, ref = _setup(validation_models, case)
    inp = validation_inputs(spec, case)
    _, out = _reference(ref, inp)
    ours = _kernel_prefill(spec, w, inp)
    scheduled = [name for _, _, name in schedule(spec)]
    assert list(TraceLayout.of(spec).layer_offsets) == list(Tap.LAYER) == list(LAYER_OPS)
    assert set(ours) == set(scheduled) == set(out.taps) | {Tap.LOGITS}
    assert scheduled[:2] == [Tap.EMBED, Tap.layer(0, Tap.ATTN_NORM)] and scheduled[-1] == Tap.LOGITS


def test_mrope_streams_matter(validation_models):
    """Qwen3-VL: distinct (t, h, w) positions change q/k, and a kernel that collapsed the streams fails."""
    spec, w, ref = _setup(validation_models, "qwen3_vl")
    inp = validation_inputs(spec, "qwen3_vl")
    assert not torch.equal(inp["positions"][0], inp["positions"][1])
    reference, _ = _reference(ref, inp)
    collapsed = dict(inp, positions=inp["positions"][0].expand(3, -1).clone())
    kernel = _kernel_prefill(spec, w, collapsed)
    report = compare(kernel, reference, spec)
    assert not report.passed
    assert (report.first_failure.layer, report.first_failure.op) == (0, "q")


def test_talker_equal_positions_is_plain_rope(validation_models):
    """Talker positions are equal in all streams: interleaved MRoPE then equals 1-D RoPE, so a shift of
    every position by the same offset must change q (RoPE is applied) but not the attention output
    (RoPE is relative)."""
    spec, _, ref = _setup(validation_models, "tts_talker")
    inp = validation_inputs(spec, "tts_talker")
    a, _ = _reference(ref, inp)
    b, _ = _reference(ref, dict(inp, positions=inp["positions"] + 100))
    assert (a["layers.0.q"] - b["layers.0.q"]).abs().max() > 1e-2
    torch.testing.assert_close(a["layers.0.attn"], b["layers.0.attn"], rtol=1e-4, atol=1e-4)


def test_code_predictor_embeds_input(validation_models):
    """The predictor's inputs are talker-width embeddings; both sides project them to the predictor width."""
    spec, w, ref = _setup(validation_models, "tts_code_predictor")
    assert spec.input_projection and spec.input_dim != spec.hidden_size
    gen = torch.Generator().manual_seed(7)
    n = 6
    embeds = torch.randn(n, spec.input_dim, generator=gen)
    positions = torch.arange(n).expand(3, n)
    out = ref.run(embeds=embeds, positions=positions, head=1)
    taps: dict = {}
    x = torch_model.embed_inputs(spec, w, embeds=embeds)
    hidden = torch_model.forward(spec, w, x, positions, taps=taps)
    taps["logits"] = torch_model.logits(spec, w, hidden, 1)
    report = compare(taps, dict(out.taps, logits=out.logits), spec)
    assert report.passed, report.to_text()
    assert out.taps["embed"].shape == (n, spec.hidden_size)
    # a different head gives different logits (the head index is honoured)
    assert not torch.allclose(ref.run(embeds=embeds, positions=positions, head=0).logits, out.logits)


def test_rotary_wrapper_restored_even_on_error(validation_models):
    _, _, ref = _setup(validation_models, "qwen3")
    modeling = sys.modules[type(ref.base.layers[0].self_attn).__module__]
    original = modeling.apply_rotary_pos_emb
    with pytest.raises(Exception):
        ref.run(embeds=torch.randn(4, 7))  # wrong width: fails inside the model
    assert modeling.apply_rotary_pos_emb is original
    ref.run(tokens=torch.arange(4))
    assert modeling.apply_rotary_pos_emb is original
    assert not any(layer._forward_hooks or layer._forward_pre_hooks for layer in ref.base.layers)


def test_run_input_errors(validation_models):
    _, _, ref = _setup(validation_models, "qwen3")
    with pytest.raises(MkportError):
        ref.run()
    with pytest.raises(MkportError):
        ref.run(tokens=torch.arange(4), positions=torch.stack([torch.arange(4), torch.arange(4), torch.arange(4) + 1]))
    with pytest.raises(MkportError):
        ref.run(tokens=torch.arange(4), positions=torch.arange(4)[None])


def test_open_model_matches_load_spec(validation_models):
    src = open_model("qwen3-tts-0.6b-code-predictor")
    assert src.config["model_type"] == "qwen3_tts" and src.part == "code_predictor"
    assert src.spec == load_spec("qwen3-tts-0.6b-code-predictor") and src.spec.name == "qwen3-tts-0.6b-code-predictor"
    src = open_model(validation_models["tts_talker"])
    assert src.part == "talker" and "talker_config" in src.config and src.spec.name.endswith("-talker")
    other = src.with_part("code_predictor")
    assert other.spec == load_spec(validation_models["tts_talker"].replace(":talker", ":code_predictor"))
    src = open_model(validation_models["qwen3"])
    assert src.config["model_type"] == "qwen3" and src.part is None
    with pytest.raises(MkportError):
        open_model("/nonexistent/model")


def test_qwen2_5_vl_mrope_read_as_interleaved_fails_at_layer_0s_q(validation_models):
    """The validation case's positions are an image-like block (distinct t, h, w streams): Qwen2.5-VL's contiguous
    sections taken as Qwen3-VL's interleaved ones rotate q differently from transformers' Qwen2.5-VL text model."""
    spec, w, ref = _setup(validation_models, "qwen2_5_vl")
    wrong = dataclasses.replace(spec, rope=dataclasses.replace(spec.rope, mrope_interleaved=True))
    inp = validation_inputs(spec, "qwen2_5_vl", seed=1)
    reference, _ = _reference(ref, inp)
    report = compare(_kernel_prefill(wrong, w, inp), reference, spec)
    assert not report.passed and report.first_failure.name == "layers.0.q", report.to_text()


def test_the_qwen_vl_reference_is_chosen_by_the_text_decoders_type():
    from mkport.check.reference import vl_text_type

    assert vl_text_type({"model_type": "qwen2_5_vl", "hidden_size": 64}) == "qwen2_5_vl_text"  # flat, as released
    assert vl_text_type({"model_type": "qwen3_vl", "text_config": {}}) == "qwen3_vl_text"
    assert vl_text_type({"model_type": "qwen2_vl_text"}) == "qwen2_vl_text"
    # a wrapper whose text_config is another decoder has no Qwen-VL reference (Reference then refuses it in one line)
    assert vl_text_type({"model_type": "qwen2_5_vl", "text_config": {"model_type": "qwen2"}}) is None
    assert vl_text_type({"model_type": "llama"}) is None
