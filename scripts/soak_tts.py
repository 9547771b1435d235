"""Soak test of the Qwen3-TTS megakernel path in one process (docs/validation.md): many requests of mixed
lengths and random seeds until FRAMES frames were made, sampling GPU and host memory as it goes; then the
last request again on fresh decoders, whose codes must equal the soaked run's.

    python3 scripts/soak_tts.py [--size 0.6b] [--frames 20000] [--json FILE]

Exit 1 when memory grew past the bounds below or the codes differ; a hang is caught by the caller's timeout.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time

import torch

from mkport.tts.model import TtsModel, random_model_folder
from mkport.tts.pipeline import make_decoders, synthesize

SENTENCES = (
    "Hello.",
    "The weather is lovely today, so we should go for a walk by the river.",
    "Please confirm the meeting for Thursday at three.",
    "A megakernel runs every layer of a decode step in one launch.",
    "Numbers like 42 and 1,600 are read aloud as words.",
    "Short.",
    "This is a much longer sentence that goes on for a while, with commas, pauses and a question at the end?",
)
WARM_UP_REQUESTS = 20  # first uses (prefill graph buckets, codec graphs) allocate once; growth counts from here
GPU_GROWTH_BOUND = 16 << 20  # bytes of allocated GPU memory the soak may add after the warm-up requests
HOST_GROWTH_BOUND = 256 << 20  # bytes of peak resident host memory likewise


def host_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def request(model, decoders, text, seed, frames):
    codes = []
    for _ in synthesize(model, text, backend="megakernel", seed=seed, max_frames=frames, frames_out=codes,
                        decoders=decoders):
        pass
    return torch.stack(codes) if codes else torch.zeros(0, 16, dtype=torch.long)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="0.6b")
    ap.add_argument("--frames", type=int, default=20000)
    ap.add_argument("--json")
    a = ap.parse_args()
    model = TtsModel.load(random_model_folder(a.size), device="cuda")
    decoders = make_decoders(model, "megakernel", 512)
    rng = random.Random(0)
    total, requests, samples, last = 0, 0, [], None
    start = time.perf_counter()
    while total < a.frames:
        text, seed, frames = rng.choice(SENTENCES), rng.randrange(2**31), rng.randrange(8, 300)
        codes = request(model, decoders, text, seed, frames)
        total += codes.shape[0]
        requests += 1
        last = (text, seed, frames, codes)
        torch.cuda.synchronize()
        if requests == 1 or requests % WARM_UP_REQUESTS == 0:
            samples.append({"frames": total, "gpu_allocated": torch.cuda.memory_allocated(),
                            "gpu_reserved": torch.cuda.memory_reserved(), "host_peak_rss": host_rss(),
                            "wall_s": time.perf_counter() - start})
            print(f"{total} frames, {requests} requests: {samples[-1]}", flush=True)
    wall = time.perf_counter() - start
    samples.append({"frames": total, "gpu_allocated": torch.cuda.memory_allocated(),
                    "gpu_reserved": torch.cuda.memory_reserved(), "host_peak_rss": host_rss(), "wall_s": wall})
    text, seed, frames, codes = last
    alone = request(model, make_decoders(model, "megakernel", 512), text, seed, frames)
    same = torch.equal(alone, codes)
    warm = samples[1] if len(samples) > 2 else samples[0]  # the sample after WARM_UP_REQUESTS requests
    gpu_growth = samples[-1]["gpu_allocated"] - warm["gpu_allocated"]
    host_growth = samples[-1]["host_peak_rss"] - warm["host_peak_rss"]
    report = {"frames": total, "requests": requests, "wall_s": wall, "ms_per_frame": 1e3 * wall / total,
              "gpu_growth_bytes": gpu_growth, "host_growth_bytes": host_growth, "last_request_equal_alone": same,
              "last_request": {"text": text, "seed": seed, "max_frames": frames, "frames": int(codes.shape[0])},
              "samples": samples}
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    ok = same and gpu_growth <= GPU_GROWTH_BOUND and host_growth <= HOST_GROWTH_BOUND
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
