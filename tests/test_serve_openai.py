"""OpenAI clients, unchanged: the official `openai` SDK with its defaults (mp3) against `mkport serve` (the tiny
random model, reference backend, 127.0.0.1), model aliases, OpenAI's voice names and --voice-map, every
response_format decoded with PyAV, speed, instructions and stream_format sse. The encoder's streaming is checked
without a server."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import av
import httpx
import numpy as np
import pytest

from test_serve import FRAMES, RATE, SPF, Server, speech, tts_cache  # noqa: F401  (tts_cache: a fixture)

from mkport.serve.audio import FORMATS, AudioEncoder
from mkport.serve.voices import MODEL_ALIASES, OPENAI_VOICES
from mkport.tts.model import write_random_tts_model

ROOT = Path(__file__).resolve().parents[1]
TINY_SPEAKERS = ["aiden", "eric", "serena", "vivian"]


@pytest.fixture(scope="module")
def server(tts_cache, tmp_path_factory):  # noqa: F811
    s = Server(tts_cache, tmp_path_factory.mktemp("serve_openai") / "server.log", "--max-streams", "4",
               "--max-frames", "400")
    yield s
    s.stop()


def decode(data: bytes) -> tuple[int, np.ndarray, str]:
    """(sample rate, mono float samples, codec name) of an encoded response, by PyAV."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        samples = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream)])
        return stream.rate, samples.astype(np.float64) / (32768 if samples.dtype == np.int16 else 1), stream.codec_context.name


def check_decoded(data: bytes, seconds: float, rate: int = RATE, tolerance_s: float = 0.1) -> np.ndarray:
    got_rate, samples, _ = decode(data)
    assert got_rate == rate
    assert samples.size / rate == pytest.approx(seconds, abs=tolerance_s)
    assert samples.std() > 1e-3  # not silence
    return samples


def pcm_of(server, **body) -> bytes:
    r = speech(server.url, response_format="pcm", **body)
    assert r.status_code == 200, r.text
    return r.content


# -- the SDK ------------------------------------------------------------------------------------------------------
def test_openai_sdk_defaults_give_mp3(server):
    """client.audio.speech.create(model="tts-1", voice="alloy", input=...) as OpenAI's docs write it: the mp3 it
    gets decodes to the request's audio (24 kHz, as long as the PCM of the same request, not silence). The one
    field added, max_frames, only keeps the request short: random weights never end an utterance."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120)
    text = "Hello from the OpenAI client."
    response = client.audio.speech.create(model="tts-1", voice="alloy", input=text,
                                          extra_body={"max_frames": FRAMES})
    assert response.response.headers["content-type"] == "audio/mpeg"
    rate, samples, codec = decode(response.content)
    assert codec.startswith("mp3")
    pcm = pcm_of(server, input=text, voice=OPENAI_VOICES["alloy"], max_frames=FRAMES)
    check_decoded(response.content, len(pcm) / 2 / RATE)
    with client.audio.speech.with_streaming_response.create(model="gpt-4o-mini-tts", voice="nova", input=text,
                                                            response_format="wav", extra_body={"max_frames": FRAMES}) as r:
        wav = r.read()
    assert wav[:4] == b"RIFF" and len(wav) == 44 + FRAMES * SPF * 2
    assert {m.id for m in client.models.list().data} >= {"qwen3-tts-random-tiny", *MODEL_ALIASES}


def test_models_and_voices_list_the_aliases_and_the_voice_table(server):
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["qwen3-tts-random-tiny", *MODEL_ALIASES]
    assert data[0]["aliases"] == list(MODEL_ALIASES) and data[0]["random_weights"] is True
    assert all(m["alias_of"] == "qwen3-tts-random-tiny" for m in data[1:])
    assert data[0]["response_formats"] == ["mp3", "opus", "aac", "flac", "wav", "pcm"]
    assert httpx.get(server.url + "/ready").json()["random_weights"] is True
    voices = httpx.get(server.url + "/v1/audio/voices").json()
    table = {v["id"]: v["speaker"] for v in voices["voices"]}
    # the tiny model has four of the nine speakers: the OpenAI voices of those four, then the speakers' own names
    want = {name: s for name, s in OPENAI_VOICES.items() if s in TINY_SPEAKERS} | {s: s for s in TINY_SPEAKERS}
    assert table == want and list(table)[-4:] == TINY_SPEAKERS and voices["default_voice"] in TINY_SPEAKERS
    assert "alloy" in table and "onyx" not in table  # onyx is uncle_fu, whom the tiny model lacks


def test_the_docs_show_the_voice_table():
    """docs/serving.md's table of OpenAI's voices is the one the server uses."""
    text = (ROOT / "docs" / "serving.md").read_text()
    rows = dict(tuple(c.strip(" `") for c in line.strip("|").split("|")[:2])
                for line in text.splitlines() if line.startswith("| `") and line.count("|") == 4)
    assert {k: v for k, v in rows.items() if k in OPENAI_VOICES} == OPENAI_VOICES


def test_aliases_and_voices_give_the_speakers_audio(server):
    """Every alias is the served model; an OpenAI voice is its speaker's audio, byte for byte; speakers' own names
    and any case keep working."""
    want = pcm_of(server, input="Same words.", voice="serena", max_frames=FRAMES)
    for model in MODEL_ALIASES + ("qwen3-tts-random-tiny",):
        assert pcm_of(server, input="Same words.", voice="alloy", model=model, max_frames=FRAMES) == want
    assert pcm_of(server, input="Same words.", voice="Sage", max_frames=FRAMES) == want
    assert pcm_of(server, input="Same words.", voice="SERENA", max_frames=FRAMES) == want
    assert pcm_of(server, input="Same words.", voice="ash", max_frames=FRAMES) != want  # aiden


@pytest.mark.parametrize("body, status, words", [
    ({"voice": "klingon"}, 400, "unknown voice 'klingon'; supported: alloy, ash, coral, nova, sage, verse, cedar, aiden"),
    ({"voice": "onyx"}, 400, "unknown voice 'onyx'"),  # mapped to a speaker the tiny model lacks
    ({"response_format": "ogg"}, 400, "'ogg' is not supported; supported: mp3, opus, aac, flac, wav, pcm"),
    ({"speed": 4.5}, 400, "speed=4.5: must be 0.25 to 4"),
    ({"speed": 0.2}, 400, "speed=0.2: must be 0.25 to 4"),
    ({"stream_format": "json"}, 400, "stream_format: Input should be 'audio' or 'sse'"),
    ({"instructions": "Whisper."}, 400, "not supported by the 0.6B"),
    ({"model": "tts-2"}, 404, "model 'tts-2' is not served here; served: qwen3-tts-random-tiny, tts-1, tts-1-hd, "
                              "gpt-4o-mini-tts"),
])
def test_openai_fields_out_of_range_are_one_line_4xx(server, body, status, words):
    r = httpx.post(server.url + "/v1/audio/speech", json={"input": "Hi.", **body}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and "\n" not in error["message"] and error["code"] == status


# -- formats, speed, sse ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, codec, rate", [("mp3", "mp3", RATE), ("opus", "opus", 48000), ("aac", "aac", RATE),
                                              ("flac", "flac", RATE)])
def test_each_format_decodes_to_the_requests_audio(server, fmt, codec, rate):
    """The encoded response decodes (PyAV) to audio as long as the request's PCM, with the right media type; the
    lossless flac gives the PCM's samples exactly. (Ogg Opus always decodes at 48 kHz.)"""
    body = dict(input="Each format, please.", voice="vivian", seed=4, max_frames=FRAMES)
    pcm = pcm_of(server, **body)
    r = speech(server.url, response_format=fmt, **body)
    assert r.status_code == 200 and r.headers["content-type"] == FORMATS[fmt][0]
    assert decode(r.content)[2].startswith(codec)
    samples = check_decoded(r.content, len(pcm) / 2 / RATE, rate)
    if fmt == "flac":
        assert np.array_equal(np.round(samples * 32768).astype("<i2").tobytes(), pcm)


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_encoded_audio_leaves_as_it_is_made(server, fmt):
    """An encoded response streams: its first bytes arrive long before its end (60 frames, over a second on CPU),
    and in pieces: each codec chunk's encoding leaves when the chunk is made (the chunks grow to 16 frames: 60
    frames are 1, 1, 2, 4, 8, 16, 16 and 12 at the end)."""
    arrivals = []
    with httpx.Client(timeout=120) as client:
        t0 = time.monotonic()
        with client.stream("POST", server.url + "/v1/audio/speech",
                           json={"input": "A longer one, streamed.", "response_format": fmt, "max_frames": 60}) as r:
            for piece in r.iter_raw():
                arrivals.append(time.monotonic() - t0)
    assert r.status_code == 200
    assert arrivals[0] < arrivals[-1] / 3 and len(arrivals) >= 6, arrivals


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
def test_speed_changes_the_duration(server, speed):
    body = dict(input="Faster or slower.", seed=2, max_frames=FRAMES)
    pcm = pcm_of(server, **body)
    r = speech(server.url, response_format="wav", speed=speed, **body)
    assert r.status_code == 200
    stretched = np.frombuffer(r.content[44:], "<i2")
    # atempo works in windows of the input: the edges may lose up to ~60 ms of input (content-dependent; seen: 28 ms
    # at 0.25, two filters chained, 53 ms at 4), which is 60 ms / speed of output; unstretched audio is far outside
    assert stretched.size / RATE == pytest.approx(len(pcm) / 2 / RATE / speed, rel=0.02, abs=0.06 / speed)
    assert stretched.std() > 0
    r = speech(server.url, response_format="mp3", speed=speed, **body)
    check_decoded(r.content, len(pcm) / 2 / RATE / speed, tolerance_s=0.1)


def sse_events(text: str) -> list[dict]:
    blocks = [b for b in text.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks)
    return [json.loads(b[len("data: "):]) for b in blocks]


@pytest.mark.parametrize("fmt", ["pcm", "mp3"])
def test_sse_stream_carries_the_audio_in_events(server, fmt):
    """stream_format sse: speech.audio.delta events whose base64 audio joins to the raw response, then
    speech.audio.done with the usage (output tokens: the frames)."""
    body = dict(input="Events, please.", seed=6, max_frames=FRAMES, response_format=fmt)
    raw = speech(server.url, **body).content
    r = speech(server.url, stream_format="sse", **body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1) and len(events) > 2
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == raw
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["output_tokens"] == FRAMES and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_encoder_streams_before_the_end():
    """Each format gives most of its bytes while audio is still coming (not all at finish()), and the bytes
    decode to the audio pushed."""
    t = np.arange(10 * SPF) / RATE
    pcm = (np.sin(2 * np.pi * 440 * t) * 8000).astype("<i2")
    for fmt in ("mp3", "opus", "aac", "flac"):
        encoder = AudioEncoder(fmt, RATE)
        early = b"".join(encoder.push(pcm[i * SPF:(i + 1) * SPF].tobytes()) for i in range(10))
        rest = encoder.finish()
        assert len(early) > 2 * len(rest), (fmt, len(early), len(rest))
        check_decoded(early + rest, 10 * SPF / RATE, 48000 if fmt == "opus" else RATE, tolerance_s=0.1)
    encoder = AudioEncoder("pcm", RATE)
    assert encoder.push(pcm.tobytes()) == pcm.tobytes() and encoder.finish() == b""


def test_websocket_sessions_take_openai_voices(server):
    from websockets.sync.client import connect

    with connect(server.url.replace("http://", "ws://") + "/v1/audio/speech/ws") as ws:
        ws.send(json.dumps({"type": "start", "voice": "alloy", "seed": 3, "max_frames": FRAMES}))
        assert json.loads(ws.recv(timeout=30))["type"] == "ready"
        ws.send(json.dumps({"type": "text", "text": "Hello there."}))
        ws.send(json.dumps({"type": "flush"}))
        audio = b""
        while isinstance(message := ws.recv(timeout=120), bytes):
            audio += message
        assert json.loads(message)["type"] == "done"
    assert audio == pcm_of(server, input="Hello there.", voice=OPENAI_VOICES["alloy"], seed=3, max_frames=FRAMES)


# -- instructions and --voice-map: their own servers --------------------------------------------------------------
def test_instructions_reach_a_model_that_takes_them(tmp_path_factory):
    """A model that takes an instruct prompt (the tiny model relabelled 1.7B): OpenAI's `instructions` field
    changes the audio, and /v1/models says the model takes it."""
    cache = tmp_path_factory.mktemp("serve_1b7")
    folder = write_random_tts_model(cache / "tts-random" / "tiny-0", "tiny", seed=0)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "tts_model_size": "1b7"}))
    s = Server(cache, cache / "server.log", "--max-streams", "2", "--max-frames", "400")
    try:
        assert httpx.get(s.url + "/v1/models").json()["data"][0]["instructions"] is True
        plain = pcm_of(s, input="Hello there.", max_frames=FRAMES)
        styled = pcm_of(s, input="Hello there.", instructions="Speak slowly and whisper.", max_frames=FRAMES)
        again = pcm_of(s, input="Hello there.", instructions="Speak slowly and whisper.", max_frames=FRAMES)
        assert styled == again and styled != plain
    finally:
        s.stop()


def test_voice_map_replaces_the_table(tts_cache, tmp_path):  # noqa: F811
    voice_map = tmp_path / "voices.json"
    voice_map.write_text(json.dumps({"alloy": "vivian", "narrator": "Aiden"}))
    s = Server(tts_cache, tmp_path / "server.log", "--max-streams", "2", "--max-frames", "400", "--voice-map",
               str(voice_map))
    try:
        table = {v["id"]: v["speaker"] for v in httpx.get(s.url + "/v1/audio/voices").json()["voices"]}
        assert table == {"alloy": "vivian", "narrator": "aiden", **{v: v for v in TINY_SPEAKERS}}
        assert pcm_of(s, input="Mapped.", voice="narrator", max_frames=FRAMES) == \
            pcm_of(s, input="Mapped.", voice="aiden", max_frames=FRAMES)
        r = speech(s.url, input="Hi.", voice="nova")
        assert r.status_code == 400 and "supported: alloy, narrator, aiden" in r.json()["error"]["message"]
    finally:
        s.stop()


@pytest.mark.parametrize("content, words", [
    ('{"alloy": "uncle_fu"}', "unknown speaker uncle_fu; the model's speakers: aiden, eric, serena, vivian"),
    ('["alloy"]', "expected a JSON object of voice names to speakers"),
    ("{alloy", "cannot read a JSON object"),
    ('{"aiden": "serena"}', "aiden is a speaker of the model; map other names"),
])
def test_a_bad_voice_map_stops_the_server_in_one_line(tts_cache, tmp_path, content, words):  # noqa: F811
    voice_map = tmp_path / "voices.json"
    voice_map.write_text(content)
    env = dict(os.environ, MKPORT_CACHE=str(tts_cache), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "mkport.cli", "serve", "--random-weights", "tiny", "--backend",
                        "reference", "--port", "0", "--voice-map", str(voice_map)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 2 and words in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
