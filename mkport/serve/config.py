"""The server's settings (no torch here: the CLI reads these before anything heavy is imported)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_PORT = 8000
DEFAULT_MAX_STREAMS = 8
DEFAULT_MAX_FRAMES = 1500  # 120 s of audio at 12.5 frames a second
DEFAULT_MAX_INPUT_CHARS = 4096  # OpenAI's limit for `input`
DEFAULT_REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ServeConfig:
    folder: Path
    model_id: str
    backend: str = "megakernel"  # the talker's and the predictor's, without a plan
    max_streams: int = DEFAULT_MAX_STREAMS
    max_frames: int = DEFAULT_MAX_FRAMES  # the most a request may ask for, and its default
    max_seq: int | None = None  # each stream's talker KV cache (prompt + frames must fit); None: the runtime's default
    max_input_chars: int = DEFAULT_MAX_INPUT_CHARS
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    batched: bool = False  # every stream in one batch decoder, all advanced by each frame (engine.py)
    plan: Path | None = None  # a `mkport plan` file: its pick for the batch size runs the talker and the predictor
    voice_map: dict[str, str] | None = None  # voice names -> speakers; None: OpenAI's voices (voices.py)
    random_weights: bool = False  # the model is random (its audio is noise): /ready and the demo page say so
