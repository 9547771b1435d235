"""The parts of mkport serve that need no server: cutting text pieces into utterances, the scheduling policy,
per-stream decoder state, and the load generator's arithmetic."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from mkport.errors import MkportError
from mkport.serve.streams import CodecLane, PendingAudio, PlaybackClock, SpeechJob, Stream
from mkport.serve.turns import next_stream
from mkport.serve.loadtest import LoadSpec, arrivals, percentiles, schedule, server_first_audio_ms
from mkport.serve.utterances import UtteranceSplitter


# -- utterances ---------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_splitter_cuts_at_sentence_ends_seen_whole():
    s = UtteranceSplitter(clock=Clock())
    assert s.push("Hello there") == []
    assert s.push(". It is 3.") == ["Hello there."]  # the last '.' may be a decimal point: it waits
    assert s.push("14 degrees! Is it") == ["It is 3.14 degrees!"]
    assert s.push(" cold?\nNo") == ["Is it cold?"]
    assert s.flush() == ["No"]
    assert s.flush() == [] and s.wait_s() is None
    assert s.push("你好。今天") == ["你好。"]
    assert s.push("很好！") == ["今天很好！"]


def test_splitter_cuts_long_text_at_a_space():
    s = UtteranceSplitter(max_chars=20, clock=Clock())
    assert s.push("one two three four five six seven") == ["one two three four"]
    assert s.flush() == ["five six seven"]
    assert UtteranceSplitter(max_chars=5, clock=Clock()).push("abcdefghijk") == ["abcde", "fghij"]


def test_splitter_speaks_text_that_waited_too_long_up_to_its_last_word():
    clock = Clock()
    s = UtteranceSplitter(max_wait_s=1.0, clock=clock)
    s.push("so I was thinking that we could")
    clock.t = 0.5
    assert s.wait_s() == pytest.approx(0.5) and s.due() == []
    s.push(" maybe go tomor")
    clock.t = 1.0
    assert s.wait_s() == 0.0
    assert s.due() == ["so I was thinking that we could maybe go"]
    assert s.buffer == " tomor" and s.wait_s() == pytest.approx(1.0)  # the partial word waits again
    s.clear()
    assert s.wait_s() is None and s.flush() == []


# -- scheduling policy --------------------------------------------------------------------------------
def _stream(arrival: float, clock: PlaybackClock | None = None) -> Stream:
    s = Stream(SpeechJob("x", None), clock or PlaybackClock(), lambda e: None, 60.0)
    s.arrival = arrival
    return s


def test_new_requests_go_first_and_running_ones_cannot_starve():
    running = _stream(0.0)
    running.first_audio_at = 0.1
    running.clock.play(0.5, now=0.1)  # its listener has audio until t = 0.6
    newcomer = _stream(0.3)
    assert next_stream([running, newcomer]) is newcomer  # due at its arrival, 0.3 < 0.6
    later = _stream(0.7)
    assert next_stream([running, later]) is running  # the running one runs out at 0.6: it goes first
    older = _stream(0.2)
    assert next_stream([newcomer, older]) is older  # two newcomers: the earlier arrival


def test_session_utterance_is_due_when_the_audio_before_it_has_played():
    clock = PlaybackClock()
    clock.play(2.0, now=1.0)  # the previous utterance plays until t = 3
    follow_up = _stream(1.5, clock)
    assert follow_up.deadline() == 3.0
    assert next_stream([follow_up, _stream(2.0)]).arrival == 2.0  # a new request at 2.0 comes before


def test_playback_clock_counts_gaps():
    clock = PlaybackClock()
    assert clock.play(0.08, now=10.0) is False
    assert clock.play(0.08, now=10.05) is False  # arrived while audio was still playing
    assert clock.ends_at == pytest.approx(10.16)
    assert clock.play(0.16, now=10.2) is True  # the listener ran out at 10.16
    assert clock.ends_at == pytest.approx(10.36)


def test_pending_audio_leaves_in_order_once_its_work_is_done():
    """A split's chunks wait for their codec work (marks here: turn numbers, done up to `finished`); a chunk whose
    work is done still waits for every chunk before it."""
    finished = {"turn": 0}
    pending = PendingAudio(lambda turn: turn <= finished["turn"])
    a, b, c = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0])
    pending.add(a, 1)
    pending.add(b, 2)
    assert list(pending.ready()) == [] and len(pending) == 2
    finished["turn"] = 1
    assert [x.item() for x in pending.ready()] == [1.0] and len(pending) == 1
    pending.add(c, 1)  # done, but behind b
    assert list(pending.ready()) == []
    finished["turn"] = 2
    assert [x.item() for x in pending.ready()] == [2.0, 3.0] and len(pending) == 0
    pending.add(a, 5)
    pending.clear()  # a stream cancelled or timed out: its chunks go
    finished["turn"] = 9
    assert list(pending.ready()) == []


def test_the_timeline_summary_reads_the_debug_log():
    """scripts/serve_timeline.py on lines as the scheduler logs them (Stream.timeline): each stamp's and each step's
    p50, p95 and max, the steps in the order the server's mode makes them (by turns, logged as slot None, the join
    comes before the prompt); a stream with a stamp missing (an error before its join) is left out."""
    from conftest import load_script

    def line(admitted, prompt, joined, first, slot=0):
        stream = Stream(SpeechJob("Hi.", None), PlaybackClock(), lambda event: None, 60.0)
        stream.slot = slot
        t = stream.arrival
        stream.admitted_at, stream.prepared_at = t + admitted / 1e3, t + prompt / 1e3
        stream.joined_at, stream.first_audio_at = t + joined / 1e3, t + first / 1e3
        return f"mkport serve: stream completed (1 active): {stream.timeline()}"

    unjoined = Stream(SpeechJob("Hi.", None), PlaybackClock(), lambda event: None, 60.0)
    log = "\n".join([line(0.5, 2.0, 4.0, 20.0), line(1.5, 3.0, 6.0, 30.0, slot=12), line(0.5, 2.5, 5.0, 22.0),
                     f"mkport serve: stream error (0 active): {unjoined.timeline()}"])
    timeline = load_script("serve_timeline")
    rows = timeline.read(log)
    assert list(rows) == ["batched"]
    assert [tuple(r.values()) for r in rows["batched"]] == [(0.5, 2.0, 4.0, 20.0), (1.5, 3.0, 6.0, 30.0),
                                                            (0.5, 2.5, 5.0, 22.0)]
    table = {name: (p50, p95, top) for name, p50, p95, top in timeline.summary(rows["batched"])}
    assert table["first audio"] == (22.0, 30.0, 30.0)
    assert table["joined -> first audio"] == (17.0, 24.0, 24.0)
    assert table["admitted -> prompt"] == (1.5, 2.0, 2.0)

    by_turns = timeline.read("\n".join([line(0.2, 1.4, 0.2, 21.8, slot=None), line(0.3, 1.5, 0.3, 22.6, slot=None)]))
    assert list(by_turns) == ["by turns"]
    table = {name: (p50, p95, top) for name, p50, p95, top in
             timeline.summary(by_turns["by turns"], timeline.ORDER["by turns"])}
    assert table["joined -> prompt"] == (1.2, 1.2, 1.2)
    assert table["prompt -> first audio"] == (20.4, 21.1, 21.1)
    assert not any(p50 < 0 for p50, _, _ in table.values())

    sent = Stream(SpeechJob("Hi.", None), PlaybackClock(), lambda event: None, 60.0)
    sent.slot, t = 0, sent.arrival
    sent.admitted_at, sent.prepared_at, sent.joined_at = t + 0.5e-3, t + 2e-3, t + 4e-3
    sent.first_audio_at, sent.sent_at = t + 20e-3, t + 23.5e-3  # handed to the HTTP response 3.5 ms after it left
    rows = timeline.read(f"mkport serve: stream completed (1 active): {sent.timeline()}")["batched"]
    assert rows == [{"admitted": 0.5, "prompt": 2.0, "joined": 4.0, "first audio": 20.0, "sent": 23.5}]
    assert dict((name, p50) for name, p50, _, _ in timeline.summary(rows))["first audio -> sent"] == 3.5


def test_a_stream_finishes_only_when_its_chunks_have_left():
    """Stream.take on a lane whose work completes a turn later: the flushed stream is finished only once the chunks
    are posted, in order, each when it leaves (its first-audio time then), and frames after its flush are ignored."""
    class Codec:  # a chunk of the frame's value at each push, the flush a chunk of -1
        def push(self, frame):
            return torch.full((1920,), float(frame) / 10)

        def flush(self):
            return torch.full((1920,), -0.1)

    class Late(CodecLane):
        turn = 0

        def mark(self):
            return self.turn

        def done(self, mark):
            return mark < self.turn

    class Model:
        class codec:
            sample_rate = 24000

    lane, posted = Late(), []
    s = Stream(SpeechJob("x", None), PlaybackClock(), posted.append, 60.0, lane)
    s._codec, s.started = Codec(), True
    assert s.take(1, False, Model, None) is False and posted == []
    lane.turn = 1
    s.post_ready(24000, None)
    first = s.first_audio_at
    assert [e[0] for e in posted] == ["audio"] and first is not None
    assert s.take(2, True, Model, None) is False  # flushed, two chunks pending
    assert s.take(3, True, Model, None) is False and s.frames == 2  # after its flush: ignored
    lane.turn = 2
    s.post_ready(24000, None)
    assert s.take(None, True, Model, None) is True
    values = [round(int.from_bytes(e[1][:2], "little", signed=True) / 32767, 2) for e in posted]
    assert values == [0.1, 0.2, -0.1] and s.samples == 3 * 1920 and s.first_audio_at == first


# -- per-stream state ---------------------------------------------------------------------------------
needs_codec = pytest.mark.skipif(importlib.util.find_spec("qwen_tts") is None,
                                 reason="the official Qwen3-TTS code (pip install --no-deps qwen-tts-hf) is needed")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mkport.tts.model import TtsModel, write_random_tts_model

    return TtsModel.load(write_random_tts_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0))


@needs_codec
def test_weights_on_moves_the_parts_asked_and_keeps_the_rest(tiny):
    """What a server on a GPU does once at loading (Scheduler._load): the parts it names moved, the others the same
    objects, the model it came from untouched."""
    def devices(w):
        seen = set()
        w.map(lambda t: seen.add(t.device.type) or t)
        return seen

    moved = tiny.weights_on("meta", predictor=False)
    assert devices(moved.talker_weights) == {"meta"}
    assert moved.predictor_weights is tiny.predictor_weights
    assert devices(tiny.talker_weights) == {"cpu"}
    assert moved.text is tiny.text  # the text table stays mapped unless asked
    with_text = tiny.weights_on("meta", talker=False, predictor=False, text=True)
    assert with_text.text.table.device.type == "meta" and tiny.text.table.device.type == "cpu"
    assert with_text.text.fc1_w is tiny.text.fc1_w  # the projection stays where the projector runs


@needs_codec
def test_decoder_pairs_share_weights_not_state(tiny):
    from mkport.serve.turns import decoder_pairs

    (t1, p1), (t2, p2) = decoder_pairs(tiny, "reference", 2, 64)
    assert t1.weights.layers[0].wqkv.data_ptr() == t2.weights.layers[0].wqkv.data_ptr()
    assert p1.weights.embed.data_ptr() == p2.weights.embed.data_ptr()
    for a, b in ((t1, t2), (p1, p2)):
        for name in ("k_cache", "v_cache", "hidden", "logits", "token_out", "seen"):
            assert getattr(a, name).data_ptr() != getattr(b, name).data_ptr(), name


@needs_codec
def test_a_reused_decoder_pair_samples_as_a_fresh_one(tiny):
    """Stream after stream on one pair (as the server reuses them), each equals a fresh pair's (the reference
    decoder's random stream restarts at reset, as the kernel's Philox counter does)."""
    from mkport.serve.turns import decoder_pairs

    def codes(pair, seed):
        s = Stream(SpeechJob("Hello there.", None, seed=seed, max_frames=4), PlaybackClock(), lambda e: None, 60.0)
        s.decoders = pair
        out = []
        s.post = lambda e: out.append(e[1]) if e[0] == "audio" else None
        while not s.advance(tiny, None):
            pass
        return b"".join(out)

    reused = decoder_pairs(tiny, "reference", 1, 64)[0]
    first, again, other = codes(reused, 1), codes(reused, 1), codes(reused, 2)  # the same seed twice in a row
    assert first == again != other
    assert first == codes(decoder_pairs(tiny, "reference", 1, 64)[0], 1)


@needs_codec
def test_a_prompt_too_long_for_the_kv_cache_is_a_400(tiny):
    from mkport.serve.streams import RequestError
    from mkport.serve.turns import decoder_pairs

    s = Stream(SpeechJob("word " * 20, None, max_frames=40), PlaybackClock(), lambda e: None, 60.0)
    s.decoders = decoder_pairs(tiny, "reference", 1, 64)[0]
    with pytest.raises(RequestError, match="input too long") as e:
        s.advance(tiny, None)
    assert e.value.status == 400


# -- load generator -----------------------------------------------------------------------------------
def test_poisson_arrivals_and_percentiles():
    times = arrivals(10.0, 200.0, random.Random(1))
    assert all(0 <= a < b < 200 for a, b in zip(times, times[1:]))
    assert len(times) == pytest.approx(2000, rel=0.1)
    gaps = torch.tensor([b - a for a, b in zip(times, times[1:])])
    assert float(gaps.mean()) == pytest.approx(0.1, rel=0.1) and float(gaps.std()) == pytest.approx(0.1, rel=0.15)
    spec = LoadSpec(url="http://127.0.0.1:1", rate=2.0, duration_s=5.0, seed=3)
    assert schedule(spec) == schedule(spec) != schedule(LoadSpec(url=spec.url, rate=2.0, duration_s=5.0, seed=4))
    p = percentiles([float(i) for i in range(1, 101)])
    assert (p["p50"], p["p95"], p["p99"], p["max"], p["mean"]) == (50.0, 95.0, 99.0, 100.0, 50.5)
    assert percentiles([])["p95"] is None


def loadtest_against_stand_in(audio, spec: dict) -> dict:
    """run_loadtest(LoadSpec(url=..., **spec)) against a stand-in server on 127.0.0.1 whose speech answers stream
    `audio()` (an async generator of PCM bytes), and its result."""
    import socket
    import threading

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from mkport.serve.loadtest import run_loadtest

    async def models(request):
        return JSONResponse({"data": [{"id": "stand-in", "sample_rate": 24000}]})

    async def speech(request):
        return StreamingResponse(audio(), media_type="audio/pcm")

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/audio/speech", speech, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.05)
            assert thread.is_alive(), "the stand-in server did not start"
        return run_loadtest(LoadSpec(url=f"http://127.0.0.1:{sock.getsockname()[1]}", **spec))
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_loadtest_says_where_each_underrun_fell_and_how_long_playback_was_silent():
    """A stand-in server sends fifteen 80 ms chunks: the second 0.4 s after the first (playback ran dry 80 ms into the
    stream, ~320 ms silent), twelve more at once, the last 1.3 s later (dry 1.12 s in, ~260 ms silent, 1.04 s having
    been in hand). The record keeps both with their audio position and silence; the summary counts the one in a
    stream's first second of audio apart."""
    import asyncio

    async def audio():
        for pause in (0.4, *[0.0] * 12, 1.3, None):
            yield bytes(3840)  # 80 ms of pcm16
            if pause is not None:
                await asyncio.sleep(pause)

    result = loadtest_against_stand_in(audio, {"duration_s": 0.5, "streams": 1, "timeout_s": 5.0})
    record, s = result["requests"][0], result["summary"]
    assert record["underruns"] == 2 and [at for at, _ in record["underrun_at"]] == [0.08, 1.12], record
    first, second = (ms for _, ms in record["underrun_at"])
    assert 200 < first < 700 and 100 < second < 700, record  # sleeps of 0.4 and 1.3 s, less the audio in hand
    assert s["underruns"] == 2 * s["completed"] and s["underruns_in_first_second"] == s["completed"], s
    assert s["silence_ms"]["max"] == max(ms for r in result["requests"] for _, ms in r["underrun_at"])


def test_a_closed_loop_of_more_clients_than_concurrency_keeps_them_all_open():
    """--streams 40 (above --concurrency's default 32) against a stand-in server on 127.0.0.1 whose answers take
    0.3 s: the server sees all 40 requests at once, and no request's first audio waits for another's connection
    (with 32 connections, 8 clients waited in httpx's pool the whole run and their wait counted as first audio)."""
    import asyncio

    open_now, peak = [0], [0]

    async def audio():
        open_now[0] += 1
        peak[0] = max(peak[0], open_now[0])
        try:
            for _ in range(6):
                yield bytes(3840)  # 80 ms of pcm16
                await asyncio.sleep(0.05)
        finally:
            open_now[0] -= 1

    result = loadtest_against_stand_in(audio, {"duration_s": 3.0, "streams": 40, "timeout_s": 5.0})
    s = result["summary"]
    assert s["errors"] == 0 and s["completed"] >= 160, s
    assert peak[0] == 40, f"the server saw at most {peak[0]} of 40 streams at once"
    # a client that waited for a connection: the whole run (3 s); a busy CI machine's slowest answer: ~1.1 s seen
    assert s["ttfa_ms"]["max"] < 2000, s["ttfa_ms"]


def test_the_config_picks_the_scheduler():
    """--batched gives the batched scheduler, else the streams take turns: each a whole Scheduler (its abstract
    methods all there, or it would not build), with no batch to report before loading."""
    from pathlib import Path

    from mkport.serve.batched import BatchedScheduler
    from mkport.serve.config import ServeConfig
    from mkport.serve.engine import Engine
    from mkport.serve.turns import TurnsScheduler

    def engine(batched: bool):
        return Engine(ServeConfig(folder=Path("."), model_id="m", backend="reference", max_streams=3, batched=batched))

    turns, batched = engine(False), engine(True)
    assert type(turns) is TurnsScheduler and type(batched) is BatchedScheduler
    assert turns.batch_layout() is None and batched.batch_layout() is None


@pytest.mark.parametrize("frames", [0, 5000])
def test_the_server_takes_speaks_frame_limits(frames):
    """--max-frames is checked as speak checks it (tts.limits), before anything loads."""
    from pathlib import Path

    from mkport.serve.config import ServeConfig
    from mkport.serve.engine import Engine

    speaks = rf"^--max-frames {frames}: must be 1\.\.4096 \(frames of 80 ms an utterance\)$"
    with pytest.raises(MkportError, match=speaks):
        Engine(ServeConfig(folder=Path("."), model_id="m", backend="reference", max_frames=frames))


def test_batch_size_of_a_batched_server():
    """--batched: the megakernel's batch decoders come in BATCHES sizes, the smallest that holds --max-streams, up to
    the largest (past it, batches of it take turns); at most 256 streams."""
    from pathlib import Path

    from mkport.errors import MkportError
    from mkport.serve.config import ServeConfig
    from mkport.serve.batched import batch_size

    def config(streams: int, backend: str = "megakernel") -> ServeConfig:
        return ServeConfig(folder=Path("."), model_id="m", backend=backend, max_streams=streams, batched=True)

    assert [batch_size(config(n)) for n in (1, 3, 8, 9, 32, 33, 64)] == [1, 4, 8, 16, 32, 32, 32]
    assert batch_size(config(5, "reference")) == 5
    for streams in (0, 257):
        with pytest.raises(MkportError, match=rf"^--max-streams {streams} with --batched: 1 to 256$"):
            batch_size(config(streams))


@needs_codec
def test_a_loaded_server_keeps_its_model_out_of_the_garbage_collector(tmp_path):
    """After loading and warming, what the server holds is frozen: a full collection no longer walks the model's
    objects, so no request meets a pause of tens of milliseconds."""
    import gc

    from mkport.serve.config import ServeConfig
    from mkport.serve.engine import Engine
    from mkport.tts.model import write_random_tts_model

    folder = write_random_tts_model(tmp_path, "tiny", seed=0)
    engine = Engine(ServeConfig(folder=folder, model_id="tiny", backend="reference", max_streams=1, max_frames=4))
    gc.unfreeze()
    try:
        with torch.no_grad():
            engine._load()
        assert gc.get_freeze_count() > 10_000
        # every chunk length a stream decodes has its graph (registered on CPU, captured on CUDA)
        assert engine.model.codec.graph_frames == {1, 2, 4, 8, 16}
        assert len(gc.get_objects()) < gc.get_freeze_count()  # what a collection walks: the rest, not the model
    finally:
        gc.unfreeze()


def test_streams_past_what_one_batch_holds_go_to_batches_that_take_turns(monkeypatch):
    """The megakernel holds 16 sequences of the 1.7B (shared memory): 32 streams are two batches of 16, 24 streams
    two of 16 (the spare slots unused), and the 0.6B's 32 fit one batch; the reference backend has no such bound."""
    from types import SimpleNamespace

    import mkport.runtime.decoder
    from mkport.kernel.gpu import target_for_arch
    from mkport.tts.planner import Composition
    from mkport.serve.config import ServeConfig
    from mkport.serve.batched import batch_groups
    from mkport.kernel.spec import load_spec

    monkeypatch.setattr(mkport.runtime.decoder, "current_device_target", lambda: target_for_arch("sm_90"))
    model = {size: SimpleNamespace(talker_spec=load_spec(f"qwen3-tts-{size}-talker"),
                                   predictor_spec=load_spec(f"qwen3-tts-{size}-code-predictor")) for size in ("0.6b", "1.7b")}
    mk, ref = Composition("megakernel", "megakernel"), Composition("reference", "reference")

    def groups(size, streams, comp=mk, batch_size=None):
        config = ServeConfig(folder=None, model_id="m", backend=comp.talker, max_streams=streams, batched=True,
                             batch_size=batch_size)
        return batch_groups(config, comp, model[size])

    assert groups("1.7b", 32) == (16, 2) and groups("1.7b", 24) == (16, 2) and groups("1.7b", 8) == (8, 1)
    assert groups("1.7b", 64) == (16, 4) and groups("0.6b", 64) == (32, 2) and groups("1.7b", 160) == (16, 10)
    assert groups("0.6b", 32) == (32, 1) and groups("1.7b", 32, ref) == (32, 1)
    # 24, a batch size only when asked: the 1.7B's batches of 24 fit a block where 32 do not
    assert groups("1.7b", 168, batch_size=24) == (24, 7) and groups("1.7b", 160, batch_size=32) == (24, 7)
    assert groups("0.6b", 48, batch_size=24) == (24, 2) and groups("1.7b", 20, batch_size=24) == (24, 1)


def test_the_server_loads_what_its_first_streamed_response_would_at_start_up():
    """A streamed response opens an anyio task group, and the first one of a process imports anyio's asyncio
    backend (~20-35 ms): the app's start-up does it, so the first request does not wait for it (a fresh process,
    since pytest's own plugins may have imported it)."""
    import subprocess
    import sys

    code = """
import asyncio, sys
from types import SimpleNamespace
from mkport.serve.app import create_app
from mkport.serve.metrics import ServeMetrics
app = create_app(SimpleNamespace(metrics=ServeMetrics(), start=lambda: None, shutdown=lambda: None))
backend = "anyio._backends._asyncio"
before = backend in sys.modules
async def main():
    async with app.router.lifespan_context(app):
        print(before, backend in sys.modules)
asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"], out.stdout


# -- the server's defaults: batched on the megakernel, as many streams as the GPU's memory holds ------------------
def test_fit_streams_holds_max_streams_to_the_free_memory(monkeypatch, caplog):
    """The default (streams_by_memory) becomes what the free memory, less the headroom, holds at per_stream bytes a
    stream, at most 256, and the log says how; a value given that memory cannot hold is a one-line error with both
    numbers; one that it holds is kept."""
    import logging
    from pathlib import Path

    from mkport.serve import batched
    from mkport.serve.config import ServeConfig

    free = {"bytes": 100e9}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (int(free["bytes"]), 141e9))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(batched, "MEMORY_HEADROOM", 0.25)
    per_stream = int(0.5e9)

    def config(streams: int, by_memory: bool) -> ServeConfig:
        return ServeConfig(folder=Path("."), model_id="m", max_streams=streams, batched=True,
                           streams_by_memory=by_memory)

    with caplog.at_level(logging.INFO, logger="mkport.serve"):
        assert batched.fit_streams(config(256, True), per_stream).max_streams == 150  # 75 GB / 0.5 GB
    assert caplog.messages[-1] == ("max streams 150: 0.50 GB a stream, 100.0 GB free after the weights, 25% kept "
                                   "back: room for 150")
    free["bytes"] = 1000e9
    with caplog.at_level(logging.INFO, logger="mkport.serve"):
        assert batched.fit_streams(config(256, True), per_stream).max_streams == 256
    assert caplog.messages[-1].startswith("max streams 256: ") and caplog.messages[-1].endswith(
        "room for 1500, at most 256")

    free["bytes"] = 100e9
    assert batched.fit_streams(config(150, False), per_stream).max_streams == 150
    with pytest.raises(MkportError, match=r"^--max-streams 151: the GPU's memory holds 150 streams \(0\.50 GB a "
                                          r"stream, 100\.0 GB free after the weights, 25% kept back: room for 150\)$"):
        batched.fit_streams(config(151, False), per_stream)
    free["bytes"] = 0.6e9
    with pytest.raises(MkportError, match=r"^not one stream fits in the GPU's memory \(0\.50 GB a stream"):
        batched.fit_streams(config(256, True), per_stream)

    # a batch's slots come together: 150 streams' room holds 144 streams in batches of 16 (nine), 144 in batches of
    # 24 (six: a seventh would be 168 slots); a value given is held to whole batches too
    free["bytes"] = 100e9
    assert batched.fit_streams(config(256, True), per_stream, 16).max_streams == 144
    with caplog.at_level(logging.INFO, logger="mkport.serve"):
        assert batched.fit_streams(config(256, True), per_stream, 24).max_streams == 144
    assert caplog.messages[-1].endswith("room for 150, 144 in whole batches of 24")
    assert batched.fit_streams(config(144, False), per_stream, 24).max_streams == 144
    with pytest.raises(MkportError, match=r"^--max-streams 145: the GPU's memory holds 144 streams \(.*room for 150, "
                                          r"144 in whole batches of 24\)$"):
        batched.fit_streams(config(145, False), per_stream, 24)
    free["bytes"] = 1000e9  # room for 1500: 256 streams in eleven batches of 24 (264 slots) fit
    assert batched.fit_streams(config(256, True), per_stream, 24).max_streams == 256


@needs_codec
def test_a_streams_bytes_are_what_its_slot_allocates(tiny):
    """stream_bytes: a slot's bf16 talker KV cache as a batch decoder allocates it (GraphDecoder, the megakernel's
    layout) and its row of the codec state, as a StreamState of one stream more allocates."""
    from mkport.runtime.graph_decoder import GraphDecoder
    from mkport.serve.batched import stream_bytes
    from mkport.tts.codec_decoder import StreamState

    def state_bytes(streams: int) -> int:
        state = StreamState(tiny.codec.module, streams)
        return sum(t.nbytes for kept in state._kept.values() for t in kept) + state.position.nbytes

    codec_row = state_bytes(3) - state_bytes(2)
    assert StreamState.row_bytes(tiny.codec.module) == codec_row > 0
    talker = GraphDecoder(tiny.talker_spec, tiny.talker_weights, max_seq=64, batch=3, device="cpu", graphs=False,
                          kv_dtype=torch.bfloat16)
    assert stream_bytes(tiny, 64) == talker.kv.nbytes // 3 + codec_row


def served_config(args: list[str], tmp_path, monkeypatch):
    """The ServeConfig `mkport serve --model TINY *args` gives the engine (the megakernel's check of a GPU, and the
    engine, stood in for)."""
    from typer.testing import CliRunner

    from mkport.cli import app
    from mkport.runtime import backends
    from mkport.serve import engine
    from mkport.tts.model import write_random_tts_model

    seen = []

    def stand_in(config):
        seen.append(config)
        raise MkportError("stood in")

    monkeypatch.setattr(backends, "check_backend", lambda backend, batched=False: None)
    monkeypatch.setattr(engine, "Engine", stand_in)
    folder = write_random_tts_model(tmp_path / "tiny", "tiny", seed=0)
    result = CliRunner().invoke(app, ["serve", "--model", str(folder), *args])
    assert str(result.exception) == "stood in", result.output
    (config,) = seen
    return config


@pytest.mark.parametrize("args, batched, streams, by_memory", [
    ([], True, 256, True),  # the megakernel: batched, as many as memory holds
    (["--batched"], True, 256, True),
    (["--max-streams", "40"], True, 40, False),
    (["--by-turns"], False, 8, False),
    (["--backend", "reference"], False, 8, False),  # the reference backend: by turns
    (["--backend", "reference", "--batched"], True, 8, False),  # on the CPU: today's 8
])
def test_the_cli_batches_by_default_on_the_megakernel_only(args, batched, streams, by_memory, tmp_path, monkeypatch):
    """What `mkport serve` gives the engine: batched and bounded by memory on the megakernel unless told otherwise,
    by turns on DEFAULT_MAX_STREAMS on the reference backend."""
    config = served_config(args, tmp_path, monkeypatch)
    assert (config.batched, config.max_streams, config.streams_by_memory) == (batched, streams, by_memory)
    assert config.compile_codec is None  # the engine decides (test_the_codec_is_compiled_by_default_...)


@pytest.mark.parametrize("flag, asked", [("--compile-codec", True), ("--no-compile-codec", False)])
def test_the_cli_passes_compile_codec_as_asked(flag, asked, tmp_path, monkeypatch):
    assert served_config([flag], tmp_path, monkeypatch).compile_codec is asked


@pytest.mark.parametrize("asked, batched, on_cuda, blocked, compiled", [
    (None, True, True, None, True),  # the default where it was measured: --batched on a GPU
    (None, False, True, None, False),  # by turns: not measured, off unless asked
    (None, True, False, None, False),  # the CPU
    (None, True, True, "no C compiler (cc, gcc, clang) for Triton's launchers", False),  # a warning, not a refusal
    (True, False, True, None, True),
    (False, True, True, None, False),
])
def test_the_codec_is_compiled_by_default_with_batched_on_a_gpu(asked, batched, on_cuda, blocked, compiled, monkeypatch,
                                                                 caplog):
    """engine.compiled_codec: --compile-codec / --no-compile-codec as asked; by default on with --batched on a CUDA
    GPU whose Triton can build, off elsewhere, saying why where Triton cannot (the GPU and Triton stood in for)."""
    from pathlib import Path

    from mkport.serve import engine
    from mkport.serve.config import ServeConfig
    from mkport.tts.planner import Composition

    monkeypatch.setattr(engine, "runs_on_cuda", lambda comp: on_cuda)
    monkeypatch.setattr(engine, "compile_unavailable", lambda: blocked)
    config = ServeConfig(folder=Path("."), model_id="m", backend="megakernel", batched=batched, compile_codec=asked)
    with caplog.at_level("WARNING", logger="mkport.serve"):
        assert engine.compiled_codec(config, Composition("megakernel", "megakernel")) is compiled
    assert ("run uncompiled" in caplog.text) == (blocked is not None) and (blocked or "") in caplog.text


def test_compile_codec_asked_where_triton_cannot_build_is_one_line(monkeypatch):
    from pathlib import Path

    from mkport.serve import engine
    from mkport.serve.config import ServeConfig
    from mkport.tts.planner import Composition

    monkeypatch.setattr(engine, "runs_on_cuda", lambda comp: True)
    monkeypatch.setattr(engine, "compile_unavailable", lambda: "Triton is not installed")
    config = ServeConfig(folder=Path("."), model_id="m", backend="megakernel", batched=True, compile_codec=True)
    with pytest.raises(MkportError, match="^--compile-codec: Triton is not installed; serve with --no-compile-codec$"):
        engine.compiled_codec(config, Composition("megakernel", "megakernel"))


def test_triton_needs_a_c_compiler_and_pythons_headers(monkeypatch, tmp_path):
    """compile_unavailable names what Triton's launchers lack: Triton itself, a C compiler ($CC when it is set, else
    cc, gcc or clang), Python's headers (Triton and the tools stood in for)."""
    import shutil
    import sysconfig

    from mkport.tts.codec import compile_unavailable

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "triton" else found(name))
    assert compile_unavailable() == "Triton is not installed"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "triton" else found(name))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    assert compile_unavailable() == "no C compiler (cc, gcc, clang) for Triton's launchers"
    monkeypatch.setenv("CC", "my-cc")
    assert compile_unavailable() == "no C compiler (my-cc) for Triton's launchers"
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}" if name == "my-cc" else None)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert compile_unavailable() == "Python's headers (Python.h), which Triton's launchers need, are not installed"
    (tmp_path / "Python.h").write_text("")
    assert compile_unavailable() is None


def test_the_loadtest_reads_the_servers_first_audio_from_server_timing():
    assert server_first_audio_ms({"server-timing": "first-audio;dur=15.25"}) == 15.25
    assert server_first_audio_ms({"server-timing": "db;dur=3, first-audio;desc=\"x\";dur=7"}) == 7.0
    assert server_first_audio_ms({"server-timing": "first-audio;dur=soon"}) is None
    assert server_first_audio_ms({"server-timing": "cache;dur=1"}) is None
    assert server_first_audio_ms({}) is None  # another server: no header
