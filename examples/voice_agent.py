"""A local voice agent: microphone -> Whisper -> an OpenAI-compatible LLM -> mkport serve -> speakers.

    mkport serve --model ~/models/Qwen3-TTS-12Hz-1.7B-CustomVoice          # in one terminal
    pip install -e '.[pipecat]' 'pipecat-ai[local,whisper,silero]'
    OPENAI_BASE_URL=http://127.0.0.1:8001/v1 OPENAI_MODEL=... python examples/voice_agent.py --voice vivian

The LLM is any server with OpenAI's chat API (vLLM, llama.cpp, Ollama, OpenAI itself); Whisper and the
VAD run on this machine. Speak, pause, and the agent answers; speak over it and it stops (the interruption
cancels the mkport stream). Not run in CI: it needs a microphone, speakers and an LLM.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair, LLMUserAggregatorParams
from pipecat.services.openai.llm import OpenAILLMService
from pipecat.services.whisper.stt import WhisperSTTService
from pipecat.transports.local.audio import LocalAudioTransport, LocalAudioTransportParams

from mkport.integrations.pipecat import MkportTTSService

SYSTEM = ("You are a friendly voice assistant. Answer in one to three short spoken sentences, with no lists, "
          "markdown or emoji.")


async def main(args: argparse.Namespace) -> None:
    transport = LocalAudioTransport(LocalAudioTransportParams(audio_in_enabled=True, audio_out_enabled=True))
    stt = WhisperSTTService()
    llm = OpenAILLMService(model=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"),
                           base_url=os.environ.get("OPENAI_BASE_URL"), api_key=os.environ.get("OPENAI_API_KEY", "none"))
    tts = MkportTTSService(url=args.server, settings=MkportTTSService.Settings(voice=args.voice, language=args.language))
    context = LLMContext([{"role": "system", "content": SYSTEM}])
    aggregators = LLMContextAggregatorPair(context, user_params=LLMUserAggregatorParams(vad_analyzer=SileroVADAnalyzer()))
    pipeline = Pipeline([transport.input(), stt, aggregators.user(), llm, tts, transport.output(), aggregators.assistant()])
    await PipelineRunner().run(PipelineWorker(pipeline))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="ws://127.0.0.1:8000/v1/audio/speech/ws", help="mkport serve's WebSocket")
    parser.add_argument("--voice", default=None, help="a voice of the served model (GET /v1/models lists them)")
    parser.add_argument("--language", default="english", help="a language of the served model, or auto")
    asyncio.run(main(parser.parse_args()))
