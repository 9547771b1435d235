"""The layer-at-a-time float32 reference (Reference(..., layered=True)) against the whole model: the same taps and
logits bit for bit, with at most one decoder layer's parameters materialised at any time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_moe_model, make_validation_model, validation_inputs

import mkport.runtime.weights as weights
from mkport.check.diff import LAYERED_REFERENCE_BYTES, reference_layered
from mkport.check.reference import Reference, can_layer
from mkport.errors import MkportError
from mkport.kernel.spec import bundled_names, open_model
from mkport.runtime.weights import Checkpoint, CounterCheckpoint, checkpoint_bytes

CASES = ("qwen3", "llama", "mistral", "granite", "phi3", "smollm3")


def _pair(model: str, checkpoint=None):
    source = open_model(model)
    checkpoint = checkpoint or Checkpoint.open(model.rsplit(":", 1)[0])
    return source, Reference(source, checkpoint), Reference(source, checkpoint, layered=True)


def _materialised(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if not p.is_meta)


def _assert_same(whole, layered, spec, case, n=12):
    inp = validation_inputs(spec, case, n=n, seed=3)
    a = whole.run(tokens=inp["tokens"], positions=inp["positions"])
    peaks = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: peaks.append(_materialised(layered.causal_lm)))
             for layer in layered.base.layers]
    try:
        b = layered.run(tokens=inp["tokens"], positions=inp["positions"])
    finally:
        for h in hooks:
            h.remove()
    assert set(a.taps) == set(b.taps) and len(a.taps) > 5 * spec.num_layers
    for name in a.taps:
        assert torch.equal(a.taps[name], b.taps[name]), name
    assert torch.equal(a.logits, b.logits)
    # only the running layer is there, besides the embeddings, final norm and head; before and after, none is
    outside = _materialised(layered.causal_lm)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in whole.base.layers]
    assert peaks == [outside + size for size in sizes]
    assert outside == sum(p.numel() for n, p in whole.causal_lm.named_parameters() if not n.startswith("model.layers."))


@pytest.mark.parametrize("case", CASES)
def test_layered_reference_gives_the_whole_models_taps(tmp_path, case):
    model = make_validation_model(tmp_path, case, seed=7)
    source, whole, layered = _pair(model)
    # mistral / phi3: 24 rows reach well past the window of 5
    _assert_same(whole, layered, source.spec, case, n=24)


@pytest.mark.parametrize("case", ("qwen2_moe", "granitemoe"))
def test_layered_reference_of_a_mixture_of_experts(tmp_path, case):
    """Per-expert tensors fused into transformers' modules (qwen2_moe), and fused ones renamed into them (granitemoe)."""
    model = make_moe_model(tmp_path, case, seed=1)
    source, whole, layered = _pair(model)
    _assert_same(whole, layered, source.spec, case)


@pytest.mark.parametrize("case", ("qwen3_5", "qwen3_5_moe"))
def test_layered_reference_of_a_hybrid(tmp_path, case):
    """Qwen3.5's hybrids, dense (the multimodal wrapper's checkpoint, tied head) and mixture of experts (its fused
    experts, untied head): Gated DeltaNet and full layers filled one at a time give the whole model's taps."""
    model = (make_moe_model(tmp_path, case, seed=3) if case == "qwen3_5_moe"
             else make_validation_model(tmp_path, case, seed=3))
    source, whole, layered = _pair(model)
    assert whole.mrope and layered.mrope
    _assert_same(whole, layered, source.spec, case, n=14)


def test_layered_reference_reads_counter_weights(tmp_path):
    """Counter-based weights, read a layer at a time as the hooks ask for them: nothing on disk."""
    model = make_validation_model(tmp_path, "qwen3")
    source = open_model(model)
    checkpoint = CounterCheckpoint(source.spec, seed=4)
    _, whole, layered = _pair(model, checkpoint)
    _assert_same(whole, layered, source.spec, "qwen3")


def test_layered_reference_refuses_what_it_does_not_build(tmp_path):
    model = make_validation_model(tmp_path, "tts_code_predictor")
    with pytest.raises(MkportError, match="layer-at-a-time reference"):
        Reference(open_model(model), Checkpoint.open(model.rsplit(":", 1)[0]), layered=True)


def test_kernel_diff_runs_the_layered_reference_only_for_large_models(tmp_path):
    """The bundled specs keep the whole-model reference but for the MoE ones past its size; a 40-layer Mistral-7B
    (17.7 GB) gets the layered one; a model past the size whose family has no layered reference keeps the whole one."""
    for name in bundled_names():  # a checkpoint holds every expert: 61, 29 and 93 GB
        layered = name in ("qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "mixtral-8x7b")
        assert reference_layered(open_model(name)) == layered, name
    cfg = json.loads((Path(weights.__file__).parents[1] / "kernel/model_specs/mistral-7b-v0.3.json").read_text())
    (tmp_path / "big").mkdir()
    (tmp_path / "big/config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=40)))
    big = open_model(str(tmp_path / "big"))
    assert checkpoint_bytes(big.spec) > LAYERED_REFERENCE_BYTES and reference_layered(big)
    talker = open_model("qwen3-tts-1.7b-talker")
    assert not can_layer(talker)


def _cast_forward(base: torch.nn.Module, hidden: int, seed: int = 5) -> torch.Tensor:
    torch.manual_seed(seed)
    embeds = torch.randn(1, 7, hidden, dtype=torch.bfloat16)
    return base(inputs_embeds=embeds, position_ids=torch.arange(7)[None]).last_hidden_state


@pytest.mark.parametrize("case", ("llama", "phi3", "qwen3_moe", "qwen3_5_moe"))
def test_bf16_reference_is_the_float32_one_cast(tmp_path, case):
    """Reference(dtype=bf16), bench's transformers baseline: the float32 model cast to bf16, parameter for parameter
    and buffer for buffer, and its forward bit for bit. Its modules are built empty (as the layered reference's) and
    each layer filled in bf16 from the checkpoint, one at a time, so no float32 copy of the model is made (a 30B
    mixture of experts would need 122 GB for one); the layers are read one by one."""
    model = (make_moe_model(tmp_path, case, seed=2) if case in ("qwen3_moe", "qwen3_5_moe")
             else make_validation_model(tmp_path, case, seed=2))
    source, checkpoint = open_model(model), Checkpoint.open(model.rsplit(":", 1)[0])
    cast = Reference(source, checkpoint).base.to(torch.bfloat16)
    reads = []
    read = checkpoint.read
    checkpoint.read = lambda wanted: (reads.append(len(wanted)), read(wanted))[1]
    bf16 = Reference(source, checkpoint, dtype=torch.bfloat16)
    assert len(reads) == 1 + source.spec.num_layers  # the embeddings, norm and head, then each layer
    a, b = cast.state_dict(), bf16.base.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert all(p.dtype == torch.bfloat16 and not p.is_meta for p in bf16.base.parameters())
    assert torch.equal(_cast_forward(cast, source.spec.hidden_size), _cast_forward(bf16.base, source.spec.hidden_size))


@pytest.mark.parametrize("case", ("glm4", "exaone4"))
def test_layered_reference_of_the_later_families(family_model_path, case):
    """GLM-4's sandwich norms under their own names and fused gate_up, EXAONE 4's post-norm layers: their full-size
    diffs (9B and 32B) run the reference this way."""
    source, whole, layered = _pair(family_model_path(case))
    _assert_same(whole, layered, source.spec, case)
