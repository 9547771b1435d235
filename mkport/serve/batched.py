"""The batched scheduler (`--batched`, BatchedScheduler): the streams share batch decoder pairs (mkport.tts.batch.FrameBatch),
a stream a slot, the lowest free. Where the megakernel cannot hold --max-streams sequences of the model, or they are
more than 32, batches of the largest size it holds take turns (FrameGroups). Every turn, the arrivals join (their
prompts prefilled into their slots; a burst's spread over turns so that no playing stream runs dry behind them), then
the batch holding the most urgent stream makes --frames-per-turn (N, default 1) frames of all its streams: a frame of
B streams reads each weight once, so it costs far less than B frames, and it runs the smallest size that holds the
batch's live slots (unless --fixed-batch; with --batch-invariant every size's megakernel sums a row as the largest
does, launch_plan's invariant plans, and a lone stream runs as batch 2). Each stream keeps its own slot state (KV
cache, position, repetition history, seeds) and its own codec state. The codec decodes the batch's chunks in calls of
the batch's shape (CodecStreams: its state kept per slot, no frame decoded twice, the same arithmetic for a stream
whoever shares the call): a newcomer's first frame right after the turn's first, every other chunk after its last, a
stream's chunks 1, N - 1, N, ... frames of its own count (so a codec call per N frames, and the same calls alone and
under load).
docs/serving.md says what this promises about a stream's samples alone and under load.

A plan's split (Composition.codec_sms > 0, batched only): the batch decoders are megakernels on all SMs but the
codec's (their grid), every frame on a high-priority CUDA stream, and the codec calls on a second stream, where
they run beside the next frame (SplitCodecLane). A chunk is posted once the event recorded after its codec call has
completed: the turn after it was decoded, when that turn's frame has been made; the host waits for a turn's codec
work before it queues the next turn's, so the codec is at most a frame behind (as mkport.tts.compose runs it). The
codec calls are the same as serial ones, so the samples are too; only when they leave moves.

Frame lanes (--frame-lanes L, FrameLane; two by default where they run, engine.frame_lanes_asked): batch g is in
lane g % L; each lane's megakernels have 1/L of the SMs (their grid) and two high-priority CUDA streams of its own,
one for its frames and prefills, one for its codec calls. A turn queues, on every lane with nothing in flight, the
frame of its most urgent batch, and finishes the lane whose frame was queued first (its codes read, its codec calls
queued on the lane's codec stream); so while the host reads one lane's codes the other lanes' frames run, and a
lane's next frame runs beside its last frame's codec call. A join's prefill runs on its lane's stream too, between
the lane's frames (a frame in flight on the lane finished first). A lane alone on the GPU runs its frames on every
SM (FrameBatch's wide decoders), the other lanes waiting. A batch's frame at batch 16 is bound by its layers' fixed
costs, not by its SMs (the 1.7B on an H100: 7.6 ms on 132 SMs, 9.0 on 66), so two lanes make more frames a second
than one (docs/serving.md). The calls and a stream's arithmetic are the serial server's on a grid of 1/L of the SMs
(or all of them, alone)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import Counter, deque

import torch

from ..errors import MkportError
from ..tts.batch import FrameBatch, FrameGroups
from ..runtime.backends import first_sequences, invariance, make_decoder
from ..runtime.decoder import Decoder
from ..tts.pipeline import make_decoders
from ..runtime.graphs import pad_rows
from ..runtime.torch_model import PREFILL_MIN_BUCKET
from ..runtime.kv_cache import KvLayout
from ..tts.codec import CodecStreams, turn_chunk, turn_chunk_lengths
from ..tts.codec_decoder import StreamState
from ..tts.compose import device_identity
from ..tts.model import TtsModel
from ..tts.planner import Composition
from .config import MAX_BATCHED_STREAMS, ServeConfig
from .metrics import ServeMetrics
from .scheduler import WARMUP_FRAMES, WARMUP_TEXT, Scheduler, request_error, runs_on_cuda, warm_prefill_lengths
from .streams import CodecLane, PlaybackClock, RequestError, SpeechJob, Stream

log = logging.getLogger("mkport.serve")

TRACE_EVENTS = 1024  # the scheduler's last events kept for the debug log's account of an underrun (~2 s at load)
LANE_POLL_S = 2e-4  # while a lane's frame runs, how often the host looks for chunks whose codec work is done
WARM_SLOT_PREFILL_ROWS = 64  # the shortest padded prompt a batch slot's graphs are captured for at start-up
# a turn's joins prefilled together (joins_together): at most this many prompts and rows a prefill; the padded row
# counts (16, 32, ... up to the rows) have their graphs captured at start-up, a lane each
JOINS_TOGETHER = 32
TOGETHER_ROWS = 1024


class SplitCodecLane(CodecLane):
    """A split of the SMs: the frames on a high-priority CUDA stream, so the megakernels go first; the codec calls on
    a second stream, beside the next frame; a chunk waits for the event recorded after its call."""

    def __init__(self):
        self.producer = torch.cuda.Stream(priority=-1)
        self.side = torch.cuda.Stream()
        self.capture_stream = self.side  # beside a plan's graphs-backend frames, whose matmuls have torch's workspace
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


class OverlappedCodecLane(SplitCodecLane):
    """A serial composition on a CUDA GPU (ServeConfig.codec_overlap): the codec calls on the frames' own CUDA
    stream, after the frame, as serial; but a turn's audio is copied to the host without waiting, and its chunks
    leave at the next turn once its codec work has completed, while that turn's frame runs (the host posts them
    instead of waiting for the device with nothing queued). The same calls, so the same samples."""

    def __init__(self):
        self.last: torch.cuda.Event | None = None

    def producing(self):
        return contextlib.nullcontext()

    def calls(self):
        return contextlib.nullcontext()

    def mark(self) -> torch.cuda.Event:
        self.last = torch.cuda.Event()
        self.last.record()
        return self.last


def codec_lane(comp: Composition, config: ServeConfig | None = None) -> CodecLane:
    """The lane of a batched engine running `comp`: a split's own; a serial one on a CUDA GPU overlapped
    (OverlappedCodecLane) unless config.codec_overlap is off; else serial (CodecLane: each chunk leaves when decoded)."""
    if comp.codec_sms:
        return SplitCodecLane()
    overlap = config is None or config.codec_overlap
    return OverlappedCodecLane() if overlap and runs_on_cuda(comp) else CodecLane()


class FrameLane:
    """A lane of --frame-lanes: its CUDA stream for its frames and prefills, a second one for its codec calls (on
    the CPU none: work is done when queued), the codec graphs' memory pool of its batches (their calls run beside
    other lanes'), and the frame it has in flight: (batch, FrameBatch.queue_frame's result, the frame's start and
    end marks), with the order it was queued and whether it runs on every SM (`wide`). The codec calls have a stream
    of their own so that the lane's next frame or a newcomer's prefill does not wait behind the last frame's codec
    call: it runs beside them; but after a wide frame, which holds every SM until it ends, they go on the frames'
    stream, before the next frame, as the serial server runs them (decoding)."""

    def __init__(self, index: int, cuda: bool):
        self.index = index
        self.stream = torch.cuda.Stream(priority=-1) if cuda else None
        # also where the lane's codec graphs are captured: their cuBLAS workspace the lane's own (graphs.capture)
        self.codec_stream = torch.cuda.Stream(priority=-1) if cuda else None
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        self.codec_on = self.codec_stream  # the stream of the lane's last codec work
        self.in_flight: tuple | None = None
        self.queued = 0
        self.wide = False

    def running(self):
        """The context of the lane's frames and prefills: its stream."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def decoding(self, after_wide: bool | None = None):
        """The context of the lane's codec calls and codec resets: its codec stream, or after a wide frame
        (`after_wide`) its frames' stream; None: where its last codec work went. Its codec work stays in order
        across the two (the graphs of its pool run one at a time): a change of stream waits for the other's."""
        if self.stream is None:
            return contextlib.nullcontext()
        on = self.codec_on if after_wide is None else self.stream if after_wide else self.codec_stream
        if on is not self.codec_on:
            on.wait_stream(self.codec_on)
            self.codec_on = on
        return torch.cuda.stream(on)

    @staticmethod
    def frame_done(mark) -> bool:
        """Whether the work before a WorkTimer mark on the lane has run (on the CPU it has)."""
        return not isinstance(mark, torch.cuda.Event) or mark.query()

    def after_scheduler(self) -> None:
        """The lane's next work waits for what the scheduler's stream has queued (the warm-up's)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            self.codec_stream.wait_stream(torch.cuda.current_stream())

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
            self.codec_stream.synchronize()


class WorkTimer:
    """How long work queued on the device took, not how long the host took to queue it: spans between two marks,
    read once they have completed (CUDA events; on the CPU the work is done when the host returns)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float | None:
        """The span's seconds, or None while its work is still running."""
        if not self.cuda:
            return end - start
        return start.elapsed_time(end) / 1e3 if end.query() else None


# of the GPU's free memory after the weights load, what fit_streams keeps back for what a stream's slot does not
# hold: the batches' predictors and buffers, the prefill and codec CUDA graphs, cuBLAS, the allocator's fragments
MEMORY_HEADROOM = 0.1


def stream_bytes(model: TtsModel, max_seq: int) -> int:
    """What one stream's slot holds on a CUDA GPU: its talker KV cache (K and V of every layer in bf16, as a batch
    decoder lays it out: kv_cache.KvLayout, a spare row a sequence, a sliding layer's ring) and its row of the codec
    state (StreamState). The rest of a batch is shared by its slots (MEMORY_HEADROOM)."""
    kv_cache = KvLayout.of(model.talker_spec, max_seq, batch=2).sequence_bytes()
    return kv_cache + StreamState.row_bytes(model.codec.module)


def fit_streams(config: ServeConfig, per_stream: int, batch: int = 1) -> ServeConfig:
    """--max-streams held to the GPU's free memory, read once the weights are loaded (MEMORY_HEADROOM of it kept back)
    and divided by `per_stream` bytes (stream_bytes), at most MAX_BATCHED_STREAMS, with the slots of a batch of `batch`
    coming together (N streams hold ceil(N / batch) batches): the default (config.streams_by_memory) becomes what it
    holds in whole batches; a value given whose batches it cannot hold is a one-line error now rather than an
    out-of-memory error while the batches are built."""
    torch.cuda.empty_cache()  # what the allocator keeps from the loading is free for the slots
    free = torch.cuda.mem_get_info()[0]
    room = int(free * (1 - MEMORY_HEADROOM)) // per_stream
    capped = min(room, MAX_BATCHED_STREAMS)
    # whole batches (ceil(N / batch) of them hold N streams), unless not even one fits: then what the memory holds
    fit = min(room // batch * batch, capped) or capped
    how = (f"{per_stream / 1e9:.2f} GB a stream, {free / 1e9:.1f} GB free after the weights, "
           f"{MEMORY_HEADROOM:.0%} kept back: room for {room}" + (f", at most {capped}" if room > capped else "")
           + (f", {fit} in whole batches of {batch}" if fit < capped else ""))
    if config.streams_by_memory:
        if fit < 1:
            raise MkportError(f"not one stream fits in the GPU's memory ({how})")
        log.info("max streams %d: %s", fit, how)
        return dataclasses.replace(config, max_streams=fit)
    if config.max_streams > fit:
        raise MkportError(f"--max-streams {config.max_streams}: the GPU's memory holds {fit} streams ({how})")
    return config


def batch_size(config: ServeConfig) -> int:
    """The largest batch decoders' size for --max-streams: the megakernel's next batch size (launch_plan.BATCHES) up to
    its largest, also with a plan (its picks may run the megakernel, which has only those), or --batch-size where it
    is less (any of launch_plan.BATCH_SIZES: 24 only when asked); past it, batches of it take turns (batch_groups)."""
    from ..kernel.launch_plan import BATCH_SIZES, BATCHES

    if not 1 <= config.max_streams <= MAX_BATCHED_STREAMS:
        raise MkportError(f"--max-streams {config.max_streams} with --batched: 1 to {MAX_BATCHED_STREAMS}")
    if config.batch_size is not None and config.batch_size not in BATCH_SIZES:
        raise MkportError(f"--batch-size {config.batch_size}: one of {', '.join(map(str, BATCH_SIZES))}")
    if config.backend != "megakernel" and config.plan is None:
        size = config.max_streams
    else:
        size = next((b for b in BATCHES if b >= config.max_streams), BATCHES[-1])
    return min(size, config.batch_size or size)


def batch_groups(config: ServeConfig, comp: Composition, model: TtsModel) -> tuple[int, int]:
    """(size, count) of the batches that hold --max-streams streams: batches of batch_size(config), or, where the
    megakernel cannot hold that many sequences of this model (shared memory: the 1.7B holds 16, or 24 when asked), of
    the largest size it holds, taking turns (FrameGroups)."""
    size = batch_size(config)
    if "megakernel" in (comp.talker, comp.predictor):
        from ..runtime.decoder import current_device_target
        from ..kernel.launch_plan import BATCH_SIZES, BATCHES, largest_batch

        target = current_device_target()
        sizes = tuple(b for b in (BATCH_SIZES if config.batch_size else BATCHES) if b <= size)
        # at least 1: where not even one sequence fits, building the decoder says so
        size = max(1, min(largest_batch(model.talker_spec, target, sizes),
                          largest_batch(model.predictor_spec, target, sizes)))
    return size, -(-config.max_streams // size)


def smaller_sizes(config: ServeConfig, comp: Composition, size: int) -> list[int]:
    """The batch sizes below `size` a batch also steps (FrameBatch's rungs): the megakernel's (BATCHES), unless
    --fixed-batch, or the talker runs on graphs (its decoder steps every sequence it holds). With --batch-invariant
    and a megakernel part, from 2: batch 1's kernel sums a row otherwise than a batch's (launch_plan), so a lone stream
    runs as batch 2, its second row idle."""
    from ..kernel.launch_plan import BATCHES

    if not config.sized_batches or comp.talker not in ("megakernel", "reference"):
        return []
    least = 2 if invariant_to(config, comp, size) else 1
    return [b for b in BATCHES if least <= b < size]


def invariant_to(config: ServeConfig, comp: Composition, size: int) -> int:
    """The batch whose sums every size of a batch of `size` follows (launch_plan's invariant plans): `size` with
    --batch-invariant where a part runs on the megakernel and the batch holds more than one stream; else 0 (plain
    plans: one stream has nothing to be invariant to, and the batch-1 kernel keeps its CUDA-core matvecs; the reference
    backend's rows never depend on the batch)."""
    megakernel = "megakernel" in (comp.talker, comp.predictor)
    return size if config.batch_invariant and config.sized_batches and megakernel and size > 1 else 0


def sized_codec(config: ServeConfig, comp: Composition) -> bool:
    """Whether a batch's codec calls carry only the rows their streams need (CodecStreams' sized calls) instead of
    all its slots: where the megakernel's frames are sized to the live streams (the default), a stream's samples
    follow the load already (its frames round as their batch size does), and a call of one stream costs about half a
    call of 16 rows. Not with --fixed-batch or --batch-invariant, whose promise is a stream's samples the same alone
    and under load, nor on the other backends, which keep that promise."""
    return config.sized_batches and not config.batch_invariant and comp.talker == "megakernel"


def prebuild(model: TtsModel, comp: Composition, sizes: list[int], grids: list[int | None], invariant: int = 0) -> None:
    """Compiles the megakernels of every batch size the server steps on each of `grids` (SMs; None: all), nvcc runs
    side by side (the decoders then load them from the cache): ten of the 1.7B a grid, ~30 s each one after another.
    `invariant`: their plans' invariant_to."""
    import dataclasses
    import os

    from ..kernel.build import build_libraries
    from ..kernel.cache import BUILDS, cache_root
    from ..kernel.launch_plan import plan_launch
    from ..kernel.render import render
    from ..runtime.decoder import current_device_target

    specs = [spec for spec, backend in ((model.talker_spec, comp.talker), (model.predictor_spec, comp.predictor))
             if backend == "megakernel"]
    if not specs:
        return
    device = current_device_target()
    targets = [dataclasses.replace(device, sm_count=sms) if sms else device for sms in grids]
    sources = [render(spec, plan_launch(spec, target, batch=b, invariant_to=invariant)).write(cache_root() / BUILDS)
               for target in targets for b in sizes for spec in specs]
    build_libraries([(src, "fast") for src in sources], device.arch, os.cpu_count() or 4)


def frame_batch(model: TtsModel, comp: Composition, config: ServeConfig, size: int, max_seq: int,
                sms: int | None, wide: bool = False) -> FrameBatch:
    """A batch of `size` slots with its smaller sizes (smaller_sizes): their talkers step its first slots
    (first_sequences), their predictors are their own (reset every frame, they keep no stream's state). With
    --batch-invariant every megakernel of them sums a row as the batch of `size` does (invariant_to). `wide`: the
    same sizes on every SM as well (FrameBatch's wide decoders; the talkers share the batch's sequences)."""
    inv = invariant_to(config, comp, size)
    talker, predictor = make_decoders(model, comp.talker, max_seq, size, predictor_backend=comp.predictor, sms=sms,
                                      invariant_to=inv)
    mk = invariance(inv) if comp.predictor == "megakernel" else {}
    predictor_of = lambda b, grid: make_decoder(  # noqa: E731
        model.predictor_spec, model.predictor_weights, comp.predictor, predictor.max_seq, batch=b, sms=grid,
        prefill_graphs=model.graphs, **mk)
    sizes = smaller_sizes(config, comp, size)
    smaller = [(first_sequences(talker, b, inv), predictor_of(b, sms)) for b in sizes]
    wide_pairs = [(first_sequences(talker, b, inv, every_sm=True), predictor_of(b, None))
                  for b in [*sizes, size]] if wide else ()
    return FrameBatch(model, talker, predictor, smaller, invariant=config.batch_invariant, wide=wide_pairs)


def wide_lanes(config: ServeConfig, comp: Composition) -> bool:
    """Whether frame lanes also have every size on every SM, for a lane alone on the GPU: on the megakernel, unless
    a stream's samples are promised the same alone and under load (--fixed-batch, --batch-invariant), which
    another grid (another split of each sum) would break."""
    return comp.talker == "megakernel" and config.sized_batches and not config.batch_invariant


def joins_together(config: ServeConfig, talkers: list) -> bool:
    """Whether a turn's joins prefill their prompts together (--joins-together, the default where it runs), one
    prefill a lane reading the talker's weights once for them all (Decoder.prefill_prompts), not one each: on the
    megakernel's batch decoders, where a stream's samples follow the load already (frames sized to the streams, not
    --batch-invariant): a prompt's rows beside others' may round otherwise than alone (another row count, another
    tiling of the matmuls). --joins-alone: a prefill each."""
    return (config.joins_together is not False and config.sized_batches and not config.batch_invariant
            and Decoder.prompts_together(talkers))


def prefill_counts(sizes: list[int]) -> list[int]:
    """How many of a lane's joins (prompts of `sizes` rows, in order of arrival) each prefill takes together: up to
    JOINS_TOGETHER prompts and TOGETHER_ROWS rows (the graphs captured at start-up), a longer prompt alone."""
    counts, count, rows = [], 0, 0
    for size in sizes:
        if count and (count == JOINS_TOGETHER or rows + size > TOGETHER_ROWS):
            counts.append(count)
            count, rows = 0, 0
        count, rows = count + 1, rows + size
    return counts + [count] if count else counts


class BatchedScheduler(Scheduler):
    """Every stream a slot of a batch decoder pair (or of batches taking turns); a turn is one batch's N frames
    (config.frames_per_turn), each sized to its live slots, and that batch's codec calls."""

    def __init__(self, config: ServeConfig, composition: Composition, metrics: ServeMetrics | None = None):
        super().__init__(config, composition, metrics)
        self._batch: FrameGroups | None = None  # every stream's slot, in one or more batches
        self._lane = codec_lane(composition, config)  # where the codec runs, when its audio leaves
        self._codecs: list[CodecStreams] = []  # each batch's codec state, a row a slot, decoded together
        # device time, not the host's: a prefill is queued in far less time than it runs
        self._timer = WorkTimer(runs_on_cuda(composition))
        self._spans: list[tuple[str, object, object]] = []  # ("join" or "turn", start, end) not yet read
        self._join_s = 0.0  # a join's time (prefill), a running mean: what _admit budgets
        self._turn_s = 0.0  # a turn's time (a batch's frame and codec), a running mean
        self._joins = 0  # arrivals joined since the last turn
        self._frame_lanes: list[FrameLane] = []  # --frame-lanes: batch g in lane g % len; none: one frame at a time
        self._queued = 0  # frames queued on the lanes so far (their order)
        self._together = False  # joins_together
        self._joining: list[tuple[int, int, Stream, torch.Tensor]] = []  # this turn's joins: (batch, slot, stream, rows)
        # at --log-level debug, the scheduler's last events (host time, what), so that an underrun is logged with what
        # ran between the stream's last chunk and the late one (_underrun); set when it loads, once logging is set up
        self._trace: deque | None = None

    def _note(self, *what) -> None:
        """An event for the debug log's account of an underrun (only at --log-level debug)."""
        if self._trace is not None:
            self._trace.append((time.perf_counter(), what))

    def _underrun(self, stream: Stream, dry_s: float) -> None:
        """Logs a late chunk with the scheduler's events since the stream's chunk before it (Stream.on_underrun)."""
        since = stream.last_audio_at or stream.arrival
        events = "; ".join(f"+{(t - since) * 1e3:.1f} " + " ".join(map(str, what))
                           for t, what in self._trace if t >= since)
        log.debug("underrun: slot %d (batch %d) after %.2f s of audio, dry %.1f ms, its last chunk %.1f ms before; "
                  "since: %s", stream.slot, self._group_of(stream), stream.samples / self.model.codec.sample_rate,
                  dry_s * 1e3, (time.perf_counter() - since) * 1e3, events or "nothing")

    def batch_layout(self) -> list[int] | None:
        return None if self._batch is None else [self._batch.size, len(self._batch.groups)]

    def frame_lanes(self) -> int:
        return max(1, len(self._frame_lanes))

    def _build(self, model: TtsModel, max_seq: int) -> None:
        comp = self.composition
        self._trace = deque(maxlen=TRACE_EVENTS) if log.isEnabledFor(logging.DEBUG) else None
        if runs_on_cuda(comp):  # the slots come a batch at a time: the size before the memory's count
            self.config = fit_streams(self.config, stream_bytes(model, max_seq), batch_groups(self.config, comp, model)[0])
            self.metrics.max_streams.set(self.config.max_streams)
        sms = comp.producer_sms(device_identity()[1]) if comp.codec_sms else None  # a split: the codec's SMs left
        size, count = batch_groups(self.config, comp, model)
        asked = self.config.frame_lanes or 1  # None (a config not resolved by engine.Engine): one lane
        lanes = min(asked, count)  # a lane holds one batch at least
        wide = lanes > 1 and wide_lanes(self.config, comp)
        if lanes > 1:
            cuda = runs_on_cuda(comp)
            sms = device_identity()[1] // lanes if cuda else None
            self._frame_lanes = [FrameLane(i, cuda) for i in range(lanes)]
            log.info("frame lanes: %d%s%s", lanes, f", each batch's megakernels on {sms} SMs" if sms else "",
                     ", and on every SM for a lane alone on the GPU" if wide else "")
        elif asked > 1:
            log.info("frame lanes: one batch of %d slots, so one lane on every SM", size)
        sizes, inv = [*smaller_sizes(self.config, comp, size), size], invariant_to(self.config, comp, size)
        if self.config.batch_invariant:
            log.info("batch-invariant: %s", f"frames of {', '.join(map(str, sizes))}, each summing a row as batch {inv}"
                     if inv else "one stream a batch, or no megakernel: nothing to be invariant to, the plain kernels")
        prebuild(model, comp, sizes, [sms, None] if wide else [sms], inv)
        self._batch = FrameGroups([frame_batch(model, comp, self.config, size, max_seq, sms, wide)
                                   for _ in range(count)])
        self._together = joins_together(self.config, [group.talker for group in self._batch.groups])
        if self._together:
            log.info("a turn's joins prefill their prompts together, up to %d a prefill", JOINS_TOGETHER)
        elif self.config.joins_together:  # given, where the talker cannot (engine.Engine refuses the rest)
            log.info("--joins-together: the talker is not the megakernel's batch decoder, so a prefill each")

    def _warm_up(self) -> None:
        """Requests through each batch at each of its sizes (a request in slot s - 1 runs size s), codec included: the
        kernels, cuBLAS set-up, codec graphs; on the megakernel, first the prefill graphs of every slot for the usual
        prompt lengths (a whole prompt is prefilled into a slot, from row 0)."""
        size, per_turn = self._batch.size, self.config.frames_per_turn
        # with turns of N frames a request of N + 1: each chunk length runs (1, N - 1, the last padded to N)
        frames = WARMUP_FRAMES if per_turn == 1 else per_turn + 1
        sized = sized_codec(self.config, self.composition)
        # with frame lanes, each lane's codec graphs in a pool of their own, captured on its codec stream
        lanes = [self._lane_of(g) if self._frame_lanes else None for g in range(len(self._batch.groups))]
        self._codecs = [CodecStreams(self.model.codec, size, sized, lane.pool, lane.codec_stream) if lane else
                        CodecStreams(self.model.codec, size, sized, capture_stream=self._lane.capture_stream)
                        for lane in lanes]
        for group, lane in zip(self._batch.groups, lanes):  # and its prefills' graphs on its frames' stream
            if lane is not None and lane.stream is not None:
                group.talker.capture_stream = lane.stream
        for g, group in enumerate(self._batch.groups):
            self._codecs[g].prepare(turn_chunk_lengths(per_turn))
            talker = group.talker
            if self._together:
                if g < self.frame_lanes():  # the lane's first batch's talker holds the lane's graphs (_joined)
                    self._warm_together(talker, lanes[g])
            elif self.composition.talker == "megakernel":
                for rows in warm_prefill_lengths(WARM_SLOT_PREFILL_ROWS, talker.max_seq):
                    for slot in range(talker.batch):
                        talker.reset_slot(slot)
                        talker.prefill_slot(slot, embeds=torch.zeros(rows, talker.spec.input_dim, device=talker.device))
                for slot in range(talker.batch):
                    talker.reset_slot(slot)
            for rung in group.sizes:
                stream = Stream(SpeechJob(WARMUP_TEXT, self.info.default_speaker, max_frames=frames),
                                PlaybackClock(), lambda event: None, float("inf"), self._lane)
                stream.slot = g * size + rung - 1
                start = self._timer.mark()
                group.add(rung - 1, *stream.prepare(self.model, talker.max_seq), frames)
                self._spans.append(("join", start, self._timer.mark()))
                self._codecs[g].reset(rung - 1)
                self._active.append(stream)
                run = lambda stream, work: work()  # noqa: E731
                while not stream.finished:  # the turns of _turn
                    self._batch_turn(g, [stream], None, run)
                self._active.remove(stream)
                self._lane.wait()
                self._join_s = 0.0  # set by this (warm) join
                self._read_spans()

    @staticmethod
    def _warm_together(talker, lane: FrameLane | None) -> None:
        """The graphs of prompts prefilled together (Decoder.prefill_prompts) for every padded row count up to
        TOGETHER_ROWS, by a prompt into the talker's slot 0 (captured on the lane's stream: _warm_up)."""
        with lane.running() if lane is not None else contextlib.nullcontext():
            for rows in warm_prefill_lengths(PREFILL_MIN_BUCKET, talker.max_seq, TOGETHER_ROWS):
                talker.reset_slot(0)
                talker.prefill_prompts([(talker, 0, torch.zeros(rows, talker.spec.input_dim, device=talker.device))])
            talker.reset_slot(0)
        if lane is not None:
            lane.synchronize()

    def _group_of(self, stream: Stream) -> int:
        return stream.slot // self._batch.size

    def _lane_of(self, g: int) -> FrameLane:
        return self._frame_lanes[g % len(self._frame_lanes)]

    def _admit(self, stream: Stream) -> bool:
        """Gives an arrival the lowest free slot (so batches stay small), its prompt prefilled there; false (it waits
        for the next turn) when the slots are full, or when this turn's joins already took what the streams playing
        can wait (_join_room; the first arrival of a turn always joins): a burst's prefills are spread over turns,
        so no stream runs dry behind them."""
        held = {s.slot for s in self._active}  # an ended stream keeps its slot until its last chunk is posted
        free = [slot for slot in self._batch.free_slots() if slot not in held]
        now = time.perf_counter()
        if not free or (self._joins and self._joins_cost(self._joins + 1) > self._join_room(now)):
            self._note("join waits", "(no slot)" if not free else f"(after {self._joins})")
            return False
        self._joins += 1
        stream.slot = free[0]
        if self._trace is not None:
            stream.on_underrun = self._underrun
        self._note("admit slot", stream.slot)
        g, local = self._group_of(stream), stream.slot % self._batch.size
        lane = self._lane_of(g) if self._frame_lanes else None
        if lane is not None:
            lane.after_scheduler()
            # a frame in flight of its batch moves every slot's next input, so it goes first; one of another batch of
            # the lane too: the prompt's copies to the device wait for the lane's stream, and would hold the host;
            # and a frame on every SM, which leaves none to this lane's work (before the stream is active: that
            # frame's codec side would take it for one that ended)
            for other in self._frame_lanes:
                if other.in_flight is not None and (other is lane or other.wide):
                    self._finish_lane(other)
        with lane.decoding() if lane is not None else contextlib.nullcontext():
            self._codecs[g].reset(local)
        self._active.append(stream)
        group, max_seq = self._batch.groups[g], self._batch.talker.max_seq
        # with frame lanes the prefill runs on its lane's stream, between its frames, beside its codec calls
        with lane.running() if lane is not None else contextlib.nullcontext():
            if self._together:  # the slot taken; its prompt prefilled with the turn's other joins' (_joined)
                def take() -> None:
                    rows = group.take(local, *stream.prepare(self.model, max_seq), stream.job.max_frames)
                    self._joining.append((g, local, stream, rows))

                self._guarded(stream, take)
                return True
            start = self._timer.mark()
            self._guarded(stream, lambda: group.add(local, *stream.prepare(self.model, max_seq), stream.job.max_frames))
            self._spans.append(("join", start, self._timer.mark()))  # read once it has run (_read_spans)
        self._note("prefill queued, slot", stream.slot)
        return True

    def _joins_cost(self, joins: int) -> float:
        """The device time a turn's `joins` take: a prefill each, or prefilled together one for up to JOINS_TOGETHER
        (the running mean _join_s is of whichever the server runs)."""
        prefills = -(-joins // JOINS_TOGETHER) if self._together else joins
        return prefills * self._join_s

    def _joined(self) -> None:
        """The turn's joins' prompts prefilled together (joins_together): each lane's in prefills of up to
        JOINS_TOGETHER prompts and TOGETHER_ROWS rows, on the lane's stream, by the graphs of its first batch's talker
        (_warm_together); a prefill that fails ends its streams with an error, not the server."""
        joining, self._joining = self._joining, []
        by_lane: dict[int, list] = {}
        for g, local, stream, rows in joining:
            if stream in self._active:  # not failed since it took its slot
                by_lane.setdefault(g % self.frame_lanes(), []).append((g, local, stream, rows))
        for index, joins in by_lane.items():
            lane = self._frame_lanes[index] if self._frame_lanes else None
            for count in prefill_counts([len(rows) for _, _, _, rows in joins]):
                self._prefill_together(lane, self._batch.groups[index].talker, joins[:count])
                joins = joins[count:]

    def _prefill_together(self, lane: FrameLane | None, talker, joins: list) -> None:
        """One prefill of joins' prompts, by `talker`'s graphs, on the lane's stream; timed as a join."""
        with lane.running() if lane is not None else contextlib.nullcontext():
            if lane is not None:
                lane.after_scheduler()
            start = self._timer.mark()
            try:
                talker.prefill_prompts([(self._batch.groups[g].talker, local, rows) for g, local, _, rows in joins])
            except Exception as e:  # noqa: BLE001 - the prefill's streams fail, not the server
                log.exception("prompts prefilled together failed")
                for _, _, stream, _ in joins:
                    self._finish(stream, "error", request_error(e))
                return
            self._spans.append(("join", start, self._timer.mark()))
        self._note("prefill together queued:", len(joins), "prompts,", sum(len(rows) for *_, rows in joins), "rows")
        now = time.perf_counter()
        for _, _, stream, _ in joins:
            stream.joined_at = now

    def _read_spans(self) -> None:
        """Folds the joins' and turns' spans whose work has completed into their running means (the first of
        each kind sets it)."""
        left = []
        for kind, start, end in self._spans:
            seconds = self._timer.seconds(start, end)
            if seconds is None:
                left.append((kind, start, end))
            elif kind == "join":
                self._join_s = seconds if not self._join_s else self._join_s + 0.2 * (seconds - self._join_s)
            else:
                self._turn_s = seconds if not self._turn_s else self._turn_s + 0.2 * (seconds - self._turn_s)
        self._spans = left

    def _join_room(self, now: float) -> float:
        """Seconds the joins of a turn may take: the least audio a playing stream has in hand, less a turn of every
        batch that holds streams (at worst, what it waits for before its next chunk, which comes at the end of its
        batch's turn: _turn_s is measured over whole turns, N frames each)."""
        ends = [s.clock.ends_at for s in self._active if s.first_audio_at is not None]
        if not ends:
            return float("inf")
        # the batches holding streams take turns; with frame lanes, those of one lane (the lanes run side by side)
        lanes = max(1, len(self._frame_lanes))
        busy = Counter(g % lanes for g, group in enumerate(self._batch.groups) if group.requests)
        return min(ends) - now - max(busy.values(), default=0) * self._turn_s

    def _next_group(self, lane: FrameLane | None = None) -> int | None:
        """Earliest deadline first, by batch, a newcomer (a stream with no audio made yet: Stream.deadline) due at its
        arrival, so a batch with a newcomer goes first (once its first frame is decoded it is due as a playing stream,
        though its chunk leaves only when that codec work is done); unless that would leave a playing stream of another
        batch dry: the newcomer's batch goes first only if, after its turn, the other batches holding playing streams
        can each take a turn, in deadline order, before their listeners run out (a turn of _turn_s each), or once it has
        waited about a round of their turns. Otherwise newcomers arriving turn after turn (a burst's joins, spread over
        turns) would keep every other batch waiting until it ran dry. With N frames a turn every span here is a whole
        turn (_turn_s, measured): the newcomer's first audio comes a frame into its batch's turn, but the other batches
        wait for all N frames of it, and each of their turns gives them N frames of audio. With a frame lane: among its
        batches that have a frame to make (None if none has)."""
        mine = self._active if lane is None else [
            s for s in self._active if self._lane_of(self._group_of(s)) is lane
            and self._batch.groups[self._group_of(s)].requests]
        if not mine:
            return None
        due = min(mine, key=lambda s: (s.deadline(), s.arrival))
        g = self._group_of(due)
        if not due.newcomer:
            return g
        dry: dict[int, float] = {}  # batch -> when its first listener runs out, batches other than g
        for s in mine:
            h = self._group_of(s)
            if h != g and not s.newcomer:
                dry[h] = min(dry.get(h, float("inf")), s.deadline())
        now, turn = time.perf_counter(), self._turn_s
        others = sorted(dry.items(), key=lambda item: item[1])
        # a batch already dry is not waited for, and a newcomer waits at most about a round of the others' turns
        # (at capacity the playing batches are always near dry): its wait stays bounded
        if now - due.arrival < (len(others) + 1) * turn and any(
                now <= ends < now + (k + 2) * turn for k, (h, ends) in enumerate(others)):
            return others[0][0]  # the playing batch due first
        return g

    def _turn(self) -> None:
        """One batch's turn (the batch of the most urgent stream): its frames and codec calls (_batch_turn). With frame
        lanes, a turn of the lanes (_lanes_turn)."""
        self._read_spans()
        if self._frame_lanes:
            self._lanes_turn()
            return
        g = self._next_group()
        streams = [s for s in self._active if self._group_of(s) == g]
        self._note("turn: batch", g)
        start = self._timer.mark()
        try:
            self._batch_turn(g, streams, self.metrics, self._guarded)
        except Exception as e:  # noqa: BLE001 - a failed batch step or codec call fails its streams, not the server
            self._fail_batch(g, e, "batched turn failed")
        self._spans.append(("turn", start, self._timer.mark()))
        self._joins = 0

    def _batch_turn(self, g: int, streams: list[Stream], metrics: ServeMetrics | None, run) -> None:
        """Batch g's frames_per_turn (N) frames back to back, each while the chunks of the codec work before it leave
        (_post_ready), with the codec calls of _codec_side: after the first frame a newcomer's first chunk (its first
        audio: one frame), after the last every other chunk. Streams join between turns only, so a stream's turns
        start at its frames 0, N, 2N, ... and its chunks are 1, N - 1, N, ... frames whatever the load (turn_chunk).
        The turn ends early once the batch has no request left."""
        busy = metrics.busy if metrics else lambda part: contextlib.nullcontext()  # no metrics: the warm-up
        per_turn, group = self.config.frames_per_turn, self._batch.groups[g]
        held: dict[int, list[torch.Tensor]] = {}  # slot -> its frames of this turn not decoded yet
        for k in range(per_turn):
            with busy("frame"):
                frames = self._batch.step_group(g, lambda: self._post_ready(metrics, run))
            for slot, codes in frames.items():
                if codes is not None:
                    held.setdefault(slot, []).append(codes)
            last = k == per_turn - 1 or not group.requests
            with busy("codec"):
                self._codec_side(g, streams, held, last, metrics, run)
            if last:
                return

    def _post_ready(self, metrics: ServeMetrics | None, run) -> None:
        """While a frame runs: the chunks of the codec work before it leave as far as that work is done (a split or
        an overlapped lane: all of them, after waiting for it; serial: none is left), and a stream whose last chunk
        has left is done."""
        self._lane.wait()
        self._post_done(metrics, run)

    def _post_done(self, metrics: ServeMetrics | None, run) -> None:
        """The chunks whose codec work is done leave (every batch's), and a stream whose last chunk has left is done."""
        rate = self.model.codec.sample_rate
        for stream in list(self._active):
            run(stream, lambda: stream.post_ready(rate, metrics) or stream.finished)

    def _lanes_turn(self) -> None:
        """A turn of the frame lanes: every lane with nothing in flight queues the frame of its most urgent batch
        (_queue_lane), the first finished first; then the lane whose frame was queued first finishes it
        (_finish_lane). So the arrivals of the time it waited join (the scheduler's loop, before the next turn)
        while that lane is idle, as between the serial server's turns, not behind its next frame."""
        for lane in sorted(self._frame_lanes, key=lambda lane: lane.queued):
            if lane.in_flight is None and not any(other.in_flight and other.wide for other in self._frame_lanes):
                g = self._next_group(lane)
                if g is not None:
                    self._queue_lane(lane, g)
        self._joins = 0
        flying = [lane for lane in self._frame_lanes if lane.in_flight]
        if flying:
            self._finish_lane(min(flying, key=lambda lane: lane.queued))
        else:  # no frame to make: the last chunks leave when done
            self._post_done(self.metrics, self._guarded)
            time.sleep(LANE_POLL_S)

    def _alone(self, lane: FrameLane) -> bool:
        """Whether the lane has the GPU to itself: no other lane has a frame in flight or a stream to make one for.
        Its frame then runs on the wide decoders, every SM (FrameBatch.queue_frame(wide=True)), where it has them;
        the other lanes queue nothing until it is done (_lanes_turn), and a join into one of them finishes it first
        (_admit): grids of cooperative launches that add up to more than the SMs could each hold part of them."""
        return not any(other.in_flight for other in self._frame_lanes if other is not lane) and not any(
            group.requests for g, group in enumerate(self._batch.groups) if self._lane_of(g) is not lane)

    def _queue_lane(self, lane: FrameLane, g: int) -> None:
        """Batch g's frame queued on its lane (whose stream has its batches' prefills too), after the scheduler's
        stream's work (the warm-up's); on every SM if the lane is alone (_alone)."""
        lane.after_scheduler()
        group = self._batch.groups[g]
        wide = bool(group.wide_rungs) and self._alone(lane)
        try:
            with lane.running():
                start = self._timer.mark()
                queued = group.queue_frame(wide)
                done = self._timer.mark()
        except Exception as e:  # noqa: BLE001 - as _finish_lane: the batch's streams fail, not the server
            self._fail_batch(g, e, f"frame lane {lane.index}'s frame failed")
            return
        self._queued += 1
        lane.in_flight, lane.queued, lane.wide = (g, queued, start, done), self._queued, wide
        self._note("lane", lane.index, "frame queued: batch", g, "size", group.last_size, "(every SM)" if wide else "")

    def _finish_lane(self, lane: FrameLane) -> None:
        """The lane's frame in flight finished: while it runs, the chunks whose codec work is done leave (polled, the
        other lanes' included); then its codes are read and its batch's codec calls queued on the lane's codec stream,
        or after a wide frame on its frames' stream (_codec_side, FrameLane.decoding), whose chunks leave once done,
        at a later turn or poll. A failed frame or codec call fails
        that batch's streams, not the server."""
        g, queued, start, done = lane.in_flight
        wide = lane.wide
        lane.in_flight, lane.wide = None, False
        metrics, size = self.metrics, self._batch.size
        streams = [s for s in self._active if self._group_of(s) == g]
        try:
            with metrics.busy("frame"):
                while not lane.frame_done(done):
                    self._post_done(metrics, self._guarded)
                    time.sleep(LANE_POLL_S)
                with lane.running():
                    frames = self._batch.groups[g].finish_frame(queued)
            self._note("lane", lane.index, "frame read: batch", g)
            # a lane's turn is its frame: its codec call runs beside the lane's next frame, on the codec stream
            # (after a wide frame, before the next one)
            self._spans.append(("turn", start, done))
            held = {g * size + s: [codes] for s, codes in frames.items() if codes is not None}
            with metrics.busy("codec"), lane.decoding(after_wide=wide):
                self._codec_side(g, streams, held, True, metrics, self._guarded)
            self._note("lane", lane.index, "codec queued: batch", g)
        except Exception as e:  # noqa: BLE001 - a failed batch step or codec call fails its streams, not the server
            self._fail_batch(g, e, f"frame lane {lane.index}'s turn failed")

    def _fail_batch(self, g: int, error: Exception, what: str) -> None:
        """Inside an except block: batch g's streams end with a 500 naming the error, the traceback logged."""
        log.exception(what)
        for stream in [s for s in self._active if self._group_of(s) == g]:
            self._finish(stream, "error", RequestError(500, f"internal error: {type(error).__name__}: {error}"))

    def _codec_side(self, g: int, streams: list[Stream], held: dict[int, list[torch.Tensor]], last: bool,
                    metrics: ServeMetrics | None, run) -> None:
        """Batch g's chunks due after a frame of its turn (`held`: each slot's frames not decoded yet, taken out as
        they are decoded): a chunk whose frames are all made (turn_chunk of the stream's count), and after the turn's
        last frame (`last`) every chunk, one that ended short (EOS or its last frame) padded with code 0 to its
        length, the padding's samples dropped (the decoder is causal; the padding enters only the state of a row
        that is reset before its next stream). One call of the batch's rows a chunk length; each stream takes its
        audio, and is flushed once it has left the batch with every frame decoded. `streams` is read again (a
        stream that failed or finished has left it); `run(stream, work)` runs one stream's work."""
        lane, rate, size = self._lane, self.model.codec.sample_rate, self._batch.size
        per_turn, upsample = self.config.frames_per_turn, self.model.codec.upsample
        in_batch = self._batch.groups[g].requests  # its slots whose request goes on after this frame
        streams = [s for s in streams if s in self._active and not s.flushed]  # a stream that failed has left
        due: dict[int, list[Stream]] = {}  # chunk length -> the streams whose chunk of that length is due
        for s in streams:
            length, made = turn_chunk(s.frames, per_turn), len(held.get(s.slot, ()))
            if made == length or (last and made):
                due.setdefault(length, []).append(s)
        with lane.calls():
            chunks = {}  # slot -> (its audio, its frames)
            for length in sorted(due):
                made = [held.pop(s.slot) for s in due[length]]
                codes = torch.stack([pad_rows(torch.stack(c), length) for c in made])
                audio = lane.to_host(self._codecs[g].decode([s.slot % size for s in due[length]], codes))
                for s, c, samples in zip(due[length], made, audio):
                    chunks[s.slot] = samples[:len(c) * upsample], len(c)
            for stream in streams:
                chunk, frames = chunks.get(stream.slot, (None, 0))
                ended = stream.slot % size not in in_batch and stream.slot not in held
                run(stream, lambda: stream.take_audio(chunk, frames, ended, rate, metrics))

    def _free(self, stream: Stream) -> None:
        self._batch.remove(stream.slot)

    def _drop(self) -> None:
        for lane in self._frame_lanes:  # their work done before the memory it uses is let go
            lane.synchronize()
            lane.in_flight = None
        self._batch = None
