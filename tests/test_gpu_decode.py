"""Megakernel decode against the transformers reference, for every bundled spec (GPU only).

After a 32-token prompt, 64 greedy tokens must equal the reference's argmax at every step, except
where the reference's top-2 logit margin is under MARGIN_TOL (such steps are counted and reported),
and the final hidden state's relative L2 error must stay under 1e-2. The reference runs in float32
from the same bf16 weights, teacher-forced on the kernel's tokens (one forward over the sequence).
"""

from __future__ import annotations

import numpy
import pytest
import torch

from conftest import bundled_kernel_params
from tolerances import HIDDEN_TOL, MARGIN_TOL
from mkport.errors import MkportError
from mkport.kernel.launch_plan import KERNELS
from mkport.runtime.decoder import Decoder
from mkport.runtime.sampling import SamplingParams
from mkport.kernel.spec import load_spec, open_model
from mkport.runtime.weights import Checkpoint, load_weights, random_weights_folder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT, STEPS = 32, 64


@pytest.fixture(scope="module")
def checkpoints():
    return lambda name: Checkpoint.open(random_weights_folder(load_spec(name), seed=0))


def generate_greedy(dec: Decoder, prompt: torch.Tensor, steps: int):
    dec.prefill(prompt[:-1])
    tokens, hiddens = [], []
    tok = dec.step(int(prompt[-1]))
    for i in range(steps):
        tokens.append(tok.clone())
        hiddens.append(dec.hidden.clone())
        if i + 1 < steps:
            tok = dec.step()  # feeds the sampled token back on the device
    return torch.cat(tokens).long(), torch.stack(hiddens)


@pytest.mark.parametrize("name", bundled_kernel_params(whole_checkpoint=True))
def test_greedy_tokens_and_hidden_match_reference(name, checkpoints):
    from mkport.check.reference import Reference

    spec = load_spec(name)
    checkpoint = checkpoints(name)
    dec = Decoder(spec, load_weights(spec, checkpoint), max_seq=256)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, spec.vocab_size, (PROMPT,), generator=gen)
    tokens, hiddens = generate_greedy(dec, prompt, STEPS)

    ref = Reference(open_model(name), checkpoint, device="cuda").run(tokens=torch.cat([prompt, tokens[:-1].cpu()]).cuda())
    ref_logits = ref.logits[PROMPT - 1 :]
    ref_hidden = ref.hidden[PROMPT - 1 :]
    top2 = ref_logits.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    mismatch = tokens != ref_logits.argmax(-1)
    near_ties = int((mismatch & (margin < MARGIN_TOL)).sum())
    hard = int((mismatch & (margin >= MARGIN_TOL)).sum())
    rel = float((hiddens - ref_hidden).norm() / ref_hidden.norm())
    print(f"{name}: {STEPS} steps, {hard} hard mismatches, {near_ties} near-tie steps, hidden rel L2 {rel:.2e}")
    assert hard == 0, f"{hard} steps differ where the reference margin is >= {MARGIN_TOL}"
    assert rel < HIDDEN_TOL


@pytest.mark.parametrize("name", ["qwen3-tts-0.6b-talker", "qwen3-tts-1.7b-code-predictor"])
def test_input_embedding_steps_match_reference(name, checkpoints):
    """The TTS decoders take input embeddings from a device buffer (the 1.7B predictor projects them)."""
    from mkport.check.reference import Reference

    spec = load_spec(name)
    checkpoint = checkpoints(name)
    dec = Decoder(spec, load_weights(spec, checkpoint), max_seq=64)
    gen = torch.Generator().manual_seed(3)
    embeds = torch.randn(12, spec.input_dim, generator=gen) * 0.1
    dec.prefill(embeds=embeds[:4])
    hiddens = []
    for e in embeds[4:]:
        dec.step(embed=e.cuda())
        hiddens.append(dec.hidden.clone())
    ref = Reference(open_model(name), checkpoint, device="cuda").run(embeds=embeds.cuda())
    rel = float((torch.stack(hiddens) - ref.hidden[4:]).norm() / ref.hidden[4:].norm())
    assert rel < HIDDEN_TOL


def test_sampling_is_seeded_and_respects_suppression(checkpoints):
    name = "qwen3-tts-0.6b-talker"
    spec = load_spec(name)
    dec = Decoder(spec, load_weights(spec, checkpoints(name)), max_seq=128)
    suppressed = [t for t in range(2048, 3072) if t != 2150]
    dec.set_suppressed(suppressed)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.05, seed=11)

    def run():
        dec.reset()
        dec.prefill(torch.arange(8))
        out = [int(dec.step(8, sampling=params))]
        out += [int(dec.step(sampling=params)) for _ in range(30)]
        return out

    first, second = run(), run()
    assert first == second
    assert not set(first) & set(suppressed)
    assert len(set(first)) > 1  # sampling, not a constant
    other = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.05, seed=12)
    dec.reset()
    dec.prefill(torch.arange(8))
    third = [int(dec.step(8, sampling=other))] + [int(dec.step(sampling=other)) for _ in range(30)]
    assert third != first


def philox_uniform(seed: int, step: int, index: int) -> float:
    """The kernel's draw (common.cuh's philox_uniform), on the host."""
    m = 0xFFFFFFFF
    c0, c1, c2, c3 = index, 0, step & m, (step >> 32) & m
    k0, k1 = seed & m, (seed >> 32) & m
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & m, p1 & m, ((p0 >> 32) ^ c3 ^ k1) & m, p0 & m
        k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
    return float(numpy.float32(((c0 >> 8) + 0.5) * (1.0 / 16777216.0)))


def top_k_pick(logits: torch.Tensor, top_k: int, top_p: float, u: float) -> tuple[int, float]:
    """The sampler's rule on processed logits, in float64: the top_k highest (lowest id first among equals), top-p
    keeping token j while the mass of j and all below exceeds 1 - top_p, a draw at u. Returns the token and how
    close the draw or the top-p cut came to a boundary (fraction of the mass): below ~1e-5 float32 may differ."""
    vals = logits.double().cpu()
    order = sorted(range(vals.numel()), key=lambda i: (-float(vals[i]), i))[:top_k]
    w = torch.exp(vals[order] - vals[order[0]])
    p = w / w.sum()
    below = torch.flip(torch.cumsum(torch.flip(p, [0]), 0), [0])  # mass of j and all below it
    keep = max(1, int((below > 1.0 - top_p).sum()))
    cum = torch.cumsum(w[:keep], 0) / w[:keep].sum()
    pick = min(int((cum < u).sum()), keep - 1)
    margin = min([abs(float(c) - u) for c in cum] + [abs(float(b) - (1.0 - top_p)) for b in below[1:]])
    return order[pick], margin


@pytest.mark.parametrize("name,params", [
    ("qwen3-tts-0.6b-code-predictor", SamplingParams(temperature=0.9, top_k=50, seed=3)),
    ("qwen3-tts-0.6b-talker", SamplingParams(temperature=0.9, top_k=50, top_p=0.8, repetition_penalty=1.05, seed=4)),
    ("qwen3-0.6b", SamplingParams(temperature=0.7, top_k=20, top_p=0.95, seed=5)),
])
def test_top_k_sampling_picks_what_its_rule_picks(name, params, checkpoints):
    """Each sampled token is the one the top-k / top-p rule and the step's Philox draw pick from the step's
    processed logits (the kernel's own, read back), except where the draw lies within 1e-5 of a boundary."""
    spec = load_spec(name)
    dec = Decoder(spec, load_weights(spec, checkpoints(name)), max_seq=128)
    dec.prefill(torch.arange(6))
    tok = dec.step(6, sampling=params)
    checked = 0
    for _ in range(40):
        want, margin = top_k_pick(dec.logits, params.top_k, params.top_p,
                                  philox_uniform(params.seed, dec.steps - 1, spec.vocab_size))
        if margin > 1e-5:
            assert int(tok) == want, f"step {dec.steps - 1}: sampled {int(tok)}, the rule picks {want}"
            checked += 1
        tok = dec.step(sampling=params)
    assert checked >= 35


def test_top_k_one_is_greedy(checkpoints):
    name = "qwen3-tts-0.6b-code-predictor"
    spec = load_spec(name)
    dec = Decoder(spec, load_weights(spec, checkpoints(name)), max_seq=64)
    dec.prefill(torch.arange(4))
    sampled = int(dec.step(4, sampling=SamplingParams(temperature=1.0, top_k=1, seed=5)))
    assert sampled == int(dec.logits.argmax())


def test_position_past_cache_is_a_clear_error(checkpoints):
    name = "qwen3-tts-0.6b-code-predictor"
    spec = load_spec(name)
    dec = Decoder(spec, load_weights(spec, checkpoints(name)), max_seq=8)
    dec.prefill(torch.arange(7))
    dec.step(1)
    with pytest.raises(MkportError, match="past the KV cache length 8"):
        dec.step(2)


@pytest.mark.parametrize("kernel", KERNELS)
def test_steps_are_the_same_bits_run_after_run(kernel, checkpoints):
    """Sums in a fixed order, no float atomics: fresh decoders on the same prompt make the same hidden states, bit
    for bit (for the streamed MLP of v6 also: its counters start from zero in every step)."""
    name = "qwen3-0.6b"
    spec = load_spec(name)
    w = load_weights(spec, checkpoints(name))
    prompt = torch.randint(0, spec.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(3))
    runs = [generate_greedy(Decoder(spec, w, max_seq=128, kernel=kernel), prompt, 16) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_a_last_round_split_over_warp_pairs_keeps_the_tokens():
    """The tail_split plan variant (matvec.cuh's TAIL_SPLITS): o_proj's and down's 2304 rows leave 192 past a first
    round of 2112 warps (H200), qkv's 2816 leave 704 and the head's 32000 leave 320, each then summed in two halves by
    a warp pair. Another order of the same sums: the tokens of the strided plan, the hidden states within float
    rounding."""
    import dataclasses

    from mkport.kernel.spec import spec_from_config
    from mkport.runtime.weights import random_weights

    spec = spec_from_config({"model_type": "llama", "hidden_size": 2304, "intermediate_size": 4096,
                             "num_hidden_layers": 2, "num_attention_heads": 18, "num_key_value_heads": 2,
                             "vocab_size": 32000}, "wide-2304")
    w = load_weights(spec, random_weights(spec, 0))
    prompt = torch.randint(0, spec.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(9))
    strided = Decoder(spec, w, max_seq=128)
    assert spec.hidden_size > strided.plan.grid * strided.plan.warps
    tokens, hiddens = generate_greedy(strided, prompt, 16)
    plan = dataclasses.replace(strided.plan, tail_split=True)
    split_tokens, split_hiddens = generate_greedy(Decoder(spec, w, max_seq=128, plan=plan), prompt, 16)
    assert torch.equal(split_tokens, tokens)
    assert float((split_hiddens - hiddens).norm() / hiddens.norm()) < 1e-4


def test_down_input_read_in_16_byte_loads_gives_the_same_bits():
    """The vector_act plan variant (mlp.cuh's gated_to_smem_vec) makes down's input from the same gate and up values
    with the same act_times: the same tokens and hidden states bit for bit, on SwiGLU (a llama config whose I = 2816
    leaves some threads past the end in its group of 16-byte loads), on GeGLU (a gemma config), and on a tiny
    qwen3_moe whose dense layer takes it and whose experts do not."""
    import dataclasses

    from conftest import moe_config

    from mkport.kernel.spec import spec_from_config
    from mkport.runtime.weights import random_weights

    configs = {"llama": {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 2,
                         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000},
               "gemma": {"model_type": "gemma", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 2,
                         "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 32000,
                         "hidden_activation": "gelu_pytorch_tanh"},
               "qwen3_moe": moe_config("qwen3_moe")}
    for name, config in configs.items():
        spec = spec_from_config(config, f"act-{name}")
        w = load_weights(spec, random_weights(spec, 0))
        prompt = torch.randint(0, spec.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(11))
        scalar = Decoder(spec, w, max_seq=128)
        tokens, hiddens = generate_greedy(scalar, prompt, 16)
        plan = dataclasses.replace(scalar.plan, vector_act=True)
        vec_tokens, vec_hiddens = generate_greedy(Decoder(spec, w, max_seq=128, plan=plan), prompt, 16)
        assert torch.equal(vec_tokens, tokens) and torch.equal(vec_hiddens, hiddens), name


def test_two_decoders_in_one_process(checkpoints):
    name = "qwen3-tts-0.6b-code-predictor"
    spec = load_spec(name)
    w = load_weights(spec, checkpoints(name))
    a, b = Decoder(spec, w, max_seq=64), Decoder(spec, w, max_seq=64)
    prompt = torch.arange(10)
    a.prefill(prompt)
    b.prefill(prompt)
    ta, tb = [], []
    for _ in range(8):  # interleaved steps: state must not leak between decoders
        ta.append(int(a.step(sampling=SamplingParams()) if ta else a.step(3)))
        tb.append(int(b.step(sampling=SamplingParams()) if tb else b.step(3)))
    assert ta == tb
    assert b.build_cached  # the second decoder reused the first one's build
