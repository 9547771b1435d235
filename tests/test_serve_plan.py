"""`mkport serve --plan` and `mkport bench-tts --plan`: a plan file written for a model on this machine's device
picks backends per batch size; the server's engine runs the pick for its batch size (on CPU, graphs and the
reference backend stand in for the GPU's backends) and bench-tts the pick for one request; a plan that does not
fit the model, the device or the batch, or that they cannot run, is refused in one line naming the file."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from mkport.errors import MkportError
from mkport.plan import Choice, Composition, Estimate, GroupTimes, Plan, model_shape, write_plan
from mkport.serve.config import ServeConfig
from mkport.serve.engine import Engine
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
    times = GroupTimes(*(device or device_identity()), first_chunk=1, chunk=16, left_context=25)
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
    "split": (dict(picks={2: Composition(MK, MK, 1)}), True, 2,
              "its pick at batch 2, mk+mk split 1, runs the codec beside the megakernels"),
    "batch_decoders_unbatched": (dict(picks={1: Composition(GR, GR)}), False, 2,
                                 "its pick at batch 1, graphs+graphs serial, runs batch decoders; without --batched"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_plan_the_server_cannot_use_is_refused_in_one_line(tiny, tmp_path, case):
    content, batched, streams, words = REFUSED[case]
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
    from mkport.graph_decoder import GraphDecoder
    from mkport.tts.batch import DecoderBatch

    plan = write(tmp_path / "plan.json", PICKS)
    ready, (talker, predictor) = _serve_one(Engine(config(tiny, plan, batched=True)), plan)
    assert ready["composition"] == "graphs+ref serial" and ready["backend"] == "graphs+reference"
    assert isinstance(talker, GraphDecoder) and talker.batch == 2
    assert isinstance(predictor, DecoderBatch) and predictor.batch == 2


@needs_codec
def test_bench_tts_times_the_pick_for_one_request(tiny, tmp_path):
    from mkport.tts.bench import run_tts_bench

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

    import mkport.runtime
    import mkport.tts.bench
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

    monkeypatch.setattr(mkport.runtime, "require_gpu", lambda: None)
    monkeypatch.setattr(mkport.tts.model, "random_model_folder", lambda which, seed=0: tmp_path)
    monkeypatch.setattr(mkport.tts.bench, "run_tts_bench", fake_bench)
    plan = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["bench-tts", "--random-weights", "0.6b", "--engines", "mkport", "--plan",
                                      str(plan)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert asked["plan"] == plan and "mkport on mk+mk serial (the plan's pick)" in result.output
    result = CliRunner().invoke(app, ["bench-tts", "--random-weights", "0.6b", "--engines", "official", "--plan",
                                      str(plan)])
    assert str(result.exception) == "--plan says how mkport runs: add mkport to --engines"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_the_served_batch_runs_the_megakernel_and_graphs_the_plan_names(tmp_path):
    """The random 0.6b, batched at 2: the plan's mk+graphs serial gives a megakernel talker of batch 2 and a graphs
    predictor, and serves a request."""
    from mkport.graph_decoder import GraphDecoder
    from mkport.runtime import Decoder
    from mkport.spec import open_model
    from mkport.tts.model import random_model_folder

    folder = random_model_folder("0.6b")
    source = open_model(f"{folder}:talker")
    shape = model_shape(source.spec, source.with_part("code_predictor").spec)
    plan = write(tmp_path / "plan.json", {2: Composition(MK, GR)}, shape=shape)
    ready, (talker, predictor) = _serve_one(Engine(config(folder, plan, batched=True)), plan)
    assert ready["composition"] == "mk+graphs serial" and ready["backend"] == "megakernel+graphs"
    assert isinstance(talker, Decoder) and talker.batch == 2
    assert isinstance(predictor, GraphDecoder) and predictor.batch == 2
