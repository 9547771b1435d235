"""The by-turns scheduler (TurnsScheduler; --by-turns, the default on the reference backend): the streams take
turns. A pool of decoder pairs (talker + code predictor, one per stream slot, sharing the weights); each turn
advances one stream by one frame, so the GPU sees one request's frame at a time. Each stream has its own decoder
pair (KV caches, positions, repetition history, random stream) and its own StreamingCodec with its own codec state
(the shared speech decoder copies it in and out around each call).

Scheduling policy: earliest deadline first, one frame per turn. A stream's deadline is the moment its
listener runs out of audio (PlaybackClock): a stream that has not sent audio yet is due at its arrival (a
WebSocket session's next utterance when the audio before it has played), so new requests go first and get
their first chunk within a frame or two, while a running stream moves up as its buffered audio drains and
cannot be starved: each frame of work pushes a stream's deadline 80 ms further, and a newcomer's deadline
is fixed. Ties go to the earlier arrival."""

from __future__ import annotations

import dataclasses

import torch

from ..runtime.torch_model import PREFILL_MIN_BUCKET
from ..tts.codec import StreamingCodec
from ..tts.model import TtsModel
from ..tts.pipeline import make_decoders
from ..runtime.backends import check_backend
from ..tts.planner import Composition
from ..tts.prompt import build_prompt
from .config import ServeConfig
from .metrics import ServeMetrics
from .scheduler import WARMUP_FRAMES, WARMUP_TEXT, Scheduler, warm_prefill_lengths
from .streams import PlaybackClock, SpeechJob, Stream


def next_stream(active: list[Stream]) -> Stream:
    """The scheduling policy (module docstring): earliest deadline first, then earliest arrival."""
    return min(active, key=lambda s: (s.deadline(), s.arrival))


def decoder_pairs(model: TtsModel, backend: str, count: int, max_seq: int) -> list[tuple]:
    """`count` (talker, predictor) pairs that share one copy of the weights on the device; each has its own
    KV caches, scratch buffers, positions and random stream."""
    check_backend(backend)
    if backend == "megakernel":  # already on the GPU and contiguous, so each Decoder's weights.to("cuda") keeps these
        shared = model.weights_on("cuda")
    else:  # already float32, so each TorchDecoder's conversion keeps these tensors
        share = lambda w: w.map(lambda t: t.to(torch.float32).contiguous())  # noqa: E731
        shared = dataclasses.replace(model, talker_weights=share(model.talker_weights),
                                     predictor_weights=share(model.predictor_weights))
    return [make_decoders(shared, backend, max_seq, device="cpu") for _ in range(count)]


class TurnsScheduler(Scheduler):
    """The streams take turns, a decoder pair each, earliest deadline first (module docstring)."""

    def __init__(self, config: ServeConfig, composition: Composition, metrics: ServeMetrics | None = None):
        super().__init__(config, composition, metrics)
        self._pool: list[tuple] = []  # the free decoder pairs, the most recently used last

    def _build(self, model: TtsModel, max_seq: int) -> None:
        self._pool = decoder_pairs(model, self.composition.talker, self.config.max_streams, max_seq)

    def _warm_up(self) -> None:
        StreamingCodec(self.model.codec)  # captures a graph for each chunk length a stream decodes (1 to 16 frames)
        # every megakernel pair has graphs and launches of its own to warm; the reference pairs share all
        # that is warmed (the codec, the text side), so one of them is enough
        for pair in self._pool if self.composition.talker == "megakernel" else self._pool[:1]:
            self._warm(pair)

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

    def _admit(self, stream: Stream) -> bool:
        """Gives an arrival its decoder pair: the most recently used (warm caches)."""
        if not self._pool:
            return False
        stream.decoders = self._pool.pop()
        self._active.append(stream)
        return True

    def _turn(self) -> None:
        """The default policy: the stream whose listener runs dry first advances one frame."""
        self.metrics.queue_length.set(sum(not s.started for s in self._active) + len(self._pending))
        stream = next_stream(self._active)
        self._guarded(stream, lambda: stream.advance(self.model, self.metrics))

    def _free(self, stream: Stream) -> None:
        self._pool.append(stream.decoders)

    def _drop(self) -> None:
        self._pool = []
