"""mkport.check.diff: the comparison can fail, names the first divergence, and catches injected faults."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import validation_inputs
from mkport.runtime import torch_model
from mkport.check.diff import (
    LAYER_OPS,
    compare,
    cosine_bound,
    cpu_decode_taps,
    inject,
    parse_inject,
    schedule,
    tolerance,
)
from mkport.errors import MkportError
from mkport.check.reference import Reference
from mkport.kernel.spec import load_spec, open_model
from mkport.runtime.weights import Checkpoint, load_weights

_CACHE: dict = {}


def _setup(validation_models, case):
    """(spec, weights, reference taps incl. logits, inputs) per case, once per session."""
    if case not in _CACHE:
        model = validation_models[case]
        folder = model.rsplit(":", 1)[0] if model.endswith((":talker", ":code_predictor")) else model
        source, checkpoint = open_model(model), Checkpoint.open(folder)
        spec = source.spec
        inp = validation_inputs(spec, case, seed=3)
        out = Reference(source, checkpoint).run(
            tokens=inp["tokens"], positions=inp["positions"], table=inp["table"], head=inp["head"]
        )
        _CACHE[case] = (spec, load_weights(spec, checkpoint), dict(out.taps, logits=out.logits), inp)
    return _CACHE[case]


def _kernel(spec, w, inp, decode=False):
    x = torch_model.embed_inputs(spec, w, tokens=inp["tokens"], table=inp["table"])
    if decode:
        taps = cpu_decode_taps(spec, w, x, inp["positions"])
    else:
        taps = {}
        torch_model.forward(spec, w, x, inp["positions"], taps=taps)
    taps["logits"] = torch_model.logits(spec, w, taps["final_norm"], inp["head"])
    return taps


@pytest.mark.parametrize("op", LAYER_OPS)
@pytest.mark.parametrize("case", ["qwen3", "qwen2", "tts_code_predictor"])
def test_injected_fault_is_first_divergence(validation_models, case, op):
    spec, w, reference, inp = _setup(validation_models, case)
    layer = 1
    faulty = inject(w, spec, layer, op, seed=11)
    report = compare(_kernel(spec, faulty, inp, decode=True), reference, spec)
    bad = report.first_failure
    assert bad is not None, report.to_text()
    assert (bad.layer, bad.op) == (layer, op), report.to_text()
    assert not report.passed
    # everything before the fault is untouched by it and passes
    index = report.rows.index(bad)
    assert all(r.ok for r in report.rows[:index])


@pytest.mark.parametrize("case,layer,op", [("llama3", 0, "attn_norm"), ("qwen3_vl", 2, "mlp_residual"),
                                           ("tts_talker", 2, "attn_residual"), ("llama_linear", 0, "q"),
                                           ("qwen2_5_vl", 1, "k")])
def test_injected_fault_first_and_last_layer(validation_models, case, layer, op):
    spec, w, reference, inp = _setup(validation_models, case)
    report = compare(_kernel(spec, inject(w, spec, layer, op, seed=5), inp), reference, spec)
    assert (report.first_failure.layer, report.first_failure.op) == (layer, op), report.to_text()


def test_inject_copies(validation_models):
    spec, w, _, _ = _setup(validation_models, "qwen3")
    before = w.layers[1].wqkv.clone()
    faulty = inject(w, spec, 1, "k", seed=0)
    assert torch.equal(w.layers[1].wqkv, before)  # the original is untouched
    q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    changed = (faulty.layers[1].wqkv != before).any(dim=1)
    assert changed[q_rows : q_rows + kv_rows].all()
    assert not changed[:q_rows].any() and not changed[q_rows + kv_rows :].any()
    assert faulty.layers[1].wqkv.dtype == before.dtype
    assert faulty.layers[0] is w.layers[0]
    # seeded: the same fault twice
    assert torch.equal(inject(w, spec, 1, "k", seed=0).layers[1].wqkv, faulty.layers[1].wqkv)
    with pytest.raises(MkportError):
        inject(w, spec, spec.num_layers, "q", seed=0)
    with pytest.raises(MkportError):
        inject(w, spec, 0, "w_up", seed=0)


def test_reference_against_itself_passes(validation_models):
    spec, _, reference, _ = _setup(validation_models, "qwen3")
    report = compare(reference, reference, spec)
    assert report.passed
    assert all(r.rel_l2 == 0 and r.max_abs == 0 for r in report.rows)
    assert report.first_failure is None
    assert [(r.layer, r.op) for r in report.rows] == [(layer, op) for layer, op, _ in schedule(spec)]


def test_small_noise_passes_large_fails(validation_models):
    spec, _, reference, _ = _setup(validation_models, "qwen3")
    gen = torch.Generator().manual_seed(0)

    def noisy(rel):
        return {k: v + rel * v.pow(2).mean().sqrt() * torch.randn(v.shape, generator=gen) for k, v in reference.items()}

    assert compare(noisy(1e-3), reference, spec).passed
    report = compare(noisy(5e-2), reference, spec)
    assert (report.first_failure.layer, report.first_failure.op) == (None, "embed")


@pytest.mark.parametrize("name", ["embed", "layers.1.q", "layers.2.attn_residual", "final_norm", "logits"])
def test_corruptions_fail_at_that_tap(validation_models, name):
    spec, _, reference, _ = _setup(validation_models, "qwen3")
    value = reference[name]
    corruptions = {
        "zeroed": torch.zeros_like(value),
        "one zeroed row": torch.cat([value[:-1], torch.zeros_like(value[-1:])]),
        "rows shuffled": value[torch.arange(value.shape[0] - 1, -1, -1)],
        "scaled 5%": value * 1.05,
        "nan": torch.where(torch.arange(value.numel()).reshape(value.shape) == 3, torch.nan, value),
        "columns rolled": value.roll(1, dims=1),
    }
    for label, bad in corruptions.items():
        report = compare(dict(reference, **{name: bad}), reference, spec)
        assert not report.passed, label
        assert report.first_failure.name == name, label
        json.dumps(report.to_dict())  # NaN/inf metrics still serialise


def test_first_of_two_failures_is_reported(validation_models):
    spec, _, reference, _ = _setup(validation_models, "qwen3")
    kernel = dict(reference)
    kernel["layers.2.k"] = -reference["layers.2.k"]
    kernel["layers.0.attn"] = reference["layers.0.attn"] * 2
    report = compare(kernel, reference, spec)
    assert report.first_failure.name == "layers.0.attn"
    assert [r.name for r in report.rows if not r.ok] == ["layers.0.attn", "layers.2.k"]
    d = report.to_dict()
    assert d["first_failure"] == {"layer": 0, "op": "attn"} and d["passed"] is False
    assert "layer 0 attn" in report.verdict()


def test_compare_structure_errors(validation_models):
    spec, _, reference, _ = _setup(validation_models, "qwen3")
    missing = {k: v for k, v in reference.items() if k != "layers.1.attn"}
    with pytest.raises(MkportError, match="layers.1.attn"):
        compare(missing, reference, spec)
    with pytest.raises(MkportError, match="shape"):
        compare(dict(reference, embed=reference["embed"][:-1]), reference, spec)
    with pytest.raises(MkportError):
        compare({}, {}, spec)
    # without logits on either side, the logits row is simply absent
    no_logits = {k: v for k, v in reference.items() if k != "logits"}
    assert all(r.op != "logits" for r in compare(no_logits, no_logits, spec).rows)


def test_tolerance_policy_shape():
    assert tolerance(0) == pytest.approx(1e-2)
    assert tolerance(27) > tolerance(1) > tolerance(0)
    assert tolerance(27) < 0.05  # an injected fault (rel >= ~0.1) stays far above even at depth
    assert 0.998 < cosine_bound(tolerance(27)) < 1


def test_parse_inject():
    spec = load_spec("qwen3-0.6b")
    assert parse_inject("3:q") == (3, "q")
    assert parse_inject(" 27:mlp_residual", spec) == (27, "mlp_residual")
    for bad in ("3", "3:w_up", "x:q", "-1:q", "3:q:1", "", ":q"):
        with pytest.raises(MkportError) as e:
            parse_inject(bad)
        msg = str(e.value)
        assert "\n" not in msg and "attn_norm" in msg and "mlp_residual" in msg
    with pytest.raises(MkportError, match=r"0\.\.27"):
        parse_inject("28:q", spec)
