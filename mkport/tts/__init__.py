"""Qwen3-TTS-12Hz end to end: prompt building, the frame loop (talker + code predictor on the megakernel or
in plain torch), the streaming speech-tokenizer decode and a streaming WAV writer. See docs/tts.md."""
