"""The graph-independent half of the CUDA-graph paths, on CPU: padding a prompt (or a codec chunk) at the
end to a fixed length, running it, and keeping the real rows gives what the unpadded run gives. The GPU
half (graph replay against eager) is tests/test_gpu_graphs.py."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_validation_model, validation_inputs
from tolerances import CONTINUATION_TOL, REL_TOL, rel
from mkport.runtime import torch_model
from mkport.runtime.graphs import pad_rows
from mkport.runtime.decoder import PROMPT_KV_ROWS, SequenceState
from mkport.runtime.kv_cache import KvCache, KvLayout, cache_rows
from mkport.kernel.spec import load_spec
from mkport.runtime.torch_decoder import TorchDecoder
from mkport.runtime.weights import Checkpoint, load_weights

CODEC_ATOL = 1e-4  # float32 rounding through the decoder's ~30 layers; about 3 steps of the 16-bit output
MAX_SEQ = 48  # small, so that some buckets are cut to the room left in the cache


def _assert_cache_close(a: torch.Tensor, b: torch.Tensor) -> None:
    """bf16 KV cache rows: a float difference under REL_TOL in the value written can still round it to
    the neighbouring bf16, so each element may differ by one bf16 step, and only a few do (0.104% of the
    0.6B talker's rows at n=5 with transformers 5.24's random model, hence the bound of 0.3%)."""
    torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=0)
    assert float((a != b).float().mean()) < 3e-3


def _folder(model: str) -> str:
    return model.rsplit(":", 1)[0] if model.endswith((":talker", ":code_predictor")) else model


# -- buckets and padding ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n, room, bucket", [(1, 4096, 16), (16, 4096, 16), (17, 4096, 32), (64, 4096, 64), (200, 4096, 256), (200, 210, 210),
                        (5, 8, 8), (40, 40, 40)]
)
def test_prefill_bucket(n, room, bucket):
    assert torch_model.prefill_bucket(n, room) == bucket


@pytest.mark.parametrize("n, room", [(0, 16), (17, 16)])
def test_prefill_bucket_refuses_what_does_not_fit(n, room):
    with pytest.raises(ValueError):
        torch_model.prefill_bucket(n, room)


def test_pad_rows():
    t = torch.arange(6).reshape(3, 2)
    assert pad_rows(t, 3) is t
    assert torch.equal(pad_rows(t, 5), torch.cat([t, torch.zeros(2, 2, dtype=t.dtype)]))
    assert torch.equal(pad_rows(t, 4, dim=1), torch.cat([t, torch.zeros(3, 2, dtype=t.dtype)], dim=1))
    with pytest.raises(ValueError):
        pad_rows(t, 2)


# -- prefill ---------------------------------------------------------------------------------------------
def _model(validation_models, case):
    model = validation_models[case]
    spec = load_spec(model)
    return spec, load_weights(spec, Checkpoint.open(_folder(model)))


def _caches(spec):
    shape = (spec.num_layers, spec.num_kv_heads, MAX_SEQ, spec.head_dim)
    gen = torch.Generator().manual_seed(5)  # stale values, as a reused cache holds
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(2)]


def _inputs(spec, case, n):
    """Token ids, or input embeddings for the TTS decoders (the way the talker is prefilled), and [3, n]
    positions (distinct streams for Qwen3-VL)."""
    inp = validation_inputs(spec, case, n=n, seed=n)
    if case.startswith("tts"):
        gen = torch.Generator().manual_seed(n)
        return torch.randn(n, spec.input_dim, generator=gen) * 0.1, inp["positions"], 0
    return inp["tokens"], inp["positions"], inp["table"]


def _padded_prefill(spec, w, inputs, pos, k, v, start, table, rows, pad_value=0):
    """What Decoder._prefill_replay computes, with the forward run eagerly instead of replayed (and the
    padding filled with `pad_value` instead of zeros, to show that it does not matter)."""
    n = inputs.shape[0]
    inputs = pad_rows(inputs, rows).index_fill(0, torch.arange(n, rows), pad_value)
    hidden = torch_model.prefill_forward(spec, w, inputs, pad_rows(pos, rows, dim=1), k, v, start, table)
    return hidden[:n]


CASES = ("qwen3", "qwen3_vl", "tts_talker", "tts_code_predictor")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("n", [5, 16, 23, 40])
def test_padded_prefill_equals_unpadded(validation_models, case, n):
    """Hidden states and the KV cache rows of the real positions agree (to float rounding: matmuls of a
    different row count may sum in another order), and with the same padded length they do not depend on the padding's values at all. Then a
    continuation (a prompt at start n, as a later prefill, and single tokens, as decode steps) reads only
    real rows, so it agrees too."""
    spec, w = _model(validation_models, case)
    inputs, pos, table = _inputs(spec, case, n)
    bucket = torch_model.prefill_bucket(n, MAX_SEQ)
    k0, v0 = _caches(spec)
    k1, v1 = k0.clone(), v0.clone()
    plain = torch_model.prefill_forward(spec, w, inputs, pos, k0, v0, 0, table)
    padded = _padded_prefill(spec, w, inputs, pos, k1, v1, 0, table, bucket)
    assert rel(padded, plain) < REL_TOL
    _assert_cache_close(k1[:, :, :n], k0[:, :, :n])
    _assert_cache_close(v1[:, :, :n], v0[:, :, :n])
    if bucket > n:  # the padding ran and wrote rows past the real ones; its values reach no real row
        assert not torch.equal(k1[:, :, n:bucket], k0[:, :, n:bucket])
        k2, v2 = k1.clone(), v1.clone()
        other = _padded_prefill(spec, w, inputs, pos, k2, v2, 0, table, bucket, pad_value=3)
        assert torch.equal(other, padded)
        assert torch.equal(k2[:, :, :n], k1[:, :, :n]) and torch.equal(v2[:, :, :n], v1[:, :, :n])

    more, more_pos, _ = _inputs(spec, case, 4)
    more_pos = more_pos - more_pos[:, :1] + pos[:, -1:] + 1
    outs = []
    for k, v in ((k0, v0), (k1, v1)):
        h = [torch_model.prefill_forward(spec, w, more[:2], more_pos[:, :2], k, v, n, table)]
        for t in (2, 3):  # one token at a time at positions n+2, n+3: the decode step's pattern
            h.append(torch_model.prefill_forward(spec, w, more[t : t + 1], more_pos[:, t : t + 1], k, v, n + t, table))
        outs.append(torch.cat(h))
    assert rel(outs[1], outs[0]) < CONTINUATION_TOL


def test_padding_at_the_front_is_caught(validation_models):
    """The comparison above can fail: padding before the prompt shifts what every real row attends to."""
    spec, w = _model(validation_models, "qwen3")
    inputs, pos, table = _inputs(spec, "qwen3", 10)
    k, v = _caches(spec)
    plain = torch_model.prefill_forward(spec, w, inputs, pos, k, v, 0, table)
    front = torch_model.prefill_forward(
        spec, w, torch.cat([torch.zeros(6, dtype=inputs.dtype), inputs]), torch.cat([pos[:, :6], pos], 1), k, v, 0, table
    )[6:]
    assert rel(front, plain) > 1e-2


def test_rope_device_tables_give_the_same_angles():
    spec = load_spec("qwen3-tts-0.6b-talker")  # MRoPE: the stream table matters
    pos = torch.stack([torch.arange(7), torch.arange(7) * 2, torch.arange(7) + 5])
    tables = torch_model.rope_device_tables(spec, "cpu")
    for a, b in zip(torch_model.rope_cos_sin(spec, pos), torch_model.rope_cos_sin(spec, pos, tables)):
        assert torch.equal(a, b)


# -- codec -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_codec(tmp_path_factory):
    from mkport.tts.codec import SpeechDecoder, write_random_codec
    from mkport.tts.model import tiny_configs

    folder = write_random_codec(tmp_path_factory.mktemp("codec"), tiny_configs()[1], seed=1)
    return SpeechDecoder.load(folder)


def _graph_codec(module, tiny_codec, monkeypatch):
    """A SpeechDecoder on `module` (made float32) that takes the graph paths on CPU, with EagerGraphs."""
    from mkport.tts.codec import SpeechDecoder

    monkeypatch.setattr("mkport.tts.codec.capture", _eager_capture)
    dec = SpeechDecoder(module, tiny_codec.upsample, tiny_codec.sample_rate)
    dec.graphs = True
    return dec


@pytest.mark.parametrize("before, frames", [(0, 1), (0, 3), (5, 3), (9, 5), (20, 13), (6, 16)])
def test_padded_last_call_equals_unpadded(tiny_codec, monkeypatch, before, frames):
    """A stream's last call (the flush) padded up to a graph's length (4 or 16 frames here) after `before` frames
    decoded: the tiny decoder's attention window (4 frames) is shorter than the stream, so the window is in play.

    With a float64 decoder the padded call equals the unpadded one up to the output's rounding to float32: padding
    is exact. In float32 the convolutions of another length sum in another order, and through the ~30 layers of
    the decoder that moves samples by up to ~3e-5 (CODEC_ATOL); the padding's values never matter (an unpadded call
    of the same length with other frames after the real ones gives identical samples). A last call leaves the
    stream's own state as it was; any other moves it on."""
    from mkport.tts.codec import SpeechDecoder

    codes = torch.randint(0, tiny_codec.codebook_size, (before + frames, 16), generator=torch.Generator().manual_seed(frames))
    for module, exact in ((copy.deepcopy(tiny_codec.module), True), (tiny_codec.module, False)):
        eager = SpeechDecoder(module, tiny_codec.upsample, tiny_codec.sample_rate)
        graph = _graph_codec(module, tiny_codec, monkeypatch)
        if exact:
            module.double()  # after SpeechDecoder made it float32, before its state and graphs are made
        graph.prepare((4, 16))
        out, kept_of = {}, {}
        for dec in (graph, eager):
            kept = dec.new_stream()
            if before:
                dec.stream(codes[:before], kept)
            saved = [t.clone() for t in kept]
            out[dec] = dec.stream(codes[before:], kept, last=True)
            assert all(torch.equal(a, b) for a, b in zip(saved, kept))
            kept_of[dec] = kept
        padded, plain = out[graph], out[eager]
        assert padded.shape == plain.shape == (frames * tiny_codec.upsample,) and float(plain.std()) > 1e-3
        assert float((padded - plain).abs().max()) <= (6e-8 if exact else CODEC_ATOL)
        pad_to = graph.graph_length(frames)
        noisy = torch.cat([codes[before:], torch.randint(0, tiny_codec.codebook_size, (pad_to - frames, 16))])
        assert torch.equal(eager.stream(noisy, kept_of[eager], last=True)[:plain.numel()], padded)
    moved = eager.new_stream()
    eager.stream(codes[:1], moved)
    assert moved and any(bool(t.any()) for t in moved)  # a fresh stream's state is all zeros


def test_codec_padding_at_the_front_is_caught(tiny_codec):
    codes = torch.randint(0, tiny_codec.codebook_size, (8, 16), generator=torch.Generator().manual_seed(0))
    plain = tiny_codec.decode(codes)
    front = tiny_codec.decode(torch.cat([torch.zeros(4, 16, dtype=codes.dtype), codes]))[4 * tiny_codec.upsample :]
    assert float((front - plain).abs().max()) > 1e-3


def test_codec_graph_lengths(tiny_codec):
    """A StreamingCodec registers a graph for each of its chunk lengths (none captured on CPU); the flush pads to
    the smallest that holds it, and anything longer runs eagerly."""
    from mkport.tts.codec import SpeechDecoder, StreamingCodec

    dec = SpeechDecoder(tiny_codec.module, tiny_codec.upsample, tiny_codec.sample_rate)
    assert not dec.graphs and dec.graph_length(4) is None  # CPU: always eager
    StreamingCodec(dec, first_chunk=4, chunk=16)
    assert dec.graph_frames == {4, 8, 16} and not dec._graphs
    dec.graphs = True  # the bucket choice alone (nothing is captured here)
    assert [dec.graph_length(t) for t in (1, 4, 5, 9, 16, 17)] == [4, 4, 8, 16, 16, None]


@pytest.mark.parametrize("kw", [{}, dict(first_chunk=4, chunk=16), dict(chunk=8), dict(first_chunk=3, chunk=5),
                                dict(first_chunk=7, chunk=3)])
def test_chunk_lengths_are_the_lengths_a_stream_decodes(tiny_codec, kw):
    """chunk_lengths (what the decoder captures graphs for) lists the chunk lengths a stream decodes, in the order
    they first come, up to the steady one; a long stream decodes no other length before its flush."""
    from mkport.tts.codec import StreamingCodec

    codec = StreamingCodec(tiny_codec, **kw)
    decoded = []
    real_stream = tiny_codec.stream
    tiny_codec.stream = lambda codes, kept, last=False: decoded.append(codes.shape[0]) or real_stream(codes, kept, last)
    try:
        for frame in torch.randint(0, tiny_codec.codebook_size, (90, 16), generator=torch.Generator().manual_seed(1)):
            codec.push(frame)
    finally:
        del tiny_codec.stream
    lengths = codec.chunk_lengths()
    assert list(dict.fromkeys(decoded)) == lengths and lengths[-1] == codec.chunk
    assert set(lengths) <= tiny_codec.graph_frames
    if not kw:
        assert lengths == [1, 2, 4, 8, 16]


# -- the replay paths, with the graph replaced by an eager call ------------------------------------------
class EagerGraph:
    """Stands in for a captured graph on CPU: replay() recomputes the output in place from the static
    buffers, as a CUDA graph replay does, so the buffer handling around it is what is tested."""

    def __init__(self, fn):
        self.fn, self.output, self.replays = fn, fn(), 0

    def replay(self):
        self.output.copy_(self.fn())
        self.replays += 1


def _eager_capture(fn, pool, stream=None):
    graph = EagerGraph(fn)
    return graph, graph.output


def _cpu_decoder(spec, w, prefill_graphs: bool, batch: int = 1):
    """A runtime.Decoder with only the state its prefill uses (the real one needs a GPU for its kernel)."""
    from mkport.runtime.decoder import Decoder

    dec = Decoder.__new__(Decoder)
    dec.spec, dec.weights, dec.device, dec.max_seq = spec, w, torch.device("cpu"), MAX_SEQ
    dec.kv = KvCache(KvLayout.of(spec, MAX_SEQ, batch), "cpu")
    gen = torch.Generator().manual_seed(5)  # stale values, as a reused cache holds
    for buffer in (dec.kv.k, dec.kv.v):
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    dec.seen = torch.zeros(batch * spec.vocab_size, dtype=torch.uint8)
    dec.sequences = [SequenceState() for _ in range(batch)]
    dec.shared, dec.prefill_graphs, dec._graph_pool = False, prefill_graphs, None
    dec.fused_prefill = False  # the fused kernels need the GPU (tests/test_gpu_prefill.py)
    dec._linear_attention = None  # and so do a hybrid's Gated DeltaNet kernels (tests/test_gpu_qwen35.py)
    dec._rope_tables = torch_model.rope_device_tables(spec, "cpu")
    dec._prefill_weights = torch_model.prefill_weights(w)
    dec._prefill_graphs, dec._graph_starts = {}, set()
    dec.prompt_kv = torch.zeros(2, spec.num_layers, spec.num_kv_heads, PROMPT_KV_ROWS, spec.head_dim)
    dec.exact_rows, dec.exact_prefix_rows = 0, PROMPT_KV_ROWS
    dec.batch = batch
    dec.linear_state = None  # a hybrid's Gated DeltaNet states; these models have none
    dec.early_inputs = None  # no Phi-3 longrope switch (runtime.rope_switch)
    return dec


def _k_rows(dec, slot: int = 0) -> torch.Tensor:
    """A decoder's K cache of one sequence as [layers, kv_heads, rows, head_dim] (these specs' layers are alike)."""
    return torch.stack(dec.kv.sequence(slot)[0])


def test_prefill_slot_writes_its_own_linear_state(tmp_path):
    """A hybrid batch decoder's prefill_slot advances one sequence's Gated DeltaNet states (the conv's and the delta
    rule's, as a one-sequence TorchDecoder's prefill of the prompt leaves them), from zero at position 0 whatever the
    slot held and from where it was when it continues; the other sequences' stay as they were, and reset_slot zeroes
    its own only."""
    model = make_validation_model(tmp_path, "qwen3_5", seed=3)
    spec = load_spec(model)
    w = load_weights(spec, Checkpoint.open(model))
    dec = _cpu_decoder(spec, w, False, batch=3)
    dec.linear_state = torch_model.LinearState.zeros(spec, "cpu", batch=3)
    dec.linear_state.conv[:, 1].fill_(3.0)  # stale: a slot's earlier request
    dec.linear_state.recurrent[:, 2].fill_(0.5)  # another sequence's, mid-way
    tokens = (torch.arange(13) * 37 + 5) % spec.vocab_size
    alone = TorchDecoder(spec, w, max_seq=MAX_SEQ)  # fp32 K/V
    alone.prefill(tokens=tokens[:9])
    one = _cpu_decoder(spec, w, False)  # a continuation attends to the bf16 cache rows, as the batch's does
    one.linear_state = torch_model.LinearState.zeros(spec, "cpu", batch=1)
    mine = dec.linear_state.sequence(1)
    for part in (tokens[:9], tokens[9:]):
        dec.prefill_slot(1, tokens=part)
        one.prefill_slot(0, tokens=part)
        want = one.linear_state.sequence(0)
        assert rel(mine.conv, want.conv) < 1e-6 and rel(mine.recurrent, want.recurrent) < 1e-6
        if part.shape[0] == 9:  # from zero, not from the stale conv state
            want = alone.linear_state
            assert rel(mine.conv, want.conv) < REL_TOL and rel(mine.recurrent, want.recurrent) < REL_TOL
    assert dec.linear_state.conv[:, 0].abs().sum() == 0 and dec.linear_state.recurrent[:, 0].abs().sum() == 0
    assert dec.linear_state.recurrent[:, 2].eq(0.5).all() and dec.linear_state.conv[:, 2].abs().sum() == 0
    dec.reset_slot(1)
    assert mine.conv.abs().sum() == 0 and mine.recurrent.abs().sum() == 0
    assert dec.linear_state.recurrent[:, 2].eq(0.5).all()


def test_prefill_slot_fills_its_own_sequence_only(validation_models):
    """A batch decoder's prefill_slot writes the K/V of one sequence, after that sequence's length, and returns
    what a one-sequence decoder's prefill returns (one that attends to the bf16 cache rows: a batch keeps no exact
    prompt rows); the other sequences' caches stay as they were."""
    spec, w = _model(validation_models, "tts_code_predictor")
    one = _cpu_decoder(spec, w, False)
    batch = _cpu_decoder(spec, w, False, batch=3)
    before = [_k_rows(batch, slot).clone() for slot in range(3)]
    gen = torch.Generator().manual_seed(4)
    first, second = (torch.randint(1, spec.vocab_size, (n,), generator=gen) for n in (7, 5))
    head = one.prefill(first)
    one.exact_rows = 0
    want = torch.cat([head, one.prefill(second)])
    got = torch.cat([batch.prefill_slot(1, tokens=first), batch.prefill_slot(1, tokens=second)])
    torch.testing.assert_close(got, want)
    assert [q.length for q in batch.sequences] == [0, 12, 0]
    torch.testing.assert_close(_k_rows(batch, 1)[:, :, :12], _k_rows(one)[:, :, :12])
    assert torch.equal(_k_rows(batch, 0), before[0]) and torch.equal(_k_rows(batch, 2), before[2])
    assert batch.seen.view(3, -1)[1].bool().tolist() == one.seen.bool().tolist() and not batch.seen.view(3, -1)[0].any()


def test_decoder_prefill_replay_path(validation_models, monkeypatch):
    """Decoder.prefill through _prefill_replay (graph captured per (start, input kind, table, bucket), inputs
    copied into its buffers at every call, real rows copied out, length and repetition history of the real
    tokens only; a continuation replays a graph of its start) against prefill_graphs=False."""
    monkeypatch.setattr("mkport.runtime.decoder.capture", _eager_capture)
    spec, w = _model(validation_models, "tts_code_predictor")  # 4 embedding tables
    graph, eager = _cpu_decoder(spec, w, True), _cpu_decoder(spec, w, False)
    gen = torch.Generator().manual_seed(9)
    for n in (10, 3, 20, 12):
        tokens = torch.randint(1, spec.vocab_size, (n,), generator=gen)  # 0 is the padding's id
        more = torch.randint(1, spec.vocab_size, (4,), generator=gen)
        out = {}
        for dec in (graph, eager):
            dec.length = 0
            dec.seen.zero_()
            out[id(dec)] = (dec.prefill(tokens, table=1), dec.prefill(more, table=1))
            assert dec.length == n + 4
        assert rel(out[id(graph)][0], out[id(eager)][0]) < REL_TOL
        assert rel(out[id(graph)][1], out[id(eager)][1]) < CONTINUATION_TOL
        assert torch.equal(graph.seen, eager.seen) and int(graph.seen[0]) == 0
        _assert_cache_close(_k_rows(graph)[:, :, : n + 4], _k_rows(eager)[:, :, : n + 4])
    # (slot 0, the one sequence's; start, token input, table, bucket, exact rows): every earlier row exact
    starts = [(0, start, True, 1, 16, start) for start in (3, 10, 12, 20)]
    assert sorted(graph._prefill_graphs) == sorted([(0, 0, True, 1, 16, 0), (0, 0, True, 1, 32, 0)] + starts)
    replays = {key[1:]: graph._prefill_graphs[key][0].replays for key in graph._prefill_graphs}
    assert replays == {(0, True, 1, 16, 0): 3, (0, True, 1, 32, 0): 1, **{key[1:]: 1 for key in starts}}


@pytest.mark.parametrize("case", ["mistral", "ministral"])
def test_a_sliding_decoder_prefills_in_passes_of_its_ring(validation_models, monkeypatch, case):
    """A window of 5 in 48 positions: rings of 20 rows, a 40-row prompt in passes of 16 (the last padded to 16 by its
    graph, the padding writing rows the pass does not read): graph and eager agree, eager equals torch_model on
    full-length caches in the same passes bit for bit, and a ring's rows hold the last positions."""
    monkeypatch.setattr("mkport.runtime.decoder.capture", _eager_capture)
    spec, w = _model(validation_models, case)
    graph, eager = _cpu_decoder(spec, w, True), _cpu_decoder(spec, w, False)
    assert graph.kv.layout.passes(40) == [(0, 16), (16, 32), (32, 40)] and min(graph.kv.layout.rows) == 20
    inputs, pos, table = _inputs(spec, case, 40)
    out = {id(dec): dec.prefill(inputs, positions=pos, table=table) for dec in (graph, eager)}
    assert graph.length == eager.length == 40 and sorted(key[1] for key in graph._prefill_graphs) == [0, 16, 32]
    assert rel(out[id(graph)], out[id(eager)]) < CONTINUATION_TOL
    full = [torch.zeros(spec.num_layers, spec.num_kv_heads, MAX_SEQ, spec.head_dim, dtype=torch.bfloat16)
            for _ in range(2)]
    exact = torch.zeros_like(eager.prompt_kv)  # the first pass's exact rows, as the decoder keeps them
    x = torch_model.embed_inputs(spec, w, inputs, None, table)
    want = torch.cat([torch_model.forward(spec, w, x[a:b], pos[:, a:b], *full, start=a, prompt_kv=exact,
                                          exact=min(a, 16)) for a, b in ((0, 16), (16, 32), (32, 40))])
    assert torch.equal(out[id(eager)], want)
    for i, cache in enumerate(eager.kv.sequence()[0]):  # the last positions a layer holds: its ring's, or all 40
        held = max(0, 40 - cache.shape[1])
        assert torch.equal(cache_rows(cache, held, 40), full[0][i, :, held:40])


def test_a_sliding_batch_prefills_a_slot_in_passes(validation_models):
    """A batch of 3 (rings of 20 rows, full layers of 49: the spare row): sequence 1's 40-row prompt in passes, as
    full-length caches give it (a batch keeps no exact rows); the other sequences' rows untouched."""
    spec, w = _model(validation_models, "ministral")
    batch = _cpu_decoder(spec, w, False, batch=3)
    assert batch.kv.layout.rows == (20, MAX_SEQ + 1, 20)
    before = [tuple(layer.clone() for layer in batch.kv.sequence(slot)[0]) for slot in range(3)]
    inputs, pos, table = _inputs(spec, "ministral", 40)
    got = batch.prefill_slot(1, tokens=inputs, positions=pos, table=table)
    full = [torch.zeros(spec.num_layers, spec.num_kv_heads, MAX_SEQ, spec.head_dim, dtype=torch.bfloat16)
            for _ in range(2)]
    x = torch_model.embed_inputs(spec, w, inputs, None, table)
    passes = ((0, 16), (16, 32), (32, 40))
    want = torch.cat([torch_model.forward(spec, w, x[a:b], pos[:, a:b], *full, start=a) for a, b in passes])
    assert torch.equal(got, want) and [q.length for q in batch.sequences] == [0, 40, 0]
    for slot in (0, 2):
        assert all(torch.equal(a, b) for a, b in zip(batch.kv.sequence(slot)[0], before[slot]))


def test_decoder_prefill_graph_starts_are_bounded(validation_models, monkeypatch):
    """Past PREFILL_GRAPH_STARTS distinct starts other than 0, a prefill runs eagerly (no new graph) and
    gives what the eager decoder gives; the starts that have graphs keep replaying them."""
    monkeypatch.setattr("mkport.runtime.decoder.capture", _eager_capture)
    monkeypatch.setattr("mkport.runtime.decoder.PREFILL_GRAPH_STARTS", 2)
    spec, w = _model(validation_models, "tts_talker")
    graph, eager = _cpu_decoder(spec, w, True), _cpu_decoder(spec, w, False)
    inputs, pos, _ = _inputs(spec, "tts_talker", 12)
    for start in (3, 5, 7, 3):
        out = []
        for dec in (graph, eager):
            dec.length = 0
            dec.prefill(embeds=inputs[:start], positions=pos[:, :start])
            out.append(dec.prefill(embeds=inputs[start:], positions=pos[:, start:]))
        assert rel(out[0], out[1]) < CONTINUATION_TOL
    assert sorted(key[1] for key in graph._prefill_graphs) == [0, 3, 5]  # (slot, start, ...)
    assert graph._prefill_graphs[(0, 3, False, 0, 16, 3)][0].replays == 2


def test_a_prompt_prefilled_in_two_parts_equals_one_pass(validation_models):
    """With the first part's exact K/V kept (Decoder.prompt_kv), a prompt prefilled as a prefix and the rest
    gives what one pass gives, also through cached_rows / load_rows into another decoder (as the prefix
    cache does); attending to the prefix as the bf16 cache holds it instead is ~100x further off."""
    spec, w = _model(validation_models, "tts_talker")
    one, split, loaded = (_cpu_decoder(spec, w, False) for _ in range(3))
    inputs, pos, _ = _inputs(spec, "tts_talker", 12)
    whole = one.prefill(embeds=inputs, positions=pos)
    head = split.prefill(embeds=inputs[:5], positions=pos[:, :5])
    rows = split.cached_rows(5)
    assert len(rows) == 3 and split.exact_rows == 5
    tail = split.prefill(embeds=inputs[5:], positions=pos[:, 5:])
    assert rel(torch.cat([head, tail]), whole) < REL_TOL
    loaded.load_rows(rows)
    assert loaded.exact_rows == 5 and rel(loaded.prefill(embeds=inputs[5:], positions=pos[:, 5:]), tail) == 0
    loaded.length, loaded.exact_rows = 0, 0  # the same rows, attended to as bf16
    loaded.load_rows(rows[:2])
    assert loaded.exact_rows == 0
    assert rel(loaded.prefill(embeds=inputs[5:], positions=pos[:, 5:]), whole[5:]) > 100 * REL_TOL


def test_codec_replay_path(tiny_codec, monkeypatch):
    """SpeechDecoder.stream through the graphs: captured once per decoder, for the chunk lengths of its first
    StreamingCodec (first chunk 2, steady 5: lengths 2, 4, 5), a mid-stream call of a length without a graph run
    eagerly and unpadded, the flush's 3 frames padded to 4; the streamed audio equals the eager decoder's and the
    whole decode."""
    from mkport.tts.codec import StreamingCodec, stream_decode

    dec = _graph_codec(tiny_codec.module, tiny_codec, monkeypatch)
    codes = torch.randint(0, dec.codebook_size, (31, 16), generator=torch.Generator().manual_seed(4))
    kw = dict(first_chunk=2, chunk=5)
    chunks = list(stream_decode(dec, codes, **kw))
    assert [c.numel() // dec.upsample for c in chunks] == [2, 2, 4, 5, 5, 5, 5, 3]
    graphs = {length: graph for length, (graph, _, _) in dec._graphs.items()}
    assert sorted(graphs) == [2, 4, 5] and {n: g.replays for n, g in graphs.items()} == {2: 2, 4: 2, 5: 4}
    plain = torch.cat(list(stream_decode(tiny_codec, codes, **kw)))
    assert float((torch.cat(chunks) - plain).abs().max()) < CODEC_ATOL
    assert float((torch.cat(chunks) - tiny_codec.decode(codes)).abs().max()) < CODEC_ATOL
    # another stream on the decoder captures nothing; a 3-frame call in mid-stream replays no graph
    StreamingCodec(dec, **kw)
    dec.stream(codes[:3], dec.new_stream())
    assert {n: g for n, (g, _, _) in dec._graphs.items()} == graphs
    assert {n: g.replays for n, g in graphs.items()} == {2: 2, 4: 2, 5: 4}
