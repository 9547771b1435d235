"""Shared test fixtures."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from safetensors.torch import save_file

from mkport.kernel.spec import _bundled_path, bundled_names, load_spec
from mkport.runtime.weights import COUNTER_WEIGHTS_BYTES, checkpoint_bytes, random_checkpoint, write_random_weights

# transformers 5.17's Phi3ForCausalLM.generate drops its cache at the longrope switch and then feeds only the last token
# (docs/validation.md: the oracle itself is wrong there); 5.24 feeds every input again. The releases between were not
# seen, so the tests that take generate as their oracle across the switch run from 5.24 (CI installs the newest).
NEEDS_PHI3_GENERATE = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24"),
    reason=f"transformers {transformers.__version__}: Phi3ForCausalLM.generate drops its cache at the longrope switch "
           "(5.24 and later recompute it)")

# ---------------------------------------------------------------------------------------------------
# Tiny model folders for the reference / diff tests (validation_*): small variants of the bundled
# configs, with random weights written as safetensors so the real loading code runs.

# Llama 3.1's rope scaling (factor 8 over an 8192-position original context)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
# Phi-3-medium-4k-instruct's published config (14B: not bundled): fused qkv_proj / gate_up_proj, a window of 2047.
PHI3_MEDIUM_4K = {
    "architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "embd_pdrop": 0.0,
    "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 17920, "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 40,
    "num_hidden_layers": 40, "num_key_value_heads": 10, "original_max_position_embeddings": 4096,
    "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.39.3",
    "use_cache": True, "vocab_size": 32064,
}
# Qwen3.5-0.8B's published config.json (Qwen3_5ForConditionalGeneration; its vision_config left out): 3 Gated DeltaNet
# layers to one gated full-attention layer, partial RoPE over a quarter of head_dim 256 as interleaved MRoPE sections.
QWEN3_5_0_8B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": True,
    "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "text_config": {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
        "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "attention_bias": False, "attn_output_gate": True, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
        "full_attention_interval": 4, "max_position_embeddings": 262144, "tie_word_embeddings": True,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "hidden_act": "silu", "eos_token_id": 248044,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "dtype": "bfloat16",
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    },
}
QWEN3_5_0_8B["text_config"]["layer_types"] = QWEN3_5_0_8B["text_config"]["layer_types"] * 6
SMALL_WINDOW = 5  # the validation inputs' 12 rows reach well past it
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


def _bundled_json(filename: str) -> dict:
    return json.loads(_bundled_path(filename).read_text())


def validation_config(case: str) -> tuple[dict, str | None]:
    """A small config dict for one validation case, and the MODEL suffix (TTS part) it needs."""
    if case == "qwen3":
        return dict(_bundled_json("qwen3-0.6b.json"), num_hidden_layers=3, **TINY), None
    if case in ("llama", "llama3", "llama_linear"):
        cfg = dict(_bundled_json("tinyllama-1.1b.json"), num_hidden_layers=3, **TINY)
        if case == "llama3":
            cfg.update(
                max_position_embeddings=32768,
                rope_theta=500000.0,
                rope_scaling=LLAMA3_SCALING,
            )
        if case == "llama_linear":
            cfg.update(max_position_embeddings=8192, rope_scaling={"type": "linear", "factor": 4.0})
        return cfg, None
    if case == "qwen2":
        cfg = dict(_bundled_json("qwen3-0.6b.json"), num_hidden_layers=3, **TINY)
        cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False)
        cfg.pop("head_dim")  # qwen2 derives it: 256 / 4 = 64
        return cfg, None
    if case == "qwen3_vl":
        text = dict(_bundled_json("qwen3-0.6b.json"), num_hidden_layers=3, **TINY)
        text.update(
            model_type="qwen3_vl_text",
            rope_theta=5000000,
            rope_scaling={"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        )
        for key in ("architectures", "tie_word_embeddings", "use_sliding_window", "sliding_window", "max_window_layers"):
            text.pop(key, None)
        return {"model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"],
                "text_config": text, "tie_word_embeddings": False}, None
    if case == "qwen2_5_vl":  # a released Qwen2.5-VL config's flat shape, the decoder's fields beside vision_config;
        # contiguous MRoPE sections over head_dim 64's 32 frequencies (the 7B's 16, 24, 24 of 64, halved)
        cfg, _ = validation_config("qwen2")
        cfg.update(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"], rope_theta=1e6,
                   rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
                   vision_config={"depth": 2, "hidden_size": 64, "out_hidden_size": 256})
        return cfg, None
    if case == "mistral":  # a window on every layer; head_dim 128 with hidden 256 and 4 heads (Nemo's shape)
        return dict(_bundled_json("mistral-7b-v0.1.json"), num_hidden_layers=3, head_dim=128,
                    sliding_window=SMALL_WINDOW, **TINY), None
    if case == "ministral":  # windows on some layers (layer_types)
        cfg = dict(_bundled_json("mistral-7b-v0.1.json"), num_hidden_layers=3, sliding_window=SMALL_WINDOW, **TINY)
        cfg.update(model_type="ministral", architectures=["MinistralForCausalLM"], head_dim=64,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        return cfg, None
    if case == "granite":
        return dict(_bundled_json("granite-3.1-2b-instruct.json"), num_hidden_layers=3, **TINY), None
    if case == "smollm3":  # layer 1 without RoPE, layer 0 sliding
        cfg = dict(_bundled_json("smollm3-3b.json"), num_hidden_layers=3, **TINY)
        cfg.update(pad_token_id=None, no_rope_layers=[1, 0, 1], use_sliding_window=True, sliding_window=SMALL_WINDOW,
                   layer_types=["sliding_attention", "full_attention", "full_attention"])
        return cfg, None
    if case == "phi3":  # fused q/k/v and gate/up, split at load; a window on every layer
        return dict(PHI3_MEDIUM_4K, num_hidden_layers=3, sliding_window=SMALL_WINDOW, pad_token_id=None,
                    eos_token_id=2, **TINY), None
    if case == "qwen3_5":  # 0.8B's shape shrunk: layers L L L F L F, value heads 2 to a q/k head, head_dim 64 (16 rotated)
        text = dict(QWEN3_5_0_8B["text_config"], num_hidden_layers=6, hidden_size=128, intermediate_size=256,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=16, mtp_num_hidden_layers=1, eos_token_id=2,
                    layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"],
                    rope_parameters=dict(QWEN3_5_0_8B["text_config"]["rope_parameters"], mrope_section=[3, 3, 2]))
        return dict(QWEN3_5_0_8B, tie_word_embeddings=False, text_config=dict(text, tie_word_embeddings=False)), None
    if case in ("tts_talker", "tts_code_predictor"):
        cfg = _bundled_json("qwen3-tts-12hz-1.7b-customvoice.json")
        talker = dict(cfg["talker_config"], num_hidden_layers=3, num_code_groups=4, **TINY)
        talker["hidden_size"] = 512  # != predictor hidden: the predictor gets its input projection
        talker["intermediate_size"] = 1024
        pred = dict(talker["code_predictor_config"], num_hidden_layers=2, num_code_groups=4, **TINY)
        talker["code_predictor_config"] = pred
        cfg["talker_config"] = talker
        return cfg, case.split("_", 1)[1]
    raise ValueError(case)


# The mixture-of-experts families' published configs (not bundled: the megakernel does not run them yet), and tiny
# versions of them for the CPU checks: 8 experts, a dense layer among the sparse ones where the family has them.
MOE_CONFIGS = {
    "qwen3_moe": {  # Qwen/Qwen3-30B-A3B
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
        "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
        "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "qwen2_moe": {  # Qwen/Qwen1.5-MoE-A2.7B
        "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe",
        "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936, "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4,
        "num_experts": 60, "norm_topk_prob": False, "output_router_logits": False, "router_aux_loss_coef": 0.001,
    },
    "olmoe": {  # allenai/OLMoE-1B-7B-0924
        "architectures": ["OlmoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None,
        "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 1024, "max_position_embeddings": 4096, "model_type": "olmoe", "norm_topk_prob": False,
        "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16,
        "num_key_value_heads": 16, "output_router_logits": False, "pad_token_id": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
        "torch_dtype": "float32", "use_cache": True, "vocab_size": 50304,
    },
    "mixtral": {  # mistralai/Mixtral-8x7B-v0.1
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000,
    },
}
# Qwen/Qwen3.5-35B-A3B's text decoder (tests/published_configs/qwen3.5-35b-a3b.json): the hybrid, every MLP experts and
# a shared expert
MOE_CONFIGS["qwen3_5_moe"] = json.loads((Path(__file__).parent / "published_configs/qwen3.5-35b-a3b.json").read_text())[
    "text_config"]
# ibm-granite/granite-3.0-1b-a400m-instruct's: granite's multipliers, every layer 8 of 32 experts
MOE_CONFIGS["granitemoe"] = json.loads((Path(__file__).parent / "published_configs/granite-3.0-1b-a400m.json").read_text())
MOE_CASES = tuple(MOE_CONFIGS)


def bundled_kernel_params(whole_checkpoint: bool = False) -> list:
    """bundled_names() to parametrize a kernel test, with the ids bundled_names() gives. whole_checkpoint: the test
    writes the spec's random checkpoint to disk and holds it on the GPU in fp32 too, so the specs past
    COUNTER_WEIGHTS_BYTES (the MoE ones of 29-93 GB) are skipped."""
    skip = pytest.mark.skip(reason="its checkpoint is past COUNTER_WEIGHTS_BYTES")
    return [pytest.param(name, marks=skip) if whole_checkpoint and checkpoint_bytes(load_spec(name)) > COUNTER_WEIGHTS_BYTES
            else name for name in bundled_names()]


# The GPU tests of the bundled specs whose bf16 checkpoint is past this are marked `serial` (as are, by hand, the tests
# that compare timings, and a large spec's test with no parameters), so the suite runs them one after another and the
# rest eight at once: `pytest -m "gpu and not serial" -n 8` then `pytest -m "gpu and serial"`. Beside each other
# (checkpoints of 7-60 GB, float32 references) they failed: 19 tests with -n 14 (fifteenth session), 5 at once with -n 8
# (sixteenth), where xdist_group had been meant to keep them on one worker (pytest 9 with xdist 3.8 ignores the group:
# tests/test_gpu_groups.py). A timing comparison beside seven other workers measured one side under their load.
LARGE_CHECKPOINT_BYTES = 4 << 30


@functools.cache
def _large_bundled_specs() -> frozenset[str]:
    return frozenset(name for name in bundled_names() if checkpoint_bytes(load_spec(name)) > LARGE_CHECKPOINT_BYTES)


def is_large_checkpoint_test(params: dict, gpu: bool) -> bool:
    """Whether a test with these parameters is a GPU test of a large bundled spec."""
    return gpu and bool(_large_bundled_specs() & {value for value in params.values() if isinstance(value, str)})


def pytest_collection_modifyitems(config, items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec and is_large_checkpoint_test(callspec.params, item.get_closest_marker("gpu") is not None):
            item.add_marker(pytest.mark.serial)


def load_script(name: str):
    """scripts/NAME.py as a module (the scripts are not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def moe_config(case: str) -> dict:
    """A tiny config of a mixture-of-experts family: 3 layers (qwen2_moe 4), 8 experts."""
    cfg = dict(MOE_CONFIGS[case], num_hidden_layers=3, bos_token_id=None, eos_token_id=2, **TINY)
    if case == "qwen3_moe":  # layer 1 dense (intermediate_size), 3 of 8 experts renormalised
        cfg.update(head_dim=64, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=128, mlp_only_layers=[1])
    elif case == "qwen2_moe":  # layers 1 and 3 sparse (decoder_sparse_step 2), with the shared expert
        cfg.update(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                   shared_expert_intermediate_size=384, decoder_sparse_step=2)
    elif case == "olmoe":  # the expert width is intermediate_size
        cfg.update(num_experts=8, num_experts_per_tok=2, intermediate_size=128)
    elif case == "granitemoe":  # 3 of 8 experts
        cfg.update(num_local_experts=8, num_experts_per_tok=3, intermediate_size=128)
    elif case == "qwen3_5_moe":  # layers L L F (head_dim 64, 16 rotated), 3 of 8 experts renormalised, the shared expert
        cfg.update(layer_types=["linear_attention", "linear_attention", "full_attention"], head_dim=64,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=16,
                   num_experts=8, num_experts_per_tok=3, moe_intermediate_size=128, shared_expert_intermediate_size=192,
                   rope_parameters=dict(cfg["rope_parameters"], mrope_section=[3, 3, 2]))
        del cfg["intermediate_size"]  # its configs have none
    else:
        cfg.update(num_local_experts=8, intermediate_size=128)
    return cfg


def make_moe_model(root: Path, case: str, seed: int = 0) -> str:
    folder = Path(root) / case
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(moe_config(case), indent=1))
    write_random_weights(load_spec(str(folder)), folder, seed=seed)
    return str(folder)


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory) -> dict[str, str]:
    """case -> MODEL string of a tiny random-weight mixture-of-experts folder."""
    root = tmp_path_factory.mktemp("moe_models")
    return {case: make_moe_model(root, case, seed=20 + i) for i, case in enumerate(MOE_CASES)}


# Real-sized shapes no bundled spec covers (2 layers each): q/k/v bias with 14 heads, llama3 rope with 15 heads,
# head_dim 256 at GQA 16, contiguous MRoPE, Gemma 3 4B's multimodal wrapper (a text_config of the fields that differ
# from Gemma3TextConfig's defaults: 8 heads of 256, 4 KV heads, a 262208-row tied head).
_WIDE = {
    "model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 2,
    "num_attention_heads": 16, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 32000,
}
ENVELOPE_CONFIGS = {
    "qwen2-14h": {
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 2,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "rope_theta": 1e6,
        "tie_word_embeddings": True,
    },
    "llama3-15h": {
        "model_type": "llama", "hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 2,
        "num_attention_heads": 15, "num_key_value_heads": 5, "vocab_size": 49152, "rope_scaling": LLAMA3_SCALING,
        "max_position_embeddings": 131072,
    },
    "hd256-gqa16": _WIDE,
    "mrope-contig": dict(_WIDE, head_dim=128, num_key_value_heads=2,
                         rope_scaling={"rope_type": "default", "mrope_section": [16, 24, 24]}),
    "gemma3-4b-wrapper": {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 2,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}},
}


# config.json of popular checkpoints outside the bundle, as published (tests/test_published_configs.py says which)
PUBLISHED_CONFIGS = {path.stem: json.loads(path.read_text())
                     for path in sorted((Path(__file__).parent / "published_configs").glob("*.json"))}

# Each new feature switched off or mis-set (ModelSpec fields replaced, the config and reference untouched): case,
# the fields, and the first traced state that must then fail. The CPU tests run them through torch_model, the GPU
# tests through a megakernel rendered from the mis-set spec.
FEATURE_ABLATIONS = {
    "mistral-no-window": ("mistral", {"attention_windows": ()}, "layers.0.attn"),
    "mistral-window+1": ("mistral", {"attention_windows": (SMALL_WINDOW + 1,) * 3}, "layers.0.attn"),
    "mistral-window-1": ("mistral", {"attention_windows": (SMALL_WINDOW - 1,) * 3}, "layers.0.attn"),
    "ministral-window-on-a-full-layer": ("ministral", {"attention_windows": (SMALL_WINDOW,) * 3}, "layers.1.attn"),
    "smollm3-rope-on-the-nope-layer": ("smollm3", {"nope_layers": ()}, "layers.1.q"),
    "smollm3-no-window": ("smollm3", {"attention_windows": ()}, "layers.0.attn"),
    "phi3-no-window": ("phi3", {"attention_windows": ()}, "layers.0.attn"),
    "granite-no-embedding-multiplier": ("granite", {"embedding_multiplier": 1.0}, "embed"),
    "granite-head-dim-attention-scale": ("granite", {"attention_multiplier": 0.0}, "layers.0.attn"),
    "granite-no-residual-multiplier": ("granite", {"residual_multiplier": 1.0}, "layers.0.attn_residual"),
    "granite-no-logits-scaling": ("granite", {"logits_scaling": 1.0}, "logits"),
}

VALIDATION_CASES = ("qwen3", "llama", "llama3", "llama_linear", "qwen2", "qwen3_vl", "tts_talker", "tts_code_predictor",
                    "mistral", "ministral", "granite", "smollm3", "phi3", "qwen2_5_vl")


def make_validation_model(root: Path, case: str, seed: int = 0) -> str:
    """Writes <root>/<case>/{config.json, model.safetensors}; returns the MODEL string for load_spec."""
    folder = Path(root) / case
    folder.mkdir(parents=True, exist_ok=True)
    cfg, part = validation_config(case)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    model = f"{folder}:{part}" if part else str(folder)
    spec = load_spec(model)
    if case in ("qwen3_vl", "qwen3_5"):  # the multimodal checkpoint naming: model.language_model.*
        tensors = {
            (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
            for k, v in random_checkpoint(spec, seed).items()
        }
        if case == "qwen3_5":  # its multi-token-prediction head, which loading skips
            tensors["mtp.fc.weight"] = torch.zeros(spec.hidden_size, 2 * spec.hidden_size, dtype=torch.bfloat16)
        save_file(tensors, str(folder / "model.safetensors"))
    elif case == "qwen2_5_vl":  # its released checkpoints' naming: the decoder under model., the vision tower beside
        tensors = random_checkpoint(spec, seed)
        tensors["visual.merger.mlp.0.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)  # never read
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        write_random_weights(spec, folder, seed=seed)
    return model


@pytest.fixture(scope="session")
def validation_models(tmp_path_factory) -> dict[str, str]:
    """case -> MODEL string of a tiny random-weight model folder, one per validation case."""
    root = tmp_path_factory.mktemp("validation_models")
    return {case: make_validation_model(root, case, seed=i) for i, case in enumerate(VALIDATION_CASES)}


def validation_inputs(spec, case: str, n: int = 12, seed: int = 0) -> dict:
    """Fresh random inputs for a case: tokens, [3, N] positions (distinct streams for Qwen3-VL; large
    offsets for the scaled-rope llama variants), and the embedding table / output head to use."""
    gen = torch.Generator().manual_seed(1000 + seed)
    tokens = torch.randint(0, spec.vocab_size, (n,), generator=gen)
    start = int(torch.randint(0, 64, (1,), generator=gen))
    if case in ("llama3", "llama_linear"):
        start = 6000  # beyond the llama3 original context, where the scaling changes low frequencies
    pos = torch.arange(start, start + n)
    positions = pos.expand(3, n).clone()
    if case in ("qwen3_vl", "qwen2_5_vl"):  # an image-like block: t fixed, h/w on a grid
        positions[1] = start + torch.arange(n) // 4
        positions[2] = start + torch.arange(n) % 4 + 7
    table = spec.num_embedding_tables - 1
    head = spec.num_output_heads - 1
    return {"tokens": tokens, "positions": positions, "table": table, "head": head}


def _have_nvcc() -> bool:
    from mkport.kernel import build
    from mkport.errors import MkportError

    try:
        build.nvcc()
        return True
    except MkportError:
        return False


needs_nvcc = pytest.mark.skipif(not _have_nvcc(), reason="nvcc not found (CUDA toolkit absent): compile checks skipped")


def held_kv(decoder, n: int, slot: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of sequence `slot`'s positions [0, n) that its cache still holds (a ring layer keeps its last rows
    only), every layer's flattened and joined: the same positions of two decoders of one spec compare element by
    element."""
    from mkport.runtime.kv_cache import cache_rows

    def held(layers):
        return torch.cat([cache_rows(c, max(0, n - c.shape[1]), n).flatten() for c in layers])

    k, v = decoder.kv.sequence(slot)
    return held(k), held(v)


def eager_to_stop(eos: int):
    """A reference talker (TorchDecoder) that picks EOS at every step where EOS is not suppressed: with the frame
    loop's suppression of the first frames, it ends an utterance at frame 2."""
    from mkport.runtime.torch_decoder import TorchDecoder

    class EagerToStop(TorchDecoder):
        def step(self, *args, **kwargs):
            tok = super().step(*args, **kwargs)
            if not self.logit_bias[eos].isinf():
                tok.fill_(eos)
            return tok

    return EagerToStop


def join_and_leave(frames, prompts, samplings, max_frames) -> dict[int, list]:
    """A FrameBatch of two slots as a server drives it: request 0 starts alone, request 1 joins at the fourth
    frame, request 2 takes slot 0 once request 0 is done. Returns each request's codes, frame by frame."""
    got, owner = {0: [], 1: [], 2: []}, {0: 0}  # owner: slot -> request
    frames.add(0, prompts[0], samplings[0], max_frames[0])
    for turn in range(30):
        if turn == 3:
            frames.add(1, prompts[1], samplings[1], max_frames[1])
            owner[1] = 1
        if 0 in frames.free_slots() and owner[0] == 0:
            frames.add(0, prompts[2], samplings[2], max_frames[2])
            owner[0] = 2
        for slot, codes in frames.step().items():
            if codes is not None:
                got[owner[slot]].append(codes)
        if not frames.requests:
            break
    return got


def torch_path_taps(spec, w, tokens, positions, decode: bool = False, routing=None) -> dict:
    """mkport's plain-torch taps of a prompt, with its logits: in one pass, or (decode) one row at a time with a bf16 KV
    cache as the kernel's steps run it; `routing` forces sparse layers' experts (diff.reference_routing)."""
    from mkport.check.diff import cpu_decode_taps
    from mkport.kernel.interface import Tap
    from mkport.runtime import torch_model

    x = torch_model.embed_inputs(spec, w, tokens=tokens)
    if decode:
        taps = cpu_decode_taps(spec, w, x, positions, routing=routing)
    else:
        taps = {}
        torch_model.forward(spec, w, x, positions, taps=taps, routing=routing)
    taps[Tap.LOGITS] = torch_model.logits(spec, w, taps[Tap.FINAL_NORM])
    return taps


# The commands that build the megakernel, as a family the kernel does not build yet must meet them: refused in one line.
KERNEL_COMMANDS = [["generate"], ["diff", "--random-weights"], ["bench", "--random-weights"], ["generate", "--check"]]


def assert_kernel_command_refuses(tmp_path, monkeypatch, config: dict, command: list[str], words: str) -> None:
    """`mkport COMMAND FOLDER` on a folder holding `config` exits 2 with one line containing `words`, before any
    weights are written."""
    from test_cli import run

    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("MKPORT_CACHE", str(tmp_path / "cache"))
    proc = run(command[0], str(tmp_path), *command[1:])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and words in proc.stderr
    assert not (tmp_path / "cache").exists()  # refused before any weights were written


def assert_config_refused(config: dict, words: str) -> None:
    """spec_from_config refuses `config` with one line containing `words`."""
    from mkport.errors import MkportError
    from mkport.kernel.spec import spec_from_config

    with pytest.raises(MkportError) as e:
        spec_from_config(config, "x")
    assert words in str(e.value) and "\n" not in str(e.value)


def reference_taps(ref, inp: dict) -> dict:
    """transformers' taps (check.reference.Reference) of validation inputs, with its logits, keyed as torch_path_taps'."""
    out = ref.run(tokens=inp["tokens"], positions=inp["positions"])
    return dict(out.taps, logits=out.logits)


def torch_path_against_transformers(spec, w, ref, inp: dict, decode: bool = False):
    """(mkport's taps, transformers' taps, compare() report) of the same inputs; `spec` and `w` may be mis-set on
    purpose (ablations, faults): the report still reads the tolerances of `ref`'s own spec."""
    from mkport.check.diff import compare

    ours, reference = torch_path_taps(spec, w, inp["tokens"], inp["positions"], decode), reference_taps(ref, inp)
    return ours, reference, compare(ours, reference, ref.spec)


def _torch_family_configs() -> dict:
    """case -> (config, seed) of the plain-torch families' tiny models, the seeds their files gave them. Imported
    here, late: the family files import this module."""
    from test_exaone4 import CONFIGS as EXAONES
    from test_gemma import CONFIGS as GEMMAS
    from test_llama_variants import CONFIGS as VARIANTS
    from test_olmo2 import CONFIGS as OLMOS
    from test_rope_scaling import CASES, _config

    return {**{case: (config, seed) for seed, (case, config) in enumerate(GEMMAS.items())},
            **{case: (config, seed) for seed, (case, config) in enumerate(OLMOS.items())},
            **{case: (config, seed) for seed, (case, config) in enumerate(VARIANTS.items())},
            **{case: (config, seed) for seed, (case, config) in enumerate(EXAONES.items())},
            **{f"{shape}-{variant}": (_config(shape, variant), seed) for seed, (shape, variant) in enumerate(CASES)}}


@pytest.fixture(scope="session")
def family_model_path(tmp_path_factory, request):
    """case -> MODEL string of a plain-torch family's tiny random model (gemma, olmo2, llama-yarn, phi3-longrope,
    qwen3_5, a MoE case, ...), written the first time a test asks for it: once a session, for every file."""
    root, paths = tmp_path_factory.mktemp("families"), {}

    def path(case: str) -> str:
        if case in MOE_CASES:
            return request.getfixturevalue("moe_models")[case]
        if case not in paths:
            if case == "qwen3_5":
                paths[case] = make_validation_model(root, "qwen3_5", seed=3)
            else:
                config, seed = _torch_family_configs()[case]
                folder = root / case
                folder.mkdir()
                (folder / "config.json").write_text(json.dumps(config))
                write_random_weights(load_spec(str(folder)), folder, seed=seed)
                paths[case] = str(folder)
        return paths[case]

    return path


@pytest.fixture(scope="session")
def family_model(family_model_path):
    """case -> (spec, kernel-layout weights, check.reference.Reference, MODEL) of family_model_path's model."""
    from mkport.check.reference import Reference
    from mkport.kernel.spec import open_model
    from mkport.runtime.weights import Checkpoint, load_weights

    out = {}

    def load(case: str):
        if case not in out:
            path = family_model_path(case)
            source, checkpoint = open_model(path), Checkpoint.open(path)
            out[case] = source.spec, load_weights(source.spec, checkpoint), Reference(source, checkpoint), path
        return out[case]

    return load
