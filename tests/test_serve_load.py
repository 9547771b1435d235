"""`mkport serve --batched` under load, on CPU (reference backend, tiny random model): each frame runs the smallest
batch size that holds the live streams, so a stream's frames run at other sizes alone than under load, and its
samples stay the same (the reference steps each sequence alone: what the torch path promises); batches past the
largest size take turns, one batch a turn, earliest deadline first; a burst's joins are spread over turns when the
streams playing would otherwise run dry. The megakernel's side of the promise is tests/test_gpu_serve_load.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from pathlib import Path

import pytest
import torch

from mkport.serve.config import ServeConfig
from mkport.serve.scheduler import WARMUP_FRAMES
from mkport.serve.engine import Engine
from mkport.serve.streams import PlaybackClock, SpeechJob, Stream
from mkport.tts.batch import FrameBatch, FrameGroups

REF = "reference"
START_S = 240  # loading and warming the tiny model on a busy 2-core machine

needs_codec = pytest.mark.skipif(importlib.util.find_spec("qwen_tts") is None,
                                 reason="the official Qwen3-TTS code (pip install --no-deps qwen-tts-hf) is needed")

A = SpeechJob("Hello there, how are you?", None, seed=5, max_frames=10)
OTHERS = [SpeechJob(text, None, seed=s, max_frames=f) for s, (text, f) in enumerate(
    [("The weather is fine today.", 7), ("One, two, three.", 12), ("Your order has shipped.", 4),
     ("See you soon.", 9), ("Four more, then done.", 11)])]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from mkport.tts.model import write_random_tts_model

    return write_random_tts_model(tmp_path_factory.mktemp("tiny") / "tiny", "tiny", seed=0)


def serve(engine, jobs: list[SpeechJob], start_s: float = START_S) -> dict[int, list]:
    """The jobs submitted before the engine starts (they join together, in order: job 0 takes slot 0); each job's
    events once all are done or failed, within start_s."""
    events = {i: [] for i in range(len(jobs))}
    for i, job in enumerate(jobs):
        engine.submit(job, events[i].append)
    engine.start()
    deadline = time.monotonic() + start_s
    try:
        while not all(ev and ev[-1][0] in ("done", "error") for ev in events.values()):
            assert engine.error is None and time.monotonic() < deadline, engine.error or "not done in time"
            time.sleep(0.05)
    finally:
        engine.shutdown()
    for i, ev in events.items():
        assert [e[0] for e in ev] == ["audio"] * (len(ev) - 1) + ["done"], (i, ev[-1])
    return events


def serve_then_join(engine, jobs: list[SpeechJob], late: SpeechJob, before_late=lambda events: None):
    """The jobs submitted before the engine starts; once job 0 has ended, before_late(their events) and `late`
    submitted; (the jobs' events, late's events) once late has ended (the engine shut down)."""
    events, joined = [[] for _ in jobs], []
    for job, ev in zip(jobs, events):
        engine.submit(job, ev.append)
    engine.start()
    try:
        deadline = time.monotonic() + START_S
        for waited in (events[0], joined):
            if waited is joined:
                before_late(events)
                engine.submit(late, joined.append)
            while not (waited and waited[-1][0] in ("done", "error")):
                assert engine.error is None and time.monotonic() < deadline, engine.error or "not done in time"
                time.sleep(0.01)
    finally:
        engine.shutdown()
    return events, joined


def chunks(events: list) -> list[bytes]:
    return [e[1] for e in events if e[0] == "audio"]


def engine(folder: Path, streams: int, **kw):
    return Engine(ServeConfig(folder=folder, model_id="tiny", backend="reference", max_streams=streams,
                              max_frames=12, batched=True, **kw))


@needs_codec
def test_a_streams_samples_are_the_same_alone_and_with_other_live_counts(tiny, monkeypatch):
    """Stream A alone (its frames at size 1), with one other (size 2) and with five others (size 8 while six live,
    smaller as they leave): the same bytes each time; --fixed-batch runs every frame at the batch's size (8) and
    gives them too."""
    sizes, real_step = [], FrameBatch.step

    def step(self, *args):
        out = real_step(self, *args)
        sizes.append(self.last_size)
        return out

    monkeypatch.setattr(FrameBatch, "step", step)
    runs = {}
    for live, fixed in ((1, False), (2, False), (6, False), (6, True)):
        sizes.clear()
        runs[live, fixed] = chunks(serve(engine(tiny, 8, sized_batches=not fixed), [A] + OTHERS[: live - 1])[0])
        served = sizes[4 * WARMUP_FRAMES:]  # past the warm-up's: a request at each of sizes 1, 2, 4 and 8
        if fixed:
            assert set(served) == {8}, served
        else:
            assert served[0] == {1: 1, 2: 2, 6: 8}[live] and max(served) == served[0], served
    assert len(runs[1, False]) == A.max_frames
    for key, got in runs.items():
        assert got == runs[1, False], f"{key}: stream A's samples differ from alone"


@needs_codec
def test_a_failed_batch_turn_ends_its_streams_with_a_500_and_the_server_goes_on(tiny, monkeypatch):
    """A frame that raises (injected: any frame of a request asking 5 frames) ends its batch's streams with a 500
    naming the error; the server keeps serving: the next request gets all its audio."""
    real_step = FrameBatch.step

    def step(self, *args):
        if any(r.max_frames == 5 for r in self.requests.values()):
            raise RuntimeError("injected frame failure")
        return real_step(self, *args)

    assert WARMUP_FRAMES != 5
    monkeypatch.setattr(FrameBatch, "step", step)
    (failed,), served = serve_then_join(engine(tiny, 8), [SpeechJob("This one fails.", None, seed=1, max_frames=5)], A)
    kind, error = failed[-1]
    assert kind == "error" and error.status == 500, failed[-1]
    assert str(error) == "internal error: RuntimeError: injected frame failure"
    assert served[-1][0] == "done" and len(chunks(served)) == A.max_frames


@needs_codec
def test_frame_lanes_turns_keep_each_streams_samples_and_run_both_lanes(tiny, monkeypatch):
    """--frame-lanes 2's turns (BatchedScheduler built directly on the reference backend, which the CLI refuses: on the
    CPU a lane's work is done when it is queued, so this checks the turns' order and bookkeeping, not the overlap,
    which tests/test_gpu_serve_load.py runs): two batches of 4; A in slot 0 (lane 0) and B in slot 4 (lane 1) beside
    four others get the bytes each gets alone without lanes; each frame is queued on its batch's lane, and both lanes
    had a frame in flight at once."""
    from mkport.serve.batched import BatchedScheduler
    from mkport.tts.planner import Composition

    queued, real_queue = [], BatchedScheduler._queue_lane

    def queue_lane(self, lane, g):
        real_queue(self, lane, g)
        queued.append((lane.index, g, sum(other.in_flight is not None for other in self._frame_lanes)))

    monkeypatch.setattr(BatchedScheduler, "_queue_lane", queue_lane)
    B = OTHERS[1]
    alone = [chunks(serve(engine(tiny, 8, batch_size=4), [job])[0]) for job in (A, B)]
    lanes = BatchedScheduler(ServeConfig(folder=tiny, model_id="tiny", backend="reference", max_streams=8, max_frames=12,
                                         batched=True, batch_size=4, frame_lanes=2), Composition(REF, REF, 0))
    events = serve(lanes, [A, OTHERS[0], OTHERS[2], OTHERS[3], B, OTHERS[4]])  # in order: B takes slot 4
    assert lanes.frame_lanes() == 2 and len(alone[0]) == A.max_frames and len(alone[1]) == B.max_frames
    assert chunks(events[0]) == alone[0], "A in lane 0 beside five others"
    assert chunks(events[4]) == alone[1], "B in lane 1 beside five others"
    assert {lane for lane, _, _ in queued} == {0, 1} and all(g % 2 == lane for lane, g, _ in queued), queued
    assert max(flying for _, _, flying in queued) == 2, queued

    # a late arrival into a lane whose frame is in flight: that frame is finished before the join (it writes every
    # slot's next input). The turns leave the lane they finished idle for the arrivals, so C is submitted as lane 0
    # finishes a frame, once X (4 frames, slot 4) has left batch 1: C takes slot 4, in lane 1, whose frame (A's, slot
    # 5) is in flight; it gets its bytes alone (without the finish-first rule it does not: checked by removing it)
    C, X = dataclasses.replace(OTHERS[3], seed=7), OTHERS[2]
    alone_c = chunks(serve(engine(tiny, 8, batch_size=4), [C])[0])
    late = BatchedScheduler(ServeConfig(folder=tiny, model_id="tiny", backend="reference", max_streams=8, max_frames=12,
                                        batched=True, batch_size=4, frame_lanes=2), Composition(REF, REF, 0))
    jobs = [OTHERS[1], OTHERS[4], OTHERS[0], OTHERS[3], X, A]  # slots 0-3 (lane 0), X slot 4 and A slot 5 (lane 1)
    events, joined, seen = [[] for _ in jobs], [], []
    real_finish, real_admit = BatchedScheduler._finish_lane, BatchedScheduler._admit

    def finish_lane(self, lane):
        real_finish(self, lane)
        if lane.index == 0 and not seen and events[4] and events[4][-1][0] == "done":
            seen.append("submitted")
            self.submit(C, joined.append)

    def admit(self, stream):
        if stream.job is C:
            seen.append([lane.index for lane in self._frame_lanes if lane.in_flight])
        return real_admit(self, stream)

    monkeypatch.setattr(BatchedScheduler, "_finish_lane", finish_lane)
    monkeypatch.setattr(BatchedScheduler, "_admit", admit)
    for job, ev in zip(jobs, events):
        late.submit(job, ev.append)
    late.start()
    deadline = time.monotonic() + START_S
    try:
        while not all(ev and ev[-1][0] in ("done", "error") for ev in [*events, joined]):
            assert late.error is None and time.monotonic() < deadline, late.error or "not done in time"
            time.sleep(0.01)
    finally:
        late.shutdown()
    assert seen == ["submitted", [1]], seen  # C came while lane 1's frame was in flight, and lane 0 idle
    assert [ev[-1][0] for ev in [*events, joined]] == ["done"] * 7, [ev[-1] for ev in [*events, joined]]
    assert chunks(joined) == alone_c, "C joining lane 1 while its frame was in flight"


@needs_codec
def test_a_frame_lane_alone_on_the_gpu_runs_its_frames_on_every_sm_and_never_beside_another(tiny, monkeypatch):
    """Frame lanes with wide decoders (batched.wide_lanes, the megakernel's; turned on here for the reference
    backend, whose wide decoders are the same arithmetic): A alone in lane 0 runs every frame wide; with B in lane 1
    beside it, frames run on the lanes' own decoders while both lanes hold streams; no frame is queued while another
    lane's wide frame is in flight; both streams get the bytes they get alone."""
    from mkport.serve import batched
    from mkport.serve.batched import BatchedScheduler
    from mkport.tts.planner import Composition

    queued, real_queue = [], BatchedScheduler._queue_lane

    def queue_lane(self, lane, g):
        beside_wide = any(other.in_flight and other.wide for other in self._frame_lanes if other is not lane)
        real_queue(self, lane, g)
        queued.append((lane.index, lane.wide, beside_wide))

    monkeypatch.setattr(batched, "wide_lanes", lambda config, comp: True)
    monkeypatch.setattr(BatchedScheduler, "_queue_lane", queue_lane)
    B = OTHERS[1]
    alone = [chunks(serve(engine(tiny, 8, batch_size=4), [job])[0]) for job in (A, B)]
    make = lambda: BatchedScheduler(ServeConfig(folder=tiny, model_id="tiny", backend="reference",  # noqa: E731
                                                max_streams=8, max_frames=12, batched=True, batch_size=4,
                                                frame_lanes=2), Composition(REF, REF, 0))
    lanes = make()
    assert chunks(serve(lanes, [A])[0]) == alone[0]
    assert queued and all(lane == 0 and wide for lane, wide, _ in queued), queued
    queued.clear()
    events = serve(make(), [A, OTHERS[0], OTHERS[2], OTHERS[3], B])  # in order: B takes slot 4, lane 1
    assert chunks(events[0]) == alone[0] and chunks(events[4]) == alone[1]
    assert not any(beside for _, _, beside in queued), queued
    assert {lane for lane, wide, _ in queued if not wide} == {0, 1}, queued  # both lanes held streams at once
    assert any(wide for _, wide, _ in queued), queued  # one lane left alone once the other's streams ended


@needs_codec
def test_sized_codec_calls_carry_their_streams_rows_and_keep_each_streams_audio(tiny, monkeypatch):
    """The batched server with codec calls sized to their streams (batched.sized_codec, the megakernel default; turned
    on here for the reference backend): stream A with five others has calls of 8, 4, 2 and 1 rows as they join and
    leave, alone calls of 1, and its samples are the same to the codec's float32 rounding (a few 16-bit steps at most:
    the H200 showed up to 4 when calls were first sized, docs/benchmarks.md)."""
    import numpy as np

    from mkport.serve import batched
    from mkport.tts.codec import CodecStreams

    rows, real_decode = [], CodecStreams.decode

    def decode(self, streams, frames):
        rows.append(self.call_rows(len(streams)))
        return real_decode(self, streams, frames)

    monkeypatch.setattr(batched, "sized_codec", lambda config, comp: True)
    monkeypatch.setattr(CodecStreams, "decode", decode)
    alone = np.frombuffer(b"".join(chunks(serve(engine(tiny, 8), [A])[0])), dtype=np.int16)
    assert set(rows[4 * WARMUP_FRAMES:]) == {1}
    rows.clear()
    loaded = np.frombuffer(b"".join(chunks(serve(engine(tiny, 8), [A] + OTHERS)[0])), dtype=np.int16)
    assert {8, 4, 2, 1} <= set(rows[4 * WARMUP_FRAMES:]) <= {1, 2, 4, 8}
    assert alone.shape == loaded.shape and alone.shape[0] == A.max_frames * 1920
    steps = np.abs(alone.astype(np.int32) - loaded)
    assert int(steps.max()) <= 4 and float(steps.mean()) < 0.5, (int(steps.max()), float(steps.mean()))


@needs_codec
def test_batches_past_the_largest_take_turns_one_batch_a_turn(tiny, monkeypatch):
    """Six streams in three batches of two (the megakernel's bound, forced): a turn steps one batch, a newcomer's
    batch first, and every stream gives the bytes it gives alone."""
    import mkport.serve.batched as batched

    monkeypatch.setattr(batched, "batch_groups", lambda config, comp, model: (2, 3))
    stepped, real = [], FrameGroups.step_group
    monkeypatch.setattr(FrameGroups, "step_group", lambda self, g, *a: stepped.append(g) or real(self, g, *a))
    jobs = [A] + OTHERS
    alone = [chunks(serve(engine(tiny, 6), [job])[0]) for job in jobs[:3]]
    stepped.clear()
    together = serve(engine(tiny, 6), jobs)
    served = stepped[3 * 2 * WARMUP_FRAMES:]  # past the warm-up's: three batches, at sizes 1 and 2
    assert served[:3] == [0, 1, 2], served  # the newcomers' batches, one turn each
    assert set(served) == {0, 1, 2} and len(served) >= max(job.max_frames for job in jobs)
    for i, job in enumerate(jobs):
        assert len(chunks(together[i])) == job.max_frames, i
    for i in range(3):
        assert chunks(together[i]) == alone[i], f"stream {i} differs from alone"


def served_log(monkeypatch, engines: list) -> list:
    """What a served engine (the last of `engines`, once ready) does, in order: ("join", slot) as an arrival's prompt
    is prefilled, ("turn",) as a turn begins, ("frame", slots stepped), ("codec", frames a row, rows named)."""
    from mkport.serve.batched import BatchedScheduler
    from mkport.tts.codec import CodecStreams

    log = []
    ready = lambda: engines and engines[-1].ready  # noqa: E731 - the warm-up's are not logged
    real_add, real_step, real_turn, real_decode = FrameBatch.add, FrameBatch.step, BatchedScheduler._turn, \
        CodecStreams.decode

    def add(self, slot, *args):
        if ready():
            log.append(("join", slot))
        return real_add(self, slot, *args)

    def step(self, *args):
        slots = sorted(self.requests)
        out = real_step(self, *args)
        if ready() and slots:
            log.append(("frame", slots))
        return out

    def turn(self):
        log.append(("turn",))
        real_turn(self)

    def decode(self, streams, frames):
        if ready():
            log.append(("codec", frames.shape[1] if frames.dim() == 3 else 1, len(streams)))
        return real_decode(self, streams, frames)

    monkeypatch.setattr(FrameBatch, "add", add)
    monkeypatch.setattr(FrameBatch, "step", step)
    monkeypatch.setattr(BatchedScheduler, "_turn", turn)
    monkeypatch.setattr(CodecStreams, "decode", decode)
    return log


def turns(log: list) -> list[list]:
    """The log cut at each turn (what comes before the next turn: its frames, codec calls, then the joins)."""
    out = []
    for entry in log:
        if entry[0] == "turn":
            out.append([])
        elif out:
            out[-1].append(entry)
    return out


def chunk_frames(events: list) -> list[int]:
    """A stream's chunks in frames (1920 int16 samples a frame)."""
    return [len(chunk) // (1920 * 2) for chunk in chunks(events)]


def schedule(frames: int, per_turn: int) -> list[int]:
    from mkport.tts.codec import turn_chunk

    sizes = []
    while sum(sizes) < frames:
        sizes.append(min(turn_chunk(sum(sizes), per_turn), frames - sum(sizes)))
    return sizes


LATE = SpeechJob("And one more thing.", None, seed=9, max_frames=12)


def serve_with_late(engines: list, folder: Path, jobs: list[SpeechJob], late: SpeechJob | None,
                    **kw) -> dict[int, list]:
    """serve() on a batched engine of 8 slots (appended to `engines`), and `late`, if given, submitted when job 0's
    second chunk is posted: it joins a later turn, beside streams that are playing (its events last)."""
    events = {i: [] for i in range(len(jobs) + (late is not None))}
    sched = engine(folder, 8, **kw)
    engines.append(sched)

    def post_first(event):
        events[0].append(event)
        if late is not None and len(events[0]) == 2:
            sched.submit(late, events[len(jobs)].append)

    sched.submit(jobs[0], post_first)
    for i, job in enumerate(jobs[1:], 1):
        sched.submit(job, events[i].append)
    sched.start()
    deadline = time.monotonic() + START_S
    try:
        while not all(ev and ev[-1][0] in ("done", "error") for ev in events.values()):
            assert sched.error is None and time.monotonic() < deadline, sched.error or "not done in time"
            time.sleep(0.05)
    finally:
        sched.shutdown()
    for i, ev in events.items():
        assert [e[0] for e in ev] == ["audio"] * (len(ev) - 1) + ["done"], (i, ev[-1])
        assert ev[-1][1]["frames"] == sum(chunk_frames(ev)), i
    return events


@needs_codec
def test_with_turns_of_n_frames_a_streams_samples_are_the_same_alone_and_under_load(tiny, monkeypatch):
    """--frames-per-turn 4: stream A alone, and with five others and one more arriving after A's second chunk: A's
    bytes the same (its calls the same lengths in the same order, it in the first row of
    each, as for N = 1); every stream's chunks 1, 3, 4, ... frames of its own count, its last cut short (padded to 4
    in its call); a turn four frames of its batch and at most three codec calls (the newcomers' first frames, the
    rest by length); the late arrival joins between turns."""
    engines = []
    log = served_log(monkeypatch, engines)
    alone = serve_with_late(engines, tiny, [A], None, frames_per_turn=4)[0]
    del log[:]
    loaded = serve_with_late(engines, tiny, [A] + OTHERS, LATE, frames_per_turn=4)
    # seeded, N chosen by load (1 alone): 958 of A's 19,200 samples differ by 1-3 steps
    assert b"".join(chunks(loaded[0])) == b"".join(chunks(alone)), "stream A's samples differ from alone"
    assert chunk_frames(alone) == chunk_frames(loaded[0]) == [1, 3, 4, 2] == schedule(A.max_frames, 4)
    for i, job in enumerate([A] + OTHERS + [LATE]):
        assert chunk_frames(loaded[i]) == schedule(job.max_frames, 4), i
    cut = turns(log)
    assert all(len([e for e in turn if e[0] == "frame"]) <= 4 for turn in cut)
    assert all(len([e for e in turn if e[0] == "codec"]) <= 3 for turn in cut)
    assert {e[1] for turn in cut for e in turn if e[0] == "codec"} == {1, 3, 4}
    # the late arrival (slot 3, freed by the 4-frame stream in the first turn) joins between turns: the last thing
    # of a turn, its first frame the next turn's first, decoded alone right after it
    late_join, (_, slot) = next((k, e) for k, turn in enumerate(cut) for e in turn if e[0] == "join")
    assert cut[late_join][-1] == ("join", slot)
    assert slot in cut[late_join + 1][0][1] and cut[late_join + 1][1] == ("codec", 1, 1), cut[late_join + 1]


@needs_codec
def test_one_frame_a_turn_is_a_codec_call_a_frame_as_before(tiny, monkeypatch):
    """--frames-per-turn 1 (the default): every turn one frame of its batch, then one codec call of one frame a row
    for every stream that made one, a newcomer's first frame and the others' together (the server before turns of N
    frames)."""
    engines = []
    log = served_log(monkeypatch, engines)
    jobs = [A] + OTHERS[:2]
    events = serve_with_late(engines, tiny, jobs, LATE)
    for i, job in enumerate(jobs + [LATE]):
        assert chunk_frames(events[i]) == [1] * job.max_frames, i
    cut = turns(log)
    assert any(("join", 3) in turn for turn in cut)  # the late arrival, beside streams playing
    for turn in cut:
        frames = [e for e in turn if e[0] != "join"]
        assert frames[0][0] == "frame" and frames[1:] == [("codec", 1, len(frames[0][1]))], turn


def test_batch_size_caps_a_batch_and_the_rest_take_turns():
    """--batch-size B: batches of at most B (the megakernel's sizes; on the reference backend --max-streams rows
    otherwise), more streams in batches of B taking turns."""
    from mkport.errors import MkportError
    from mkport.serve.batched import batch_size

    def config(backend, streams, size=None):
        return ServeConfig(folder=Path("."), model_id="m", backend=backend, max_streams=streams, batched=True,
                           batch_size=size)

    assert batch_size(config("megakernel", 160)) == 32 and batch_size(config("megakernel", 160, 8)) == 8
    assert batch_size(config("megakernel", 3, 8)) == 4  # never more than the streams need
    assert batch_size(config("reference", 6)) == 6 and batch_size(config("reference", 6, 2)) == 2
    assert batch_size(config("megakernel", 160, 24)) == 24  # 24: only when asked (launch_plan.BATCH_SIZES)
    with pytest.raises(MkportError, match=r"^--batch-size 12: one of 1, 2, 4, 8, 16, 24, 32$"):
        batch_size(config("megakernel", 160, 12))


@needs_codec
def test_streams_past_the_batch_size_take_turns_in_batches_of_it(tiny, monkeypatch):
    """A reference server of 4 streams in batches of 2 (--batch-size 2): two batches, and four requests at once all
    complete with all their frames' audio."""
    layouts, real_init = [], FrameGroups.__init__

    def init(self, *args, **kw):
        real_init(self, *args, **kw)
        layouts.append((self.size, len(self.groups)))

    monkeypatch.setattr(FrameGroups, "__init__", init)
    jobs = [A] + OTHERS[:3]
    events = serve(engine(tiny, 4, batch_size=2), jobs)
    assert layouts == [(2, 2)]
    assert [len(chunks(events[i])) for i in range(4)] == [job.max_frames for job in jobs]


def test_frames_per_turn_out_of_range_is_refused_in_one_line():
    from mkport.errors import MkportError

    for n, words in ((0, "--frames-per-turn 0: 1 to 8"), (9, "--frames-per-turn 9: 1 to 8")):
        with pytest.raises(MkportError, match=words) as e:
            Engine(ServeConfig(folder=None, model_id="m", backend="reference", batched=True, frames_per_turn=n))
        assert "\n" not in str(e.value)
    with pytest.raises(MkportError, match="--frames-per-turn makes the turns of --batched: give both, or neither"):
        Engine(ServeConfig(folder=None, model_id="m", backend="reference", frames_per_turn=4))


class FakeGroup:
    """A batch's slots as _admit uses them (its prefill takes no time)."""

    def __init__(self, size: int):
        self.size, self.added = size, []

    def free_slots(self):
        return [s for s in range(self.size) if s not in self.added]

    def add(self, slot, *args):
        self.added.append(slot)

    def take(self, slot, *args):
        self.added.append(slot)
        return torch.zeros(2, 4)

    @property
    def requests(self):
        return {s: None for s in self.added}


def scheduler_with_playing(in_hand_s: float, join_s: float, turn_s: float):
    """A batched scheduler (not loaded) of one batch of 8 with one stream playing that has `in_hand_s` of audio."""
    from mkport.serve.batched import BatchedScheduler
    from mkport.tts.planner import Composition

    sched = BatchedScheduler(ServeConfig(folder=None, model_id="m", backend="reference", max_streams=8, batched=True),
                             Composition("reference", "reference"))
    group = FakeGroup(8)
    sched._batch = FrameGroups.__new__(FrameGroups)
    sched._batch.groups, sched._batch.size, sched._batch.batch = [group], 8, 8
    sched._codecs = [type("Codec", (), {"reset": lambda self, slot: None})()]
    sched._batch.groups[0].talker = type("Talker", (), {"max_seq": 64})()
    playing = new_stream()
    playing.slot, playing.first_made_at, playing.first_audio_at = 0, 0.0, 0.0
    group.added.append(0)
    now = time.perf_counter()
    playing.clock.ends_at = now + in_hand_s
    sched._active = [playing]
    sched._join_s, sched._turn_s = join_s, turn_s
    return sched


def new_stream() -> Stream:
    stream = Stream(SpeechJob("x", None), PlaybackClock(), lambda event: None, 60.0)
    stream.prepare = lambda model, max_seq: ()
    return stream


def test_a_bursts_joins_wait_for_a_later_turn_when_a_playing_stream_would_run_dry():
    """A stream playing with 45 ms in hand, joins of 30 ms and turns of 10 ms: the first arrival joins (one a turn
    always does), the second would leave the playing stream 45 - 10 - 2 x 30 < 0 ms: it waits for the next turn;
    with 2 s in hand all join; with nothing playing all join."""
    sched = scheduler_with_playing(0.045, 0.030, 0.010)
    burst = [new_stream() for _ in range(3)]
    assert [sched._admit(s) for s in burst] == [True, False, False]
    assert burst[0].slot == 1 and sched._active[-1] is burst[0]
    sched._joins = 0  # the next turn
    assert sched._admit(burst[1]) is True and burst[1].slot == 2
    sched = scheduler_with_playing(2.0, 0.030, 0.010)
    assert all(sched._admit(new_stream()) for _ in range(5))
    sched = scheduler_with_playing(0.0, 0.030, 0.010)
    sched._active[0].first_audio_at = sched._active[0].first_made_at = None  # not playing yet: no listener to run dry
    assert all(sched._admit(new_stream()) for _ in range(5))
    assert [s.slot for s in sched._active[1:]] == [1, 2, 3, 4, 5]  # the lowest free slots: batches stay small


class DeviceTimer:
    """WorkTimer as on a GPU: the host queues a join at once, its span reads `join_s` of device time."""

    def __init__(self, join_s: float):
        self.join_s, self.marks = join_s, 0

    def mark(self):
        self.marks += 1
        return self.marks

    def seconds(self, start, end):
        return self.join_s


def test_a_join_is_budgeted_at_its_device_time_not_the_time_to_queue_it():
    """On a GPU a prefill is queued in a fraction of the time it runs: the budget of a burst's joins takes their
    device time (30 ms here, queued in ~0), read the turn after. With a playing stream's 45 ms in hand and 10 ms
    turns, the next turn then joins one arrival more, not the whole burst (the 32-stream burst's underruns)."""
    sched = scheduler_with_playing(0.045, 0.0, 0.010)
    sched._timer = DeviceTimer(0.030)
    burst = [new_stream() for _ in range(4)]
    assert sched._admit(burst[0])  # the first of a turn always joins
    sched._joins = 0  # the next turn, which reads the spans of the joins before it
    sched._read_spans()
    assert sched._join_s == pytest.approx(0.030)
    assert [sched._admit(s) for s in burst[1:]] == [True, False, False]  # 45 - 10 - 2 x 30 < 0 ms


def two_batches(in_hand_s: float, turn_s: float, waited_s: float = 0.0):
    """A batched scheduler of two batches of 2: batch 0 holds a stream playing with `in_hand_s` of audio, batch 1 a
    newcomer that arrived `waited_s` ago; turns of `turn_s`."""
    sched = scheduler_with_playing(in_hand_s, 0.0, turn_s)
    sched._batch.groups = [FakeGroup(2), FakeGroup(2)]
    sched._batch.size, sched._batch.batch = 2, 4
    sched._batch.groups[0].added.append(0)
    newcomer = new_stream()
    newcomer.slot, newcomer.arrival = 2, time.perf_counter() - waited_s
    sched._batch.groups[1].added.append(0)
    sched._active.append(newcomer)
    return sched


def test_a_newcomers_batch_goes_first_unless_a_playing_batch_would_run_dry_behind_it():
    """Earliest deadline first by batch puts a newcomer (due at its arrival) first; with 50 ms in hand and 30 ms
    turns the playing batch would run dry behind the newcomer's turn and its own (60 ms): it goes first. With 2 s
    in hand, or once the newcomer has waited about a round of turns, the newcomer's batch goes first."""
    assert two_batches(0.050, 0.030)._next_group() == 0
    assert two_batches(2.0, 0.030)._next_group() == 1
    assert two_batches(0.050, 0.030, waited_s=0.2)._next_group() == 1
    # ran dry 10 ms ago, after the newcomer arrived (20 ms ago): earliest deadline first, nothing left to save
    assert two_batches(-0.010, 0.030, waited_s=0.020)._next_group() == 1
    assert two_batches(-0.030, 0.030, waited_s=0.020)._next_group() == 0  # ran dry before the newcomer arrived


def test_a_stream_whose_first_frame_is_decoded_is_no_longer_due_at_its_arrival():
    """A newcomer whose first chunk is made (its codec work queued, the chunk not left yet) is due when that audio
    would end, not at its arrival: its batch does not keep going first while it waits for the codec. (Seen on an H100
    in the 64-stream ramp: newcomers arriving every ~31 ms into one batch kept it first for 217 ms while a stream of
    the other batch of its lane, with 160 ms in hand, ran dry 68 ms; the debug log's underrun line.) Still a
    newcomer, its batch goes first (above)."""
    sched = two_batches(0.050, 0.030, waited_s=0.2)
    newcomer = sched._active[1]
    assert sched._next_group() == 1
    newcomer.first_made_at, newcomer.made_s = time.perf_counter(), 0.08  # its first frame decoded, 80 ms of audio
    assert newcomer.deadline() == pytest.approx(newcomer.first_made_at + 0.08)
    assert sched._next_group() == 0  # the playing stream (50 ms in hand) first
    sched = two_batches(0.200, 0.030)
    assert sched._next_group() == 1
    sched._active[1].first_made_at, sched._active[1].made_s = time.perf_counter(), 0.08
    assert sched._next_group() == 1  # 80 ms in hand against 200: earliest deadline first


def test_newcomers_arriving_turn_after_turn_do_not_starve_the_other_batch(monkeypatch):
    """The 64-stream ramp's pattern, simulated on a fake clock: two batches taking turns of 12 ms, batch 0 with a
    stream that has 160 ms in hand, a newcomer into batch 1 every 31 ms, whose first chunk leaves two turns after its
    frame (its codec call beside the next frame, then the host's poll). Every stream gets 80 ms of audio a frame of
    its batch. No stream runs dry and every newcomer's first frame is made by the turn after its arrival. (Before a
    newcomer stopped being due at its arrival once its first frame was decoded, batch 1 went first turn after turn
    and batch 0's stream ran dry at 252 and 504 ms: checked.)"""
    turn, now = 0.012, [1000.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    sched = two_batches(0.160, turn)
    sched._batch.groups = [FakeGroup(16), FakeGroup(16)]
    sched._batch.size, sched._batch.batch = 16, 32
    sched._batch.groups[0].added.append(0)
    sched._active = sched._active[:1]  # the playing stream, slot 0
    posts, dry, waits, arrivals = [], [], [], 0
    while now[0] < 1000.6:
        if now[0] >= 1000.0 + 0.031 * arrivals and arrivals < 16:
            newcomer = new_stream()
            newcomer.slot = 16 + arrivals
            sched._batch.groups[1].added.append(arrivals)
            sched._active.append(newcomer)
            arrivals += 1
        g = sched._next_group()
        end = now[0] + turn
        for s in [s for s in sched._active if s.slot // 16 == g]:
            if s.first_made_at is None:  # its first frame
                waits.append(end - s.arrival)
                s.first_made_at, s.made_s = end, 0.08
                posts.append((end + 2 * turn, s))  # its chunk leaves once its codec call is done
            elif s.first_audio_at is None:
                s.made_s += 0.08
            else:
                if s.clock.play(0.08, end):
                    dry.append((round(end - 1000.0, 3), s.slot))
        for t, s in [p for p in posts if p[0] <= end]:
            posts.remove((t, s))
            s.first_audio_at = t
            s.clock.play(s.made_s, t)
        now[0] = end
    assert arrivals == 16 and len(waits) == 16
    assert not dry, dry
    assert max(waits) <= 2 * turn + 1e-9, waits


@needs_codec
def test_the_debug_log_gives_each_streams_path_to_first_audio(tiny, caplog):
    """At debug level (`mkport serve --log-level debug`) each stream that ends logs when the scheduler took it, when
    its prompt was built, when its join returned and when its first audio left, in ms after its arrival, in that
    order (sent: '-', no HTTP response here; test_serve.py has one)."""
    import logging
    import re

    with caplog.at_level(logging.DEBUG, logger="mkport.serve"):
        serve(engine(tiny, 4), [A, OTHERS[0]])
    lines = [m for m in caplog.messages if m.startswith("stream completed")]
    assert len(lines) == 2, caplog.messages
    for line in lines:
        found = re.search(r"slot (\d): admitted ([\d.]+) ms after arrival, prompt ([\d.]+), joined ([\d.]+), "
                          r"first audio ([\d.]+), sent -$", line)
        assert found, line
        admitted, prompt, joined, first = map(float, found.groups()[1:])
        assert 0 <= admitted <= prompt <= joined <= first, line


@needs_codec
def test_the_debug_log_says_what_the_scheduler_ran_while_a_stream_ran_dry(tiny, monkeypatch, caplog):
    """At debug level an underrun is logged as it happens: the stream's slot and frames, how long it was dry, and the
    scheduler's events since its chunk before (here a frame made slow on purpose, its 4th: its 3 frames of audio,
    240 ms, ran out while the frame took 600 ms)."""
    import logging
    import re

    finish = FrameBatch.finish_frame

    def slow_fourth(self, queued):
        if any(r.frame == 3 for r in self.requests.values()):
            time.sleep(0.6)
        return finish(self, queued)

    monkeypatch.setattr(FrameBatch, "finish_frame", slow_fourth)
    with caplog.at_level(logging.DEBUG, logger="mkport.serve"):
        serve(engine(tiny, 4), [A])
    lines = [m for m in caplog.messages if m.startswith("underrun")]
    assert len(lines) == 1, caplog.messages
    found = re.search(r"^underrun: slot 0 \(batch 0\) after ([\d.]+) s of audio, dry ([\d.]+) ms, its last chunk "
                      r"([\d.]+) ms before; since: (.*)$", lines[0])
    assert found, lines[0]
    audio, dry, since, events = float(found[1]), float(found[2]), float(found[3]), found[4]
    assert audio == 0.24 and 300 <= dry < since, lines[0]
    assert re.search(r"\+[\d.]+ turn: batch 0", events), events


def prompts_together(monkeypatch, fail: list | None = None) -> list[int]:
    """The reference backend's batches made to take a turn's joins together (the megakernel's Decoder.prefill_prompts
    on a GPU; here each prompt prefilled alone into its slot, so each stream's bytes are its bytes alone if the
    scheduler takes, prefills and steps the slots right): the prompt count of each prefill, once served (the warm-up's
    graphs are a GPU's); with `fail`, each prefill pops its outcome first (an exception is raised)."""
    from mkport.runtime.torch_decoder import DecoderBatch
    from mkport.serve import batched

    calls = []

    def prefill_prompts(self, prompts):
        outcome = fail.pop(0) if fail else None
        if outcome is not None:
            raise outcome
        calls.append(len(prompts))
        return torch.cat([d.prefill_slot(slot, embeds=rows) for d, slot, rows in prompts])

    monkeypatch.setattr(batched.Decoder, "prompts_together", staticmethod(lambda decoders: True))
    monkeypatch.setattr(batched.BatchedScheduler, "_warm_together", staticmethod(lambda talker, lane: None))
    monkeypatch.setattr(DecoderBatch, "prefill_prompts", prefill_prompts, raising=False)
    return calls


@needs_codec
def test_a_turns_joins_prefill_their_prompts_together_and_each_stream_keeps_its_samples(tiny, monkeypatch):
    """With --joins-together, six arrivals of one turn join in one prefill of their six prompts (none playing yet:
    none waits), and stream A among them gets the bytes it gets alone prefilled by itself; not given, they are
    prefilled together where that runs and alone elsewhere (--fixed-batch, --batch-invariant); --joins-alone prefills
    each alone; --joins-together given with --fixed-batch, --batch-invariant or by turns is refused in one line (a
    prompt's rows in company may round otherwise than alone)."""
    alone = chunks(serve(engine(tiny, 8), [A])[0])
    calls = prompts_together(monkeypatch)
    together = serve(engine(tiny, 8, joins_together=True), [A] + OTHERS)
    assert calls == [6], calls
    assert chunks(together[0]) == alone and len(alone) == A.max_frames
    calls.clear()
    serve(engine(tiny, 8), [A] + OTHERS[:2])  # not given: together where it runs, the made-to-take backend here
    assert calls == [3], calls
    calls.clear()
    serve(engine(tiny, 8, joins_together=False), [A] + OTHERS[:2])
    serve(engine(tiny, 8, sized_batches=False), [A] + OTHERS[:2])  # not given, where it does not run: alone
    serve(engine(tiny, 8, batch_invariant=True), [A] + OTHERS[:2])
    assert calls == [], calls
    from mkport.errors import MkportError

    for kw, words in ((dict(sized_batches=False), "--fixed-batch"), (dict(batch_invariant=True), "--batch-invariant"),
                      (dict(batched=False), "--by-turns")):
        with pytest.raises(MkportError, match=f"^--joins-together prefills the joins of --batched .*{words}") as e:
            Engine(ServeConfig(folder=tiny, model_id="tiny", backend="reference", joins_together=True,
                               **{"batched": True, **kw}))
        assert "\n" not in str(e.value)


@needs_codec
def test_a_failed_prefill_together_ends_its_streams_with_a_500_and_the_server_goes_on(tiny, monkeypatch):
    """A prefill of joins together that raises (injected: the first) ends its streams with a 500 naming the error;
    the next arrival joins in a prefill of its own and gets all its audio."""
    fail = [RuntimeError("injected prefill failure")]
    calls = prompts_together(monkeypatch, fail)
    (failed,), served = serve_then_join(engine(tiny, 8, joins_together=True), [OTHERS[0]], A)
    kind, error = failed[-1]
    assert kind == "error" and error.status == 500 and str(error) == "internal error: RuntimeError: injected prefill failure"
    assert calls == [1] and served[-1][0] == "done" and len(chunks(served)) == A.max_frames


def test_prompts_together_take_up_to_32_prompts_and_1024_rows_a_prefill():
    from mkport.serve.batched import JOINS_TOGETHER, TOGETHER_ROWS, prefill_counts

    assert (JOINS_TOGETHER, TOGETHER_ROWS) == (32, 1024)
    assert prefill_counts([20] * 40) == [32, 8]
    assert prefill_counts([600, 600, 100]) == [1, 2]
    assert prefill_counts([2000, 10]) == [1, 1]  # a longer prompt alone
    assert prefill_counts([]) == []


def test_joins_prefilled_together_are_budgeted_as_one_prefill():
    """With 45 ms in hand, joins of 30 ms and turns of 10 ms, a burst's arrivals prefilled together all join in one
    turn (one prefill, 30 ms, fits 45 - 10 ms), where prefilled one each only the first does; their prompts are
    taken (slots held) and left for the turn's prefill together."""
    sched = scheduler_with_playing(0.045, 0.030, 0.010)
    sched._together = True
    burst = [new_stream() for _ in range(5)]
    assert all(sched._admit(s) for s in burst)
    assert [s.slot for s in burst] == [1, 2, 3, 4, 5] and [j[2] for j in sched._joining] == burst
    assert sched._joins_cost(32) == pytest.approx(0.030) and sched._joins_cost(33) == pytest.approx(0.060)
    sched._together = False
    assert sched._joins_cost(3) == pytest.approx(0.090)
