"""Qwen3-TTS compositions (mkport.plan) on the device: each group timed alone (measure_groups), B streams run end
to end on a composition (run_composition), and `mkport plan` on top (make_plan).

A run is what a server does with B streams: FrameBatch advances every stream a frame at a time, and each stream's
StreamingCodec turns its frames into audio chunks. Serial: the codec's calls follow the frame on the same CUDA
stream. Split: T and L are megakernels on all SMs but k (their grid), on a high-priority stream, and the codec's
calls go to a second stream, where they run beside the next frame; the host waits for a frame's codec work before
it queues the next frame's, so the codec is never more than a frame behind.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path

import torch

from ..errors import MkportError
from ..plan import (BACKENDS, SPLIT_FRACTIONS, Composition, GroupTimes, Measured, Plan, Validation, choose,
                    enumerate_compositions, key, model_shape, read_plan, split_sms)
from ..spec import open_model
from .batch import FrameBatch, make_batch_decoders
from .codec import DEFAULT_CHUNK, DEFAULT_FIRST_CHUNK, DEFAULT_LEFT_CONTEXT, StreamingCodec
from .model import TtsModel
from .pipeline import BACKENDS as SEQUENCE_BACKENDS
from .pipeline import TtsSampling
from .prompt import build_prompt

CODEC = {"first_chunk": DEFAULT_FIRST_CHUNK, "chunk": DEFAULT_CHUNK, "left_context": DEFAULT_LEFT_CONTEXT}
REPEATS = 5  # timed calls of each group (their median), after one untimed call
TALKER_STEPS = 8  # talker steps in one timed call (queued back to back, as in a frame)
PREDICTOR_PASSES = 4
WHOLE_FRAMES = 4  # whole frames in one timed call (the overhead beyond T and L)
TIMED_CHUNKS = 2  # a run's timed window: this many steady chunks of every stream
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
    """The backend of one-sequence decoder pairs (pipeline.make_decoders) that runs `comp`, if one does: T and L
    on one such backend, serial (those run the codec after each frame)."""
    same = comp.talker == comp.predictor and not comp.codec_sms
    return comp.talker if same and comp.talker in SEQUENCE_BACKENDS else None


def run_frames(chunk: int) -> int:
    """Frames of a run (run_composition): the others join over one chunk of frames, the timed joiner after a second,
    its growing chunks take a third, then the timed window."""
    return 3 * chunk + 1 + TIMED_CHUNKS * chunk


class Pool:
    """What the compositions share: the model (its decoder weights on the device once), the requests the streams
    speak, and the talker / predictor batch decoders by (backend, batch, SMs), built on first use."""

    def __init__(self, model: TtsModel, device, max_batch: int, codec: dict = CODEC, repeats: int = REPEATS):
        """`repeats`: timed calls of each measurement (measure_groups)."""
        self.model, self.device, self.codec, self.repeats = model, torch.device(device), dict(codec), repeats
        self.gpu, self.sm_count = device_identity(self.device)
        model.talker_weights = model.talker_weights.to(self.device)  # every decoder then shares one copy
        model.predictor_weights = model.predictor_weights.to(self.device)
        speaker = model.config.default_speaker
        self.prompts = [build_prompt(model.config, model.encode, model.text, model.talker_weights.embed[0],
                                     f"Stream {b} reads this sentence aloud, at its own pace.", speaker, "auto")
                        for b in range(max_batch)]
        self.samplings = [TtsSampling.from_generation_config(model.generation, seed=b) for b in range(max_batch)]
        self.frames = run_frames(self.codec["chunk"])  # a request's max_frames: none ends by it in a run
        measure_positions = (1 + repeats) * (TALKER_STEPS + WHOLE_FRAMES)  # the talker steps of a measurement
        self.max_seq = max(p.embeds.shape[0] for p in self.prompts) + max(self.frames, measure_positions) + 1
        self._pairs: dict[tuple, tuple] = {}

    def pair(self, backend: str, batch: int, sms: int) -> tuple:
        """(talker, predictor) of `batch` sequences; `sms` is the megakernels' grid (other backends use every SM)."""
        sms = sms if backend == "megakernel" else self.sm_count
        if (backend, batch, sms) not in self._pairs:
            budget = sms if backend == "megakernel" else None
            self._pairs[backend, batch, sms] = make_batch_decoders(self.model, backend, self.max_seq, batch,
                                                                   device=self.device, sms=budget)
        return self._pairs[backend, batch, sms]

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
    from ..build import build_libraries
    from ..cache import BUILDS, cache_root
    from ..gpu import current_device_target
    from ..render import render
    from ..tiling import plan_launch

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

    times = GroupTimes(pool.gpu, sm, **pool.codec)
    budgets = [sm] + [sm - k for k in split_sms(sm, fractions)]
    gen = torch.Generator().manual_seed(0)
    q, size = model.config.num_code_groups, model.codec.codebook_size
    first = torch.randint(0, size, (pool.codec["first_chunk"], q), generator=gen)
    steady = torch.randint(0, size, (pool.codec["left_context"] + pool.codec["chunk"], q), generator=gen)
    model.codec.prepare((first.shape[0], steady.shape[0]))  # the graph lengths a StreamingCodec replays
    for batch in batches:
        progress(f"batch {batch}: timing the codec")
        times.codec_first[key(batch)] = ms(lambda: [model.codec.decode(first) for _ in range(batch)])
        times.codec_steady[key(batch)] = ms(lambda: [model.codec.decode(steady) for _ in range(batch)])
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
    """`batch` streams on `comp`, end to end: (ms a frame of every stream once all are steady, codec work
    included; ms from the last stream's join, its prefill included, to its first chunk's samples on the host).

    The first batch-1 streams join spread over one chunk of frames (as arrivals do, so their chunks fall on
    different frames), the last joins once they are steady; a chunk of its is decoded before the others' chunks of
    the same frame. The timed window starts when it is steady too and lasts TIMED_CHUNKS chunks. A request that
    ends (EOS) is replaced by a new one in its slot. The audio stays on the device, but for the first chunk."""
    cuda = pool.device.type == "cuda"
    if comp.codec_sms and not cuda:
        raise MkportError("a split of the SMs needs a CUDA GPU")
    sms = comp.producer_sms(pool.sm_count)
    talker, predictor = pool.pair(comp.talker, batch, sms)[0], pool.pair(comp.predictor, batch, sms)[1]
    producer = torch.cuda.Stream(priority=-1) if comp.codec_sms else None  # its megakernels go first
    side = torch.cuda.Stream() if comp.codec_sms else None
    chunk, last = pool.codec["chunk"], batch - 1
    joins = {b: b * chunk // last for b in range(last)}
    joins[last] = 2 * chunk if batch > 1 else 0
    start = joins[last] + chunk + 1
    end = start + TIMED_CHUNKS * chunk
    codecs, queued, first_ms, joined_at, window_at = {}, None, None, 0.0, 0.0
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
                    codecs[slot] = StreamingCodec(pool.model.codec, **pool.codec)
            out = frames.step()
            if queued is not None:
                queued.synchronize()  # the last frame's codec work is done: at most one frame of it in flight
            with torch.cuda.stream(side):
                for slot in sorted(out, key=lambda s: s != last):
                    wav = None if out[slot] is None else codecs[slot].push(out[slot])
                    if wav is not None and slot == last and first_ms is None:
                        wav.cpu()
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
              device="cuda", codec: dict = CODEC, repeats: int = REPEATS, runs: int = VALIDATE_RUNS,
              progress=lambda message: None) -> Plan:
    """`mkport plan`: load the model, time its groups (`repeats` calls each), score and choose per batch size, and
    with `check` run every scored composition end to end `runs` times (Plan.validation)."""
    progress("loading the model")
    model = TtsModel.load(folder, device=device)
    if model.config.model_type != "custom_voice":
        raise MkportError(f"plan runs CustomVoice models (a speaker id); this one is '{model.config.model_type}'")
    pool = Pool(model, device, max(batches), codec, repeats)
    if "megakernel" in backends:
        prebuild(pool, batches, fractions, progress)
    times = measure_groups(pool, batches, backends, fractions, progress)
    plan = Plan(str(folder), model_shape(model.talker_spec, model.predictor_spec), times,
                choose(times, batches, enumerate_compositions(times.sm_count, backends, fractions)))
    if check:
        plan.validation = validate(pool, plan.choices, runs, progress)
    return plan
