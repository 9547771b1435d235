"""The frame loop of one sequence: talker (one codebook-0 token a frame) + code predictor (codebooks 1..15), the
frame recipe of mkport.tts.frames with one row, with two backends behind the Decoder interface of
mkport.runtime.decoder:

- `megakernel`: mkport.runtime.decoder.Decoder for both decoders (needs a CUDA GPU);
- `reference`: mkport.runtime.torch_decoder.TorchDecoder, plain torch on CPU or GPU (float32 from the bf16
  weights, the kernel's sampling semantics from a seeded torch.Generator).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..errors import MkportError
from ..runtime.backends import invariance, make_decoder
from ..runtime.decoder_api import SequenceDecoder
from ..runtime.sampling import SamplingParams
from .codec import StreamingCodec
from .frames import MIN_FRAMES, FrameRecipe, OneRow, predictor_sampling
from .limits import DEFAULT_MAX_FRAMES, check_max_frames, fits
from .model import TtsModel
from .prefix_cache import SHARED_CACHE, PrefixCache, prefill_prompt
from .prompt import Prompt, build_prompt
from .text import UTTERANCE_TOKENS, split_utterances


@dataclass(frozen=True)
class TtsSampling:
    talker: SamplingParams
    predictor: SamplingParams

    @classmethod
    def from_generation_config(cls, gen: dict, seed: int = 0, greedy: bool = False) -> "TtsSampling":
        """Official defaults: talker top-k 50, top-p 1.0, temperature 0.9, repetition penalty 1.05;
        predictor top-k 50, top-p 1.0, temperature 0.9 (no penalty); generation_config.json overrides."""
        def params(prefix: str, penalty: float) -> SamplingParams:
            sample = bool(gen.get(prefix + ("dosample" if prefix else "do_sample"), True)) and not greedy
            return SamplingParams(
                temperature=float(gen.get(prefix + "temperature", 0.9)) if sample else 0.0,
                top_k=int(gen.get(prefix + "top_k", 50)),
                top_p=float(gen.get(prefix + "top_p", 1.0)),
                repetition_penalty=penalty,
                seed=seed,
            )
        return cls(params("", float(gen.get("repetition_penalty", 1.05))), params("subtalker_", 1.0))


# -- long text ------------------------------------------------------------------------------------------
def check_fits(prompt: Prompt, max_frames: int, max_position: int) -> None:
    """The talker's KV cache holds a prompt and its frames; the error names what does not fit."""
    n, tokens = prompt.embeds.shape[0], len(prompt.text_ids)
    if fits(n, max_frames, max_position):
        return
    cache = f"the talker's KV cache ({max_position} positions, its max_position_embeddings)"
    if n + MIN_FRAMES > max_position:  # the text alone
        most = max_position - MIN_FRAMES - (n - tokens)
        raise MkportError(f"a sentence of {tokens} text tokens does not fit {cache}: a sentence may have at most "
                          f"{most}; end sentences earlier (. ! ? or a new line)")
    raise MkportError(f"a sentence of {tokens} text tokens ({n} prompt positions) and --max-frames {max_frames} "
                      f"exceed {cache}; lower --max-frames to {max_position - n} or shorten the sentence")


def _utterance_seed(seed: int, index: int) -> int:
    """Utterance 0 keeps the seed (a short text is spoken as before); the others get their own."""
    return (seed + index) & 0x7FFFFFFFFFFFFFFF


# -- the loop -------------------------------------------------------------------------------------------
def make_decoders(model: TtsModel, backend: str, max_seq: int, batch: int | None = None, device=None,
                  sms: int | None = None, predictor_backend: str | None = None, invariant_to: int = 0):
    """(talker, predictor) decoders for a backend (runtime.backends.make_decoder): one-sequence ones (generate_frames),
    or with `batch` batch decoders of `batch` sequences (tts.batch). `sms`: the megakernels' SM budget;
    `predictor_backend`: the code predictor's, when it is not the talker's (a composition of mkport.tts.planner).
    The megakernels' prefill replays CUDA graphs unless the model was loaded without them (TtsModel.graphs).
    `invariant_to` N: the megakernels' plans are batch-invariant to N (launch_plan; the other backends ignore it)."""
    pred_seq = model.config.num_code_groups + 1
    part = dict(batch=batch, device=device, sms=sms, prefill_graphs=model.graphs)
    predictor_backend = predictor_backend or backend
    mk = lambda b: invariance(invariant_to) if b == "megakernel" else {}  # noqa: E731
    return (make_decoder(model.talker_spec, model.talker_weights, backend, max_seq, **part, **mk(backend)),
            make_decoder(model.predictor_spec, model.predictor_weights, predictor_backend, pred_seq, **part,
                         **mk(predictor_backend)))


class Span:
    """The time of queued work from its creation to stop(): CUDA events on a GPU (no sync of their own; read
    seconds() once the work is done), the host clock on the CPU, where the work is done when queued."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.begin = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.end = time.perf_counter()

    def seconds(self) -> float:
        return self.begin.elapsed_time(self.end) / 1e3 if self.cuda else self.end - self.begin


class _HostCopy:
    """A device tensor copied to the host without waiting for the device: the copy is queued behind the
    work in flight, and get() waits for it alone. Two pinned buffers in turn, so that the next frame's copy
    can be queued while the host still reads this one."""

    def __init__(self, like: torch.Tensor):
        cuda = like.is_cuda
        self.buffers = [torch.empty(like.shape, dtype=like.dtype, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.turn = 0

    def put(self, t: torch.Tensor) -> int:
        slot, self.turn = self.turn, 1 - self.turn
        self.buffers[slot].copy_(t, non_blocking=True)
        if self.events[slot] is not None:
            self.events[slot].record()
        return slot

    def get(self, slot: int) -> torch.Tensor:
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        return self.buffers[slot].clone()


@torch.no_grad()
def generate_frames(model: TtsModel, prompt: Prompt, talker: SequenceDecoder, predictor: SequenceDecoder,
                    sampling: TtsSampling, max_frames: int, caller_decodes=lambda frame: False,
                    prefix_cache: PrefixCache | None = SHARED_CACHE, spans: dict | None = None
                    ) -> Iterator[torch.Tensor]:
    """Yields frames of 16 codes (CPU int64 tensors) until EOS or max_frames.

    `spans`, when given, gets the prefill's Span ("prefill"), to read once frame 0 is out.
    The talker's K/V of the prompt's prefix rows (Prompt.prefix_rows) come from `prefix_cache` when it
    holds them for this talker, and go into it when not; None prefills the whole prompt in one pass.

    The device does not wait for the host between frames: frame k+1 (its talker step, fed frame k's codes,
    and its predictor pass) is queued before the host waits for frame k's codes, which are copied out
    behind frame k's work: the one sync of a frame. When frame k is EOS, the queued frame k+1 is dropped.
    `caller_decodes(k)` true: the caller queues GPU work of its own when it gets frame k (a codec call),
    which should not wait behind frame k+1, so frame k+1 is queued after the caller is done with frame k."""
    dev = talker.device
    talker.reset()
    if prompt.embeds.shape[0] < 2:
        raise MkportError("prompt too short")
    if not fits(prompt.embeds.shape[0], max_frames, talker.max_seq):
        raise MkportError(f"the prompt ({prompt.embeds.shape[0]} positions) and max_frames ({max_frames}) exceed "
                          f"the KV cache of the talker decoder given ({talker.max_seq} positions)")
    recipe = FrameRecipe(model, talker, predictor, 1)
    one = OneRow(predictor)
    out = _HostCopy(recipe.codes[0])

    def talker_step(k: int, embed: torch.Tensor) -> None:
        """Samples frame k's codebook 0 into the recipe's codes."""
        ids = recipe.suppressed(k)
        if ids is not None:
            talker.set_suppressed(ids)
        recipe.codes[:, 0] = talker.step(embed=embed, sampling=sampling.talker)

    def queue_frame(k: int) -> tuple[int, torch.Tensor]:
        """Queues frame k's predictor pass after its codebook 0; returns (host copy slot, E0(c0))."""
        e0 = recipe.predictor_pass(one, talker.hidden.view(1, -1), predictor_sampling(sampling.predictor, k))
        return out.put(recipe.codes[0]), e0

    def queue_next(k: int, e0: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Queues frame k+1 (its talker step, fed frame k and the text for step k, then its predictor pass)."""
        talker_step(k + 1, recipe.next_inputs(e0, prompt.text_for_step(k).to(dev)[None])[0])
        return queue_frame(k + 1)

    # prefill all but the last prompt position; the last one goes through the kernel step and samples c0
    embeds = prompt.embeds.to(dev)
    prefill = Span(dev)
    prefill_prompt(talker, embeds[:-1], prompt.prefix_rows, prompt.prefix_key, prefix_cache)
    prefill.stop()
    if spans is not None:
        spans["prefill"] = prefill
    talker_step(0, embeds[-1])
    slot, e0 = queue_frame(0)
    for k in range(max_frames):
        more = k + 1 < max_frames
        ahead = more and not caller_decodes(k)
        if ahead:
            queued = queue_next(k, e0)
        host = out.get(slot)
        if int(host[0]) == recipe.eos:
            return
        yield host
        if not more:
            return
        slot, e0 = queued if ahead else queue_next(k, e0)


@dataclass
class SpeakStats:
    frames: int = 0
    samples: int = 0
    first_chunk_s: float | None = None
    total_s: float = 0.0
    sample_rate: int = 24000
    # wall time of each frame in the frame loop (frame 0 includes the prefill), ending at the frame's host
    # copy, which waits for the device; codec work between frames is not counted
    frame_s: list[float] = field(default_factory=list)
    # host time from the call to the frame loop's start: prompt (tokenizer, text projection), decoders when
    # built here, codec set-up; GPU work it queued finishes inside frame 0. prompt_s and decoders_s are parts
    setup_s: float = 0.0
    prompt_s: float = 0.0
    decoders_s: float = 0.0
    # the first utterance's prompt prefill: device time on a GPU (CUDA events), a part of frame_s[0]
    prefill_s: float | None = None
    # wall time of each codec call that made a chunk, up to its samples on the host
    codec_s: list[float] = field(default_factory=list)
    # when each frame and each chunk's codec call ended, seconds since the call, and each chunk's samples:
    # the request's timeline (mkport.bench.plots.tts_timeline)
    frame_end_s: list[float] = field(default_factory=list)
    chunk_end_s: list[float] = field(default_factory=list)
    chunk_samples: list[int] = field(default_factory=list)

    @property
    def audio_s(self) -> float:
        return self.samples / self.sample_rate

    @property
    def rtf(self) -> float:
        return self.total_s / self.audio_s if self.samples else float("inf")


def synthesize(model: TtsModel, text: str, speaker=None, language="auto", instruct=None,
               text_mode="non-streaming", backend="reference", seed=0, max_frames=DEFAULT_MAX_FRAMES, greedy=False,
               stats: SpeakStats | None = None, codec_kwargs: dict | None = None,
               frames_out: list | None = None, decoders=None,
               utterance_tokens: int = UTTERANCE_TOKENS,
               prefix_cache: PrefixCache | None = SHARED_CACHE) -> Iterator[torch.Tensor]:
    """Text -> audio chunks (float32 CPU tensors, 24 kHz), as soon as each is decoded. Long text is spoken
    as utterances (split_utterances), one after the other, each its own prompt, frame loop (at most
    max_frames) and codec stream, seeded seed, seed + 1, ...; their audio follows on in one stream.
    Every utterance's prompt is built and checked before the decoders are allocated. `decoders`: (talker,
    predictor) from make_decoders to reuse across requests (the frame loop resets them); built for this
    request when None. `prefix_cache`: see generate_frames (the process's shared one by default, None: off)."""
    t0 = time.perf_counter()
    stats = stats if stats is not None else SpeakStats()
    stats.sample_rate = model.codec.sample_rate
    check_max_frames(max_frames)
    texts = split_utterances(text, model.encode, utterance_tokens)
    prompts = [build_prompt(model.config, model.encode, model.text, model.talker_weights.embed[0], t,
                            speaker, language, instruct, text_mode) for t in texts]
    for prompt in prompts:
        check_fits(prompt, max_frames, model.talker_spec.max_position)
    stats.prompt_s = time.perf_counter() - t0
    max_seq = max(p.embeds.shape[0] for p in prompts) + max_frames
    talker, predictor = decoders or make_decoders(model, backend, max_seq)
    stats.decoders_s = time.perf_counter() - t0 - stats.prompt_s

    def out(chunk, codec_start):
        chunk = chunk.cpu()  # waits for a codec on the GPU, so the times below include its work
        end = time.perf_counter()
        stats.codec_s.append(end - codec_start)
        stats.chunk_end_s.append(end - t0)
        stats.chunk_samples.append(chunk.numel())
        if stats.first_chunk_s is None:
            stats.first_chunk_s = time.perf_counter() - t0
        stats.samples += chunk.numel()
        stats.total_s = time.perf_counter() - t0
        return chunk

    for index, prompt in enumerate(prompts):
        sampling = TtsSampling.from_generation_config(model.generation, seed=_utterance_seed(seed, index),
                                                      greedy=greedy)
        codec = StreamingCodec(model.codec, **(codec_kwargs or {}))
        frame_start = time.perf_counter()
        if index == 0:
            stats.setup_s = frame_start - t0
        spans = {}
        frames = generate_frames(model, prompt, talker, predictor, sampling, max_frames,
                                 caller_decodes=lambda k: codec.next_push_emits(), prefix_cache=prefix_cache,
                                 spans=spans)
        for frame in frames:
            codec_start = time.perf_counter()
            if stats.prefill_s is None:  # frame 0 is out: the prefill's work is done
                stats.prefill_s = spans["prefill"].seconds()
            stats.frame_s.append(codec_start - frame_start)
            stats.frame_end_s.append(codec_start - t0)
            stats.frames += 1
            if frames_out is not None:
                frames_out.append(frame)
            chunk = codec.push(frame)
            if chunk is not None:
                yield out(chunk, codec_start)
            frame_start = time.perf_counter()
        codec_start = time.perf_counter()
        chunk = codec.flush()
        if chunk is not None:
            yield out(chunk, codec_start)
    stats.total_s = time.perf_counter() - t0
