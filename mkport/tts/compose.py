"""Qwen3-TTS compositions (mkport.tts.planner) on the device: each group timed alone (measure_groups), B streams run end
to end on a composition (run_composition), and `mkport plan` on top (make_plan).

A run is what a batched server does with B streams: FrameBatch advances every stream a frame at a time, and one
codec call (CodecStreams, each stream's state kept) turns the frame of every stream into its audio. Serial: the
codec's call follows the frame on the same CUDA stream. Split: T and L are megakernels on all SMs but k (their
grid), on a high-priority stream, and the codec's calls go to a second stream, where they run beside the next frame;
the host waits for a frame's codec work before it queues the next frame's, so the codec is never more than a frame
behind.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path

import torch

from ..errors import MkportError
from .planner import (BACKENDS, SPLIT_FRACTIONS, Composition, GroupTimes, Measured, Plan, Validation, choose,
                    enumerate_compositions, key, model_shape, read_plan, split_sms)
from ..kernel.spec import open_model
from .batch import FrameBatch
from .codec import CodecStreams
from .model import TtsModel
from ..runtime.backends import BACKENDS as SEQUENCE_BACKENDS
from .pipeline import TtsSampling, make_decoders
from .prompt import build_prompt

REPEATS = 5  # timed calls of each group (their median), after one untimed call
TALKER_STEPS = 8  # talker steps in one timed call (queued back to back, as in a frame)
PREDICTOR_PASSES = 4
WHOLE_FRAMES = 4  # whole frames in one timed call (the overhead beyond T and L)
JOIN_FRAMES = 16  # a run's streams but the last join over this many frames, the last this many frames later
TIMED_FRAMES = 32  # a run's timed window, once every stream has joined
VALIDATE_RUNS = 3  # end-to-end runs of each composition (their median)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _ms(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of fn() in ms, the device's queued work included, after one untimed call (first-use
    costs: graph captures, cuBLAS set-up)."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def device_identity(device=None) -> tuple[str, int]:
    """(name, SMs) of a device, as plans record it: ("cpu", 1) off a GPU. None: the GPU if there is one."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return "cpu", 1
    return torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).multi_processor_count


def planned_composition(path: Path, folder: Path, batch: int) -> Composition:
    """The composition the plan file `path` picks for `batch`, checked against the model in `folder` (its shape,
    from its config) and this machine's device; any problem is one line naming the file."""
    plan = read_plan(path)
    talker = open_model(f"{folder}:talker")
    shape = model_shape(talker.spec, talker.with_part("code_predictor").spec)
    try:
        return plan.composition_for(batch, shape, *device_identity())
    except MkportError as e:
        raise MkportError(f"{path}: {e}") from None


def sequence_backend(comp: Composition) -> str | None:
    """The backend of one-sequence decoder pairs (pipeline.make_decoders without a batch) that runs `comp`, if one
    does: T and L on one such backend, serial (those run the codec after each frame)."""
    same = comp.talker == comp.predictor and not comp.codec_sms
    return comp.talker if same and comp.talker in SEQUENCE_BACKENDS else None


RUN_FRAMES = 2 * JOIN_FRAMES + 1 + TIMED_FRAMES  # a request's frames in a run: none ends by its max_frames there


class Pool:
    """What the compositions share: the model (its decoder weights on the device once), the requests the streams
    speak, and the talker / predictor batch decoders by (backend, batch, SMs), built on first use."""

    def __init__(self, model: TtsModel, device, max_batch: int, repeats: int = REPEATS):
        """`repeats`: timed calls of each measurement (measure_groups)."""
        self.model, self.device, self.repeats = model, torch.device(device), repeats
        self.gpu, self.sm_count = device_identity(self.device)
        model.talker_weights = model.talker_weights.to(self.device)  # every decoder then shares one copy
        model.predictor_weights = model.predictor_weights.to(self.device)
        speaker = model.config.default_speaker
        self.prompts = [build_prompt(model.config, model.encode, model.text, model.talker_weights.embed[0],
                                     f"Stream {b} reads this sentence aloud, at its own pace.", speaker, "auto")
                        for b in range(max_batch)]
        self.samplings = [TtsSampling.from_generation_config(model.generation, seed=b) for b in range(max_batch)]
        self.frames = RUN_FRAMES  # a request's max_frames
        measure_positions = (1 + repeats) * (TALKER_STEPS + WHOLE_FRAMES)  # the talker steps of a measurement
        self.max_seq = max(p.embeds.shape[0] for p in self.prompts) + max(self.frames, measure_positions) + 1
        self._pairs: dict[tuple, tuple] = {}
        self._codecs: dict[int, CodecStreams] = {}

    def pair(self, backend: str, batch: int, sms: int) -> tuple:
        """(talker, predictor) of `batch` sequences; `sms` is the megakernels' grid (other backends use every SM)."""
        sms = sms if backend == "megakernel" else self.sm_count
        if (backend, batch, sms) not in self._pairs:
            budget = sms if backend == "megakernel" else None
            self._pairs[backend, batch, sms] = make_decoders(self.model, backend, self.max_seq, batch,
                                                              device=self.device, sms=budget)
        return self._pairs[backend, batch, sms]

    def codec(self, batch: int) -> CodecStreams:
        """The codec of `batch` streams, its graph captured on first use (each run resets a stream's row as it joins)."""
        if batch not in self._codecs:
            self._codecs[batch] = CodecStreams(self.model.codec, batch)
            self._codecs[batch].prepare()
        return self._codecs[batch]

    def filled(self, talker, predictor, batch: int) -> FrameBatch:
        """A FrameBatch with a request in each of its first `batch` slots."""
        frames = FrameBatch(self.model, talker, predictor)
        talker.reset()
        for b in range(batch):
            frames.add(b, self.prompts[b], self.samplings[b], self.frames)
        return frames


def prebuild(pool: Pool, batches, fractions=SPLIT_FRACTIONS, log=lambda message: None) -> None:
    """Compiles every megakernel the plan may use (each batch size and SM budget), nvcc runs side by side; the
    decoders then load them from the cache. Sizes the plan refuses (shared memory) are left to measure_groups."""
    from ..kernel.build import build_libraries
    from ..kernel.cache import BUILDS, cache_root
    from ..runtime.decoder import current_device_target
    from ..kernel.render import render
    from ..kernel.launch_plan import plan_launch

    target = current_device_target()
    model = pool.model
    sources = []
    for batch in batches:
        for sms in [target.sm_count] + [target.sm_count - k for k in split_sms(target.sm_count, fractions)]:
            for spec in (model.talker_spec, model.predictor_spec):
                try:
                    plan = plan_launch(spec, dataclasses.replace(target, sm_count=sms), batch=batch)
                except MkportError:
                    continue
                sources.append(render(spec, plan).write(cache_root() / BUILDS))
    log(f"building {len(sources)} megakernels (cached ones are loaded)")
    build_libraries([(src, "fast") for src in sources], target.arch, os.cpu_count() or 4)


def measure_groups(pool: Pool, batches, backends=BACKENDS, fractions=SPLIT_FRACTIONS,
                   progress=lambda message: None) -> GroupTimes:
    """Each group alone, at each batch size, backend and SM budget (GroupTimes says what each entry is), the median
    of pool.repeats timed calls."""
    model, device, sm = pool.model, pool.device, pool.sm_count

    def ms(fn) -> float:
        return _ms(fn, device, pool.repeats)

    times = GroupTimes(pool.gpu, sm)
    budgets = [sm] + [sm - k for k in split_sms(sm, fractions)]
    gen = torch.Generator().manual_seed(0)
    q, size = model.config.num_code_groups, model.codec.codebook_size
    for batch in batches:
        progress(f"batch {batch}: timing the codec")
        codec, frames = pool.codec(batch), torch.randint(0, size, (batch, q), generator=gen)
        times.codec[key(batch)] = ms(lambda: codec.decode(list(range(batch)), frames))
        for backend in backends:
            for sms in budgets if backend == "megakernel" else [sm]:
                progress(f"batch {batch}: timing {backend}" + (f" on {sms} SMs" if sms < sm else ""))
                try:
                    frames = pool.filled(*pool.pair(backend, batch, sms), batch)
                except MkportError as e:  # e.g. a batch whose vectors do not fit the megakernel's shared memory
                    times.notes[key(backend, batch)] = str(e)
                    break
                talker_s, predictor_s, active = frames.samplings()
                talker = ms(lambda: [frames.talker_step(talker_s, active) for _ in range(TALKER_STEPS)]) / TALKER_STEPS
                predictor = ms(lambda: [frames.predictor_pass(predictor_s) for _ in range(PREDICTOR_PASSES)]
                               ) / PREDICTOR_PASSES
                times.talker[key(backend, batch, sms)] = talker
                times.predictor[key(backend, batch, sms)] = predictor
                if sms != sm:
                    continue
                times.prefill[key(backend, batch)] = ms(lambda: _rejoin(pool, frames, 0))
                if key(batch) not in times.overhead:  # the host's turn is the same whichever backend
                    whole = ms(lambda: [frames.step() for _ in range(WHOLE_FRAMES)]) / WHOLE_FRAMES
                    times.overhead[key(batch)] = max(0.0, whole - talker - predictor)
    return times


def _rejoin(pool: Pool, frames: FrameBatch, slot: int) -> None:
    """A new request in `slot`: its prompt prefilled into the talker's row of the slot."""
    frames.remove(slot)
    frames.add(slot, pool.prompts[slot], pool.samplings[slot], pool.frames)


def run_composition(pool: Pool, comp: Composition, batch: int) -> tuple[float, float]:
    """`batch` streams on `comp`, end to end: (ms a frame of every stream once all have joined, codec work
    included; ms from the last stream's join, its prefill included, to its first frame's samples on the host).

    The first batch-1 streams join spread over JOIN_FRAMES frames (as arrivals do), the last JOIN_FRAMES frames
    later; the timed window starts the frame after it and lasts TIMED_FRAMES frames. A request that ends (EOS) is
    replaced by a new one in its slot. The audio stays on the device, but for the last stream's first frame."""
    cuda = pool.device.type == "cuda"
    if comp.codec_sms and not cuda:
        raise MkportError("a split of the SMs needs a CUDA GPU")
    sms = comp.producer_sms(pool.sm_count)
    talker, predictor = pool.pair(comp.talker, batch, sms)[0], pool.pair(comp.predictor, batch, sms)[1]
    producer = torch.cuda.Stream(priority=-1) if comp.codec_sms else None  # its megakernels go first
    side = torch.cuda.Stream() if comp.codec_sms else None
    last = batch - 1
    joins = {b: b * JOIN_FRAMES // last for b in range(last)}
    joins[last] = 2 * JOIN_FRAMES if batch > 1 else 0
    start = joins[last] + 1
    end = start + TIMED_FRAMES
    codec = pool.codec(batch)  # its graph captured before anything is timed
    queued, first_ms, joined_at, window_at = None, None, 0.0, 0.0
    if cuda:
        _sync(pool.device)  # the new streams start after everything before them
    with torch.cuda.stream(producer):
        frames = FrameBatch(pool.model, talker, predictor)
        talker.reset()
        for frame in range(end):
            if frame == start:
                _sync(pool.device)
                window_at = time.perf_counter()
            for slot in range(batch):
                if joins[slot] == frame or (joins[slot] < frame and slot not in frames.requests):
                    if slot == last and frame == joins[last]:
                        joined_at = time.perf_counter()
                    _rejoin(pool, frames, slot)
                    codec.reset(slot)
            out = frames.step()
            if queued is not None:
                queued.synchronize()  # the last frame's codec work is done: at most one frame of it in flight
            with torch.cuda.stream(side):
                made = [slot for slot in sorted(out) if out[slot] is not None]
                wav = codec.decode(made, torch.stack([out[slot] for slot in made])) if made else None
                if last in made and first_ms is None:
                    wav[made.index(last)].cpu()
                    first_ms = 1e3 * (time.perf_counter() - joined_at)
                if side is not None:
                    queued = torch.cuda.Event()
                    queued.record()
        _sync(pool.device)
    return 1e3 * (time.perf_counter() - window_at) / (end - start), first_ms


def validate(pool: Pool, choices, runs: int = VALIDATE_RUNS, progress=lambda message: None) -> list[Validation]:
    """Every composition scored at each batch size, run end to end `runs` times (the runs interleaved, so that a
    slow spell of the machine does not fall on one composition)."""
    out = []
    for choice in choices:
        comps = [c for c, _ in choice.estimates]
        measured = {c: ([], []) for c in comps}
        for r in range(runs):
            for c in comps:
                progress(f"batch {choice.batch}: {c.label}, run {r + 1} of {runs}")
                frame, first = run_composition(pool, c, choice.batch)
                measured[c][0].append(frame)
                measured[c][1].append(first)
        out.append(Validation(choice.batch, choice.pick, [Measured(c, *measured[c]) for c in comps]))
    return out


def make_plan(folder: Path, batches, check: bool = False, backends=BACKENDS, fractions=SPLIT_FRACTIONS,
              device="cuda", repeats: int = REPEATS, runs: int = VALIDATE_RUNS,
              progress=lambda message: None) -> Plan:
    """`mkport plan`: load the model, time its groups (`repeats` calls each), score and choose per batch size, and
    with `check` run every scored composition end to end `runs` times (Plan.validation)."""
    progress("loading the model")
    model = TtsModel.load(folder, device=device)
    if model.config.model_type != "custom_voice":
        raise MkportError(f"plan runs CustomVoice models (a speaker id); this one is '{model.config.model_type}'")
    pool = Pool(model, device, max(batches), repeats)
    if "megakernel" in backends:
        prebuild(pool, batches, fractions, progress)
    times = measure_groups(pool, batches, backends, fractions, progress)
    plan = Plan(str(folder), model_shape(model.talker_spec, model.predictor_spec), times,
                choose(times, batches, enumerate_compositions(times.sm_count, backends, fractions)))
    if check:
        plan.validation = validate(pool, plan.choices, runs, progress)
    return plan
