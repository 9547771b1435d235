"""Times Qwen3-TTS frames of B requests advanced together on the megakernel (mkport.tts.batch), against B = 1
in the same process:

    python3 scripts/bench_tts_batch.py [--size 0.6b|1.7b] [--batches 1,4,8,16] [--frames 40] [--json FILE]

A frame is one talker step and the code predictor's 16 steps for every request; its time is the wall clock
from one frame's codes on the host to the next's (the loop copies the codes out at each frame). Reported: the
median frame time, its ratio to B = 1, and the real-time factor of each stream (frame time over the 80 ms of
audio a frame makes). Random weights; texts and seeds differ between the requests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mkport.errors import MkportError
from mkport.tts.batch import generate_frames_batch
from mkport.tts.model import TtsModel, random_model_folder
from mkport.tts.pipeline import TtsSampling, make_decoders
from mkport.tts.prompt import build_prompt

FRAME_AUDIO_S = 0.08


def frame_times(mk, batch: int, frames: int) -> list[float]:
    speaker = next(iter(mk.config.speakers))
    prompts = [build_prompt(mk.config, mk.encode, mk.text, mk.talker_weights.embed[0], f"Sentence number {b}, spoken.",
                            speaker, "auto") for b in range(batch)]
    samplings = [TtsSampling.from_generation_config(mk.generation, seed=b) for b in range(batch)]
    talker, predictor = make_decoders(mk, "megakernel", max(p.embeds.shape[0] for p in prompts) + frames + 1,
                                      batch)
    times, last = [], None
    for _ in generate_frames_batch(mk, prompts, talker, predictor, samplings, [frames] * batch):
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.6b")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--json")
    args = ap.parse_args()
    mk = TtsModel.load(random_model_folder(args.size, seed=0), device="cuda")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        try:
            frame_times(mk, batch, 4)  # builds and warms the batch's kernels
            ms = 1e3 * statistics.median(frame_times(mk, batch, args.frames))
        except MkportError as e:
            print(f"batch {batch}: {e}")
            continue
        rows.append({"batch": batch, "frame_ms": ms, "rtf_per_stream": ms / 1e3 / FRAME_AUDIO_S})
        torch.cuda.empty_cache()
    base = rows[0]["frame_ms"] if rows and rows[0]["batch"] == 1 else None
    print(f"Qwen3-TTS {args.size}: a frame of B requests (talker + 16 predictor steps), median of {args.frames}")
    for r in rows:
        ratio = f"{r['frame_ms'] / base:.2f}x" if base else ""
        print(f"  B={r['batch']:>2}  {r['frame_ms']:7.2f} ms  {ratio:>6}  RTF a stream {r['rtf_per_stream']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "frames": args.frames, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
