"""`mkport serve`: a streaming Qwen3-TTS server (OpenAI-compatible HTTP, a WebSocket for text in pieces),
its scheduler (many streams on one GPU), metrics, the `--server` client of `mkport speak` and `mkport
loadtest`. docs/serving.md describes it for users."""
