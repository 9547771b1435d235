"""EXAONE 4, the CPU half: OLMo 2's post-norm layers (no input norm; the attention and MLP outputs normed before their
residual adds) with q/k norms a head at a time, sliding layers, and no RoPE on the full layers where the model has a
sliding window (Exaone4Attention rotates its sliding layers only then). Every feature is one the megakernel already
has (OLMo 2/3's post-norm layers, Qwen3's per-head q/k norms, Mistral's windows, SmolLM3's layers without RoPE): the
spec puts them together. The spec against transformers' Exaone4Config (as written, from its defaults, and from
layer_types), the checkpoint names, refusals, and each feature switched off failing where it bites. The checks every
plain-torch family shares (prefill, decode, greedy tokens, weight faults): test_torch_families.py; the megakernel on the
GPU: test_gpu_llama_variants.py."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import torch_path_against_transformers, validation_inputs
from mkport.errors import MkportError
from mkport.kernel.interface import Tap
from mkport.kernel.spec import spec_from_config
from mkport.runtime.weights import checkpoint_shapes, weight_names

# Three sliding layers (window 6, under 20-row inputs) and a full one without RoPE, as sliding_window_pattern 4 makes
# them; head_dim 64 with 4 heads on hidden 128
EXAONE4 = {"model_type": "exaone4", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "rope_theta": 1e4, "sliding_window": 6,
           "sliding_window_pattern": 4, "tie_word_embeddings": False}
CONFIGS = {"exaone4": EXAONE4}


def _theirs(config: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})


def _read_as_theirs(config: dict):
    """mkport's spec and Exaone4Config's reading of the same config: windows and the layers without RoPE."""
    s, theirs = spec_from_config(config, "x"), _theirs(config)
    windows = tuple(theirs.sliding_window if t == "sliding_attention" else 0 for t in theirs.layer_types)
    rotated = [theirs.sliding_window is None or t == "sliding_attention" for t in theirs.layer_types]
    return s, theirs, (windows if any(windows) else ()), tuple(i for i, r in enumerate(rotated) if not r)


@pytest.mark.parametrize("defaults", [False, True], ids=["as-written", "class-defaults"])
def test_spec_is_transformers_config(defaults):
    """Each field as Exaone4Config reads it, from the config as written and from one that leaves every optional field
    out (eps 1e-5, window 4096 every layer but each 4th, 2048 positions; its 32 KV heads would not divide 4 heads)."""
    config = EXAONE4
    if defaults:
        config = {k: v for k, v in EXAONE4.items() if k in ("model_type", "vocab_size", "hidden_size",
                                                            "intermediate_size", "num_hidden_layers",
                                                            "num_attention_heads", "num_key_value_heads", "head_dim")}
    s, theirs, windows, nope = _read_as_theirs(config)
    assert (s.num_kv_heads, s.rms_eps, s.tie_embeddings, s.max_position) == (
        theirs.num_key_value_heads, theirs.rms_norm_eps, theirs.tie_word_embeddings, theirs.max_position_embeddings)
    assert (s.attention_windows, s.nope_layers) == (windows, nope) == ((6 if not defaults else 4096,) * 3 + (0,), (3,))
    assert not s.pre_norms and s.qk_norm and s.qk_norm_span == "head" and not s.sandwich_norms
    assert s.rope.theta == theirs.rope_parameters["rope_theta"] and s.attention_scale == s.head_dim**-0.5


@pytest.mark.parametrize("changes", [
    {"layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]},
    {"sliding_window": None, "layer_types": ["full_attention"] * 4},  # no window: every layer full, every one rotated
], ids=["layer-types", "no-window"])
def test_layer_types_as_theirs(changes):
    s, _, windows, nope = _read_as_theirs(dict(EXAONE4, **changes))
    assert (s.attention_windows, s.nope_layers) == (windows, nope)


@pytest.mark.parametrize("changes,message", [
    ({"sliding_window": None}, "exaone4 without layer_types needs a sliding_window and an integer sliding_window_"),
    ({"sliding_window_pattern": "LLLG"}, "exaone4 without layer_types needs a sliding_window and an integer"),
    ({"sliding_window": None, "layer_types": ["sliding_attention"] * 4}, "sliding_attention layers but sliding_window"),
])
def test_what_transformers_cannot_read_is_refused_in_one_line(changes, message):
    """Exaone4Config cannot derive layer types from a null window or a pattern string (it divides by the pattern)."""
    with pytest.raises(MkportError, match=message) as e:
        spec_from_config(dict(EXAONE4, **changes), "x")
    assert "\n" not in str(e.value)


def test_weight_names_are_transformers_state_dict():
    """The checkpoint mkport reads and writes has Exaone4ForCausalLM's tensors, shape for shape: no input_layernorm,
    post_attention_layernorm and post_feedforward_layernorm, q/k norms of head_dim."""
    from transformers import AutoModelForCausalLM

    spec = spec_from_config(EXAONE4, "x")
    theirs = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(_theirs(EXAONE4)).state_dict().items()}
    assert checkpoint_shapes(spec, weight_names(spec)) == theirs


@pytest.mark.parametrize("changes,first", [
    ({"qk_norm_span": "projection"}, Tap.layer(0, Tap.Q)),  # OLMo 2's q/k norms over the whole projection
    ({"nope_layers": ()}, Tap.layer(3, Tap.Q)),  # RoPE on the full layer too
    ({"attention_windows": ()}, Tap.layer(0, Tap.ATTN)),  # no window on the sliding layers
], ids=["projection-qk-norm", "rope-on-the-full-layer", "no-window"])
def test_ablations_fail_where_the_feature_bites(family_model, changes, first):
    spec, w, ref, _ = family_model("exaone4")
    if "qk_norm_span" in changes:  # OLMo's norms read a weight a q/k row: each head's repeated
        w = dataclasses.replace(w, layers=[dataclasses.replace(
            lw, q_norm=lw.q_norm.repeat(spec.num_heads), k_norm=lw.k_norm.repeat(spec.num_kv_heads)) for lw in w.layers])
    _, _, report = torch_path_against_transformers(dataclasses.replace(spec, **changes), w, ref,
                                                   validation_inputs(spec, "exaone4", n=20, seed=11))
    assert not report.passed and report.first_failure.name == first, report.to_text()
