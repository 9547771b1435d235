"""Qwen3.5 (hybrid: Gated DeltaNet linear attention + gated full attention with partial RoPE), the CPU half: its spec
and refusals, its weights, mkport's plain-torch path (torch_model, TorchDecoder) against transformers' own Qwen3.5
classes on a tiny random model, the chunked scan against the recurrence, prefill-then-decode against one pass, and
faults in the new ops found by the diff at their layer and op. The megakernel runs the family at every batch that fits
a block's shared memory: the kernel commands plan a batch (tested here; the kernel's CPU side is
tests/test_qwen35_kernel.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import (QWEN3_5_0_8B, assert_config_refused, reference_taps, torch_path_against_transformers,
                      validation_inputs)
from mkport.check.diff import inject, parse_inject, schedule
from mkport.check.reference import Reference, cache_argument, linear_attention_dispatch, torch_path
from mkport.errors import MkportError
from mkport.kernel.gpu import target_for_arch
from mkport.kernel.interface import Tap
from mkport.kernel.launch_plan import largest_batch, plan_launch
from mkport.kernel.spec import _bundled_path, load_spec, open_model, spec_from_config
from mkport.runtime import torch_model
from mkport.runtime.torch_decoder import TorchDecoder
from mkport.runtime.weights import Checkpoint, checkpoint_shapes, load_weights, random_checkpoint, weight_names
from tolerances import rel

TEXT = QWEN3_5_0_8B["text_config"]


def _text(**overrides) -> dict:
    return dict(TEXT, **overrides)


# -- spec --------------------------------------------------------------------------------------------------------

def _assert_qwen35_shape(s, layers: int, hidden: int, heads: int, kv_heads: int, value_heads: int) -> None:
    """What the published Qwen3.5 configs share: head_dim 256 with a quarter rotated (MRoPE sections, theta 1e7), every
    4th layer full, 16 DeltaNet q/k heads of 128 and `value_heads` value heads of 128, conv 4, (1 + w) norms, the output
    gate, q/k norms, tied embeddings."""
    assert (s.family, s.num_layers, s.hidden_size, s.head_dim, s.num_heads, s.num_kv_heads) == (
        "qwen3_5", layers, hidden, 256, heads, kv_heads)
    assert s.linear_layers == tuple(i for i in range(layers) if i % 4 != 3)
    la = s.linear_attention
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel) == (
        16, value_heads, 128, 128, 4)
    qk, v = 2 * 16 * 128, value_heads * 128  # the conv runs over q, k and v; z, a and b are read beside it
    assert (la.conv_dim, la.value_dim, la.in_rows) == (qk + v, v, qk + v + v + 2 * value_heads)
    assert s.rotary_dim == 64 and s.rope_dim == 64 and s.rope.theta == 1e7
    assert (s.rope.variant, s.rope.mrope_section, s.rope.mrope_interleaved) == ("mrope", (11, 11, 10), True)
    assert s.norm_weight_offset == 1.0 and s.attn_output_gate and s.qk_norm and s.tie_embeddings


def test_spec_of_the_published_0_8b_config():
    s = spec_from_config(QWEN3_5_0_8B, "qwen3.5-0.8b")
    _assert_qwen35_shape(s, layers=24, hidden=1024, heads=8, kv_heads=2, value_heads=16)
    # the text config alone is the same decoder
    assert spec_from_config(TEXT, "qwen3.5-0.8b") == s


def test_spec_of_the_4b_config():
    """The bundled qwen3.5-4b (Qwen/Qwen3.5-4B's fields from partial public copies, docs/validation.md): 32 layers of
    2560, 16 q heads to 4 KV heads, 2 DeltaNet value heads to a q/k head, every 4th layer full as transformers reads
    it."""
    from transformers import Qwen3_5TextConfig

    config = json.loads(_bundled_path("qwen3.5-4b.json").read_text())
    text = config["text_config"]
    s = spec_from_config(config, "qwen3.5-4b")
    assert load_spec("qwen3.5-4b") == s
    _assert_qwen35_shape(s, layers=32, hidden=2560, heads=16, kv_heads=4, value_heads=32)
    assert (s.intermediate_size, s.vocab_size, s.max_position, s.rms_eps) == (9216, 248320, 262144, 1e-6)
    theirs = Qwen3_5TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    assert theirs.layer_types == text["layer_types"] == [
        "linear_attention" if s.is_linear(i) else "full_attention" for i in range(32)]
    assert (theirs.linear_num_value_heads, theirs.rope_parameters["partial_rotary_factor"]) == (32, 0.25)
    assert spec_from_config(text, "qwen3.5-4b") == dataclasses.replace(s, tie_embeddings=False)


@pytest.mark.parametrize("fields", [
    {"full_attention_interval": 4}, {"full_attention_interval": 2}, {"full_attention_interval": 3},
    {"layer_types": ["full_attention", "linear_attention"] * 3},
], ids=["interval4", "interval2", "interval3", "explicit"])
def test_layer_kinds_are_transformers(fields):
    """layer_types, or every full_attention_interval-th layer full: as Qwen3_5TextConfig reads them."""
    from transformers import Qwen3_5TextConfig

    cfg = {k: v for k, v in TEXT.items() if k not in ("layer_types", "full_attention_interval")}
    cfg.update(fields, num_hidden_layers=6)
    ours = spec_from_config(cfg, "q")
    theirs = Qwen3_5TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"}).layer_types
    assert [("linear_attention" if ours.is_linear(i) else "full_attention") for i in range(6)] == theirs


def test_defaults_are_qwen3_5_text_configs():
    """Fields left out take Qwen3_5TextConfig's defaults: head_dim 256, partial_rotary_factor 0.25, the DeltaNet
    shape 16/32 heads of 128, a conv of 4, every 4th layer full."""
    from transformers import Qwen3_5TextConfig

    cfg = {k: TEXT[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "num_key_value_heads")}
    s, theirs = spec_from_config(cfg, "q"), Qwen3_5TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    la = s.linear_attention
    assert s.head_dim == theirs.head_dim == 256
    assert s.rotary_dim == int(theirs.head_dim * theirs.rope_parameters["partial_rotary_factor"]) == 64
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel) == (
        theirs.linear_num_key_heads, theirs.linear_num_value_heads, theirs.linear_key_head_dim,
        theirs.linear_value_head_dim, theirs.linear_conv_kernel_dim)
    assert s.rope.variant == "standard"  # no mrope_section: all streams equal in text, the plain rotation


REFUSALS = {
    "unknown-layer-type": (_text(layer_types=["linear_attention", "sliding_attention"] * 12), "sliding_attention"),
    "key-heads-dividing": (_text(linear_num_key_heads=6), "linear_num_key_heads=6 must divide"),
    "no-output-gate": (_text(attn_output_gate=False), "attn_output_gate=false"),
    "odd-rotation": (_text(head_dim=64, rope_parameters={"rope_theta": 1e7, "partial_rotary_factor": 0.05}),
                     "rotates 3 of head_dim 64"),
    "sections": (_text(rope_parameters=dict(TEXT["rope_parameters"], mrope_section=[24, 20, 20])),
                 "must sum to the rotated dimensions/2 = 32"),
    "conv-1": (_text(linear_conv_kernel_dim=1), "linear_conv_kernel_dim=1"),
    "moe-dense-layers": ({"model_type": "qwen3_5_moe", "text_config": _text(model_type="qwen3_5_moe_text", num_experts=256,
                                                                            mlp_only_layers=[1])},
                         "every qwen3_5_moe layer is sparse in transformers"),
    "moe-width": ({"model_type": "qwen3_5_moe", "text_config": _text(model_type="qwen3_5_moe_text", num_experts=256,
                                                                     moe_intermediate_size=500)},
                  "moe_intermediate_size=500 is not supported; it must be a multiple of 8"),
    "qwen3_next": (_text(model_type="qwen3_next"), "fused Gated DeltaNet projections"),
    "linear-in-llama": (_text(model_type="llama"), "layer_types contains 'linear_attention'"),
    "partial-in-llama": (dict(_text(model_type="llama"), layer_types=None, rope_parameters=None,
                              partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refusals_name_the_field(name):
    assert_config_refused(*REFUSALS[name])


def test_the_kernel_path_plans_a_batch_up_to_its_shared_memory():
    spec, target = spec_from_config(QWEN3_5_0_8B, "qwen3.5-0.8b"), target_for_arch("sm_90")
    assert largest_batch(spec, target) == 16 and plan_launch(spec, target, batch=16).batch == 16
    with pytest.raises(MkportError, match="qwen3.5-0.8b at batch 32 needs .*: batch up to 24 fits") as e:
        plan_launch(spec, target, batch=32)
    assert "\n" not in str(e.value)


def test_generate_renders_a_batch(tmp_path, monkeypatch):
    from test_cli import run

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_5_0_8B))
    monkeypatch.setenv("MKPORT_CACHE", str(tmp_path / "cache"))
    proc = run("generate", str(tmp_path), "--batch", "4", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    (header,) = (tmp_path / "out").glob("*/constants.cuh")
    assert "constexpr int BATCH = 4;" in header.read_text()


# -- weights -----------------------------------------------------------------------------------------------------

@pytest.fixture
def model(family_model):
    """(spec, kernel-layout weights, Reference, MODEL) of the tiny random Qwen3.5 (conftest): layers L L L F L F."""
    return family_model("qwen3_5")


def test_weights_names_and_split(model):
    spec, w, _, path = model
    names = checkpoint_shapes(spec, weight_names(spec))
    assert names["model.layers.0.linear_attn.conv1d.weight"] == (spec.linear_attention.conv_dim, 1, 4)
    assert names["model.layers.3.self_attn.q_proj.weight"] == (2 * 4 * 64, 128)  # query and gate rows
    assert "model.layers.0.self_attn.q_proj.weight" not in names and "model.layers.3.linear_attn.A_log" not in names
    tensors = random_checkpoint(spec, seed=3)
    q_proj = tensors["model.layers.3.self_attn.q_proj.weight"]
    # Qwen3_5Attention: view(..., heads, 2 * head_dim) then chunk: a head's query rows, then its gate rows
    assert torch.equal(w.layers[3].wqkv[64:128], q_proj[128:192]) and torch.equal(w.layers[3].q_gate[64:128], q_proj[192:256])
    la = spec.linear_attention
    assert torch.equal(w.layers[0].lin_in[la.conv_dim + la.value_dim + 4:],
                       tensors["model.layers.0.linear_attn.in_proj_a.weight"])
    assert w.layers[0].wqkv is None and w.layers[3].lin_in is None


def test_mtp_tensors_are_skipped_with_a_note(model, capsys):
    spec, _, _, path = model
    checkpoint = Checkpoint.open(path)
    assert "mtp.fc.weight" in checkpoint.tensors
    load_weights(spec, checkpoint)
    load_weights(spec, checkpoint)
    err = capsys.readouterr().err
    assert err.count("multi-token-prediction tensors (mtp.*) skipped") == 1


# -- the torch path against transformers ---------------------------------------------------------------------------

def test_recurrent_decode_keeps_the_deltanet_taps_to_fp32(model):
    """Token by token (the recurrent step, fp32 states, bf16 KV cache on the full layers) against the reference
    over the same tokens, with distinct MRoPE streams: the DeltaNet taps to fp32 (within the diff's tolerance:
    test_torch_families.py)."""
    spec, w, ref, _ = model
    inp = validation_inputs(spec, "qwen3_5", n=16, seed=2)
    _, _, report = torch_path_against_transformers(spec, w, ref, inp, decode=True)
    errors = {r.name: r.rel_l2 for r in report.rows}
    assert all(errors[Tap.layer(i, op)] < 2e-4 for i in (0, 1, 2)
               for op in (Tap.CONV, Tap.GATES, Tap.STATE_OUT, Tap.GATED_NORM))  # before any KV cache is read
    assert errors[Tap.layer(3, Tap.ATTN)] > 1e-4  # the bf16 KV cache is visible: the comparison is not vacuous


def test_bench_hf_eager_cache_takes_a_prompt_and_a_step(model):
    """bench's hf_eager cache (bench.decode.dynamic_cache) through the hybrid: a prompt, then a step, as bench times
    them (an empty DynamicCache() raised IndexError here)."""
    from mkport.bench.decode import cache_argument, dynamic_cache

    _, _, ref, _ = model
    cache = dynamic_cache(ref.base)
    tokens = torch.arange(9)[None]
    with torch.no_grad():
        ref.base(input_ids=tokens[:, :8], **{cache_argument(ref.base): cache}, use_cache=True)
        out = ref.base(input_ids=tokens[:, 8:], **{cache_argument(ref.base): cache}, use_cache=True)
    assert out.last_hidden_state.shape[1] == 1 and cache.get_seq_length() == 9


def test_transformers_cached_generation_agrees(model):
    """transformers' own cached decode (its causal_conv1d_update and recurrent delta rule) against TorchDecoder's
    prefill and steps: the logits of every step."""
    spec, w, ref, _ = model
    tokens = validation_inputs(spec, "qwen3_5", n=12, seed=5)["tokens"]
    dec = TorchDecoder(spec, w, max_seq=16)
    ours = [torch_model.logits(spec, dec.weights, dec.prefill(tokens=tokens[:7])[-1])]
    for t in tokens[7:]:
        dec.step(int(t))
        ours.append(dec.logits.clone())
    from transformers import DynamicCache

    cache = {cache_argument(ref.base): DynamicCache(config=ref.base.config)}  # `cache` or, before 5.2x, past_key_values
    theirs = []
    with torch.no_grad():
        h = ref.base(input_ids=tokens[None, :7], use_cache=True, **cache).last_hidden_state[0, -1]
        theirs.append(h @ ref._head(0).T)
        for t in tokens[7:]:
            h = ref.base(input_ids=t.view(1, 1), use_cache=True, **cache).last_hidden_state[0, -1]
            theirs.append(h @ ref._head(0).T)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert rel(a, b) < 1e-4, f"step {step}: rel {rel(a, b):.3g}"


# -- the chunked scan and the recurrence -----------------------------------------------------------------------------

def _delta_inputs(n, heads=3, dk=8, dv=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch_model._l2norm(torch.randn(n, heads, dk, generator=gen)) * dk**-0.5
    k = torch_model._l2norm(torch.randn(n, heads, dk, generator=gen))
    v = torch.randn(n, heads, dv, generator=gen)
    g = -torch.rand(n, heads, generator=gen) * 2  # decays e^-2 .. 1
    beta = torch.rand(n, heads, generator=gen)
    s0 = torch.randn(heads, dk, dv, generator=gen)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("n,chunk", [(13, 4), (8, 8), (3, 64), (1, 4)])
def test_chunked_scan_is_the_recurrence(n, chunk):
    """From a non-zero state: the chunked scan's read-outs and final state equal transformers' token-by-token
    torch_recurrent_gated_delta_rule (the oracle) and mkport's own step, whatever the chunk boundaries."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    q, k, v, g, beta, s0 = _delta_inputs(n)
    s = s0.clone()
    out = torch_model.delta_rule_chunked(s, q, k, v, g, beta, chunk)
    # the oracle takes q before its 1/sqrt(dk) scale, and scales it itself
    ref_out, ref_state = torch_recurrent_gated_delta_rule(q[None] * q.shape[-1] ** 0.5, k[None], v[None], g[None],
                                                          beta[None], initial_state=s0[None], output_final_state=True)
    assert rel(out, ref_out[0]) < 1e-5 and rel(s, ref_state[0]) < 1e-5
    step_state = s0.clone()
    steps = torch.stack([torch_model.delta_rule_step(step_state, q[t], k[t], v[t], g[t], beta[t]) for t in range(n)])
    assert rel(out, steps) < 1e-5 and rel(s, step_state) < 1e-5
    assert rel(s, s0) > 1e-2  # the rows did move the state


def test_prefill_then_decode_equals_one_pass(model):
    """TorchDecoder: a prompt prefilled in two parts (the second continuing the first's conv and recurrent states),
    then token steps, gives the hidden states and final states of one pass over the whole sequence."""
    spec, w, _, _ = model
    tokens = validation_inputs(spec, "qwen3_5", n=15, seed=6)["tokens"]
    whole = TorchDecoder(spec, w, max_seq=16)
    one_pass = whole.prefill(tokens=tokens)
    parts = TorchDecoder(spec, w, max_seq=16)
    hidden = [parts.prefill(tokens=tokens[:5]), parts.prefill(tokens=tokens[5:9])]
    for t in tokens[9:]:
        parts.step(int(t))
        hidden.append(parts.hidden[None].clone())
    assert rel(torch.cat(hidden), one_pass) < 1e-5
    assert rel(parts.linear_state.recurrent, whole.linear_state.recurrent) < 1e-5
    assert rel(parts.linear_state.conv, whole.linear_state.conv) < 1e-5
    parts.reset()  # a new sequence starts from zero states
    assert rel(parts.prefill(tokens=tokens), one_pass) < 1e-6


def test_a_padded_prefill_advances_the_state_by_its_real_rows(model):
    """A CUDA graph's bucket (runtime.Decoder._prefill_replay): 13 real rows padded with 3 junk rows and real_rows 13
    give the real rows' hidden states and the conv and recurrent states of the 13 rows alone; without real_rows the
    junk rows would move both states."""
    spec, w, _, _ = model
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(16, spec.hidden_size, generator=gen)
    pos = torch.arange(16).expand(3, 16)
    alone, padded, unmasked = (torch_model.LinearState.zeros(spec, "cpu") for _ in range(3))
    want = torch_model.forward(spec, w, x[:13], pos[:, :13], state=alone)
    got = torch_model.forward(spec, w, x, pos, state=padded, real_rows=torch.tensor(13))
    torch_model.forward(spec, w, x, pos, state=unmasked)
    assert rel(got[:13], want) < 1e-6
    assert rel(padded.recurrent, alone.recurrent) < 1e-6 and rel(padded.conv, alone.conv) < 1e-6
    assert rel(unmasked.recurrent, alone.recurrent) > 1e-3 and rel(unmasked.conv, alone.conv) > 1e-1


def test_a_continuation_needs_its_state(model):
    spec, w, _, _ = model
    x = torch.zeros(2, spec.hidden_size)
    with pytest.raises(MkportError, match="needs its linear-attention state"):
        torch_model.forward(spec, w, x, torch.arange(3, 5).expand(3, 2), start=3)


# -- faults found at their layer and op ----------------------------------------------------------------------------

def test_schedule_has_each_layer_kinds_ops(model):
    spec = model[0]
    ops = [(layer, op) for layer, op, _ in schedule(spec, logits=False) if layer in (2, 3)]
    assert ops == [(2, op) for op in Tap.LINEAR_LAYER] + [(3, op) for op in Tap.LAYER]


@pytest.mark.parametrize("layer,op", [(1, Tap.CONV), (1, Tap.GATES), (4, Tap.GATED_NORM), (4, Tap.ATTN_RESIDUAL),
                                      (2, Tap.MLP_RESIDUAL), (5, Tap.ATTN)])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_injected_weight_fault_is_found_there(model, layer, op, decode):
    spec, w, ref, _ = model
    inp = validation_inputs(spec, "qwen3_5", n=12, seed=7)
    report = torch_path_against_transformers(spec, inject(w, spec, layer, op, seed=1), ref, inp, decode)[2]
    assert not report.passed and report.first_failure.name == Tap.layer(layer, op), report.to_text()


def _step_without_beta(s, q, k, v, g, beta, *args):
    return ORIGINAL_STEP(s, q, k, v, g, torch.ones_like(beta))


def _chunked_without_beta(s, q, k, v, g, beta, *args):
    return ORIGINAL_CHUNKED(s, q, k, v, g, torch.ones_like(beta), *args)


ORIGINAL_STEP, ORIGINAL_CHUNKED = torch_model.delta_rule_step, torch_model.delta_rule_chunked


def _conv_state_dropped(original):
    """gated_delta_net forgetting the conv's history between calls (each call starts from zeros)."""
    def wrong(spec, lw, h, state, slot, tap, *args, **kwargs):
        state.conv[slot].zero_()
        return original(spec, lw, h, state, slot, tap, *args, **kwargs)
    return wrong


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_a_fault_in_the_recurrence_is_found_at_state_out(model, monkeypatch, decode):
    """state_out has no weights of its own: a fault in the delta rule itself (beta ignored) is named there, at
    the first linear-attention layer, after its conv and gates passed."""
    spec, w, ref, _ = model
    monkeypatch.setattr(torch_model, "delta_rule_step", _step_without_beta)
    monkeypatch.setattr(torch_model, "delta_rule_chunked", _chunked_without_beta)
    inp = validation_inputs(spec, "qwen3_5", n=12, seed=8)
    report = torch_path_against_transformers(spec, w, ref, inp, decode)[2]
    assert not report.passed and report.first_failure.name == Tap.layer(0, Tap.STATE_OUT), report.to_text()


def test_a_dropped_conv_state_is_found_at_conv(model, monkeypatch):
    spec, w, ref, _ = model
    monkeypatch.setattr(torch_model, "gated_delta_net", _conv_state_dropped(torch_model.gated_delta_net))
    inp = validation_inputs(spec, "qwen3_5", n=12, seed=9)
    report = torch_path_against_transformers(spec, w, ref, inp, True)[2]
    assert not report.passed and report.first_failure.name == Tap.layer(0, Tap.CONV), report.to_text()


@pytest.mark.parametrize("changes,first", [
    ({"norm_weight_offset": 0.0}, Tap.layer(0, Tap.ATTN_NORM)),  # w instead of (1 + w)
    ({"rotary_dim": 0}, Tap.layer(3, Tap.Q)),  # all of head_dim rotated instead of a quarter
], ids=["plain-norm-weights", "full-rope"])
def test_ablations_fail_where_the_feature_bites(model, changes, first):
    spec, w, ref, _ = model
    inp = validation_inputs(spec, "qwen3_5", n=12, seed=10)
    wrong = dataclasses.replace(spec, **changes)
    report = torch_path_against_transformers(wrong, w, ref, inp, False)[2]
    assert not report.passed and report.first_failure.name == first, report.to_text()


def test_no_output_gate_is_found_at_attn(model):
    spec, w, ref, _ = model
    inp = validation_inputs(spec, "qwen3_5", n=12, seed=11)
    ungated = dataclasses.replace(w, layers=[dataclasses.replace(lw, q_gate=None) for lw in w.layers])
    report = torch_path_against_transformers(spec, ungated, ref, inp, False)[2]
    assert not report.passed and report.first_failure.name == Tap.layer(3, Tap.ATTN), report.to_text()


@pytest.mark.parametrize("text,words", [
    ("0:q", "layer 0 is a linear-attention layer; its ops with weights to perturb are attn_norm, conv, gates"),
    ("0:state_out", "layer 0 is a linear-attention layer"),
    ("3:conv", "layer 3 is an attention layer"),
    ("0:bogus", "OP one of attn_norm, q, k, attn, attn_residual, mlp_residual, conv, gates, state_out, gated_norm"),
])
def test_inject_ops_follow_the_layer_kind(model, text, words):
    with pytest.raises(MkportError) as e:
        parse_inject(text, model[0])
    assert words in str(e.value) and "\n" not in str(e.value)
    assert parse_inject("0:conv", model[0]) == (0, "conv") and parse_inject("3:q", model[0]) == (3, "q")


def test_the_reference_ignores_a_registered_default_rope(model, monkeypatch):
    """qwen-tts-hf puts a "default" RoPE initialiser in transformers' global registry (mkport.tts.official loads it);
    one that rotates all of head_dim must not reach the Qwen3.5 reference built after it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    spec, _, ref, path = model

    def full_rotation(config, *args, **kwargs):
        dim = config.head_dim
        return 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)), 1.0

    monkeypatch.setitem(ROPE_INIT_FUNCTIONS, "default", full_rotation)
    rebuilt = Reference(open_model(path), Checkpoint.open(path))
    assert rebuilt.base.rotary_emb.inv_freq.shape == (spec.rope_dim // 2,)
    assert torch.equal(rebuilt.base.rotary_emb.inv_freq, ref.base.rotary_emb.inv_freq)
    assert ROPE_INIT_FUNCTIONS["default"] is full_rotation  # put back


class _KernelCalled(Exception):
    pass


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """Puts a stand-in kernel package where transformers looks for flash-linear-attention or causal-conv1d and
    returns patch(names): the Qwen3.5 modeling functions named, replaced by transformers' own dispatchers built
    around their torch code with the stand-in as the package (its functions raise _KernelCalled)."""
    import sys
    import types

    import transformers.integrations.hub_kernels as hub_kernels
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    def kernel(*args, **kwargs):
        raise _KernelCalled

    kernel.__module__ = "stand_in_kernels.ops"  # as a package's own function
    package = types.ModuleType("stand_in_kernels")
    monkeypatch.setitem(sys.modules, "stand_in_kernels", package)
    if hasattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES"):  # transformers >= 5.25 runs a package on its devices only
        monkeypatch.setitem(hub_kernels._PACKAGE_SUPPORTED_DEVICES, "stand_in_kernels", ("cpu", "cuda"))

    def patch(names: dict[str, str]) -> None:
        for name, kernel_name in names.items():
            setattr(package, kernel_name, kernel)
            own = torch_path(getattr(modeling, name))
            assert own.__module__ == modeling.__name__  # transformers' own torch code, not its dispatcher
            dispatcher = hub_kernels.use_kernel_func_from_hub_with_fallback(kernel_name, "stand_in_kernels")(own)
            monkeypatch.setattr(modeling, name, dispatcher)

    return patch


def test_the_reference_runs_transformers_torch_code_where_a_kernel_package_is_installed(model, stand_in_kernels):
    """With flash-linear-attention or causal-conv1d installed (and Triton on a GPU), transformers dispatches the
    Gated DeltaNet's conv and chunked delta rule to their kernels (TF32 matmuls on float32 inputs). A stand-in
    package shows the dispatch reaching it; the float32 reference still runs transformers' own torch code and gives
    the same taps, bit for bit."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    spec, _, ref, _ = model
    inp = validation_inputs(spec, "qwen3_5", n=12, seed=4)
    before = reference_taps(ref, inp)
    stand_in_kernels({"causal_conv1d_fn": "causal_conv1d_fn", "torch_chunk_gated_delta_rule": "chunk_gated_delta_rule"})
    with pytest.raises(_KernelCalled):  # the dispatch reaches the installed package
        modeling.torch_chunk_gated_delta_rule(*[torch.zeros(1, 2, 1, 4)] * 3, torch.zeros(1, 2, 1), torch.zeros(1, 2, 1))
    after = reference_taps(ref, inp)
    assert before.keys() == after.keys() and Tap.layer(0, Tap.STATE_OUT) in after
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_benchmark_says_which_code_transformers_decodes_with(stand_in_kernels):
    """`mkport bench`'s transformers rows of a hybrid name what ran its per-token Gated DeltaNet ops: transformers'
    torch code here (no kernel package), the package where transformers dispatches to one."""
    ops = ("causal_conv1d_update", "torch_recurrent_gated_delta_rule")
    assert linear_attention_dispatch() == {op: "transformers' torch code" for op in ops}
    stand_in_kernels({"torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule"})
    assert linear_attention_dispatch() == {"causal_conv1d_update": "transformers' torch code",
                                           "torch_recurrent_gated_delta_rule": "stand_in_kernels"}
    assert linear_attention_dispatch("qwen3_5_moe") == {op: "transformers' torch code" for op in ops}  # its own file


def test_a_hybrid_prefills_its_linear_layers_in_the_kernels_on_bf16_weights(model):
    """A decoder's prefill runs a hybrid's Gated DeltaNet layers in mkport's kernels (prefill.gated_delta_net: the
    conv weights they read as bf16) when its weights are bf16 and the GPU gives a block the kernels' shared memory
    (188 KB for the 0.8B: the H200's 227 KB, not a 99 KB card's), torch's layer otherwise; the dense fused prefill
    runs no hybrid, and a dense spec has no linear layers to run."""
    from mkport.runtime import prefill

    spec, w, _, _ = model
    bf16 = w.map(lambda t: t.bfloat16() if t.is_floating_point() else t)
    h200, consumer, kernels = 227 * 1024, 99 * 1024, 188 * 1024
    assert prefill.linear_layers_run(spec, bf16, kernels, h200)
    assert not prefill.linear_layers_run(spec, bf16, kernels, consumer)
    fp32 = w.map(lambda t: t.float() if t.is_floating_point() else t)
    assert not prefill.linear_layers_run(spec, fp32, kernels, h200)
    assert not prefill.runs(spec)
    assert not prefill.linear_layers_run(load_spec("qwen3-0.6b"), bf16, 0, h200)
