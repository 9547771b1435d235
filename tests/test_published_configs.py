"""Configs outside the bundle, as a new user brings them (issue 28): the config.json of popular checkpoints of every
supported family, transcribed from the Hugging Face Hub into tests/published_configs/ (the fields that shape a port;
multimodal wrappers as published, Gemma 3's text_config leaning on its defaults). Each is read without code
changes into the spec its family's transformers classes describe, and its kernel compiles for sm_90 without spills
(test_generate_check.py's pool); the ones whose features are not supported are refused in one line naming the field.
Their `mkport diff` on the GPU: `scripts/gpu_validate.sh published`."""

from __future__ import annotations

import pytest
from conftest import PUBLISHED_CONFIGS

from mkport.errors import MkportError
from mkport.kernel.spec import spec_from_config

REFUSED = {
    "deepseek-v2-lite": "n_routed_experts=64: mixture of experts is supported for model_type qwen3_moe, qwen2_moe, "
                        "olmoe, mixtral, granitemoe, qwen3_5_moe, not 'deepseek_v2'",
}
# name -> family, layers, heads / kv heads, head_dim, vocab, RoPE variant and rotated dims, sliding layers and their
# window, the attention scale's denominator squared (scale = d ** -0.5), experts (count, top k, shared) or None
EXPECTED = {
    "gemma-2-9b-it": ("gemma2", 42, 16, 8, 256, 256000, "standard", 256, 21, 4096, 256, None),
    "gemma-2-27b-it": ("gemma2", 46, 32, 16, 128, 256000, "standard", 128, 23, 4096, 144, None),  # query_pre_attn_scalar
    "gemma-3-270m-it": ("gemma3", 18, 4, 1, 256, 262144, "standard", 256, 15, 512, 256, None),
    "gemma-3-4b-it": ("gemma3", 34, 8, 4, 256, 262208, "linear", 256, 29, 1024, 256, None),  # Gemma3TextConfig defaults
    "gemma-3-12b-it": ("gemma3", 48, 16, 8, 256, 262208, "linear", 256, 40, 1024, 256, None),
    "phi-3-mini-4k-instruct": ("phi3", 32, 32, 32, 96, 32064, "standard", 96, 32, 2047, 96, None),
    "phi-3-medium-4k-instruct": ("phi3", 40, 40, 10, 128, 32064, "standard", 128, 40, 2047, 128, None),
    "phi-4-mini-instruct": ("phi3", 32, 24, 8, 128, 200064, "longrope", 96, 32, 262144, 128, None),
    "mistral-nemo-instruct-2407": ("mistral", 40, 32, 8, 128, 131072, "standard", 128, 0, 0, 128, None),
    "ministral-8b-instruct-2410": ("mistral", 36, 32, 8, 128, 131072, "standard", 128, 36, 32768, 128, None),
    "olmo-2-1124-7b": ("olmo2", 32, 32, 32, 128, 100352, "standard", 128, 0, 0, 128, None),
    "olmo-2-0325-32b": ("olmo2", 64, 40, 8, 128, 100352, "standard", 128, 0, 0, 128, None),
    "granite-3.3-8b-instruct": ("granite", 40, 32, 8, 128, 49159, "standard", 128, 0, 0, 128**2, None),
    "llama-3.1-8b-instruct": ("llama", 32, 32, 8, 128, 128256, "llama3", 128, 0, 0, 128, None),
    "qwen2.5-7b-instruct-yarn": ("qwen2", 28, 28, 4, 128, 152064, "yarn", 128, 0, 0, 128, None),
    "qwen3-4b": ("qwen3", 36, 32, 8, 128, 151936, "standard", 128, 0, 0, 128, None),
    "mixtral-8x22b-instruct": ("mixtral", 56, 48, 8, 128, 32768, "standard", 128, 0, 0, 128, (8, 2, 0)),
    "qwen2-57b-a14b": ("qwen2_moe", 28, 28, 4, 128, 151936, "standard", 128, 0, 0, 128, (64, 8, 20480)),
    "qwen3-moe-235b": ("qwen3_moe", 94, 64, 4, 128, 151936, "standard", 128, 0, 0, 128, (128, 8, 0)),
    "granite-3.0-1b-a400m": ("granitemoe", 24, 16, 8, 64, 49155, "standard", 64, 0, 0, 64**2, (32, 8, 0)),
    # its text decoder as released (the vision tower's config left out: mkport does not read it)
    "qwen3.5-35b-a3b": ("qwen3_5_moe", 40, 16, 2, 256, 248320, "mrope", 64, 0, 0, 256, (256, 8, 512)),
    "ernie-4.5-0.3b-pt": ("ernie4_5", 18, 16, 2, 128, 103424, "standard", 128, 0, 0, 128, None),
    "helium-1-preview-2b": ("helium", 24, 20, 20, 128, 48000, "standard", 128, 0, 0, 128, None),
    "seed-oss-36b-instruct": ("seed_oss", 64, 80, 8, 128, 155136, "standard", 128, 0, 0, 128, None),
    "exaone-4.0-32b": ("exaone4", 64, 40, 8, 128, 102400, "llama3", 128, 48, 4096, 128, None),
    "glm-4-9b-chat-hf": ("glm", 40, 32, 2, 128, 151552, "standard", 64, 0, 0, 128, None),
    "glm-4-9b-0414": ("glm4", 40, 32, 2, 128, 151552, "standard", 64, 0, 0, 128, None),
    # flat, as released: the text decoder's fields beside vision_config
    "qwen2.5-vl-7b-instruct": ("qwen2", 28, 28, 4, 128, 152064, "mrope", 128, 0, 0, 128, None),
}


def published(name: str) -> dict:
    return PUBLISHED_CONFIGS[name]


def test_every_published_config_is_checked():
    assert sorted([*EXPECTED, *REFUSED]) == sorted(PUBLISHED_CONFIGS)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_a_published_config_gives_its_familys_spec(name):
    family, layers, heads, kv, head_dim, vocab, rope, rotated, sliding, window, scale_d, experts = EXPECTED[name]
    spec = spec_from_config(published(name), name)
    assert (spec.family, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (
        family, layers, heads, kv, head_dim, vocab)
    assert (spec.rope.variant, spec.rope_dim) == (rope, rotated)
    windows = [w for w in spec.attention_windows if w]
    assert (len(windows), max(windows, default=0)) == (sliding, window)
    assert spec.attention_scale == pytest.approx(scale_d**-0.5, rel=1e-6)
    got = None if spec.moe is None else (spec.moe.num_experts, spec.moe.top_k, spec.moe.shared_expert_intermediate_size)
    assert got == experts


def test_the_features_each_published_family_brings():
    """What sets each family apart, read from its published config."""
    gemma2 = spec_from_config(published("gemma-2-9b-it"), "g2")
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.sandwich_norms) == (50.0, 30.0, True)
    assert gemma2.attention_windows[:2] == (4096, 0)  # sliding on even layers, as Gemma2Config's layer_types
    assert gemma2.embedding_multiplier == pytest.approx(3584**0.5) and gemma2.tie_embeddings
    gemma3 = spec_from_config(published("gemma-3-4b-it"), "g3")
    assert gemma3.qk_norm and gemma3.local_rope.theta == 10000.0 and gemma3.rope.factor == 8.0
    assert [i for i, w in enumerate(gemma3.attention_windows) if not w] == [5, 11, 17, 23, 29]  # 5 sliding : 1 full
    phi4 = spec_from_config(published("phi-4-mini-instruct"), "p4")
    assert phi4.fused_projections and phi4.tie_embeddings and phi4.rope.original_max_position == 4096
    assert phi4.rope.factor == 32.0 and phi4.rope.attention_factor == pytest.approx((1 + 3.4657359 / 8.3177662) ** 0.5)
    nemo = spec_from_config(published("mistral-nemo-instruct-2407"), "n")
    assert nemo.num_heads * nemo.head_dim == 4096 != nemo.hidden_size
    olmo = spec_from_config(published("olmo-2-1124-7b"), "o")
    assert (olmo.pre_norms, olmo.qk_norm_span) == (False, "projection")
    granite = spec_from_config(published("granite-3.3-8b-instruct"), "gr")
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.logits_scaling) == (12.0, 0.22, 16.0)
    qwen25 = spec_from_config(published("qwen2.5-7b-instruct-yarn"), "q")
    assert qwen25.qkv_bias and (qwen25.max_position, qwen25.max_context) == (32768, 131072)
    assert not spec_from_config(published("qwen2-57b-a14b"), "m").moe.norm_topk_prob
    granite_moe = spec_from_config(published("granite-3.0-1b-a400m"), "gm")  # granite's multipliers, every layer sparse
    assert (granite_moe.embedding_multiplier, granite_moe.residual_multiplier, granite_moe.logits_scaling) == (12.0, 0.22, 6.0)
    assert granite_moe.moe.norm_topk_prob and granite_moe.moe.sparse_layers == tuple(range(24)) and granite_moe.tie_embeddings
    qwen35 = spec_from_config(published("qwen3.5-35b-a3b"), "q35")  # every layer sparse, 3 of 4 Gated DeltaNet
    assert qwen35.moe.norm_topk_prob and qwen35.moe.sparse_layers == tuple(range(40)) and not qwen35.tie_embeddings
    assert qwen35.linear_layers == tuple(i for i in range(40) if i % 4 != 3) and qwen35.attn_output_gate
    assert qwen35.linear_attention.num_value_heads == 32 and qwen35.norm_weight_offset == 1.0
    ernie = spec_from_config(published("ernie-4.5-0.3b-pt"), "e")  # RoPE on adjacent pairs, tied
    assert ernie.rope.adjacent_pairs and ernie.rope.theta == 500000 and ernie.tie_embeddings and not ernie.qkv_bias
    helium = spec_from_config(published("helium-1-preview-2b"), "h")
    assert helium.rope.adjacent_pairs and (helium.rope.theta, helium.rms_eps) == (100000.0, 1e-8)
    seed = spec_from_config(published("seed-oss-36b-instruct"), "s")  # q/k/v bias, no o_proj bias
    assert seed.qkv_bias and not seed.rope.adjacent_pairs and seed.rope.theta == 1e7
    exaone = spec_from_config(published("exaone-4.0-32b"), "x")  # post-norm, per-head q/k norms, full layers unrotated
    assert not exaone.pre_norms and exaone.qk_norm_span == "head" and exaone.nope_layers == tuple(range(3, 64, 4))
    for name in ("glm-4-9b-chat-hf", "glm-4-9b-0414"):  # half of each head rotated on adjacent pairs, q/k/v bias
        glm = spec_from_config(published(name), name)
        assert glm.rope.adjacent_pairs and glm.rope_dim == 64 and glm.qkv_bias and glm.fused_gate_up
        assert glm.sandwich_norms == (glm.family == "glm4") and glm.norm_weight_offset == 0.0


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_published_config_outside_the_envelope_is_refused_in_one_line(name):
    with pytest.raises(MkportError) as e:
        spec_from_config(published(name), name)
    assert str(e.value) == REFUSED[name] and "\n" not in str(e.value)
