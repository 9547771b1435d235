"""CUDA graphs against eager on the GPU: the prompt prefill of runtime.Decoder and the speech tokenizer
decoder of tts.codec.SpeechDecoder. Same results (within float rounding), then the times, printed
(`pytest -s`) and required to improve. The padding itself is checked on CPU in tests/test_graphs_cpu.py."""

from __future__ import annotations


import pytest
import torch

from conftest import held_kv
from tolerances import CONTINUATION_TOL, REL_TOL, rel
from mkport.bench.decode import host_ms
from mkport.runtime.decoder import Decoder
from mkport.kernel.spec import load_spec
from mkport.runtime.weights import Checkpoint, load_weights, random_weights_folder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TALKER = "qwen3-tts-0.6b-talker"
PROMPT_LENGTHS = (16, 64, 200)
# graph against eager prefill: the graph's matmuls run on the rows padded to the bucket, which cuBLAS may sum in
# another order; each is within 2e-5 of the float64 product (test_prefill_matmul_is_float32_accurate), and a token
# prompt's 28 layers were seen at 1.02e-5 from each other (a first bound of 1e-5 failed on the H200)
PADDED_ROWS_TOL = 2e-5
CODEC_ATOL = 1e-3  # padded vs unpadded: float32 rounding of convolutions of another length (see below)


def _assert_cache_close(a: torch.Tensor, b: torch.Tensor) -> None:
    """bf16 KV cache rows: a float difference under REL_TOL in the value written can still round it to
    the neighbouring bf16, so an element may differ by one bf16 step of itself, or, near zero, by a step of
    a value 1e-3 of the tensor's largest (measured on the H200: 7.6e-6 and 1.8e-4 against maxima of ~10);
    and only a few differ at all (with fp32 matmuls 0.015% of a 200-row prefill, 0.1% after an eager
    continuation; with the split bf16 matmuls, ~3e-6 from the exact product instead of ~3e-7, 1.6% after
    the continuation)."""
    torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-3 * float(b.float().abs().max()))
    assert float((a != b).float().mean()) < 3e-2
    assert rel(a, b) < 1e-3


def _host_ms(fn, reps: int = 20) -> float:
    """mkport.bench.decode.host_ms after one untimed call (captures the graph on its first use)."""
    fn()
    return host_ms(fn, reps)


# -- prefill ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 16, 128])
def test_prefill_matmul_is_float32_accurate(rows):
    """The prefill's matmul on bf16 weights (x split into two bf16 parts, tensor cores, fp32 accumulation)
    against the float64 product: within 2e-5 relative, as close as fp32 F.linear on the fp32 weights; a
    single bf16 x (no low part) would be ~2e-3 off, so the test can fail."""
    from mkport.runtime.torch_model import linear

    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(3072, 1024, generator=gen) * 0.02).to(torch.bfloat16).cuda()
    x = torch.randn(rows, 1024, generator=gen).cuda() * 3
    exact = x.double() @ w.double().t()
    split = linear(x, w)
    plain = torch.nn.functional.linear(x, w.float())
    coarse = x.to(torch.bfloat16).double() @ w.double().t()
    print(f"\nprefill matmul {rows} rows: split {rel(split, exact):.1e}, fp32 {rel(plain, exact):.1e}, "
          f"bf16 x {rel(coarse, exact):.1e} rel L2 from float64")
    assert split.dtype == torch.float32 and split.shape == (rows, 3072)
    assert rel(split, exact) < 2e-5 and rel(coarse, exact) > 1e-3


@pytest.fixture(scope="module")
def talkers():
    """(graph decoder, eager decoder) of the 0.6B talker, on the same random weights."""
    spec = load_spec(TALKER)
    w = load_weights(spec, Checkpoint.open(random_weights_folder(spec, seed=0)))
    return Decoder(spec, w, max_seq=512), Decoder(spec, w, max_seq=512, prefill_graphs=False)


def _embeds(spec, n: int, seed: int) -> torch.Tensor:
    return (torch.randn(n, spec.input_dim, generator=torch.Generator().manual_seed(seed)) * 0.1).cuda()


def _greedy(dec: Decoder, first_embed: torch.Tensor, steps: int) -> list[int]:
    out = [int(dec.step(embed=first_embed))]
    out += [int(dec.step()) for _ in range(steps - 1)]  # fed back through the codec embedding
    return out


@pytest.mark.parametrize("n", [*PROMPT_LENGTHS, 37])
def test_prefill_graph_matches_eager(talkers, n):
    """Hidden states within 2e-5 relative L2 (PADDED_ROWS_TOL) and the KV cache rows of the prompt to one bf16 step (float
    rounding only: matmuls of the padded row count may sum in another order), the same length, then 24
    identical greedy tokens."""
    graph, eager = talkers
    spec = graph.spec
    embeds = _embeds(spec, n + 1, seed=n)
    hidden = {}
    for dec in talkers:
        dec.reset()
        hidden[dec] = dec.prefill(embeds=embeds[:-1])
    assert graph.length == eager.length == n
    assert rel(hidden[graph], hidden[eager]) < PADDED_ROWS_TOL
    for a, b in zip(held_kv(graph, n), held_kv(eager, n)):
        _assert_cache_close(a, b)
    assert _greedy(graph, embeds[-1], 24) == _greedy(eager, embeds[-1], 24)


def test_prefill_graph_tokens_buckets_and_continuation(talkers):
    """Token prompts (their own graphs), switching buckets and back (graphs share a memory pool), the
    repetition history of real tokens only, and a continuation prefill after a graph one (a graph of its
    start, as the rows after a cached prompt prefix)."""
    graph, eager = talkers
    gen = torch.Generator().manual_seed(1)
    for n in (10, 40, 12, 40):
        tokens = torch.randint(0, graph.spec.vocab_size, (n,), generator=gen)
        more = torch.randint(0, graph.spec.vocab_size, (5,), generator=gen)
        out = {}
        for dec in talkers:
            dec.reset()
            out[dec] = (dec.prefill(tokens), dec.prefill(more))
        assert (graph.seen == eager.seen).all() and int(graph.seen.sum()) == len(set(tokens.tolist() + more.tolist()))
        assert rel(out[graph][0], out[eager][0]) < PADDED_ROWS_TOL
        assert rel(out[graph][1], out[eager][1]) < CONTINUATION_TOL
        _assert_cache_close(*(torch.stack(dec.kv.sequence()[0])[:, :, : n + 5] for dec in (graph, eager)))
    tokens = [key for key in graph._prefill_graphs if key[2]]  # (slot, start, tokens, table, bucket, exact rows)
    assert {key[4] for key in tokens if key[1] == 0} == {16, 64}
    assert {key[1] for key in tokens if key[1]} == {10, 40, 12}


def test_prefill_times(talkers):
    graph, eager = talkers
    rows = []
    for n in PROMPT_LENGTHS:
        embeds = _embeds(graph.spec, n, seed=n)
        times = []
        for dec in talkers:
            def prefill(dec=dec):
                dec.reset()
                dec.prefill(embeds=embeds)
            times.append(_host_ms(prefill))
        rows.append((n, *times))
    print(f"\n{TALKER} prefill (host ms, median of 20): " +
          ", ".join(f"{n} rows: graph {g:.3f} / eager {e:.3f}" for n, g, e in rows))
    for n, g, e in rows:
        assert g < e, f"{n} rows: graph {g:.3f} ms is not faster than eager {e:.3f} ms"


# -- codec -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def codec_folder(tmp_path_factory):
    from mkport.tts.codec import write_random_codec
    from mkport.tts.model import codec_config

    return write_random_codec(tmp_path_factory.mktemp("codec"), codec_config(), seed=0)


def _codec_pair(folder):
    """(graph, eager) SpeechDecoders of the full-size 12 Hz decoder with random weights; the graph one has the
    default StreamingCodec's chunk lengths captured (1, 2, 4, 8 and 16 frames), once for the decoder."""
    from mkport.tts.codec import SpeechDecoder, StreamingCodec

    graph, eager = SpeechDecoder.load(folder, "cuda"), SpeechDecoder.load(folder, "cuda", graphs=False)
    StreamingCodec(graph)
    captured = dict(graph._graphs)
    StreamingCodec(graph)
    assert graph.graph_frames == set(graph._graphs) == {1, 2, 4, 8, 16}
    assert all(graph._graphs[n] is captured[n] for n in captured)  # the second codec captured nothing
    assert eager.graph_length(4) is None
    return graph, eager


@pytest.fixture(scope="module")
def codecs(codec_folder):
    """Graphs captured with full float32 convolutions (see no_tf32; the tests that use this pair run so)."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        return _codec_pair(codec_folder)
    finally:
        torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def no_tf32():
    """Full float32 convolutions, so that eager runs of different lengths differ by float32 rounding only
    (cuDNN's TF32 default rounds inputs to 10 bits, in an order that depends on the length)."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = saved


def _codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("before, frames, last", [(0, 1, False), (1, 1, False), (2, 2, False), (4, 4, False),
                                                  (8, 8, False), (16, 16, False), (20, 5, True), (9, 13, True),
                                                  (3, 1, True)])
def test_codec_graph_matches_eager(codecs, no_tf32, before, frames, last):
    """A stream call of `frames` after `before` frames decoded: the replay (the flush, `last`, padded up to a graph
    length) equals eager at the same (padded) length, and the tail of the eager whole decode to float32 rounding (on
    CPU, tests/test_graphs_cpu.py shows the padding exact in float64)."""
    from mkport.runtime.graphs import pad_rows

    graph, eager = codecs
    codes = _codes(before + frames, seed=before + frames)
    length = graph.graph_length(frames) if last else frames
    assert length in graph._graphs
    kept = {dec: dec.new_stream() for dec in codecs}
    for dec in codecs:
        if before:
            dec.stream(codes[:before], kept[dec])
    replayed = graph.stream(codes[before:], kept[graph], last=last)
    same_length = eager.stream(pad_rows(codes[before:], length), kept[eager], last=last)[:frames * graph.upsample]
    whole = eager.decode(codes)[before * graph.upsample:]
    print(f"\ncodec {frames} frames after {before} (replayed at {length}): graph vs eager same length "
          f"{float((replayed - same_length).abs().max()):.2e}, vs whole {float((replayed - whole).abs().max()):.2e} max abs")
    assert replayed.shape == whole.shape == (frames * graph.upsample,)
    assert rel(replayed, same_length) < REL_TOL
    assert rel(replayed, whole) < 1e-4 and float((replayed - whole).abs().max()) < CODEC_ATOL
    assert float(whole.std()) > 1e-3


def test_streamed_codec_graph_matches_eager(codecs, no_tf32):
    """70 frames streamed (chunks 1, 1, 2, 4, 8, 16, 16, 16, the flush's 6 padded to 8 on the graph decoder): the
    graph decoder's audio equals the eager one's and the whole decode, to float32 rounding."""
    from mkport.tts.codec import stream_decode

    graph, eager = codecs
    codes = _codes(70, seed=70)
    chunks = [list(stream_decode(dec, codes)) for dec in codecs]
    assert [c.numel() for c in chunks[0]] == [c.numel() for c in chunks[1]] == [n * 1920 for n in (1, 1, 2, 4, 8, 16, 16, 16, 6)]
    streamed = [torch.cat(c) for c in chunks]
    whole = eager.decode(codes)
    print(f"\ncodec streamed 70 frames: graph vs eager {float((streamed[0] - streamed[1]).abs().max()):.2e}, "
          f"graph vs whole {float((streamed[0] - whole).abs().max()):.2e} max abs")
    assert float((streamed[0] - streamed[1]).abs().max()) < CODEC_ATOL
    assert rel(streamed[0], whole) < 1e-4 and float((streamed[0] - whole).abs().max()) < CODEC_ATOL


def test_codec_times(codec_folder):
    """A stream's 1- and 16-frame chunk calls, with cuDNN's defaults (TF32 on), as served; graphs captured here
    under the same. Printed for docs; the replay must be faster than eager."""
    graph, eager = _codec_pair(codec_folder)
    rows = []
    for frames in (1, 16):
        codes = _codes(frames, seed=frames)
        kept = {dec: dec.new_stream() for dec in (graph, eager)}
        rows.append((frames, _host_ms(lambda: graph.stream(codes, kept[graph])),
                     _host_ms(lambda: eager.stream(codes, kept[eager]))))
    print("\ncodec stream chunk (host ms, median of 20): " +
          ", ".join(f"{f} frames: graph {g:.3f} / eager {e:.3f}" for f, g, e in rows))
    for f, g, e in rows:
        assert g < e, f"{f} frames: graph {g:.3f} ms is not faster than eager {e:.3f} ms"


def _decode_in_turns(streams, utterances: list, firsts: list[int], turns: int) -> list[torch.Tensor]:
    """A frame a call of each utterance from its first call on, utterance i in stream i (reset at its first frame),
    for `turns` calls: each utterance's samples."""
    got = [[] for _ in utterances]
    for turn in range(turns):
        live = [i for i, (codes, first) in enumerate(zip(utterances, firsts)) if 0 <= turn - first < codes.shape[0]]
        for i in live:
            if turn == firsts[i]:
                streams.reset(i)
        audio = streams.decode(live, torch.stack([utterances[i][turn - firsts[i]] for i in live]))
        for i, chunk in zip(live, audio):
            got[i].append(chunk)
    return [torch.cat(g) for g in got]


@pytest.mark.parametrize("compiled", [False, True], ids=["graphs", "compiled"])
def test_codec_streams_graphs_match_whole_decodes(codec_folder, no_tf32, compiled):
    """CodecStreams on CUDA (one graph of 4 rows, those of absent streams padded): three streams a frame a call, one
    joining late, each equal to the eager whole decode of its frames to float32 rounding, and bit for bit to the
    same frames decoded alone in another row; also with the graph capturing torch.compile's fusion of the call
    (`serve --compile-codec`; written without a GPU at hand, not run yet)."""
    from mkport.tts.codec import CodecStreams, SpeechDecoder

    graph_decoder = SpeechDecoder.load(codec_folder, "cuda", compiled=compiled)
    eager = SpeechDecoder.load(codec_folder, "cuda", graphs=False)
    streams = CodecStreams(graph_decoder, 4)
    streams.prepare()
    utterances = [_codes(20, seed=s) for s in (1, 2, 3)]
    got = _decode_in_turns(streams, utterances, [0, 0, 5], 25)
    for i, codes in enumerate(utterances):
        whole = eager.decode(codes)
        streamed = got[i]
        print(f"\ncodec streams, utterance {i}: {float((streamed - whole).abs().max()):.2e} max abs from the whole decode")
        assert streamed.shape == whole.shape and rel(streamed, whole) < 1e-4
        assert float((streamed - whole).abs().max()) < CODEC_ATOL
        streams.reset(3)
        alone = torch.cat([streams.decode([3], frame[None])[0] for frame in codes])
        assert torch.equal(alone, streamed), f"utterance {i}: other samples alone than with other streams"


def test_sized_codec_streams_graphs_match_whole_decodes(codec_folder, no_tf32):
    """CodecStreams(sized=True) on CUDA, a graph for each of 1, 2, 4 and 8 rows: streams joining one after another, so
    each stream's calls change size; each stream equal to the eager whole decode of its frames to float32 rounding,
    and the same frames through the eager sized calls the same (graph against eager); how far a stream's samples
    are from the ones it gets alone (one row a call) is printed, what the sized server gives up."""
    from mkport.tts.codec import CodecStreams, SpeechDecoder

    graph_decoder, eager = SpeechDecoder.load(codec_folder, "cuda"), SpeechDecoder.load(codec_folder, "cuda", graphs=False)
    utterances = [_codes(16, seed=s) for s in (1, 2, 3, 4, 5)]
    firsts = [0, 2, 3, 4, 6]

    def run(decoder):
        streams = CodecStreams(decoder, 8, sized=True)
        streams.prepare()
        return _decode_in_turns(streams, utterances, firsts, 22)

    graphed, eagerly = run(graph_decoder), run(eager)
    lone = CodecStreams(graph_decoder, 8, sized=True)
    lone.prepare()
    for i, codes in enumerate(utterances):
        whole = eager.decode(codes)
        assert graphed[i].shape == whole.shape and rel(graphed[i], whole) < 1e-4
        assert float((graphed[i] - whole).abs().max()) < CODEC_ATOL
        assert torch.equal(graphed[i], eagerly[i]), f"utterance {i}: the graphs' samples are not the eager calls'"
        lone.reset(7)
        alone = torch.cat([lone.decode([7], frame[None])[0] for frame in codes])
        print(f"\nsized codec streams, utterance {i}: {float((graphed[i] - alone).abs().max()):.2e} max abs from "
              "its calls alone")


def test_codec_streams_turns_of_n_frames_alone_and_with_others_bit_for_bit(codec_folder):
    """A batched server's codec calls with turns of 4 frames (test_codec_decoder._serve_turns: chunks 1, 3, 4, ... of
    each stream's own count, a last one padded with code 0), on CUDA with a graph a length, TF32 as served: a stream
    among others gives the bytes it gives alone in another row (the promise --frames-per-turn keeps on the GPU).
    Written without a GPU at hand (the session that added turns of N frames had no device time): not run yet."""
    from test_codec_decoder import _serve_turns

    from mkport.tts.codec import CodecStreams, SpeechDecoder, turn_chunk_lengths

    decoder = SpeechDecoder.load(codec_folder, "cuda")
    utterances = [_codes(n, seed=s) for n, s in ((13, 1), (6, 2), (2, 3), (9, 4))]
    plan = [(0, utterances[0], 0), (1, utterances[1], 1), (2, utterances[2], 1), (2, utterances[3], 3)]
    streams = CodecStreams(decoder, 4)
    streams.prepare(turn_chunk_lengths(4))
    got = _serve_turns(streams, plan, 4)
    for (slot, codes, _), chunks in zip(plan, got):
        lone = CodecStreams(decoder, 4)
        lone.prepare(turn_chunk_lengths(4))
        alone = _serve_turns(lone, [(3, codes, 0)], 4)[0]
        assert torch.equal(torch.cat(chunks), torch.cat(alone)), f"slot {slot}: other samples alone than with others"


def test_codec_streams_times(codec_folder):
    """A frame of n streams in one CodecStreams call against the chunk calls a stream decodes alone (StreamingCodec's
    graphs; TF32 on, as served): printed for docs/benchmarks.md; a call of 32 streams must cost less than 32 calls
    of one."""
    from mkport.tts.codec import CodecStreams, SpeechDecoder, StreamingCodec

    decoder = SpeechDecoder.load(codec_folder, "cuda")
    StreamingCodec(decoder)
    times = {}
    for n in (1, 4, 8, 16, 32):
        streams, frames = CodecStreams(decoder, n), _codes(n, seed=n)
        streams.prepare()
        times[n] = _host_ms(lambda: streams.decode(list(range(n)), frames))
    sized = CodecStreams(decoder, 16, sized=True)  # a sized call of one stream costs a call of one row
    sized.prepare()
    times["1 of 16, sized"] = _host_ms(lambda: sized.decode([0], _codes(1, seed=1)))
    kept = decoder.new_stream()
    chunks = {f: _host_ms(lambda: decoder.stream(_codes(f, seed=f), kept)) for f in (1, 16)}
    print("\ncodec streams, a frame of n streams in one call of n rows (host ms, median of 20): " +
          ", ".join(f"n={n}: {t:.3f}" for n, t in times.items()) +
          "; a stream's chunk calls alone: " + ", ".join(f"{f} frames {t:.3f}" for f, t in chunks.items()))
    assert times[32] < 32 * times[1]
    assert times["1 of 16, sized"] < times[16]
