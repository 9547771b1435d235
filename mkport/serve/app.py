"""The HTTP and WebSocket app (FastAPI) over an engine (scheduler.Scheduler). Endpoints, formats and limits:
docs/serving.md.

Requests are checked here, on the event loop, before they take a slot: bad input is a 4xx with a one-line
message (OpenAI's error shape), and a full server a 503 with Retry-After, both at once. The response
starts when the stream's first audio chunk exists (or with a 4xx/5xx when the stream fails before it), so
an error that the scheduler finds (a prompt too long for the KV cache) is still a proper status code."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

import anyio
from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import MkportError
from ..runtime.sampling import check_seed
from ..tts.prompt import resolve_voice
from ..tts.wav import wav_header
from .audio import FORMATS, SPEEDS, AudioEncoder
from .scheduler import Scheduler
from .streams import PlaybackClock, RequestError, SpeechJob
from .utterances import DEFAULT_MAX_CHARS, DEFAULT_MAX_WAIT_S, UtteranceSplitter
from .voices import MODEL_ALIASES, voice_table

log = logging.getLogger("mkport.serve")

WS_FORMATS = ("wav", "pcm")  # a session's audio: binary messages of int16 PCM, the first one with a WAV header
RETRY_AFTER_S = 1
WS_START_TIMEOUT_S = 10.0
WS_TRY_AGAIN_LATER = 1013  # WebSocket close code: server overloaded or not ready
WS_POLICY_VIOLATION = 1008
STATIC = Path(__file__).parent / "static"  # the demo page at / (package data)


class SpeechRequest(BaseModel):
    """OpenAI's POST /v1/audio/speech body, plus language, seed and max_frames."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str
    voice: str | None = None
    response_format: str = "mp3"  # OpenAI's default
    speed: float = 1.0
    language: str = "auto"
    instructions: str | None = None
    seed: int = 0
    max_frames: int | None = None
    stream_format: Literal["audio", "sse"] = "audio"  # sse: OpenAI's server-sent audio events


class SessionStart(BaseModel):
    """The first message of a WebSocket session."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["start"]
    voice: str | None = None
    language: str = "auto"
    response_format: str = "pcm"
    instructions: str | None = None
    seed: int = 0
    max_frames: int | None = None
    max_wait_ms: float = DEFAULT_MAX_WAIT_S * 1e3
    max_chars: int | None = None  # default: DEFAULT_MAX_CHARS, or the server's --max-input-chars if lower


def error_body(status: int, message: str) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(status: int, message: str, retry: bool = False) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if retry else None
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def one_line(exc: ValidationError | RequestValidationError) -> str:
    """The first problem of a body that did not validate, on one line."""
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
    where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    return f"{where}: {err.get('msg')}" if where else str(err.get("msg"))


def sse_event(event: dict) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def server_timing(stream) -> dict:
    """The W3C Server-Timing header of a response: the server's own time to first audio (from the stream's arrival
    at the scheduler until its first chunk left it), so a client can tell it from the time on the way in and out."""
    if stream.first_audio_at is None:
        return {}
    return {"Server-Timing": f"first-audio;dur={(stream.first_audio_at - stream.arrival) * 1e3:.2f}"}


def poster(queue: asyncio.Queue):
    """A thread-safe `post(event)` for the scheduler, putting events on `queue` in this event loop."""
    loop = asyncio.get_running_loop()

    def post(event: tuple) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    return post


class AudioResponse(StreamingResponse):
    """A streaming response that runs `on_close` however it ends (finished, client gone, cancelled), even
    when its body never started; a stream that fails midway is cut off without the closing chunk, so the
    client sees an incomplete response rather than audio that looks complete."""

    def __init__(self, body, media_type: str, headers: dict, on_close):
        super().__init__(body, media_type=media_type, headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except RequestError as e:
            log.warning("stream cut off: %s", e)
        finally:
            self.on_close()


def create_app(engine: Scheduler) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        # every streamed response opens an anyio task group, and the first one imports anyio's asyncio backend:
        # 35 ms of the first request's time to first audio (py-spy, CPU machine), paid here instead
        async with anyio.create_task_group():
            pass
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="mkport serve", lifespan=lifespan)
    metrics = engine.metrics

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        metrics.rejected.labels("invalid").inc()
        return error_response(400, one_line(exc))

    def not_ready() -> str | None:
        if engine.draining:
            return "the server is shutting down"
        if not engine.ready:
            return "the model is loading; see GET /ready"
        return None

    def check_voice(voice, language, instructions, seed: int, max_frames) -> tuple[str | None, str]:
        """(speaker, language) from request fields, or a RequestError naming what is wrong and what is
        supported."""
        info, cfg = engine.info, engine.config
        try:
            check_seed(seed, "seed")
        except MkportError as e:
            raise RequestError(400, str(e)) from None
        if instructions and info.model_size == "0b6":
            raise RequestError(400, "instructions are not supported by the 0.6B models; use a 1.7B model")
        if max_frames is not None and not 1 <= max_frames <= cfg.max_frames:
            raise RequestError(400, f"max_frames={max_frames}: must be 1..{cfg.max_frames}")
        voices = voice_table(cfg.voice_map, info.speakers)
        if voice and voice.lower() not in voices:
            raise RequestError(400, f"unknown voice '{voice}'; supported: "
                                    f"{', '.join(voices) or 'none (the model has no speakers)'}")
        try:
            return resolve_voice(engine.model.config, voices[voice.lower()] if voice else info.default_speaker,
                                 language)
        except MkportError as e:
            raise RequestError(400, str(e)) from None

    def check_job(text: str, voice, language, instructions, seed: int, max_frames) -> SpeechJob:
        if not text.strip():
            raise RequestError(400, "input is empty: give the text to speak")
        limit = engine.config.max_input_chars
        if len(text) > limit:
            raise RequestError(400, f"input is {len(text)} characters; at most {limit}")
        speaker, language = check_voice(voice, language, instructions, seed, max_frames)
        return SpeechJob(text, speaker, language, instructions or None, seed, max_frames or engine.config.request_frames)

    def check_format(fmt: str, formats) -> None:
        if fmt not in formats:
            raise RequestError(400, f"response_format '{fmt}' is not supported; supported: {', '.join(formats)}")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def demo_page():
        return FileResponse(STATIC / "index.html")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if engine.error:
            return error_response(503, engine.error)
        reason = not_ready()
        if reason:
            return error_response(503, reason, retry=True)
        plan = engine.config.plan
        return {"status": "ready", "model": engine.info.model_id, "backend": engine.backend,
                "composition": engine.composition.label, "plan": str(plan) if plan else None,
                "max_streams": engine.config.max_streams, "batched": engine.config.batched,
                "batches": engine.batch_layout(), "frame_lanes": engine.frame_lanes(),
                "compiled_codec": bool(engine.config.compile_codec),
                "load_s": round(engine.load_s, 3), "warm_s": round(engine.warm_s, 3),
                "random_weights": engine.config.random_weights}

    @app.get("/v1/models")
    async def models():
        reason = not_ready()
        if reason:
            return error_response(503, reason, retry=True)
        info = engine.info
        return {"object": "list", "data": [{
            "id": info.model_id, "object": "model", "owned_by": "mkport", "model_type": info.model_type,
            "voices": info.speakers, "default_voice": info.default_speaker, "languages": ["auto"] + info.languages,
            "sample_rate": info.sample_rate, "response_formats": list(FORMATS),
            "instructions": info.model_size != "0b6", "aliases": list(MODEL_ALIASES),
            "random_weights": engine.config.random_weights}] + [
            {"id": alias, "object": "model", "owned_by": "mkport", "alias_of": info.model_id}
            for alias in MODEL_ALIASES]}

    @app.get("/v1/audio/voices")
    async def voices():
        reason = not_ready()
        if reason:
            return error_response(503, reason, retry=True)
        table = voice_table(engine.config.voice_map, engine.info.speakers)
        return {"voices": [{"id": name, "speaker": speaker} for name, speaker in table.items()],
                "default_voice": engine.info.default_speaker}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/audio/speech")
    async def speech(body: SpeechRequest):
        reason = not_ready()
        if reason:
            metrics.rejected.labels("not_ready").inc()
            return error_response(503, reason, retry=True)
        try:
            served = (engine.info.model_id, *MODEL_ALIASES)
            if body.model is not None and body.model not in served:
                raise RequestError(404, f"model '{body.model}' is not served here; served: {', '.join(served)}")
            check_format(body.response_format, FORMATS)
            if not SPEEDS[0] <= body.speed <= SPEEDS[1]:
                raise RequestError(400, f"speed={body.speed:g}: must be {SPEEDS[0]:g} to {SPEEDS[1]:g}")
            job = check_job(body.input, body.voice, body.language, body.instructions, body.seed, body.max_frames)
        except RequestError as e:
            metrics.rejected.labels("invalid").inc()
            return error_response(e.status, str(e))
        if not engine.try_admit():
            metrics.rejected.labels("busy").inc()
            return error_response(503, f"server busy: all {engine.config.max_streams} streams are in use; retry later",
                                  retry=True)
        events: asyncio.Queue = asyncio.Queue()
        stream = engine.submit(job, poster(events))
        closed = False

        def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                engine.cancel(stream)
                engine.release()

        try:
            first = await events.get()
        except BaseException:
            close()
            raise
        if first[0] == "error":
            close()
            return error_response(first[1].status, str(first[1]))

        encoder = AudioEncoder(body.response_format, engine.info.sample_rate, body.speed)
        sse = body.stream_format == "sse"

        def chunk(data: bytes) -> bytes:
            return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if sse else data

        async def encode(step, *args) -> bytes:  # off the event loop, which serves every stream, when it is work
            return await asyncio.to_thread(step, *args) if encoder.works else step(*args)

        async def audio():
            event = first
            while event[0] == "audio":
                if data := await encode(encoder.push, event[1]):
                    stream.sent_at = stream.sent_at or time.perf_counter()  # the server's debug timeline
                    yield chunk(data)
                event = await events.get()
            if event[0] == "error":
                raise event[1]
            if data := await encode(encoder.finish):
                yield chunk(data)
            if sse:  # the text's tokens in, the frames out
                tokens, frames = len(engine.model.encode(body.input)), event[1]["frames"]
                yield sse_event({"type": "speech.audio.done", "usage": {
                    "input_tokens": tokens, "output_tokens": frames, "total_tokens": tokens + frames}})

        headers = {"X-Sample-Rate": str(engine.info.sample_rate), **server_timing(stream)}
        media_type = "text/event-stream" if sse else FORMATS[body.response_format][0]
        return AudioResponse(audio(), media_type, headers, close)

    @app.websocket("/v1/audio/speech/ws")
    async def speech_ws(ws: WebSocket):
        await ws.accept()
        reason = not_ready()
        if reason:
            metrics.rejected.labels("not_ready").inc()
            return await _refuse(ws, reason, WS_TRY_AGAIN_LATER)
        try:
            start = SessionStart.model_validate_json(await asyncio.wait_for(ws.receive_text(), WS_START_TIMEOUT_S))
            check_format(start.response_format, WS_FORMATS)
            limit = engine.config.max_input_chars
            start.max_chars = start.max_chars or min(DEFAULT_MAX_CHARS, limit)
            if not 0 <= start.max_wait_ms <= 60_000 or not 1 <= start.max_chars <= limit:
                raise RequestError(400, f"max_wait_ms must be 0..60000 and max_chars 1..{limit}")
            check_voice(start.voice, start.language, start.instructions, start.seed, start.max_frames)
        except (ValidationError, RequestError) as e:
            metrics.rejected.labels("invalid").inc()
            return await _refuse(ws, one_line(e) if isinstance(e, ValidationError) else str(e), WS_POLICY_VIOLATION)
        except asyncio.TimeoutError:
            return await _refuse(ws, f"no start message within {WS_START_TIMEOUT_S:g} s", WS_POLICY_VIOLATION)
        except WebSocketDisconnect:
            return
        if not engine.try_admit():
            metrics.rejected.labels("busy").inc()
            return await _refuse(ws, f"server busy: all {engine.config.max_streams} streams are in use; retry later",
                                 WS_TRY_AGAIN_LATER)
        try:
            await Session(engine, ws, start, check_job).run()
        finally:
            engine.release()

    return app


async def _refuse(ws: WebSocket, message: str, code: int) -> None:
    try:
        await ws.send_json({"type": "error", "message": message})
        await ws.close(code, reason=message[:120])
    except (WebSocketDisconnect, RuntimeError):
        pass


FLUSH = object()


class Session:
    """One WebSocket session: text pieces in, cut into utterances (utterances.py), spoken one after another
    on the engine (one stream slot for the whole session); audio out as binary messages and, after each
    flush, a done message with the timings of the utterances spoken since the previous one.

    Client -> server (JSON text messages): start (first, once), {"type": "text", "text": ...},
    {"type": "flush"}, {"type": "cancel"} (drop buffered text and the utterance being spoken: an
    interruption). Server -> client: {"type": "ready", ...}, binary audio, {"type": "done", ...},
    {"type": "cancelled"}, {"type": "error", "message": ...} (the session goes on)."""

    def __init__(self, engine: Scheduler, ws: WebSocket, start: SessionStart, check_job):
        self.engine, self.ws, self.start, self.check_job = engine, ws, start, check_job
        self.splitter = UtteranceSplitter(start.max_chars, start.max_wait_ms / 1e3)
        self.clock = PlaybackClock()
        self.todo: asyncio.Queue = asyncio.Queue()
        self.spoken: list[dict] = []
        self.header = wav_header(engine.info.sample_rate, None) if start.response_format == "wav" else b""
        self.send_lock = asyncio.Lock()

    async def send(self, message: dict | bytes) -> None:
        async with self.send_lock:
            if isinstance(message, bytes):
                await self.ws.send_bytes(message)
            else:
                await self.ws.send_json(message)

    async def run(self) -> None:
        inbox: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            try:
                while True:
                    await inbox.put(await self.ws.receive_text())
            except (WebSocketDisconnect, RuntimeError, KeyError):  # closed, or a binary message
                await inbox.put(None)

        reader = asyncio.create_task(read())
        speaker = asyncio.create_task(self.speak_all())
        try:
            await self.send({"type": "ready", "sample_rate": self.engine.info.sample_rate,
                             "format": self.start.response_format, "model": self.engine.info.model_id})
            while True:
                try:
                    raw = await asyncio.wait_for(inbox.get(), self.splitter.wait_s())
                except asyncio.TimeoutError:
                    self.queue(self.splitter.due())
                    continue
                if raw is None:
                    return
                speaker = await self.handle(raw, speaker)
        except WebSocketDisconnect:
            return
        finally:
            reader.cancel()
            speaker.cancel()
            await asyncio.gather(reader, speaker, return_exceptions=True)

    def queue(self, utterances: list[str]) -> None:
        for text in utterances:
            self.todo.put_nowait(text)

    async def handle(self, raw: str, speaker: asyncio.Task) -> asyncio.Task:
        try:
            message = json.loads(raw)
            kind = message["type"] if isinstance(message, dict) else None
        except (ValueError, KeyError):
            kind, message = None, None
        if kind == "text" and isinstance(message.get("text"), str):
            self.queue(self.splitter.push(message["text"]))
        elif kind == "flush":
            self.queue(self.splitter.flush())
            self.todo.put_nowait(FLUSH)
        elif kind == "cancel":
            self.splitter.clear()
            speaker.cancel()
            await asyncio.gather(speaker, return_exceptions=True)
            self.todo, self.spoken = asyncio.Queue(), []
            await self.send({"type": "cancelled"})
            return asyncio.create_task(self.speak_all())
        else:
            await self.send({"type": "error", "message": "expected a JSON message of type text (with a string "
                             "'text'), flush or cancel"})
        return speaker

    async def speak_all(self) -> None:
        while True:
            item = await self.todo.get()
            if item is FLUSH:
                await self.send({"type": "done", "utterances": self.spoken,
                                 "audio_s": round(sum(u.get("audio_s", 0) for u in self.spoken), 4)})
                self.spoken = []
            else:
                await self.speak(item)

    async def speak(self, text: str) -> None:
        s = self.start
        try:
            job = self.check_job(text, s.voice, s.language, s.instructions, s.seed, s.max_frames)
        except RequestError as e:
            self.spoken.append({"text": text, "error": str(e)})
            await self.send({"type": "error", "message": str(e)})
            return
        events: asyncio.Queue = asyncio.Queue()
        stream = self.engine.submit(job, poster(events), self.clock)
        try:
            while True:
                kind, value = await events.get()
                if kind == "audio":
                    await self.send(self.header + value)
                    self.header = b""
                elif kind == "done":
                    self.spoken.append({"text": text, **value})
                    return
                else:
                    self.spoken.append({"text": text, "error": str(value)})
                    await self.send({"type": "error", "message": str(value)})
                    return
        finally:
            self.engine.cancel(stream)
