"""faster-qwen3-tts as a one-shot process, timed as `mkport speak --verbose` times itself (docs/benchmarks.md,
"First audio"): seconds from the process's start to its imports, its model loaded, its first audio chunk on the
host, and its last.

    python3 scripts/oneshot_faster.py MODEL_DIR "text" [--max-frames 60]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mkport.bench.timing import Steps

steps = Steps("python start")
import torch  # noqa: E402  (timed: the imports are part of a one-shot run)
import qwen_tts  # noqa: E402,F401  (registers the RoPE initialiser adapt_rope_shim wraps: mkport/tts/bench_tts.py)
from faster_qwen3_tts import FasterQwen3TTS  # noqa: E402

from mkport.tts.official import adapt_rope_shim  # noqa: E402
from mkport.tts.prompt import TtsConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("text")
    ap.add_argument("--max-frames", type=int, default=60)
    args = ap.parse_args()
    steps.mark("import torch, faster_qwen3_tts")
    torch.zeros(1, device="cuda")
    steps.mark("CUDA start")
    adapt_rope_shim()
    model = FasterQwen3TTS.from_pretrained(args.model, device="cuda", dtype=torch.bfloat16)
    steps.mark("model loaded")
    speaker = TtsConfig.from_dict(json.loads((Path(args.model) / "config.json").read_text())).default_speaker
    samples = 0
    for i, (audio, _, _) in enumerate(model.generate_custom_voice_streaming(
            text=args.text, speaker=speaker, language="auto", max_new_tokens=args.max_frames, chunk_size=1)):
        samples += len(audio)
        if i == 0:
            steps.mark("first audio chunk on the host")
    steps.mark(f"the rest: {samples / 24000:.2f} s of audio")
    print("\n".join(steps.lines("faster-qwen3-tts one-shot: where the time went (seconds)")), flush=True)
    print(f"total {time.perf_counter() - steps.start:.3f} s since the process started")


if __name__ == "__main__":
    main()
