"""Llama's layers under other names, the CPU half: ERNIE 4.5 (dense) and Helium, with RoPE on adjacent pairs
(2i, 2i + 1) where the kernel rotates (i, i + d/2), Seed-OSS, with a q/k/v bias by default, and GLM and GLM-4, with
RoPE on adjacent pairs of the first half of each head, a q/k/v bias by default, gate/up fused in one gate_up_proj,
and for GLM-4 Gemma 2's four norms a layer (with weights w, not 1 + w). Loading reorders each q and k head's rotated
rows of the adjacent-pair families (weights.pairs_to_halves), so the kernel runs them unchanged; the reference's q
and k taps are compared in that order. The specs against transformers' config classes (as written and from their
defaults), every family's RoPE theta left out, the checkpoint names, the reorder's arithmetic, and what breaks without
it. The checks every plain-torch family shares (prefill, decode, greedy tokens, weight faults): test_torch_families.py;
the megakernel on the GPU: test_gpu_llama_variants.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import torch_path_against_transformers, validation_inputs
from mkport.errors import MkportError
from mkport.kernel.interface import Tap
from mkport.kernel.spec import LLM_FAMILIES, spec_from_config
from mkport.runtime.torch_model import _rope
from mkport.runtime.weights import Checkpoint, checkpoint_shapes, load_weights, pairs_to_halves, weight_names

ERNIE = {"model_type": "ernie4_5", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "rope_theta": 5e5, "use_bias": False,
         "tie_word_embeddings": True}
# Helium with its q/k/v bias on (attention_bias; its o_proj never has one), untied; its heads span hidden_size
HELIUM = {"model_type": "helium", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "rms_norm_eps": 1e-8, "max_position_embeddings": 512, "rope_theta": 1e5, "attention_bias": True,
          "mlp_bias": False, "tie_word_embeddings": False}
# Seed-OSS's q/k/v bias (its class default) and RoPE theta 1e7, GQA 2
SEED_OSS = {"model_type": "seed_oss", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "rope_theta": 1e7, "tie_word_embeddings": False}
# GLM (glm-4-9b-chat-hf) and GLM-4 (GLM-4-0414): half of each head rotated (their default), q/k/v bias (their default);
# the pad and EOS ids inside the tiny vocabulary
GLM = {"model_type": "glm", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-5,
       "max_position_embeddings": 512, "rope_theta": 1e4, "partial_rotary_factor": 0.5, "attention_bias": True,
       "pad_token_id": 0, "eos_token_id": 2, "tie_word_embeddings": False}
GLM4 = dict(GLM, model_type="glm4", rope_theta=5e5)
CONFIGS = {"ernie4_5": ERNIE, "helium": HELIUM, "seed_oss": SEED_OSS, "glm": GLM, "glm4": GLM4}
ADJACENT = ("ernie4_5", "helium", "glm", "glm4")


def _theirs(config: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})


@pytest.mark.parametrize("case", list(CONFIGS))
@pytest.mark.parametrize("defaults", [False, True], ids=["as-written", "class-defaults"])
def test_spec_is_transformers_config(case, defaults):
    """Each field as Ernie4_5Config / HeliumConfig / SeedOssConfig / GlmConfig / Glm4Config reads it, from the config
    as written and from one that leaves every optional field out (their heads 16 / 20 / 80 / 32 and KV heads 2 / 20 /
    8 / 2, head_dim 128, eps 1e-5 / 1e-8 / 1e-6 / 1.5625e-7, theta 5e5 / 1e5 / 1e4 / 1e4, ERNIE tied and 131072
    positions, Seed-OSS's and GLM's q/k/v bias on, GLM's RoPE on half of each head)."""
    config = CONFIGS[case]
    if defaults:
        config = {k: v for k, v in config.items() if k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                                           "num_hidden_layers", "pad_token_id", "eos_token_id")}
        if case == "helium":  # its default 20 heads of 128 span hidden_size, as HeliumAttention's o_proj needs
            config["hidden_size"] = 2560
    s, theirs = spec_from_config(config, "a"), _theirs(config)
    assert (s.num_heads, s.head_dim, s.num_kv_heads, s.rms_eps, s.tie_embeddings, s.max_position) == (
        theirs.num_attention_heads, theirs.head_dim, theirs.num_key_value_heads, theirs.rms_norm_eps, theirs.tie_word_embeddings,
        theirs.max_position_embeddings)
    assert (s.rope.variant, s.rope.theta) == ("standard", theirs.rope_parameters["rope_theta"])
    assert s.rope.adjacent_pairs == (case in ADJACENT)
    assert s.rope_dim == int(theirs.head_dim * theirs.rope_parameters.get("partial_rotary_factor", 1.0))
    assert s.sandwich_norms == (case == "glm4") and s.fused_gate_up == case.startswith("glm")
    assert s.qkv_bias == bool(getattr(theirs, "attention_bias", False)) and not s.qk_norm
    assert s.attention_scale == theirs.head_dim**-0.5


def test_a_null_head_dim_is_hidden_over_heads():
    """Ernie4_5Config's head_dim null: hidden_size / heads, as its __post_init__ derives it."""
    config = dict(ERNIE, head_dim=None, num_attention_heads=2, num_key_value_heads=1)
    assert spec_from_config(config, "a").head_dim == _theirs(config).head_dim == 64


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "granite", "smollm3", "phi3", "mixtral",
                                        "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "gemma", "gemma2", "olmo2",
                                        "ernie4_5", "helium", "seed_oss", "glm", "glm4"])
def test_rope_theta_left_out_is_the_config_class_default(model_type):
    """A config without rope_theta rotates with its class's default_theta (SmolLM3 2e6, Mixtral 1e6, ERNIE 5e5, Helium
    1e5, the rest 1e4), not one value for all."""
    assert model_type in LLM_FAMILIES
    config = {"model_type": model_type, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512}
    assert spec_from_config(config, "t").rope.theta == _theirs(config).rope_parameters["rope_theta"]


def test_qwen3_vl_text_theta_left_out_is_its_class_default():
    from transformers import Qwen3VLTextConfig

    text = {"model_type": "qwen3_vl_text", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512}
    assert spec_from_config(text, "t").rope.theta == Qwen3VLTextConfig(**text).rope_parameters["rope_theta"] == 5e5


@pytest.mark.parametrize("config,message", [
    (dict(ERNIE, use_bias=True), "use_bias=true is not supported for ernie4_5"),
    (dict(HELIUM, mlp_bias=True), "mlp_bias=true is not supported"),
    (dict(HELIUM, head_dim=128), "head_dim=128 with 4 heads is not hidden_size=256: helium's o_proj"),
    (dict(SEED_OSS, attention_out_bias=True), "attention_out_bias=true is not supported"),
    (dict(ERNIE, attention_bias=True), "attention_bias=true is not supported for ernie4_5; supported: q/k/v bias of "
                                       "qwen2, helium, seed_oss"),
    (dict(ERNIE, partial_rotary_factor=0.5), "partial_rotary_factor=0.5: partial rotary embeddings are not supported"),
    (dict(GLM, partial_rotary_factor=0.3), "partial_rotary_factor=0.3 rotates 19 of head_dim 64"),
])
def test_what_is_not_built_is_refused_in_one_line(config, message):
    with pytest.raises(MkportError, match=message) as e:
        spec_from_config(config, "a")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_weight_names_are_transformers_state_dict(case):
    """The checkpoint mkport reads and writes has each family's ForCausalLM's tensors, shape for shape (Helium's,
    Seed-OSS's and GLM's q/k/v biases; ERNIE's head tied to the embeddings; GLM's gate_up_proj, GLM-4's four norms)."""
    from transformers import AutoModelForCausalLM

    from mkport.check.reference import own_default_rope

    spec = spec_from_config(CONFIGS[case], "a")
    with own_default_rope():  # GLM's half-head RoPE even after the official Qwen3-TTS code's registration in this process
        model = AutoModelForCausalLM.from_config(_theirs(CONFIGS[case]))
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (spec.tie_embeddings and k == "lm_head.weight")}
    assert checkpoint_shapes(spec, weight_names(spec)) == theirs


@pytest.mark.parametrize("case", ["ernie4_5", "glm"])
def test_rotating_the_reordered_halves_is_rotating_the_pairs(case):
    """The kernel's rotate-half RoPE on reordered q and k rows gives the pairs' rotation reordered (transformers'
    apply_rotary_pos_emb of ERNIE, and of GLM, which rotates the pairs of a head's first half only), so every score
    q . k is the same."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{case}.modeling_{case}")
    spec = spec_from_config(CONFIGS[case], "a")
    d, r, heads = spec.head_dim, spec.rope_dim, spec.num_heads + spec.num_kv_heads
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(spec.qkv_rows, spec.hidden_size, generator=gen)
    x = torch.randn(5, spec.hidden_size, generator=gen)
    positions = torch.arange(40, 45, dtype=torch.float32)
    inv = 1.0 / spec.rope.theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r)
    angle = torch.cat([positions[:, None] * inv] * 2, dim=-1)  # [N, r], as transformers' rotary embedding
    pairs = (x @ w[: heads * d].T).view(5, heads, d).transpose(0, 1)[None]  # [1, heads, N, d]
    q_pairs, _ = modeling.apply_rotary_pos_emb(pairs, pairs, angle.cos()[None], angle.sin()[None])
    halves = (x @ pairs_to_halves(spec, w)[: heads * d].T).view(5, heads, d)
    q_halves = _rope(halves, angle.cos(), angle.sin())
    order = torch.cat([torch.arange(r).view(r // 2, 2).t().reshape(-1), torch.arange(r, d)])
    torch.testing.assert_close(q_halves, q_pairs[0].transpose(0, 1)[..., order])
    torch.testing.assert_close(pairs_to_halves(spec, w)[heads * d:], w[heads * d:], rtol=0, atol=0)  # v as it was


@pytest.mark.parametrize("case", ADJACENT)
def test_without_the_reorder_q_fails_at_the_first_layer(family_model, case):
    """The weights loaded as if the family rotated halves (the reorder left out): the first layer's q parts from
    transformers' on the first state it touches."""
    spec, w, ref, path = family_model(case)
    plain = dataclasses.replace(spec, rope=dataclasses.replace(spec.rope, adjacent_pairs=False))
    unordered = load_weights(plain, Checkpoint.open(path))
    _, _, report = torch_path_against_transformers(plain, unordered, ref, validation_inputs(spec, case, n=12, seed=3))
    assert not report.passed and report.first_failure.name == Tap.layer(0, Tap.Q), report.to_text()
    _, _, report = torch_path_against_transformers(spec, w, ref, validation_inputs(spec, case, n=12, seed=3))
    assert report.passed, report.to_text()


def test_other_specs_digest_as_before():
    """adjacent_pairs enters spec.json (a build's digest) only where set: every other spec's builds and random weights
    stay valid (qwen3-0.6b's digest as before the field)."""
    from mkport.kernel.spec import load_spec

    assert "adjacent_pairs" not in load_spec("qwen3-0.6b").to_dict()["rope"]
    assert load_spec("qwen3-0.6b").digest() == "f4b2db5a359c"
    assert spec_from_config(ERNIE, "a").to_dict()["rope"]["adjacent_pairs"] is True


def test_glm4s_norms_read_under_gemmas_meaning_fail_at_the_first_attention_output(family_model, monkeypatch):
    """GLM-4's post_attention_layernorm norms the MLP input (its attention output's is post_self_attn_layernorm): the
    two read the other way round, as Gemma 2 means them, part from transformers' at layer 0's attention residual."""
    from mkport.runtime import weights

    spec, w, ref, path = family_model("glm4")
    monkeypatch.setattr(weights, "post_norm_names", lambda spec: (
        "post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm"))
    swapped = load_weights(spec, Checkpoint.open(path))
    _, _, report = torch_path_against_transformers(spec, swapped, ref, validation_inputs(spec, "glm4", n=12, seed=3))
    assert not report.passed and report.first_failure.name == Tap.layer(0, Tap.ATTN_RESIDUAL), report.to_text()
