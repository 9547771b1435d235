"""`mkport speak --server URL`: the request goes to a running `mkport serve`, which is already warm, instead
of loading the model here. Standard library HTTP and no torch, so that the first WAV bytes leave soon
after the process starts."""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
import urllib.parse

from ..errors import MkportError

ENV_VAR = "MKPORT_SERVER"
READ_BYTES = 1 << 16


def server_url(flag: str | None, model_given: bool) -> str | None:
    """--server, else $MKPORT_SERVER unless a local model was asked for."""
    return flag or (None if model_given else os.environ.get(ENV_VAR) or None)


def _connection(url: str) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MkportError(f"--server '{url}' is not an http:// or https:// URL (e.g. http://127.0.0.1:8000)")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return kind(parts.hostname, parts.port, timeout=300), parts.path.rstrip("/")


def _error_message(resp: http.client.HTTPResponse) -> str:
    raw = resp.read()
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace").strip() or resp.reason


LOCAL_ONLY = ("model", "random_weights", "weights_seed", "backend", "text_mode", "greedy")  # options of a local `mkport speak`


def speak_remote(url: str, text: str, out: str, source, force: bool = False, **fields) -> None:
    """Streams the server's PCM for `text` into a WAV on `out` ('-': stdout; an existing file is replaced only
    with `force`) as it arrives. `fields`: voice,
    language, instructions, seed, max_frames of the request; `source(name)`: where the command's option came
    from (typer's Context.get_parameter_source). max_frames is sent only when given (the server's default is
    its own cap); the options of a local run are refused: the server's model and backend speak."""
    given = lambda name: source(name) is not None and source(name).name != "DEFAULT"  # noqa: E731
    local = ["--" + name.replace("_", "-") for name in LOCAL_ONLY if given(name)]
    if local:
        raise MkportError(f"{', '.join(local)}: not with --server (the server's model and backend speak); "
                          "drop them or the --server option")
    if not given("max_frames"):
        fields.pop("max_frames", None)
    if not text.strip():
        raise MkportError("text is empty: give the words to speak")
    from ..tts.wav import open_wav_output  # numpy, not torch

    t0 = time.perf_counter()
    conn, prefix = _connection(url)
    body = {"input": text, "response_format": "pcm", **{k: v for k, v in fields.items() if v is not None}}
    try:
        conn.request("POST", prefix + "/v1/audio/speech", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
    except OSError as e:
        raise MkportError(f"cannot reach mkport serve at {url}: {e.strerror or e} (start one with mkport serve, "
                          f"or set --server / ${ENV_VAR})") from None
    if resp.status != 200:
        raise MkportError(f"{url}: HTTP {resp.status}: {_error_message(resp)}")
    rate = int(resp.getheader("X-Sample-Rate", "24000"))
    import numpy as np

    first = None
    samples = 0
    try:
        with open_wav_output(out, rate, force=force) as wav:
            rest = b""
            while chunk := resp.read1(READ_BYTES):
                first = first or time.perf_counter()
                pcm, rest = rest + chunk, b""
                if len(pcm) % 2:
                    pcm, rest = pcm[:-1], pcm[-1:]
                # 16-bit in, 16-bit out: i / 32767 * 32767 rounds back to i exactly
                wav.write(np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767.0)
                samples += len(pcm) // 2
    except (http.client.HTTPException, OSError) as e:
        raise MkportError(f"{url}: the stream broke off after {samples / rate:.2f} s of audio ({type(e).__name__}: {e})") from None
    finally:
        conn.close()
    total = time.perf_counter() - t0
    print(f"mkport speak --server {url}: {samples / rate:.2f} s audio; first audio "
          f"{(first - t0) if first else float('nan'):.3f} s, total {total:.2f} s", file=sys.stderr)
