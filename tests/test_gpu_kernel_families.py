"""The megakernel of the families the plain-torch path ran first (issue 28), on the GPU: tiny random models (the CPU
tests' configs, whose soft-caps, windows and RoPE scalings bite on random weights; OLMo 2/3's post-norm layers with
q/k norms over the whole projection; Phi-3's head_dim 96; Phi-4-mini's RoPE on 3/4 of a head) pass `mkport diff`
against transformers' own classes in float32 (longrope and dynamic RoPE, whose frequencies follow each forward's length,
against the reference prefilled and stepped as the decoder runs: kernel_diff), a fault injected into one layer's
weights is found at exactly that layer and op, and each feature switched off or mis-set in the kernel (rendered from a mis-set spec; the reference is built from
the true config) fails at the layer and op where it bites. Phi-3's recompute of the cache at its longrope switch: the
Decoder's greedy tokens equal Phi3ForCausalLM.generate's across it."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from mkport.check.diff import kernel_diff
from mkport.kernel.spec import open_model
from mkport.runtime.weights import Checkpoint, write_random_weights
from test_gemma import CONFIGS as GEMMAS
from test_gpu_diff import prebuild
from test_olmo2 import CONFIGS as OLMOS
from test_rope_scaling import LONG, SHAPES, SHORT, _config as rope_config
from tolerances import HIDDEN_TOL, MARGIN_TOL, rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# yarn factor 4, longrope and dynamic NTK (factor 2) from an original length of 16: 24 positions reach past it (a
# prefill of 16 rows, then 8 steps, each past it). Gemma 2's soft-caps of 2 and 5 bite on random weights, its window
# of 6 and gemma3's under 24 positions.
# OLMo 3's window of 6 under 24 positions too, and linear scaling 8 on its full layer (layer 3) only.
LENGTH_DEPENDENT = {f"{variant}-{shape}": rope_config(shape, variant) for variant in ("longrope", "dynamic")
                    for shape in ("llama", "qwen2")}
# (the later cases last: a case's random weights are seeded by its place). Phi-3/3.5-mini's head_dim 96 (2 heads on
# hidden 192), its RoPE unscaled: a lane's second rotate-half pair is padding in half the lanes (attention.cuh).
# Phi-4-mini's partial rotary (head_dim 128, RoPE on the first 96: element i pairs with i +- 48, another lane's and
# slot's, rope.cuh) with longrope's 48 factors from 16 (its prompt on torch_model's prefill), and unscaled (its prompt
# on the fused prefill, which rotates as the decode step does).
CONFIGS = {"yarn-llama": rope_config("llama", "yarn"), "yarn-qwen2": rope_config("qwen2", "yarn"), **GEMMAS, **OLMOS,
           **LENGTH_DEPENDENT, "hd96-phi3": dict(SHAPES["phi3"], max_position_embeddings=64, rope_scaling=None),
           "longrope-phi4": rope_config("phi4", "longrope"),
           "phi4": dict(SHAPES["phi4"], max_position_embeddings=64, rope_scaling=None),
           # Qwen2.5's yarn block: max_position_embeddings left at the original 16, so the 24 positions run past it
           # (ModelSpec.max_context: 16 x 4)
           "yarn-qwen2-past-max-position": dict(rope_config("qwen2", "yarn"), max_position_embeddings=16)}
LAYER, OPS = 1, ("attn_norm", "q", "k", "attn", "attn_residual", "mlp_residual")
# (case, op) of each fault: OLMo 2/3 have no input norm (no attn_norm to inject at, none traced)
FAULTS = [(case, op) for case in CONFIGS for op in OPS if not (case in OLMOS and op == "attn_norm")]


def write_models(root, configs: dict) -> dict[str, str]:
    """case -> folder of each config's tiny model, its random weights seeded by its place; their trace builds made
    side by side."""
    out = {}
    for seed, (case, config) in enumerate(configs.items()):
        folder = root / case
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        write_random_weights(open_model(str(folder)).spec, folder, seed=seed)
        out[case] = str(folder)
    prebuild(out.values())
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return write_models(tmp_path_factory.mktemp("kernel_families"), CONFIGS)


def _diff(models, case: str, spec_changes: dict | None = None, **kwargs):
    source = open_model(models[case])
    if spec_changes:
        source = dataclasses.replace(source, spec=dataclasses.replace(source.spec, **spec_changes))
    return kernel_diff(source, Checkpoint.open(models[case]), prompt_len=16, steps=8, seed=0, **kwargs)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_diff_passes_and_tokens_agree(models, case):
    result = _diff(models, case)
    assert result.report.passed, result.report.verdict()
    # a near tie may part (gemma2's final cap of 5 squeezes a vocabulary of 512 into [-5, 5])
    assert result.token_agreement >= 6, f"greedy tokens agree on {result.token_agreement}/8"


@pytest.mark.parametrize("case,op", FAULTS)
def test_injected_fault_is_found_at_its_layer_and_op(models, case, op):
    result = _diff(models, case, inject_at=(LAYER, op))
    assert not result.report.passed and result.caught_injection, result.report.verdict()


# name -> case, the spec fields replaced in the kernel (the sandwich norms are not ablated here: a spec without them
# loads no post-norm weights, which the reference's weight mapping refuses; test_a_fault_in_a_post_norm_... moves them) ("rope": fields of the spec's own RopeSpec), the first traced
# state that must fail
ABLATIONS = {
    "yarn-without-attention-factor": ("yarn-llama", {"rope": {"attention_factor": 1.0}}, "layers.0.q"),
    "yarn-as-linear": ("yarn-qwen2", {"rope": {"variant": "linear"}}, "layers.0.q"),  # no ramp: every frequency / 4
    # the short factors' table past the switch too: the prefill (16 rows, length 16) is right, the first step is not
    "longrope-short-only": ("longrope-llama", {"rope": {"long_factor": tuple(SHORT)}}, "layers.0.q"),
    "longrope-without-attention-factor": ("longrope-qwen2", {"rope": {"attention_factor": 1.0}}, "layers.0.q"),
    "gemma-plain-norm-weights": ("gemma", {"norm_weight_offset": 0.0}, "layers.0.attn_norm"),  # w, not 1 + w
    "gemma-unscaled-embedding": ("gemma", {"embedding_multiplier": 1.0}, "embed"),
    "gemma-silu": ("gemma", {"mlp_activation": "silu"}, "layers.0.mlp_residual"),
    "gemma2-no-attn-cap": ("gemma2", {"attn_logit_softcap": 0.0}, "layers.0.attn"),
    "gemma2-no-final-cap": ("gemma2", {"final_logit_softcap": 0.0}, "logits"),
    "gemma2-head-dim-scale": ("gemma2", {"attention_multiplier": 0.0}, "layers.0.attn"),
    "gemma2-window+1": ("gemma2", {"attention_windows": (7, 0, 7, 0)}, "layers.0.attn"),
    "gemma2-window-1": ("gemma2", {"attention_windows": (5, 0, 5, 0)}, "layers.0.attn"),
    "gemma3-one-rope": ("gemma3", {"local_rope": None}, "layers.0.q"),  # the global theta on the sliding layers
    "olmo3-window+1": ("olmo3", {"attention_windows": (7, 7, 7, 0)}, "layers.0.attn"),
    "olmo3-window-1": ("olmo3", {"attention_windows": (5, 5, 5, 0)}, "layers.0.attn"),
    "olmo3-one-rope": ("olmo3", {"local_rope": None}, "layers.0.q"),  # the full layer's scaled RoPE on the sliding ones
    # all 128 dimensions of a head rotated (i with i + 64), with the 64 factors that reads, not the first 96 only
    "phi4-whole-head-rope": ("longrope-phi4", {"rotary_dim": 0, "rope": {"short_factor": tuple(SHORT * 2),
                                                                         "long_factor": tuple(LONG * 2)}}, "layers.0.q"),
}


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_ablation_fails_where_the_feature_bites(models, name):
    case, changes, first = ABLATIONS[name]
    rope = open_model(models[case]).spec.rope
    if "rope" in changes:
        changes = {**changes, "rope": dataclasses.replace(rope, **changes["rope"])}
    faulty = _diff(models, case, changes)
    assert not faulty.report.passed and faulty.report.first_failure.name == first, faulty.report.verdict()


def test_dynamic_table_never_raised_fails_at_q(models, monkeypatch):
    """The decoder's dynamic NTK table with every row the unraised base's (as if the kernel ignored the length): the
    prefill is right (16 rows), the steps past the original length are not, from layer 0's q."""
    import mkport.runtime.decoder

    real = mkport.runtime.decoder.dynamic_rope_table

    def unraised(spec, max_seq):
        table = real(spec, max_seq)
        return np.repeat(table[:1], len(table), axis=0)

    monkeypatch.setattr(mkport.runtime.decoder, "dynamic_rope_table", unraised)
    faulty = _diff(models, "dynamic-llama")
    assert not faulty.report.passed and faulty.report.first_failure.name == "layers.0.q", faulty.report.verdict()


@pytest.mark.parametrize("case", list(LENGTH_DEPENDENT))
def test_a_batch_switches_each_sequence_at_its_own_length(models, case):
    """Prompts of 14 to 17 rows, 4 steps: at the first step sequences 0 and 1 (positions 14, 15) are within the original
    length 16 and sequences 2 and 3 (16, 17) past it, and sequence 0 crosses it at its third step: each sequence's
    frequencies follow its own position, against its own stepped reference."""
    result = kernel_diff(open_model(models[case]), Checkpoint.open(models[case]), prompt_len=14, steps=4, seed=0,
                         batch=4)
    assert result.report.passed, result.report.verdict()


@pytest.mark.parametrize("case", list(CONFIGS))
def test_batch_of_four_passes(models, case):
    """Four sequences at their own positions (prompts of 16 to 19 rows), each against its own reference run."""
    result = kernel_diff(open_model(models[case]), Checkpoint.open(models[case]), prompt_len=16, steps=4, seed=0,
                         batch=4)
    assert result.report.passed, result.report.verdict()


@pytest.mark.parametrize("case", ["gemma2", "olmo2"])
@pytest.mark.parametrize("field,op", [("post_attn_norm", "attn_residual"), ("post_mlp_norm", "mlp_residual")])
def test_a_fault_in_a_post_norm_is_found_at_its_residual(models, monkeypatch, case, field, op):
    """Layer 1's post-attention or post-feedforward norm weights (kernel copy only) moved by 0.5: found there (the
    phase after the sublayer makes the norm and traces the residual it makes)."""
    import mkport.runtime.weights

    real = mkport.runtime.weights.load_weights

    def faulty(spec, checkpoint):
        w = real(spec, checkpoint)
        layers = list(w.layers)
        layers[LAYER] = dataclasses.replace(layers[LAYER], **{field: getattr(layers[LAYER], field) + 0.5})
        return dataclasses.replace(w, layers=layers)

    monkeypatch.setattr(mkport.runtime.weights, "load_weights", faulty)
    result = _diff(models, case)
    assert not result.report.passed, result.report.verdict()
    assert result.report.first_failure.name == f"layers.{LAYER}.{op}", result.report.verdict()


@pytest.mark.parametrize("case", list(OLMOS))
@pytest.mark.parametrize("batch", [1, 4])
def test_olmo_per_head_qk_norm_fails_at_q(models, monkeypatch, case, batch):
    """The kernel alone rendered with per-head q/k norms (qk_norm_span "head": each head's own sum of squares over HD,
    and, as that path reads them, the first HD weights of q_norm / k_norm for every head), the prefill and the
    reference as OLMo has them (over the whole projection): the first decode step's layer-0 q fails."""
    import mkport.runtime.decoder

    real = mkport.runtime.decoder.render
    monkeypatch.setattr(mkport.runtime.decoder, "render",
                        lambda spec, plan: real(dataclasses.replace(spec, qk_norm_span="head"), plan))
    result = kernel_diff(open_model(models[case]), Checkpoint.open(models[case]), prompt_len=16, steps=4, seed=0,
                         batch=batch)
    assert not result.report.passed and result.report.first_failure.name == "layers.0.q", result.report.verdict()


# -- Phi-3's recompute of the cache at its longrope switch (runtime.rope_switch) -------------------------------------

# tiny phi3 (head_dim 96) and phi4 (partial rotary) longrope models, weights seeded as test_rope_scaling.py's, and
# prompts of 8 and 11 tokens: the switch (the step at position 16) is their 10th and 7th step.
PHI3_SWITCH = {"phi3": (6, [[444, 427, 236, 287, 235, 99, 300, 280],
                            [183, 321, 369, 333, 259, 384, 504, 253, 461, 262, 52]]),
               "phi4": (7, [[332, 12, 376, 315, 410, 460, 455, 215],
                            [389, 337, 133, 377, 42, 86, 436, 313, 312, 78, 343]])}
SWITCH_STEPS = 24
# without the recompute the logits past the switch move by 0.3-0.95 (rel L2; TorchDecoder on the CPU, these models
# and prompts), 30x the kernel's distance from float32 that HIDDEN_TOL allows
ABLATED_MIN = 0.1


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory) -> dict[str, str]:
    out = {}
    for shape, (seed, _) in PHI3_SWITCH.items():
        folder = tmp_path_factory.mktemp(f"{shape}-longrope")
        (folder / "config.json").write_text(json.dumps(rope_config(shape, "longrope")))
        write_random_weights(open_model(str(folder)).spec, folder, seed=seed)
        out[shape] = str(folder)
    return out


def _reference_logits(folder: str, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """TorchDecoder's (float32, on the GPU) greedy tokens and each step's logits [steps, vocab] (on the CPU): the
    oracle here, as the H200's transformers 5.17 Phi3ForCausalLM.generate drops its cache at the switch and then feeds
    only the last token (5.24 feeds every input again); test_torch_families ties TorchDecoder's greedy tokens across the
    switch to a generate that recomputes."""
    from mkport.runtime.torch_decoder import TorchDecoder
    from mkport.runtime.weights import load_weights

    spec = open_model(folder).spec
    ref = TorchDecoder(spec, load_weights(spec, Checkpoint.open(folder)), max_seq=len(prompt) + SWITCH_STEPS,
                       device="cuda")
    ref.prefill(tokens=prompt[:-1])
    token, tokens, logits = prompt[-1], [], []
    for _ in range(SWITCH_STEPS):
        ref.step(token=token)
        logits.append(ref.logits.float().cpu().clone())
        token = int(logits[-1].argmax())
        tokens.append(token)
    return tokens, torch.stack(logits)


def _kernel_logits(folder: str, prompts: list[list[int]], fed: list[list[int]]) -> list[torch.Tensor]:
    """The megakernel's logits [steps, vocab] at each step, fed each prompt and then generate's tokens `fed` (teacher
    forced: a near tie cannot send the sequences apart): the first prompt on a one-sequence Decoder, then both on the
    slots of a batch of two (the switch at a different step each)."""
    from mkport.runtime.decoder import Decoder
    from mkport.runtime.weights import load_weights

    spec = open_model(folder).spec
    weights = load_weights(spec, Checkpoint.open(folder))
    max_seq = max(map(len, prompts)) + SWITCH_STEPS
    inputs = [[prompt[-1]] + tokens[:-1] for prompt, tokens in zip(prompts, fed)]
    one = Decoder(spec, weights, max_seq=max_seq)
    one.prefill(tokens=prompts[0][:-1])
    alone = []
    for token in inputs[0]:
        one.step(token=token)
        alone.append(one.logits.clone())
    batch = Decoder(spec, weights, max_seq=max_seq, batch=len(prompts))
    for slot, prompt in enumerate(prompts):
        batch.prefill_slot(slot, tokens=prompt[:-1])
    rows = []
    for step in range(SWITCH_STEPS):
        batch.step_batch(tokens=[tokens[step] for tokens in inputs])
        rows.append(batch.logits.view(len(prompts), -1).clone())
    return [torch.stack(alone).cpu()] + list(torch.stack(rows).transpose(0, 1).cpu())


@pytest.mark.parametrize("shape", list(PHI3_SWITCH))
def test_phi3_logits_are_the_reference_across_the_switch(phi3_longrope, monkeypatch, shape):
    """Phi3ForCausalLM.generate drops its cache once at the longrope switch and recomputes every key with the long
    factors; the megakernel's Decoder does the same (one sequence, and each slot of a batch at its own step). Fed
    the reference's greedy tokens (TorchDecoder in float32, which recomputes as generate does), its logits are the
    reference's within HIDDEN_TOL at each of 24 steps across the switch, and its argmax is the reference's token
    wherever the reference's top two are MARGIN_TOL apart. Without the recompute they move by more than ABLATED_MIN
    past the switch."""
    from mkport.runtime import rope_switch

    folder, prompts = phi3_longrope[shape], PHI3_SWITCH[shape][1]
    theirs = [_reference_logits(folder, prompt) for prompt in prompts]
    fed = [tokens for tokens, _ in theirs]
    expected = [theirs[0][1]] + [logits for _, logits in theirs]  # the one sequence's (the first prompt), the batch's
    for got, want, tokens in zip(_kernel_logits(folder, prompts, fed), expected, [fed[0]] + fed):
        errors = [rel(g, w) for g, w in zip(got, want)]
        assert max(errors) < HIDDEN_TOL, errors
        top2 = want.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) >= MARGIN_TOL
        assert torch.equal(got.argmax(-1)[clear], torch.tensor(tokens)[clear])
    monkeypatch.setattr(rope_switch, "recomputes", lambda *args: False)
    for got, want in zip(_kernel_logits(folder, prompts, fed), expected):
        assert max(rel(g, w) for g, w in zip(got, want)) > ABLATED_MIN
