"""mkport.runtime.graph_decoder.GraphDecoder, the batch decoder of plain torch (the "graphs" backend): on CPU its step
runs eagerly, the same function a CUDA graph captures; each sequence of a batch gives what TorchDecoder gives
for it alone, and FrameBatch over it makes the reference backend's codes. The GPU test checks the graph replay
against the eager step and prints the talker's step time."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import join_and_leave
from mkport.errors import MkportError
from mkport.runtime.graph_decoder import GraphDecoder, sample_rows, uniforms
from mkport.runtime.sampling import SamplingParams

warnings.filterwarnings("ignore", category=FutureWarning)

from mkport.tts.batch import FrameBatch  # noqa: E402
from mkport.tts.model import TtsModel, write_random_tts_model  # noqa: E402
from mkport.runtime.torch_decoder import TorchDecoder  # noqa: E402
from mkport.runtime.backends import check_backend  # noqa: E402
from mkport.tts.pipeline import TtsSampling, make_decoders  # noqa: E402
from mkport.tts.prompt import build_prompt  # noqa: E402

HIDDEN_TOL = 1e-5  # max abs, against TorchDecoder (same fp32 math, attention as matrix products instead of SDPA)
MAX_SEQ = 96
TEXTS = ["Hi there", "A somewhat longer sentence to say.", "Three"]
GREEDY_PENALTY = SamplingParams(repetition_penalty=1.3)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return TtsModel.load(write_random_tts_model(tmp_path_factory.mktemp("graph_decoder") / "tiny", "tiny", seed=0))


def _prompts(spec, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, spec.vocab_size, (n,), generator=gen) for n in lengths]


def _max_diff(a, b):
    return float((a - b).abs().max())


# -- against TorchDecoder ----------------------------------------------------------------------------------
@pytest.mark.parametrize("part", ["talker", "predictor"])
def test_each_sequence_steps_as_torch_decoder_alone(tiny, part):
    """Prompts of different lengths share each step (so each attends to its own number of rows); greedy with a
    repetition penalty, tokens fed back on the device; the predictor through its last table and head."""
    spec, w = (tiny.talker_spec, tiny.talker_weights) if part == "talker" else (tiny.predictor_spec,
                                                                                 tiny.predictor_weights)
    table, head = spec.num_embedding_tables - 1, spec.num_output_heads - 1
    max_seq = min(spec.max_position, MAX_SEQ)
    prompts = _prompts(spec, [3, 11, 6])
    dec = GraphDecoder(spec, w, max_seq, batch=3, device="cpu")
    alone = [TorchDecoder(spec, w, max_seq) for _ in prompts]
    for b, prompt in enumerate(prompts):
        got, want = dec.prefill_slot(b, tokens=prompt[:-1], table=table), alone[b].prefill(prompt[:-1], table=table)
        assert _max_diff(got, want) <= HIDDEN_TOL
    tokens = [int(p[-1]) for p in prompts]
    for step in range(8):
        out = dec.step_batch(tokens=tokens if step == 0 else None, table=table, head=head,
                             sampling=GREEDY_PENALTY).tolist()
        for b, d in enumerate(alone):
            want = d.step(token=tokens[b] if step == 0 else None, table=table, head=head, sampling=GREEDY_PENALTY)
            assert out[b] == int(want[0]), f"sequence {b} step {step}"
            assert _max_diff(dec.hidden.view(3, -1)[b], d.hidden) <= HIDDEN_TOL, f"sequence {b} step {step}"


def test_embeds_and_positions_as_torch_decoder(tiny):
    """Input embeddings (the talker's frame input) and explicit (t, h, w) positions, one a sequence."""
    spec, w = tiny.talker_spec, tiny.talker_weights
    gen = torch.Generator().manual_seed(1)
    dec = GraphDecoder(spec, w, MAX_SEQ, batch=2, device="cpu")
    alone = [TorchDecoder(spec, w, MAX_SEQ) for _ in range(2)]
    for b, n in enumerate((4, 9)):
        embeds = torch.randn(n, spec.input_dim, generator=gen)
        dec.prefill_slot(b, embeds=embeds)
        alone[b].prefill(embeds=embeds)
    for step in range(4):
        embeds = torch.randn(2, spec.input_dim, generator=gen)
        positions = [(20 + step, 3, 5 + step), 40 + step]
        out = dec.step_batch(embeds=embeds, positions=positions).tolist()
        for b, d in enumerate(alone):
            want = d.step(embed=embeds[b], position=positions[b])
            assert out[b] == int(want[0])
            assert _max_diff(dec.hidden.view(2, -1)[b], d.hidden) <= HIDDEN_TOL


def test_inactive_sequences_keep_their_state(tiny):
    """Sequence 1 sits out steps 2..4: meanwhile its hidden state and last token stay, and afterwards it goes
    on as TorchDecoder does over the steps it took (cache, length, history as they were)."""
    spec, w = tiny.talker_spec, tiny.talker_weights
    prompts = _prompts(spec, [5, 8, 7], seed=2)
    dec = GraphDecoder(spec, w, MAX_SEQ, batch=3, device="cpu")
    one = TorchDecoder(spec, w, MAX_SEQ)
    for b, prompt in enumerate(prompts):
        dec.prefill_slot(b, tokens=prompt[:-1])
    one.prefill(prompts[1][:-1])
    tokens = [int(p[-1]) for p in prompts]
    for step in range(8):
        active = [True, not 2 <= step <= 4, True]
        before = (dec.hidden.view(3, -1)[1].clone(), int(dec.token_out[1]))
        out = dec.step_batch(tokens=tokens if step == 0 else None, sampling=GREEDY_PENALTY, active=active)
        if not active[1]:
            assert torch.equal(dec.hidden.view(3, -1)[1], before[0]) and int(out[1]) == before[1]
            continue
        want = one.step(token=tokens[1] if step == 0 else None, sampling=GREEDY_PENALTY)
        assert int(out[1]) == int(want[0]), f"step {step}"
        assert _max_diff(dec.hidden.view(3, -1)[1], one.hidden) <= HIDDEN_TOL, f"step {step}"
    assert dec.lengths == [4 + 8, 7 + 5, 6 + 8]
    assert torch.equal(dec.seen[1], one.seen)  # its repetition history: its prompt and the tokens it sampled


def test_an_inactive_sequence_keeps_its_random_stream(tiny):
    """Sampled, sequence 1 of a batch that sits out steps draws what it draws alone over the steps it takes."""
    spec, w = tiny.talker_spec, tiny.talker_weights
    prompts = _prompts(spec, [5, 8, 7], seed=2)
    dec, one = GraphDecoder(spec, w, MAX_SEQ, batch=3, device="cpu"), GraphDecoder(spec, w, MAX_SEQ, device="cpu")
    for b, prompt in enumerate(prompts):
        dec.prefill_slot(b, tokens=prompt[:-1])
    one.prefill_slot(0, tokens=prompts[1][:-1])
    got, want = [], []
    for step in range(10):
        active = [True, step % 3 != 1, True]
        out = dec.step_batch(tokens=[int(p[-1]) for p in prompts] if step == 0 else None, sampling=SAMPLED,
                             active=active)
        if active[1]:
            got.append(int(out[1]))
            want.append(int(one.step_batch(tokens=[int(prompts[1][-1])] if step == 0 else None, sampling=SAMPLED)[0]))
    assert got == want and len(set(got)) > 1


def test_bf16_cache_stays_close(tiny):
    """The cache dtype of the GPU default (bf16) on the CPU: states within bf16's rounding of the fp32 run."""
    spec, w = tiny.talker_spec, tiny.talker_weights
    prompts = _prompts(spec, [6, 10], seed=3)
    runs = [GraphDecoder(spec, w, MAX_SEQ, batch=2, device="cpu", kv_dtype=dt) for dt in (torch.float32,
                                                                                          torch.bfloat16)]
    for dec in runs:
        for b, prompt in enumerate(prompts):
            dec.prefill_slot(b, tokens=prompt)
        dec.step_batch(tokens=[1, 2])
        dec.step_batch(tokens=[3, 4])
    fp32, bf16 = (d.hidden for d in runs)
    assert runs[1].kv.k.dtype == torch.bfloat16
    assert 0 < float((bf16 - fp32).norm() / fp32.norm()) < 1e-2


# -- sampling ------------------------------------------------------------------------------------------------
def test_sample_rows_follows_the_reference_rules():
    l = torch.tensor([[1.0, 3.0, 3.0, 0.5], [0.0, 0.2, 2.0, 1.9], [0.3, 0.1, 0.2, 0.0]])
    u = torch.tensor([0.99, 0.99, 0.99], dtype=torch.float64)
    top_p = torch.ones(3, dtype=torch.float64)
    greedy = torch.ones(3, dtype=torch.bool)
    assert sample_rows(l, torch.full((3,), 4), top_p, greedy, u).tolist() == [1, 2, 0]  # lowest id on ties
    sampled = ~greedy
    assert sample_rows(l, torch.ones(3, dtype=torch.long), top_p, sampled, u).tolist() == [1, 2, 0]  # top_k 1
    tiny_p = torch.full((3,), 1e-6, dtype=torch.float64)
    assert sample_rows(l, torch.full((3,), 4), tiny_p, sampled, u).tolist() == [1, 2, 0]  # top_p -> the best
    # top_k 2 never leaves the two highest (ties ordered by id), whatever the draw
    draws = uniforms(torch.full((200,), 5), torch.arange(200))
    picks = {int(sample_rows(l[:1], torch.tensor([2]), top_p[:1], sampled[:1], d[None])) for d in draws}
    assert picks == {1, 2}


def test_uniforms_follow_their_seed_and_step_only():
    steps = torch.arange(4000)
    u = uniforms(torch.full((4000,), 123), steps)
    assert torch.equal(u, uniforms(torch.full((4000,), 123), steps))
    assert not torch.equal(u, uniforms(torch.full((4000,), 124), steps))
    assert not torch.equal(u[1:], uniforms(torch.full((3999,), 124), steps[:-1]))  # no seed is another's shifted
    assert 0 <= float(u.min()) and float(u.max()) < 1
    # a draw from p = (0.5, 0.3, 0.2) four thousand times: frequencies within 3 sigma (~0.025)
    l = torch.log(torch.tensor([0.5, 0.3, 0.2])).expand(4000, 3)
    picks = sample_rows(l, torch.full((4000,), 3), torch.ones(4000, dtype=torch.float64),
                        torch.zeros(4000, dtype=torch.bool), u)
    freq = torch.bincount(picks, minlength=3).double() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), atol=0.025), freq


def test_a_sampled_sequence_does_not_depend_on_its_neighbours(tiny):
    """Sequence 0 samples the same tokens alone (batch 1) as beside other sequences sampled differently, and
    starting its stream again (reset_slot) repeats them."""
    spec, w = tiny.talker_spec, tiny.talker_weights
    prompts = _prompts(spec, [6, 9, 4], seed=4)

    def run(dec, count):
        for b in range(count):
            dec.reset_slot(b)
            dec.prefill_slot(b, tokens=prompts[b][:-1])
        sampling = [SAMPLED, SamplingParams(temperature=1.0, seed=99), GREEDY_PENALTY][:count]
        first = [int(p[-1]) for p in prompts[:count]]
        return [int(dec.step_batch(tokens=first if i == 0 else None, sampling=sampling)[0]) for i in range(10)]

    alone = run(GraphDecoder(spec, w, MAX_SEQ, batch=1, device="cpu"), 1)
    batch = GraphDecoder(spec, w, MAX_SEQ, batch=3, device="cpu")
    assert run(batch, 3) == alone
    assert run(batch, 3) == alone
    assert len(set(alone)) > 1  # it sampled, not a constant


# -- FrameBatch ------------------------------------------------------------------------------------------------
def _prompt(tiny, text):
    return build_prompt(tiny.config, tiny.encode, tiny.text, tiny.talker_weights.embed[0], text, "vivian",
                        text_mode="streaming")


def _join_and_leave(tiny, backend, samplings, max_frames):
    """conftest.join_and_leave over a batch of two on `backend`: each request's codes."""
    talker, predictor = make_decoders(tiny, backend, MAX_SEQ, batch=2, device="cpu")
    return join_and_leave(FrameBatch(tiny, talker, predictor), [_prompt(tiny, t) for t in TEXTS], samplings,
                          max_frames)


def test_frames_over_graphs_equal_the_reference_backend(tiny):
    samplings = [TtsSampling.from_generation_config(tiny.generation, seed=s, greedy=True) for s in (1, 2, 3)]
    max_frames = [5, 7, 4]
    got = _join_and_leave(tiny, "graphs", samplings, max_frames)
    want = _join_and_leave(tiny, "reference", samplings, max_frames)
    for b in range(3):
        assert len(got[b]) == len(want[b]) == max_frames[b], (b, len(got[b]))
        assert all(torch.equal(x, y) for x, y in zip(got[b], want[b])), f"request {b} differs from the reference"
    assert len({tuple(f[0].tolist()) for f in got.values()}) == 3  # the requests differ


def test_sampled_frames_over_graphs_do_not_depend_on_the_schedule(tiny):
    """Sampled requests that join and leave make the frames each makes alone (a batch of one): each has its own
    seeds and random streams."""
    samplings = [TtsSampling.from_generation_config(tiny.generation, seed=s) for s in (4, 5, 6)]
    max_frames = [5, 7, 4]
    got = _join_and_leave(tiny, "graphs", samplings, max_frames)
    for b in range(3):
        talker, predictor = make_decoders(tiny, "graphs", MAX_SEQ, batch=1, device="cpu")
        frames = FrameBatch(tiny, talker, predictor)
        frames.add(0, _prompt(tiny, TEXTS[b]), samplings[b], max_frames[b])
        alone = []
        while frames.requests:
            alone += [codes for codes in frames.step().values() if codes is not None]
        assert len(alone) == len(got[b]) and all(torch.equal(x, y) for x, y in zip(got[b], alone)), \
            f"request {b} depends on its neighbours"


# -- errors ------------------------------------------------------------------------------------------------
def test_bad_arguments_are_one_line_errors(tiny):
    spec, w = tiny.predictor_spec, tiny.predictor_weights
    dec = GraphDecoder(spec, w, 17, batch=2, device="cpu")
    calls = {
        "sequence 2 does not exist": lambda: dec.prefill_slot(2, tokens=[1]),
        "sequence -1 does not exist": lambda: dec.reset_slot(-1),
        "sequence 5 does not exist": lambda: dec.set_suppressed_slot(5, [1]),
        "sampling has 3 entries": lambda: dec.step_batch(tokens=[1, 2], sampling=[SamplingParams()] * 3),
        "active has 1 entries": lambda: dec.step_batch(tokens=[1, 2], active=[True]),
        "tokens has 3 entries": lambda: dec.step_batch(tokens=[1, 2, 3]),
        "positions has 1 entries": lambda: dec.step_batch(tokens=[1, 2], positions=[0]),
        "embeds has": lambda: dec.step_batch(embeds=torch.zeros(3, spec.input_dim)),
        "output head 15 does not exist": lambda: dec.step_batch(tokens=[1, 2], head=15),
        "embedding table 15 does not exist": lambda: dec.step_batch(tokens=[1, 2], table=15),
        "token id 2048": lambda: dec.step_batch(tokens=[1, 2048]),
        "prefill takes tokens or embeds": lambda: dec.prefill_slot(0),
        "past the KV cache length": lambda: dec.prefill_slot(0, tokens=list(range(18))),
        "top_k=": lambda: dec.step_batch(tokens=[1, 2], sampling=SamplingParams(top_k=-1)),
        "batch 0": lambda: GraphDecoder(spec, w, 17, batch=0, device="cpu"),
    }
    for message, call in calls.items():
        with pytest.raises(MkportError, match=message) as e:
            call()
        assert "\n" not in str(e.value)
    assert dec.lengths == [0, 0]  # nothing ran


def test_graphs_is_a_backend_of_batches_only(tiny):
    talker, predictor = make_decoders(tiny, "graphs", MAX_SEQ, batch=2, device="cpu")
    assert isinstance(talker, GraphDecoder) and talker.batch == predictor.batch == 2
    assert predictor.max_seq == tiny.config.num_code_groups + 1
    with pytest.raises(MkportError, match="'graphs' is not supported .graphs decodes batches only.; supported: "
                                          "megakernel, reference$"):
        check_backend("graphs")
    with pytest.raises(MkportError, match="'warp' is not supported; supported: megakernel, reference, graphs$"):
        make_decoders(tiny, "warp", MAX_SEQ, batch=2)


# -- GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_equals_eager_and_step_times():
    """The 0.6B talker at batch 4: the graph replays give the eager step's tokens and hidden states (prompts of
    different lengths, greedy and sampled sequences, some left out of some steps, token and embedding inputs,
    context buckets crossed). Then the step time (embedding inputs, as the frame loop feeds the talker) at
    batch 1, 8 and 32, printed."""
    from mkport.kernel.spec import load_spec
    from mkport.runtime.weights import Checkpoint, load_weights, random_weights_folder

    spec = load_spec("qwen3-tts-0.6b-talker")
    weights = load_weights(spec, Checkpoint.open(random_weights_folder(spec, seed=0))).to("cuda")
    graphs, eager = (GraphDecoder(spec, weights, 256, batch=4, graphs=g) for g in (True, False))
    prompts = _prompts(spec, [5, 12, 14, 9], seed=5)
    sampling = [GREEDY_PENALTY, SAMPLED, SamplingParams(temperature=0.8, seed=3), SamplingParams()]
    gen = torch.Generator().manual_seed(6)
    for dec in (graphs, eager):
        for b, prompt in enumerate(prompts):
            dec.prefill_slot(b, tokens=prompt[:-1])
    for step in range(40):  # the longest sequence goes from 14 to 51 rows: context buckets 16, 32 and 64
        active = [step % 5 != 3, True, step < 30, step >= 4]
        embeds = torch.randn(4, spec.input_dim, generator=gen).cuda() if step % 7 == 6 else None
        tokens = [int(p[-1]) if step == first else None for p, first in zip(prompts, (0, 0, 0, 4))]
        out = [d.step_batch(tokens=tokens, embeds=embeds, sampling=sampling, active=active).tolist()
               for d in (graphs, eager)]
        assert out[0] == out[1], f"step {step}: tokens {out[0]} replayed, {out[1]} eager"
        assert _max_diff(graphs.hidden, eager.hidden) <= HIDDEN_TOL, f"step {step}"
    assert graphs.lengths == eager.lengths and len(graphs._graphs) >= 4

    for batch in (1, 8, 32):
        dec = GraphDecoder(spec, weights, 512, batch=batch)
        for b, prompt in enumerate(_prompts(spec, [140] * batch, seed=7)):
            dec.prefill_slot(b, tokens=prompt)
        embeds = torch.randn(batch, spec.input_dim, device="cuda")
        for _ in range(20):
            dec.step_batch(embeds=embeds, sampling=SAMPLED)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            dec.step_batch(embeds=embeds, sampling=SAMPLED)
        end.record()
        end.synchronize()
        print(f"graphs backend, 0.6B talker, batch {batch}: {start.elapsed_time(end) / 50:.3f} ms a step "
              f"(context 160..210)")
        del dec
