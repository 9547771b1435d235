"""The server's settings (no torch here: the CLI reads these before anything heavy is imported)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..tts.limits import DEFAULT_MAX_FRAMES

DEFAULT_PORT = 8000
DEFAULT_MAX_STREAMS = 8  # by turns and on the CPU (by turns a GPU keeps ~20 streams ahead of real time)
MAX_BATCHED_STREAMS = 256  # --max-streams with --batched: batches of up to 32 taking turns, each slot a KV cache
DEFAULT_MAX_INPUT_CHARS = 4096  # OpenAI's limit for `input`
DEFAULT_REQUEST_TIMEOUT_S = 300.0
MAX_FRAMES_PER_TURN = 8  # --frames-per-turn: a turn's frames, each stream's steady chunk (640 ms at 8)
# --frame-lanes: two are measured in a server (the default where they run: 20 req/s without underruns,
# docs/serving.md); three lanes made no more frames a second in the bench, and its run with the codec on three lanes
# did not finish (docs/benchmarks.md, "Frames on shares of the SMs")
MAX_FRAME_LANES = 2


@dataclass(frozen=True)
class ServeConfig:
    folder: Path
    model_id: str
    backend: str = "megakernel"  # the talker's and the predictor's, without a plan
    max_streams: int = DEFAULT_MAX_STREAMS
    # batched on a CUDA GPU: max_streams is only a cap, lowered at loading to what the GPU's free memory holds
    # (batched.fit_streams; the CLI's default there). False: max_streams as given, refused there if memory holds fewer
    streams_by_memory: bool = False
    max_frames: int = DEFAULT_MAX_FRAMES  # the most a request may ask for
    default_frames: int | None = None  # a request's frames when it asks for none; None: max_frames
    max_seq: int | None = None  # each stream's talker KV cache (prompt + frames must fit); None: the runtime's default
    max_input_chars: int = DEFAULT_MAX_INPUT_CHARS
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    batched: bool = False  # every stream in one batch decoder, all advanced by each frame (batched.py)
    sized_batches: bool = True  # batched: a frame runs the smallest batch size holding the streams (False: --fixed-batch)
    # batched: the most streams a batch holds (--batch-size); more take turns in batches of it. None: as many as
    # max_streams, up to what the model fits
    batch_size: int | None = None
    # batched, sized frames: the megakernels of every size sum a row as the batch's full size does (launch_plan's
    # batch-invariant plans, --batch-invariant), so a stream's samples are the same alone and under load
    batch_invariant: bool = False
    # batched, a serial composition on a CUDA GPU: a turn's codec audio is copied to the host without waiting and its
    # chunks leave during the next turn's frame (batched.OverlappedCodecLane; False: --no-codec-overlap, each chunk
    # leaves as soon as its call is done, the host waiting for it)
    codec_overlap: bool = True
    # batched on the megakernel, frames sized to the streams: a turn's joins prefill their prompts together, one
    # prefill a lane (batched.joins_together, --joins-together); False: a prefill each (--joins-alone); None: together
    # where it runs (given True elsewhere, engine.Engine refuses it)
    joins_together: bool | None = None
    # batched: a turn makes N frames of its batch back to back, a stream's chunks then 1, N - 1, N, ... frames of its
    # own count (tts.codec.turn_chunk), so a codec call per N frames (1: a call a frame)
    frames_per_turn: int = 1
    # on a GPU: the codec's graphs capture torch.compile's fusion of its calls (tts.codec.compiled_stream;
    # --compile-codec / --no-compile-codec). None: on where it was measured to help, --batched on a CUDA GPU whose
    # Triton can build (engine.Engine resolves it)
    compile_codec: bool | None = None
    # batched on the megakernel on a CUDA GPU: the codec's calls on a CUDA stream of their own, beside the next frame,
    # the megakernels on every SM but these (the composition `mk+mk split K` without a plan, --codec-sms); 0: serial
    codec_sms: int = 0
    # batched on the megakernel on a CUDA GPU: the batches split into L lanes, each lane's megakernels on 1/L of the SMs
    # and a CUDA stream of its own, its next frame queued as soon as its last one's codes are read while the other
    # lanes' frames run (batched.FrameLane, --frame-lanes); 1: one batch's frame at a time on every SM. None: 2 where
    # they were measured to help, else 1 (engine.frame_lanes_asked)
    frame_lanes: int | None = None
    plan: Path | None = None  # a `mkport plan` file: its pick for the batch size runs the talker and the predictor
    voice_map: dict[str, str] | None = None  # voice names -> speakers; None: OpenAI's voices (voices.py)
    random_weights: bool = False  # the model is random (its audio is noise): /ready and the demo page say so

    @property
    def request_frames(self) -> int:
        """A request's max_frames when it gives none."""
        return self.default_frames or self.max_frames
