"""The batched scheduler (`--batched`, BatchedScheduler): the streams share one batch decoder pair of --max-streams
sequences (mkport.tts.batch.FrameBatch), a stream a slot. Every turn, the arrivals join the batch (their prompts
prefilled into free slots), then one batched frame advances every stream at once: a frame of B streams
reads each weight once, so it costs far less than B frames. No stream waits for another's turn; a new stream
waits for at most the frame in flight. Each stream keeps its own slot state (KV cache, position, repetition
history, seeds) and its own codec state, so its audio is the same alone and in any batch. The codec decodes
the turn's frame of every stream in one call of a fixed shape (CodecStreams: its state kept per slot, no frame
decoded twice, the same arithmetic for a stream whoever shares the call), and each stream's 80 ms of audio leaves
that turn. Where the megakernel cannot hold --max-streams sequences of the model, batches of the largest size it
holds take turns (FrameGroups).

A plan's split (Composition.codec_sms > 0, batched only): the batch decoders are megakernels on all SMs but the
codec's (their grid), every frame on a high-priority CUDA stream, and the codec calls on a second stream, where
they run beside the next frame (SplitCodecLane). A chunk is posted once the event recorded after its codec call has
completed: the turn after it was decoded, when that turn's frame has been made; the host waits for a turn's codec
work before it queues the next turn's, so the codec is at most a frame behind (as mkport.tts.compose runs it). The
codec calls are the same as serial ones, so the samples are too; only when they leave moves."""

from __future__ import annotations

import logging

import torch

from ..errors import MkportError
from ..tts.batch import FrameBatch, FrameGroups
from ..tts.pipeline import make_decoders
from ..tts.codec import CodecStreams
from ..tts.compose import device_identity
from ..tts.model import TtsModel
from ..tts.planner import Composition
from .config import ServeConfig
from .metrics import ServeMetrics
from .scheduler import WARMUP_FRAMES, WARMUP_TEXT, Scheduler, warm_prefill_lengths
from .streams import CodecLane, PlaybackClock, RequestError, SpeechJob, Stream

log = logging.getLogger("mkport.serve")

WARM_SLOT_PREFILL_ROWS = 64  # the shortest padded prompt a batch slot's graphs are captured for at start-up


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


class BatchedScheduler(Scheduler):
    """Every stream a slot of one batch decoder pair (or of batches taking turns), all advanced by each frame."""

    def __init__(self, config: ServeConfig, composition: Composition, metrics: ServeMetrics | None = None):
        super().__init__(config, composition, metrics)
        self._batch: FrameGroups | None = None  # every stream's slot, in one or more batches
        self._lane = codec_lane(composition)  # where the codec runs, when its audio leaves
        self._codecs: CodecStreams | None = None  # every slot's codec state, decoded together

    def batch_layout(self) -> list[int] | None:
        return None if self._batch is None else [self._batch.size, len(self._batch.groups)]

    def _build(self, model: TtsModel, max_seq: int) -> None:
        comp = self.composition
        sms = comp.producer_sms(device_identity()[1]) if comp.codec_sms else None  # a split: the codec's SMs left
        size, count = batch_groups(self.config, comp, model)
        self._batch = FrameGroups([FrameBatch(model, *make_decoders(model, comp.talker, max_seq, size,
                                                                     predictor_backend=comp.predictor, sms=sms))
                                   for _ in range(count)])

    def _warm_up(self) -> None:
        """A request through each group of the batch, its codec included: the groups' kernels, cuBLAS set-up, codec
        graphs; on the megakernel, first the prefill graphs of every slot for the usual prompt lengths (a whole
        prompt is prefilled into a slot, from row 0)."""
        self._codecs = CodecStreams(self.model.codec, self._batch.batch)
        self._codecs.prepare()
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
            while not stream.finished:  # the turns of _turn
                self._codec_side([stream], group.step(), group, None, lambda stream, work: work())

    def _admit(self, stream: Stream) -> bool:
        """Gives an arrival a slot of the batch, with its prompt prefilled there."""
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

    def _turn(self) -> None:
        """One frame of every stream at once, then its codec side (_codec_side)."""
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

    def _free(self, stream: Stream) -> None:
        self._batch.remove(stream.slot)

    def _drop(self) -> None:
        self._batch = None
