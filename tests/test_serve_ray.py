"""The mkport serve app as a Ray Serve deployment (mkport.integrations.ray_serve), on a local Ray with the tiny
model and the reference backend: the same HTTP and WebSocket answers through Ray's proxy. Ray is an optional
extra (pip install -e '.[ray]'), not in `dev`: its protobuf 7 conflicts with pipecat-ai's (< 7)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import time
from pathlib import Path

import httpx
import pytest

import mkport

pytest.importorskip("ray.serve", reason="Ray Serve is an optional extra: pip install -e '.[ray]'")
if importlib.util.find_spec("qwen_tts") is None:
    pytest.skip("the official Qwen3-TTS code (pip install --no-deps qwen-tts-hf) is needed for the codec",
                allow_module_level=True)

import ray  # noqa: E402
from ray import serve  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from mkport.integrations.ray_serve import deployment  # noqa: E402
from mkport.serve.config import ServeConfig  # noqa: E402
from mkport.tts.model import write_random_tts_model  # noqa: E402


def test_ray_serve_deployment_serves_http_and_websocket(tmp_path):
    folder = write_random_tts_model(tmp_path / "tiny", "tiny", seed=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(Path(mkport.__file__).resolve().parents[1])
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServeConfig(folder=folder, model_id="tiny", backend="reference", max_streams=2, max_frames=6)
        serve.run(deployment(config), route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "the replica was not ready within 240 s"
            time.sleep(0.5)
        r = httpx.post(url + "/v1/audio/speech", json={"input": "Hello there.", "seed": 3, "response_format": "pcm"},
                       timeout=120)
        assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
        assert 0 < len(r.content) <= 6 * 1920 * 2 and len(r.content) % (1920 * 2) == 0
        bad = httpx.post(url + "/v1/audio/speech", json={"input": ""}, timeout=30)
        assert bad.status_code == 400 and "input is empty" in bad.json()["error"]["message"]
        with connect(url.replace("http://", "ws://") + "/v1/audio/speech/ws") as ws:
            ws.send(json.dumps({"type": "start", "seed": 3}))
            assert json.loads(ws.recv(timeout=60))["type"] == "ready"
            ws.send(json.dumps({"type": "text", "text": "Hello there."}))
            ws.send(json.dumps({"type": "flush"}))
            audio = b""
            while isinstance(message := ws.recv(timeout=120), bytes):
                audio += message
            assert json.loads(message)["type"] == "done" and audio == r.content
    finally:
        serve.shutdown()
        ray.shutdown()
