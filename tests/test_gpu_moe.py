"""Mixture of experts on the megakernel (moe.cuh), on the GPU: tiny random models of the six families (conftest's
moe_config: qwen3_moe with a dense layer among sparse ones, qwen2_moe's shared expert and sparse step, olmoe's q/k norm
over the projection, mixtral's top-2, granitemoe's multipliers, qwen3_5_moe's Gated DeltaNet layers beside its experts) pass `mkport diff` against transformers' own classes in float32 with the
kernel applying the reference's experts and its own router compared as flips; a fault in a sparse layer's experts
shows at that layer's expert block, one in attention at its op; the routing's family rule, switched in the kernel
alone, fails at the expert weights; a fast build's steps give the same bits twice. A batch (moe_batch.cuh, the union of
its sequences' experts): each sequence matches it decoded alone (tiny models with 60 experts, and bundled specs shrunk
to 2 layers), and a sequence's bits do not change when the other sequences' prompts do."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import MOE_CASES
from mkport.kernel.interface import Tap
from mkport.kernel.spec import open_model
from mkport.runtime.decoder import Decoder
from mkport.runtime.weights import Checkpoint, load_weights
from test_gpu_diff import prebuild
from test_gpu_kernel_families import _diff

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# a sparse layer of each tiny model (qwen3_5_moe's layer 2: its full-attention layer, whose q a fault can perturb)
SPARSE = {"qwen3_moe": 2, "qwen2_moe": 3, "olmoe": 1, "mixtral": 1, "granitemoe": 1, "qwen3_5_moe": 2}


@pytest.fixture(scope="module")
def models(moe_models) -> dict[str, str]:
    prebuild(moe_models.values())
    return moe_models


@pytest.mark.parametrize("case", MOE_CASES)
def test_diff_passes_on_the_reference_experts(models, case):
    result = _diff(models, case)
    assert result.forced_routing and result.report.passed, result.report.verdict()
    names = {r.name for r in result.report.rows}
    layer = SPARSE[case]
    assert {Tap.layer(layer, op) for op in Tap.MOE_LAYER} <= names  # every expert tap was compared
    assert result.token_agreement >= 6, f"greedy tokens agree on {result.token_agreement}/8"


@pytest.mark.parametrize("case,op", [(c, op) for c in MOE_CASES for op in ("q", "mlp_residual")])
def test_fault_is_found_at_its_layer(models, case, op):
    layer = SPARSE[case]
    result = _diff(models, case, inject_at=(layer, op))
    assert not result.report.passed and result.caught_injection, result.report.verdict()
    if op == "mlp_residual":
        assert result.report.first_failure.name == Tap.layer(layer, Tap.MOE)


@pytest.mark.parametrize("op,first", [("gates", "gates"), ("mlp_residual", "moe")])
def test_a_fault_in_a_qwen3_5_moe_linear_layer_is_found_there(models, op, first):
    """Qwen3.5's mixture of experts: layer 1 is Gated DeltaNet and experts; its gates, and its shared expert's down."""
    result = _diff(models, "qwen3_5_moe", inject_at=(1, op))
    assert result.caught_injection and result.report.first_failure.name == Tap.layer(1, first), result.report.verdict()


def test_a_dense_layer_among_sparse_ones_keeps_its_mlp(models):
    result = _diff(models, "qwen3_moe", inject_at=(1, "mlp_residual"))  # layer 1: mlp_only_layers
    assert result.caught_injection and result.report.first_failure.name == "layers.1.mlp_residual"


@pytest.mark.parametrize("case", ["qwen3_moe", "olmoe"])
def test_the_wrong_renormalisation_fails_at_the_expert_weights(models, case):
    """qwen3_moe renormalises its top-k weights, olmoe does not: the kernel built with the other rule fails there."""
    spec = open_model(models[case]).spec
    moe = dataclasses.replace(spec.moe, norm_topk_prob=not spec.moe.norm_topk_prob)
    result = _diff(models, case, {"moe": moe})
    first = result.report.first_failure
    assert first is not None and first.name == Tap.layer(min(spec.moe.sparse_layers), Tap.EXPERT_WEIGHTS), \
        result.report.verdict()


@pytest.mark.parametrize("case", ["qwen2_moe", "mixtral"])
def test_steps_give_the_same_bits_twice(models, case):
    source = open_model(models[case])
    dec = Decoder(source.spec, load_weights(source.spec, Checkpoint.open(models[case])), max_seq=64)
    runs = []
    for _ in range(2):
        dec.reset()
        dec.prefill(torch.arange(10) % source.spec.vocab_size)
        steps = []
        for t in range(12):
            dec.step(int(t * 7 % source.spec.vocab_size))
            steps.append(dec.logits.clone())
        runs.append(torch.stack(steps))
    assert torch.equal(runs[0], runs[1])
    assert torch.isfinite(runs[0]).all()


# -- a batch: the union of its sequences' experts (moe_batch.cuh) -----------------------------------------------------

def _tiny_many_experts(tmp_path_factory, case: str, experts: int, top_k: int) -> str:
    """A tiny random model of `case` with many experts: 60 span two warps of the union's prefix sum."""
    from conftest import moe_config
    from mkport.runtime.weights import write_random_weights
    from mkport.kernel.spec import load_spec
    import json

    folder = tmp_path_factory.mktemp(f"{case}-{experts}")
    cfg = moe_config(case)
    cfg.update({"num_local_experts" if case == "mixtral" else "num_experts": experts, "num_experts_per_tok": top_k})
    (folder / "config.json").write_text(json.dumps(cfg))
    write_random_weights(load_spec(str(folder)), folder, seed=4)
    return str(folder)


def _shrunk_bundled(name: str, layers: int):
    """A bundled MoE spec with its first `layers` layers, on counter-based random weights made on the GPU."""
    from mkport.kernel.spec import spec_from_config
    from mkport.runtime.weights import CounterCheckpoint

    cfg = dict(open_model(name).config, num_hidden_layers=layers)
    spec = spec_from_config(cfg, f"{name}-{layers}l")
    return spec, load_weights(spec, CounterCheckpoint(spec, 0, "cuda"))


def _batch_and_alone(spec, weights, batch: int, seed: int = 3):
    """Each sequence of a trace build's batch against the same sequence decoded alone (test_gpu_batch's plan: own
    prompts and lengths, greedy and sampled, late starts and early stops). A sequence may part from its alone run only
    at a router flip (a layer's experts differ: the batch's tensor-core matvecs move a router logit by ~1e-5 relative,
    enough where two experts nearly tie) or a near tie of its tokens; before that its hidden states are within
    HIDDEN_TOL and its tokens equal. Returns (partings, flips)."""
    from test_gpu_batch import HIDDEN_TOL, STEPS, plan_for, rel

    spec_experts = [Tap.layer(i, Tap.EXPERTS) for i in spec.moe.sparse_layers]
    alone = Decoder(spec, weights, max_seq=256, trace=True)
    batched = Decoder(spec, weights, max_seq=256, batch=batch, trace=True)
    gen = torch.Generator().manual_seed(seed)
    seqs = plan_for(batch)
    prompts = [torch.randint(0, spec.vocab_size, (s["prompt"],), generator=gen) for s in seqs]
    got = [([], [], []) for _ in range(batch)]  # tokens, hidden, experts a step
    batched.reset()
    for b in range(batch):
        batched.prefill_slot(b, tokens=prompts[b][:-1])
    last = [int(p[-1]) for p in prompts]
    for step in range(STEPS):
        active = [seqs[b]["start"] <= step < seqs[b]["stop"] for b in range(batch)]
        tokens = [last[b] if step == seqs[b]["start"] else None for b in range(batch)]
        tok = batched.step_batch(tokens=tokens, sampling=[s["sampling"] for s in seqs], active=active).clone()
        hidden = batched.hidden.view(batch, -1).clone()
        for b in range(batch):
            if active[b]:
                taps = batched.trace_taps(b)
                got[b][0].append(int(tok[b]))
                got[b][1].append(hidden[b])
                got[b][2].append([taps[n] for n in spec_experts])
    partings, flips = 0, 0
    for b in range(batch):
        alone.reset()
        alone.prefill(prompts[b][:-1])
        tok = alone.step(int(prompts[b][-1]), sampling=seqs[b]["sampling"])
        for i in range(seqs[b]["stop"] - seqs[b]["start"]):
            taps = alone.trace_taps()
            experts = [taps[n] for n in spec_experts]
            if any(not torch.equal(x, y) for x, y in zip(got[b][2][i], experts)):
                flips += 1  # a router flip: the two runs apply other experts from here on
                partings += 1
                break
            err = rel(got[b][1][i], alone.hidden)
            assert err < HIDDEN_TOL, f"sequence {b} step {i}: hidden rel L2 {err:.2e} against alone, same experts"
            if got[b][0][i] != int(tok[0]):  # a near tie of the tokens
                partings += 1
                break
            tok = alone.step(sampling=seqs[b]["sampling"])
    print(f"{spec.name} batch {batch}: {partings} sequences parted ({flips} at a router flip)")
    return partings, flips


@pytest.mark.parametrize("case,experts,top_k,batch", [("qwen2_moe", 60, 4, 8), ("qwen3_moe", 60, 8, 4),
                                                      ("mixtral", 4, 2, 2), ("qwen3_5_moe", 64, 8, 4)])
def test_each_sequence_of_a_moe_batch_matches_it_alone(tmp_path_factory, case, experts, top_k, batch):
    """Tiny random models: 60 experts (qwen2_moe with its shared expert and dense layers between sparse ones; qwen3_moe
    with a dense layer and renormalised weights), mixtral with 4 experts at batch 2 (batch * experts = 8, fewer than
    the 16 per-warp counts of the prefix sum), and Qwen3.5's hybrid with 64 experts (a linear-attention state a
    sequence beside the union of experts)."""
    folder = _tiny_many_experts(tmp_path_factory, case, experts, top_k)
    spec = open_model(folder).spec
    weights = load_weights(spec, Checkpoint.open(folder))
    partings, flips = _batch_and_alone(spec, weights, batch)
    assert partings <= max(1, batch // 4), f"{partings} of {batch} sequences parted from their alone runs"


@pytest.mark.parametrize("name,layers,batch", [("qwen3-30b-a3b", 2, 8), ("qwen1.5-moe-a2.7b", 2, 4)])
def test_a_bundled_moe_batch_matches_each_sequence_alone(name, layers, batch):
    """A bundled spec at full width, shrunk in layers: 128 experts of 768 (qwen3-30b-a3b), 60 of 1408 with the shared
    expert of 5632 (qwen1.5-moe-a2.7b)."""
    spec, weights = _shrunk_bundled(name, layers)
    partings, flips = _batch_and_alone(spec, weights, batch)
    assert partings <= max(1, batch // 4), f"{partings} of {batch} sequences parted from their alone runs"


@pytest.mark.parametrize("case,experts,top_k", [("qwen2_moe", 60, 4), ("olmoe", 8, 2)])
def test_a_sequences_bits_do_not_depend_on_the_others(tmp_path_factory, case, experts, top_k):
    """Sequence 0 of a batch of 4, its prompt the same, the other three's prompts changed (other tokens, the same
    lengths, so other experts in the union): its hidden states, logits and tokens are the same bits, step by step
    (moe_batch.cuh: a sequence's sums hold its own experts' terms in the same order whatever the union)."""
    folder = _tiny_many_experts(tmp_path_factory, case, experts, top_k)
    spec = open_model(folder).spec
    weights = load_weights(spec, Checkpoint.open(folder))
    dec = Decoder(spec, weights, max_seq=128, batch=4)
    gen = torch.Generator().manual_seed(8)
    mine = torch.randint(0, spec.vocab_size, (11,), generator=gen)
    runs = []
    for others in range(2):
        prompts = [mine] + [torch.randint(0, spec.vocab_size, (11,), generator=gen) for _ in range(3)]
        dec.reset()
        for b in range(4):
            dec.prefill_slot(b, tokens=prompts[b][:-1])
        steps = []
        tok = dec.step_batch(tokens=[int(p[-1]) for p in prompts])
        for _ in range(12):
            steps.append((int(tok[0]), dec.hidden.view(4, -1)[0].clone(), dec.logits.view(4, -1)[0].clone()))
            tok = dec.step_batch()
        runs.append(steps)
    for i, (a, b) in enumerate(zip(*runs)):
        assert a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]), f"step {i}: sequence 0 changed"


def test_a_batch_counts_the_experts_it_read(tmp_path_factory):
    """Decoder.experts_read (bench's floor of a batch's bytes): each sparse layer's union, added up over steps, is
    between top_k and min(experts, batch * top_k) a step; a dense layer's stays 0."""
    folder = _tiny_many_experts(tmp_path_factory, "qwen2_moe", 60, 4)
    spec = open_model(folder).spec
    dec = Decoder(spec, load_weights(spec, Checkpoint.open(folder)), max_seq=64, batch=8)
    for b in range(8):
        dec.prefill_slot(b, tokens=torch.arange(3 + b) * (b + 1) % spec.vocab_size)
    dec.step_batch(tokens=list(range(8)))
    dec.experts_read.zero_()
    for _ in range(5):
        dec.step_batch()
    counts = dec.experts_read.cpu().tolist()
    k = spec.moe.top_k
    for i in range(spec.num_layers):
        if spec.sparse(i):
            assert 5 * k <= counts[i] <= 5 * min(spec.moe.num_experts, 8 * k), counts
        else:
            assert counts[i] == 0, counts
