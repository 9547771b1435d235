"""Qwen3-TTS pipeline on CPU: WAV writer, prompt, frame loop (reference backend), streaming codec, and
`mkport speak` end to end on a tiny seeded random model."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import eager_to_stop
from mkport.errors import MkportError

warnings.filterwarnings("ignore", category=FutureWarning)  # the official code's, where bench-tts runs it

from mkport.tts import wav as wavmod  # noqa: E402
from mkport.tts.codec import SpeechDecoder, StreamingCodec, stream_decode  # noqa: E402
from mkport.tts.model import TtsModel, random_model_folder, write_random_tts_model  # noqa: E402
from mkport.runtime.torch_decoder import TorchDecoder  # noqa: E402
from mkport.tts.pipeline import SpeakStats, synthesize  # noqa: E402
from mkport.tts.text import split_utterances  # noqa: E402
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


def _temps(folder) -> list[Path]:
    return [p for p in Path(folder).iterdir() if p.name.endswith(".partial")]


def test_wav_file_header_fixed_up_and_clipped(tmp_path):
    out = tmp_path / "a.wav"
    with wavmod.open_wav_output(str(out)) as w:
        (temp,) = _temps(tmp_path)  # the audio goes to a hidden temp file until it is complete
        assert temp.name.startswith(".a.wav.") and not out.exists()
        w.write(np.array([0.0, 0.5, -0.5], dtype=np.float32))
        w.write(torch.tensor([2.0, -3.0, 1.0]))
    assert _temps(tmp_path) == []
    raw = out.read_bytes()
    riff, fmt, data = _header(raw)
    assert (riff, data) == (36 + 12, 12)
    assert fmt == (16, 1, 1, 24000, 48000, 2, 16)
    sr, x = wavmod.read_wav(out)
    assert sr == 24000 and x.shape == (6,)
    assert np.frombuffer(raw[44:], "<i2").tolist() == [0, 16384, -16384, 32767, -32767, 32767]


def test_wav_two_writers_of_one_name_never_share_a_file(tmp_path):
    """Two runs with the same --out: each writes its own temp file; the first to finish gets the name, the
    second is refused without --force (its audio is not claimed to be there) and replaces it with --force."""
    out = tmp_path / "same.wav"
    first, second = wavmod.open_wav_output(str(out)), wavmod.open_wav_output(str(out))
    first.__enter__().write(np.full(10, 0.5, np.float32))
    second.__enter__().write(np.full(20, -0.5, np.float32))
    assert len(_temps(tmp_path)) == 2
    first.__exit__(None, None, None)
    with pytest.raises(MkportError, match="appeared while this ran; not replaced"):
        second.__exit__(None, None, None)
    assert wavmod.read_wav(out)[1].size == 10 and _temps(tmp_path) == []
    with pytest.raises(MkportError, match="exists; pass --force"):
        with wavmod.open_wav_output(str(out)):
            pass
    with wavmod.open_wav_output(str(out), force=True) as c:
        c.write(np.full(40, 0.25, np.float32))
    assert wavmod.read_wav(out)[1].size == 40 and _temps(tmp_path) == []


def _raise(code):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return fail


@pytest.mark.parametrize(
    "case, needle",
    [
        ("missing_folder", "no/such/dir does not exist"),
        ("folder", "is a folder; give a file name"),
        ("parent_is_a_file", "is not a folder"),
        ("device", "is not a regular file"),
        ("no_permission", "Permission denied"),
        ("read_only_fs", "Read-only file system"),
        ("read_only_fs_at_the_end", "Read-only file system"),
    ],
)
def test_wav_path_problems_are_one_error(tmp_path, monkeypatch, case, needle):
    """Every problem with --out is one MkportError naming it; where the clean-up fails too (a read-only file
    system), the first error is the one reported."""
    out = {"missing_folder": tmp_path / "no/such/dir/x.wav", "folder": tmp_path, "device": Path("/dev/null"),
           "parent_is_a_file": tmp_path / "f.txt" / "x.wav"}.get(case, tmp_path / "x.wav")
    (tmp_path / "f.txt").write_text("a file")
    if case == "no_permission":
        monkeypatch.setattr(wavmod.os, "open", _raise(errno.EACCES))
    if case == "read_only_fs":
        monkeypatch.setattr(wavmod.os, "open", _raise(errno.EROFS))
    if case == "read_only_fs_at_the_end":  # the temp file was made; moving it and removing it both fail
        for name in ("link", "replace", "unlink"):
            monkeypatch.setattr(wavmod.os, name, _raise(errno.EROFS))
        monkeypatch.setattr(Path, "unlink", _raise(errno.EROFS))
    with pytest.raises(MkportError) as e:
        with wavmod.open_wav_output(str(out), force=True) as w:
            w.write(np.zeros(10, np.float32))
    message = str(e.value)
    assert needle in message and len(message.splitlines()) == 1, message
    assert message.startswith("--out "), message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway (the EACCES case is simulated)")
def test_wav_folder_without_write_permission(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    with pytest.raises(MkportError, match="Permission denied"):
        with wavmod.open_wav_output(str(ro / "x.wav")):
            pass


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


# -- long text ------------------------------------------------------------------------------------------
def test_split_utterances_at_sentence_ends():
    count = str.split  # one token a word
    text = 'One two three. "Four five?" she said! Six seven\neight nine ten. 3.14 is pi。短い。'
    assert split_utterances(text, count, limit=100) == [text]  # within the limit: unchanged
    assert split_utterances(text, count, limit=4) == ["One two three.", '"Four five?" she said!', "Six seven",
                                                      "eight nine ten.", "3.14 is pi。短い。"]
    assert split_utterances("a b c d e f. g", count, limit=2) == ["a b c d e f.", "g"]  # a long sentence stays whole
    assert split_utterances("no end at all", count, limit=1) == ["no end at all"]


def test_long_text_is_utterances_one_after_the_other(tiny):
    """Each utterance is its own prompt, frame loop and codec stream (seeded seed, seed + 1): the audio of a
    long text is the audio of its utterances, spoken alone, one after the other."""
    text = "Hello there. How are you today? Fine, thanks."
    assert split_utterances(text, tiny.encode, 20) == ["Hello there.", "How are you today?", "Fine, thanks."]
    stats = SpeakStats()
    whole = torch.cat(list(synthesize(tiny, text, speaker="vivian", seed=4, max_frames=3, stats=stats,
                                      utterance_tokens=20)))
    alone = [torch.cat(list(synthesize(tiny, t, speaker="vivian", seed=4 + i, max_frames=3)))
             for i, t in enumerate(["Hello there.", "How are you today?", "Fine, thanks."])]
    assert stats.frames == 9 and whole.numel() == 9 * SPF
    assert torch.equal(whole, torch.cat(alone))


def test_text_too_long_names_the_real_limit(tiny, monkeypatch):
    """The tiny talker holds 4096 positions. A sentence too long by itself is named as such (with the most it
    may have); one that fits only with fewer frames says how many; neither allocates a decoder."""
    import mkport.tts.pipeline as pipeline

    monkeypatch.setattr(pipeline, "make_decoders", lambda *a, **k: pytest.fail("decoders allocated"))
    with pytest.raises(MkportError) as e:
        list(synthesize(tiny, "Short one. " + "a" * 5000 + ".", speaker="vivian", max_frames=3))
    message = str(e.value)
    assert "a sentence of 5001 text tokens does not fit the talker's KV cache (4096 positions" in message
    fixed = build_prompt(tiny.config, tiny.encode, tiny.text, tiny.talker_weights.embed[0], "a.", "vivian").embeds.shape[0] - 2
    assert f"at most {4096 - 2 - fixed}" in message and "--max-frames" not in message
    with pytest.raises(MkportError) as e:
        list(synthesize(tiny, "b" * 3999 + ".", speaker="vivian", max_frames=200))
    prompt_rows = fixed + 4000
    assert f"lower --max-frames to {4096 - prompt_rows}" in str(e.value)
    with pytest.raises(MkportError, match="--max-frames 5000: must be 1..4096"):
        list(synthesize(tiny, "Hi.", speaker="vivian", max_frames=5000))


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
    assert len(_frame_loop(tiny, eager_to_stop(tiny.config.codec_eos))) == 2


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
    chunks = list(stream_decode(dec, codes, first_chunk=2, chunk=6))
    sizes = [c.numel() // SPF for c in chunks]
    assert sizes == [2, 2, 4, 6, 6, 6, 4]  # each as long as the audio out, up to 6
    streamed = torch.cat(chunks)
    rel = float((streamed - whole).norm() / whole.norm())
    assert rel < 1e-4, rel
    # the same chunks decoded without the state kept: the test can fail
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    alone = torch.cat([dec.decode(codes[s:s + n]) for s, n in zip(starts, sizes)])
    assert float((alone - whole).norm() / whole.norm()) > 1e-2


@pytest.mark.parametrize("kw", [dict(first_chunk=0), dict(chunk=0)])
def test_streaming_codec_validates(kw):
    with pytest.raises(MkportError, match="first_chunk >= 1 and chunk >= 1"):
        StreamingCodec(None, **kw)


# -- CLI ------------------------------------------------------------------------------------------------
def _cli_main(argv, monkeypatch):
    import mkport.cli as cli
    from mkport.cli.speak import speak

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


def test_speak_verbose_says_where_the_time_went(tiny_folder, tmp_path, monkeypatch, capsys):
    """--verbose: every step of a one-shot run in order, the first counted from the process's start, the times
    adding up (each step's seconds are its 'since start' minus the one before); the model is loaded without
    CUDA graphs (a one-shot run replays them too few times to pay for their capture)."""
    from mkport.tts.model import TtsModel

    loaded = {}
    real_load = TtsModel.load.__func__

    def load(cls, folder, **kwargs):
        loaded.update(kwargs)
        return real_load(cls, folder, **kwargs)

    monkeypatch.setattr(TtsModel, "load", classmethod(load))
    code = _cli_main(["speak", "Hello. Bye.", "--model", str(tiny_folder), "--backend", "reference", "--max-frames",
                      "3", "--out", str(tmp_path / "v.wav"), "--verbose"], monkeypatch)
    assert code in (0, None) and loaded["graphs"] is False
    lines = capsys.readouterr().err.splitlines()
    table = lines[lines.index("mkport speak: where the time went (seconds)") + 2:]
    steps = [line for line in table if line.startswith("  ") and not line.startswith("    ")]
    names = [line.split("  ")[1].strip() for line in steps]
    assert names[:6] == ["python start, mkport's imports", "import torch, mkport's model code", "config, text tokenizer",
                         "weights: talker, code predictor (to host memory)", "text embedding and projection",
                         "speech tokenizer decoder"]
    assert names[6] == "first WAV bytes written" and names[7].startswith("the rest: 3 frames in all")
    since = [float(line.split()[-1]) for line in steps]
    seconds = [float(line.split()[-2]) for line in steps]
    assert since == sorted(since) and since[0] > 0
    assert all(abs(b - a - s) < 2e-3 for a, b, s in zip(since, since[1:], seconds[1:]))
    details = [line for line in table if line.startswith("    ")]
    assert [d.split("  ")[2].strip() for d in details][:2] == ["prompt: tokenizer, text projection",
                                                               "decoders: kernels loaded, weights to the GPU"]


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
        "import sys; import mkport.cli as c; from mkport.cli.speak import speak; c.app.command()(speak); "
        "sys.argv = ['mkport', 'speak', 'Hi', '--random-weights', 'tiny', '--backend', 'reference', "
        "'--max-frames', '6']; c.main()"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, env=dict(os.environ), timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert b"speaking:" not in r.stderr  # no progress line into a pipe
    raw = r.stdout
    riff, fmt, data = _header(raw)
    assert riff == data == 0xFFFFFFFF and fmt[3] == 24000
    assert len(raw) - 44 == 6 * SPF * 2
    assert b"real-time factor" in r.stderr


@pytest.fixture
def speak_proc():
    """Starts `mkport speak ARGS` in its own process (as a user runs it), with the reference backend; one
    still running when the test ends is killed."""
    started = []

    def start(args, **popen):
        started.append(subprocess.Popen([sys.executable, "-m", "mkport.cli", "speak", *args, "--backend", "reference"],
                                        **popen))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _broken_folder(tiny_folder, tmp_path) -> Path:
    """A model folder that fails to load (no speech_tokenizer/): a check that runs first is seen first."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_folder, broken, ignore=shutil.ignore_patterns("speech_tokenizer"))
    return broken


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--max-frames", "0"], "--max-frames 0: must be 1..4096"),
        (["--max-frames", "100000"], "--max-frames 100000: must be 1..4096"),
        (["--seed", str(2**64)], "--seed 18446744073709551616: a seed is an integer from 0 to 2**63-1"),
        (["--weights-seed", "-1"], "--weights-seed -1: a seed is an integer from 0 to 2**63-1"),
    ],
)
def test_speak_numbers_checked_before_loading(tiny_folder, tmp_path, monkeypatch, capsys, args, needle):
    code = _cli_main(["speak", "hi", "--model", str(_broken_folder(tiny_folder, tmp_path)), "--backend", "reference",
                      "--out", str(tmp_path / "x.wav"), *args], monkeypatch)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "x.wav").exists() and _temps(tmp_path) == []


@pytest.mark.parametrize("weights, frames", [("random", 75), ("folder", 1500), ("given", 7)])
def test_speak_default_length(tiny_folder, tmp_path, monkeypatch, weights, frames):
    """Random weights never pick EOS: 75 frames (6 s) unless --max-frames is given; a model folder 1500 (120 s), as
    a request to mkport serve (tests/test_limits.py)."""
    import mkport.tts.pipeline as pipeline

    asked = {}

    def fake_synthesize(model, text, **kwargs):
        asked.update(kwargs)
        yield torch.zeros(SPF)

    monkeypatch.setattr(pipeline, "synthesize", fake_synthesize)
    source = ["--model", str(tiny_folder)] if weights == "folder" else ["--random-weights", "tiny"]
    extra = ["--max-frames", "7"] if weights == "given" else []
    code = _cli_main(["speak", "hi", *source, *extra, "--backend", "reference", "--out", str(tmp_path / "d.wav")],
                     monkeypatch)
    assert code in (0, None) and asked["max_frames"] == frames


def test_speak_refuses_a_terminal_before_loading(tiny_folder, tmp_path, speak_proc):
    import pty

    master, slave = pty.openpty()
    proc = speak_proc(["hi", "--model", str(_broken_folder(tiny_folder, tmp_path))], stdout=slave,
                       stderr=subprocess.PIPE, text=True)
    os.close(slave)
    _, err = proc.communicate(timeout=120)
    os.close(master)
    assert proc.returncode == 2 and err.strip().splitlines() == [
        "error: refusing to write WAV audio to a terminal: redirect stdout (> out.wav) or pass --out FILE"], err


def test_speak_refuses_stdout_opened_for_append(tiny_folder, tmp_path, speak_proc):
    target = tmp_path / "kept.wav"
    target.write_bytes(b"what the user had")
    with open(target, "ab") as appending:
        proc = speak_proc(["hi", "--random-weights", "tiny", "--max-frames", "2"], stdout=appending,
                           stderr=subprocess.PIPE, text=True)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1 and "opened for append (>>)" in err, err
    assert target.read_bytes() == b"what the user had"


def test_speak_keeps_an_existing_file_unless_forced(tiny_folder, tmp_path, monkeypatch, capsys):
    out = tmp_path / "o.wav"
    out.write_bytes(b"what the user had")
    args = ["speak", "Hi", "--random-weights", "tiny", "--backend", "reference", "--max-frames", "2", "--out", str(out)]
    assert _cli_main(args, monkeypatch) == 2
    assert "exists; pass --force to replace it" in capsys.readouterr().err
    assert out.read_bytes() == b"what the user had"
    assert _cli_main(args + ["--force"], monkeypatch) in (0, None)
    assert wavmod.read_wav(out)[1].size == 2 * SPF and _temps(tmp_path) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_speak_signal_removes_the_partial_file(tiny_folder, tmp_path, speak_proc, sig):
    """A signal while audio is being written: the temp file is removed, one line says so, exit 128 + signal."""
    out = tmp_path / "s.wav"
    proc = speak_proc(["Hi", "--random-weights", "tiny", "--max-frames", "3000", "--out", str(out)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        sizes = []
        for temp in _temps(tmp_path):
            with __import__("contextlib").suppress(FileNotFoundError):
                sizes.append(temp.stat().st_size)
        if any(size > 44 for size in sizes):  # header and audio written
            break
        time.sleep(0.05)
    assert proc.poll() is None, "speak ended before it was signalled"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert f"error: stopped by {sig.name}; {out} was not written" in err.splitlines() and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_speak_progress_on_a_terminal(tiny_folder, tmp_path, speak_proc):
    """With stderr on a terminal, a live line counts frames and audio; in a pipe there is none (the pipe test)."""
    import pty

    master, slave = pty.openpty()
    proc = speak_proc(["Hi", "--random-weights", "tiny", "--max-frames", "12", "--out", str(tmp_path / "p.wav")],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave,
                       env=dict(os.environ, TERM="xterm", COLUMNS="100"))
    os.close(slave)
    seen = b""
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the process closed the terminal
            break
        if not data:
            break
        seen += data
    os.close(master)
    assert proc.wait(timeout=120) == 0, seen.decode(errors="replace")
    text = seen.decode(errors="replace")
    assert re.search(r"speaking: [1-9]\d* frames, \d+\.\d\d s of audio written", text), text
    assert "real-time factor" in text


def test_speak_long_text_is_one_wav(tiny_folder, tmp_path, monkeypatch):
    """Three sentences of about 90 tokens each (the tiny tokenizer: one a byte) are two utterances; their
    audio is one WAV: one header, every frame's samples."""
    sentence = "This sentence is long enough that two of them fill most of one utterance of two hundred tokens."
    out = tmp_path / "long.wav"
    code = _cli_main(["speak", " ".join([sentence] * 3), "--random-weights", "tiny", "--backend", "reference",
                      "--max-frames", "2", "--out", str(out)], monkeypatch)
    assert code in (0, None)
    raw = out.read_bytes()
    assert raw.count(b"RIFF") == 1 and _header(raw)[2] == len(raw) - 44 == 2 * 2 * SPF * 2


# -- bench-tts ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--random-weights", "qwen3-0.6b"], "unknown --random-weights 'qwen3-0.6b'"),
        (["qwen3-0.6b"], "Qwen3-TTS model folder"),
        ([], "give exactly one of DIR"),
        (["--random-weights", "0.6b", "--engines", "vllm"], "--engines: unknown vllm"),
        (["--random-weights", "0.6b", "--engines", "mkport,"], "--engines 'mkport,': an empty item"),
        (["--random-weights", "0.6b", "--steps", "0"], "--steps 0: must be 1..4096"),
        (["--random-weights", "0.6b", "--seed", str(2**64)], "--seed 18446744073709551616: a seed is an integer"),
        (["--random-weights", "0.6b", "--text", " "], "--text is empty"),
        (["--random-weights", "0.6b"], "no CUDA GPU"),
    ],
)
def test_bench_tts_bad_inputs_exit_2(monkeypatch, capsys, args, needle):
    if needle == "no CUDA GPU" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code = _cli_main(["bench-tts", *args], monkeypatch)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and needle in err, err


def test_bench_tts_llm_config_folder_is_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    code = _cli_main(["bench-tts", str(tmp_path)], monkeypatch)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "model_type 'qwen3', not qwen3_tts" in err


def test_bench_with_tts_points_to_bench_tts(monkeypatch, capsys):
    code = _cli_main(["bench", "--tts", "--random-weights", "0.6b"], monkeypatch)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "mkport bench-tts" in err, err


def test_run_tts_bench_records_every_engine(tiny_folder):
    """The bench's bookkeeping on CPU (mkport's reference backend): one row per engine, in order; an engine
    that cannot run here carries its reason, never a number."""
    from mkport.tts.bench_tts import TTS_ENGINES, run_tts_bench

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
    split = mk["first_chunk_parts_ms"]  # the same, with the prefill apart from the rest of the first frame
    assert split["prefill"] > 0 and split["first_frame"] > 0
    assert sum(split.values()) == pytest.approx(parts) and split["setup"] == mk["setup_ms"]
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
    import mkport.runtime.decoder
    import mkport.tts.bench_tts
    import mkport.tts.model

    ok = dict(engine="mkport", first_chunk_ms=40.0, streamed=True, first_chunk_frames=4, frame_median_ms=4.0,
              frame_p10_ms=3.9, frame_p90_ms=4.2, rtf=0.06, frames=50, audio_s=4.0, frame_method="each frame")
    other = {"engine": "official", "error": "failed: AttributeError: x"} if failed else dict(ok, engine="official")
    canned = {"environment": {"gpu": "test GPU"}, "folder": str(tmp_path), "speaker": "vivian", "results": [ok, other]}
    monkeypatch.setattr(mkport.runtime.decoder, "require_gpu", lambda spec=None: None)
    monkeypatch.setattr(mkport.tts.model, "random_model_folder", lambda which, seed=0: tmp_path)
    monkeypatch.setattr(mkport.tts.bench_tts, "run_tts_bench", lambda *args, **kwargs: canned)
    out = tmp_path / "tts.json"
    code = _cli_main(["bench-tts", "--random-weights", "0.6b", "--engines", "mkport,official", "--json", str(out)],
                     monkeypatch)
    printed = capsys.readouterr().out
    assert code == (1 if failed else 0)
    assert json.loads(out.read_text())["results"][1] == other
    assert "mkport" in printed and ("failed: AttributeError" in printed) == failed
