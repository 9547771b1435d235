"""Qwen3-TTS pipeline on CPU: WAV writer, prompt, frame loop (reference backend), streaming codec, and
`mkport speak` end to end on a tiny seeded random model."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from mkport.errors import MkportError

warnings.filterwarnings("ignore", category=FutureWarning)  # the official code's, where bench --tts runs it

from mkport.tts import wav as wavmod  # noqa: E402
from mkport.tts.codec import SpeechDecoder, StreamingCodec, stream_decode  # noqa: E402
from mkport.tts.model import TtsModel, random_model_folder, write_random_tts_model  # noqa: E402
from mkport.tts.pipeline import SpeakStats, TorchDecoder, synthesize  # noqa: E402
from mkport.tts.prompt import build_prompt  # noqa: E402

SPF = 1920  # samples a frame


@pytest.fixture(scope="session")
def tts_cache(tmp_path_factory):
    """A cache root holding the tiny random model where `--random-weights tiny` (seed 0) looks for it."""
    cache = tmp_path_factory.mktemp("mkport_cache")
    write_random_tts_model(cache / "tts-random" / "tiny-0", "tiny", seed=0)
    return cache


@pytest.fixture
def tiny_folder(tts_cache, monkeypatch):
    monkeypatch.setenv("MKPORT_CACHE", str(tts_cache))  # restored after each test (GPU tests share the build cache)
    return random_model_folder("tiny", seed=0)


@pytest.fixture(scope="session")
def tiny(tts_cache):
    return TtsModel.load(tts_cache / "tts-random" / "tiny-0")


# -- WAV ------------------------------------------------------------------------------------------------
def _header(b: bytes):
    riff, = struct.unpack("<I", b[4:8])
    fmt = struct.unpack("<IHHIIHH", b[16:36])
    data, = struct.unpack("<I", b[40:44])
    return riff, fmt, data


def test_wav_file_header_fixed_up_and_clipped(tmp_path):
    out = tmp_path / "a.wav"
    with wavmod.open_wav_output(str(out)) as w:
        assert (tmp_path / "a.wav.partial").exists() and not out.exists()
        w.write(np.array([0.0, 0.5, -0.5], dtype=np.float32))
        w.write(torch.tensor([2.0, -3.0, 1.0]))
    assert not (tmp_path / "a.wav.partial").exists()
    raw = out.read_bytes()
    riff, fmt, data = _header(raw)
    assert (riff, data) == (36 + 12, 12)
    assert fmt == (16, 1, 1, 24000, 48000, 2, 16)
    sr, x = wavmod.read_wav(out)
    assert sr == 24000 and x.shape == (6,)
    assert np.frombuffer(raw[44:], "<i2").tolist() == [0, 16384, -16384, 32767, -32767, 32767]


def test_wav_pipe_gets_streaming_header():
    r, w = os.pipe()
    with os.fdopen(w, "wb") as f:
        writer = wavmod.WavWriter(f)
        assert not writer.seekable
        writer.write(np.zeros(10, np.float32))
        writer.finish()
    with os.fdopen(r, "rb") as f:
        raw = f.read()
    riff, _, data = _header(raw)
    assert riff == data == 0xFFFFFFFF and len(raw) == 44 + 20


def test_wav_failed_run_leaves_no_file(tmp_path):
    out = tmp_path / "b.wav"
    with pytest.raises(RuntimeError):
        with wavmod.open_wav_output(str(out)) as w:
            w.write(np.zeros(100, np.float32))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


# -- prompt ---------------------------------------------------------------------------------------------
def test_prompt_layout(tiny):
    cfg, tp, e0 = tiny.config, tiny.text, tiny.talker_weights.embed[0].float()
    text = "Hello there"
    p = build_prompt(cfg, tiny.encode, tp, e0, text, "vivian", "english", text_mode="non-streaming")
    n_text = len(p.text_ids)
    assert n_text == len(text.encode())  # the tiny tokenizer: one token per byte
    role = tiny.encode("<|im_start|>assistant\n")
    tags = [cfg.think, cfg.think_bos, cfg.languages["english"], cfg.think_eos, cfg.speakers["vivian"]]
    # role (3+... tokens), tags+pad (C[:-1]), text + eos, pad + bos
    assert p.embeds.shape[0] == len(role) + len(tags) + 1 + n_text + 1 + 1
    assert p.trailing.shape[0] == 0
    torch.testing.assert_close(p.embeds[: len(role)], tp(role))
    pad, bos, eos = tp([cfg.tts_pad]), tp([cfg.tts_bos]), tp([cfg.tts_eos])
    at = len(role)
    torch.testing.assert_close(p.embeds[at], pad[0] + e0[cfg.think])
    torch.testing.assert_close(p.embeds[at + 4], pad[0] + e0[cfg.speakers["vivian"]])
    torch.testing.assert_close(p.embeds[at + 5], bos[0] + e0[cfg.codec_pad])
    torch.testing.assert_close(p.embeds[-2], eos[0] + e0[cfg.codec_pad])
    torch.testing.assert_close(p.embeds[-1], pad[0] + e0[cfg.codec_bos])

    s = build_prompt(cfg, tiny.encode, tp, e0, text, None, "auto", text_mode="streaming")
    # auto: nothink, think_bos, think_eos; no speaker; first text token with codec_bos; rest trails
    assert s.embeds.shape[0] == len(role) + 3 + 1 + 1
    torch.testing.assert_close(s.embeds[len(role)], pad[0] + e0[cfg.nothink])
    torch.testing.assert_close(s.embeds[-1], tp(s.text_ids[:1])[0] + e0[cfg.codec_bos])
    assert s.trailing.shape[0] == n_text
    torch.testing.assert_close(s.trailing[-1], eos[0])
    torch.testing.assert_close(s.text_for_step(n_text), pad[0])


def test_prompt_dialect_speaker_takes_the_dialect_language(tiny):
    cfg = tiny.config
    e0 = tiny.talker_weights.embed[0].float()
    cfg2 = cfg.__class__(**{**cfg.__dict__, "languages": {**cfg.languages, "sichuan_dialect": 2062}})
    p = build_prompt(cfg2, tiny.encode, tiny.text, e0, "hi", "eric", "chinese")
    at = len(tiny.encode("<|im_start|>assistant\n")) + 2
    torch.testing.assert_close(p.embeds[at], tiny.text([cfg.tts_pad])[0] + e0[2062])


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(speaker="nobody"), ["unknown speaker 'nobody'", "vivian"]),
        (dict(language="klingon"), ["unknown language 'klingon'", "english"]),
        (dict(text="  "), ["text is empty"]),
        (dict(instruct="whisper"), ["instruct"]),
        (dict(text_mode="word"), ["streaming"]),
    ],
)
def test_prompt_bad_inputs(tiny, kwargs, words):
    args = dict(text="hi", speaker="vivian", language="english")
    args.update(kwargs)
    with pytest.raises(MkportError) as e:
        build_prompt(tiny.config, tiny.encode, tiny.text, tiny.talker_weights.embed[0], **args)
    for w in words:
        assert w in str(e.value)


# -- frame loop -----------------------------------------------------------------------------------------
def test_reference_decoder_step_matches_prefill(tiny):
    """A prompt run through step() one position at a time leaves the same hidden as a one-pass prefill."""
    spec, w = tiny.talker_spec, tiny.talker_weights
    x = torch.randn(5, spec.input_dim, generator=torch.Generator().manual_seed(1))
    a = TorchDecoder(spec, w, 16)
    h = a.prefill(embeds=x)
    b = TorchDecoder(spec, w, 16)
    for row in x:
        b.step(embed=row)
    torch.testing.assert_close(b.hidden, h[-1], rtol=1e-4, atol=1e-4)


def test_frames_seeded_and_suppressed(tiny):
    runs = []
    for seed in (5, 5, 6):
        frames, st = [], SpeakStats()
        chunks = list(synthesize(tiny, "Hi there", speaker="vivian", seed=seed, max_frames=5, stats=st, frames_out=frames))
        runs.append((torch.stack(frames), torch.cat(chunks)))
        assert st.frames == len(frames) == 5  # EOS is suppressed in the first two frames; random weights rarely stop
        assert sum(c.numel() for c in chunks) == 5 * SPF
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], runs[2][0])
    codes = runs[0][0]
    assert int(codes.max()) < 2048 and int(codes.min()) >= 0  # c0 never a special id, c1..15 in the codebook
    assert len({tuple(r.tolist()) for r in codes}) == 5  # frames differ (no aliasing)


# -- codec ----------------------------------------------------------------------------------------------
def _frame_loop(tiny, talker_class=TorchDecoder, **kwargs) -> list[torch.Tensor]:
    from mkport.tts.pipeline import TtsSampling, generate_frames

    prompt = build_prompt(tiny.config, tiny.encode, tiny.text, tiny.talker_weights.embed[0], "Hi there", "vivian")
    talker = talker_class(tiny.talker_spec, tiny.talker_weights, 64)
    predictor = TorchDecoder(tiny.predictor_spec, tiny.predictor_weights, 17)
    sampling = TtsSampling.from_generation_config(tiny.generation, seed=3)
    return list(generate_frames(tiny, prompt, talker, predictor, sampling, 8, **kwargs))


def test_eos_allowed_from_the_third_frame(tiny):
    """Official min_new_tokens=2: EOS cannot be codebook 0 of frames 0 and 1, and ends the loop at frame 2
    when the talker would pick it whenever it may."""
    eos = tiny.config.codec_eos

    class EagerToStop(TorchDecoder):
        def step(self, *args, **kwargs):
            tok = super().step(*args, **kwargs)
            if not self.logit_bias[eos].isinf():
                tok.fill_(eos)
            return tok

    assert len(_frame_loop(tiny, EagerToStop)) == 2


def test_frames_queued_ahead_are_the_same_frames(tiny):
    """The loop queues frame k+1 before handing out frame k unless the caller decodes audio on frame k;
    either order gives the same codes."""
    ahead = _frame_loop(tiny)
    waiting = _frame_loop(tiny, caller_decodes=lambda k: True)
    mixed = _frame_loop(tiny, caller_decodes=lambda k: k % 3 == 0)
    assert len(ahead) == 8 and all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(ahead, waiting, mixed))


def test_streaming_codec_equals_whole_decode(tiny):
    dec: SpeechDecoder = tiny.codec
    codes = torch.randint(0, 2048, (30, 16), generator=torch.Generator().manual_seed(2))
    whole = dec.decode(codes)
    assert whole.shape == (30 * SPF,) and float(whole.std()) > 1e-3
    # the tiny decoder's receptive field is about 12 frames (a 4-frame attention window plus the convolutions)
    chunks = list(stream_decode(dec, codes, left_context=16, first_chunk=2, chunk=6))
    assert [c.numel() // SPF for c in chunks] == [2, 2, 4, 6, 6, 6, 4]  # each as long as the audio out, up to 6
    streamed = torch.cat(chunks)
    rel = float((streamed - whole).norm() / whole.norm())
    assert rel < 1e-4, rel
    # too little left context for the window: the test can fail
    short = torch.cat(list(stream_decode(dec, codes, left_context=4, first_chunk=2, chunk=6)))
    assert float((short - whole).norm() / whole.norm()) > 1e-2


def test_streaming_codec_validates():
    with pytest.raises(MkportError):
        StreamingCodec(None, left_context=-1)


# -- CLI ------------------------------------------------------------------------------------------------
def _cli_main(argv, monkeypatch):
    import mkport.cli as cli
    from mkport.tts.cli import speak

    if not any(getattr(c, "name", None) == "speak" or getattr(c.callback, "__name__", "") == "speak"
               for c in cli.app.registered_commands):
        cli.app.command()(speak)
    monkeypatch.setattr(sys, "argv", ["mkport", *argv])
    with pytest.raises(SystemExit) as e:
        cli.main()
    return e.value.code


def test_speak_to_file(tiny_folder, tmp_path, monkeypatch, capsys):
    out = tmp_path / "o.wav"
    code = _cli_main(["speak", "Hello", "--model", str(tiny_folder), "--backend", "reference", "--max-frames", "3",
                      "--out", str(out), "--speaker", "serena", "--language", "english", "--seed", "1"], monkeypatch)
    assert code in (0, None)
    sr, x = wavmod.read_wav(out)
    assert sr == 24000 and x.size == 3 * SPF
    riff, _, data = _header(out.read_bytes())
    assert data == 3 * SPF * 2 and riff == data + 36
    err = capsys.readouterr().err
    assert "first chunk" in err and "real-time factor" in err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["", "--random-weights", "tiny"], "text is empty"),
        (["hi", "--random-weights", "tiny", "--speaker", "bob"], "unknown speaker 'bob'"),
        (["hi", "--random-weights", "tiny", "--language", "elvish"], "unknown language 'elvish'"),
        (["hi", "--model", "/nonexistent/folder"], "model folder not found"),
        (["hi", "--random-weights", "tiny", "--backend", "megakernel"], "CUDA GPU"),
        (["hi", "--random-weights", "tiny", "--backend", "gpu"], "backend 'gpu'"),
        (["hi"], "--model"),
    ],
)
def test_speak_bad_inputs_exit_2(tiny_folder, tmp_path, monkeypatch, capsys, args, needle):
    if "megakernel" in args and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    if "--backend" not in args:
        args = args + ["--backend", "reference"]
    out = tmp_path / "x.wav"
    code = _cli_main(["speak", *args, "--out", str(out)], monkeypatch)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and needle in err, err
    assert list(tmp_path.iterdir()) == []


def test_speak_model_folder_missing_files(tiny_folder, tmp_path, monkeypatch, capsys):
    import shutil

    broken = tmp_path / "m"
    shutil.copytree(tiny_folder, broken, ignore=shutil.ignore_patterns("speech_tokenizer"))
    code = _cli_main(["speak", "hi", "--model", str(broken), "--backend", "reference", "--out", str(tmp_path / "y.wav")],
                     monkeypatch)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "speech_tokenizer" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "y.wav").exists() and not (tmp_path / "y.wav.partial").exists()


def test_speak_streams_to_a_pipe(tiny_folder):
    code = (
        "import sys; import mkport.cli as c; from mkport.tts.cli import speak; c.app.command()(speak); "
        "sys.argv = ['mkport', 'speak', 'Hi', '--random-weights', 'tiny', '--backend', 'reference', "
        "'--max-frames', '6']; c.main()"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, env=dict(os.environ), timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    raw = r.stdout
    riff, fmt, data = _header(raw)
    assert riff == data == 0xFFFFFFFF and fmt[3] == 24000
    assert len(raw) - 44 == 6 * SPF * 2
    assert b"real-time factor" in r.stderr


# -- bench --tts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--tts", "--random-weights", "qwen3-0.6b"], "random TTS spec"),
        (["qwen3-0.6b", "--tts"], "Qwen3-TTS model folder"),
        (["--tts", "--random-weights", "0.6b", "--contexts", "128"], "--contexts: not used with --tts"),
        (["--tts", "--random-weights", "0.6b", "--engines", "vllm"], "unknown --tts engine"),
        (["qwen3-0.6b", "--random-weights", "--text", "hi"], "--text is for --tts"),
        (["--tts", "--random-weights", "0.6b"], "no CUDA GPU"),
    ],
)
def test_bench_tts_bad_inputs_exit_2(monkeypatch, capsys, args, needle):
    if needle == "no CUDA GPU" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code = _cli_main(["bench", *args], monkeypatch)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and needle in err, err


def test_bench_tts_llm_config_folder_is_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    code = _cli_main(["bench", str(tmp_path), "--tts"], monkeypatch)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "model_type 'qwen3', not qwen3_tts" in err


def test_run_tts_bench_records_every_engine(tiny_folder):
    """The bench's bookkeeping on CPU (mkport's reference backend): one row per engine, in order; an engine
    that cannot run here carries its reason, never a number."""
    from mkport.tts.bench import TTS_ENGINES, run_tts_bench

    frames = 10
    result = run_tts_bench(tiny_folder, "Hi there", frames=frames, seed=1, device="cpu", mkport_backend="reference")
    assert [r["engine"] for r in result["results"]] == list(TTS_ENGINES)
    mk = result["results"][0]
    assert "error" not in mk, mk
    assert mk["frames"] == frames and len(mk["frame_ms"]) == frames - 1
    assert mk["first_chunk_frames"] == 1 and 0 < mk["first_chunk_ms"] <= mk["total_s"] * 1e3
    assert mk["audio_s"] == pytest.approx(frames * SPF / 24000)
    assert mk["rtf"] == pytest.approx(mk["total_s"] / mk["audio_s"])
    assert mk["frame_p10_ms"] <= mk["frame_median_ms"] <= mk["frame_p90_ms"]
    # the first chunk is the set-up, the first frame and the first codec call, and nothing else much
    parts = mk["setup_ms"] + mk["first_frame_ms"] + mk["codec_ms"][0]
    assert 0 < mk["setup_ms"] and 0.9 * mk["first_chunk_ms"] <= parts <= mk["first_chunk_ms"]
    assert len(mk["codec_ms"]) == 5  # frames 10: chunks of 1, 1, 2 and 4, then the flush of 2
    assert mk["warmup_s"] > 0  # the first request of the engine, with its one-time set-up
    for other in result["results"][1:]:
        if "error" in other:
            assert other["error"].startswith(("not available: ", "failed: ")) and len(other["error"]) > 20
        else:
            assert other["frames"] > 0 and other["first_chunk_ms"] > 0
    first_speaker = next(iter(json.loads((tiny_folder / "config.json").read_text())["talker_config"]["spk_id"]))
    assert result["speaker"] == first_speaker.lower() and result["text"] == "Hi there"


@pytest.mark.parametrize("failed", [False, True])
def test_bench_tts_exit_code_says_whether_every_engine_ran(monkeypatch, capsys, tmp_path, failed):
    """The table and the JSON are written either way; the exit code is 1 when an engine has no numbers."""
    import mkport.runtime
    import mkport.tts.bench
    import mkport.tts.model

    ok = dict(engine="mkport", first_chunk_ms=40.0, streamed=True, first_chunk_frames=4, frame_median_ms=4.0,
              frame_p10_ms=3.9, frame_p90_ms=4.2, rtf=0.06, frames=50, audio_s=4.0, frame_method="each frame")
    other = {"engine": "official", "error": "failed: AttributeError: x"} if failed else dict(ok, engine="official")
    canned = {"environment": {"gpu": "test GPU"}, "folder": str(tmp_path), "speaker": "vivian", "results": [ok, other]}
    monkeypatch.setattr(mkport.runtime, "require_gpu", lambda: None)
    monkeypatch.setattr(mkport.tts.model, "random_model_folder", lambda which, seed=0: tmp_path)
    monkeypatch.setattr(mkport.tts.bench, "run_tts_bench", lambda *args, **kwargs: canned)
    out = tmp_path / "tts.json"
    code = _cli_main(["bench", "--tts", "--random-weights", "0.6b", "--engines", "mkport,official", "--json", str(out)],
                     monkeypatch)
    printed = capsys.readouterr().out
    assert code == (1 if failed else 0)
    assert json.loads(out.read_text())["results"][1] == other
    assert "mkport" in printed and ("failed: AttributeError" in printed) == failed
