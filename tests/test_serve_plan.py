"""`mkport serve --plan` and `mkport bench-tts --plan`: a plan file written for a model on this machine's device
picks backends per batch size; the server's engine runs the pick for its batch size (on CPU, graphs and the
reference backend stand in for the GPU's backends) and bench-tts the pick for one request; a plan that does not
fit the model, the device or the batch, or that they cannot run, is refused in one line naming the file. A split
(the codec beside the megakernels) posts each chunk once its codec work is done, a turn after it was decoded: on CPU
through a lane whose work completes a turn later, on the GPU for real."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from mkport.errors import MkportError
from mkport.tts.planner import Choice, Composition, Estimate, GroupTimes, Plan, model_shape, write_plan
from mkport.serve.config import ServeConfig
from mkport.serve.engine import Engine
from mkport.serve.streams import CodecLane, SpeechJob
from mkport.tts.compose import device_identity

MK, GR, REF = "megakernel", "graphs", "reference"
TINY_SHAPE = "talker 2 layers x 256, code predictor 1 layers x 128"
PICKS = {1: Composition(REF, REF), 2: Composition(GR, REF), 4: None}  # none is real time at 4
START_S = 240  # loading and warming the tiny model on a busy 2-core machine

needs_codec = pytest.mark.skipif(importlib.util.find_spec("qwen_tts") is None,
                                 reason="the official Qwen3-TTS code (pip install --no-deps qwen-tts-hf) is needed")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from mkport.tts.model import write_random_tts_model

    return write_random_tts_model(tmp_path_factory.mktemp("tiny") / "tiny", "tiny", seed=0)


def write(path: Path, picks: dict, shape: str = TINY_SHAPE, device: tuple | None = None) -> Path:
    """A plan file for a model of `shape` made on `device` ((name, SMs); this machine's by default) with `picks`
    by batch size. Its times and estimates are placeholders: what is served reads the picks alone."""
    times = GroupTimes(*(device or device_identity()))
    estimate = Estimate(frame_ms=10.0, first_chunk_ms=50.0, producer_ms=8.0, codec_ms=2.0)
    choices = [Choice(batch, pick, [(pick, estimate)] if pick else []) for batch, pick in picks.items()]
    write_plan(Plan("somewhere/tiny", shape, times, choices), path)
    return path


def config(folder: Path, plan: Path, batched: bool, streams: int = 2) -> ServeConfig:
    return ServeConfig(folder=folder, model_id="tiny", max_streams=streams, max_frames=4, batched=batched, plan=plan)


def test_the_server_takes_the_pick_for_its_batch_size(tiny, tmp_path):
    plan = write(tmp_path / "plan.json", PICKS)
    alone = Engine(config(tiny, plan, batched=False))  # a decoder pair a stream: batch 1
    assert alone.composition == Composition(REF, REF) and alone.backend == REF
    batched = Engine(config(tiny, plan, batched=True))  # a batch of --max-streams 2
    assert batched.composition == Composition(GR, REF) and batched.backend == "graphs+reference"


REFUSED = {
    "missing": (None, True, 2, "plan file not found"),
    "malformed": ("{not json", True, 2, "not a plan file (not valid JSON"),
    "other_model": (dict(shape="talker 28 layers x 2048, code predictor 5 layers x 1024"), True, 2,
                    "made for a model of talker 28 layers x 2048"),
    "other_device": (dict(device=("another GPU", 7)), True, 2, "made on another GPU (7 SMs), not on this"),
    "no_pick": ({}, True, 3, "no composition is real time at batch 4"),  # 3 streams: the megakernel's batch 4
    "batch_not_planned": ({}, True, 5, "the plan has no batch 8; it has 1, 2, 4"),
    "split_without_cuda": (dict(picks={2: Composition(MK, MK, 1)}), True, 2,
                           "its pick at batch 2, mk+mk split 1, runs the codec beside the megakernels on SMs of its "
                           "own, which needs a CUDA GPU"),
    "split_unbatched": (dict(picks={1: Composition(MK, MK, 1)}), False, 2,
                        "its pick at batch 1, mk+mk split 1, runs the codec beside the megakernels; without --batched"),
    "batch_decoders_unbatched": (dict(picks={1: Composition(GR, GR)}), False, 2,
                                 "its pick at batch 1, graphs+graphs serial, runs batch decoders; without --batched"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_plan_the_server_cannot_use_is_refused_in_one_line(tiny, tmp_path, case, monkeypatch):
    content, batched, streams, words = REFUSED[case]
    if case == "split_without_cuda":  # a machine without CUDA (the plan made there too)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "plan.json"
    if isinstance(content, str):
        path.write_text(content)
    elif isinstance(content, dict):
        write(path, **{"picks": PICKS, **content})
    with pytest.raises(MkportError) as e:
        Engine(config(tiny, path, batched, streams))
    message = str(e.value)
    assert words in message and str(path) in message and "\n" not in message, message


def test_serve_takes_backend_or_plan_not_both(tmp_path):
    from typer.testing import CliRunner

    from mkport.cli import app

    result = CliRunner().invoke(app, ["serve", "--random-weights", "tiny", "--backend", "reference", "--plan",
                                      str(tmp_path / "plan.json")])
    assert isinstance(result.exception, MkportError)
    assert str(result.exception) == "give --backend or --plan, not both: the plan names the backends"


def test_codec_sms_asks_a_split_without_a_plan_where_one_can_run(tmp_path, monkeypatch):
    """--codec-sms K is `mk+mk split K` without a plan file: batched, on the megakernel, on a CUDA GPU with more than
    K SMs; anything else is one line saying what is missing (the CUDA GPU is stood in for here; the served split runs
    in the GPU test below)."""
    import mkport.serve.engine as engine_module
    from mkport.serve.engine import split_sms_asked

    def asked(k, **kw):
        return split_sms_asked(ServeConfig(folder=tmp_path, model_id="m", **{"batched": True, **kw, "codec_sms": k}))

    assert asked(0) == 0 and asked(0, batched=False, backend=REF) == 0  # not asked: serial, whatever else
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MkportError, match=r"^--codec-sms 16 runs the codec beside the megakernels on SMs of its own, "
                                          r"which needs a CUDA GPU$"):
        asked(16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_module, "device_identity", lambda device=None: ("NVIDIA H200", 132))
    assert asked(16) == 16 and Composition(MK, MK, asked(16)).label == "mk+mk split 16"
    assert Composition(MK, MK, asked(16)).producer_sms(132) == 116
    for k, words in [(132, "--codec-sms 132: the codec's SMs must be 1 to 131 (this GPU has 132"),
                     (16, "--codec-sms 16 and --plan: a plan picks its own split"),
                     (8, "--codec-sms 8 runs the codec beside the batch decoders of --batched"),
                     (4, "--codec-sms 4 splits the SMs between the megakernels (their grid) and the codec; the "
                         "reference backend has no grid")]:
        kw = {16: dict(plan=tmp_path / "plan.json"), 8: dict(batched=False), 4: dict(backend=REF)}.get(k, {})
        with pytest.raises(MkportError) as e:
            asked(k, **kw)
        assert str(e.value).startswith(words), str(e.value)


def test_frame_lanes_are_asked_where_batches_can_run_side_by_side(tmp_path, monkeypatch):
    """--frame-lanes L: batched, on the megakernel without a plan, no --codec-sms, one frame a turn, a CUDA GPU; each
    miss is one line naming it; not given, two where they run with sized frames, else one (the GPU is stood in for
    here; served lanes run in tests/test_gpu_serve_load.py)."""
    from mkport.serve.engine import frame_lanes_asked

    def asked(lanes, **kw):
        return frame_lanes_asked(ServeConfig(folder=tmp_path, model_id="m", **{"batched": True, **kw,
                                                                                "frame_lanes": lanes}))

    assert asked(1) == 1 and asked(1, batched=False, backend=REF) == 1  # one lane, whatever else
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MkportError, match=r"^--frame-lanes 2 runs each lane on a CUDA stream and SMs of its own, "
                                          r"which needs a CUDA GPU$"):
        asked(2)
    assert asked(None) == 1  # not given, no GPU: one lane
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert asked(2) == 2
    # not given: two where lanes run with sized frames (a lane alone on every SM), one wherever they cannot
    assert asked(None) == 2
    for kw in [dict(batched=False), dict(backend=REF), dict(plan=tmp_path / "plan.json"), dict(codec_sms=16),
               dict(frames_per_turn=4), dict(sized_batches=False), dict(batch_invariant=True)]:
        assert asked(None, **kw) == 1, kw
    for lanes, kw, words in [(0, {}, "--frame-lanes 0: 1 to 2"), (3, {}, "--frame-lanes 3: 1 to 2"),
                             (2, dict(batched=False), "--frame-lanes 2 runs the frames of --batched's batches"),
                             (2, dict(backend=REF), "--frame-lanes 2 gives each lane's megakernels a share of the SMs"),
                             (2, dict(plan=tmp_path / "plan.json"), "--frame-lanes 2 gives each lane's megakernels"),
                             (2, dict(codec_sms=16), "--frame-lanes 2 and --codec-sms: each lane runs its codec"),
                             (2, dict(frames_per_turn=4), "--frame-lanes 2 makes one frame a lane's turn")]:
        with pytest.raises(MkportError) as e:
            asked(lanes, **kw)
        assert str(e.value).startswith(words), str(e.value)


def _serve_one(engine: Engine, plan: Path) -> tuple[dict, tuple]:
    """The engine in its app: /ready once warm, and one request's PCM. Returns /ready's answer and the batch's
    (talker, predictor), seen as the engine loaded them (its shutdown frees them)."""
    from fastapi.testclient import TestClient

    from mkport.serve.app import create_app

    built, load = [], engine._load

    def load_and_look():
        load()
        built.extend([engine._batch.talker, engine._batch.predictor])

    engine._load = load_and_look
    with TestClient(create_app(engine)) as client:
        deadline = time.monotonic() + START_S
        while client.get("/ready").status_code != 200:
            assert engine.error is None and time.monotonic() < deadline, engine.error or "not ready in time"
            time.sleep(0.2)
        ready = client.get("/ready").json()
        assert ready["plan"] == str(plan) and ready["composition"] == engine.composition.label
        r = client.post("/v1/audio/speech", json={"input": "Hello there.", "max_frames": 4, "response_format": "pcm"})
        assert r.status_code == 200, r.text
        assert len(r.content) > 0 and len(r.content) % (2 * 1920) == 0  # whole 80 ms frames of int16
    return ready, tuple(built)


@needs_codec
def test_the_served_batch_runs_on_the_backends_the_plan_names(tiny, tmp_path):
    from mkport.runtime.graph_decoder import GraphDecoder
    from mkport.runtime.torch_decoder import DecoderBatch

    plan = write(tmp_path / "plan.json", PICKS)
    ready, (talker, predictor) = _serve_one(Engine(config(tiny, plan, batched=True)), plan)
    assert ready["composition"] == "graphs+ref serial" and ready["backend"] == "graphs+reference"
    assert isinstance(talker, GraphDecoder) and talker.batch == 2
    assert isinstance(predictor, DecoderBatch) and predictor.batch == 2


@needs_codec
def test_bench_tts_times_the_pick_for_one_request(tiny, tmp_path):
    from mkport.tts.bench_tts import run_tts_bench

    # without the plan, mkport's default backend (the megakernel) would be timed, and no CPU runs it
    result = run_tts_bench(tiny, "Hi there", frames=4, engines=("mkport",), device="cpu",
                           plan=write(tmp_path / "plan.json", PICKS))
    (mk,) = result["results"]
    assert "error" not in mk and mk["backend"] == REF and mk["frames"] == 4
    assert result["composition"] == "ref+ref serial" and result["plan"] == str(tmp_path / "plan.json")
    path = write(tmp_path / "graphs.json", {1: Composition(GR, GR)})
    with pytest.raises(MkportError, match=r"graphs.json: its pick at batch 1, graphs\+graphs serial, is not what "
                                          "bench-tts runs"):
        run_tts_bench(tiny, "Hi there", frames=4, engines=("mkport",), device="cpu", plan=path)


def test_bench_tts_names_the_plans_composition(tmp_path, monkeypatch):
    """The command's wiring, the bench replaced by a canned result: the plan goes to the bench and the table's title
    names the composition; a plan without mkport among the engines is refused."""
    from typer.testing import CliRunner

    import mkport.runtime.decoder
    import mkport.tts.bench_tts
    import mkport.tts.model
    from mkport.cli import app

    asked = {}
    run = dict(engine="mkport", first_chunk_ms=40.0, streamed=True, first_chunk_frames=1, frame_median_ms=4.0,
               frame_p10_ms=3.9, frame_p90_ms=4.2, rtf=0.06, frames=100, audio_s=8.0, frame_method="each frame")
    canned = {"environment": {"gpu": "NVIDIA H200"}, "folder": str(tmp_path), "speaker": "vivian",
              "composition": "mk+mk serial", "results": [run]}

    def fake_bench(*args, **kwargs):
        asked.update(kwargs)
        return canned

    monkeypatch.setattr(mkport.runtime.decoder, "require_gpu", lambda spec=None: None)
    monkeypatch.setattr(mkport.tts.model, "random_model_folder", lambda which, seed=0: tmp_path)
    monkeypatch.setattr(mkport.tts.bench_tts, "run_tts_bench", fake_bench)
    plan = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["bench-tts", "--random-weights", "0.6b", "--engines", "mkport", "--plan",
                                      str(plan)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert asked["plan"] == plan and "mkport on mk+mk serial (the plan's pick)" in result.output
    result = CliRunner().invoke(app, ["bench-tts", "--random-weights", "0.6b", "--engines", "official", "--plan",
                                      str(plan)])
    assert str(result.exception) == "--plan says how mkport runs: add mkport to --engines"


class Turns(CodecLane):
    """The serial lane, counting the batched turns (warm-up's included) and when each began."""

    def __init__(self):
        self.turn, self.began = 0, {}

    def wait(self):
        self.turn += 1
        self.began[self.turn] = time.perf_counter()


class OneTurnLate(Turns):
    """A split's timing on the CPU: the codec work of a turn is done when the next turn begins. `released`: (the
    turn a chunk was decoded, the turn it left) of every chunk let out."""

    def __init__(self):
        super().__init__()
        self.released = []

    def mark(self):
        return self.turn

    def done(self, mark):
        if mark < self.turn:
            self.released.append((mark, self.turn))
            return True
        return False


JOBS = [SpeechJob("Hello there, how are you?", None, seed=0, max_frames=12),
        SpeechJob("The weather is fine today.", "serena", seed=1, max_frames=9),
        SpeechJob("One, two, three.", None, seed=2, max_frames=5),  # C: a newcomer arrives as it ends
        SpeechJob("Your order has shipped.", None, seed=3, max_frames=12),  # cancelled at its first chunk
        SpeechJob("See you soon.", None, seed=4, max_frames=6)]  # the newcomer, at C's third chunk


def _serve_with_lane(folder: Path, lane: Turns, monkeypatch) -> tuple[dict, dict]:
    """JOBS 0-3 on a batched reference engine whose codec lane is `lane`, submitted before it starts (so they join
    together, in slot order); 3 is cancelled at its first chunk, 4 submitted at C's third. Returns each job's
    events (kind, value, lane's turn, time) and its Stream."""
    import mkport.serve.batched as engine_module

    monkeypatch.setattr(engine_module, "codec_lane", lambda comp, config=None: lane)
    engine = Engine(ServeConfig(folder=folder, model_id="tiny", backend="reference", max_streams=4, max_frames=12,
                                batched=True))
    events, streams = {i: [] for i in range(len(JOBS))}, {}

    def post(i):
        def on(event):
            events[i].append((*event, lane.turn, time.perf_counter()))
            chunks = sum(e[0] == "audio" for e in events[i])
            if i == 3 and chunks == 1 and event[0] == "audio":
                engine.cancel(streams[3])
            if i == 2 and chunks == 3 and event[0] == "audio":
                streams[4] = engine.submit(JOBS[4], post(4))
        return on

    for i in range(4):
        streams[i] = engine.submit(JOBS[i], post(i))
    engine.start()
    deadline = time.monotonic() + START_S
    try:
        while not all(events[i] and events[i][-1][0] in ("done", "error") for i in (0, 1, 2, 4)):
            assert engine.error is None and time.monotonic() < deadline, engine.error or "not done in time"
            time.sleep(0.05)
    finally:
        engine.shutdown()
    return events, streams


def _chunks(events: list) -> list[bytes]:
    return [e[1] for e in events if e[0] == "audio"]


@needs_codec
def test_a_split_posts_each_chunk_a_turn_later_with_the_serial_samples(tiny, monkeypatch):
    """The engine's split path on CPU (the lane's codec work completes a turn later; its CUDA streams are the one
    part left to the GPU test): every request's chunks are the serial lane's, byte for byte; each leaves the turn
    after it was decoded, its first-audio time when it leaves; a stream that ends is done in the turn its last chunk
    leaves, and holds its slot until then (a newcomer arriving meanwhile gets another); a cancelled stream's
    pending chunk is dropped."""
    serial, _ = _serve_with_lane(tiny, Turns(), monkeypatch)
    late_lane = OneTurnLate()
    late, streams = _serve_with_lane(tiny, late_lane, monkeypatch)
    for i in (0, 1, 2, 4):
        assert [e[0] for e in late[i]] == ["audio"] * len(_chunks(late[i])) + ["done"], i
        assert len(_chunks(late[i])) >= 3 and _chunks(late[i]) == _chunks(serial[i]), f"job {i}: other samples"
        assert late[i][-1][1]["frames"] == serial[i][-1][1]["frames"] == JOBS[i].max_frames
        assert late[i][-1][2] == late[i][-2][2], f"job {i}: done a turn after its last chunk"
        first_turn, first_posted = late[i][0][2], late[i][0][3]
        assert late_lane.began[first_turn] <= streams[i].first_audio_at <= first_posted, \
            f"job {i}: first audio not counted when it left"
    assert late_lane.released and all(left == decoded + 1 for decoded, left in late_lane.released)
    assert streams[4].slot != streams[2].slot, "the newcomer took the slot of a stream whose audio was still pending"
    for run in (serial, late):
        assert [e[0] for e in run[3]] == ["audio"]  # cancelled: nothing after it, no done
    assert len(streams[3].pending) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_the_served_batch_runs_the_megakernel_and_graphs_the_plan_names(tmp_path):
    """The random 0.6b, batched at 2: the plan's mk+graphs serial gives a megakernel talker of batch 2 and a graphs
    predictor, and serves a request."""
    from mkport.runtime.graph_decoder import GraphDecoder
    from mkport.runtime.decoder import Decoder
    from mkport.kernel.spec import open_model
    from mkport.tts.model import random_model_folder

    folder = random_model_folder("0.6b")
    source = open_model(f"{folder}:talker")
    shape = model_shape(source.spec, source.with_part("code_predictor").spec)
    plan = write(tmp_path / "plan.json", {2: Composition(MK, GR)}, shape=shape)
    ready, (talker, predictor) = _serve_one(Engine(config(folder, plan, batched=True)), plan)
    assert ready["composition"] == "mk+graphs serial" and ready["backend"] == "megakernel+graphs"
    assert isinstance(talker, Decoder) and talker.batch == 2
    assert isinstance(predictor, GraphDecoder) and predictor.batch == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("asked", ["plan", "codec_sms"])
def test_gpu_a_served_split_gives_the_serial_samples_once_their_codec_events_complete(tmp_path, monkeypatch, asked):
    """The random 0.6b, 3 requests in a batch of 4 on `mk+mk split k` (k: the smallest split tried, an eighth of the
    SMs), picked by a plan or asked by --codec-sms k: the megakernels' grid is the SMs left, the frames run on the high-priority stream and the codec calls on
    the side stream; no chunk is posted before the event recorded after its codec call has completed, and most leave
    a frame after they were decoded; each request's chunks equal, byte for byte, those of the same engine with the
    codec serial after each frame, on the same decoders (the same codec calls, only their timing moves). Not
    compared with `mk+mk serial` on every SM: the megakernel's split-K and attention splits follow its grid, so its
    samples may differ by rounding."""
    import mkport.serve.batched as engine_module
    from mkport.tts.planner import split_sms
    from mkport.serve.batched import SplitCodecLane
    from mkport.serve.streams import PendingAudio, Stream
    from mkport.kernel.spec import open_model
    from mkport.tts.batch import FrameBatch
    from mkport.tts.codec import CodecStreams
    from mkport.tts.model import random_model_folder

    folder = random_model_folder("0.6b")
    source = open_model(f"{folder}:talker")
    shape = model_shape(source.spec, source.with_part("code_predictor").spec)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    split = Composition(MK, MK, split_sms(sm_count)[0])
    plan = write(tmp_path / "plan.json", {4: split}, shape=shape)
    cfg = ServeConfig(folder=folder, model_id="0.6b", max_streams=3, max_frames=40, batched=True,
                      **(dict(plan=plan) if asked == "plan" else dict(codec_sms=split.codec_sms)))
    jobs = [SpeechJob("Hello there, how are you?", None, seed=0, max_frames=40),
            SpeechJob("The weather is fine today.", None, seed=1, max_frames=33),
            SpeechJob("One, two, three.", None, seed=2, max_frames=20)]

    def serve(engine: Engine) -> dict:
        events = {i: [] for i in range(len(jobs))}
        for i, job in enumerate(jobs):  # before the start: they join together, in slot order
            engine.submit(job, events[i].append)
        engine.start()
        deadline = time.monotonic() + 900  # the split's megakernels may be built first
        try:
            while not all(ev and ev[-1][0] in ("done", "error") for ev in events.values()):
                assert engine.error is None and time.monotonic() < deadline, engine.error or "not done in time"
                time.sleep(0.05)
            assert engine._batch.talker.plan.grid == engine._batch.predictor.plan.grid == split.producer_sms(sm_count)
        finally:
            engine.shutdown()
        for ev in events.values():
            assert [e[0] for e in ev] == ["audio"] * (len(ev) - 1) + ["done"]
        return events

    with monkeypatch.context() as m:  # the reference: the codec after each frame, on the frames' stream
        m.setattr(engine_module, "codec_lane", lambda comp, config=None: CodecLane())
        serial = serve(Engine(cfg))

    engine = Engine(cfg)
    assert engine.composition == split
    lane = engine._lane
    assert isinstance(lane, SplitCodecLane) and lane.producer.priority < lane.side.priority
    steps, marks, posted, frame_streams, codec_streams = [0], {}, [], set(), set()
    real_step, real_add = FrameBatch.step, PendingAudio.add
    real_audio, real_decode = Stream._audio, CodecStreams.decode

    def step(self, *args, **kwargs):  # as FrameBatch.step (its while_running)
        steps[0] += 1
        frame_streams.add(torch.cuda.current_stream())
        return real_step(self, *args, **kwargs)

    def add(self, chunk, mark):
        marks[id(chunk)] = (chunk, mark, steps[0])  # the chunk kept: its id is not reused
        real_add(self, chunk, mark)

    def audio(self, chunk, sample_rate, metrics):
        _, mark, decoded = marks[id(chunk)]
        posted.append((mark.query(), decoded, steps[0]))
        real_audio(self, chunk, sample_rate, metrics)

    def decode(self, *args, **kwargs):
        if engine.ready:
            codec_streams.add(torch.cuda.current_stream())
        return real_decode(self, *args, **kwargs)

    monkeypatch.setattr(FrameBatch, "step", step)
    monkeypatch.setattr(PendingAudio, "add", add)
    monkeypatch.setattr(Stream, "_audio", audio)
    monkeypatch.setattr(CodecStreams, "decode", decode)
    split_run = serve(engine)
    assert frame_streams == {lane.producer} and codec_streams == {lane.side}
    assert posted and all(done for done, _, _ in posted), "a chunk was posted before its codec work completed"
    later = sum(left > decoded for _, decoded, left in posted)
    print(f"{split.label}: {later} of {len(posted)} chunks posted a frame after they were decoded")
    assert later > len(posted) // 2
    for i in range(len(jobs)):
        assert _chunks(split_run[i]) == _chunks(serial[i]), f"request {i}: the split gave other samples"
        assert split_run[i][-1][1]["frames"] == jobs[i].max_frames
