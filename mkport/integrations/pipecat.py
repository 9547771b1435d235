"""A Pipecat TTSService that speaks through `mkport serve` over its WebSocket (pip install -e '.[pipecat]').

    tts = MkportTTSService(url="ws://127.0.0.1:8000/v1/audio/speech/ws",
                           settings=MkportTTSService.Settings(voice="vivian", language=Language.EN))

One WebSocket session per service (it holds one of the server's stream slots while the pipeline runs).
Pipecat already cuts the LLM's text into sentences; each one is sent as a text piece and a flush, and its
audio frames go downstream as the server sends them. An interruption sends a cancel: the server drops
the utterance it is speaking and the text it holds, and the audio that was already under way is skipped.
examples/voice_agent.py is a whole voice agent with it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from loguru import logger
from pipecat.frames.frames import CancelFrame, EndFrame, ErrorFrame, Frame, StartFrame
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TTSService
from pipecat.transcriptions.language import Language
from websockets.asyncio.client import ClientConnection, connect

DEFAULT_URL = "ws://127.0.0.1:8000/v1/audio/speech/ws"
# Pipecat's language codes (their base) -> the language names of the Qwen3-TTS configs
LANGUAGES = {"en": "english", "zh": "chinese", "fr": "french", "de": "german", "it": "italian", "ja": "japanese",
             "ko": "korean", "pt": "portuguese", "ru": "russian", "es": "spanish"}


@dataclass
class MkportTTSSettings(TTSSettings):
    """voice: a speaker of the served model (None: its default); language: a Language or a config name."""


class MkportTTSService(TTSService):
    Settings = MkportTTSSettings
    _settings: Settings

    def __init__(self, *, url: str = DEFAULT_URL, seed: int = 0, max_frames: int | None = None,
                 settings: Settings | None = None, **kwargs):
        defaults = self.Settings(model=None, voice=None, language=None)
        if settings is not None:
            defaults.apply_update(settings)
        super().__init__(push_start_frame=True, push_stop_frames=True, settings=defaults, **kwargs)
        self._url, self._seed, self._max_frames = url, seed, max_frames
        self._ws: ClientConnection | None = None
        self._server_rate = 0
        self._unanswered_cancels = 0  # cancels sent whose "cancelled" has not come back yet

    def can_generate_metrics(self) -> bool:
        return True

    def language_to_service_language(self, language: Language) -> str | None:
        code = str(getattr(language, "value", language))
        return LANGUAGES.get(code.split("-")[0].lower(), code.lower())

    async def start(self, frame: StartFrame):
        await super().start(frame)
        await self._connect()

    async def stop(self, frame: EndFrame):
        await super().stop(frame)
        await self._disconnect()

    async def cancel(self, frame: CancelFrame):
        await super().cancel(frame)
        await self._disconnect()

    async def _update_settings(self, delta: Settings) -> dict[str, Any]:
        changed = await super()._update_settings(delta)
        if changed.keys() & {"voice", "language"}:  # a session's voice is set at its start
            await self._disconnect()
            await self._connect()
        return changed

    async def _connect(self) -> None:
        start = {"type": "start", "voice": self._settings.voice, "language": self._settings.language or "auto",
                 "seed": self._seed, "max_frames": self._max_frames, "response_format": "pcm"}
        self._ws = await connect(self._url, max_size=None)
        await self._ws.send(json.dumps({k: v for k, v in start.items() if v is not None}))
        reply = json.loads(await self._ws.recv())
        if reply.get("type") != "ready":
            await self._disconnect()
            raise RuntimeError(f"mkport serve at {self._url} refused the session: {reply.get('message', reply)}")
        self._server_rate = int(reply["sample_rate"])
        self._unanswered_cancels = 0
        await self._call_event_handler("on_connected")

    async def _disconnect(self) -> None:
        if self._ws is not None:
            ws, self._ws = self._ws, None
            await ws.close()
            await self._call_event_handler("on_disconnected")

    async def on_audio_context_interrupted(self, context_id: str):
        await self._send_cancel()
        await super().on_audio_context_interrupted(context_id)

    async def _send_cancel(self) -> None:
        if self._ws is not None:
            await self._ws.send(json.dumps({"type": "cancel"}))
            self._unanswered_cancels += 1

    async def _messages(self) -> AsyncGenerator[bytes | dict, None]:
        """Server messages, with those of cancelled utterances (up to each "cancelled") left out."""
        while True:
            raw = await self._ws.recv()
            if self._unanswered_cancels:
                if not isinstance(raw, bytes) and json.loads(raw).get("type") == "cancelled":
                    self._unanswered_cancels -= 1
                continue
            yield raw if isinstance(raw, bytes) else json.loads(raw)

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        if self._ws is None:
            await self._connect()
        errors: list[str] = []

        async def audio() -> AsyncGenerator[bytes, None]:
            async for message in self._messages():
                if isinstance(message, bytes):
                    yield message
                elif message.get("type") == "error":
                    errors.append(message["message"])
                elif message.get("type") == "done":
                    return

        await self.start_tts_usage_metrics(text)
        await self._ws.send(json.dumps({"type": "text", "text": text}))
        await self._ws.send(json.dumps({"type": "flush"}))
        finished = False
        try:
            async for frame in self._stream_audio_frames_from_iterator(
                    audio(), in_sample_rate=self._server_rate, context_id=context_id):
                await self.stop_ttfb_metrics()
                yield frame
            finished = True
        finally:
            if not finished and self._ws is not None:  # interrupted while its audio was under way
                await self._send_cancel()
            await self.stop_ttfb_metrics()
        for error in errors:
            logger.error(f"{self}: {error}")
            yield ErrorFrame(error=f"mkport serve: {error}")
