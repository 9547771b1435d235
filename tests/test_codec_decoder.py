"""mkport's own 12 Hz codec decoder (mkport/tts/codec_decoder.py) against the official one (PyPI `qwen-tts-hf`,
loaded by mkport.tts.official) on the same random safetensors, whole and streamed, on CPU; the checkpoint
layout both read; bad speech tokenizer folders; and `mkport speak` with the official package unimportable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import official_qwen_tts
from tolerances import rel
from mkport.errors import MkportError
from mkport.runtime.graphs import pad_rows
from mkport.tts.codec import SpeechDecoder, stream_decode, write_random_codec
from mkport.tts.codec_decoder import CodecDecoder, CodecDecoderConfig
from mkport.tts.model import codec_config, tiny_configs

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # the official code's, about transformers
needs_official = pytest.mark.skipif(not official_qwen_tts.installed(), reason=official_qwen_tts.SKIP_REASON)
needs_cpu_compile = pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++")) or not Path(sysconfig.get_paths()["include"], "Python.h").exists(),
    reason="torch.compile's CPU kernels need a C++ compiler and Python's headers")
# float32 rounding through the decoder's ~30 layers, measured: mkport's float32 decode may be at most this many
# times as far from the official decoder run in float64 as the official float32 decode is (each sums in its own
# order; the two float32 decodes differ by ~2e-5 relative L2, a wrong weight by more than 1e-3)
FLOAT32_ROUNDING = 2.0
# the same audio decoded in chunks of other lengths: the convolutions of another length sum in another order
CHUNKING_REL = 1e-4
# torch.compile's fused kernels sum in their own order too (1.2e-5 seen on the tiny decoder)
COMPILED_REL = 1e-4


def _assert_float32_rounding(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor, what) -> None:
    """got (mkport, float32) as close to exact (the official decoder in float64) as want (official, float32) is."""
    ours, theirs = rel(got, exact), rel(want, exact)
    assert ours <= FLOAT32_ROUNDING * theirs + 2e-6, (what, f"mkport {ours:.2e}, official {theirs:.2e} from float64")


def _codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny codec (1 transformer layer with a 4-frame window, thin channels, the real 1920x upsampling)."""
    return write_random_codec(tmp_path_factory.mktemp("codec") / "tiny", tiny_configs()[1], seed=5)


@pytest.fixture(scope="module")
def full_folder(tmp_path_factory):
    """The released decoder's configuration (8 layers, 72-frame window, 1536 channels)."""
    return write_random_codec(tmp_path_factory.mktemp("codec") / "full", codec_config(), seed=6)


def test_load_skips_the_random_init_and_keeps_every_tensor(tiny_folder):
    """SpeechDecoder.load builds the module on the meta device and takes the checkpoint's tensors: nothing is
    left on the meta device (the RoPE buffer no checkpoint holds is computed), and the audio equals a module
    built and initialised normally, then loaded."""
    from safetensors.torch import load_file

    from mkport.tts.codec import build_decoder, read_codec_config

    loaded = SpeechDecoder.load(tiny_folder)
    assert not any(t.is_meta for t in [*loaded.module.parameters(), *loaded.module.buffers()])
    cfg = read_codec_config(tiny_folder)
    plain = build_decoder(tiny_folder / "config.json", cfg)
    plain.load_state_dict({k.removeprefix("decoder."): v for k, v in load_file(tiny_folder / "model.safetensors").items()})
    codes = _codes(9, seed=3)
    assert torch.equal(loaded.decode(codes), SpeechDecoder(plain, loaded.upsample, loaded.sample_rate).decode(codes))


@needs_cpu_compile
def test_compiled_stream_calls_decode_as_the_module_does(tiny_folder, tmp_path, monkeypatch):
    """codec.compiled_stream (what `serve --compile-codec` captures in its graphs): torch.compile's fusion of
    CodecDecoder.stream, in one graph (the weight-only values computed inside it), gives the module's samples and
    leaves the module's state, to float32 rounding, call after call, at two call shapes and on the one-stream state
    (views of row 0); and a weight written in place reaches it (its parameters are read, not frozen). On the CPU (inductor's C++ kernels; the GPU's are Triton's)."""
    from mkport.tts.codec import compiled_stream
    from mkport.tts.codec_decoder import StreamState

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    module = SpeechDecoder.load(tiny_folder).module
    explained = torch._dynamo.explain(module.stream)(_codes(1, seed=1).t()[None], StreamState(module, 1))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    call = compiled_stream(module)
    eager_state, compiled_state = StreamState(module, 3), StreamState(module, 3)
    eager_state.rows = compiled_state.rows = torch.tensor([2, 0])
    codes = torch.stack([_codes(13, seed=s).t() for s in (1, 2)])  # [2, Q, 13]
    with torch.no_grad():
        start = 0
        for n in (1, 1, 4, 4, 1, 1):
            piece = codes[:, :, start:start + n]
            want, got = module.stream(piece, eager_state), call(piece, compiled_state)
            assert rel(got, want) < COMPILED_REL, (start, n)
            start += n
        for eager_kept, compiled_kept in zip(eager_state._kept.values(), compiled_state._kept.values()):
            for a, b in zip(eager_kept, compiled_kept):
                assert rel(b, a) < COMPILED_REL
        assert torch.equal(eager_state.position, compiled_state.position)
        snake = next(m for m in module.modules() if type(m).__name__ == "Snake")
        snake.alpha.add_(0.5)
        piece = codes[:, :, start:start + 1]
        want, got = module.stream(piece, eager_state), call(piece, compiled_state)
        assert rel(got, want) < COMPILED_REL
        snake.alpha.sub_(0.5)
        assert rel(call(piece, compiled_state), got) > 100 * COMPILED_REL  # the test can tell a stale weight
        # SpeechDecoder's one-stream state: row 0 through views (rows None), written in place
        eager_one, compiled_one = StreamState(module, 1), StreamState(module, 1)
        eager_one.rows = compiled_one.rows = None
        for t in range(3):
            piece = codes[1:, :, t:t + 1]
            assert rel(call(piece, compiled_one), module.stream(piece, eager_one)) < COMPILED_REL, t
        *kept, position = compiled_one.row(0)
        *eager_kept, eager_position = eager_one.row(0)
        assert all(rel(a, b) < COMPILED_REL for a, b in zip(kept, eager_kept)) and torch.equal(position, eager_position)


@needs_cpu_compile
def test_dynamic_rows_compile_once_for_every_call_of_two_rows_and_more(tiny_folder, tmp_path, monkeypatch):
    """compiled_stream(dynamic_rows=True), the cold-start variant scripts/codec_compile_ab.py times: calls of 2, 4
    and 8 rows share one compile (the static default compiles each), and each gives the module's samples to float32
    rounding. Compiles counted by dynamo's graph counter."""
    from mkport.tts.codec import compiled_stream
    from mkport.tts.codec_decoder import StreamState

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    module = SpeechDecoder.load(tiny_folder).module
    call = compiled_stream(module, dynamic_rows=True)
    codes = torch.stack([_codes(2, seed=s).t() for s in range(8)])  # [8, Q, 2]
    compiles = []
    with torch.no_grad():
        for rows in (2, 4, 8):
            eager_state, compiled_state = StreamState(module, 8), StreamState(module, 8)
            eager_state.rows = compiled_state.rows = torch.arange(rows)
            before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            got = call(codes[:rows, :, :1], compiled_state)
            compiles.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
            assert rel(got, module.stream(codes[:rows, :, :1], eager_state)) < COMPILED_REL, rows
    assert compiles == [1, 0, 0]


def test_a_failed_compile_is_one_line(tiny_folder, monkeypatch):
    """torch.compile's own failure (pages of inductor's trace) reaches `serve --compile-codec` as one line naming the
    call, the backend's own error (which a backend failure wraps under a first line that says nothing) and the way
    out."""
    from mkport.tts.codec import compiled_stream
    from mkport.tts.codec_decoder import StreamState

    def inductor():
        pass

    def failing_compile(fn, **options):
        def run(*args):
            cause = RuntimeError("operation not permitted when stream is capturing\nand pages of the backend's trace")
            raise torch._dynamo.exc.BackendCompilerFailed(inductor, cause, None)
        return run

    monkeypatch.setattr(torch, "compile", failing_compile)
    module = SpeechDecoder.load(tiny_folder).module
    with pytest.raises(MkportError) as raised:
        compiled_stream(module)(_codes(1, seed=1).t()[None], StreamState(module, 1))
    message = str(raised.value)
    assert "\n" not in message and message.startswith("--compile-codec: torch.compile failed on a codec call of "
                                                       "(1, 16, 1) codes") and "serve with --no-compile-codec" in message
    assert "(RuntimeError: operation not permitted when stream is capturing)" in message


def test_a_compiled_speech_decoder_needs_cuda_graphs(tiny_folder):
    with pytest.raises(MkportError, match="needs CUDA graphs"):
        SpeechDecoder.load(tiny_folder, compiled=True)


def test_weight_only_values_are_computed_once_and_follow_the_weights(tiny_folder):
    """Snake factors and codebook entries (mkport.tts.codec_decoder.derived) are not recomputed at each decode
    (no exp, reciprocal or division launched the second time), but a weight written in place afterwards
    changes the audio exactly as in a decoder loaded with that weight."""
    from torch.profiler import ProfilerActivity, profile

    decoder = SpeechDecoder.load(tiny_folder)
    codes = _codes(5, seed=9)
    decoder.decode(codes)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        first = decoder.decode(codes)
    launched = [e.name for e in prof.events()]
    assert not set(launched) & {"aten::exp", "aten::reciprocal", "aten::div"}, launched
    assert launched.count("aten::clamp") == 1  # the output's to [-1, 1]; the codebooks' usage clamps are kept
    snake = next(m for m in decoder.module.modules() if type(m).__name__ == "Snake")
    codebook = next(m for m in decoder.module.modules() if type(m).__name__ == "Codebook")
    with torch.no_grad():
        snake.alpha.add_(0.5)
        codebook.embedding_sum.mul_(2.0)
    changed = decoder.decode(codes)
    fresh = SpeechDecoder.load(tiny_folder)
    fresh_snake = next(m for m in fresh.module.modules() if type(m).__name__ == "Snake")
    fresh_codebook = next(m for m in fresh.module.modules() if type(m).__name__ == "Codebook")
    with torch.no_grad():
        fresh_snake.alpha.add_(0.5)
        fresh_codebook.embedding_sum.mul_(2.0)
    assert not torch.equal(changed, first)
    assert torch.equal(changed, fresh.decode(codes))


# -- against the official decoder -----------------------------------------------------------------------
@needs_official
@pytest.mark.parametrize("size", ["tiny", "full"])
def test_decode_equals_official(size, tiny_folder, full_folder):
    """Whole utterances of several lengths (the tiny one's 90 frames are far past its 4-frame window): mkport's
    SpeechDecoder against the official `Qwen3TTSTokenizerV2Model.decode`, within float32 rounding."""
    folder = tiny_folder if size == "tiny" else full_folder
    ours = SpeechDecoder.load(folder)
    theirs = official_qwen_tts.build_codec_decoder(folder)
    theirs64 = official_qwen_tts.build_codec_decoder(folder).double()
    for frames in ((1, 7, 90) if size == "tiny" else (1, 24)):
        codes = _codes(frames, seed=frames)
        want = official_qwen_tts.codec_decode(theirs, folder, codes)
        got = ours.decode(codes)
        assert got.shape == want.shape == (frames * 1920,)
        assert float(want.std()) > 1e-3, "silent output: the comparison would prove little"
        _assert_float32_rounding(got, want, official_qwen_tts.codec_decode(theirs64, folder, codes), frames)


@needs_official
def test_streamed_equals_official_decode(tiny_folder):
    """mkport's StreamingCodec with its default chunks (1, 1, 2, 4, 8, 16, 16, ...) against the official decode of the
    whole utterance, within float32 rounding. The utterance is longer than the official 300-frame chunk: the official
    decode cuts it into [0, 300) and [275, 340) with 25 frames of left context, which is its whole decode for the tiny
    decoder (its reach, about 12 frames, is inside those 25), so the seam is checked too. mkport's stream keeps the
    decoder's state instead of a left context, so it is the whole decode for a decoder of any reach; a mirror of the
    official 25-frame seams would only reproduce their error on the released decoder (72-frame attention window)."""
    ours = SpeechDecoder.load(tiny_folder)
    theirs = official_qwen_tts.build_codec_decoder(tiny_folder)
    codes = _codes(340, seed=1)
    want = official_qwen_tts.codec_decode(theirs, tiny_folder, codes)
    exact = official_qwen_tts.codec_decode(official_qwen_tts.build_codec_decoder(tiny_folder).double(), tiny_folder, codes)
    streamed = list(stream_decode(ours, codes))
    assert len(streamed) == 5 + 20 + 1  # 1, 1, 2, 4, 8, twenty chunks of 16, the flush's 4
    _assert_float32_rounding(torch.cat(streamed), want, exact, "streamed")


@needs_official
def test_same_checkpoint_layout_as_official(tiny_folder):
    """Every tensor name and shape of the official decoder, in its order (so a released speech tokenizer loads
    and the random weights are those of the official module randomised the same way)."""
    from mkport.tts.official import load

    official = load()
    raw = tiny_configs()[1]["decoder_config"]
    theirs = official.codec_modeling.Qwen3TTSTokenizerV2Decoder._from_config(
        official.codec_configuration.Qwen3TTSTokenizerV2DecoderConfig(**raw))
    ours = CodecDecoder(CodecDecoderConfig.from_dict(raw))
    assert [(k, tuple(v.shape)) for k, v in ours.state_dict().items()] == \
        [(k, tuple(v.shape)) for k, v in theirs.state_dict().items()]


@needs_official
def test_a_wrong_weight_is_seen_by_the_oracle(tiny_folder, tmp_path):
    """The comparison can fail: one codebook entry changed in mkport's copy only moves the audio of the frames
    that use it far outside float32 rounding."""
    ours = SpeechDecoder.load(tiny_folder)
    theirs = official_qwen_tts.build_codec_decoder(tiny_folder)
    codes = _codes(12, seed=2)
    with torch.no_grad():
        ours.module.quantizer.rvq_rest.vq.layers[3]._codebook.embedding_sum[codes[5, 4]] += 1.0
    assert rel(ours.decode(codes), official_qwen_tts.codec_decode(theirs, tiny_folder, codes)) > 1e-3


# -- without the official package ------------------------------------------------------------------------
def test_random_codec_is_seeded_and_scaled(tmp_path):
    """write_random_codec: the same seed writes the same tensors, another seed others; the output level is
    about the 0.1 it is calibrated to."""
    from safetensors.torch import load_file

    cfg = tiny_configs()[1]
    a, b, c = (load_file(str(write_random_codec(tmp_path / name, cfg, seed) / "model.safetensors"))
               for name, seed in (("a", 1), ("b", 1), ("c", 2)))
    assert a.keys() == b.keys() == c.keys() and all(k.startswith("decoder.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["decoder.decoder.0.conv.weight"], c["decoder.decoder.0.conv.weight"])
    audio = SpeechDecoder.load(tmp_path / "a").decode(_codes(20, seed=3))
    assert 0.03 < float(audio.std()) < 0.3


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda cfg, st: cfg["decoder_config"].pop("codebook_dim"), "lacks codebook_dim"),
        (lambda cfg, st: cfg["decoder_config"].update(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (lambda cfg, st: cfg["decoder_config"].update(upsample_rates=[8, "5"]), "upsample_rates"),
        (lambda cfg, st: cfg["decoder_config"].update(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (lambda cfg, st: cfg["decoder_config"].update(rope_scaling={"rope_type": "yarn"}), "rope_scaling"),
        (lambda cfg, st: cfg.update(decode_upsample_rate=960), "decode_upsample_rate 960"),
        (lambda cfg, st: cfg.pop("decoder_config"), "no decoder_config"),
        (lambda cfg, st: cfg["decoder_config"].update(latent_dim=48), "has shape"),
        (lambda cfg, st: st.pop("decoder.pre_conv.conv.bias"), "'decoder.pre_conv.conv.bias' missing"),
        (lambda cfg, st: st.update({"decoder.extra.weight": torch.zeros(1)}), "'decoder.extra.weight' is not part"),
    ],
)
def test_bad_speech_tokenizer_folder(tiny_folder, tmp_path, change, needle):
    """One MkportError line naming what is wrong, never a traceback from torch."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((tiny_folder / "config.json").read_text())
    state = load_file(str(tiny_folder / "model.safetensors"))
    change(cfg, state)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(MkportError) as e:
        SpeechDecoder.load(tmp_path)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_damaged_speech_tokenizer_files(tiny_folder, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes((tiny_folder / "model.safetensors").read_bytes())
    with pytest.raises(MkportError, match="not valid JSON"):
        SpeechDecoder.load(tmp_path)
    (tmp_path / "config.json").write_text((tiny_folder / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes((tiny_folder / "model.safetensors").read_bytes()[:5000])
    with pytest.raises(MkportError, match="not a readable safetensors file"):
        SpeechDecoder.load(tmp_path)


def test_speak_without_the_official_package(tmp_path):
    """`mkport speak --backend reference --random-weights tiny` in a process where `import qwen_tts` (and any
    of its modules, by any name) fails, as after the README's first command: a WAV of the frames asked for,
    and neither the official code nor mkport's adapter to it (mkport.tts.official) imported."""
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('qwen_tts', 'faster_qwen3_tts'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import mkport.cli\n"
        "sys.argv[0] = 'mkport'\n"
        "try:\n"
        "    mkport.cli.main()\n"
        "finally:\n"
        "    loaded = [m for m, mod in sys.modules.items() if m == 'mkport.tts.official'\n"
        "              or 'qwen_tts' in m or 'qwen_tts' in str(getattr(mod, '__file__', ''))]\n"
        "    print('official modules loaded:', loaded, file=sys.stderr)\n"
    )
    out = tmp_path / "o.wav"
    env = dict(os.environ, MKPORT_CACHE=str(tmp_path / "cache"))
    argv = ["speak", "Hi", "--random-weights", "tiny", "--backend", "reference", "--max-frames", "4", "--out", str(out)]
    r = subprocess.run([sys.executable, "-c", blocker, *argv], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "official modules loaded: []" in r.stderr and "Warning" not in r.stderr
    from mkport.tts import wav

    rate, samples = wav.read_wav(out)
    assert rate == 24000 and samples.size == 4 * 1920 and float(samples.std()) > 1e-3


# -- streaming with the state kept ---------------------------------------------------------------------------
def test_stream_with_state_equals_one_decode_of_all_frames(tiny_folder):
    """CodecDecoder.stream in calls of 1 to 16 frames, three streams in rows out of order, gives the samples of one
    forward() of all the frames (float64: the same sums, up to the last bits), far past the tiny decoder's 4-frame
    attention window; a row reset starts a new utterance that owes nothing to what the row decoded before."""
    from mkport.tts.codec_decoder import StreamState

    module = SpeechDecoder.load(tiny_folder).module.double()
    codes = torch.stack([_codes(40, seed=s).t() for s in (1, 2, 3)])  # [3, Q, 40]
    with torch.no_grad():
        whole = module(codes)
        state = StreamState(module, 4)
        state.rows = torch.tensor([2, 0, 3])
        pieces, start = [], 0
        for n in (1, 1, 2, 4, 7, 9, 16):
            pieces.append(module.stream(codes[:, :, start:start + n], state))
            start += n
        assert rel(torch.cat(pieces, dim=-1), whole) < 1e-12
        state.reset(0)
        state.rows = torch.tensor([0])
        again = torch.cat([module.stream(codes[2:3, :, t:t + 1], state) for t in range(6)], dim=-1)
        assert rel(again, whole[2:3, :, :6 * 1920]) < 1e-12
        # without the state, the same calls are another decode: the test can tell
        fresh = torch.cat([module.stream(codes[:1, :, t:t + 1], StreamState(module, 1)) for t in range(6)], dim=-1)
        assert rel(fresh, whole[:1, :, :6 * 1920]) > 1e-3


def _float64(folder) -> SpeechDecoder:
    decoder = SpeechDecoder.load(folder)
    decoder.module.double()  # before any stream: the decoder's static state is made in the module's dtype
    return decoder


@pytest.mark.parametrize("first_chunk, chunk", [(1, 16), (1, 1), (2, 6), (3, 5), (7, 3), (300, 300)])
def test_streaming_codec_equals_the_whole_decode(tiny_folder, first_chunk, chunk):
    """StreamingCodec chunk by chunk, far past the tiny decoder's 4-frame attention window, with a flush of an odd
    tail: in float64 the samples of one decode of all the frames (to the last float32 step the output is rounded to),
    in float32 the same up to the rounding of other lengths; no frame decoded twice."""
    codes = _codes(25, seed=7)
    for decoder, exact in ((_float64(tiny_folder), True), (SpeechDecoder.load(tiny_folder), False)):
        decoded = []
        real_stream = decoder.stream
        decoder.stream = lambda c, kept, last=False: decoded.append(c.shape[0]) or real_stream(c, kept, last)
        chunks = list(stream_decode(decoder, codes, first_chunk=first_chunk, chunk=chunk))
        assert sum(decoded) == 25 and [c.numel() for c in chunks] == [n * 1920 for n in decoded]
        streamed, whole = torch.cat(chunks), decoder.decode(codes)
        assert float(whole.std()) > 1e-3
        if exact:
            assert float((streamed - whole).abs().max()) <= 6e-8  # one float32 step at |x| < 1
        else:
            assert rel(streamed, whole) < CHUNKING_REL
    if first_chunk != 300:
        # the same chunks decoded each on its own: far from the whole decode, so the comparison can fail
        pieces, start = [], 0
        for n in decoded:
            pieces.append(decoder.decode(codes[start:start + n]))
            start += n
        assert rel(torch.cat(pieces), whole) > 1e-2


def test_streaming_codecs_on_one_decoder_keep_their_own_state(tiny_folder):
    """Two StreamingCodecs on one SpeechDecoder, their frames pushed in turns (the static state every call runs on
    is shared): each gives the whole decode of its own frames, in float64 to the last float32 step."""
    from mkport.tts.codec import StreamingCodec

    decoder = _float64(tiny_folder)
    utterances = [_codes(30, seed=21), _codes(23, seed=22)]
    codecs = [StreamingCodec(decoder, first_chunk=2, chunk=5), StreamingCodec(decoder)]
    got = [[], []]
    for t in range(30):
        for i, codes in enumerate(utterances):
            if t < codes.shape[0] and (chunk := codecs[i].push(codes[t])) is not None:
                got[i].append(chunk)
            elif t == codes.shape[0]:
                got[i].append(codecs[i].flush())
    got[0].append(codecs[0].flush())
    for codes, chunks in zip(utterances, got):
        whole = decoder.decode(codes)
        assert float((torch.cat(chunks) - whole).abs().max()) <= 6e-8
    with pytest.raises(MkportError, match="a frame after flush"):
        codecs[1].push(utterances[1][0])


def _decode_plan(streams, utterances: dict, plan: list, turns: int, each_call=None) -> dict[str, list]:
    """A frame a call of each live stream of `plan` ((slot, utterance name, first call); a stream's slot reset at its
    first frame), for `turns` calls: each utterance's chunks. `each_call(live)` sees each call's streams first."""
    got = {name: [] for name in utterances}
    for turn in range(turns):
        live = [(slot, name, turn - first) for slot, name, first in plan
                if 0 <= turn - first < utterances[name].shape[0]]
        for slot, name, t in live:
            if t == 0:
                streams.reset(slot)
        if each_call:
            each_call(live)
        audio = streams.decode([slot for slot, _, _ in live], torch.stack([utterances[n][t] for _, n, t in live]))
        assert audio.shape == (len(live), 1920)
        for (_, name, _), chunk in zip(live, audio):
            got[name].append(chunk)
    return got


def test_codec_streams_decode_each_streams_frames_as_alone(tiny_folder):
    """CodecStreams: three streams a frame a call, joining at different frames, one leaving and its slot taken by
    a new utterance: each stream's samples are its whole decode (float32, up to the rounding of other lengths), and
    what it gets decoded alone in another slot (a call's shape does not depend on who is in it). On the CPU only to
    float32 rounding: the CPU's matmuls may round a row by its position in the call (seen on an AMD EPYC: 1e-5
    relative after a few frames of state); bit-for-bit equality is promised on CUDA, where each call is one fixed-shape graph (tests/test_gpu_graphs.py)."""
    from mkport.tts.codec import CodecStreams

    decoder = SpeechDecoder.load(tiny_folder)
    streams = CodecStreams(decoder, 3)
    utterances = {name: _codes(n, seed=s) for name, n, s in (("a", 12, 1), ("b", 9, 2), ("c", 5, 3), ("d", 6, 4))}
    # (slot, utterance, first turn): c leaves slot 2 after turn 6, d takes it at turn 7
    plan = [(0, "a", 0), (1, "b", 2), (2, "c", 2), (2, "d", 7)]
    got = _decode_plan(streams, utterances, plan, 13)
    for name, codes in utterances.items():
        assert len(got[name]) == codes.shape[0]
        assert rel(torch.cat(got[name]), decoder.decode(codes)) < CHUNKING_REL, name
        lone = CodecStreams(decoder, 3)
        lone.reset(1)
        alone = torch.cat([lone.decode([1], frame[None])[0] for frame in codes])
        assert rel(torch.cat(got[name]), alone) < CHUNKING_REL, name


def test_sized_codec_streams_decode_each_streams_frames_to_its_whole_decode(tiny_folder):
    """CodecStreams(sized=True): a call has the fewest of 1, 2, 4, ... rows that hold its streams (3 streams of 6: 4
    rows), so a stream's calls change size as others join and leave; each stream's samples are still its whole
    decode to float32 rounding, its state kept across calls of any size (the padding rows decode into the spare row),
    and alone, in calls of one row, the same to that rounding."""
    from mkport.tts.codec import CodecStreams

    decoder = SpeechDecoder.load(tiny_folder)
    assert CodecStreams(decoder, 16, sized=True).call_sizes() == [1, 2, 4, 8, 16]
    assert CodecStreams(decoder, 12, sized=True).call_sizes() == [1, 2, 4, 8, 12]
    assert CodecStreams(decoder, 1, sized=True).call_sizes() == [1]
    assert CodecStreams(decoder, 16).call_sizes() == [16]
    streams = CodecStreams(decoder, 6, sized=True)
    assert [streams.call_rows(n) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]
    utterances = {name: _codes(n, seed=s) for name, n, s in (("a", 12, 1), ("b", 9, 2), ("c", 5, 3), ("d", 6, 4),
                                                             ("e", 4, 5), ("f", 4, 6))}
    # (slot, utterance, first call): a alone, then b, c, e and f in slots 5, 2, 4 and 1 (calls of 2, 4, 4 and 6 rows),
    # d in c's slot after it
    plan = [(0, "a", 0), (5, "b", 2), (2, "c", 3), (4, "e", 4), (1, "f", 5), (2, "d", 8)]
    sizes = []
    got = _decode_plan(streams, utterances, plan, 14, lambda live: sizes.append(streams.call_rows(len(live))))
    assert set(sizes) == {1, 2, 4, 6}
    for name, codes in utterances.items():
        assert rel(torch.cat(got[name]), decoder.decode(codes)) < CHUNKING_REL, name
        lone = CodecStreams(decoder, 6, sized=True)
        lone.reset(3)
        alone = torch.cat([lone.decode([3], frame[None])[0] for frame in codes])
        assert rel(torch.cat(got[name]), alone) < CHUNKING_REL, name


def test_codec_streams_capture_their_graphs_in_their_pool_on_their_capture_stream(tiny_folder, monkeypatch):
    """CodecStreams(pool, capture_stream): every call's graph is captured from that pool on that stream (the frame
    lanes' codec calls run side by side, so each lane's graphs need a cuBLAS workspace of their own: graphs.capture).
    Captures replayed here by running the call again (the CPU has no CUDA graphs): the samples are the eager ones."""
    from mkport.tts import codec
    from mkport.tts.codec import CodecStreams

    captures = []

    def capture(fn, pool, stream=None):
        captures.append((pool, stream))
        out = fn()
        return SimpleNamespace(replay=lambda: out.copy_(fn())), out

    decoder = SpeechDecoder.load(tiny_folder)
    eager = CodecStreams(decoder, 2)
    frames = _codes(3, seed=1)
    expected = torch.cat([eager.decode([1], frame[None])[0] for frame in frames])
    monkeypatch.setattr(codec, "capture", capture)
    decoder.graphs = True
    graphed = CodecStreams(decoder, 2, pool="lane pool", capture_stream="lane codec stream")
    graphed.prepare()
    assert captures == [("lane pool", "lane codec stream")]  # its one call: a frame a row, both rows
    assert torch.equal(torch.cat([graphed.decode([1], frame[None])[0] for frame in frames]), expected)


def test_turn_chunks_follow_a_streams_own_count():
    """A stream's chunks with N frames a turn: 1 (its first audio), N - 1 (the rest of its first turn), then N; with
    N = 1 one frame a chunk, as before turns of N frames."""
    from mkport.tts.codec import turn_chunk, turn_chunk_lengths

    def schedule(per_turn, frames):
        sizes, decoded = [], 0
        while decoded < frames:
            sizes.append(turn_chunk(decoded, per_turn))
            decoded += sizes[-1]
        return sizes

    assert schedule(1, 4) == [1, 1, 1, 1] and turn_chunk_lengths(1) == [1]
    assert schedule(2, 7) == [1, 1, 2, 2, 2] and turn_chunk_lengths(2) == [1, 2]
    assert schedule(4, 13) == [1, 3, 4, 4, 4] and turn_chunk_lengths(4) == [1, 3, 4]


def _serve_turns(streams, plan: list, per_turn: int) -> list:
    """A batched server's codec calls (mkport.serve.batched): turns of `per_turn` frames; plan: (slot, codes [T, Q],
    first turn), each stream joining at a turn boundary; in a turn, the newcomers' first frames decoded in a call of
    their own, then every other chunk in a call of its length (turn_chunk), a stream's last padded with code 0, the
    padding's samples dropped. Returns each plan entry's chunks."""
    from mkport.tts.codec import turn_chunk

    got, decoded = [[] for _ in plan], [0] * len(plan)

    def call(chunks: list) -> None:  # [(plan entry, its frames)], all of one chunk length
        length = turn_chunk(decoded[chunks[0][0]], per_turn)
        frames = torch.stack([pad_rows(plan[i][1][decoded[i]:decoded[i] + n], length) for i, n in chunks])
        for (i, n), samples in zip(chunks, streams.decode([plan[i][0] for i, _ in chunks], frames)):
            got[i].append(samples[:n * 1920])
            decoded[i] += n

    for turn in range(max(first + codes.shape[0] for _, codes, first in plan)):
        live = [i for i, (_, codes, first) in enumerate(plan) if first <= turn and decoded[i] < codes.shape[0]]
        made = {i: min(per_turn, plan[i][1].shape[0] - decoded[i]) for i in live}  # this turn's frames
        firsts = [i for i in live if decoded[i] == 0]
        for i in firsts:
            streams.reset(plan[i][0])
        if firsts:
            call([(i, 1) for i in firsts])
        rest = {}
        for i in live:
            if left := made[i] - (i in firsts):
                rest.setdefault(turn_chunk(decoded[i], per_turn), []).append((i, left))
        for length in sorted(rest):
            call(rest[length])
    return got


@pytest.mark.parametrize("per_turn, sized", [(2, False), (4, False), (4, True)])
def test_codec_streams_decode_turns_of_n_frames_as_the_whole_decode(tiny_folder, per_turn, sized):
    """Calls of N frames a row, as a batched server with turns of N frames makes them (_serve_turns: chunks 1, N - 1,
    N, ... of each stream's own count, joins at turn boundaries, a last chunk padded with code 0): in float64 each
    stream's samples are the whole decode of its frames to the last float32 step (the padding, after its last frame,
    changes none of its samples: the decoder is causal), in float32 to the rounding of other lengths, and alone in
    another slot the same. A call of N frames is N calls of one only up to that rounding (the convolutions of another
    length sum in another order), so a stream's samples repeat with the same chunk lengths: a schedule that follows
    its own count, never the load. On the CPU to float32 rounding alone and with others (the row's position in a
    call: see test_codec_streams_decode_each_streams_frames_as_alone); bit for bit on CUDA, a graph a length
    (tests/test_gpu_graphs.py). With calls sized to their streams (the batched server's default on the megakernel) the
    same, each call's rows its streams'."""
    from mkport.tts.codec import CodecStreams

    utterances = [_codes(n, seed=s) for n, s in ((13, 1), (6, 2), (2, 3), (9, 4))]
    plan = [(0, utterances[0], 0), (1, utterances[1], 1), (2, utterances[2], 1), (2, utterances[3], 3)]
    for decoder, exact in ((_float64(tiny_folder), True), (SpeechDecoder.load(tiny_folder), False)):
        got = _serve_turns(CodecStreams(decoder, 3, sized), plan, per_turn)
        for (slot, codes, _), chunks in zip(plan, got):
            whole, streamed = decoder.decode(codes), torch.cat(chunks)
            assert streamed.shape == whole.shape, slot
            if exact:
                assert float((streamed - whole).abs().max()) <= 6e-8, slot
            else:
                assert rel(streamed, whole) < CHUNKING_REL, slot
            alone = torch.cat(_serve_turns(CodecStreams(decoder, 3, sized), [(1, codes, 0)], per_turn)[0])
            assert rel(streamed, alone) < (1e-12 if exact else CHUNKING_REL), slot
    # a chunk padded in mid-stream (its padding entering the state) is another decode: the comparison can fail
    streams, codes = CodecStreams(decoder, 3), utterances[0]
    streams.reset(0)
    padded = [streams.decode([0], pad_rows(codes[:1], 2)[None])[0, :1920]]
    padded += [streams.decode([0], codes[t:t + 1])[0] for t in range(1, 5)]
    assert rel(torch.cat(padded), decoder.decode(codes[:5])) > 1e-3


@pytest.mark.parametrize("call, needle", [
    (lambda codec: codec.decode([0, 0], _codes(2, seed=0)), "2 distinct streams"),
    (lambda codec: codec.decode([0], _codes(2, seed=0)), r"frames \[1, 16\]"),
    (lambda codec: codec.reset(3), "stream 3 is not one of 0..2"),
    (lambda codec: codec.decode([1, 5], _codes(2, seed=0)), r"\[1, 5\] are not all of 0..2"),
    (lambda codec: type(codec)(codec.decoder, 0), "at least 1, not 0")])
def test_codec_streams_refuse_bad_calls(tiny_folder, call, needle):
    from mkport.tts.codec import CodecStreams

    with pytest.raises(MkportError, match=needle):
        call(CodecStreams(SpeechDecoder.load(tiny_folder), 3))


def test_stream_with_the_released_decoders_shapes(full_folder):
    """The released configuration (8 layers, 16 heads of 64, a 72-frame window, 1536 channels): frame by frame
    with the state kept equals one decode of the frames (float32)."""
    from mkport.tts.codec import CodecStreams

    decoder = SpeechDecoder.load(full_folder)
    codes = _codes(3, seed=11)
    streams = CodecStreams(decoder, 2)
    streams.reset(1)
    audio = torch.cat([streams.decode([1], codes[t:t + 1]) for t in range(3)], dim=-1).reshape(-1)
    assert rel(audio, decoder.decode(codes)) < CHUNKING_REL
