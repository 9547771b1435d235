"""A few megakernel decode steps of each bundled spec and one Qwen3-TTS frame, small enough to run under
compute-sanitizer (memcheck, racecheck, synccheck) on the GPU (docs/validation.md):

    compute-sanitizer --tool memcheck --kernel-name regex:decode_step python3 scripts/sanitize_steps.py [--kernel v16]

Exit 1 when a step's output is not finite; the sanitizer's own exit code reports what it found.
"""

from __future__ import annotations

import argparse
import sys

import torch

from mkport.kernel.launch_plan import DEFAULT_KERNEL
from mkport.runtime.backends import make_decoder
from mkport.kernel.spec import bundled_names, load_spec
from mkport.runtime.weights import load_weights, random_weights


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", default=",".join(bundled_names()))
    ap.add_argument("--kernel", default=DEFAULT_KERNEL)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tts", default="0.6b", help="random TTS model for one frame; '' to skip")
    a = ap.parse_args()
    ok = True
    for name in a.specs.split(","):
        spec = load_spec(name)
        # no prefill: under racecheck, torch's Hopper matmuls fail ("failed to handle a hardware exception");
        # the megakernel fills its own KV cache from position 0
        dec = make_decoder(spec, load_weights(spec, random_weights(spec, 0)), "megakernel", 32, kernel=a.kernel)
        dec.step(1)
        for _ in range(a.steps - 1):
            dec.step()
        torch.cuda.synchronize()
        finite = bool(torch.isfinite(dec.hidden).all())
        ok &= finite
        print(f"{name}: {a.steps} steps, hidden finite {finite}, token {int(dec.token_out)}", flush=True)
        del dec
    if a.tts:
        from mkport.tts.model import TtsModel, random_model_folder
        from mkport.tts.pipeline import synthesize

        model = TtsModel.load(random_model_folder(a.tts), device="cuda")
        chunks = list(synthesize(model, "Hi.", backend="megakernel", max_frames=1))
        finite = all(bool(torch.isfinite(c).all()) for c in chunks)
        ok &= finite
        print(f"tts {a.tts}: one frame, {sum(c.numel() for c in chunks)} samples, finite {finite}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
