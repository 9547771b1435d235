"""A request in the server, as both schedulers (turns.py, batched.py) keep it: its job, its one error type, its
listener's playback clock, and its Stream: prompt and sampling, frames and codec state, the chunks waiting for their
codec work (PendingAudio, through the lane the codec runs on), the events it posts to the event loop, its stats.

Each stream has its own prompt, sampling parameters and codec state, so its audio depends on its request alone: the
same request and seed give the same samples alone and under load."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..tts.codec import StreamingCodec
from ..tts.limits import DEFAULT_MAX_FRAMES, fits
from ..tts.model import TtsModel
from ..tts.pipeline import TtsSampling, generate_frames
from ..tts.prompt import build_prompt
from ..tts.wav import to_pcm16
from .metrics import ServeMetrics


@dataclass(frozen=True)
class SpeechJob:
    """One utterance, checked against the model (see app.py)."""

    text: str
    speaker: str | None
    language: str = "auto"
    instruct: str | None = None
    seed: int = 0
    max_frames: int = DEFAULT_MAX_FRAMES


class PlaybackClock:
    """When a listener runs out of audio, the scheduler's deadline. A WebSocket session's utterances share
    one, so that the next utterance is due when the audio before it has played."""

    def __init__(self):
        self.ends_at: float | None = None

    def play(self, seconds: float, now: float) -> bool:
        """Adds audio that is ready at `now`; true when the listener had run out before it (a gap)."""
        starved = self.ends_at is not None and now > self.ends_at
        self.ends_at = max(self.ends_at or now, now) + seconds
        return starved


class CodecLane:
    """Where a turn's codec calls run and when their audio may leave. This one, serial: on the frames' CUDA stream,
    after the frame, so a chunk may leave as soon as it is decoded (by turns, and every serial composition; a split
    has batched.SplitCodecLane)."""

    # where the codec's CUDA graphs are captured (graphs.capture): torch's capture stream, unless the calls run beside
    # other graphs that use cuBLAS, which then need a workspace of their own
    capture_stream = None

    def producing(self):
        """The context of the scheduler's other work: loading, prefill, the frames."""
        return contextlib.nullcontext()

    def calls(self):
        """The context of a turn's codec calls."""
        return contextlib.nullcontext()

    def mark(self):
        """Right after a codec call that made a chunk: what the chunk waits for (PendingAudio)."""
        return None

    def to_host(self, audio: torch.Tensor) -> torch.Tensor:
        """A turn's decoded audio, every stream's, to the host in one copy and one wait, not one a stream."""
        return audio.cpu()

    def done(self, mark) -> bool:
        """Whether the codec work of `mark` has completed."""
        return True

    def wait(self) -> None:
        """Before a turn's audio is posted and its codec calls are queued: the turn before's codec work completes."""


SERIAL = CodecLane()


class PendingAudio:
    """A stream's decoded chunks, in order, each with the mark of the codec work that makes it (CodecLane.mark). A
    chunk leaves only when `done(mark)` is true and every chunk before it has left."""

    def __init__(self, done: Callable[[object], bool]):
        self.done = done
        self._chunks: deque[tuple[torch.Tensor, object]] = deque()

    def add(self, chunk: torch.Tensor, mark) -> None:
        self._chunks.append((chunk, mark))

    def ready(self) -> Iterator[torch.Tensor]:
        """The chunks that may leave now, oldest first (each taken out as it is yielded)."""
        while self._chunks and self.done(self._chunks[0][1]):
            yield self._chunks.popleft()[0]

    def clear(self) -> None:
        self._chunks.clear()

    def __len__(self) -> int:
        return len(self._chunks)


class RequestError(Exception):
    """What went wrong with one request, as the HTTP status and the one-line message its client gets: refused at
    the door (the app's checks) or ended while it streamed (the scheduler's)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Stream:
    """A request's state in the scheduler. Events for the event loop, through `post`: ("audio", pcm16
    bytes), then ("done", stats dict) or ("error", RequestError). `lane`: where its codec calls run and when their
    chunks may be posted (batched; the default posts each as soon as it is decoded)."""

    def __init__(self, job: SpeechJob, clock: PlaybackClock, post: Callable[[tuple], None], timeout_s: float,
                 lane: CodecLane = SERIAL):
        self.job, self.clock, self.post, self.lane = job, clock, post, lane
        self.arrival = time.perf_counter()
        self.expires_at = self.arrival + timeout_s
        self.cancelled = False  # set by the event loop; the scheduler drops the stream on its next turn
        self.decoders = None
        self.slot: int | None = None  # batched: the stream's slot of the FrameBatch
        self.started = False
        # when the scheduler took it, its prompt was built (prepare) and its join returned (timeline)
        self.admitted_at: float | None = None
        self.prepared_at: float | None = None
        self.joined_at: float | None = None
        self.sent_at: float | None = None  # the first chunk handed to the HTTP response, on the event loop (app.py)
        self.first_audio_at: float | None = None
        self.last_audio_at: float | None = None  # when its last chunk left
        # when its first chunk was made (decoded, or its codec work queued) and the audio seconds made so far: a chunk
        # leaves once its codec work is done, so a stream can have audio made and none posted yet (deadline)
        self.first_made_at: float | None = None
        self.made_s = 0.0
        self.frames = self.samples = self.underruns = 0
        # called as on_underrun(stream, seconds it was dry) when a chunk leaves after its audio ran out (the batched
        # scheduler's debug log of what it ran meanwhile)
        self.on_underrun: Callable[[Stream, float], None] | None = None
        self._frames = None
        self._codec: StreamingCodec | None = None
        self.flushed = False  # its last frame is in the codec, and the codec flushed
        self.pending = PendingAudio(lane.done)

    @property
    def newcomer(self) -> bool:
        """No audio of it made yet: due at its arrival (deadline)."""
        return self.first_made_at is None

    def deadline(self) -> float:
        """When its listener runs out of audio: for a newcomer, its arrival (or, in a session, when the utterance
        before it ends); once audio is made, when what was made would end had it left when the first of it was made
        (its chunks leave when their codec work is done), then the playback clock's end."""
        if self.first_audio_at is not None:
            return self.clock.ends_at
        if self.newcomer:
            return max(self.arrival, self.clock.ends_at or self.arrival)
        return max(self.first_made_at, self.clock.ends_at or self.first_made_at) + self.made_s

    def prepare(self, model: TtsModel, max_seq: int) -> tuple:
        """The prompt (tokens, text projection) and sampling, checked against a talker KV cache of max_seq, and
        this stream's codec. Returns (prompt, sampling)."""
        job = self.job
        prompt = build_prompt(model.config, model.encode, model.text, model.talker_weights.embed[0], job.text,
                              job.speaker, job.language, job.instruct)
        rows = prompt.embeds.shape[0]
        if not fits(rows, job.max_frames, max_seq):
            raise RequestError(400, f"input too long: its prompt is {rows} tokens, which with up to {job.max_frames} "
                                   f"frames exceeds a stream's KV cache ({max_seq}); send shorter text")
        self.started = True
        self.prepared_at = time.perf_counter()
        return prompt, TtsSampling.from_generation_config(model.generation, seed=job.seed)

    def start(self, model: TtsModel) -> None:
        """prepare, then the frame generator on this stream's decoders and its codec."""
        talker, predictor = self.decoders
        prompt, sampling = self.prepare(model, talker.max_seq)
        self._codec = StreamingCodec(model.codec)
        self._frames = generate_frames(model, prompt, talker, predictor, sampling, self.job.max_frames,
                                       caller_decodes=lambda k: self._codec.next_push_emits())

    def advance(self, model: TtsModel, metrics: ServeMetrics | None) -> bool:
        """Runs one frame (and the codec when a chunk is due); true when the stream is finished."""
        busy = metrics.busy if metrics else lambda part: contextlib.nullcontext()  # no metrics: the warm-up
        if not self.started:
            with busy("join"):
                self.start(model)
        with busy("frame"):
            frame = next(self._frames, None)
        with busy("codec"):
            return self.take(frame, False, model, metrics)

    def take(self, frame: torch.Tensor | None, last: bool, model: TtsModel, metrics: ServeMetrics | None) -> bool:
        """By turns: a frame's codes into the codec, a chunk when one is due; None: the stream ended before it (EOS
        or its frames made), `last`: this frame is its last. Once flushed, frames are ignored. True when the stream
        is finished: its codec flushed, every chunk posted."""
        if not self.flushed:
            if frame is not None:
                self.frames += 1
                self._decoded(self._codec.push(frame), model.codec.sample_rate, metrics)
            if frame is None or last:
                self._decoded(self._codec.flush(), model.codec.sample_rate, metrics)
                self.flushed = True
        return self.finished

    def take_audio(self, chunk: torch.Tensor | None, frames: int, ended: bool, sample_rate: int,
                   metrics: ServeMetrics | None) -> bool:
        """Batched: a chunk of `frames` frames already decoded (the engine's CodecStreams), None when none is due;
        `ended`: no frame follows. A chunk is posted when its codec work is done (the lane). True when the stream
        is finished: every chunk posted after its last frame."""
        if not self.flushed:
            if chunk is not None:
                self.frames += frames
                self._decoded(chunk, sample_rate, metrics)
            self.flushed = ended
        return self.finished

    @property
    def finished(self) -> bool:
        """Its codec flushed and every chunk posted."""
        return self.flushed and not self.pending

    def _decoded(self, chunk: torch.Tensor | None, sample_rate: int, metrics: ServeMetrics | None) -> None:
        if chunk is not None:
            if self.first_made_at is None:
                self.first_made_at = time.perf_counter()
            self.made_s += chunk.numel() / sample_rate
            self.pending.add(chunk, self.lane.mark())
            self.post_ready(sample_rate, metrics)

    def post_ready(self, sample_rate: int, metrics: ServeMetrics | None) -> None:
        """Posts the chunks whose codec work is done, in order."""
        for chunk in self.pending.ready():
            self._audio(chunk, sample_rate, metrics)

    def _audio(self, chunk: torch.Tensor, sample_rate: int, metrics: ServeMetrics | None) -> None:
        now = time.perf_counter()  # when it leaves: first audio and underruns count from here
        seconds, ran_out_at = chunk.numel() / sample_rate, self.clock.ends_at
        starved = self.clock.play(seconds, now)
        if self.first_audio_at is None:
            self.first_audio_at = now
            if metrics:
                metrics.time_to_first_audio.observe(now - self.arrival)
        elif starved:
            self.underruns += 1
            if metrics:
                metrics.underruns.inc()
            if self.on_underrun:
                self.on_underrun(self, now - ran_out_at)
        self.samples += chunk.numel()
        self.last_audio_at = now
        if metrics:
            metrics.audio_seconds.inc(seconds)
        self.post(("audio", to_pcm16(chunk)))

    def stats(self, sample_rate: int) -> dict:
        end = time.perf_counter()
        audio_s = self.samples / sample_rate
        return {
            "frames": self.frames,
            "audio_s": round(audio_s, 4),
            "first_audio_ms": None if self.first_audio_at is None else round((self.first_audio_at - self.arrival) * 1e3, 2),
            "total_ms": round((end - self.arrival) * 1e3, 2),
            "rtf": round((end - self.arrival) / audio_s, 4) if audio_s else None,
            "underruns": self.underruns,
        }

    def timeline(self) -> str:
        """Where its first audio's time went, for the server's debug log: waiting for the scheduler, its join
        (batched: its prompt built, then prefilled; by turns: its decoders, the prompt then in its first frame), then
        its first frame and codec call until the chunk left the scheduler, then the event loop until it was handed
        to the HTTP response (sent; '-' on a WebSocket)."""
        def ms(t):
            return "-" if t is None else f"{(t - self.arrival) * 1e3:.1f}"
        return (f"slot {self.slot}: admitted {ms(self.admitted_at)} ms after arrival, prompt {ms(self.prepared_at)}, "
                f"joined {ms(self.joined_at)}, first audio {ms(self.first_audio_at)}, sent {ms(self.sent_at)}")

    def close(self) -> None:
        """Drops what is left: the frame generator and the chunks not yet posted."""
        self.pending.clear()
        if self._frames is not None:
            self._frames.close()
            self._frames = None
