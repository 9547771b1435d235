"""`mkport speak`: text -> streaming WAV (stdout or a file). Registered by mkport/cli/__init__.py."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from ..errors import MkportError
from ..tts.limits import DEFAULT_MAX_FRAMES, RANDOM_WEIGHTS_FRAMES, check_max_frames, default_max_frames
from .options import tts_model

class _Progress:
    """The live status line: read from the stats while the frame loop fills them."""

    def __init__(self, stats):
        self.stats = stats

    def __rich__(self) -> str:
        return f"speaking: {self.stats.frames} frames, {self.stats.audio_s:.2f} s of audio written"


def speak(
    ctx: typer.Context,
    text: str = typer.Argument(..., help="The text to speak (long text is spoken sentence group by sentence group)."),
    model: Optional[Path] = typer.Option(None, "--model", help="Qwen3-TTS-12Hz model folder (with speech_tokenizer/)."),
    random_weights: Optional[str] = typer.Option(
        None, "--random-weights", help="Seeded random model instead of --model: 0.6b, 1.7b or tiny."
    ),
    speaker: Optional[str] = typer.Option(None, "--speaker", help="CustomVoice speaker (default: the first in the config)."),
    language: str = typer.Option("auto", "--language", help="Language name from the config, or auto."),
    instruct: Optional[str] = typer.Option(None, "--instruct", help="Style instruction (1.7B models)."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    weights_seed: int = typer.Option(0, "--weights-seed", help="Seed of --random-weights."),
    out: str = typer.Option("-", "--out", help="WAV file to write, or - for stdout."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out file."),
    backend: str = typer.Option("megakernel", "--backend", help="megakernel (CUDA) or reference (plain torch)."),
    max_frames: Optional[int] = typer.Option(
        None, "--max-frames", help="Stop each utterance after this many 12.5 Hz frames (80 ms each); default "
        f"{DEFAULT_MAX_FRAMES}, {RANDOM_WEIGHTS_FRAMES} with --random-weights (they never pick EOS)."
    ),
    text_mode: str = typer.Option(
        "non-streaming", "--text-mode", help="non-streaming (all text in the prompt, the official CustomVoice default) or streaming."
    ),
    greedy: bool = typer.Option(False, "--greedy", help="Argmax instead of sampling (talker and predictor)."),
    server: Optional[str] = typer.Option(
        None, "--server", help="URL of a running mkport serve to speak through, loading no model here "
        "(default: $MKPORT_SERVER when neither --model nor --random-weights is given)."
    ),
    verbose: bool = typer.Option(False, "--verbose", help="Print where the time went, from the process's start."),
):
    """Speak TEXT with Qwen3-TTS-12Hz, streaming 16-bit 24 kHz WAV to stdout (or --out FILE)."""
    from ..serve.client import server_url, speak_remote
    from ..bench.timing import Steps

    steps = Steps("python start, mkport's imports")
    if url := server_url(server, model is not None or random_weights is not None):
        return speak_remote(url, text, out, ctx.get_parameter_source, force=force, voice=speaker, language=language,
                            instructions=instruct, seed=seed, max_frames=max_frames)
    from ..runtime.sampling import check_seed
    from ..tts.model import TtsModel
    from ..runtime.backends import check_backend
    from ..tts.pipeline import SpeakStats, synthesize
    from ..tts.wav import open_wav_output

    steps.mark("import torch, mkport's model code")
    # every option is checked, and the output opened, before anything loads
    if not text.strip():
        raise MkportError("text is empty: give the words to speak")
    tts_arg = tts_model(model, random_weights, weights_seed, "--model DIR")
    check_backend(backend)
    check_seed(seed, "--seed")
    if max_frames is None:
        max_frames = default_max_frames(random_weights is not None)
    check_max_frames(max_frames)
    err = Console(stderr=True)
    status = err.status("loading the model") if err.is_terminal else contextlib.nullcontext()
    stats = SpeakStats()
    with open_wav_output(out, force=force) as wav, status:
        t0 = time.perf_counter()
        if backend == "megakernel":  # with it the text projection and the codec run on the GPU too
            import torch

            torch.zeros(1, device="cuda")
            steps.mark("CUDA start")
        # one request: the prefill and the codec run eagerly, cheaper than capturing their CUDA graphs
        tts = TtsModel.load(tts_arg.folder(), device="cuda" if backend == "megakernel" else "cpu", graphs=False,
                            mark=steps.mark)
        load_s = time.perf_counter() - t0
        wav.sample_rate = tts.codec.sample_rate
        if err.is_terminal:
            status.update(_Progress(stats))
        for chunk in synthesize(tts, text, speaker=speaker or tts.config.default_speaker, language=language,
                                instruct=instruct, text_mode=text_mode, backend=backend, seed=seed,
                                max_frames=max_frames, greedy=greedy, stats=stats):
            wav.write(chunk)
            if stats.frames and len(stats.codec_s) == 1:
                steps.mark("first WAV bytes written")
                steps.detail("prompt: tokenizer, text projection", stats.prompt_s)
                steps.detail("decoders: kernels loaded, weights to the GPU", stats.decoders_s)
                steps.detail("first frame, prompt prefill included", stats.frame_s[0])
                steps.detail("codec, first chunk", stats.codec_s[0])
        steps.mark(f"the rest: {stats.frames} frames in all, {stats.audio_s:.2f} s of audio")
    if verbose:
        print("\n".join(steps.lines("mkport speak: where the time went (seconds)")), file=sys.stderr)
    print(
        f"mkport speak: {stats.frames} frames, {stats.audio_s:.2f} s audio, backend {backend}; "
        f"load {load_s:.2f} s, first chunk {stats.first_chunk_s if stats.first_chunk_s is not None else float('nan'):.3f} s, "
        f"total {stats.total_s:.2f} s, real-time factor {stats.rtf:.3f}",
        file=sys.stderr,
    )
