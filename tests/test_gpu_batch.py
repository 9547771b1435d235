"""Batched decode (GPU only): every sequence of a batch gives what it gives alone.

A batch decoder and a one-sequence decoder are built on the same weights. Each sequence of the batch gets its
own prompt (of its own length), its own sampling parameters and seed, and some sequences start later and stop
earlier than others (left out of steps with `active`). Each is then run alone on the one-sequence decoder with
the same inputs. The tokens must be equal, except at near ties, and the hidden states within HIDDEN_TOL: a batch's
matvecs run on tensor cores with each fp32 input split into two bf16, and its attention may split a sequence's
positions differently, which moves states by ~1e-4 (a tenth of the kernel's distance to the fp32 reference).
"""

from __future__ import annotations

import pytest
import torch

from conftest import held_kv
from mkport.errors import MkportError
from mkport.runtime.decoder import Decoder
from mkport.runtime.sampling import SamplingParams
from mkport.kernel.spec import load_spec
from mkport.runtime.weights import Checkpoint, load_weights, random_weights_folder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HIDDEN_TOL = 1e-3  # relative L2, a sequence in a batch against alone (tensor-core matvecs, attention splits)
STEPS = 24


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def plan_for(batch: int):
    """Sequence b: prompt length, first and last step it takes part in, sampling."""
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11)
    return [
        dict(prompt=5 + 7 * b, start=(b % 3) * 2, stop=STEPS - (b % 4), sampling=greedy if b % 2 == 0 else
             SamplingParams(**{**sampled.__dict__, "seed": 11 + b, "repetition_penalty": 1.0 + 0.1 * (b % 3)}))
        for b in range(batch)
    ]


def run_batch(dec: Decoder, prompts, seqs):
    """Per sequence: its tokens and hidden states at each step it was active."""
    n = dec.batch
    out = [([], []) for _ in range(n)]
    dec.reset()
    for b in range(n):
        dec.prefill_slot(b, tokens=prompts[b][:-1])
    last = [int(p[-1]) for p in prompts]
    for step in range(STEPS):
        active = [seqs[b]["start"] <= step < seqs[b]["stop"] for b in range(n)]
        tokens = [last[b] if step == seqs[b]["start"] else None for b in range(n)]
        tok = dec.step_batch(tokens=tokens, sampling=[s["sampling"] for s in seqs], active=active).clone()
        hidden = dec.hidden.view(n, -1).clone()
        for b in range(n):
            if active[b]:
                out[b][0].append(int(tok[b]))
                out[b][1].append(hidden[b])
    return out


def run_alone(dec: Decoder, prompt, seq):
    dec.reset()
    dec.prefill(prompt[:-1])
    tokens, hiddens = [], []
    tok = dec.step(int(prompt[-1]), sampling=seq["sampling"])
    for i in range(seq["stop"] - seq["start"]):
        tokens.append(int(tok[0]))
        hiddens.append(dec.hidden.clone())
        if i + 1 < seq["stop"] - seq["start"]:
            tok = dec.step(sampling=seq["sampling"])
    return tokens, hiddens


@pytest.mark.parametrize("name,batch", [("qwen3-0.6b", 4), ("qwen3-tts-0.6b-talker", 8), ("qwen3-tts-1.7b-talker", 8),
                                        ("qwen3-tts-0.6b-talker", 32),  # 32: n8 tiles 2 and 3
                                        ("qwen3-tts-1.7b-talker", 24)])  # 24: 504 threads store, attention in 2 passes
def test_each_sequence_of_a_batch_matches_it_alone(name, batch):
    spec = load_spec(name)
    weights = load_weights(spec, Checkpoint.open(random_weights_folder(spec, seed=0)))
    alone = Decoder(spec, weights, max_seq=256)
    batched = Decoder(spec, weights, max_seq=256, batch=batch)
    gen = torch.Generator().manual_seed(3)
    seqs = plan_for(batch)
    prompts = [torch.randint(0, spec.vocab_size, (s["prompt"],), generator=gen) for s in seqs]
    got = run_batch(batched, prompts, seqs)
    ties = 0
    for b in range(batch):
        tokens, hiddens = run_alone(alone, prompts[b], seqs[b])
        btokens, bhiddens = got[b]
        assert len(btokens) == len(tokens), f"sequence {b}: {len(btokens)} steps in the batch, {len(tokens)} alone"
        for i, (x, y) in enumerate(zip(btokens, tokens)):
            if x != y:  # allowed only where the two runs' logits nearly tie; then the sequences part ways
                ties += 1
                break
            err = rel(bhiddens[i], hiddens[i])
            assert err < HIDDEN_TOL, f"sequence {b} step {i}: hidden rel L2 {err:.2e} against alone"
    print(f"{name} batch {batch}: {ties} sequences parted at a near tie")
    assert ties <= max(1, batch // 16), f"{ties} of {batch} sequences gave other tokens in the batch than alone"


def test_trace_of_a_batch_sequence_matches_it_alone():
    """The trace build records each sequence's per-layer states: sequence 2 of a batch equals it alone."""
    spec = load_spec("qwen3-tts-0.6b-talker")
    weights = load_weights(spec, Checkpoint.open(random_weights_folder(spec, seed=0)))
    alone = Decoder(spec, weights, max_seq=128, trace=True)
    batched = Decoder(spec, weights, max_seq=128, trace=True, batch=4)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, spec.vocab_size, (9 + 3 * b,), generator=gen) for b in range(4)]
    for b in range(4):
        batched.prefill_slot(b, tokens=prompts[b])
    batched.step_batch(tokens=[1, 2, 3, 4])
    alone.prefill(prompts[2])
    alone.step(3)
    want, got = alone.trace_taps(), batched.trace_taps(2)
    assert want.keys() == got.keys()
    worst = max(rel(got[k], want[k]) for k in want)
    assert worst < HIDDEN_TOL, f"worst traced state rel L2 {worst:.2e}"


def test_batch_decoder_refuses_one_sequence_calls_and_bad_slots():
    spec = load_spec("qwen3-tts-0.6b-code-predictor")
    weights = load_weights(spec, Checkpoint.open(random_weights_folder(spec, seed=0)))
    dec = Decoder(spec, weights, max_seq=16, batch=2)
    with pytest.raises(MkportError, match="step_batch"):
        dec.step(1)
    with pytest.raises(MkportError, match="sequence 2 does not exist"):
        dec.prefill_slot(2, tokens=[1])
    with pytest.raises(MkportError, match="sampling has 3 entries"):
        dec.step_batch(tokens=[1, 2], sampling=[SamplingParams()] * 3)


@pytest.mark.parametrize("size,batch", [("0.6b", 8), ("1.7b", 4)])
def test_tts_requests_in_a_batch_make_their_frames_alone(size, batch):
    """Qwen3-TTS on the megakernel: requests with their own texts, seeds and lengths, one joining three frames late,
    advanced together by batch decoders (mkport.tts.batch). Each must make exactly the codes it makes alone in its
    slot of the same decoders: a sequence's arithmetic in a batch does not depend on the other sequences. Against
    the one-sequence decoders of `mkport speak` (other matvec arithmetic) the first talker step's hidden state of
    every request is within HIDDEN_TOL; the codes then part at near ties, which are counted, not asserted."""
    from mkport.tts.batch import FrameBatch
    from mkport.tts.model import TtsModel, random_model_folder
    from mkport.tts.pipeline import TtsSampling, generate_frames, make_decoders
    from mkport.tts.prompt import build_prompt

    mk = TtsModel.load(random_model_folder(size, seed=0), device="cuda")
    speaker = next(iter(mk.config.speakers))
    texts = ["Hello there.", "How are you today?", "Fine, thanks, and you?", "It is a lovely day.",
             "Yes.", "Let us talk about the weather for a moment.", "Why?", "Because I said so."][:batch]
    prompts = [build_prompt(mk.config, mk.encode, mk.text, mk.talker_weights.embed[0], t, speaker, "auto",
                            text_mode="streaming") for t in texts]
    samplings = [TtsSampling.from_generation_config(mk.generation, seed=10 + b, greedy=b % 2 == 0) for b in range(batch)]
    frames = [12 + b % 3 for b in range(batch)]
    late = batch - 1  # joins after JOIN frames of the others
    join = 3
    max_seq = max(p.embeds.shape[0] for p in prompts) + max(frames) + 1
    talker, predictor = make_decoders(mk, "megakernel", max_seq, batch)

    def run(slots: list[int], first_hidden: dict | None = None) -> dict[int, list[torch.Tensor]]:
        """The requests of `slots`, each in its own slot; the late one joins at frame JOIN unless it runs alone."""
        joins = {b: join if b == late and len(slots) > 1 else 0 for b in slots}
        got = {b: [] for b in slots}
        fb = FrameBatch(mk, talker, predictor)
        talker.reset()
        step = 0
        while joins or fb.requests:
            for b in [b for b, at in joins.items() if at == step]:
                fb.add(b, prompts[b], samplings[b], frames[b])
                del joins[b]
            for b, codes in fb.step().items():
                if first_hidden is not None:
                    first_hidden.setdefault(b, talker.hidden.view(batch, -1)[b].clone())
                if codes is not None:
                    got[b].append(codes)
            step += 1
        return got

    first = {}
    together = run(list(range(batch)), first)
    assert all(len(together[b]) > 0 for b in range(batch))
    for b in range(batch):
        alone = run([b])[b]
        assert len(alone) == len(together[b]) and all(torch.equal(x, y) for x, y in zip(alone, together[b])), \
            f"request {b} made other codes in the batch than alone in its slot"
    one_talker, one_predictor = make_decoders(mk, "megakernel", max_seq)
    parted = 0
    for b in range(batch):
        one_talker.reset()
        one_talker.prefill(embeds=prompts[b].embeds[:-1].cuda())
        one_talker.step(embed=prompts[b].embeds[-1].cuda(), sampling=samplings[b].talker)
        err = rel(first[b], one_talker.hidden)
        assert err < HIDDEN_TOL, f"request {b}: first talker hidden rel L2 {err:.2e} against the one-sequence decoder"
        alone = list(generate_frames(mk, prompts[b], one_talker, one_predictor, samplings[b], frames[b],
                                     prefix_cache=None))
        parted += not (len(alone) == len(together[b]) and all(torch.equal(x, y) for x, y in zip(alone, together[b])))
    print(f"tts {size} batch {batch}: {parted} requests parted from the one-sequence decoders (near ties)")


def test_prefill_of_a_slot_replays_a_graph_equal_to_its_eager_run():
    """A batch slot's prompt from row 0 replays a CUDA graph (captured per slot and padded length): its hidden
    states and K/V rows equal the eager prefill's in every slot, within float rounding (a padded length can make
    cuBLAS pick another matmul algorithm)."""
    spec = load_spec("qwen3-tts-0.6b-talker")
    weights = load_weights(spec, Checkpoint.open(random_weights_folder(spec, seed=0)))
    graphed = Decoder(spec, weights, max_seq=256, batch=4)
    eager = Decoder(spec, weights, max_seq=256, batch=4, prefill_graphs=False)
    gen = torch.Generator().manual_seed(9)
    for slot, rows in enumerate([5, 40, 100, 100]):
        embeds = torch.randn(rows, spec.input_dim, generator=gen).cuda()
        want = eager.prefill_slot(slot, embeds=embeds)
        got = graphed.prefill_slot(slot, embeds=embeds)
        assert rel(got, want) < 1e-4, f"slot {slot}: hidden states differ by {rel(got, want):.1e}"
        for a, b in zip(held_kv(graphed, rows, slot), held_kv(eager, rows, slot)):  # the prompt's rows (a graph
            err = rel(a, b)  # also writes its padding's, after them)
            assert err < 1e-3, f"slot {slot}: K/V rows differ by {err:.1e}"
    assert len(graphed._prefill_graphs) == 4  # one a slot (the two prompts of 100 rows in their own slots)


def test_prompts_prefilled_together_match_each_prefilled_alone():
    """Four prompts of 1 to 100 rows into slots of two batch decoders (one spec, layout and weights), prefilled
    together in one graph (Decoder.prefill_prompts, as the server's joins of a turn): each prompt's hidden states and
    K/V rows against the same prompt prefilled alone into its slot (prefill_slot), within float rounding (another row
    count, another tiling of the matmuls); each slot's length; the other slots' caches untouched, bit for bit; and the
    next step of every slot gives the tokens and states it gives after the lone prefills."""
    spec = load_spec("qwen3-tts-1.7b-talker")  # the server's talker
    weights = load_weights(spec, Checkpoint.open(random_weights_folder(spec, seed=0))).to("cuda")  # shared tensors
    a, b, alone_a, alone_b = (Decoder(spec, weights, max_seq=256, batch=4) for _ in range(4))
    assert Decoder.prompts_together([a, b])
    gen = torch.Generator().manual_seed(5)
    embeds = lambda rows: torch.randn(rows, spec.input_dim, generator=gen).cuda()  # noqa: E731
    early = embeds(20)  # a's slot 1 holds a prompt already; nothing of the prefill together may reach it
    a.prefill_slot(1, embeds=early)
    alone_a.prefill_slot(1, embeds=early)
    before = [t.clone() for t in held_kv(a, 256, 1)] + [t.clone() for s in (0, 3) for t in held_kv(b, 256, s)]
    prompts = [(a, 0, embeds(1)), (b, 2, embeds(37)), (a, 3, embeds(100)), (b, 1, embeds(12))]
    hidden = a.prefill_prompts(prompts)
    assert [("prompts", 256)] == [k for k in a._prefill_graphs if k[0] == "prompts"] and not b._prefill_graphs
    first = 0
    for d, slot, rows in prompts:
        ref = alone_a if d is a else alone_b
        want = ref.prefill_slot(slot, embeds=rows)
        n = rows.shape[0]
        err = rel(hidden[first:first + n], want)
        assert err < 1e-4, f"slot {slot} ({n} rows): hidden states differ from alone by {err:.1e}"
        for got, kv in zip(held_kv(d, n, slot), held_kv(ref, n, slot)):
            assert rel(got, kv) < 1e-3, f"slot {slot}: K/V rows differ from alone by {rel(got, kv):.1e}"
        assert d.sequences[slot].length == n
        first += n
    after = list(held_kv(a, 256, 1)) + [t for s in (0, 3) for t in held_kv(b, 256, s)]
    assert all(torch.equal(x, y) for x, y in zip(after, before)), "a slot outside the prompts was written"
    nexts = embeds(4)
    for together, ref, active in ((a, alone_a, [True] * 4), (b, alone_b, [False, True, True, False])):
        tokens = together.step_batch(embeds=nexts, active=active).clone()
        want = ref.step_batch(embeds=nexts, active=active)
        for slot in (s for s in range(4) if active[s]):
            assert int(tokens[slot]) == int(want[slot]), f"slot {slot}: the next step's token differs from alone"
            err = rel(together.hidden.view(4, -1)[slot], ref.hidden.view(4, -1)[slot])
            assert err < HIDDEN_TOL, f"slot {slot}: the next step's state differs from alone by {err:.1e}"
    with pytest.raises(MkportError, match="not empty"):
        a.prefill_prompts([(a, 0, embeds(3))])
