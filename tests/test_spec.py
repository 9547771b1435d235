"""ModelSpec parsing: bundled specs, the config shapes mkport accepts, and the ones it must refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import LLAMA3_SCALING
from mkport.errors import MkportError
from mkport.kernel.gpu import KNOWN_TARGETS
from mkport.kernel.spec import MAX_BASE_NAME, SAFE_NAME, _bundled_path, bundled_names, load_spec, safe_name, spec_from_config
from mkport.kernel.launch_plan import ATTN_MAX_SPLITS, plan_launch

ARCHS = tuple(KNOWN_TARGETS)


def bundled_config(filename: str) -> dict:
    return json.loads(_bundled_path(filename).read_text())


def write_config(folder: Path, config: dict, filename: str = "config.json") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    path.write_text(json.dumps(config))
    return path


def llama_config(**overrides) -> dict:
    cfg = bundled_config("tinyllama-1.1b.json")
    cfg.update(overrides)
    return cfg


def qwen3_config(**overrides) -> dict:
    cfg = bundled_config("qwen3-0.6b.json")
    cfg.update(overrides)
    return cfg


# Qwen2-0.5B's published shape: 14 heads (not a power of two), 2 KV heads, head_dim 896/14 = 64, q/k/v bias.
QWEN2_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}


# ---------------------------------------------------------------------------------------------------
# Bundled specs


def test_bundled_names():
    names = bundled_names()
    assert names == [
        "qwen3-0.6b",
        "tinyllama-1.1b",
        "mistral-7b-v0.3",
        "mistral-7b-v0.1",
        "granite-3.1-2b",
        "smollm3-3b",
        "qwen3-tts-0.6b-talker",
        "qwen3-tts-0.6b-code-predictor",
        "qwen3-tts-1.7b-talker",
        "qwen3-tts-1.7b-code-predictor",
        "qwen3-30b-a3b",
        "qwen1.5-moe-a2.7b",
        "olmoe-1b-7b",
        "mixtral-8x7b",
        "gemma-2-2b",
        "gemma-3-1b",
        "olmo-2-0425-1b",
        "phi-3.5-mini",
        "qwen3.5-0.8b",
        "qwen3.5-4b",
    ]
    for name in names:
        assert load_spec(name).name == name


def test_qwen3_0_6b():
    s = load_spec("qwen3-0.6b")
    assert (s.family, s.role, s.input_mode, s.output_mode) == ("qwen3", "llm", "token", "logits")
    assert (s.num_layers, s.hidden_size, s.intermediate_size) == (28, 1024, 3072)
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.gqa_ratio) == (16, 8, 128, 2)
    assert s.vocab_size == 151936
    assert s.rope.theta == 1e6 and s.rope.variant == "standard"
    assert s.tie_embeddings and s.qk_norm and not s.qkv_bias
    assert s.rms_eps == 1e-6 and s.max_position == 40960
    assert s.qkv_rows == (16 + 2 * 8) * 128
    assert s.input_dim == 1024 and not s.input_projection
    assert (s.num_embedding_tables, s.num_output_heads) == (1, 1)


def test_tinyllama():
    s = load_spec("tinyllama-1.1b")
    assert s.family == "llama" and s.role == "llm"
    assert (s.num_layers, s.hidden_size, s.intermediate_size) == (22, 2048, 5632)
    assert (s.num_heads, s.num_kv_heads) == (32, 4)
    assert s.head_dim == 64  # derived: 2048 / 32, the config has no head_dim
    assert s.vocab_size == 32000
    assert s.rope.theta == 1e4 and s.rope.variant == "standard"
    assert not s.tie_embeddings and not s.qk_norm and not s.qkv_bias
    assert s.rms_eps == 1e-5


@pytest.mark.parametrize("size,hidden,inter", [("0.6b", 1024, 3072), ("1.7b", 2048, 6144)])
def test_tts_talker(size, hidden, inter):
    s = load_spec(f"qwen3-tts-{size}-talker")
    assert (s.family, s.role, s.input_mode, s.output_mode) == ("qwen3", "tts_talker", "embedding", "logits")
    assert (s.num_layers, s.hidden_size, s.intermediate_size) == (28, hidden, inter)
    assert (s.num_heads, s.num_kv_heads, s.head_dim) == (16, 8, 128)
    assert s.rope.variant == "mrope"
    assert s.rope.mrope_section == (24, 20, 20) and s.rope.mrope_interleaved
    assert s.rope.theta == 1e6
    assert s.vocab_size == 3072
    assert not s.tie_embeddings and s.qk_norm
    assert (s.num_embedding_tables, s.num_output_heads) == (1, 1)
    assert s.input_dim == hidden and not s.input_projection


@pytest.mark.parametrize("size,talker_hidden", [("0.6b", 1024), ("1.7b", 2048)])
def test_tts_code_predictor(size, talker_hidden):
    s = load_spec(f"qwen3-tts-{size}-code-predictor")
    assert (s.family, s.role, s.input_mode, s.output_mode) == ("qwen3", "tts_code_predictor", "embedding", "logits")
    assert (s.num_layers, s.hidden_size, s.intermediate_size) == (5, 1024, 3072)
    assert (s.num_heads, s.num_kv_heads, s.head_dim) == (16, 8, 128)
    assert s.rope.variant == "standard" and s.rope.theta == 1e6
    assert s.vocab_size == 2048
    assert (s.num_embedding_tables, s.num_output_heads) == (15, 15)
    assert s.input_dim == talker_hidden
    assert s.input_projection == (talker_hidden != 1024)
    assert not s.tie_embeddings


@pytest.mark.parametrize(
    "name,mbytes",
    [
        ("qwen3-tts-0.6b-talker", 887e6),
        ("qwen3-tts-1.7b-talker", 2.83e9),
        ("qwen3-tts-0.6b-code-predictor", 162e6),
    ],
)
def test_weight_bytes_per_step(name, mbytes):
    got = load_spec(name).weight_bytes_per_step()
    assert abs(got - mbytes) / mbytes < 0.01, got


def test_weight_bytes_counts_the_parts():
    talker = load_spec("qwen3-tts-1.7b-talker")
    pred_06, pred_17 = load_spec("qwen3-tts-0.6b-code-predictor"), load_spec("qwen3-tts-1.7b-code-predictor")
    # the 1.7B predictor adds the 2048 -> 1024 projection (weight and bias) and a wider input row
    assert pred_17.weight_bytes_per_step() - pred_06.weight_bytes_per_step() == 2 * (2048 * 1024 + 1024 + 1024)
    # tied and untied heads both read one vocab x hidden head
    assert talker.weight_bytes_per_step() > 28 * 2 * 2048 * 6144 * 3


def test_digest_is_stable_and_content_addressed():
    a, b = load_spec("qwen3-0.6b"), load_spec("qwen3-0.6b")
    assert a.digest() == b.digest() and len(a.digest()) == 12
    assert a.digest() != load_spec("qwen3-tts-0.6b-talker").digest()
    assert a.with_name("other").digest() != a.digest()


# ---------------------------------------------------------------------------------------------------
# Where a MODEL can come from


def test_from_config_path_and_folder(tmp_path):
    cfg = bundled_config("qwen3-0.6b.json")
    path = write_config(tmp_path / "My-Qwen", cfg)
    by_path, by_folder = load_spec(str(path)), load_spec(str(tmp_path / "My-Qwen"))
    assert by_path.name == by_folder.name == "My-Qwen"
    bundled = load_spec("qwen3-0.6b")
    assert by_path.with_name(bundled.name) == bundled
    other = write_config(tmp_path, cfg, "some-model.json")
    assert load_spec(str(other)).name == "some-model"


@pytest.mark.parametrize("size", ["0.6b", "1.7b"])
def test_tts_folder_parts(tmp_path, size):
    folder = tmp_path / f"tts-{size}"
    write_config(folder, bundled_config(f"qwen3-tts-12hz-{size}-customvoice.json"))
    talker = load_spec(f"{folder}:talker")
    predictor = load_spec(f"{folder}:code_predictor")
    assert talker.name == f"tts-{size}-talker" and predictor.name == f"tts-{size}-code-predictor"
    assert talker.with_name("x") == load_spec(f"qwen3-tts-{size}-talker").with_name("x")
    assert predictor.with_name("x") == load_spec(f"qwen3-tts-{size}-code-predictor").with_name("x")
    # the config.json path works the same as the folder
    assert load_spec(f"{folder / 'config.json'}:talker") == talker


def qwen3_vl_config(rope_key: str) -> dict:
    text = qwen3_config(model_type="qwen3_vl_text", hidden_size=2048, intermediate_size=6144)
    for key in ("architectures", "tie_word_embeddings", "rope_scaling", "rope_theta"):
        text.pop(key, None)
    rope = {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    if rope_key == "rope_parameters":  # transformers 5: theta inside rope_parameters
        text["rope_parameters"] = dict(rope, rope_theta=5000000.0)
    else:
        text["rope_scaling"] = rope
        text["rope_theta"] = 5000000.0
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "text_config": text,
        "vision_config": {"depth": 24, "hidden_size": 1024},
        "tie_word_embeddings": True,
    }


@pytest.mark.parametrize("rope_key", ["rope_scaling", "rope_parameters"])
def test_qwen3_vl_text_config(tmp_path, rope_key):
    folder = tmp_path / "qwen3-vl"
    write_config(folder, qwen3_vl_config(rope_key))
    s = load_spec(str(folder))
    assert s.family == "qwen3" and s.role == "llm" and s.qk_norm
    assert (s.hidden_size, s.intermediate_size, s.num_heads, s.head_dim) == (2048, 6144, 16, 128)
    assert s.rope.variant == "mrope" and s.rope.mrope_interleaved
    assert s.rope.mrope_section == (24, 20, 20) and s.rope.theta == 5e6
    assert s.tie_embeddings  # from the outer config


def test_qwen2_05b_bias_and_14_heads():
    s = spec_from_config(QWEN2_05B, "qwen2-0.5b")
    assert s.family == "qwen2" and s.qkv_bias and not s.qk_norm
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.gqa_ratio) == (14, 2, 64, 7)
    assert s.tie_embeddings and s.rope.theta == 1e6
    assert s.qkv_rows == (14 + 4) * 64
    for arch in ARCHS:
        plan = plan_launch(s, KNOWN_TARGETS[arch])
        assert plan.attn_max_splits == min(ATTN_MAX_SPLITS, KNOWN_TARGETS[arch].sm_count // 2, plan.attn_tile // 7)


def test_llama3_rope_scaling():
    cfg = llama_config(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    r = spec_from_config(cfg, "l3").rope
    assert (r.variant, r.theta, r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position) == (
        "llama3", 5e5, 8.0, 1.0, 4.0, 8192
    )


@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_linear_rope_scaling(key):
    r = spec_from_config(llama_config(rope_scaling={key: "linear", "factor": 4.0}), "lin").rope
    assert (r.variant, r.factor, r.theta) == ("linear", 4.0, 1e4)


def test_transformers5_rope_parameters():
    cfg = qwen3_config(rope_parameters={"rope_type": "default", "rope_theta": 250000.0})
    cfg.pop("rope_theta")
    cfg.pop("rope_scaling")
    r = spec_from_config(cfg, "t5").rope
    assert (r.variant, r.theta) == ("standard", 250000.0)
    cfg = llama_config(rope_parameters={**LLAMA3_SCALING, "rope_theta": 500000.0, "factor": 32.0})
    cfg.pop("rope_theta", None)
    r = spec_from_config(cfg, "t5-l3").rope
    assert (r.variant, r.theta, r.factor) == ("llama3", 5e5, 32.0)
    cfg = llama_config(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    assert spec_from_config(cfg, "t5-lin").rope.factor == 2.0


def test_qwen2_vl_style_mrope_not_interleaved():
    cfg = dict(QWEN2_05B, hidden_size=1536, num_attention_heads=12, intermediate_size=8960)
    cfg["rope_scaling"] = {"type": "mrope", "mrope_section": [16, 24, 24]}
    cfg["head_dim"] = 128
    r = spec_from_config(cfg, "q2vl").rope
    assert r.variant == "mrope" and r.mrope_section == (16, 24, 24) and not r.mrope_interleaved


@pytest.mark.parametrize("heads,kv", [(14, 2), (14, 7), (14, 14), (15, 5), (15, 3), (15, 1), (15, 15), (16, 1)])
def test_odd_head_counts_parse_and_plan(heads, kv):
    cfg = llama_config(hidden_size=heads * 64, num_attention_heads=heads, num_key_value_heads=kv)
    s = spec_from_config(cfg, f"h{heads}-{kv}")
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.gqa_ratio) == (heads, kv, 64, heads // kv)
    for arch in ARCHS:
        target = KNOWN_TARGETS[arch]
        plan = plan_launch(s, target)
        assert plan.grid == target.sm_count
        assert plan.smem_bytes <= target.smem_per_block
        assert plan.attn_max_splits == min(ATTN_MAX_SPLITS, target.sm_count // kv, plan.attn_tile // s.gqa_ratio)


@pytest.mark.parametrize("ratio", range(1, 9))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gqa_ratios_parse_and_plan(ratio, head_dim):
    kv = 4
    cfg = qwen3_config(
        hidden_size=2048, num_attention_heads=kv * ratio, num_key_value_heads=kv, head_dim=head_dim
    )
    s = spec_from_config(cfg, f"gqa{ratio}")
    assert s.gqa_ratio == ratio and s.head_dim == head_dim
    for arch in ARCHS:
        target = KNOWN_TARGETS[arch]
        plan = plan_launch(s, target)
        assert plan.grid == target.sm_count and plan.smem_bytes <= target.smem_per_block
        assert plan.attn_max_splits == min(ATTN_MAX_SPLITS, target.sm_count // kv, plan.attn_tile // s.gqa_ratio)
        assert plan.attn_outputs_per_thread * plan.threads >= ratio * head_dim


def test_gqa_16_is_the_limit():
    spec_from_config(llama_config(num_attention_heads=32, num_key_value_heads=2), "g16")
    with pytest.raises(MkportError, match="GQA ratio 32"):
        spec_from_config(llama_config(num_attention_heads=32, num_key_value_heads=1), "g32")


# ---------------------------------------------------------------------------------------------------
# Refusals: one line, naming the field and its value


def _without(cfg: dict, key: str) -> dict:
    cfg = dict(cfg)
    cfg.pop(key)
    return cfg


REFUSED = {
    "moe": (qwen3_config(model_type="qwen3", num_experts=128, num_experts_per_tok=8), r"num_experts=128"),
    "mixtral": (llama_config(num_local_experts=8), r"num_local_experts=8"),
    "sliding_window": (dict(QWEN2_05B, use_sliding_window=True), r"use_sliding_window"),
    "layer_types": (
        qwen3_config(layer_types=["full_attention", "sliding_attention"] * 14),
        r"layer_types.*sliding_attention",
    ),
    "gelu": (llama_config(hidden_act="gelu"), r"hidden_act 'gelu'"),
    "head_dim_96": (qwen3_config(head_dim=96), r"head_dim=96"),
    "head_dim_derived_80": (llama_config(hidden_size=2560, num_attention_heads=32), r"head_dim=80"),
    "yarn_missing_factor": (
        qwen3_config(rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 32768}),
        r"yarn.*'factor'",
    ),
    "dynamic_missing_factor": (llama_config(rope_scaling={"type": "dynamic"}), r"dynamic.*'factor'"),
    "unknown_rope_type": (
        llama_config(rope_scaling={"rope_type": "stretched", "factor": 2.0}), r"rope_type 'stretched'"
    ),
    "kv_not_dividing": (llama_config(num_key_value_heads=5), r"num_key_value_heads=5.*num_attention_heads=32"),
    "missing_hidden": (_without(llama_config(), "hidden_size"), r"'hidden_size'.*None"),
    "missing_layers": (_without(llama_config(), "num_hidden_layers"), r"'num_hidden_layers'"),
    "too_many_layers": (llama_config(num_hidden_layers=10**9), r"num_hidden_layers=1000000000 is not supported; "
                        r"supported: 1 to 256"),
    "string_vocab": (llama_config(vocab_size="32000"), r"'vocab_size'.*'32000'"),
    "unknown_model_type": (llama_config(model_type="gpt2"), r"model_type 'gpt2'"),
    "no_model_type": (_without(llama_config(), "model_type"), r"model_type ''"),
    "llama_attention_bias": (llama_config(attention_bias=True), r"attention_bias"),
    "mlp_bias": (llama_config(mlp_bias=True), r"mlp_bias"),
    "llama3_missing_factor": (
        llama_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}),
        r"llama3.*'high_freq_factor'",
    ),
    "linear_missing_factor": (llama_config(rope_scaling={"rope_type": "linear"}), r"linear.*'factor'"),
    "mrope_bad_sum": (
        qwen3_config(rope_scaling={"rope_type": "default", "mrope_section": [16, 16, 16]}),
        r"mrope_section \[16, 16, 16\]",
    ),
    "hidden_not_multiple_of_8": (
        llama_config(hidden_size=1028, num_attention_heads=16, head_dim=64),
        r"hidden_size=1028",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_configs_refused(case):
    cfg, pattern = REFUSED[case]
    with pytest.raises(MkportError, match=pattern) as info:
        spec_from_config(cfg, case)
    message = str(info.value)
    assert "\n" not in message and message


def test_unsupported_via_load_spec(tmp_path):
    path = write_config(tmp_path / "moe", REFUSED["moe"][0])
    with pytest.raises(MkportError, match="num_experts=128"):
        load_spec(str(path))


def test_non_json_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("model_type: qwen3\n")
    with pytest.raises(MkportError, match="not valid JSON") as info:
        load_spec(str(bad))
    assert "\n" not in str(info.value)
    bad.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(MkportError, match="not valid JSON"):
        load_spec(str(tmp_path))


def test_json_that_is_not_an_object(tmp_path):
    path = write_config(tmp_path, [1, 2, 3])
    with pytest.raises(MkportError, match="not a config"):
        load_spec(str(path))


def test_tts_config_needs_a_part(tmp_path):
    folder = tmp_path / "tts"
    write_config(folder, bundled_config("qwen3-tts-12hz-0.6b-customvoice.json"))
    with pytest.raises(MkportError, match=r"Qwen3-TTS config.*:talker.*:code_predictor"):
        load_spec(str(folder))


def test_part_on_a_plain_decoder(tmp_path):
    folder = tmp_path / "q"
    write_config(folder, qwen3_config())
    with pytest.raises(MkportError, match=r"part 'talker'.*qwen3_tts"):
        load_spec(f"{folder}:talker")


def test_unknown_model_and_missing_paths(tmp_path):
    with pytest.raises(MkportError, match="unknown model 'no-such-model'"):
        load_spec("no-such-model")
    missing = tmp_path / "missing" / "config.json"
    with pytest.raises(MkportError) as info:
        load_spec(str(missing))
    assert str(info.value) == f"no such file or folder: {missing}"
    with pytest.raises(MkportError) as info:
        load_spec(f"{tmp_path / 'gone'}:talker")
    assert str(info.value) == f"no such file or folder: {tmp_path / 'gone'}"
    with pytest.raises(MkportError) as info:
        load_spec(str(tmp_path))  # a folder without config.json
    assert str(info.value) == f"{tmp_path} has no config.json"


# ---------------------------------------------------------------------------------------------------
# Config values of the wrong type: integral floats are taken as integers, anything else is refused


def test_integral_floats_are_integers():
    cfg = qwen3_config(head_dim=128.0, num_attention_heads=16.0, max_position_embeddings=40960.0)
    s = spec_from_config(cfg, "floats")
    assert s == spec_from_config(qwen3_config(), "floats")
    assert type(s.head_dim) is int and type(s.num_heads) is int and type(s.max_position) is int


WRONG_TYPES = {
    "fractional_head_dim": (qwen3_config(head_dim=128.5), r"'head_dim'.*128.5"),
    "string_eps": (qwen3_config(rms_norm_eps="1e-6"), r"'rms_norm_eps'.*'1e-6'"),
    "string_theta": (qwen3_config(rope_theta="1e6"), r"'rope_theta'.*'1e6'"),
    "string_max_position": (qwen3_config(max_position_embeddings="4k"), r"'max_position_embeddings'.*'4k'"),
    "list_rope_scaling": (llama_config(rope_scaling=["linear", 4]), r"'rope_scaling' must be an object"),
    "string_tie": (qwen3_config(tie_word_embeddings="false"), r"'tie_word_embeddings'.*true or false"),
    "string_kv_heads": (qwen3_config(num_key_value_heads="8"), r"'num_key_value_heads'.*'8'"),
    "string_text_config": ({"model_type": "qwen3_vl", "text_config": "qwen3"}, r"'text_config' must be an object"),
    "string_layer_types": (qwen3_config(layer_types="full_attention"), r"'layer_types' must be a list"),
    "mrope_section_strings": (
        qwen3_config(rope_scaling={"rope_type": "default", "mrope_section": ["24", "20", "20"]}),
        r"'mrope_section'.*'24'",
    ),
    "tts_talker_list": (
        dict(bundled_config("qwen3-tts-12hz-0.6b-customvoice.json"), talker_config=[1]),
        r"'talker_config' must be an object",
    ),
}


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_wrong_types_refused_in_one_line(tmp_path, case):
    cfg, pattern = WRONG_TYPES[case]
    path = write_config(tmp_path / "model", cfg)
    model = f"{path}:talker" if case.startswith("tts") else str(path)
    with pytest.raises(MkportError, match=pattern) as info:
        load_spec(model)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message  # names the file


# ---------------------------------------------------------------------------------------------------
# Spec names come from folder names: reduced to a safe alphabet before they reach a path or a template


@pytest.mark.parametrize(
    "raw,safe",
    [
        ("Qwen3-0.6B", "Qwen3-0.6B"),
        ("..", "model"),
        ("../../etc", "_._etc"),
        ("a..b", "a.b"),
        ("-rf", "rf"),
        ('x\n#include "evil.h"\n// */ y', "x_include_evil.h_y"),
        ("日本語モデル", "_"),
        ("a" * 300, "a" * MAX_BASE_NAME),
    ],
)
def test_safe_name(raw, safe):
    assert safe_name(raw) == safe
    assert SAFE_NAME.fullmatch(safe) and ".." not in safe


def test_spec_names_from_hostile_folders_are_safe(tmp_path):
    for raw in ("x\n#include <cstdlib>\nstatic int y = system(\"id\");//", "..hidden", 'q"uote\'s */', "b" * 250):
        path = write_config(tmp_path / raw, qwen3_config())
        spec = load_spec(str(path.parent))
        assert SAFE_NAME.fullmatch(spec.name) and ".." not in spec.name and len(spec.name) <= MAX_BASE_NAME
        assert spec == load_spec("qwen3-0.6b").with_name(spec.name)
    assert load_spec(f"{path.parent}/../{path.parent.name}").name == "b" * MAX_BASE_NAME  # the resolved folder


@pytest.mark.parametrize("name", ["", "..", "../x", "a\nb", "a b", ".hidden", "x" * 200])
def test_model_spec_refuses_an_unsafe_name(name):
    with pytest.raises(MkportError, match="not safe"):
        spec_from_config(qwen3_config(), name)


def test_qwen3_vl_mrope_is_interleaved_when_the_flag_is_absent():
    """transformers' Qwen3-VL always interleaves the sections; a config without the flag must not be read
    as Qwen2-VL's contiguous layout."""
    text = {
        "model_type": "qwen3_vl_text", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 100,
        "rope_scaling": {"rope_type": "default", "mrope_section": [12, 10, 10]},
    }
    spec = spec_from_config({"model_type": "qwen3_vl", "text_config": text}, "vl")
    assert spec.rope.variant == "mrope" and spec.rope.mrope_interleaved
    qwen2_vl = {**text, "model_type": "qwen2", "rope_scaling": {"type": "mrope", "mrope_section": [12, 10, 10]}}
    assert not spec_from_config(qwen2_vl, "q2vl").rope.mrope_interleaved


QWEN2_5_VL_TINY = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
                   "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 512, "rope_theta": 1e6, "tie_word_embeddings": False,
                   "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
                   "vision_config": {"depth": 2, "hidden_size": 64}}


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen2_vl_text_decoder_from_a_flat_config_or_a_text_config(model_type):
    """Qwen2-VL's and Qwen2.5-VL's released configs are flat (the decoder's fields beside vision_config), the ones
    transformers 5 writes have a text_config: both read as Qwen2's layers (q/k/v bias) with contiguous MRoPE
    sections, as transformers' Qwen2(.5)-VL config classes read them."""
    import transformers

    flat = dict(QWEN2_5_VL_TINY, model_type=model_type)
    theirs = getattr(transformers, {"qwen2_vl": "Qwen2VLConfig", "qwen2_5_vl": "Qwen2_5_VLConfig"}[model_type])(
        **{k: v for k, v in flat.items() if k not in ("model_type", "architectures")}).text_config
    text = {k: v for k, v in flat.items() if k not in ("model_type", "architectures", "vision_config")}
    nested = {"model_type": model_type, "text_config": text, "vision_config": {"depth": 2}}
    for config in (flat, nested):
        spec = spec_from_config(config, "vl")
        assert (spec.family, spec.qkv_bias, spec.num_layers, spec.hidden_size) == ("qwen2", True, 2, 256)
        assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (theirs.num_attention_heads,
                                                                      theirs.num_key_value_heads, 64)
        assert spec.rope.variant == "mrope" and spec.rope.mrope_section == (8, 12, 12)
        assert not spec.rope.mrope_interleaved  # contiguous, as transformers' Qwen2-VL rotary takes them
        assert spec.rope.theta == theirs.rope_parameters["rope_theta"] == 1e6
        assert spec.rms_eps == theirs.rms_norm_eps


@pytest.mark.parametrize("text_type", ["qwen2_vl_text", "qwen2_5_vl_text"])
def test_qwen2_vl_text_fields_left_out_are_their_class_defaults(text_type):
    import transformers

    text = {"model_type": text_type, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rope_scaling": {"mrope_section": [8, 12, 12]}}
    theirs = getattr(transformers, {"qwen2_vl_text": "Qwen2VLTextConfig", "qwen2_5_vl_text": "Qwen2_5_VLTextConfig"}[
        text_type])(**{k: v for k, v in text.items() if k != "model_type"})
    spec = spec_from_config(text, "t")
    assert (spec.rope.theta, spec.rms_eps, spec.vocab_size) == (
        theirs.rope_parameters["rope_theta"], theirs.rms_norm_eps, theirs.vocab_size) == (1e6, 1e-5, 152064)
