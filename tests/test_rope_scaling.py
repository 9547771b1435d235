"""yarn, dynamic and longrope RoPE, and Phi-3/3.5-mini's head_dim 96, the CPU half: inv_freq and the attention
factor against transformers' own ROPE_INIT_FUNCTIONS, mkport's plain-torch path against transformers' float32
classes on tiny llama-, qwen2- and phi3-shaped models (one pass per tap, token by token; the reference backend's
greedy tokens and `run --backend reference`: test_torch_families.py), ablations that must fail, the stepped reference
the megakernel's diff takes for dynamic and longrope, their megakernel's rendered tables and sm_90 compiles, and
Phi-4-mini's partial rotary (3/4 of a head of 128; the plain-torch path, the megakernel's plan and sm_90 compiles,
the partial rotations it refuses in one line), and Phi-3's one-time recompute of the cache at its longrope switch
(TorchDecoder's greedy tokens against Phi3ForCausalLM.generate across it). The tiny models' original
length is 16, so that 24- and 32-row sequences pass it: dynamic NTK raises its base and longrope switches to its
long factors there. The tiny phi3 model has Phi-3.5-mini's head_dim 96 (2 heads on hidden 192) with longrope, as
the 128k checkpoints."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from conftest import (NEEDS_PHI3_GENERATE, assert_config_refused, assert_kernel_command_refuses, needs_nvcc,
                      torch_path_taps)
from mkport.check.diff import compare
from mkport.check.reference import Reference, cache_argument
from mkport.errors import MkportError
from mkport.kernel.build import compile_check
from mkport.kernel.gpu import target_for_arch
from mkport.kernel.launch_plan import plan_launch
from mkport.kernel.render import _float_literal, dynamic_rope_table, render, rope_tables
from mkport.kernel.spec import open_model, spec_from_config
from mkport.runtime import rope_switch
from mkport.runtime.generate import generate
from mkport.runtime.sampling import SamplingParams
from mkport.runtime.torch_decoder import TorchDecoder
from mkport.runtime.weights import Checkpoint, load_weights, write_random_weights
from tolerances import HIDDEN_TOL, rel

HALF = 32  # head_dim 64: frequencies per head
# longrope's factors as Phi-3's look: short ones near 1, long ones growing with the wavelength
SHORT = [1.0 + 0.02 * i for i in range(HALF)]
LONG = [1.0 + 0.5 * i for i in range(HALF)]
SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                 "original_max_position_embeddings": 16},
}
TINY = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False}
SHAPES = {"llama": dict(TINY, model_type="llama"), "qwen2": dict(TINY, model_type="qwen2"),
          # Phi-3.5-mini's layout shrunk: head_dim 96, fused projections, the window past every test length
          "phi3": dict(TINY, model_type="phi3", hidden_size=192, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=96, sliding_window=262144, pad_token_id=None,
                       original_max_position_embeddings=16),  # Phi-3 keeps it at the top level (default 4096)
          # Phi-4-mini's layout shrunk: head_dim 128 of which RoPE rotates 3/4 (96), two q heads to a kv head
          "phi4": dict(TINY, model_type="phi3", hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=128, partial_rotary_factor=0.75, sliding_window=262144, pad_token_id=None,
                       original_max_position_embeddings=16)}
PHI3_LONGROPE = dict(SCALINGS["longrope"], short_factor=SHORT + SHORT[:16], long_factor=LONG + LONG[:16])
CASES = [(s, v) for v in SCALINGS for s in ("llama", "qwen2")] + [("phi3", "longrope"), ("phi4", "longrope")]

# dynamic NTK scales from max_position_embeddings, the others from their original length 16
MAX_POSITIONS = {"yarn": 64, "dynamic": 16, "longrope": 64}
REFUSED = "the megakernel is not built yet for"


def _config(shape: str, variant: str) -> dict:
    scaling = PHI3_LONGROPE if shape in ("phi3", "phi4") else SCALINGS[variant]  # 48 frequencies: 96 rotated
    # a copy: transformers' config classes standardise rope_scaling in place (Phi3Config moves the top-level
    # partial_rotary_factor into it), which would reach every config sharing the dict
    return dict(SHAPES[shape], max_position_embeddings=MAX_POSITIONS[variant], rope_scaling=copy.deepcopy(scaling))


# -- inv_freq and the attention factor ---------------------------------------------------------------------------

# variant -> configs beside the tiny ones: transformers' defaults (factor, beta, attention factor, original length)
# left out, each given, mscale / mscale_all_dim, truncate off, Phi-3's top-level original length
HEADS = {"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 128, "intermediate_size": 11008,
         "num_hidden_layers": 2, "vocab_size": 32000}
CONFIGS = {
    "yarn-qwen3": dict(HEADS, model_type="qwen3", max_position_embeddings=131072, rope_theta=1e6,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "yarn-default-original": dict(HEADS, model_type="llama", max_position_embeddings=65536,
                                  rope_scaling={"rope_type": "yarn", "factor": 2.0}),
    "yarn-betas-untruncated": dict(HEADS, model_type="llama", max_position_embeddings=16384, rope_theta=5e5,
                                   rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2,
                                                 "truncate": False, "original_max_position_embeddings": 2048}),
    "yarn-mscale": dict(HEADS, model_type="llama", max_position_embeddings=163840,
                        rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                                      "original_max_position_embeddings": 4096}),
    "yarn-attention-factor": dict(HEADS, model_type="llama", max_position_embeddings=32768,
                                  rope_scaling={"rope_type": "yarn", "factor": 8.0, "attention_factor": 0.8,
                                                "original_max_position_embeddings": 4096}),
    "dynamic-llama": dict(HEADS, model_type="llama", max_position_embeddings=4096,
                          rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
    "longrope-phi3": dict(HEADS, model_type="phi3", hidden_size=5120, num_attention_heads=40, num_key_value_heads=10,
                          max_position_embeddings=131072,
                          original_max_position_embeddings=4096, rope_theta=1e4,
                          rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.01 * i for i in range(64)],
                                        "long_factor": [1.0 + 0.7 * i for i in range(64)]}),
    "longrope-factor": dict(HEADS, model_type="llama", max_position_embeddings=8192,
                            rope_scaling={"rope_type": "longrope", "factor": 16.0, "attention_factor": 1.3,
                                          "original_max_position_embeddings": 4096,
                                          "short_factor": [1.5] * 64, "long_factor": [3.0 + i for i in range(64)]}),
}
CONFIGS.update({f"{v}-tiny-{s}": _config(s, v) for s, v in CASES})
# Phi-3's top-level original length wins over one in rope_scaling, as Phi3Config's standardize_rope_params does
CONFIGS["longrope-phi3-top-level-wins"] = dict(_config("phi3", "longrope"), rope_scaling=dict(
    PHI3_LONGROPE, original_max_position_embeddings=8))


def _theirs(config: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})


def _lengths(spec) -> list[int]:
    """Sequence lengths to ask both sides about: none (load time), up to the switch and past it."""
    edge = spec.rope.original_max_position
    return [0, 1, edge, edge + 1, 3 * edge]


@pytest.mark.parametrize("case", list(CONFIGS))
def test_inv_freq_and_attention_factor_are_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = CONFIGS[case]
    spec, theirs = spec_from_config(config, "r"), _theirs(config)
    assert spec.rope.variant == theirs.rope_parameters["rope_type"]
    changed = False
    for seq_len in _lengths(spec):
        inv_freq, factor = ROPE_INIT_FUNCTIONS[spec.rope.variant](theirs, torch.device("cpu"), seq_len=seq_len or None)
        ours = rope_tables(spec, seq_len)[0]
        assert ours.dtype == np.float32
        np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6, atol=0, err_msg=f"seq_len {seq_len}")
        assert spec.rope.attention_factor == pytest.approx(factor, rel=1e-12)
        changed |= not np.array_equal(ours, rope_tables(spec)[0])
    # the length matters where transformers says it does, and the scaling changed the frequencies
    assert changed == (spec.rope.variant in ("dynamic", "longrope"))
    plain = rope_tables(dataclasses.replace(spec, rope=dataclasses.replace(spec.rope, variant="standard")), 10**6)[0]
    assert not np.allclose(rope_tables(spec, 10**6)[0], plain, rtol=1e-3)


def test_yarn_extends_the_context_past_max_position_embeddings():
    """Qwen2.5's long-context recipe adds yarn (factor 4 from 32768) and keeps max_position_embeddings at 32768:
    transformers rotates any position, so a sequence may use original x factor = 131072 positions (vLLM's limit too).
    diff and bench take that limit, and say where it comes from; other RoPEs keep max_position_embeddings, dynamic
    NTK has none."""
    from mkport.bench.decode import check_bench_lengths
    from mkport.check.diff import check_diff_lengths

    qwen25 = dict(HEADS, model_type="qwen2", num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6,
                  rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    spec = spec_from_config(qwen25, "qwen25-yarn")
    assert (spec.max_position, spec.max_context) == (32768, 131072)
    check_diff_lengths(spec, 100000, 8)  # past max_position_embeddings, within yarn's reach
    check_bench_lengths(spec, [100000], 100, 16)
    words = "the model's 131072 positions (original_max_position_embeddings 32768 x yarn factor 4)"
    with pytest.raises(MkportError, match=re.escape(f"need 131073 positions, past {words}")):
        check_diff_lengths(spec, 131065, 8)
    # a yarn config whose max_position_embeddings is already the extended length keeps it
    assert spec_from_config(CONFIGS["yarn-qwen3"], "q").max_context == 131072
    assert spec_from_config(CONFIGS["yarn-default-original"], "y").max_context == 65536 * 2
    plain = spec_from_config(dict(qwen25, rope_scaling=None), "plain")
    assert plain.max_context == 32768
    with pytest.raises(MkportError, match=re.escape("past the model's 32768 positions (max_position_embeddings)")):
        check_diff_lengths(plain, 32765, 8)
    dynamic = spec_from_config(CONFIGS["dynamic-llama"], "d")
    check_diff_lengths(dynamic, 10**6, 8)  # its base grows with the length


@pytest.mark.parametrize("field,value,words", [
    ("attention_factor", -1.0, "needs a positive number 'attention_factor'"),
    ("short_factor", [1.0] * 3, "must have head_dim/2 = 32 entries, got 32 and 3"),
    ("long_factor", "4", "needs 'long_factor': a list of positive numbers"),
    ("factor", None, "needs a positive number 'factor'"),
])
def test_malformed_scaling_is_refused_in_one_line(field, value, words):
    config = _config("llama", "yarn" if field == "factor" else "longrope")  # yarn needs a factor, longrope does not
    config["rope_scaling"] = dict(config["rope_scaling"], **{field: value})
    assert_config_refused(config, words)


# -- the megakernel's length-dependent RoPE (yarn's kernel: test_kernel_families.py; GPU diffs:
# test_gpu_kernel_families.py) -------------------------------------------------------------------------------------

# Real-sized shapes for the compiles: Phi-3-medium-128k-like longrope on a llama, dynamic NTK from 4096
LONGROPE_LLAMA = dict(HEADS, model_type="llama", num_key_value_heads=8, max_position_embeddings=131072,
                      rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 4096,
                                    "short_factor": [1.0 + 0.01 * i for i in range(64)],
                                    "long_factor": [1.0 + 0.7 * i for i in range(64)]})
DYNAMIC_LLAMA = dict(HEADS, model_type="llama", num_key_value_heads=8, max_position_embeddings=4096,
                     rope_scaling={"rope_type": "dynamic", "factor": 4.0})


def _positions_around_the_switch(spec) -> list[int]:
    edge = spec.rope.original_max_position  # a step at position p has length p + 1: edge - 1 is the last before
    return [0, edge - 2, edge - 1, edge, edge + 1, 2 * edge + 3]


def _rendered(config: dict, batch: int = 1) -> tuple:
    spec = spec_from_config(config, "r")
    return spec, render(spec, plan_launch(spec, target_for_arch("sm_90"), batch=batch)).files


@pytest.mark.parametrize("shape", ["llama", "qwen2"])
def test_longrope_renders_both_tables_and_switches_past_the_original_length(shape):
    """ROPE_INV_FREQ holds the short factors' table, ROPE_LONGROPE_INV_FREQ the short then the long factors'; rope.cuh
    picks the long one for a length past ROPE_ORIGINAL: for a step at position p (length p + 1), rope_tables(spec,
    p + 1)."""
    spec, files = _rendered(_config(shape, "longrope"))
    constants = files["constants.cuh"]
    short, long = (", ".join(_float_literal(f) for f in rope_tables(spec, n)[0]) for n in (1, 17))
    assert short != long
    assert f"ROPE_INV_FREQ[HD / 2] = {{ {short} }}" in constants
    assert f"ROPE_LONGROPE_INV_FREQ[2][HD / 2] = {{ {{ {short} }},\n" in constants
    assert f"{{ {long} }} }};" in constants
    assert "constexpr int ROPE_ORIGINAL = 16;" in constants and "#define HAS_LONGROPE 1" in constants
    assert "#define HAS_DYNAMIC_ROPE 0" in constants
    assert "ROPE_LONGROPE_INV_FREQ[length.len > ROPE_ORIGINAL][i]" in files["rope.cuh"]
    assert "return {pos_t + 1, p.rope_table};" in files["rope.cuh"]  # a step's length
    for p in _positions_around_the_switch(spec):
        picked = long if p + 1 > spec.rope.original_max_position else short
        assert picked == ", ".join(_float_literal(f) for f in rope_tables(spec, p + 1)[0]), f"position {p}"
    # the attention factor, as yarn's
    assert f"constexpr float ROPE_ATTENTION_FACTOR = {_float_literal(spec.rope.attention_factor)};" in constants


def test_only_longrope_declares_the_long_table():
    for config in (_config("llama", "dynamic"), _config("llama", "yarn")):
        constants = _rendered(config)[1]["constants.cuh"]
        assert "ROPE_LONGROPE_INV_FREQ" not in constants and "#define HAS_LONGROPE 0" in constants
    assert "#define HAS_DYNAMIC_ROPE 1" in _rendered(_config("llama", "dynamic"))[1]["constants.cuh"]


@pytest.mark.parametrize("max_seq", [8, 16, 40])
def test_dynamic_table_rows_are_rope_tables_of_each_step_length(max_seq):
    """The decoder's Params::rope_table: the row a step at position p reads (max(p + 1 - original, 0), rope.cuh) is
    rope_tables(spec, p + 1), bit for bit, on both sides of the original length; a max_seq within the original length
    needs one row."""
    spec = spec_from_config(_config("llama", "dynamic"), "r")
    edge = spec.rope.original_max_position
    table = dynamic_rope_table(spec, max_seq)
    assert table.dtype == np.float32 and table.shape == (max(max_seq - edge, 0) + 1, 32)
    for p in (p for p in _positions_around_the_switch(spec) if p < max(max_seq, edge)):
        np.testing.assert_array_equal(table[max(p + 1 - edge, 0)], rope_tables(spec, p + 1)[0], err_msg=f"position {p}")
    assert len({row.tobytes() for row in table}) == len(table)  # the base grows with every length past the original


@pytest.mark.parametrize("variant", ["dynamic", "longrope"])
def test_the_fused_prefill_leaves_them_to_torch(models, variant):
    """A prompt's frequencies follow its own length (torch_model.rope_cos_sin); the fused prefill kernels rotate by the
    rendered load-time table, so these prompts take torch_model's prefill (yarn's, the same shape, does not)."""
    from mkport.runtime import prefill

    assert not prefill.supported(*models["qwen2", variant][:2])
    assert prefill.supported(*models["qwen2", "yarn"][:2])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """Both real-sized shapes for sm_90: batch 1 normal and trace builds, batch 8 normal, in one pool."""
    root, target = tmp_path_factory.mktemp("length_rope"), target_for_arch("sm_90")
    configs = {"longrope": LONGROPE_LLAMA, "dynamic": DYNAMIC_LLAMA}

    def job(variant: str, batch: int, trace: bool):
        spec = spec_from_config(configs[variant], variant)
        plan = plan_launch(spec, target, batch=batch)
        return compile_check(render(spec, plan).write(root), plan, target, trace=trace)

    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        futures = {key: pool.submit(job, *key) for key in COMPILES}
    return {key: future.result() for key, future in futures.items()}


COMPILES = [(variant, batch, trace) for variant in ("longrope", "dynamic") for batch, trace in ((1, False), (1, True),
                                                                                                 (8, False))]


@needs_nvcc
@pytest.mark.parametrize("variant,batch,trace", COMPILES)
def test_compiles_for_sm90_without_spills(compiled, variant, batch, trace):
    result = compiled[variant, batch, trace]
    assert result.ok, result.problems
    assert all(k.spill_stores == k.spill_loads == 0 for k in result.kernels), result.kernels


def test_phi35_mini_head_dim_96_is_read_and_the_kernel_plans_it():
    """Phi-3.5-mini's shape (head_dim 3072 / 32 = 96, 128k longrope from 4096) is a spec, with transformers'
    head_dim and attention factor; the megakernel plans it (a padded rotate-half pair, attention.cuh; longrope's two
    tables, rope.cuh)."""
    config = dict(SHAPES["phi3"], hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=131072,
                  original_max_position_embeddings=4096,
                  rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48})
    del config["head_dim"]
    spec, theirs = spec_from_config(config, "phi3.5-mini"), _theirs(config)
    assert spec.head_dim == theirs.hidden_size // theirs.num_attention_heads == 96
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert spec.rope.attention_factor == ROPE_INIT_FUNCTIONS["longrope"](theirs, torch.device("cpu"))[1]
    assert plan_launch(spec, target_for_arch("sm_90")).batch == 1


# Phi-4-mini's shape: head_dim 3072 / 24 = 128, partial_rotary_factor 0.75 (RoPE on the first 96 dimensions),
# longrope's 48 factors a table, 128k from 4096
PHI4_MINI = dict(SHAPES["phi4"], hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
                 num_key_value_heads=8, vocab_size=200064, max_position_embeddings=131072,
                 original_max_position_embeddings=4096,
                 rope_scaling={"type": "longrope", "short_factor": SHORT + SHORT[:16], "long_factor": LONG + LONG[:16]})
del PHI4_MINI["head_dim"]


def test_phi4_mini_partial_rotary_is_read_and_the_kernel_plans_it():
    """Phi-4-mini's shape is a spec whose frequencies are transformers'; the megakernel plans it (rope.cuh's partial
    rotation: element i < 96 pairs with i +- 48, in another slot and lane)."""
    spec, theirs = spec_from_config(PHI4_MINI, "phi-4-mini"), _theirs(copy.deepcopy(PHI4_MINI))
    assert (spec.head_dim, spec.rope_dim) == (128, 96)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for seq_len in (None, 4097):
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](theirs, torch.device("cpu"), seq_len=seq_len)
        np.testing.assert_allclose(rope_tables(spec, seq_len or 0)[0], inv_freq.numpy(), rtol=1e-6, atol=0)
        assert spec.rope.attention_factor == pytest.approx(factor, rel=1e-12)
    assert plan_launch(spec, target_for_arch("sm_90")).batch == 1
    short = dict(PHI4_MINI, rope_scaling=dict(PHI4_MINI["rope_scaling"], short_factor=[1.0] * 64))
    with pytest.raises(MkportError, match="the rotated dimensions/2 = 48 entries, got 48 and 64"):
        spec_from_config(short, "phi-4-mini")


def test_partial_rotary_the_kernel_does_not_lay_out_is_refused(tmp_path, monkeypatch):
    """head_dim 96 holds a head in padded pairs (attention.cuh), not element i in lane i % 32, slot i / 32, which the
    partial rotation needs; nor does it rotate an odd number of dimensions: one line each, the command's too."""
    phi35 = dict(SHAPES["phi3"], partial_rotary_factor=0.5, max_position_embeddings=64, rope_scaling=None)
    spec = spec_from_config(phi35, "phi3-half-rotary")
    assert (spec.head_dim, spec.rope_dim) == (96, 48)
    words = "not built yet for partial rotary embeddings (RoPE on {} of head_dim {};"
    with pytest.raises(MkportError, match=re.escape(words.format(48, 96))):
        plan_launch(spec, target_for_arch("sm_90"))
    assert_kernel_command_refuses(tmp_path, monkeypatch, phi35, ["generate"], words.format(48, 96))
    odd = dataclasses.replace(spec_from_config(PHI4_MINI, "phi-4-mini"), rotary_dim=95)
    with pytest.raises(MkportError, match=re.escape(words.format(95, 128))):
        plan_launch(odd, target_for_arch("sm_90"))


def test_the_fused_prefill_rotates_an_unscaled_partial_rotary():
    """Phi-4-mini's shape without longrope takes the fused prefill, whose apply_rope is the decode step's (its GPU diff:
    test_gpu_kernel_families.py's phi4); with longrope, torch_model's."""
    from mkport.runtime import prefill

    assert prefill.runs(spec_from_config(dict(SHAPES["phi4"], max_position_embeddings=64), "phi4"))
    assert not prefill.runs(spec_from_config(_config("phi4", "longrope"), "longrope-phi4"))


@pytest.fixture(scope="module")
def phi4_compiled(tmp_path_factory) -> dict:
    """The tiny phi4 shape and Phi-4-mini's for sm_90, batch 1 normal and trace builds, in one pool."""
    root, target = tmp_path_factory.mktemp("partial_rope"), target_for_arch("sm_90")
    configs = {"tiny": _config("phi4", "longrope"), "phi-4-mini": PHI4_MINI}

    def job(shape: str, trace: bool):
        spec = spec_from_config(configs[shape], shape)
        plan = plan_launch(spec, target)
        return compile_check(render(spec, plan).write(root), plan, target, trace=trace)

    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        futures = {key: pool.submit(job, *key) for key in PHI4_COMPILES}
    return {key: future.result() for key, future in futures.items()}


PHI4_COMPILES = [(shape, trace) for shape in ("tiny", "phi-4-mini") for trace in (False, True)]


@needs_nvcc
@pytest.mark.parametrize("shape,trace", PHI4_COMPILES)
def test_partial_rotary_compiles_for_sm90_without_spills(phi4_compiled, shape, trace):
    result = phi4_compiled[shape, trace]
    assert result.ok, result.problems
    assert all(k.spill_stores == k.spill_loads == 0 for k in result.kernels), result.kernels


# -- the torch path against transformers -------------------------------------------------------------------------



@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(shape, variant) -> (spec, kernel-layout weights, folder) of each tiny random model."""
    out = {}
    for seed, (shape, variant) in enumerate(CASES):
        folder = tmp_path_factory.mktemp(f"{shape}-{variant}")
        (folder / "config.json").write_text(json.dumps(_config(shape, variant)))
        spec = open_model(str(folder)).spec
        write_random_weights(spec, folder, seed=seed)
        out[shape, variant] = spec, load_weights(spec, Checkpoint.open(folder)), str(folder)
    return out


def _inputs(spec, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n random tokens at positions 0..n-1 (a sequence from its start, as transformers' stateful dynamic RoPE is
    checked against)."""
    tokens = torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    return tokens, torch.arange(n).expand(3, n).clone()


def _one_pass_report(models, case, spec=None, n: int = 24):
    """compare() of mkport's one-pass taps (of `spec`, the model's own unless an ablation) against a fresh
    transformers reference of n rows: past the original length 16."""
    own, w, folder = models[case]
    source = open_model(folder)
    tokens, positions = _inputs(own, n, seed=1)
    theirs = Reference(source, Checkpoint.open(folder)).run(tokens=tokens, positions=positions)
    ours = torch_path_taps(spec or own, w, tokens, positions)
    return compare(ours, dict(theirs.taps, logits=theirs.logits), own)


@pytest.mark.parametrize("shape,variant", CASES)
def test_one_pass_matches_transformers(models, shape, variant):
    """24 rows at once against transformers' float32 classes: every tap and the logits to fp32 rounding."""
    report = _one_pass_report(models, (shape, variant))
    assert report.passed, report.to_text()
    worst = max(report.rows, key=lambda r: r.rel_l2)
    assert worst.rel_l2 < 2e-4, f"{worst.name}: rel_l2 {worst.rel_l2:.3g} is more than fp32 rounding"


def _transformers_steps(folder: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits fed one token at a time with its KV cache: its dynamic and longrope frequencies follow
    each step's length, so the cached keys keep the frequencies of the step that wrote them."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cache, rows = None, []
    with torch.no_grad():
        for t in range(tokens.shape[0]):
            out = hf(input_ids=tokens[None, t : t + 1], position_ids=torch.tensor([[t]]), use_cache=True,
                     **{cache_argument(hf): cache})
            cache = out.past_key_values
            rows.append(out.logits[0, -1])
    return torch.stack(rows)


@pytest.mark.parametrize("shape,variant", CASES)
def test_token_by_token_matches_transformers(models, shape, variant):
    """32 rows one at a time with a bf16 KV cache (the kernel's numerics on the CPU) against transformers step by
    step: each row's logits within the diff's hidden-state tolerance, past the original length too."""
    spec, w, folder = models[shape, variant]
    tokens, positions = _inputs(spec, 32, seed=2)
    ours = torch_path_taps(spec, w, tokens, positions, decode=True)["logits"]
    theirs = _transformers_steps(folder, tokens)
    for t in (range(17), range(17, 32)):  # up to the switch, past it
        assert rel(ours[t], theirs[t]) < HIDDEN_TOL, f"rows {t}: {rel(ours[t], theirs[t]):.3g}"


@pytest.mark.parametrize("variant", ["dynamic", "longrope"])
def test_a_stepped_reference_is_what_decode_steps_compute(models, variant):
    """kernel_diff's reference for these: the prompt (16 rows) in one pass, then each row alone with transformers' KV
    cache, as the megakernel's decoder prefills and steps; its logits are transformers' own step by step (a fresh
    model each, whatever the Reference ran before: the one-pass run first grows dynamic's cached length to 24).
    mkport's token-by-token taps pass against it, and fail against the one pass, which rotates every row by the
    whole sequence's length: why kernel_diff steps its reference."""
    spec, w, folder = models["qwen2", variant]
    tokens, positions = _inputs(spec, 24, seed=3)
    ref = Reference(open_model(folder), Checkpoint.open(folder))
    one_pass = ref.run(tokens=tokens, positions=positions)
    stepped = ref.run(tokens=tokens, positions=positions, steps_from=16)
    assert rel(stepped.logits, _transformers_steps(folder, tokens)) < 1e-5
    layered = Reference(open_model(folder), Checkpoint.open(folder), layered=True)  # a large model's, the same
    assert torch.equal(layered.run(tokens=tokens, positions=positions, steps_from=16).logits, stepped.logits)
    ours = torch_path_taps(spec, w, tokens, positions, decode=True)
    for theirs, passes in ((stepped, True), (one_pass, False)):
        report = compare({k: v[16:] for k, v in ours.items()},
                         {**{k: v[16:] for k, v in theirs.taps.items()}, "logits": theirs.logits[16:]}, spec)
        assert report.passed == passes, report.to_text()
    assert report.first_failure.name.startswith("layers.0.")


def test_a_stepped_reference_uses_its_cache(models):
    """With a static RoPE (yarn) stepping changes nothing: the stepped rows equal the one pass, which holds only if each
    step attends to the cached rows (its forward takes the cache by the name this transformers release uses)."""
    from mkport.check.reference import cache_argument

    spec, _, folder = models["qwen2", "yarn"]
    tokens, positions = _inputs(spec, 24, seed=3)
    ref = Reference(open_model(folder), Checkpoint.open(folder))
    one_pass, stepped = ref.run(tokens=tokens, positions=positions), ref.run(tokens=tokens, positions=positions, steps_from=16)
    assert rel(stepped.logits, one_pass.logits) < 1e-5

    class Older(torch.nn.Module):  # transformers 5 before the rename
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return input_ids

    assert cache_argument(Older()) == "past_key_values"


@pytest.mark.parametrize("variant", ["dynamic", "longrope"])
def test_graphs_backend_refuses_length_dependent_rope(models, variant):
    """One captured step serves a batch's sequences of every length: the graphs backend refuses it in one line."""
    from mkport.runtime.graph_decoder import GraphDecoder

    spec, w, _ = models["qwen2", variant]
    with pytest.raises(MkportError, match=f"graphs backend does not run {variant} RoPE") as e:
        GraphDecoder(spec, w, 16, batch=2, device="cpu")
    assert "\n" not in str(e.value)


# -- ablations: each must fail ---------------------------------------------------------------------------------------

def _ablated(spec, **rope_fields):
    return dataclasses.replace(spec, rope=dataclasses.replace(spec.rope, **rope_fields))


SWAPPED = {"long_factor": tuple(SHORT), "short_factor": tuple(LONG)}


@pytest.mark.parametrize("variant,ablation,n", [
    ("yarn", {"attention_factor": 1.0}, 24),  # cos/sin left unscaled
    ("yarn", {"variant": "linear"}, 24),  # every frequency interpolated, no ramp
    ("longrope", {"attention_factor": 1.0}, 24),
    ("longrope", SWAPPED, 24),  # past the switch: the same as never switching to the long factors
    ("longrope", SWAPPED, 16),
    ("dynamic", {"variant": "standard"}, 24),  # the base never raised
])
def test_ablation_fails(models, variant, ablation, n):
    """Each variant's features switched off or mis-set is caught in one pass of n rows, on the qwen2 shape."""
    spec = models["qwen2", variant][0]
    report = _one_pass_report(models, ("qwen2", variant), _ablated(spec, **ablation), n)
    assert not report.passed, report.to_text()


def test_phi4_rope_over_the_whole_head_fails_at_q(models):
    """Phi-4-mini's rotation over all 128 dimensions of a head (i with i + 64, with the 64 factors that reads) instead
    of its first 96: layer 0's q fails (the megakernel's ablation on the GPU: test_gpu_kernel_families.py)."""
    spec = models["phi4", "longrope"][0]
    whole_head = dataclasses.replace(_ablated(spec, short_factor=tuple(SHORT * 2), long_factor=tuple(LONG * 2)),
                                     rotary_dim=0)
    report = _one_pass_report(models, ("phi4", "longrope"), whole_head)
    assert not report.passed and report.first_failure.name == "layers.0.q", report.to_text()


def test_length_dependent_ablations_are_invisible_before_the_switch(models):
    """Up to the original length, dynamic's unraised base and longrope's missing switch to its long factors change
    nothing: the 24-row inputs above are what exercises them."""
    for variant, ablation in (("dynamic", {"variant": "standard"}), ("longrope", {"long_factor": tuple(SHORT)})):
        spec = models["qwen2", variant][0]
        assert _one_pass_report(models, ("qwen2", variant), _ablated(spec, **ablation), n=16).passed


# -- Phi-3's recompute of the cache at its longrope switch (runtime.rope_switch) -------------------------------------

# 8 tokens: generate prefills 7 and steps from position 7, so its 10th token (index 9) is the first whose step (position
# 16, length 17) passes the original length 16
PHI3_PROMPT = [5, 100, 300, 7, 42, 256, 11, 300]
SWITCH_TOKEN = 9


def test_the_recompute_rule_is_phi3_generates():
    """prepare_inputs_for_generation's condition: inputs reaching past the original length 16 while the cache holds at
    most 16 rows; phi3 with longrope only (llama's longrope and phi3 unscaled never recompute)."""
    phi3, phi4 = (spec_from_config(_config(shape, "longrope"), shape) for shape in ("phi3", "phi4"))
    for spec in (phi3, phi4):
        assert [rope_switch.recomputes(spec, start, 1) for start in (0, 15, 16, 17)] == [False, False, True, False]
        assert rope_switch.recomputes(spec, 10, 7) and not rope_switch.recomputes(spec, 10, 6)  # a prompt continued
        assert not rope_switch.recomputes(spec, 0, 24)  # a prompt from row 0 is that forward already
    for config in (_config("llama", "longrope"), dict(SHAPES["phi3"], max_position_embeddings=64)):
        assert not rope_switch.recomputes(spec_from_config(config, "r"), 16, 1)


def _greedy(spec, w, steps: int = 24) -> list[int]:
    return list(generate(TorchDecoder(spec, w, len(PHI3_PROMPT) + steps), PHI3_PROMPT, SamplingParams(), steps))


@NEEDS_PHI3_GENERATE
@pytest.mark.parametrize("shape", ["phi3", "phi4"])
def test_greedy_tokens_are_phi3_generate_across_the_switch(models, monkeypatch, shape):
    """TorchDecoder's greedy tokens equal Phi3ForCausalLM.generate's for 24 steps across the switch (its cache dropped
    and every key recomputed with the long factors at the 10th); without the recompute they part there or after."""
    from test_run import transformers_greedy

    spec, w, folder = models[shape, "longrope"]
    theirs = transformers_greedy(folder, PHI3_PROMPT, 24)
    assert _greedy(spec, w) == theirs
    monkeypatch.setattr(rope_switch, "recomputes", lambda *args: False)
    ablated = _greedy(spec, w)
    assert ablated[:SWITCH_TOKEN] == theirs[:SWITCH_TOKEN] and ablated != theirs, (ablated, theirs)


def test_the_recompute_feeds_embeddings_again(models):
    """A sequence fed input embeddings (the tokens' own rows) keeps them for the recompute: the same greedy tokens as
    fed the token ids, across the switch."""
    spec, w, _ = models["phi3", "longrope"]
    expected, table = _greedy(spec, w), w.embed[0].float()
    decoder = TorchDecoder(spec, w, 32)
    decoder.prefill(embeds=table[PHI3_PROMPT[:-1]])
    got = [int(decoder.step(embed=table[PHI3_PROMPT[-1]]))]
    while len(got) < 24:
        got.append(int(decoder.step(embed=table[got[-1]])))
    assert got == expected


def test_the_recompute_refuses_loaded_rows(models):
    """Rows put in with load_rows come without their inputs: the step at the switch is refused in one line."""
    spec, w, _ = models["phi3", "longrope"]
    first = TorchDecoder(spec, w, 32)
    first.prefill(tokens=PHI3_PROMPT)
    second = TorchDecoder(spec, w, 32)
    second.load_rows(first.cached_rows(len(PHI3_PROMPT)))
    second.prefill(tokens=PHI3_PROMPT)  # rows 8 to 15: up to the switch
    with pytest.raises(MkportError, match="needs the inputs of all 16 cached rows") as e:
        second.step(token=1)
    assert "\n" not in str(e.value)


@NEEDS_PHI3_GENERATE
def test_the_stepped_reference_recomputes_as_generate(models):
    """kernel_diff's reference (its GPU diffs of longrope-phi4 cross the switch, test_gpu_kernel_families.py) with
    switch_recompute: fed generate's own sequence, prompt in one pass then a row at a time, its argmax at each row is
    generate's next token; stepped without the recompute it is not."""
    from test_run import transformers_greedy

    spec, _, folder = models["phi3", "longrope"]
    theirs = transformers_greedy(folder, PHI3_PROMPT, 24)
    tokens, positions = torch.tensor(PHI3_PROMPT + theirs[:-1]), torch.arange(31).expand(3, 31)
    ref = Reference(open_model(folder), Checkpoint.open(folder))
    prompt = len(PHI3_PROMPT)
    for recompute in (True, False):
        out = ref.run(tokens=tokens, positions=positions, steps_from=prompt, switch_recompute=recompute)
        assert out.logits.shape[0] == 31 and out.taps["final_norm"].shape[0] == 31
        assert (out.logits[prompt - 1 :].argmax(-1).tolist() == theirs) == recompute
