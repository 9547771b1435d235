"""`mkport speak`: text -> streaming WAV (stdout or a file). Registered by mkport/cli.py."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer

from ..errors import MkportError


def speak(
    ctx: typer.Context,
    text: str = typer.Argument(..., help="The text to speak."),
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
    backend: str = typer.Option("megakernel", "--backend", help="megakernel (CUDA) or reference (plain torch)."),
    max_frames: int = typer.Option(1000, "--max-frames", help="Stop after this many 12.5 Hz frames (80 ms each)."),
    text_mode: str = typer.Option(
        "non-streaming", "--text-mode", help="non-streaming (all text in the prompt, the official CustomVoice default) or streaming."
    ),
    greedy: bool = typer.Option(False, "--greedy", help="Argmax instead of sampling (talker and predictor)."),
    server: Optional[str] = typer.Option(
        None, "--server", help="URL of a running mkport serve to speak through, loading no model here "
        "(default: $MKPORT_SERVER when neither --model nor --random-weights is given)."
    ),
):
    """Speak TEXT with Qwen3-TTS-12Hz, streaming 16-bit 24 kHz WAV to stdout (or --out FILE)."""
    from ..serve.client import server_url, speak_remote

    if url := server_url(server, model is not None or random_weights is not None):
        return speak_remote(url, text, out, ctx.get_parameter_source, voice=speaker, language=language,
                            instructions=instruct, seed=seed, max_frames=max_frames)
    from ..runtime import check_seed
    from .model import TtsModel, random_model_folder
    from .pipeline import SpeakStats, check_backend, synthesize
    from .wav import open_wav_output

    if not text.strip():
        raise MkportError("text is empty: give the words to speak")
    if (model is None) == (random_weights is None):
        raise MkportError("give exactly one of --model DIR or --random-weights SPEC")
    check_backend(backend)  # before loading anything
    check_seed(seed, "--seed")
    check_seed(weights_seed, "--weights-seed")
    if max_frames < 1:
        raise MkportError(f"--max-frames {max_frames}: must be at least 1")
    t0 = time.perf_counter()
    folder = random_model_folder(random_weights, weights_seed) if random_weights else model
    # with the megakernel backend the text projection and the codec run on the GPU too
    tts = TtsModel.load(folder, device="cuda" if backend == "megakernel" else "cpu")
    if speaker is None:
        speaker = tts.config.default_speaker
    load_s = time.perf_counter() - t0
    stats = SpeakStats()
    # everything that can be checked is checked before the first byte is written
    chunks = synthesize(tts, text, speaker=speaker, language=language, instruct=instruct, text_mode=text_mode,
                        backend=backend, seed=seed, max_frames=max_frames, greedy=greedy, stats=stats)
    first = next(chunks, None)
    with open_wav_output(out, tts.codec.sample_rate) as wav:
        if first is not None:
            wav.write(first)
        for chunk in chunks:
            wav.write(chunk)
    print(
        f"mkport speak: {stats.frames} frames, {stats.audio_s:.2f} s audio, backend {backend}; "
        f"load {load_s:.2f} s, first chunk {stats.first_chunk_s if stats.first_chunk_s is not None else float('nan'):.3f} s, "
        f"total {stats.total_s:.2f} s, real-time factor {stats.rtf:.3f}",
        file=sys.stderr,
    )
