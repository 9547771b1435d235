"""`mkport diff` on the GPU for every bundled spec and for configs outside the bundle, with every kernel design:
the megakernel passes against the float32 reference, and a fault injected into one layer's weights (kernel copy
only) is reported at exactly that layer and op."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import ENVELOPE_CONFIGS, VALIDATION_CASES, make_validation_model

from mkport.kernel.build import build_libraries
from mkport.kernel.cache import BUILDS, cache_root
from mkport.check.diff import injectable_ops, kernel_diff
from mkport.runtime.decoder import current_device_target
from mkport.kernel.render import render
from mkport.kernel.spec import bundled_names, load_spec, open_model
from mkport.kernel.launch_plan import KERNELS, plan_launch
from mkport.runtime.weights import Checkpoint, random_weights, random_weights_folder, write_random_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def prebuild(models) -> None:
    """The trace builds of `models` with every kernel design, nvcc runs side by side (each diff would build its own)."""
    target = current_device_target()
    specs = [load_spec(m) for m in models]
    jobs = [(render(spec, plan_launch(spec, target, kernel)).write(cache_root() / BUILDS), "trace")
            for spec in specs for kernel in KERNELS]
    build_libraries(jobs, target.arch, os.cpu_count() or 4)


def diff_and_inject(model: str, checkpoint: Checkpoint, op_index: int, kernel: str) -> None:
    source = open_model(model)
    spec = source.spec
    clean = kernel_diff(source, checkpoint, prompt_len=16, steps=8, seed=0, kernel=kernel)
    assert clean.report.passed, clean.report.verdict()
    layer = spec.num_layers // 2
    ops = injectable_ops(spec, layer)  # LAYER_OPS, or a hybrid's linear layer's
    where = (layer, ops[op_index % len(ops)])
    faulty = kernel_diff(source, checkpoint, prompt_len=16, steps=8, seed=0, inject_at=where, kernel=kernel)
    assert not faulty.report.passed
    assert faulty.caught_injection, faulty.report.verdict()


@pytest.fixture(scope="module")
def bundled_built():
    prebuild(bundled_names())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("index,name", list(enumerate(bundled_names())))
def test_diff_passes_and_finds_the_injected_fault(bundled_built, index, name, kernel):
    # counter-based weights past COUNTER_WEIGHTS_BYTES (three MoE specs), as `mkport diff --random-weights` has them
    diff_and_inject(name, random_weights(load_spec(name), seed=0), index, kernel)


# mrope-contig is compiled only (test_generate_check): transformers' qwen3 reference ignores its mrope_section
OTHER_CONFIGS = (*VALIDATION_CASES, *(name for name in ENVELOPE_CONFIGS if name != "mrope-contig"))


@pytest.fixture(scope="module")
def other_models(tmp_path_factory) -> dict[str, str]:
    """Model folders of configs no bundled spec is: the small validation cases (qwen2 bias, llama3 and linear rope,
    Qwen3-VL's interleaved MRoPE, a TTS talker and predictor) and the real-sized envelope shapes (14 and 15 heads,
    head_dim 256 at GQA 16, contiguous MRoPE), random weights written as safetensors; their builds made up front."""
    root = tmp_path_factory.mktemp("other_configs")
    models = {case: make_validation_model(root, case, seed=i) for i, case in enumerate(VALIDATION_CASES)}
    for name in OTHER_CONFIGS[len(VALIDATION_CASES):]:
        config = ENVELOPE_CONFIGS[name]
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        write_random_weights(load_spec(str(folder)), folder, seed=0)
        models[name] = str(folder)
    prebuild(models.values())
    return models


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("index,case", list(enumerate(OTHER_CONFIGS)))
def test_configs_outside_the_bundle_pass_and_find_the_fault(other_models, index, case, kernel):
    model = other_models[case]
    folder = model.rsplit(":", 1)[0] if model.endswith((":talker", ":code_predictor")) else model
    diff_and_inject(model, Checkpoint.open(folder), index, kernel)


@pytest.mark.parametrize("name,batch", [("qwen3-tts-0.6b-talker", 4), ("qwen3-tts-1.7b-talker", 8), ("qwen3-0.6b", 16),
                                        ("qwen3-tts-1.7b-talker", 24)])
def test_batched_diff_passes_for_every_sequence_and_finds_the_fault(name, batch):
    """Each of `batch` sequences at its own position against its own reference run; a fault shows at its layer."""
    source = open_model(name)
    spec = source.spec
    checkpoint = Checkpoint.open(random_weights_folder(spec, seed=0))
    clean = kernel_diff(source, checkpoint, prompt_len=16, steps=4, seed=0, batch=batch)
    assert clean.report.passed, clean.report.verdict()
    assert clean.token_agreement >= 4 * batch - 1, f"greedy tokens agree on {clean.token_agreement}/{4 * batch}"
    where = (spec.num_layers // 2, "attn_residual")
    faulty = kernel_diff(source, checkpoint, prompt_len=16, steps=4, seed=0, inject_at=where, batch=batch)
    assert faulty.caught_injection, faulty.report.verdict()


def test_splits_of_several_tiles(tmp_path_factory):
    """A context where each of a KV head's 32 splits walks two tiles of 128 positions (the next tile's K and V copied
    in while one is computed) and, at context 4480, this step's row lies in its split's second tile (written to the
    cache first, then copied in with the rest): the tiny qwen3 config over a 4470-token prompt and 16 steps."""
    model = make_validation_model(tmp_path_factory.mktemp("long_splits"), "qwen3", seed=0)
    source = open_model(model)
    plan = plan_launch(source.spec, current_device_target())
    assert (plan.attention_splits(4480), plan.attn_tile) == (32, 128)  # 140 positions a split: 128, then 12
    result = kernel_diff(source, Checkpoint.open(model), prompt_len=4470, steps=16, seed=0)
    assert result.report.passed, result.report.verdict()
