"""What the app calls on an engine, and what the two schedulers share (Scheduler): one Qwen3-TTS model, the stream
slots, and the scheduler thread whose loop, turn after turn, lets the cancelled and timed-out streams leave, the
arrivals join, and the streams advance. How they advance is the scheduler's own: turns.py (the streams take turns, a
decoder pair each, earliest deadline first) or batched.py (--batched, the CLI's default on the megakernel: every
stream in one batch decoder pair, all advanced by each frame); engine.py picks one from the server's config.

All torch work runs on that one thread, so no two threads touch torch state; the event loop only moves bytes."""

from __future__ import annotations

import gc
import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import MkportError
from ..runtime.decoder_api import DEFAULT_MAX_SEQ
from ..tts.model import TtsModel
from ..tts.planner import Composition
from .config import ServeConfig
from .metrics import ServeMetrics
from .streams import SERIAL, CodecLane, PlaybackClock, RequestError, SpeechJob, Stream

log = logging.getLogger("mkport.serve")

WARMUP_TEXT = "Warm up."
WARMUP_FRAMES = 2
# prefill graphs captured at start-up for up to this many prompt rows after the prefix (more: on first use)
WARM_PREFILL_ROWS = 256


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    model_type: str
    model_size: str
    speakers: list[str]
    languages: list[str]
    default_speaker: str | None
    sample_rate: int


def warm_prefill_lengths(first: int, room: int, most: int = WARM_PREFILL_ROWS) -> list[int]:
    """The padded prompt lengths whose prefill graphs start-up captures: first, doubling, up to `most` and the cache
    rows left (`room`)."""
    lengths = []
    while first <= min(most, room):
        lengths.append(first)
        first *= 2
    return lengths


def request_error(e: Exception) -> RequestError:
    """What a client is told of its stream's failed work: the RequestError itself, a 400 for what mkport refused
    (MkportError), else a 500 naming the error."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, MkportError):
        return RequestError(400, str(e))
    return RequestError(500, f"internal error: {type(e).__name__}: {e}")


def runs_on_cuda(comp) -> bool:
    """Whether a composition's decoders run on a CUDA GPU: any backend but the reference's, where there is one."""
    return {comp.talker, comp.predictor} != {"reference"} and torch.cuda.is_available()


class Scheduler(ABC):
    """An engine, as the app and the CLI use it: start, then try_admit a stream slot, submit a job on it (its events
    come through `post`), cancel its stream, release the slot; ready, draining, error, info, model, config,
    composition, backend, batch_layout, load_s and warm_s answer /ready and /v1/models; metrics; drain, then
    shutdown. A subclass says how frames are made: the decoders it builds and warms at loading, how an arrival
    joins, what a turn runs, and how a stream's decoders are freed."""

    _lane: CodecLane = SERIAL  # where the codec runs and when its audio leaves (batched.py's split has its own)

    def __init__(self, config: ServeConfig, composition: Composition, metrics: ServeMetrics | None = None):
        self.config, self.composition = config, composition
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
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def backend(self) -> str:
        """What runs the talker and the code predictor: their backend, or both joined by '+'."""
        comp = self.composition
        return comp.talker if comp.talker == comp.predictor else f"{comp.talker}+{comp.predictor}"

    def batch_layout(self) -> list[int] | None:
        """[slots a batch, batches] of a batched scheduler once loaded; None by turns (decoder pairs)."""
        return None

    def frame_lanes(self) -> int:
        """How many batches' frames run at once, each on its share of the SMs (batched.FrameLane); 1 by turns."""
        return 1

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
            self._active, self._pending = [], []
            self._drop()
            self.model = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _load(self) -> None:
        cfg, comp = self.config, self.composition
        t0 = time.perf_counter()
        on_cuda = runs_on_cuda(comp)
        model = TtsModel.load(cfg.folder, device="cuda" if on_cuda else "cpu", compiled_codec=bool(cfg.compile_codec))
        if on_cuda:  # one copy on the GPU for every slot's or batch's decoders, before their memory is sized; the
            # text table there too, so no prompt gathers its rows on the host (TextProjector.table_on)
            model = model.weights_on("cuda", talker=comp.talker != "reference", predictor=comp.predictor != "reference",
                                     text=True)
        self._build(model, min(model.talker_spec.max_position, cfg.max_seq or DEFAULT_MAX_SEQ))
        cfg = self.config  # the batched scheduler's _build holds --max-streams to the GPU's memory
        self.model = model
        self.info = ModelInfo(cfg.model_id, model.config.model_type, model.config.model_size,
                              sorted(model.config.speakers), sorted(model.config.languages),
                              model.config.default_speaker, model.codec.sample_rate)
        self.load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if cfg.compile_codec:
            log.info("warm-up: torch.compile compiles each codec call shape, ~30 s each with an empty cache, seconds "
                     "once cached (--no-compile-codec: none)")
        self._warm_up()
        # what is loaded lives as long as the server: out of the collector's way, a full collection takes ~0.1 ms
        # instead of ~60 ms (the model's ~170,000 objects walked), a pause a request would otherwise meet at random
        gc.collect()
        gc.freeze()
        self.warm_s = time.perf_counter() - t0
        layout = self.batch_layout()
        log.info("ready: %s, %s (%s), %d streams%s%s; load %.1f s, warm-up %.1f s", cfg.model_id, comp.label,
                 f"the pick of {cfg.plan}" if cfg.plan else f"backend {cfg.backend}", cfg.max_streams,
                 f" in {layout[1]} batch(es) of {layout[0]}" if layout else "",
                 ", codec compiled" if cfg.compile_codec else "", self.load_s, self.warm_s)

    def _schedule(self) -> None:
        """Turn after turn: the streams that are cancelled or past their time leave, the arrivals join, then the
        scheduler's turn advances the streams."""
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
            waiting = []  # arrivals the scheduler did not take this turn (batched: the turn's joins took their time)
            with self.metrics.busy("join"):
                for stream in arrived:
                    if stream.cancelled:
                        self.metrics.streams.labels("cancelled").inc()
                    elif waiting:  # in order of arrival
                        waiting.append(stream)
                    else:
                        stream.admitted_at = time.perf_counter()
                        if self._admit(stream):
                            stream.joined_at = time.perf_counter()
                        else:
                            waiting.append(stream)
                self._joined()
            if waiting:
                with self._wake:
                    self._pending[:0] = waiting
            if self._active:
                self._turn()
            self.metrics.queue_length.set(sum(not s.started for s in self._active) + len(self._pending))

    def _guarded(self, stream: Stream, work) -> None:
        """Runs a stream's work; its failure ends that stream alone (one line for the client), and work that
        returns true completes it."""
        try:
            done = work()
        except Exception as e:  # noqa: BLE001 - one stream's failure must not stop the others
            if not isinstance(e, (RequestError, MkportError)):
                log.exception("stream failed")
            self._finish(stream, "error", request_error(e))
        else:
            if done:
                self._finish(stream, "completed")

    def _finish(self, stream: Stream, outcome: str, error: RequestError | None = None) -> None:
        stream.close()
        self._active.remove(stream)
        self._free(stream)
        self.metrics.streams.labels(outcome).inc()
        if log.isEnabledFor(logging.DEBUG):  # the timeline's formatting only where it is logged
            log.debug("stream %s (%d active): %s", outcome, len(self._active), stream.timeline())
        if outcome == "completed":
            stats = stream.stats(self.model.codec.sample_rate)
            if stats["rtf"] is not None:
                self.metrics.real_time_factor.observe(stats["rtf"])
            stream.post(("done", stats))
        elif error is not None:
            stream.post(("error", error))

    # -- what each scheduler does its own way ---------------------------------------------------------
    @abstractmethod
    def _build(self, model: TtsModel, max_seq: int) -> None:
        """Loading: the decoders of every stream slot, with talker KV caches of max_seq."""

    @abstractmethod
    def _warm_up(self) -> None:
        """Runs what requests will run (kernels, graphs, the codec), so that the first request does not pay for it."""

    @abstractmethod
    def _admit(self, stream: Stream) -> bool:
        """Gives an arrival its decoders (and adds it to self._active); false when it waits for a later turn (none
        are free, or the batched scheduler's joins of this turn took their time): it stays first in line."""

    def _joined(self) -> None:
        """After a turn's admissions: work they left for the turn's joins together (the batched scheduler's prompts
        prefilled together); none by default."""

    @abstractmethod
    def _turn(self) -> None:
        """Advances the active streams (at least one)."""

    @abstractmethod
    def _free(self, stream: Stream) -> None:
        """A stream has left: its decoders serve the next arrival."""

    @abstractmethod
    def _drop(self) -> None:
        """The scheduler has stopped: lets go of every decoder."""
