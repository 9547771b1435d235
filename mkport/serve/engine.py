"""The engine of `mkport serve`: the scheduler its config names, behind the interface the app calls
(scheduler.Scheduler). The config is resolved here, once, at start-up: a backend, a batch or a plan that cannot be
is refused before anything loads."""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..errors import MkportError
from ..tts.codec import compile_unavailable
from ..tts.compose import device_identity, planned_composition, sequence_backend
from ..tts.limits import check_max_frames
from ..runtime.backends import check_backend
from ..tts.planner import Composition
from .batched import BatchedScheduler, batch_size, wide_lanes
from .config import MAX_FRAME_LANES, MAX_FRAMES_PER_TURN, ServeConfig
from .metrics import ServeMetrics
from .scheduler import Scheduler, runs_on_cuda
from .turns import TurnsScheduler

log = logging.getLogger("mkport.serve")


def Engine(config: ServeConfig, metrics: ServeMetrics | None = None) -> Scheduler:
    """The factory of the server's scheduler, named for what the app and the CLI hold: with --batched a
    BatchedScheduler (every stream in one batch decoder pair), else a TurnsScheduler (the streams take turns, a
    decoder pair each); either runs config's backend for the talker and the predictor, or its plan's pick."""
    if config.max_streams < 1:
        raise MkportError(f"--max-streams {config.max_streams}: must be at least 1")
    check_max_frames(config.max_frames)  # speak's bounds: the frames a talker's KV cache can hold
    if not 1 <= config.frames_per_turn <= MAX_FRAMES_PER_TURN:
        raise MkportError(f"--frames-per-turn {config.frames_per_turn}: 1 to {MAX_FRAMES_PER_TURN}")
    if config.frames_per_turn > 1 and not config.batched:
        raise MkportError("--frames-per-turn makes the turns of --batched: give both, or neither")
    if config.batch_size is not None and not config.batched:
        raise MkportError("--batch-size sizes the batches of --batched: give both, or neither")
    if config.batch_invariant and not config.batched:
        raise MkportError("--batch-invariant sizes the frames of --batched (by turns each stream has its own decoders, "
                          "its samples already the same alone and under load): give --batched too")
    if config.batch_invariant and not config.sized_batches:
        raise MkportError("--batch-invariant and --fixed-batch: every frame at the full size is invariant already; "
                          "--batch-invariant sizes the frames to the streams and keeps it: give one")
    if config.joins_together is True and not (config.batched and config.sized_batches and not config.batch_invariant):
        raise MkportError("--joins-together prefills the joins of --batched with frames sized to the streams, not with "
                          "--by-turns, --fixed-batch or --batch-invariant (a prompt's rows in company may round "
                          "otherwise than alone)")
    # a backend, a batch, a split, lanes or a plan that cannot be is refused now, not after loading
    split = split_sms_asked(config)
    config = dataclasses.replace(config, frame_lanes=frame_lanes_asked(config))
    if config.plan is None:
        check_backend(config.backend)
        if config.batched:
            batch_size(config)
        composition = Composition(config.backend, config.backend, split)
    else:
        composition = served_composition(config)
    if config.batch_invariant:
        check_invariant_composition(composition)
    config = dataclasses.replace(config, compile_codec=compiled_codec(config, composition))
    scheduler = BatchedScheduler if config.batched else TurnsScheduler
    return scheduler(config, composition, metrics)


def split_sms_asked(config: ServeConfig) -> int:
    """--codec-sms K, checked: a split of the SMs without a plan (`mk+mk split K`, the codec's calls beside the next
    frame on K SMs, the megakernels on the rest), which the batched server on the megakernel runs on a CUDA GPU; 0
    when not asked."""
    k = config.codec_sms
    if not k:
        return 0
    what = f"--codec-sms {k}"
    if config.plan is not None:
        raise MkportError(f"{what} and --plan: a plan picks its own split (its composition); give one")
    if not config.batched:
        raise MkportError(f"{what} runs the codec beside the batch decoders of --batched; by turns each stream's codec "
                          "runs after its frame: give --batched too")
    if config.backend != "megakernel":
        raise MkportError(f"{what} splits the SMs between the megakernels (their grid) and the codec; the {config.backend} "
                          "backend has no grid: serve it on the megakernel")
    if not torch.cuda.is_available():
        raise MkportError(f"{what} runs the codec beside the megakernels on SMs of its own, which needs a CUDA GPU")
    sms = device_identity()[1]
    if not 1 <= k < sms:
        raise MkportError(f"{what}: the codec's SMs must be 1 to {sms - 1} (this GPU has {sms}; 0 or no "
                          "--codec-sms: serial)")
    return k


def frame_lanes_asked(config: ServeConfig) -> int:
    """--frame-lanes L, checked: the batches' frames in L lanes at once, each lane's megakernels on 1/L of the SMs
    (their grid) and CUDA streams of its own, which the batched server on the megakernel runs on a CUDA GPU, one
    frame a turn, each lane's codec calls on a second stream of its own beside its frames. Not given: 2 where lanes
    run with sized frames (a lane alone on every SM), measured against one lane on the H100 (docs/serving.md: 20
    req/s without underruns, 10 req/s first audio +3 ms), else 1."""
    lanes = config.frame_lanes
    if lanes is None:  # where lanes run with sized frames: batched.wide_lanes's rule (lanes_run: on the megakernel)
        composition = Composition(config.backend, config.backend, 0)
        return 2 if lanes_run(config) is None and wide_lanes(config, composition) else 1
    what = f"--frame-lanes {lanes}"
    if not 1 <= lanes <= MAX_FRAME_LANES:
        raise MkportError(f"{what}: 1 to {MAX_FRAME_LANES} (1: one batch's frame at a time on every SM)")
    if lanes == 1:
        return 1
    blocked = lanes_run(config)
    if blocked:
        raise MkportError(f"{what} {blocked}")
    return lanes


def lanes_run(config: ServeConfig) -> str | None:
    """None where frame lanes can run, else why not (the words after "--frame-lanes L")."""
    if not config.batched:
        return "runs the frames of --batched's batches side by side: give --batched too"
    if config.plan is not None or config.backend != "megakernel":
        return ("gives each lane's megakernels a share of the SMs (their grid): serve on the megakernel backend, "
                "without --plan")
    if config.codec_sms:
        return "and --codec-sms: each lane runs its codec calls beside its frames, on a stream of its own; give one"
    if config.frames_per_turn > 1:
        return "makes one frame a lane's turn: give --frames-per-turn 1 or no --frame-lanes"
    if not torch.cuda.is_available():
        return "runs each lane on a CUDA stream and SMs of its own, which needs a CUDA GPU"
    return None


def compiled_codec(config: ServeConfig, composition: Composition) -> bool:
    """Whether the codec's calls are compiled: as asked, or by default where that was measured to help (--batched on a
    CUDA GPU: a call -23 to -26%, docs/serving.md) and Triton can build; asked where it cannot, refused in one line."""
    wanted, on_cuda = config.compile_codec, runs_on_cuda(composition)
    if wanted and not on_cuda:
        raise MkportError("--compile-codec compiles the codec's CUDA graphs: it needs a CUDA GPU and a backend that runs "
                          "there (megakernel or graphs), not the reference on the CPU")
    if wanted is False or (wanted is None and not (config.batched and on_cuda)):
        return False
    blocked = compile_unavailable()
    if blocked and wanted:
        raise MkportError(f"--compile-codec: {blocked}; serve with --no-compile-codec")
    if blocked:
        log.warning("the codec's calls run uncompiled: %s (--no-compile-codec silences this)", blocked)
    return blocked is None


def check_invariant_composition(comp: Composition) -> None:
    """--batch-invariant runs sized frames whose every size sums a row alike: the megakernel's invariant plans, or the
    reference's one-sequence decoders. A predictor on the graphs backend (torch's matmuls, cuBLAS picking its kernels
    by the batch's rows) would be a decoder of each size with sums of its own: refused in one line."""
    if comp.talker != "graphs" and comp.predictor == "graphs":
        raise MkportError(f"--batch-invariant: this composition ({comp.label}) runs the code predictor on the graphs "
                          "backend, whose torch matmuls round a row by the batch's shape; serve it with --fixed-batch "
                          "(every frame at the full size), or a plan whose predictor runs on the megakernel")


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

