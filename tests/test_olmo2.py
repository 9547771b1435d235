"""OLMo 2 and OLMo 3, the CPU half: the specs against transformers' Olmo2Config and Olmo3Config, the kernel plan
(the megakernel builds both; what it still refuses, OLMo 3 sliding layers with a yarn RoPE, in one line), and
mkport's plain-torch path (torch_model, TorchDecoder, `run --backend reference`) against
transformers' own Olmo2 / Olmo3 classes on tiny random models, with faults and ablations of the post-norm layers (and
OLMo 3's sliding layers and their own RoPE) found at their layer and op. head_dim 64 with 4 heads on hidden 128 makes
the q/k norms span 256 and 128 values, not hidden_size; OLMo 3's window of 6 bites under 20-row inputs, and linear
RoPE scaling on its full layer makes the two RoPEs differ.
The checks every plain-torch family shares (prefill, decode, greedy tokens, `run`, weight faults):
test_torch_families.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import reference_taps, torch_path_against_transformers, torch_path_taps, validation_inputs
from mkport.check.diff import compare, inject
from mkport.errors import MkportError
from mkport.kernel.gpu import target_for_arch
from mkport.kernel.interface import Tap
from mkport.kernel.launch_plan import plan_launch
from mkport.kernel.spec import RopeSpec, open_model, spec_from_config
from mkport.runtime.weights import checkpoint_shapes, weight_names

OLMO2 = {"model_type": "olmo2", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "rope_theta": 5e5}
# Olmo3Config's default layer pattern (three sliding layers, then a full one)
OLMO3 = dict(OLMO2, model_type="olmo3", num_hidden_layers=4, sliding_window=6,
             rope_scaling={"rope_type": "linear", "factor": 8.0})
CONFIGS = {"olmo2": OLMO2, "olmo3": OLMO3}
# OLMo 3 with a yarn RoPE on its sliding layers (rope_parameters per layer type): the kernel's sliding layers rotate
# with their own theta, unscaled, linear or llama3, and no attention factor
OLMO3_LOCAL_YARN = {**{k: v for k, v in OLMO3.items() if k not in ("rope_theta", "rope_scaling")}, "rope_parameters": {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
    "sliding_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                          "rope_theta": 5e5}}}

# allenai/OLMo-2-0425-1B's shape (config.json as released: 16 heads of 128, as many KV heads, untied)
OLMO_2_1B = {"model_type": "olmo2", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
             "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 100352, "rms_norm_eps": 1e-6,
             "max_position_embeddings": 4096, "rope_theta": 500000, "tie_word_embeddings": False}


def _theirs(config: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})


# -- spec --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CONFIGS))
@pytest.mark.parametrize("defaults", [False, True], ids=["as-written", "class-defaults"])
def test_spec_is_transformers_config(case, defaults):
    """Each field as Olmo2Config / Olmo3Config reads it, from the config as written and from one that leaves every
    optional field out (the class defaults: rms_norm_eps 1e-5, RoPE theta 1e4 / 5e5, untied, as many KV heads as heads,
    olmo3's layer pattern and window 4096); head_dim stays, as the classes have none of their own (hidden / heads would
    be 32 here)."""
    config = CONFIGS[case]
    if defaults:
        config = {k: v for k, v in config.items() if k not in ("rms_norm_eps", "rope_theta", "num_key_value_heads",
                                                               "sliding_window", "rope_scaling")}
    s, theirs = spec_from_config(config, "o"), _theirs(config)
    head_dim = getattr(theirs, "head_dim", theirs.hidden_size // theirs.num_attention_heads)
    assert (s.head_dim, s.num_kv_heads, s.rms_eps, s.tie_embeddings) == (
        head_dim, theirs.num_key_value_heads, theirs.rms_norm_eps, theirs.tie_word_embeddings)
    assert not s.pre_norms and s.qk_norm and s.qk_norm_span == "projection" and not s.sandwich_norms
    assert s.attention_scale == head_dim**-0.5
    if case == "olmo2":
        assert s.rope == RopeSpec(theirs.rope_parameters["rope_theta"], "standard") and not s.attention_windows
        return
    assert [s.window(i) for i in range(s.num_layers)] == [
        theirs.sliding_window if t == "sliding_attention" else 0 for t in theirs.layer_types]
    full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    assert (s.rope.theta, s.rope.factor) == (full["rope_theta"], full.get("factor", 1.0))
    assert local["rope_type"] == "default" and (s.local_rope or s.rope) == RopeSpec(local["rope_theta"], "standard")
    assert (s.local_rope is None) == defaults  # one RoPE where the full layers' is unscaled


def test_olmo3_rope_parameters_per_layer_type():
    """transformers 5 writes rope_parameters per layer type: read the same as rope_theta with rope_scaling; a flat
    rope_parameters, which Olmo3Config would take for the full layers only, is refused."""
    per_type = {k: v for k, v in OLMO3.items() if k not in ("rope_theta", "rope_scaling")}
    per_type["rope_parameters"] = _theirs(OLMO3).rope_parameters
    assert spec_from_config(per_type, "o") == spec_from_config(OLMO3, "o")
    with pytest.raises(MkportError, match="rope_parameters for olmo3 must be given per layer type"):
        spec_from_config(dict(per_type, rope_parameters={"rope_theta": 1e4, "rope_type": "default"}), "o")


def test_olmo3_null_window_with_sliding_layers_is_refused():
    with pytest.raises(MkportError, match="sliding_window is null"):
        spec_from_config(dict(OLMO3, sliding_window=None), "o")



def test_bundled_spec_is_the_published_config():
    """The bundled olmo-2-0425-1b holds OLMO_2_1B's fields as written, and its spec is Olmo2Config's reading of them:
    head_dim 2048 / 16 = 128, 16 KV heads, eps 1e-6, RoPE theta 5e5, untied, 4096 positions."""
    source = open_model("olmo-2-0425-1b")
    assert {k: source.config[k] for k in OLMO_2_1B} == OLMO_2_1B
    s, theirs = source.spec, _theirs(source.config)
    assert s == spec_from_config(OLMO_2_1B, "olmo-2-0425-1b")
    assert (s.head_dim, s.num_kv_heads, s.rms_eps, s.tie_embeddings, s.max_position) == (
        theirs.hidden_size // theirs.num_attention_heads, theirs.num_key_value_heads, theirs.rms_norm_eps,
        theirs.tie_word_embeddings, theirs.max_position_embeddings) == (128, 16, 1e-6, False, 4096)
    assert s.rope == RopeSpec(theirs.rope_parameters["rope_theta"], "standard") and not s.attention_windows
    assert not s.pre_norms and s.qk_norm_span == "projection"

@pytest.mark.parametrize("case", list(CONFIGS))
def test_weight_names_are_transformers_state_dict(case):
    """The checkpoint mkport reads and writes has Olmo2ForCausalLM's tensors, shape for shape: no input_layernorm,
    a post_feedforward_layernorm, q/k norms over heads * head_dim."""
    from transformers import AutoModelForCausalLM

    spec = spec_from_config(CONFIGS[case], "o")
    theirs = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(_theirs(CONFIGS[case])).state_dict().items()}
    assert checkpoint_shapes(spec, weight_names(spec)) == theirs


def test_weight_bytes_count_every_norm():
    """A step reads every layer tensor (both post norms, the q/k norms over the projection), the final norm, one
    embedding row and the untied head."""
    spec = spec_from_config(OLMO2, "o")
    elems = sum(torch.Size(shape).numel() for shape in checkpoint_shapes(spec, weight_names(spec)).values())
    assert spec.weight_bytes_per_step() == 2 * (elems - (spec.vocab_size - 1) * spec.hidden_size)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_the_kernel_plan_accepts_it(case, batch):
    """The megakernel builds OLMo 2/3's post-norm layers (test_kernel_families.py renders and compiles them)."""
    plan = plan_launch(spec_from_config(CONFIGS[case], "o"), target_for_arch("sm_90"), batch=batch)
    assert plan.batch == batch


# OLMO3_LOCAL_YARN's refusal on the megakernel: test_kernel_families.py (with Gemma 3's, the same rule)


# -- ablations found at their layer and op (the torch path against transformers, weight faults: test_torch_families.py)

def test_no_input_norm_to_inject(family_model):
    spec, w, _, _ = family_model("olmo2")
    with pytest.raises(MkportError, match="cannot inject at 0:attn_norm") as e:
        inject(w, spec, 0, Tap.ATTN_NORM, seed=1)
    assert "\n" not in str(e.value)


def _relaid(w, **fields):
    return dataclasses.replace(w, layers=[dataclasses.replace(lw, **{k: f(lw) for k, f in fields.items()})
                                          for lw in w.layers])


@pytest.mark.parametrize("fields,first", [
    # the Llama lineage's placement: the same norms before attention and the MLP instead of after them
    ({"attn_norm": lambda lw: lw.post_attn_norm, "mlp_norm": lambda lw: lw.post_mlp_norm,
      "post_attn_norm": lambda lw: None, "post_mlp_norm": lambda lw: None}, Tap.layer(0, Tap.Q)),
    ({"post_attn_norm": lambda lw: None}, Tap.layer(0, Tap.ATTN_RESIDUAL)),
    ({"post_mlp_norm": lambda lw: None}, Tap.layer(0, Tap.MLP_RESIDUAL)),
], ids=["pre-norm", "no-post-attention-norm", "no-post-feedforward-norm"])
def test_norm_placement_ablations_fail_where_they_bite(family_model, fields, first):
    spec, w, ref, _ = family_model("olmo2")
    inp = validation_inputs(spec, "olmo2", n=12, seed=10)
    ours = torch_path_taps(spec, _relaid(w, **fields), inp["tokens"], inp["positions"])
    # a pre-norm layer traces attn_norm, a state transformers' OLMo 2 does not have: compared where both have one
    ours = {k: v for k, v in ours.items() if not k.endswith(Tap.ATTN_NORM)}
    report = compare(ours, reference_taps(ref, inp), spec)
    assert not report.passed and report.first_failure.name == first, report.to_text()


@pytest.mark.parametrize("case,changes,first", [
    ("olmo2", {"qk_norm": False}, Tap.layer(0, Tap.Q)),
    ("olmo3", {"attention_windows": (7, 7, 7, 0)}, Tap.layer(0, Tap.ATTN)),  # window + 1
    ("olmo3", {"attention_windows": (5, 5, 5, 0)}, Tap.layer(0, Tap.ATTN)),  # window - 1
    ("olmo3", {"local_rope": None}, Tap.layer(0, Tap.Q)),  # the full layers' scaled RoPE on the sliding ones
    ("olmo3", {"rope": RopeSpec(5e5, "standard")}, Tap.layer(3, Tap.Q)),  # the full layer's scaling left out
], ids=["no-qk-norm", "window+1", "window-1", "one-rope", "unscaled-full-rope"])
def test_ablations_fail_where_the_feature_bites(family_model, case, changes, first):
    spec, w, ref, _ = family_model(case)
    inp = validation_inputs(spec, case, n=20, seed=11)
    _, _, report = torch_path_against_transformers(dataclasses.replace(spec, **changes), w, ref, inp)
    assert not report.passed and report.first_failure.name == first, report.to_text()
