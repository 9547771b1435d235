"""Gemma, Gemma 2 and Gemma 3 (text), the CPU half: specs against transformers' config classes, refusals, the
kernel commands' one-line refusal of what the megakernel does not build (its Gemma: test_kernel_families.py), and mkport's plain-torch path (torch_model, TorchDecoder, `run --backend
reference`) against transformers' own Gemma classes on tiny random models, with faults and ablations of each Gemma
feature found at their layer and op. The tiny configs make the features bite on random weights: soft-caps small
enough for the scores and logits to reach them, a sliding window of 6 under 20-row inputs.
The checks every plain-torch family shares (prefill, decode, greedy tokens, `run`, weight faults):
test_torch_families.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import (assert_config_refused, reference_taps, torch_path_against_transformers, torch_path_taps,
                      validation_inputs)
from mkport.check.reference import Reference
from mkport.errors import MkportError
from mkport.kernel.interface import Tap
from mkport.kernel.spec import RopeSpec, open_model, spec_from_config
from mkport.runtime import torch_model
from mkport.runtime.weights import Checkpoint
from tolerances import rel

GEMMA = {"model_type": "gemma", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "hidden_act": "gelu_pytorch_tanh"}
# Every other layer slides (Gemma2Config's default pattern); caps of 2 and 5 bite on these scores and logits
GEMMA2 = dict(GEMMA, model_type="gemma2", num_hidden_layers=4, hidden_activation="gelu_pytorch_tanh",
              query_pre_attn_scalar=48, sliding_window=6, attn_logit_softcapping=2.0, final_logit_softcapping=5.0)
GEMMA3 = dict(GEMMA2, model_type="gemma3_text", attn_logit_softcapping=None, final_logit_softcapping=None,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
              rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
CONFIGS = {"gemma": GEMMA, "gemma2": GEMMA2, "gemma3": GEMMA3}
# The decoder fields of google/gemma-2-2b's and google/gemma-3-1b-pt's config.json
GEMMA_2_2B = {"model_type": "gemma2", "attention_bias": False, "attn_logit_softcapping": 50.0,
              "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
              "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "intermediate_size": 9216,
              "max_position_embeddings": 8192, "num_attention_heads": 8, "num_hidden_layers": 26,
              "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
              "sliding_window": 4096, "vocab_size": 256000}
GEMMA_3_1B = {"model_type": "gemma3_text", "attention_bias": False, "attn_logit_softcapping": None,
              "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
              "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
              "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256,
              "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
              "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144}
SPEC_CASES = {**CONFIGS, "gemma-2-2b": GEMMA_2_2B, "gemma-3-1b": GEMMA_3_1B}


@pytest.mark.parametrize("name,fields", [("gemma-2-2b", GEMMA_2_2B), ("gemma-3-1b", GEMMA_3_1B)])
def test_bundled_spec_is_the_published_config(name, fields):
    """The bundled gemma-2-2b (google/gemma-2-2b-it's config.json) and gemma-3-1b (google/gemma-3-1b-it's) hold the
    decoder fields above as written, and give their spec (an -it config differs from the base model's in its EOS
    ids only); test_spec_is_transformers_config checks those fields against transformers' classes."""
    source = open_model(name)
    assert {k: source.config[k] for k in fields} == fields
    assert source.spec == spec_from_config(fields, name)


def _theirs(config: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})


# -- spec --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(SPEC_CASES))
@pytest.mark.parametrize("defaults", [False, True], ids=["as-written", "class-defaults"])
def test_spec_is_transformers_config(case, defaults):
    """Each field as the family's config class reads it, from the config as written and from one that leaves every
    optional field out (the class defaults: head_dim 256, the layer pattern, window 4096, soft-caps, scalar, RoPE
    thetas)."""
    config = SPEC_CASES[case]
    if defaults:
        config = {k: config[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                         "num_hidden_layers", "num_attention_heads", "num_key_value_heads")}
    s, theirs = spec_from_config(config, "g"), _theirs(config)
    assert (s.head_dim, s.num_kv_heads, s.tie_embeddings) == (theirs.head_dim, theirs.num_key_value_heads,
                                                               theirs.tie_word_embeddings)
    assert s.norm_weight_offset == 1.0 and s.mlp_activation == "gelu_tanh"
    assert s.embedding_multiplier == theirs.hidden_size**0.5
    layer_types = getattr(theirs, "layer_types", None) or ["full_attention"] * s.num_layers
    assert [s.window(i) for i in range(s.num_layers)] == [
        theirs.sliding_window if t == "sliding_attention" else 0 for t in layer_types]
    if s.family == "gemma":
        assert not s.sandwich_norms and s.attention_scale == s.head_dim**-0.5 and not s.attn_logit_softcap
        return
    assert s.sandwich_norms and s.attention_scale == theirs.query_pre_attn_scalar**-0.5
    assert s.attn_logit_softcap == (theirs.attn_logit_softcapping or 0.0)
    assert s.final_logit_softcap == (theirs.final_logit_softcapping or 0.0)
    assert s.qk_norm == (s.family == "gemma3")
    if s.family == "gemma3":
        full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
        assert (s.rope.theta, s.local_rope.theta) == (full["rope_theta"], local["rope_theta"])
        assert s.rope.factor == full.get("factor", 1.0) and local["rope_type"] == "default"
        assert s.local_rope == RopeSpec(local["rope_theta"], "standard")


def test_published_shapes():
    g2, g3 = spec_from_config(GEMMA_2_2B, "gemma-2-2b"), spec_from_config(GEMMA_3_1B, "gemma-3-1b")
    assert g2.attention_windows == (4096, 0) * 13 and (g2.attn_logit_softcap, g2.final_logit_softcap) == (50.0, 30.0)
    assert g3.attention_windows == ((512,) * 5 + (0,)) * 4 + (512, 512)
    assert (g3.gqa_ratio, g3.rope.theta, g3.local_rope.theta, g3.tie_embeddings) == (4, 1e6, 1e4, True)


def test_gemma3_rope_parameters_per_layer_type():
    """transformers 5 writes rope_parameters per layer type: read the same as the older fields."""
    per_type = {k: v for k, v in GEMMA3.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    per_type["rope_parameters"] = _theirs(GEMMA3).rope_parameters
    assert spec_from_config(per_type, "g") == spec_from_config(GEMMA3, "g")


# Gemma 3's multimodal wrapper (google/gemma-3-4b-it and up): its text_config lists only what differs from
# Gemma3TextConfig's defaults, its decoder's tensors live under language_model. This one is tiny, vision tower too.
TINY_VISION = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
               "num_hidden_layers": 1, "image_size": 28, "patch_size": 14, "vision_use_head": False}
GEMMA3_WRAPPER = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 4,
                  "text_config": {"model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 128,
                                  "intermediate_size": 256, "num_hidden_layers": 7, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 6,
                                  "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
                  "vision_config": TINY_VISION}


@pytest.mark.parametrize("text", [GEMMA3_WRAPPER["text_config"],
                                  {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                   "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                   "sliding_window": 1024}], ids=["tiny", "sparse-4b-shape"])
def test_gemma3_wrapper_is_its_text_decoder_as_gemma3config_reads_it(text):
    """model_type gemma3 with a text_config: the spec of the decoder Gemma3Config makes of it (the class's defaults
    filled: heads, KV heads, vocab, head_dim, the 5:1 layer pattern, thetas, the tied head)."""
    from transformers import Gemma3Config

    config = dict(GEMMA3_WRAPPER, text_config=text)
    s, theirs = spec_from_config(config, "g"), Gemma3Config(**config).text_config
    assert s.family == "gemma3" and s == spec_from_config(dict(theirs.to_dict(), model_type="gemma3_text"), "g")
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.vocab_size, s.tie_embeddings) == (
        theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim, theirs.vocab_size, True)
    assert [s.window(i) for i in range(s.num_layers)] == [
        theirs.sliding_window if t == "sliding_attention" else 0 for t in theirs.layer_types]
    assert (s.rope.theta, s.rope.factor, s.local_rope.theta) == (1e6, 8.0, 1e4)


def test_legacy_gelu_is_the_tanh_form(family_model_path, tmp_path):
    """hidden_act 'gelu' (the released configs' value) means gelu_pytorch_tanh: mkport's spec and its reference read it
    so in every transformers release (GemmaConfig rewrites it since 5.2x; 5.17's ran erf GELU)."""
    assert spec_from_config(dict(GEMMA, hidden_act="gelu"), "g").mlp_activation == "gelu_tanh"
    folder = Path(family_model_path("gemma"))
    legacy = tmp_path / "legacy"
    shutil.copytree(folder, legacy)
    (legacy / "config.json").write_text(json.dumps(dict(json.loads((folder / "config.json").read_text()),
                                                        hidden_act="gelu")))
    ref = Reference(open_model(str(legacy)), Checkpoint.open(str(legacy)))
    assert ref.causal_lm.config.hidden_act == "gelu_pytorch_tanh"


REFUSALS = {
    "gemma2-silu": (dict(GEMMA2, hidden_activation="silu"), "hidden_activation 'silu' is not supported for gemma2"),
    "gemma2-gelu": (dict(GEMMA2, hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
    "bidirectional": (dict(GEMMA3, use_bidirectional_attention=True), "use_bidirectional_attention=true"),
    "null-window": (dict(GEMMA2, sliding_window=None), "sliding_window is null"),
    "bad-cap": (dict(GEMMA2, attn_logit_softcapping=-1), "'attn_logit_softcapping' must be a positive number"),
    "gemma3n": (dict(GEMMA, model_type="gemma3n_text", hidden_size_per_layer_input=256), "per-layer inputs"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refusals_name_the_field(name):
    assert_config_refused(*REFUSALS[name])


def test_null_soft_caps_are_none():
    s = spec_from_config(dict(GEMMA2, attn_logit_softcapping=None, final_logit_softcapping=None), "g")
    assert s.attn_logit_softcap == 0.0 and s.final_logit_softcap == 0.0


# gemma3's sliding layers with yarn RoPE of their own (rope_parameters per layer type): the kernel builds a sliding
# layer's own theta, not its attention factor (the megakernel of the rest: test_kernel_families.py)
GEMMA3_LOCAL_YARN = dict({k: v for k, v in GEMMA3.items() if k not in ("rope_theta", "rope_local_base_freq",
                                                                       "rope_scaling")},
                         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                                "original_max_position_embeddings": 128}})
# its refusal on the megakernel: test_kernel_families.py (with OLMo 3's, the same rule)


# -- ablations found at their layer and op (the torch path against transformers, weight faults: test_torch_families.py)

def _without(w, **fields):
    return dataclasses.replace(w, layers=[dataclasses.replace(lw, **fields) for lw in w.layers])


@pytest.mark.parametrize("case,changes,first", [
    ("gemma", {"norm_weight_offset": 0.0}, Tap.layer(0, Tap.ATTN_NORM)),  # w instead of (1 + w)
    ("gemma", {"embedding_multiplier": 1.0}, Tap.EMBED),
    ("gemma", {"mlp_activation": "silu"}, Tap.layer(0, Tap.MLP_RESIDUAL)),
    ("gemma2", {"attn_logit_softcap": 0.0}, Tap.layer(0, Tap.ATTN)),
    ("gemma2", {"final_logit_softcap": 0.0}, Tap.LOGITS),
    ("gemma2", {"attention_multiplier": 0.0}, Tap.layer(0, Tap.ATTN)),  # head_dim^-0.5, not query_pre_attn_scalar
    ("gemma2", {"attention_windows": (7, 0, 7, 0)}, Tap.layer(0, Tap.ATTN)),  # window + 1
    ("gemma2", {"attention_windows": (5, 0, 5, 0)}, Tap.layer(0, Tap.ATTN)),  # window - 1
    ("gemma3", {"local_rope": None}, Tap.layer(0, Tap.Q)),  # the global theta on sliding layers
    ("gemma3", {"rope": RopeSpec(1e6, "standard")}, Tap.layer(2, Tap.Q)),  # the full layer's scaling left out
], ids=["plain-norm-weights", "unscaled-embedding", "silu", "no-attn-cap", "no-final-cap", "head-dim-scale",
        "window+1", "window-1", "one-rope", "unscaled-global-rope"])
def test_ablations_fail_where_the_feature_bites(family_model, case, changes, first):
    spec, w, ref, _ = family_model(case)
    inp = validation_inputs(spec, case, n=20, seed=10)
    _, _, report = torch_path_against_transformers(dataclasses.replace(spec, **changes), w, ref, inp)
    assert not report.passed and report.first_failure.name == first, report.to_text()


@pytest.mark.parametrize("field,first", [("post_attn_norm", Tap.ATTN_RESIDUAL), ("post_mlp_norm", Tap.MLP_RESIDUAL)])
def test_a_missing_sandwich_norm_is_found_at_its_residual(family_model, field, first):
    spec, w, ref, _ = family_model("gemma2")
    inp = validation_inputs(spec, "gemma2", n=12, seed=11)
    _, _, report = torch_path_against_transformers(spec, _without(w, **{field: None}), ref, inp)
    assert not report.passed and report.first_failure.name == Tap.layer(0, first), report.to_text()


def test_erf_gelu_is_seen_at_fp32_rounding_not_at_the_diff_tolerance(family_model, monkeypatch):
    """GELU with erf instead of tanh moves an activation by ~1e-3 at most: layer 0's MLP output moves ~3e-5
    relative, far under the diff's 1e-2 (a limit of `mkport diff`, docs/validation.md), but 100x above the fp32
    rounding that the torch path's one pass holds to, which is where this port is checked for it."""
    spec, w, ref, _ = family_model("gemma")
    inp = validation_inputs(spec, "gemma", n=12, seed=12)
    reference = reference_taps(ref, inp)  # first: F is torch's own module, which transformers' GELU calls too
    tap = Tap.layer(0, Tap.MLP_RESIDUAL)
    right = rel(torch_path_taps(spec, w, inp["tokens"], inp["positions"])[tap], reference[tap])
    gelu = torch.nn.functional.gelu
    monkeypatch.setattr(torch_model.F, "gelu", lambda x, approximate="none": gelu(x))
    erf = rel(torch_path_taps(spec, w, inp["tokens"], inp["positions"])[tap], reference[tap])
    assert right < 1e-6 and erf > 1e-5, (right, erf)


def test_graphs_backend_refuses_what_it_does_not_run(family_model):
    from mkport.runtime.graph_decoder import GraphDecoder

    spec, w, _, _ = family_model("gemma2")
    with pytest.raises(MkportError, match="graphs backend does not run soft-capped attention"):
        GraphDecoder(spec, w, 32, batch=2, device="cpu")


@pytest.mark.parametrize("case", list(CONFIGS))
def test_weight_bytes_count_every_norm(case):
    """A step reads every layer tensor (the sandwich norms and q/k norms too), the final norm, one embedding row and
    the tied head: the checkpoint's bytes with the head counted once and one row more."""
    from mkport.runtime.weights import checkpoint_shapes, weight_names

    spec = spec_from_config(CONFIGS[case], "g")
    elems = sum(torch.Size(shape).numel() for shape in checkpoint_shapes(spec, weight_names(spec)).values())
    assert spec.weight_bytes_per_step() == 2 * (elems + spec.hidden_size)
