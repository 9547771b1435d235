"""`mkport bench-tts`: one cold text-to-speech request on each engine, the same weights and text, in one
process: mkport (the megakernel backend of `synthesize`), the official Qwen3-TTS pipeline (`qwen_tts`,
`Qwen3TTSModel.generate_custom_voice`) and faster-qwen3-tts (`FasterQwen3TTS`, CUDA graphs).

Every engine is loaded and warmed up first (kernel builds, CUDA-graph capture, cuBLAS start-up), then times
one request: text in, PCM out. Nothing of the timed request is prepared in advance (mkport reads and projects
its text-embedding rows per request; only the projections every request shares, of the special tokens and the
chat template's role, are kept from the warm-up). What each number means, engine by engine, is in docs/tts.md.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import platform
import statistics
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import MkportError
from .codec import DEFAULT_CHUNK, DEFAULT_FIRST_CHUNK

TTS_ENGINES = ("mkport", "official", "faster-qwen3-tts")
DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the quiet forest."
WARMUP_FRAMES = 8
LANGUAGE = "auto"


@dataclass
class TtsRun:
    """One engine's timed request. frame_ms holds one entry per generated frame after the first; how each
    was measured is in `frame_method`."""

    engine: str
    first_chunk_ms: float | None = None
    first_chunk_frames: int | None = None
    streamed: bool = True
    frame_ms: list[float] = field(default_factory=list)
    frame_method: str = ""
    per_frame: bool = True  # False: frame_ms holds one mean, with no spread to report
    total_s: float = 0.0
    frames: int = 0
    audio_s: float = 0.0
    extra: dict = field(default_factory=dict)
    error: str | None = None

    def percentile(self, q: float) -> float:
        s = sorted(self.frame_ms)
        return s[min(len(s) - 1, int(q * len(s)))]

    def summary(self) -> dict:
        if self.error:
            return {"engine": self.engine, "error": self.error}
        return {
            "engine": self.engine,
            "first_chunk_ms": self.first_chunk_ms,
            "first_chunk_frames": self.first_chunk_frames,
            "streamed": self.streamed,
            "frame_median_ms": statistics.median(self.frame_ms) if self.frame_ms else None,
            "frame_p10_ms": self.percentile(0.1) if self.frame_ms and self.per_frame else None,
            "frame_p90_ms": self.percentile(0.9) if self.frame_ms and self.per_frame else None,
            "frame_method": self.frame_method,
            "rtf": self.total_s / self.audio_s if self.audio_s else None,
            "total_s": self.total_s,
            "frames": self.frames,
            "audio_s": self.audio_s,
            "frame_ms": self.frame_ms,
            **self.extra,
        }


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _wall_s(run, device) -> float:
    """Wall time of run(), the device's queued work included."""
    start = time.perf_counter()
    run()
    _sync(device)
    return time.perf_counter() - start


def _free(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _versions() -> dict:
    out = {}
    for dist in ("qwen-tts-hf", "faster-qwen3-tts", "transformers", "torch"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def tts_environment(device) -> dict:
    if torch.device(device).type == "cuda":
        from ..bench.decode import environment

        env = environment()
    else:
        env = {"gpu": None, "torch": torch.__version__, "python": platform.python_version()}
    env["packages"] = _versions()
    return env


# -- engines --------------------------------------------------------------------------------------------
def bench_mkport(folder, text: str, speaker, frames: int, seed: int, device, backend: str) -> TtsRun:
    """synthesize() on decoders built and warmed up once (kernel builds and weight uploads are set-up, as in a
    server); the timed request starts from the text. frame_ms: each frame of the frame loop (talker step and
    predictor pass, ending at the frame's host copy), frame 0 (with the prefill) left out."""
    from .model import TtsModel
    from .pipeline import SpeakStats, make_decoders, synthesize
    from .prompt import build_prompt

    tts = TtsModel.load(folder, device=device)
    prompt = build_prompt(tts.config, tts.encode, tts.text, tts.talker_weights.embed[0], text, speaker, LANGUAGE)
    max_seq = min(tts.talker_spec.max_position, prompt.embeds.shape[0] + frames + 1)
    decoders = make_decoders(tts, backend, max_seq, device=device)
    request = dict(speaker=speaker, language=LANGUAGE, backend=backend, seed=seed, decoders=decoders)
    warmup_s = _wall_s(lambda: list(synthesize(tts, text, max_frames=min(frames, WARMUP_FRAMES), **request)), device)
    stats = SpeakStats()
    start = time.perf_counter()
    chunks = synthesize(tts, text, max_frames=frames, stats=stats, **request)
    first = next(chunks)  # a CPU tensor: the codec's work is done
    first_s = time.perf_counter() - start
    for _ in chunks:
        pass
    total_s = time.perf_counter() - start
    return TtsRun(
        "mkport", first_chunk_ms=first_s * 1e3, first_chunk_frames=first.numel() // tts.codec.upsample,
        frame_ms=[s * 1e3 for s in stats.frame_s[1:]], frame_method="each frame (wall clock, synchronised)",
        total_s=total_s, frames=stats.frames, audio_s=stats.audio_s,
        extra={"warmup_s": warmup_s, "first_frame_ms": stats.frame_s[0] * 1e3 if stats.frame_s else None,
               "first_chunk_parts_ms": first_chunk_parts(stats),
               "backend": backend, "prompt_rows": prompt.embeds.shape[0], "setup_ms": stats.setup_s * 1e3,
               "codec_ms": [c * 1e3 for c in stats.codec_s], "sample_rate": stats.sample_rate,
               # the timeline (mkport.bench.plots.tts_timeline): ends of each frame and codec call since the request
               "frame_end_ms": [s * 1e3 for s in stats.frame_end_s],
               "chunk_end_ms": [s * 1e3 for s in stats.chunk_end_s], "chunk_samples": stats.chunk_samples},
    )


def first_chunk_parts(stats) -> dict | None:
    """Where a request's first chunk went (ms): set-up (host: prompt, codec state), the prompt prefill (device
    time), the first frame without it (talker step, predictor pass, codes to the host), the codec's first call."""
    if not stats.frame_s or not stats.codec_s or stats.prefill_s is None:
        return None
    return {"setup": stats.setup_s * 1e3, "prefill": stats.prefill_s * 1e3,
            "first_frame": (stats.frame_s[0] - stats.prefill_s) * 1e3, "codec": stats.codec_s[0] * 1e3}


def bench_official(folder, text: str, speaker, frames: int, seed: int, device) -> TtsRun:
    """Qwen3TTSModel.generate_custom_voice in bf16, as its README runs it. It does not stream: its first audio
    is all of its audio, so first_chunk_ms is the whole call. frame_ms: the mean over the frames of its
    `generate` (the codec decode after it excluded). Imported by mkport.tts.official, so the package's
    --no-deps install is enough."""
    from .official import load

    model = load().Qwen3TTSModel.from_pretrained(str(folder), dtype=torch.bfloat16, device_map=str(device))
    generate = model.model.generate
    timed: dict = {}

    def timed_generate(*args, **kwargs):
        _sync(device)
        t = time.perf_counter()
        codes, hidden = generate(*args, **kwargs)
        _sync(device)
        timed.update(generate_s=time.perf_counter() - t, frames=int(codes[0].shape[0]))
        return codes, hidden

    model.model.generate = timed_generate  # times the frame loop inside the public call; changes nothing
    request = dict(text=text, speaker=speaker, language=LANGUAGE)
    torch.manual_seed(seed)
    warmup_s = _wall_s(lambda: model.generate_custom_voice(**request, max_new_tokens=min(frames, WARMUP_FRAMES) + 1),
                       device)
    torch.manual_seed(seed)
    start = time.perf_counter()
    # the talker's last token never reaches the code predictor: frames + 1 tokens give `frames` frames
    wavs, sample_rate = model.generate_custom_voice(**request, max_new_tokens=frames + 1)
    _sync(device)
    total_s = time.perf_counter() - start
    n = timed["frames"]
    return TtsRun(
        "official", first_chunk_ms=total_s * 1e3, first_chunk_frames=n, streamed=False,
        frame_ms=[timed["generate_s"] / n * 1e3] if n else [], per_frame=False,
        frame_method="mean over its generate (not streamed: first chunk = whole call)",
        total_s=total_s, frames=n, audio_s=len(wavs[0]) / sample_rate,
        extra={"warmup_s": warmup_s, "generate_s": timed["generate_s"]},
    )


def bench_faster(folder, text: str, speaker, frames: int, seed: int, device) -> TtsRun:
    """FasterQwen3TTS.generate_custom_voice_streaming (CUDA graphs), graphs captured in the warm-up. Two timed
    requests: one with chunk_size = mkport's first chunk, stopped at its first chunk (first_chunk_ms), and one
    whole request with chunk_size = mkport's later chunks (frames, RTF). frame_ms: each chunk's decode time
    (its own synchronised timing, codec excluded) spread over the chunk's frames."""
    from faster_qwen3_tts import FasterQwen3TTS

    # faster-qwen3-tts imports qwen_tts only in from_pretrained; the package's __init__ registers the RoPE
    # initialiser that adapt_rope_shim wraps, so it must be imported first
    import qwen_tts  # noqa: F401

    from .official import adapt_rope_shim

    adapt_rope_shim()
    model = FasterQwen3TTS.from_pretrained(str(folder), device=str(device), dtype=torch.bfloat16)
    request = dict(text=text, speaker=speaker, language=LANGUAGE)
    torch.manual_seed(seed)
    warmup_s = _wall_s(lambda: list(model.generate_custom_voice_streaming(
        **request, max_new_tokens=min(frames, WARMUP_FRAMES), chunk_size=DEFAULT_FIRST_CHUNK)), device)
    torch.manual_seed(seed)
    start = time.perf_counter()
    stream = model.generate_custom_voice_streaming(**request, max_new_tokens=frames, chunk_size=DEFAULT_FIRST_CHUNK)
    _, _, first_timing = next(stream)  # numpy audio: on the host
    first_s = time.perf_counter() - start
    stream.close()
    torch.manual_seed(seed)
    _sync(device)
    start = time.perf_counter()
    samples, sample_rate, frame_ms, timings = 0, 24000, [], []
    for audio, sample_rate, timing in model.generate_custom_voice_streaming(**request, max_new_tokens=frames,
                                                                           chunk_size=DEFAULT_CHUNK):
        samples += len(audio)
        frame_ms += [timing["decode_ms"] / timing["chunk_steps"]] * timing["chunk_steps"]
        timings.append(timing)
    total_s = time.perf_counter() - start
    return TtsRun(
        "faster-qwen3-tts", first_chunk_ms=first_s * 1e3, first_chunk_frames=first_timing["chunk_steps"],
        frame_ms=frame_ms[1:], frame_method="chunk decode time / chunk frames (its own timing)",
        total_s=total_s, frames=len(frame_ms), audio_s=samples / sample_rate,
        extra={"warmup_s": warmup_s, "prefill_ms": timings[0]["prefill_ms"] if timings else None,
               "chunk_timings": timings,
               "first_chunk_timing": first_timing},
    )


def _failure(engine: str, e: BaseException) -> TtsRun:
    if isinstance(e, ImportError):
        return TtsRun(engine, error=f"not available: {type(e).__name__}: {e}")
    frame = traceback.extract_tb(e.__traceback__)[-1]
    where = f" ({frame.filename.rsplit('/', 2)[-1]}:{frame.lineno})"
    return TtsRun(engine, error=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}{where}")


def run_tts_bench(folder, text: str = DEFAULT_TEXT, frames: int = 100, seed: int = 0,
                  engines: tuple[str, ...] = TTS_ENGINES, device="cuda", mkport_backend: str = "megakernel",
                  plan: Path | None = None, progress=None) -> dict:
    """Every engine on the same folder and text; returns every raw number. An engine that cannot be imported
    or fails is recorded with its reason (mkport's own bad-input errors end the run). `plan`: a `mkport plan`
    file whose pick at batch 1 (one request) runs mkport, instead of `mkport_backend`."""
    from .compose import planned_composition, sequence_backend
    from .prompt import TtsConfig

    if not text.strip():
        raise MkportError("--text is empty: give the words to speak")
    if frames < 1:
        raise MkportError(f"--steps {frames}: the number of frames must be at least 1")
    tick = progress or (lambda message: None)
    config = TtsConfig.from_dict(json.loads((Path(folder) / "config.json").read_text()))
    if config.model_type != "custom_voice":
        raise MkportError(f"bench-tts runs CustomVoice models (a speaker id); this one is '{config.model_type}'")
    speaker = config.default_speaker
    composition = planned_composition(plan, folder, 1) if plan is not None else None
    if composition is not None:
        mkport_backend = sequence_backend(composition)
        if mkport_backend is None:  # a request here is synthesize()'s frame loop: one-sequence decoders
            raise MkportError(f"{plan}: its pick at batch 1, {composition.label}, is not what bench-tts runs (the "
                              "megakernel or the reference backend, serial); mkport plan --validate runs it end to end")
    runs = []
    for engine in engines:
        tick(f"{engine}: loading, warming up and timing one request")
        try:
            if engine == "mkport":
                runs.append(bench_mkport(folder, text, speaker, frames, seed, device, mkport_backend))
            elif engine == "official":
                runs.append(bench_official(folder, text, speaker, frames, seed, device))
            else:
                runs.append(bench_faster(folder, text, speaker, frames, seed, device))
        except MkportError:
            raise
        except Exception as e:  # an engine that cannot run here is reported, never skipped
            runs.append(_failure(engine, e))
        _free(device)
    return {
        "folder": str(folder),
        "text": text,
        "speaker": speaker,
        "language": LANGUAGE,
        "frames_requested": frames,
        "seed": seed,
        "warmup_frames": min(frames, WARMUP_FRAMES),
        "mkport_chunks": {"first": DEFAULT_FIRST_CHUNK, "later": DEFAULT_CHUNK},
        "plan": str(plan) if plan is not None else None,
        "composition": composition.label if composition is not None else None,  # the plan's, mkport ran on
        "environment": tts_environment(device),
        "results": [r.summary() for r in runs],
    }
