"""The engine: one Qwen3-TTS model, a pool of decoder pairs (talker + code predictor, one per stream slot,
sharing the weights), and the scheduler thread that advances every active stream one frame at a time.

All torch work runs on that one thread, so the GPU sees one request's frame at a time and no two threads
touch torch state; the event loop only moves bytes. Each stream has its own decoder pair (KV caches,
positions, repetition history, random stream), its own prompt and sampling parameters and its own
StreamingCodec with its own codec state (the shared speech decoder copies it in and out around each call), so a
stream's audio depends on its request alone: the same request and seed give the same samples alone and under load.

Scheduling policy: earliest deadline first, one frame per turn. A stream's deadline is the moment its
listener runs out of audio (PlaybackClock): a stream that has not sent audio yet is due at its arrival (a
WebSocket session's next utterance when the audio before it has played), so new requests go first and get
their first chunk within a frame or two, while a running stream moves up as its buffered audio drains and
cannot be starved: each frame of work pushes a stream's deadline 80 ms further, and a newcomer's deadline
is fixed. Ties go to the earlier arrival.

Batched (`--batched`): the streams share one batch decoder pair of --max-streams sequences
(mkport.tts.batch.FrameBatch), a stream a slot. Every turn, the arrivals join the batch (their prompts
prefilled into free slots), then one batched frame advances every stream at once: a frame of B streams
reads each weight once, so it costs far less than B frames. No stream waits for another's turn; a new stream
waits for at most the frame in flight. Each stream keeps its own slot state (KV cache, position, repetition
history, seeds) and its own codec state, so its audio is the same alone and in any batch. The codec decodes
the turn's frame of every stream in one call of a fixed shape (CodecStreams: its state kept per slot, no frame
decoded twice, the same arithmetic for a stream whoever shares the call), and each stream's 80 ms of audio leaves
that turn.

A plan's split (Composition.codec_sms > 0, batched only): the batch decoders are megakernels on all SMs but the
codec's (their grid), every frame on a high-priority CUDA stream, and the codec calls on a second stream, where
they run beside the next frame (SplitCodecLane). A chunk is posted once the event recorded after its codec call has
completed: the turn after it was decoded, when that turn's frame has been made; the host waits for a turn's codec
work before it queues the next turn's, so the codec is at most a frame behind (as mkport.tts.compose runs it). The
codec calls are the same as serial ones, so the samples are too; only when they leave moves.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..errors import MkportError
from ..tts.planner import Composition
from ..runtime.decoder import DEFAULT_MAX_SEQ
from ..runtime.torch_model import PREFILL_MIN_BUCKET
from ..tts.codec import CodecStreams, StreamingCodec
from ..tts.batch import FrameBatch, FrameGroups, make_batch_decoders
from ..tts.compose import device_identity, planned_composition, sequence_backend
from ..tts.limits import DEFAULT_MAX_FRAMES, fits
from ..tts.model import TtsModel
from ..tts.pipeline import TorchDecoder, TtsSampling, check_backend, generate_frames
from ..tts.prompt import build_prompt
from ..tts.wav import to_pcm16
from .config import ServeConfig
from .metrics import ServeMetrics

log = logging.getLogger("mkport.serve")

WARMUP_TEXT = "Warm up."
WARMUP_FRAMES = 2
# prefill graphs captured at start-up for up to this many prompt rows after the prefix (more: on first use)
WARM_PREFILL_ROWS = 256
WARM_SLOT_PREFILL_ROWS = 64  # the shortest padded prompt a batch slot's graphs are captured for at start-up


@dataclass(frozen=True)
class SpeechJob:
    """One utterance, checked against the model (see app.py)."""

    text: str
    speaker: str | None
    language: str = "auto"
    instruct: str | None = None
    seed: int = 0
    max_frames: int = DEFAULT_MAX_FRAMES


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    model_type: str
    model_size: str
    speakers: list[str]
    languages: list[str]
    default_speaker: str | None
    sample_rate: int


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
    """Where a batched turn's codec calls run and when their audio may leave. This one, serial: on the frames' CUDA
    stream, after the frame, so a chunk may leave as soon as it is decoded (every serial composition)."""

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


class SplitCodecLane(CodecLane):
    """A split of the SMs: the frames on a high-priority CUDA stream, so the megakernels go first; the codec calls on
    a second stream, beside the next frame; a chunk waits for the event recorded after its call."""

    def __init__(self):
        self.producer = torch.cuda.Stream(priority=-1)
        self.side = torch.cuda.Stream()
        self.last: torch.cuda.Event | None = None

    def producing(self):
        return torch.cuda.stream(self.producer)

    def calls(self):
        self.side.wait_stream(self.producer)  # what the codec reads was made there (its graphs, at warm-up)
        return torch.cuda.stream(self.side)

    def mark(self) -> torch.cuda.Event:
        self.last = torch.cuda.Event()
        self.last.record(self.side)
        return self.last

    def to_host(self, audio: torch.Tensor) -> torch.Tensor:
        # queued on the side stream without waiting: the chunks' marks are recorded after it
        host = torch.empty(audio.shape, dtype=audio.dtype, pin_memory=True)
        return host.copy_(audio, non_blocking=True)

    def done(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def wait(self) -> None:
        if self.last is not None:
            self.last.synchronize()  # events complete in order on one stream: every earlier chunk's too


def codec_lane(comp: Composition) -> CodecLane:
    """The lane of a batched engine running `comp`."""
    return SplitCodecLane() if comp.codec_sms else CodecLane()


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
        self.first_audio_at: float | None = None
        self.frames = self.samples = self.underruns = 0
        self._frames = None
        self._codec: StreamingCodec | None = None
        self.flushed = False  # its last frame is in the codec, and the codec flushed
        self.pending = PendingAudio(lane.done)

    def deadline(self) -> float:
        if self.first_audio_at is None:
            return max(self.arrival, self.clock.ends_at or self.arrival)
        return self.clock.ends_at

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

    def take_audio(self, chunk: torch.Tensor | None, ended: bool, sample_rate: int, metrics: ServeMetrics | None) -> bool:
        """Batched: this turn's frame already decoded (the engine's CodecStreams), None when the stream made none;
        `ended`: no frame follows. A chunk is posted when its codec work is done (the lane). True when the stream
        is finished: every chunk posted after its last frame."""
        if not self.flushed:
            if chunk is not None:
                self.frames += 1
                self._decoded(chunk, sample_rate, metrics)
            self.flushed = ended
        return self.finished

    @property
    def finished(self) -> bool:
        """Its codec flushed and every chunk posted."""
        return self.flushed and not self.pending

    def _decoded(self, chunk: torch.Tensor | None, sample_rate: int, metrics: ServeMetrics | None) -> None:
        if chunk is not None:
            self.pending.add(chunk, self.lane.mark())
            self.post_ready(sample_rate, metrics)

    def post_ready(self, sample_rate: int, metrics: ServeMetrics | None) -> None:
        """Posts the chunks whose codec work is done, in order."""
        for chunk in self.pending.ready():
            self._audio(chunk, sample_rate, metrics)

    def _audio(self, chunk: torch.Tensor, sample_rate: int, metrics: ServeMetrics | None) -> None:
        now = time.perf_counter()  # when it leaves: first audio and underruns count from here
        seconds = chunk.numel() / sample_rate
        starved = self.clock.play(seconds, now)
        if self.first_audio_at is None:
            self.first_audio_at = now
            if metrics:
                metrics.time_to_first_audio.observe(now - self.arrival)
        elif starved:
            self.underruns += 1
            if metrics:
                metrics.underruns.inc()
        self.samples += chunk.numel()
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

    def close(self) -> None:
        """Drops what is left: the frame generator and the chunks not yet posted."""
        self.pending.clear()
        if self._frames is not None:
            self._frames.close()
            self._frames = None


def next_stream(active: list[Stream]) -> Stream:
    """The scheduling policy (module docstring): earliest deadline first, then earliest arrival."""
    return min(active, key=lambda s: (s.deadline(), s.arrival))


def warm_prefill_lengths(first: int, room: int) -> list[int]:
    """The padded prompt lengths whose prefill graphs start-up captures: first, doubling, up to WARM_PREFILL_ROWS
    and the cache rows left (`room`)."""
    lengths = []
    while first <= min(WARM_PREFILL_ROWS, room):
        lengths.append(first)
        first *= 2
    return lengths


def batch_size(config: ServeConfig) -> int:
    """The batch decoders' size for --max-streams: the megakernel's next batch size (launch_plan.BATCHES), also with a
    plan (its picks may run the megakernel, which has only those)."""
    if config.backend != "megakernel" and config.plan is None:
        return config.max_streams
    from ..kernel.launch_plan import BATCHES

    fits = [b for b in BATCHES if b >= config.max_streams]
    if not fits:
        raise MkportError(f"--max-streams {config.max_streams} with --batched: a batch holds at most {BATCHES[-1]}")
    return fits[0]


def batch_groups(config: ServeConfig, comp: Composition, model: TtsModel) -> tuple[int, int]:
    """(size, count) of the batches that hold --max-streams streams: one batch of batch_size(config), or, where the
    megakernel cannot hold that many sequences of this model (shared memory: the 1.7B holds 16), batches of the
    largest size it holds, taking turns (FrameGroups)."""
    size = batch_size(config)
    if "megakernel" in (comp.talker, comp.predictor):
        from ..runtime.decoder import current_device_target
        from ..kernel.launch_plan import largest_batch

        target = current_device_target()
        # at least 1: where not even one sequence fits, building the decoder says so
        size = max(1, min(size, largest_batch(model.talker_spec, target), largest_batch(model.predictor_spec, target)))
    return size, -(-config.max_streams // size)


def served_composition(config: ServeConfig) -> Composition:
    """What config.plan picks for this server's batch size (batch_size; 1 without --batched), if the engine can
    run it: without --batched, on one-sequence decoder pairs (serial); a split, with --batched on a CUDA GPU."""
    batch = batch_size(config) if config.batched else 1
    comp = planned_composition(config.plan, config.folder, batch)
    pick = f"{config.plan}: its pick at batch {batch}, {comp.label},"
    if not config.batched and sequence_backend(comp) is None:
        what = "runs the codec beside the megakernels" if comp.codec_sms else "runs batch decoders"
        raise MkportError(f"{pick} {what}; without --batched the server runs the megakernel or the reference "
                          "backend one stream a pair, the codec after each frame: serve with --batched")
    if comp.codec_sms and not torch.cuda.is_available():
        raise MkportError(f"{pick} runs the codec beside the megakernels on SMs of its own, which needs a CUDA GPU")
    for backend in (comp.talker, comp.predictor):
        check_backend(backend, batched=True)
    return comp


def decoder_pairs(model: TtsModel, backend: str, count: int, max_seq: int) -> list[tuple]:
    """`count` (talker, predictor) pairs that share one copy of the weights on the device; each has its own
    KV caches, scratch buffers, positions and random stream."""
    check_backend(backend)
    pred_seq = model.config.num_code_groups + 1
    if backend == "megakernel":
        from ..runtime.decoder import Decoder

        # already on the GPU and contiguous, so each Decoder's weights.to("cuda") keeps these tensors
        talker_w, pred_w = model.talker_weights.to("cuda"), model.predictor_weights.to("cuda")
        return [(Decoder(model.talker_spec, talker_w, max_seq), Decoder(model.predictor_spec, pred_w, pred_seq))
                for _ in range(count)]
    # already float32, so each TorchDecoder's conversion keeps these tensors
    f32 = lambda w: w.map(lambda t: t.to(torch.float32).contiguous())  # noqa: E731
    talker_w, pred_w = f32(model.talker_weights), f32(model.predictor_weights)
    return [(TorchDecoder(model.talker_spec, talker_w, max_seq, "cpu"),
             TorchDecoder(model.predictor_spec, pred_w, pred_seq, "cpu")) for _ in range(count)]


class Engine:
    def __init__(self, config: ServeConfig, metrics: ServeMetrics | None = None):
        if config.max_streams < 1:
            raise MkportError(f"--max-streams {config.max_streams}: must be at least 1")
        if config.max_frames < 1:
            raise MkportError(f"--max-frames {config.max_frames}: must be at least 1")
        # a backend, a batch or a plan that cannot be is refused now, not after loading
        if config.plan is None:
            check_backend(config.backend)
            if config.batched:
                batch_size(config)
            self.composition = Composition(config.backend, config.backend)
        else:
            self.composition = served_composition(config)
        self.config = config
        self.metrics = metrics or ServeMetrics()
        self.metrics.max_streams.set(config.max_streams)
        self.model: TtsModel | None = None
        self.info: ModelInfo | None = None
        self.ready = False
        self.draining = False
        self.error: str | None = None  # why loading or the scheduler failed (the server then stops)
        self.load_s = self.warm_s = None
        self.on_fatal: Callable[[], None] | None = None  # called on self.error (the CLI stops the server)
        self._wake = threading.Condition()
        self._slots = 0
        self._pending: list[Stream] = []
        self._active: list[Stream] = []
        self._pool: list[tuple] = []
        self._batch: FrameGroups | None = None  # batched: every stream's slot, in one or more batches
        self._lane = codec_lane(self.composition)  # batched: where the codec runs, when its audio leaves
        self._codecs: CodecStreams | None = None  # batched: every slot's codec state, decoded together
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def backend(self) -> str:
        """What runs the talker and the code predictor: their backend, or both joined by '+'."""
        comp = self.composition
        return comp.talker if comp.talker == comp.predictor else f"{comp.talker}+{comp.predictor}"

    # -- the event loop's side ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mkport-scheduler", daemon=True)
        self._thread.start()

    def try_admit(self) -> bool:
        """Takes a stream slot when one is free (never waits)."""
        with self._wake:
            if self._slots >= self.config.max_streams:
                return False
            self._slots += 1
        self.metrics.active_streams.inc()
        return True

    def release(self) -> None:
        with self._wake:
            self._slots -= 1
        self.metrics.active_streams.dec()

    def submit(self, job: SpeechJob, post: Callable[[tuple], None], clock: PlaybackClock | None = None) -> Stream:
        """Queues a stream for a slot already taken with try_admit."""
        stream = Stream(job, clock or PlaybackClock(), post, self.config.request_timeout_s, self._lane)
        with self._wake:
            self._pending.append(stream)
            self._wake.notify()
        return stream

    def cancel(self, stream: Stream) -> None:
        """Drops a stream (client gone, interrupted); its decoders are free before the next stream starts.
        Set before the slot is released, so a stream admitted into that slot always finds a decoder pair."""
        stream.cancelled = True
        with self._wake:
            self._wake.notify()

    def drain(self) -> None:
        """Shutdown has begun: refuse new streams, let the running ones finish."""
        self.draining = True
        self.ready = False

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ends the scheduler (streams still running get an error event) and frees the decoders."""
        self.drain()
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # -- the scheduler thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.no_grad(), self._lane.producing():
                self._load()
                self.ready = not self.draining
                self._schedule()
        except Exception as e:  # noqa: BLE001 - reported, and the server stops
            stage = "serving" if self.ready else "loading"
            self.error = f"{stage} failed: " + (str(e) if isinstance(e, MkportError) else f"{type(e).__name__}: {e}")
            if self.ready:  # a bug: keep the traceback
                log.exception(self.error)
            else:
                log.error(self.error)
            self.ready = False
            if self.on_fatal:
                self.on_fatal()
        finally:
            for stream in self._active + self._pending:
                stream.close()
                stream.post(("error", RequestError(503, self.error or "the server is shutting down")))
            self._active, self._pending, self._pool, self._batch = [], [], [], None
            self.model = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _load(self) -> None:
        cfg, comp = self.config, self.composition
        t0 = time.perf_counter()
        on_gpu = {comp.talker, comp.predictor} != {"reference"} and torch.cuda.is_available()
        model = TtsModel.load(cfg.folder, device="cuda" if on_gpu else "cpu")
        max_seq = min(model.talker_spec.max_position, cfg.max_seq or DEFAULT_MAX_SEQ)
        if cfg.batched:
            sms = comp.producer_sms(device_identity()[1]) if comp.codec_sms else None  # a split: the codec's SMs left
            size, count = batch_groups(cfg, comp, model)
            self._batch = FrameGroups([FrameBatch(model, *make_batch_decoders(model, comp.talker, max_seq, size,
                                                                              predictor_backend=comp.predictor, sms=sms))
                                       for _ in range(count)])
        else:
            self._pool = decoder_pairs(model, comp.talker, cfg.max_streams, max_seq)
        self.model = model
        self.info = ModelInfo(cfg.model_id, model.config.model_type, model.config.model_size,
                              sorted(model.config.speakers), sorted(model.config.languages),
                              model.config.default_speaker, model.codec.sample_rate)
        self.load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if self._batch is not None:
            self._codecs = CodecStreams(model.codec, self._batch.batch)
            self._codecs.prepare()
        else:
            StreamingCodec(model.codec)  # captures a graph for each chunk length a stream decodes (1 to 16 frames)
        # every megakernel pair has graphs and launches of its own to warm; the reference pairs share all
        # that is warmed (the codec, the text side), so one of them is enough
        for pair in self._pool if comp.talker == "megakernel" else self._pool[:1]:
            self._warm(pair)
        if self._batch is not None:
            self._warm_batch()
        # what is loaded lives as long as the server: out of the collector's way, a full collection takes ~0.1 ms
        # instead of ~60 ms (the model's ~170,000 objects walked), a pause a request would otherwise meet at random
        gc.collect()
        gc.freeze()
        self.warm_s = time.perf_counter() - t0
        layout = self.batch_layout()
        log.info("ready: %s, %s (%s), %d streams%s; load %.1f s, warm-up %.1f s", cfg.model_id, comp.label,
                 f"the pick of {cfg.plan}" if cfg.plan else f"backend {cfg.backend}", cfg.max_streams,
                 f" in {layout[1]} batch(es) of {layout[0]}" if layout else "", self.load_s, self.warm_s)

    def batch_layout(self) -> list[int] | None:
        """Batched: [slots a batch, batches]; None for decoder pairs (or before loading)."""
        return None if self._batch is None else [self._batch.size, len(self._batch.groups)]

    def _warm(self, pair: tuple) -> None:
        """Runs what a request runs on this pair (kernel launches, codec graphs, cuBLAS set-up) and, on the
        megakernel, captures the prefill graphs of the usual prompt lengths: a request's prompt prefix
        comes from the prefix cache (after its first use), and the rest is prefilled after it, so the
        graphs are those of the rows after the prefixes of the default speaker, with language auto and
        with a named one."""
        talker, model = pair[0], self.model
        if self.composition.talker == "megakernel":
            languages = ["auto"] + sorted(model.config.languages)[:1]
            starts = {build_prompt(model.config, model.encode, model.text, model.talker_weights.embed[0], WARMUP_TEXT,
                                   self.info.default_speaker, language).prefix_rows for language in languages}
            zeros = lambda n: torch.zeros(n, talker.spec.input_dim, device=talker.device)  # noqa: E731
            for start in sorted(starts):
                for rows in warm_prefill_lengths(PREFILL_MIN_BUCKET, talker.max_seq - start):
                    talker.reset()
                    talker.prefill(embeds=zeros(start))
                    talker.prefill(embeds=zeros(rows))
        job = SpeechJob(WARMUP_TEXT, self.info.default_speaker, max_frames=WARMUP_FRAMES)
        stream = Stream(job, PlaybackClock(), lambda event: None, float("inf"))
        stream.decoders = pair
        while not stream.advance(self.model, None):
            pass
        stream.close()

    def _warm_batch(self) -> None:
        """A request through each group of the batch, its codec included: the groups' kernels, cuBLAS set-up, codec
        graphs; on the megakernel, first the prefill graphs of every slot for the usual prompt lengths (a whole
        prompt is prefilled into a slot, from row 0)."""
        for group in self._batch.groups:
            talker = group.talker
            if self.composition.talker == "megakernel":
                for rows in warm_prefill_lengths(WARM_SLOT_PREFILL_ROWS, talker.max_seq):
                    for slot in range(talker.batch):
                        talker.reset_slot(slot)
                        talker.prefill_slot(slot, embeds=torch.zeros(rows, talker.spec.input_dim, device=talker.device))
                for slot in range(talker.batch):
                    talker.reset_slot(slot)
            stream = Stream(SpeechJob(WARMUP_TEXT, self.info.default_speaker, max_frames=WARMUP_FRAMES),
                            PlaybackClock(), lambda event: None, float("inf"), self._lane)
            stream.slot = 0
            group.add(0, *stream.prepare(self.model, talker.max_seq), WARMUP_FRAMES)
            self._codecs.reset(0)
            while not stream.finished:  # the turns of _batched_turn
                self._codec_side([stream], group.step(), group, None, lambda stream, work: work())

    def _schedule(self) -> None:
        """Turn after turn: the streams that are cancelled or past their time leave, the arrivals join, then one
        stream advances a frame (the default policy), or every stream does (batched)."""
        while True:
            with self._wake:
                while not (self._stop or self._pending or self._active):
                    self._wake.wait()
                if self._stop:
                    return
                arrived, self._pending = self._pending, []
            now = time.perf_counter()
            for stream in list(self._active):  # first, so that their decoders or slots serve the arrivals
                if stream.cancelled:
                    self._finish(stream, "cancelled")
                elif now > stream.expires_at:
                    self._finish(stream, "timeout", RequestError(
                        504, f"request timed out after {self.config.request_timeout_s:g} s"))
            with self.metrics.busy("join"):
                for stream in arrived:
                    if stream.cancelled:
                        self.metrics.streams.labels("cancelled").inc()
                    elif not self._admit(stream):  # cannot happen while every slot holds at most one stream
                        with self._wake:
                            self._pending.insert(0, stream)
            if self._active and self._batch is None:
                self._turn()
            elif self._active:
                self._batched_turn()
            self.metrics.queue_length.set(sum(not s.started for s in self._active) + len(self._pending))

    def _admit(self, stream: Stream) -> bool:
        """Gives an arrival its decoder pair (the most recently used: warm caches) or, batched, a slot of the
        batch with its prompt prefilled there; false when none is free."""
        if self._batch is None:
            if not self._pool:
                return False
            stream.decoders = self._pool.pop()
            self._active.append(stream)
            return True
        held = {s.slot for s in self._active}  # an ended stream keeps its slot until its last chunk is posted
        free = [slot for slot in self._batch.free_slots() if slot not in held]
        if not free:
            return False
        stream.slot = free[0]
        self._active.append(stream)
        self._codecs.reset(stream.slot)
        self._guarded(stream, lambda: self._batch.add(stream.slot, *stream.prepare(self.model, self._batch.talker.max_seq),
                                                      stream.job.max_frames))
        return True

    def _guarded(self, stream: Stream, work) -> None:
        """Runs a stream's work; its failure ends that stream alone (one line for the client), and work that
        returns true completes it."""
        try:
            done = work()
        except RequestError as e:
            self._finish(stream, "error", e)
        except MkportError as e:
            self._finish(stream, "error", RequestError(400, str(e)))
        except Exception as e:  # noqa: BLE001 - one stream's failure must not stop the others
            log.exception("stream failed")
            self._finish(stream, "error", RequestError(500, f"internal error: {type(e).__name__}: {e}"))
        else:
            if done:
                self._finish(stream, "completed")

    def _turn(self) -> None:
        """The default policy: the stream whose listener runs dry first advances one frame."""
        self.metrics.queue_length.set(sum(not s.started for s in self._active) + len(self._pending))
        stream = next_stream(self._active)
        self._guarded(stream, lambda: stream.advance(self.model, self.metrics))

    def _batched_turn(self) -> None:
        """Batched: one frame of every stream at once, then its codec side (_codec_side)."""
        batch = self._batch
        try:
            with self.metrics.busy("frame"):
                frames = batch.step()
            with self.metrics.busy("codec"):
                self._codec_side(self._active, frames, batch, self.metrics, self._guarded)
        except Exception as e:  # noqa: BLE001 - a failed batch step or codec call fails its streams, not the server
            log.exception("batched turn failed")
            for stream in list(self._active):
                self._finish(stream, "error", RequestError(500, f"internal error: {type(e).__name__}: {e}"))

    def _codec_side(self, streams: list[Stream], frames: dict, batch, metrics: ServeMetrics | None, run) -> None:
        """A batched turn once its frame is made: the turn before's chunks leave as far as their codec work is done
        (a split: all of them, after waiting for it; serial: none is left), then the frame of every stream that made
        one is decoded, all in one call, and each stream takes its audio. `streams` is read again after the first
        pass (a stream that failed has left it); `run(stream, work)` runs one stream's work."""
        lane, rate = self._lane, self.model.codec.sample_rate
        lane.wait()
        for stream in list(streams):
            run(stream, lambda: stream.post_ready(rate, metrics))
        in_batch = batch.requests  # the slots whose request goes on after this frame (once: a dict is built)
        with lane.calls():
            made = [s.slot for s in streams if not s.flushed and frames.get(s.slot) is not None]
            audio = lane.to_host(self._codecs.decode(made, torch.stack([frames[slot] for slot in made]))) if made else []
            chunks = dict(zip(made, audio))
            for stream in list(streams):
                run(stream, lambda: stream.take_audio(chunks.get(stream.slot), stream.slot not in in_batch, rate,
                                                      metrics))

    def _finish(self, stream: Stream, outcome: str, error: RequestError | None = None) -> None:
        stream.close()
        self._active.remove(stream)
        if self._batch is not None:
            self._batch.remove(stream.slot)
        else:
            self._pool.append(stream.decoders)
        self.metrics.streams.labels(outcome).inc()
        if outcome == "completed":
            stats = stream.stats(self.model.codec.sample_rate)
            if stats["rtf"] is not None:
                self.metrics.real_time_factor.observe(stats["rtf"])
            stream.post(("done", stats))
        elif error is not None:
            stream.post(("error", error))

