"""The families beyond the Llama lineage (mistral / ministral, granite, smollm3): specs from their published
configs, the refusals that name a feature, the rendered constants, and ablations that must fail: each feature
switched off or mis-set in torch_model (the kernel's schedule on CPU) diverges from transformers' own class at
the layer and op where it bites."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import (FEATURE_ABLATIONS, PHI3_MEDIUM_4K, SMALL_WINDOW, assert_config_refused, load_script,
                      torch_path_against_transformers, torch_path_taps, validation_inputs)
from mkport.runtime import torch_model
from mkport.check.diff import compare
from mkport.kernel.gpu import target_for_arch
from mkport.check.reference import Reference
from mkport.kernel.render import render
from mkport.kernel.spec import _bundled_path, load_spec, open_model, spec_from_config
from mkport.kernel.launch_plan import plan_launch
from mkport.runtime.weights import (Checkpoint, checkpoint_shapes, load_weights, random_checkpoint, to_kernel_layout,
                                    weight_names, write_random_weights)


def bundled_config(filename: str) -> dict:
    return json.loads(_bundled_path(filename).read_text())


# -- specs from the published configs ------------------------------------------------------------------------------

def test_mistral_v03_is_the_llama_shape():
    s = load_spec("mistral-7b-v0.3")
    assert (s.family, s.num_layers, s.hidden_size, s.head_dim, s.num_kv_heads, s.vocab_size) == (
        "mistral", 32, 4096, 128, 8, 32768)
    assert not s.sliding and s.attention_windows == () and s.rope.theta == 1e6 and not s.tie_embeddings


def test_mistral_v01_slides_every_layer():
    s = load_spec("mistral-7b-v0.1")
    assert s.attention_windows == (4096,) * 32 and s.window(31) == 4096 and s.sliding


def test_mistral_without_sliding_window_key_takes_transformers_default():
    """MistralConfig defaults sliding_window to 4096 when the key is absent; null means no window."""
    cfg = bundled_config("mistral-7b-v0.3.json")
    del cfg["sliding_window"]
    assert spec_from_config(cfg, "m").attention_windows == (4096,) * 32


def test_mistral_nemo_head_dim_is_explicit():
    """Mistral-Nemo: head_dim 128 with hidden 5120 and 32 heads (q rows 4096, not the hidden size)."""
    cfg = dict(bundled_config("mistral-7b-v0.3.json"), hidden_size=5120, head_dim=128, num_hidden_layers=40,
               vocab_size=131072, rope_theta=1e6, max_position_embeddings=1024000)
    s = spec_from_config(cfg, "nemo")
    assert s.head_dim == 128 and s.num_heads * s.head_dim == 4096 != s.hidden_size
    assert s.attention_scale == 128**-0.5


def test_ministral_layer_types_set_windows_per_layer():
    cfg = dict(bundled_config("mistral-7b-v0.1.json"), model_type="ministral", num_hidden_layers=4, head_dim=128,
               sliding_window=32768, layer_types=["sliding_attention", "full_attention"] * 2)
    assert spec_from_config(cfg, "m").attention_windows == (32768, 0, 32768, 0)
    cfg.pop("layer_types")  # MinistralConfig: every layer slides when there is a window
    assert spec_from_config(cfg, "m").attention_windows == (32768,) * 4


def test_granite_multipliers():
    s = load_spec("granite-3.1-2b")
    assert (s.family, s.num_layers, s.head_dim, s.vocab_size, s.tie_embeddings) == ("granite", 40, 64, 49155, True)
    assert (s.embedding_multiplier, s.residual_multiplier, s.attention_scale, s.logits_scaling) == (
        12.0, 0.22, 0.015625, 8.0)


def test_granite_defaults_are_transformers_defaults():
    """GraniteConfig defaults every multiplier to 1, attention_multiplier too (not head_dim^-0.5)."""
    cfg = bundled_config("granite-3.1-2b-instruct.json")
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        del cfg[key]
    s = spec_from_config(cfg, "g")
    assert (s.embedding_multiplier, s.residual_multiplier, s.attention_scale, s.logits_scaling) == (1, 1, 1, 1)


def test_smollm3_nope_layers():
    """no_rope_layers holds 1 for a layer that uses RoPE: SmolLM3-3B leaves it out of every 4th layer."""
    s = load_spec("smollm3-3b")
    assert s.nope_layers == tuple(range(3, 36, 4)) and not s.uses_rope(3) and s.uses_rope(0)
    assert not s.sliding and s.tie_embeddings and s.head_dim == 128
    cfg = bundled_config("smollm3-3b.json")
    for key in ("no_rope_layers", "tie_word_embeddings"):
        del cfg[key]  # the interval rule, and SmolLM3Config's tied default
    s = spec_from_config(cfg, "s")
    assert s.nope_layers == tuple(range(3, 36, 4)) and s.tie_embeddings


def test_phi35_mini_head_dim_96_and_longrope():
    """Phi-3.5-mini-instruct as Phi3Config reads it: head_dim 3072 / 32 = 96, longrope from 4096 to 131072 positions
    with its 48 short and long factors and transformers' attention factor, a window (262144) past every position;
    planned for sm_90 (test_rope_scaling and test_gpu_kernel_families run head_dim 96 with longrope on tiny models)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    source = open_model("phi-3.5-mini")
    s, cfg = source.spec, source.config
    theirs = AutoConfig.for_model("phi3", **{k: v for k, v in cfg.items() if k != "model_type"})
    assert (s.family, s.num_layers, s.hidden_size, s.intermediate_size, s.vocab_size) == ("phi3", 32, 3072, 8192, 32064)
    assert s.head_dim == theirs.hidden_size // theirs.num_attention_heads == 96 and s.num_kv_heads == 32
    assert (s.rope.variant, s.rope.theta, s.rope.original_max_position, s.max_position) == (
        "longrope", 1e4, 4096, 131072)
    assert (s.rope.short_factor, s.rope.long_factor) == (
        tuple(cfg["rope_scaling"]["short_factor"]), tuple(cfg["rope_scaling"]["long_factor"]))
    assert len(s.rope.long_factor) == 48 and s.rope.long_factor != s.rope.short_factor
    assert s.rope.attention_factor == pytest.approx(ROPE_INIT_FUNCTIONS["longrope"](theirs, torch.device("cpu"))[1])
    assert s.attention_windows == (262144,) * 32 and not s.tie_embeddings
    assert plan_launch(s, target_for_arch("sm_90")).batch == 1


# Issue 28's bundled files shrunk in width and depth only: every other field as written (auto_map, cache_implementation,
# sliding_window_pattern, pad and EOS ids, the vocabulary, the longrope factors, which need head_dim 96)
SHRUNK = {"gemma-2-2b": dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=64, num_hidden_layers=2),
          "gemma-3-1b": dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=64, num_hidden_layers=6),  # the 6th layer is its first full one
          "olmo-2-0425-1b": dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
                                 num_hidden_layers=2),
          "phi-3.5-mini": dict(hidden_size=192, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
                               num_hidden_layers=2)}


@pytest.mark.parametrize("name", list(SHRUNK))
def test_bundled_files_run_as_written(tmp_path, name):
    """A bundled file's fields beside the shape (shrunk) load in transformers' own class and in mkport alike: the
    torch path (the kernel's schedule on CPU) passes the diff against the float32 reference, in one pass and token by
    token with a bf16 KV cache."""
    (tmp_path / "config.json").write_text(json.dumps(dict(open_model(name).config, **SHRUNK[name])))
    source = open_model(str(tmp_path))
    write_random_weights(source.spec, tmp_path, seed=3)
    checkpoint = Checkpoint.open(tmp_path)
    inp = validation_inputs(source.spec, name, seed=3)
    reference = Reference(source, checkpoint).run(tokens=inp["tokens"], positions=inp["positions"])
    weights = load_weights(source.spec, checkpoint)
    for decode in (False, True):
        report = compare(_ours(source.spec, weights, inp, decode), dict(reference.taps, logits=reference.logits),
                         source.spec)
        assert report.passed, (decode, report.to_text())


def test_smollm3_sliding_only_where_the_config_says():
    cfg = dict(bundled_config("smollm3-3b.json"), num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0],
               use_sliding_window=True, sliding_window=4096)
    del cfg["layer_types"]  # SmolLM3Config: sliding on the NoPE layers
    assert spec_from_config(cfg, "s").attention_windows == (0, 0, 0, 4096)
    cfg["layer_types"] = ["sliding_attention", "full_attention", "full_attention", "full_attention"]
    assert spec_from_config(cfg, "s").attention_windows == (4096, 0, 0, 0)


def test_phi3_fused_projections_and_window():
    s = spec_from_config(PHI3_MEDIUM_4K, "phi-3-medium-4k")
    assert (s.family, s.head_dim, s.num_kv_heads, s.fused_projections) == ("phi3", 128, 10, True)
    assert s.attention_windows == (2047,) * 40
    names = checkpoint_shapes(s, weight_names(s))
    assert names["model.layers.0.self_attn.qkv_proj.weight"] == (40 * 128 + 2 * 10 * 128, 5120)
    assert names["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 17920, 5120)
    assert "model.layers.0.self_attn.q_proj.weight" not in names
    assert spec_from_config(dict(PHI3_MEDIUM_4K, sliding_window=None), "p").attention_windows == ()


def test_phi3_split_at_load_is_transformers_order(validation_models):
    """q, k, v rows of qkv_proj in that order; gate_up_proj's first half the gate (Phi3MLP: gate, up = chunk(2))."""
    spec = open_model(validation_models["phi3"]).spec
    tensors = random_checkpoint(spec, seed=5)
    w = to_kernel_layout(spec, tensors)
    qkv = tensors["model.layers.1.self_attn.qkv_proj.weight"]
    gate_up = tensors["model.layers.1.mlp.gate_up_proj.weight"]
    assert torch.equal(w.layers[1].wqkv, qkv)
    assert torch.equal(w.layers[1].w_gate, gate_up[: spec.intermediate_size])
    assert torch.equal(w.layers[1].w_up, gate_up[spec.intermediate_size :])


# -- refusals: one line naming the field and the feature -----------------------------------------------------------

def _llama(**overrides) -> dict:
    return dict(bundled_config("tinyllama-1.1b.json"), **overrides)


REFUSALS = {
    # head_dim 96 outside phi3 (Phi-3/3.5-mini's runs on the plain-torch path: test_rope_scaling)
    "llama-head-dim-96": (_llama(hidden_size=3072, num_attention_heads=32), "head_dim=96 is not supported"),
    # partial rotary outside qwen3_5 and phi3 (Phi-4-mini's runs on the plain-torch path: test_rope_scaling)
    "llama-partial-rotary": (_llama(partial_rotary_factor=0.5), "partial_rotary_factor=0.5: partial rotary embeddings"),
    # the 128k variants' short and long factors, one per frequency (test_rope_scaling runs well-formed ones)
    "phi3-longrope-factors": (dict(PHI3_MEDIUM_4K, rope_scaling={"type": "longrope", "short_factor": [1.0] * 64,
                                                                  "long_factor": [4.0] * 48}),
                              "long_factor and short_factor must have head_dim/2 = 64 entries, got 48 and 64"),
    "granitemoeshared": (_llama(model_type="granitemoeshared", num_local_experts=40), "num_local_experts=40: mixture of "
                         "experts is supported for model_type qwen3_moe, qwen2_moe, olmoe, mixtral, granitemoe, "
                         "qwen3_5_moe, not 'granitemoeshared'"),
    "llama-experts": (_llama(num_experts=8), "num_experts=8: mixture of experts is supported for model_type"),
    "deepseek_v3": (_llama(model_type="deepseek_v3", n_routed_experts=256, kv_lora_rank=512), "n_routed_experts=256"),
    "mla": (_llama(model_type="deepseek_v2", kv_lora_rank=512), "kv_lora_rank=512: multi-head latent attention (MLA)"),
    "qwen3_5-without-text-config": (_llama(model_type="qwen3_5", layer_types=["linear_attention", "full_attention"]),
                                    "its decoder is read from text_config"),
    "llama-linear-attention": (_llama(layer_types=["linear_attention", "full_attention"] * 11),
                               "layer_types contains 'linear_attention': hybrid linear-attention layers"),
    "gemma-silu": (_llama(model_type="gemma"), "hidden_act 'silu' is not supported for gemma"),  # tinyllama's silu
    "gemma3n": (_llama(model_type="gemma3n_text", hidden_size_per_layer_input=256), "per-layer inputs"),
    "qwen2-sliding": (_llama(model_type="qwen2", use_sliding_window=True), "use_sliding_window=true: sliding-window"),
    "llama-sliding": (_llama(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]),
                      "sliding-window attention is not supported for llama"),
    "llama-nope": (_llama(no_rope_layers=[1] * 22), "no_rope_layers is not supported for llama"),
    "llama-multiplier": (_llama(residual_multiplier=0.22), "residual_multiplier is not supported for llama"),
    "smollm3-ambiguous": (dict(bundled_config("smollm3-3b.json"), layer_types=["sliding_attention"] * 36),
                          "use_sliding_window is false"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_unbuilt_features_are_refused_by_name(name):
    assert_config_refused(*REFUSALS[name])


@pytest.mark.parametrize("name", ["mla", "llama-partial-rotary"])
def test_refusal_through_the_cli_is_one_line_exit_2(tmp_path, name):
    """`mkport generate` on such a config: exit 2, one line naming the field (the partial rotations the megakernel
    does not lay out, which the plain-torch path runs, are refused by its commands: test_rope_scaling.py)."""
    from test_cli import run

    config, words = REFUSALS[name]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    proc = run("generate", str(path))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and words in proc.stderr


# -- rendered constants --------------------------------------------------------------------------------------------

def _sources(spec) -> dict:
    return render(spec, plan_launch(spec, target_for_arch("sm_90"))).files


def test_rendered_windows_nope_and_multipliers():
    sliding = _sources(load_spec("mistral-7b-v0.1"))["constants.cuh"]
    assert "ATTN_WINDOW[L] = { " + ", ".join(["4096"] * 32) + " }" in sliding and "#define HAS_SLIDING_WINDOW 1" in sliding
    nope = _sources(load_spec("smollm3-3b"))["constants.cuh"]
    assert "ROPE_LAYER[L] = { " + ", ".join(["1, 1, 1, 0"] * 9) + " }" in nope and "#define HAS_NOPE_LAYERS 1" in nope
    granite = _sources(load_spec("granite-3.1-2b"))["constants.cuh"]
    assert "ATTN_SCALE = 0x1.0000000000000p-6f" in granite  # 0.015625, not 64^-0.5
    for flag in ("HAS_EMBEDDING_MULTIPLIER", "HAS_RESIDUAL_MULTIPLIER", "HAS_LOGITS_SCALING"):
        assert f"constexpr bool {flag} = true;" in granite
    plain = _sources(load_spec("qwen3-0.6b"))["constants.cuh"]  # the Llama lineage has none of them
    for flag in ("HAS_EMBEDDING_MULTIPLIER", "HAS_RESIDUAL_MULTIPLIER", "HAS_LOGITS_SCALING"):
        assert f"constexpr bool {flag} = false;" in plain
    assert "#define HAS_SLIDING_WINDOW 0" in plain and "#define HAS_NOPE_LAYERS 0" in plain
    assert "ATTN_WINDOW[" not in plain and "ROPE_LAYER[" not in plain


# -- the window's exact semantics, against transformers' own mask ----------------------------------------------------

@pytest.mark.parametrize("n,start,window", [(12, 0, 5), (1, 20, 5), (7, 9, 4), (3, 2, 8)])
def test_window_mask_is_transformers_mask(n, start, window):
    """The row at cache index p sees p-W+1..p, as transformers' sliding_window_causal_mask_function says (in the
    version installed: this pins the semantics wherever the tests run)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    theirs = sliding_window_causal_mask_function(window)
    t = torch.tensor
    expected = torch.tensor([[bool(theirs(t(0), t(0), t(start + q), t(kv))) for kv in range(start + n)] for q in range(n)])
    ours = torch_model.attention_mask(n, start, window, "cpu")
    assert torch.equal(ours, expected)
    assert int(ours[-1].sum()) == min(window, start + n)


# -- ablations: each feature switched off or mis-set fails where it bites -------------------------------------------

_CACHE: dict = {}


def _setup(validation_models, case):
    if case not in _CACHE:
        model = validation_models[case]
        source, checkpoint = open_model(model), Checkpoint.open(model)
        spec = source.spec
        inp = validation_inputs(spec, case, seed=4)
        out = Reference(source, checkpoint).run(tokens=inp["tokens"], positions=inp["positions"])
        _CACHE[case] = (spec, load_weights(spec, checkpoint), dict(out.taps, logits=out.logits), inp)
    return _CACHE[case]


def _ours(spec, w, inp, decode: bool) -> dict:
    return torch_path_taps(spec, w, inp["tokens"], inp["positions"], decode)


@pytest.mark.parametrize("case", ["mistral", "ministral", "granite", "smollm3", "phi3"])
def test_features_bite_in_the_validation_inputs(validation_models, case):
    """The cases are shaped so each feature matters: 12 rows past a window of SMALL_WINDOW, a NoPE layer, granite's
    multipliers far from 1; and the clean model passes both ways (prefill, and token by token with a bf16 cache)."""
    spec, w, reference, inp = _setup(validation_models, case)
    assert inp["tokens"].shape[0] > 2 * SMALL_WINDOW
    for decode in (False, True):
        report = compare(_ours(spec, w, inp, decode), reference, spec)
        assert report.passed, report.to_text()


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("name", list(FEATURE_ABLATIONS))
def test_ablation_fails_where_the_feature_bites(validation_models, name, decode):
    case, changes, first = FEATURE_ABLATIONS[name]
    spec, w, reference, inp = _setup(validation_models, case)
    wrong = dataclasses.replace(spec, **changes)
    report = compare(_ours(wrong, w, inp, decode), reference, spec)
    assert not report.passed
    assert report.first_failure.name == first, report.to_text()


def swapped_split(w, spec, what: str):
    """The kernel weights as a wrong split of phi3's fused tensors would give them: k and v rows exchanged, or
    gate and up."""
    def layer(lw):
        lw = dataclasses.replace(lw)
        if what == "kv":
            q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
            lw.wqkv = torch.cat([lw.wqkv[:q], lw.wqkv[q + kv :], lw.wqkv[q : q + kv]])
        else:
            lw.w_gate, lw.w_up = lw.w_up, lw.w_gate
        return lw

    return dataclasses.replace(w, layers=[layer(lw) for lw in w.layers])


@pytest.mark.parametrize("what,first", [("kv", "layers.0.k"), ("gate_up", "layers.0.mlp_residual")])
def test_phi3_wrong_split_fails(validation_models, what, first):
    spec, w, reference, inp = _setup(validation_models, "phi3")
    report = compare(_ours(spec, swapped_split(w, spec, what), inp, decode=False), reference, spec)
    assert not report.passed and report.first_failure.name == first, report.to_text()


# -- multimodal wrappers: their text decoder, from a folder laid out as released ------------------------------------

# Mistral Small 3.1's wrapper shrunk (mistral3: a mistral text_config, a pixtral vision tower)
MISTRAL3_WRAPPER = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
                    "spatial_merge_size": 2,
                    "text_config": {"model_type": "mistral", "vocab_size": 512, "hidden_size": 128,
                                    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
                                    "num_key_value_heads": 1, "head_dim": 64, "sliding_window": None,
                                    "max_position_embeddings": 512, "rope_theta": 1e6},
                    "vision_config": {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64,
                                      "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 16,
                                      "image_size": 56, "patch_size": 14}}


def _wrapper_greedy(folder: str, prompt: list[int], n: int) -> list[int]:
    """The wrapper's own class (from_pretrained, which maps the released layout's names) and its greedy generate."""
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", ["gemma3", "mistral3"])
def test_multimodal_wrapper_runs_its_text_decoder_as_transformers_loads_it(tmp_path, case):
    """A tiny wrapper's folder as released (the decoder under language_model.model., the head, untied, under
    language_model., a vision tower tensor beside them): mkport's plain-torch path against the reference on every
    tap, and TorchDecoder's greedy tokens against the wrapper's own from_pretrained and generate."""
    from safetensors.torch import save_file
    from test_gemma import GEMMA3_WRAPPER
    from test_run import reference_tokens

    (tmp_path / "config.json").write_text(json.dumps({"gemma3": GEMMA3_WRAPPER, "mistral3": MISTRAL3_WRAPPER}[case]))
    source = open_model(str(tmp_path))
    tensors = {"language_model." + k: v for k, v in random_checkpoint(source.spec, seed=3).items()}
    tensors["vision_tower.post_layernorm.weight"] = torch.ones(32, dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    checkpoint = Checkpoint.open(tmp_path)
    assert checkpoint.model_prefix(source.spec) == "language_model.model."
    assert source.spec.tie_embeddings == (case == "gemma3")  # mistral3's head is its own: read from language_model.
    inp = validation_inputs(source.spec, case, n=12, seed=4)
    ref = Reference(source, checkpoint)
    _, _, report = torch_path_against_transformers(source.spec, load_weights(source.spec, checkpoint), ref, inp)
    assert report.passed and len(report.rows) > 5 * source.spec.num_layers, report.to_text()
    prompt = [5, 77, 300, 12, 9]
    assert reference_tokens(str(tmp_path), prompt, 10) == _wrapper_greedy(str(tmp_path), prompt, 10)


def test_the_family_table_reads_what_diff_and_bench_write(tmp_path):
    """scripts/family_table.py on the JSON `mkport diff --json` and `mkport bench --json` write (KernelDiff.to_dict and
    bench's result rows): the clean diff's states, tokens and worst state, where the fault was found, the step and
    its ratio; a spec with no files is 'not run'."""
    from mkport.check.diff import DiffReport, DiffRow, KernelDiff

    rows = [DiffRow(0, "attn", 1e-3, 2e-3, 0.9999, 1e-2, True), DiffRow(1, "mlp", 1e-3, 6e-3, 0.9998, 1e-2, True),
            DiffRow(None, "logits", 1e-3, 3e-3, 0.9999, 2e-2, True)]
    clean = KernelDiff(DiffReport(rows, 8), steps=8, prompt_len=16, token_agreement=8, positions="equal")
    bad = [rows[0], DiffRow(1, "mlp", 1.0, 0.5, 0.8, 1e-2, False)]
    fault = KernelDiff(DiffReport(bad, 8), steps=8, prompt_len=16, token_agreement=5, positions="equal",
                       injected=(1, "mlp"))
    bench = {"spec": "fam", "floor_us": 1000.0, "results": [
        {"engine": "megakernel-v20", "context": 128, "median_us": 1600.0, "floor_fraction": 0.625},
        {"engine": "hf_graph", "context": 128, "median_us": 4000.0, "floor_fraction": 0.25, "megakernel_speedup": 2.5}]}
    for name, payload in (("diff-fam", clean.to_dict()), ("inject-fam", fault.to_dict()), ("bench-fam", bench)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"spec": "fam", **payload}))
    lines = load_script("family_table").table(tmp_path, ["fam", "other"]).splitlines()
    assert lines[2] == ("| fam | PASS, 3 states, tokens 8/8 | 6.00e-03 at 1:mlp (0.60 of tol) | `1:mlp`: found there |  "
                        "| 1600.0 us (62% of 1000) | 4000.0 us (2.50x) |")
    assert lines[3].count("not run") == 5 and len(lines) == 4
