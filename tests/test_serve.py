"""`mkport serve` end to end on CPU: a real uvicorn server on 127.0.0.1 (a free port) with the tiny random
model and the reference backend, in a subprocess; HTTP and WebSocket clients here; `mkport speak --server`
and `mkport loadtest` against it. Requests ask for a few frames each to keep the runtime modest."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np
import pytest
from websockets.sync.client import connect

import mkport

if __import__("importlib.util").util.find_spec("qwen_tts") is None:
    pytest.skip("the official Qwen3-TTS code (pip install --no-deps qwen-tts-hf) is needed for the codec",
                allow_module_level=True)

from mkport.tts.model import write_random_tts_model  # noqa: E402

SPF = 1920  # samples a frame
RATE = 24000
FRAMES = 6  # a request's max_frames in these tests
PCM_ROUNDING = 4  # 16-bit steps two decodes of the same frames may differ by (same_audio)
START_S = 240  # loading and warming the tiny model on a busy 2-core CI machine
ROOT = Path(mkport.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tts_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("serve_cache")
    write_random_tts_model(cache / "tts-random" / "tiny-0", "tiny", seed=0)
    return cache


class Server:
    """`mkport serve --random-weights tiny --backend reference --port 0 ARGS` in a subprocess."""

    def __init__(self, cache: Path, log: Path, *args: str):
        env = dict(os.environ, MKPORT_CACHE=str(cache), OMP_NUM_THREADS="1",  # 1 thread: CI's cores are shared
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mkport.cli", "serve", "--random-weights", "tiny", "--backend", "reference",
             "--port", "0", *args], stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_S
        self.url = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"mkport serve exited with {self.proc.returncode}:\n{self.tail()}")
            if self.url is None:
                m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text())
                self.url = m.group(1) if m else None
            elif httpx.get(self.url + "/ready").status_code == 200:
                return
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"mkport serve was not ready within {START_S} s:\n{self.tail()}")

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(tts_cache, tmp_path_factory):
    s = Server(tts_cache, tmp_path_factory.mktemp("serve") / "server.log", "--max-streams", "8",
               "--max-frames", "400", "--max-input-chars", "200")
    yield s
    s.stop()


def speech(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/audio/speech", json={"max_frames": FRAMES, **body}, timeout=120)


def wav_samples(data: bytes) -> np.ndarray:
    """The samples of a streamed WAV, after checking its header (16-bit mono 24 kHz, streaming sizes)."""
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE" and data[36:40] == b"data"
    fmt = struct.unpack("<IHHIIHH", data[16:36])
    assert fmt == (16, 1, 1, RATE, 2 * RATE, 2, 16)
    assert struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    return np.frombuffer(data[44:], dtype="<i2")


def same_audio(data: bytes, want: bytes, wav: bool) -> bool:
    """The same response up to float32 rounding: the same header and length, each 16-bit sample within a few steps
    (a batched server decodes a turn's streams in one codec call, which sums in another order than a stream alone;
    another frame's audio differs by thousands)."""
    head = 44 if wav else 0
    if len(data) != len(want) or data[:head] != want[:head]:
        return False
    pcm = lambda d: np.frombuffer(d[head:], dtype="<i2").astype(np.int32)  # noqa: E731
    return int(np.abs(pcm(data) - pcm(want)).max()) <= PCM_ROUNDING


def check_audio(samples: np.ndarray, max_frames: int = FRAMES) -> None:
    assert 0 < samples.size <= max_frames * SPF and samples.size % SPF == 0
    assert samples.std() > 0 and np.abs(samples).max() < 32767  # not silence, not clipped throughout


# -- HTTP ---------------------------------------------------------------------------------------------
def test_the_debug_timeline_says_when_the_first_chunk_was_handed_to_the_response(tts_cache, tmp_path):
    """`--log-level debug`: a stream's line ends with when its first chunk went to the HTTP response, after it left
    the scheduler (what lies between the server's first audio and the client's)."""
    s = Server(tts_cache, tmp_path / "server.log", "--max-streams", "2", "--log-level", "debug")
    try:
        assert speech(s.url, input="Stamp it.").status_code == 200
        deadline = time.monotonic() + 10
        while not (found := re.search(r"first audio ([\d.]+), sent ([\d.]+)$", s.log.read_text(), re.M)):
            assert time.monotonic() < deadline, s.tail()
            time.sleep(0.1)
        assert 0 < float(found.group(1)) <= float(found.group(2)), found.group(0)
    finally:
        s.stop()


def test_health_ready_models_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    ready = httpx.get(server.url + "/ready").json()
    assert ready["status"] == "ready" and ready["backend"] == "reference" and ready["max_streams"] == 8 and ready["batched"] is False
    assert ready["batches"] is None and ready["frame_lanes"] == 1  # decoder pairs, a stream each
    assert ready["compiled_codec"] is False  # the CPU: the codec runs uncompiled
    assert ready["composition"] == "ref+ref serial" and ready["plan"] is None  # --backend's, no plan
    model = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert model["id"] == "qwen3-tts-random-tiny" and model["sample_rate"] == RATE
    assert model["default_voice"] in model["voices"] and "english" in model["languages"]
    r = speech(server.url, input="Metrics, please.")
    assert r.status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ("mkport_time_to_first_audio_seconds_count", "mkport_real_time_factor_count", "mkport_active_streams",
                 "mkport_queue_length", "mkport_rejected_requests_total", "mkport_streams_total", "mkport_underruns_total"):
        assert name in text, name
    assert server.metric("mkport_time_to_first_audio_seconds_count") >= 1
    assert server.metric('mkport_streams_total{outcome="completed"}') >= 1
    for part in ("join", "frame", "codec"):  # the scheduler's time, by part: all three ran for the request
        assert server.metric(f'mkport_scheduler_seconds_total{{part="{part}"}}') > 0, part


REQUESTS = [dict(input=text, seed=seed, voice=voice, response_format=fmt)
            for text, seed, voice, fmt in [
                ("Hello there, how are you?", 0, None, "wav"), ("The weather is fine today.", 1, "serena", "wav"),
                ("Hello there, how are you?", 7, None, "pcm"), ("One, two, three.", 2, "vivian", "wav"),
                ("Your order has shipped.", 3, "vivian", "pcm"), ("Good night!", 4, None, "wav"),
                ("Please hold the line.", 5, "aiden", "wav"), ("See you soon.", 6, None, "pcm")]]


def at_once(url: str, bodies: list[dict]) -> list[tuple]:
    """The requests sent together (a barrier): (status, bytes, first bytes' time, end time) of each."""
    results: list = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies))

    def run(i: int) -> None:
        with httpx.Client(timeout=120) as client:
            barrier.wait()
            first, data = None, b""
            with client.stream("POST", url + "/v1/audio/speech", json={"max_frames": FRAMES, **bodies[i]}) as r:
                for chunk in r.iter_bytes():
                    first = first or time.monotonic()
                    data += chunk
            results[i] = (r.status_code, data, first, time.monotonic())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(r is not None for r in results), "a request did not finish"
    return results


def test_concurrent_streams_equal_alone(server):
    """8 requests at once all complete with valid audio, each the same bytes as when it was served alone;
    the new requests get their first audio before any stream ends (new requests first)."""
    alone = []
    for body in REQUESTS:
        r = speech(server.url, **body)
        assert r.status_code == 200, r.text
        alone.append(r.content)
    results = at_once(server.url, REQUESTS)
    for body, solo, (status, data, _, _) in zip(REQUESTS, alone, results):
        assert status == 200
        samples = wav_samples(data) if body["response_format"] == "wav" else np.frombuffer(data, "<i2")
        check_audio(samples)
        assert data == solo, f"{body} differs under load"
    assert alone[0][44:] != alone[2], "different seeds gave the same audio"
    assert max(r[2] for r in results) < min(r[3] for r in results)


def test_batched_server_gives_each_stream_its_audio_alone(server, tts_cache, tmp_path_factory):
    """`--batched`: requests advanced together by one batch decoder pair, joining at different times, give the bytes
    each gives alone on the batched server, and the default server's audio up to float32 rounding (both decode a
    stream's frames with the codec state kept: the batched codec a frame at a time, the default server in growing
    chunks)."""
    default = [speech(server.url, **body).content for body in REQUESTS[:4]]
    batched = Server(tts_cache, tmp_path_factory.mktemp("serve_batched") / "server.log", "--batched",
                     "--max-streams", "4", "--max-frames", "400")
    try:
        ready = httpx.get(batched.url + "/ready").json()
        assert ready["batched"] is True and ready["batches"] == [4, 1]
        alone = [speech(batched.url, **body).content for body in REQUESTS[:4]]
        results = at_once(batched.url, REQUESTS[:4])
        late = speech(batched.url, **REQUESTS[0])  # into a slot a finished stream left
        assert late.status_code == 200 and late.content == alone[0]
        for body, solo, other, (status, data, _, _) in zip(REQUESTS, alone, default, results):
            assert status == 200 and data == solo, f"{body} differs in the batch"
            assert same_audio(data, other, body["response_format"] == "wav"), f"{body}: not the default server's audio"
        assert batched.metric('mkport_streams_total{outcome="completed"}') == 9
        assert all(batched.metric(f'mkport_scheduler_seconds_total{{part="{part}"}}') > 0 for part in ("join", "frame", "codec"))
    finally:
        batched.stop()


@pytest.mark.parametrize("body, status, words", [
    ('{"input": "Hello"', 400, "not valid JSON"),
    ({"input": ""}, 400, "input is empty"),
    ({"input": "   "}, 400, "input is empty"),
    ({"input": "x" * 201}, 400, "at most 200"),
    ({"input": "Hi.", "voice": "klingon"}, 400, "unknown voice 'klingon'; supported: alloy"),
    ({"input": "Hi.", "language": "klingon"}, 400, "unknown language 'klingon'"),
    ({"input": "Hi.", "instructions": "Whisper."}, 400, "not supported by the 0.6B"),
    ({"input": "Hi.", "max_frames": 401}, 400, "must be 1..400"),
    ({"input": "Hi.", "seed": -1}, 400, "seed -1: a seed is an integer from 0 to 2**63-1"),
    ({"input": "Hi.", "pitch": 2}, 400, "pitch"),
    ({"voice": "aiden"}, 400, "input"),
    ({"input": "Hi.", "model": "tts-2"}, 404, "served: qwen3-tts-random-tiny"),
])
def test_bad_requests_get_one_line_4xx(server, body, status, words):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(server.url + "/v1/audio/speech", timeout=30, **kw)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert words in message and "\n" not in message


def test_busy_gives_503_and_a_disconnect_frees_the_slot(server):
    """Past --max-streams: 503 with Retry-After at once (a WebSocket: close code 1013); a client that goes
    away mid-stream frees its slot at once. Seven idle WebSocket sessions and one long stream hold the
    eight slots (a session holds its slot while open)."""
    rejected = server.metric('mkport_rejected_requests_total{reason="busy"}')
    cancelled = server.metric('mkport_streams_total{outcome="cancelled"}')
    with ExitStack() as stack:
        for _ in range(7):
            ws = stack.enter_context(connect(ws_url(server)))
            ws.send(json.dumps({"type": "start"}))
            reply = json.loads(ws.recv(timeout=30))
            assert reply["type"] == "ready", reply
        client = stack.enter_context(httpx.Client(timeout=120))
        long = client.stream("POST", server.url + "/v1/audio/speech", json={"input": "Long stream 0.", "max_frames": 400})
        r = long.__enter__()
        assert r.status_code == 200
        audio = r.iter_raw()  # kept: a dropped iterator closes the response
        next(audio)  # audio is flowing
        assert server.metric("mkport_active_streams") == 8
        t0 = time.monotonic()
        busy = speech(server.url, input="One more.")
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert time.monotonic() - t0 < 5 and "busy" in busy.json()["error"]["message"]
        with connect(ws_url(server)) as ws:
            ws.send(json.dumps({"type": "start"}))
            assert "busy" in json.loads(ws.recv(timeout=30))["message"]
            with pytest.raises(Exception):
                ws.recv(timeout=30)
            assert ws.close_code == 1013
        assert server.metric('mkport_rejected_requests_total{reason="busy"}') == rejected + 2
        long.__exit__(None, None, None)
        client.close()
        t0 = time.monotonic()
        while server.metric("mkport_active_streams") > 7 and time.monotonic() - t0 < 30:
            time.sleep(0.02)
        assert time.monotonic() - t0 < 5, "the slot was not freed"
        r = speech(server.url, input="In the freed slot.", response_format="wav")
        assert r.status_code == 200, r.text
        check_audio(wav_samples(r.content))
        t0 = time.monotonic()
        while server.metric('mkport_streams_total{outcome="cancelled"}') < cancelled + 1 and time.monotonic() - t0 < 30:
            time.sleep(0.02)
        assert server.metric('mkport_streams_total{outcome="cancelled"}') == cancelled + 1
    t0 = time.monotonic()  # the sessions closed too
    while server.metric("mkport_active_streams") > 0 and time.monotonic() - t0 < 30:
        time.sleep(0.02)
    assert server.metric("mkport_active_streams") == 0


# -- WebSocket ----------------------------------------------------------------------------------------
def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/audio/speech/ws"


def receive_until(ws, kind: str) -> tuple[bytes, list[dict]]:
    audio, messages = b"", []
    while True:
        m = ws.recv(timeout=120)
        if isinstance(m, bytes):
            audio += m
            continue
        messages.append(json.loads(m))
        if messages[-1]["type"] == kind:
            return audio, messages


def test_websocket_session_end_to_end(server):
    """Pieces cut at sentence ends and at the flush; each utterance's audio equals the HTTP answer for its
    text; cancel drops what is pending and the session goes on."""
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"type": "start", "voice": "serena", "seed": 3, "max_frames": FRAMES}))
        ready = json.loads(ws.recv(timeout=30))
        assert ready == {"type": "ready", "sample_rate": RATE, "format": "pcm", "model": "qwen3-tts-random-tiny"}
        for piece in ("Hello the", "re. How are", " you", " today"):
            ws.send(json.dumps({"type": "text", "text": piece}))
        ws.send(json.dumps({"type": "flush"}))
        audio, messages = receive_until(ws, "done")
        done = messages[-1]
        assert [u["text"] for u in done["utterances"]] == ["Hello there.", "How are you today"]
        assert [m["type"] for m in messages] == ["done"]
        expected = b"".join(speech(server.url, input=u["text"], voice="serena", seed=3, response_format="pcm").content
                            for u in done["utterances"])
        assert audio == expected
        assert len(audio) / 2 / RATE == pytest.approx(done["audio_s"], abs=1e-3)
        for u in done["utterances"]:
            assert u["first_audio_ms"] > 0 and u["frames"] <= FRAMES and u["underruns"] >= 0
        ws.send(json.dumps({"type": "bogus"}))
        assert json.loads(ws.recv(timeout=30))["type"] == "error"
        ws.send(json.dumps({"type": "text", "text": "This one is interrupted. And this."}))
        ws.send(json.dumps({"type": "cancel"}))
        _, messages = receive_until(ws, "cancelled")
        ws.send(json.dumps({"type": "text", "text": "After the cancel"}))
        ws.send(json.dumps({"type": "flush"}))
        audio, messages = receive_until(ws, "done")
        assert [u["text"] for u in messages[-1]["utterances"]] == ["After the cancel"] and audio


def test_websocket_bad_start_is_refused(server):
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"type": "start", "voice": "klingon"}))
        message = json.loads(ws.recv(timeout=30))
        assert message["type"] == "error" and "unknown voice 'klingon'" in message["message"]
        with pytest.raises(Exception):
            ws.recv(timeout=30)
        assert ws.close_code == 1008


# -- clients ------------------------------------------------------------------------------------------
SPEAK_NO_TORCH = """
import sys
from mkport.cli import main
sys.argv = ["mkport", *sys.argv[1:]]
try:
    main()
finally:
    assert "torch" not in sys.modules, "mkport speak --server imported torch"
"""


def speak_remote(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SPEAK_NO_TORCH, "speak", *args], capture_output=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


def test_speak_through_the_server_without_torch(server, tmp_path):
    out = tmp_path / "a.wav"
    r = speak_remote("Hello there, how are you?", "--server", server.url, "--seed", "7", "--max-frames", str(FRAMES),
                     "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()
    http = speech(server.url, input="Hello there, how are you?", seed=7, response_format="pcm").content
    from mkport.tts.wav import read_wav

    rate, samples = read_wav(out)
    assert rate == RATE and np.array_equal(np.round(samples * 32767).astype("<i2"), np.frombuffer(http, "<i2"))
    # MKPORT_SERVER is the default URL; the WAV goes to stdout
    r = speak_remote("Hello there, how are you?", "--seed", "7", "--max-frames", str(FRAMES),
                     env={"MKPORT_SERVER": server.url})
    assert r.returncode == 0 and r.stdout[44:] == http


def test_speak_server_errors_are_one_line(server):
    r = speak_remote("Hi.", "--server", server.url, "--speaker", "klingon")
    assert r.returncode == 2 and b"unknown voice 'klingon'" in r.stderr and r.stderr.count(b"\n") == 1
    r = speak_remote("Hi.", "--server", server.url, "--random-weights", "tiny")
    assert r.returncode == 2 and b"--random-weights: not with --server" in r.stderr
    r = speak_remote("Hi.", "--server", "http://127.0.0.1:9")
    assert r.returncode == 2 and b"cannot reach mkport serve at http://127.0.0.1:9" in r.stderr


def test_loadtest_json(server):
    r = subprocess.run([sys.executable, "-m", "mkport.cli", "loadtest", server.url, "--rate", "3", "--duration", "2",
                        "--concurrency", "4", "--max-frames", "3", "--json"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    s = result["summary"]
    assert s["sent"] == s["arrivals"] - s["dropped"] and s["completed"] == s["sent"] >= 1 and s["errors"] == 0
    done = [q for q in result["requests"] if q["error"] is None]
    assert all(q["audio_s"] > 0 and q["ttfa_ms"] > 0 for q in done)
    assert s["ttfa_ms"]["p50"] <= s["ttfa_ms"]["p95"] <= s["ttfa_ms"]["p99"] == max(q["ttfa_ms"] for q in done)
    # the server's own first audio (its Server-Timing header) is part of the client's, the rest is outside it
    assert all(0 < q["server_ttfa_ms"] < q["ttfa_ms"] for q in done)
    assert s["outside_server_ms"]["max"] == round(max(q["ttfa_ms"] - q["server_ttfa_ms"] for q in done), 4)


def test_a_response_says_the_servers_own_time_to_first_audio(server):
    r = speech(server.url, input="How long did it take?")
    assert r.status_code == 200
    assert re.fullmatch(r"first-audio;dur=\d+\.\d\d", r.headers["server-timing"]), r.headers


def test_loadtest_closed_loop_keeps_its_streams_open(server):
    """--streams 2: two clients back to back; every request completes, never more than two overlap, and each
    client's next request starts as its last ends (the two overlap for most of the run)."""
    r = subprocess.run([sys.executable, "-m", "mkport.cli", "loadtest", server.url, "--streams", "2", "--duration", "3",
                        "--max-frames", "3", "--json"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    s, done = result["summary"], result["requests"]
    assert s["completed"] == s["sent"] == s["arrivals"] >= 4 and s["errors"] == s["dropped"] == 0
    # a request's span from its recorded start, rtf and audio (rounded to ms and 1e-4: ends pulled in by 2 ms)
    spans = [(q["at_s"], q["at_s"] + q["rtf"] * q["audio_s"] - 0.002) for q in done]
    assert all(start <= 3.0 for start, _ in spans)  # none starts after --duration (2.9996 s is recorded as 3.0)
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    open_now = peak = 0
    for _, step in events:
        open_now += step
        peak = max(peak, open_now)
    assert peak == 2, peak


def test_loadtest_ramp_starts_the_clients_one_after_another(server):
    """--streams 3 --ramp 1.5: client k starts at 0.5 k s; until then at most k requests are in flight."""
    from mkport.serve.loadtest import LoadSpec, run_loadtest

    result = run_loadtest(LoadSpec(url=server.url, duration_s=2.0, max_frames=2, streams=3, ramp_s=1.5))
    assert result["summary"]["errors"] == 0
    spans = [(q["at_s"], q["at_s"] + q["rtf"] * q["audio_s"] - 0.002) for q in result["requests"]]
    in_flight = lambda t: sum(a <= t < b for a, b in spans)  # noqa: E731
    assert max(in_flight(t / 100) for t in range(0, 50)) == 1
    assert max(in_flight(t / 100) for t in range(50, 100)) <= 2
    for k in (1, 2):  # client k's first request, once its start has come
        assert any(0.5 * k <= a < 0.5 * k + 0.2 for a, _ in spans), (k, sorted(spans))


@pytest.mark.parametrize("args, needle", [
    (["--rate", "2", "--streams", "4"], "--rate (open loop) or --streams (closed loop), not both"),
    (["--ramp", "2"], "--ramp spreads the starts of --streams clients: give --streams too"),
    (["--streams", "4", "--ramp", "30", "--duration", "10"], "--ramp 30: must be >= 0 and shorter than --duration")])
def test_loadtest_refuses_bad_loads_in_one_line(args, needle):
    r = subprocess.run([sys.executable, "-m", "mkport.cli", "loadtest", "http://127.0.0.1:9", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and needle in r.stderr
    assert r.stderr.strip().count("\n") == 0  # one line


# -- shutdown -----------------------------------------------------------------------------------------
def test_request_timeout_cuts_the_stream_then_sigterm_drains_and_exits(tts_cache, tmp_path):
    """A stream past --request-timeout is cut off (no closing chunk: the client sees an incomplete response);
    on SIGTERM the running stream finishes (within --shutdown-timeout), the app shuts down (decoders freed)
    and the process ends by the signal, as uvicorn re-raises it (or with 0)."""
    s = Server(tts_cache, tmp_path / "server.log", "--max-streams", "2", "--request-timeout", "6",
               "--shutdown-timeout", "60")
    try:
        with pytest.raises(httpx.RemoteProtocolError):
            with httpx.stream("POST", s.url + "/v1/audio/speech", timeout=120,
                              json={"input": "Long stream 0.", "max_frames": 1500, "response_format": "pcm"}) as r:
                assert r.status_code == 200
                for _ in r.iter_raw():
                    pass
        assert s.metric('mkport_streams_total{outcome="timeout"}') == 1
        with httpx.Client(timeout=120) as client, client.stream(
                "POST", s.url + "/v1/audio/speech",
                json={"input": "Finish me.", "max_frames": 12, "response_format": "wav"}) as r:
            it = r.iter_raw()
            data = next(it)
            s.proc.send_signal(signal.SIGTERM)
            data += b"".join(it)
        check_audio(wav_samples(data), 12)
        assert s.proc.wait(60) in (0, -signal.SIGTERM), s.tail()
        log = s.log.read_text()
        assert "Application shutdown complete" in log and "Traceback" not in log
        assert "stream cut off: request timed out after 6 s" in log
    finally:
        s.stop()


# -- Pipecat ------------------------------------------------------------------------------------------
def test_pipecat_service_produces_the_servers_audio_frames(server):
    """MkportTTSService in a Pipecat pipeline (Pipecat's run_test): a TTSSpeakFrame in, TTSStartedFrame,
    the audio as TTSAudioRawFrames (the same samples as the HTTP answer) and TTSStoppedFrame out."""
    pytest.importorskip("pipecat", reason="pipecat-ai is an optional extra: pip install -e '.[pipecat]'")
    import asyncio

    from pipecat.frames.frames import TTSAudioRawFrame, TTSSpeakFrame, TTSStartedFrame, TTSStoppedFrame
    from pipecat.tests.utils import run_test

    from mkport.integrations.pipecat import MkportTTSService

    tts = MkportTTSService(url=ws_url(server), seed=5, max_frames=FRAMES, sample_rate=RATE,
                           settings=MkportTTSService.Settings(voice="vivian", language="english"))
    down, _ = asyncio.run(run_test(tts, frames_to_send=[TTSSpeakFrame(text="Hello from Pipecat.")]))
    kinds = [type(f) for f in down]
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert kinds.index(TTSStartedFrame) < kinds.index(TTSAudioRawFrame) < kinds.index(TTSStoppedFrame)
    assert all(f.sample_rate == RATE and f.num_channels == 1 for f in audio)
    http = speech(server.url, input="Hello from Pipecat.", voice="vivian", language="english", seed=5,
                  response_format="pcm").content
    assert b"".join(f.audio for f in audio) == http


def test_pipecat_interruption_cancels_the_stream(server):
    """An interruption sends a cancel: the server drops the utterance (a cancelled stream), and the next
    sentence's frames carry only its own audio."""
    pytest.importorskip("pipecat", reason="pipecat-ai is an optional extra: pip install -e '.[pipecat]'")
    import asyncio

    from pipecat.frames.frames import InterruptionFrame, TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.tests.utils import SleepFrame, run_test

    from mkport.integrations.pipecat import MkportTTSService

    cancelled = server.metric('mkport_streams_total{outcome="cancelled"}')
    tts = MkportTTSService(url=ws_url(server), seed=5, max_frames=400, sample_rate=RATE)
    frames = [TTSSpeakFrame(text="A long answer that is interrupted."), SleepFrame(sleep=1.0), InterruptionFrame(),
              TTSSpeakFrame(text="Short.")]
    down, _ = asyncio.run(run_test(tts, frames_to_send=frames))
    assert server.metric('mkport_streams_total{outcome="cancelled"}') >= cancelled + 1
    after = down[max(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame)):]
    short = speech(server.url, input="Short.", seed=5, max_frames=400, response_format="pcm").content
    assert b"".join(f.audio for f in after if isinstance(f, TTSAudioRawFrame)) == short


def test_serve_refuses_bad_options_in_one_line(tts_cache, tmp_path):
    import socket

    env = dict(os.environ, MKPORT_CACHE=str(tts_cache))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        for args, words in [(["--random-weights", "tiny", "--port", port], f"cannot listen on 127.0.0.1:{port}"),
                            (["--random-weights", "tiny", "--max-streams", "0"], "--max-streams 0: must be at least 1"),
                            (["--random-weights", "tiny", "--port", "70000"], "--port 70000: must be 0..65535"),
                            (["--random-weights", "tiny", "--port", "-1"], "--port -1: must be 0..65535"),
                            (["--random-weights", "tiny", "--log-level", "loud"],
                             "--log-level loud is not supported; supported: critical, error, warning, info, debug"),
                            (["--random-weights", "tiny", "--fixed-batch"],
                             "--fixed-batch sizes the frames of --batched: give both, or neither"),
                            (["--random-weights", "tiny", "--batch-invariant"],
                             "--batch-invariant sizes the frames of --batched"),
                            (["--random-weights", "tiny", "--batched", "--fixed-batch", "--batch-invariant"],
                             "--batch-invariant and --fixed-batch: every frame at the full size is invariant already"),
                            (["--random-weights", "tiny", "--batched", "--max-streams", "300"],
                             "--max-streams 300 with --batched: 1 to 256"),
                            (["--random-weights", "tiny", "--batched", "--frames-per-turn", "9"],
                             "--frames-per-turn 9: 1 to 8"),
                            (["--random-weights", "tiny", "--frames-per-turn", "4"],
                             "--frames-per-turn makes the turns of --batched: give both, or neither"),
                            (["--random-weights", "tiny", "--batch-size", "4"],
                             "--batch-size sizes the batches of --batched: give both, or neither"),
                            (["--random-weights", "tiny", "--batched", "--batch-size", "12"],
                             "--batch-size 12: one of 1, 2, 4, 8, 16, 24, 32"),
                            (["--random-weights", "tiny", "--codec-sms", "-1"],
                             "--codec-sms -1: the codec's SMs, at least 1 (0: serial)"),
                            (["--random-weights", "tiny", "--codec-sms", "4"],
                             "--codec-sms 4 runs the codec beside the batch decoders of --batched"),
                            (["--random-weights", "tiny", "--batched", "--codec-sms", "4"],
                             "--codec-sms 4 splits the SMs between the megakernels (their grid) and the codec; the "
                             "reference backend has no grid"),
                            (["--random-weights", "tiny", "--compile-codec"],
                             "--compile-codec compiles the codec's CUDA graphs: it needs a CUDA GPU"),
                            (["--model", str(tmp_path)], "lacks config.json"),
                            (["--random-weights", "huge"], "unknown --random-weights 'huge'; supported: 0.6b, 1.7b, tiny")]:
            r = subprocess.run([sys.executable, "-m", "mkport.cli", "serve", "--backend", "reference", *args],
                               capture_output=True, text=True, env=env, timeout=120)
            assert r.returncode == 2 and words in r.stderr and r.stderr.startswith("error:"), (args, r.stderr)
