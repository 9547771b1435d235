"""Qwen3.5 on the megakernel (linear_attention.cuh, the full layers' output gate and partial RoPE), on the GPU, batch 1:
the tiny random model of the CPU tests (conftest's qwen3_5: layers L L L F L F, two value heads to a q/k head, head_dim
64 with 16 rotated, MRoPE sections) passes `mkport diff` against transformers' own Qwen3.5 classes in float32 at every
tap, the Gated DeltaNet's included; a fault in a linear layer's op or a full layer's q is found at its layer and op; each
feature mis-set in the kernel alone (the reference and the prefill keep the true spec) fails where it bites; a state the
kernel did not read fails at that layer's conv or state read-out; two runs give the same bits; a prompt prefilled
(torch_model's chunked scan) then stepped equals one token prefilled and the rest stepped on the kernel. A batch: each
sequence (its own prompt length, joining at its own step) gives what it gives alone at batch 1, also when a smaller
batch over the first sequences steps them; one state for the whole batch, or a state advanced while its sequence sits a
step out, fails. (The batch tests were written without a GPU at hand: not yet run on one.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_validation_model
from mkport.check.diff import kernel_diff
from mkport.kernel.build import build_library
from mkport.kernel.cache import BUILDS, cache_root
from mkport.kernel.interface import Tap
from mkport.kernel.launch_plan import plan_launch
from mkport.kernel.render import render
from mkport.kernel.spec import load_spec, open_model
from mkport.runtime import prefill, torch_model
from mkport.runtime.backends import first_sequences
from mkport.runtime.decoder import Decoder, current_device_target
from mkport.runtime.weights import Checkpoint, load_weights
from test_gpu_diff import prebuild
from tolerances import rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FULL = 3  # the tiny model's first full-attention layer; 0, 1, 2 and 4 are linear


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = make_validation_model(tmp_path_factory.mktemp("qwen35"), "qwen3_5", seed=3)
    prebuild([path])
    return path


def _diff(model: str, **kwargs):
    return kernel_diff(open_model(model), Checkpoint.open(model), prompt_len=16, steps=8, seed=0, **kwargs)


def test_diff_passes_at_every_tap(model):
    result = _diff(model)
    assert result.report.passed, result.report.verdict()
    names = {r.name for r in result.report.rows}
    for op in Tap.LINEAR_LAYER:
        assert Tap.layer(0, op) in names and Tap.layer(4, op) in names
    for op in Tap.LAYER:
        assert Tap.layer(FULL, op) in names
    assert result.token_agreement >= 6, f"greedy tokens agree on {result.token_agreement}/8"


@pytest.mark.parametrize("layer,op", [(0, "conv"), (1, "gates"), (4, "gated_norm"), (0, "attn_residual"),
                                      (FULL, "q"), (FULL, "k"), (FULL, "attn")])
def test_fault_is_found_at_its_layer_and_op(model, layer, op):
    result = _diff(model, inject_at=(layer, op))
    assert not result.report.passed and result.caught_injection, result.report.verdict()


# the spec fields replaced in the kernel alone (render), and the first traced state that must fail
ABLATIONS = {
    "plain-norm-weights": ({"norm_weight_offset": 0.0}, Tap.layer(0, Tap.ATTN_NORM)),  # w, not 1 + w
    "no-output-gate": ({"attn_output_gate": False}, Tap.layer(FULL, Tap.ATTN)),
    "full-rope": ({"rotary_dim": 0}, Tap.layer(FULL, Tap.Q)),  # all of head_dim rotated, not a quarter
}


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_kernel_ablation_fails_where_it_bites(model, monkeypatch, name):
    import mkport.runtime.decoder

    changes, first = ABLATIONS[name]
    real = mkport.runtime.decoder.render
    monkeypatch.setattr(mkport.runtime.decoder, "render",
                        lambda spec, plan: real(dataclasses.replace(spec, **changes), plan))
    result = _diff(model)
    assert not result.report.passed and result.report.first_failure.name == first, result.report.verdict()


@pytest.mark.parametrize("field,first", [("conv", Tap.CONV), ("recurrent", Tap.STATE_OUT)])
def test_the_prefilled_state_is_what_the_steps_read(model, monkeypatch, field, first):
    """Layer 0's conv or delta-rule state zeroed after the prompt's prefill: the first step fails at that op."""
    real = Decoder.prefill

    def prefill_then_forget(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        getattr(self.linear_state, field)[0].zero_()
        return out

    monkeypatch.setattr(Decoder, "prefill", prefill_then_forget)
    result = _diff(model)
    assert not result.report.passed and result.report.first_failure.name == Tap.layer(0, first), result.report.verdict()


def _decoder(model: str) -> tuple:
    spec = open_model(model).spec
    return spec, Decoder(spec, load_weights(spec, Checkpoint.open(model)), max_seq=64)


def test_steps_give_the_same_bits_twice(model):
    spec, dec = _decoder(model)
    runs = []
    for _ in range(2):
        dec.reset()
        dec.prefill(torch.arange(10) % spec.vocab_size)
        steps = []
        for t in range(12):
            dec.step(int(t * 7 % spec.vocab_size))
            steps.append(torch.cat([dec.logits, dec.linear_state.recurrent.flatten(), dec.linear_state.conv.flatten()]))
        runs.append(torch.stack(steps))
    assert torch.equal(runs[0], runs[1])
    assert torch.isfinite(runs[0]).all()


def test_prefill_then_steps_equals_stepping(model):
    """12 tokens prefilled (the chunked scan) against 1 prefilled and 11 stepped on the kernel, and against 5 then 7
    prefilled (the second part continuing the first's states): the same linear states and KV cache, then the same next
    steps. The states are fp32 but are fed by bf16 projections that cuBLAS (prefill) and the kernel's matvec (steps)
    round differently, so they agree at the steps' tolerance, not the scan's (measured on the H200: 3.1e-4)."""
    spec, one = _decoder(model)
    _, stepped = _decoder(model)
    _, parts = _decoder(model)
    tokens = (torch.arange(20) * 37 + 5) % spec.vocab_size
    one.prefill(tokens[:12])
    parts.prefill(tokens[:5])
    parts.prefill(tokens[5:12])
    stepped.prefill(tokens[:1])
    for t in tokens[1:12]:
        stepped.step(int(t))
    for other in (stepped, parts):
        assert rel(other.linear_state.recurrent, one.linear_state.recurrent) < 5e-3
        assert rel(other.linear_state.conv, one.linear_state.conv) < 5e-3
        assert rel(other.kv.k_layers[FULL][0, :, :12].float(), one.kv.k_layers[FULL][0, :, :12].float()) < 1e-2
    for t in tokens[12:]:
        for dec in (one, stepped, parts):
            dec.step(int(t))
        for other in (stepped, parts):
            assert rel(other.logits, one.logits) < 5e-3 and rel(other.hidden, one.hidden) < 5e-3


def test_a_graphed_prefill_is_the_eager_one(model):
    """The prompt's prefill replayed from a CUDA graph (12 real rows in a bucket of 16: the padding must not move the
    linear states), twice with a reset between (capture's warm-up and each replay start from zero states), against
    eager: the same hidden states, states and next steps; a continuation (start 12) runs eagerly and agrees too."""
    spec = open_model(model).spec
    weights = load_weights(spec, Checkpoint.open(model))
    graphed, eager = (Decoder(spec, weights, max_seq=64, prefill_graphs=g) for g in (True, False))
    tokens = (torch.arange(20) * 37 + 5) % spec.vocab_size
    want = eager.prefill(tokens[:12])
    for _ in range(2):
        graphed.reset()
        got = graphed.prefill(tokens[:12])
        assert rel(got, want) < 1e-5
        assert rel(graphed.linear_state.recurrent, eager.linear_state.recurrent) < 1e-5
        assert rel(graphed.linear_state.conv, eager.linear_state.conv) < 1e-5
    assert len(graphed._prefill_graphs) == 1
    assert rel(graphed.prefill(tokens[12:16]), eager.prefill(tokens[12:16])) < 1e-5
    assert len(graphed._prefill_graphs) == 1  # a hybrid's continuation is not captured
    for t in tokens[16:]:
        graphed.step(int(t))
        eager.step(int(t))
        assert rel(graphed.logits, eager.logits) < 1e-4


def _library(spec):
    target = current_device_target()
    return build_library(render(spec, plan_launch(spec, target)).write(cache_root() / BUILDS), target.arch)[0]


@pytest.mark.parametrize("rows", [2, 37, 64, 100, 512])
@pytest.mark.parametrize("which", ["tiny", "qwen3.5-0.8b"])
def test_the_delta_rule_kernels_are_the_torch_scan(model, which, rows):
    """prefill.delta_rule (kernel/cuda/delta_rule_prefill.cuh) against torch_model.delta_rule_chunked on the same fp32
    inputs from the same state, heads of the tiny model (32 x 16) and the 0.8B's (16 of 128 x 128), rows ending inside a
    chunk and on its edge, decays from slow to e^-64 over a chunk: the read-outs and the state after agree to fp32."""
    spec = open_model(model).spec if which == "tiny" else load_spec(which)
    la, gen = spec.linear_attention, torch.Generator().manual_seed(rows)
    nv, dk, dv = la.num_value_heads, la.key_head_dim, la.value_head_dim
    q = torch.nn.functional.normalize(torch.randn(rows, nv, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(rows, nv, dk, generator=gen), dim=-1)
    v = torch.randn(rows, nv, dv, generator=gen)
    g = -torch.rand(rows, nv, generator=gen) * torch.linspace(0.01, 2, nv)  # a head's log decay a row
    beta = torch.sigmoid(torch.randn(rows, nv, generator=gen))
    state = torch.randn(nv, dk, dv, generator=gen) * 0.1
    inputs = [t.cuda() for t in (q, k, v, g, beta)]
    want_state, got_state = state.cuda(), state.cuda()
    want = torch_model.delta_rule_chunked(want_state, *inputs)
    got = prefill.delta_rule(_library(spec))(got_state, *inputs)
    print(f"\n{which} {rows} rows: read-outs {rel(got, want):.1e}, state {rel(got_state, want_state):.1e}")
    assert rel(got, want) < 1e-5 and rel(got_state, want_state) < 1e-5, (rel(got, want), rel(got_state, want_state))


def test_the_prefill_s_linear_layer_kernels_are_torch_s(model):
    """A decoder's prefill (its Gated DeltaNet layers in mkport's kernels) against one whose prefill is torch_model's
    alone (fused_prefill=False): a 100-row prompt then a 30-row continuation give the same hidden states and linear
    states to fp32 rounding, and the same next steps."""
    spec, weights = _weights(model)
    fused, plain = (Decoder(spec, weights, max_seq=160, prefill_graphs=False, fused_prefill=f) for f in (True, False))
    assert fused._linear_attention is not None and plain._linear_attention is None
    tokens = (torch.arange(140) * 37 + 5) % spec.vocab_size
    for part in (slice(0, 100), slice(100, 130)):
        hidden = rel(fused.prefill(tokens[part]), plain.prefill(tokens[part]))
        state = rel(fused.linear_state.recurrent, plain.linear_state.recurrent)
        print(f"\nrows {part.start}..{part.stop}: hidden {hidden:.1e}, state {state:.1e} from torch's scan")
        assert hidden < 1e-4 and state < 1e-4
    for t in tokens[130:]:
        fused.step(int(t))
        plain.step(int(t))
        assert rel(fused.logits, plain.logits) < 1e-4


# -- a batch -------------------------------------------------------------------------------------------------------

def test_diff_of_a_batch_passes_at_every_tap(model):
    """`mkport diff --batch 4`: each sequence of a batch (prompts of 16 to 19 tokens) against its own float32
    reference at every tap, the Gated DeltaNet's included."""
    result = _diff(model, batch=4)
    assert result.report.passed, result.report.verdict()
    assert Tap.layer(0, Tap.STATE_OUT) in {r.name for r in result.report.rows}


PROMPTS = (5, 9, 3, 12)  # prompt lengths of the batch's sequences
JOINS = (0, 3, 1, 6)  # the step each joins at: left out before it, its state must stay as its prefill left it
STEPS = 10
BATCH_TOL = 1e-3  # logits and hidden states against alone, relative L2: tests/test_gpu_batch.py's HIDDEN_TOL


def _weights(model: str):
    spec = open_model(model).spec
    return spec, load_weights(spec, Checkpoint.open(model))


def _inputs(spec):
    """Each sequence's prompt, and the token it is fed at each of its steps (the same alone and in the batch, so that
    every step compares the same inputs whatever the greedy tokens)."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=gen) for n in PROMPTS]
    return prompts, torch.randint(0, spec.vocab_size, (len(PROMPTS), STEPS), generator=gen)


def _alone(dec: Decoder, prompt, fed) -> list:
    """One sequence on a batch-1 decoder: (logits, hidden, greedy token) at each step."""
    dec.reset()
    dec.prefill(prompt)
    out = []
    for t in fed:
        token = int(dec.step(int(t))[0])
        out.append((dec.logits.clone(), dec.hidden.clone(), token))
    return out


def _batch(dec: Decoder, prompts, fed, joins, stepper=None) -> list:
    """The sequences prefilled in their slots of `dec`, then stepped together, each from its join on: per sequence,
    (logits, hidden, greedy token) at each step it took. stepper(step): the decoder that takes the step (dec, or one
    over its first sequences)."""
    dec.reset()
    for b, prompt in enumerate(prompts):
        dec.prefill_slot(b, tokens=prompt)
    out = [[] for _ in prompts]
    for step in range(STEPS):
        d = dec if stepper is None else stepper(step)
        live = [joins[b] <= step for b in range(d.batch)]
        tokens = [int(fed[b][step - joins[b]]) if live[b] else 0 for b in range(d.batch)]
        sampled = d.step_batch(tokens=tokens, active=live).clone()
        logits, hidden = d.logits.view(d.batch, -1), d.hidden.view(d.batch, -1)
        for b in range(d.batch):
            if live[b]:
                out[b].append((logits[b].clone(), hidden[b].clone(), int(sampled[b])))
    return out


def _against_alone(model: str, batch_decoder: Decoder, joins=JOINS, stepper=None) -> tuple[float, list]:
    """The worst relative L2 of a step's logits or hidden state in the batch against the sequence alone, and the
    (sequence, step) whose greedy token differs where alone's two best logits are not a near tie."""
    spec, w = _weights(model)
    prompts, fed = _inputs(spec)
    got = _batch(batch_decoder, prompts, fed, joins, stepper)
    one = Decoder(spec, w, max_seq=64)
    worst, wrong = 0.0, []
    for b, prompt in enumerate(prompts):
        want = _alone(one, prompt, fed[b][: len(got[b])])
        assert len(got[b]) == STEPS - joins[b]
        for i, ((logits, hidden, token), (logits1, hidden1, token1)) in enumerate(zip(got[b], want)):
            worst = max(worst, rel(logits, logits1), rel(hidden, hidden1))
            best = logits1.topk(2).values
            if token != token1 and float(best[0] - best[1]) > 1e-3 * float(best[0].abs()):
                wrong.append((b, i))
    return worst, wrong


def test_each_sequence_of_a_batch_matches_it_alone(model):
    spec, w = _weights(model)
    worst, wrong = _against_alone(model, Decoder(spec, w, max_seq=64, batch=len(PROMPTS)))
    assert worst < BATCH_TOL and not wrong, (worst, wrong)


def test_a_smaller_batch_over_the_first_sequences_steps_their_states(model):
    """first_sequences (Decoder(share=...)) steps sequences 0 and 1 for the first 3 steps, with the states the owner
    prefilled; the owner then steps all 4 from the states the smaller batch left."""
    spec, w = _weights(model)
    owner = Decoder(spec, w, max_seq=64, batch=len(PROMPTS))
    small = first_sequences(owner, 2)
    assert small.linear_state is owner.linear_state
    worst, wrong = _against_alone(model, owner, joins=(0, 1, 3, 5), stepper=lambda step: small if step < 3 else owner)
    assert worst < BATCH_TOL and not wrong, (worst, wrong)


# the kernel's sources changed in the rendering alone: every sequence reads and writes sequence 0's state; a sequence a
# step leaves out advances its state anyway
STATE_FAULTS = {
    "one-state-for-the-batch": ("constants.cuh", ["constexpr int LA_CONV_STATE = (LA_CONV - 1) * LA_CONV_DIM;",
                                                  "constexpr int LA_DELTA_STATE = LA_NV * LA_DK * LA_DV;"],
                                ["constexpr int LA_CONV_STATE = 0;", "constexpr int LA_DELTA_STATE = 0;"]),
    "left-out-advances": ("linear_attention.cuh", ["return BATCH == 1 || p.advances[b];"], ["return true;"]),
}


@pytest.mark.parametrize("fault", list(STATE_FAULTS))
def test_a_batch_without_its_own_states_fails(model, monkeypatch, fault):
    import mkport.runtime.decoder

    filename, old, new = STATE_FAULTS[fault]
    real = mkport.runtime.decoder.render

    def faulty(spec, plan):
        sources = real(spec, plan)
        text = sources.files[filename]
        for a, b in zip(old, new):
            assert a in text, a
            text = text.replace(a, b)
        return dataclasses.replace(sources, name=f"{sources.name}-{fault}", files={**sources.files, filename: text})

    monkeypatch.setattr(mkport.runtime.decoder, "render", faulty)
    spec, w = _weights(model)
    batched = Decoder(spec, w, max_seq=64, batch=len(PROMPTS))
    monkeypatch.setattr(mkport.runtime.decoder, "render", real)  # alone: the true kernel
    worst, _ = _against_alone(model, batched)
    assert worst > 10 * BATCH_TOL, worst
