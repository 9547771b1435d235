"""Where a batched decode step's time goes, phase by phase, at several batch sizes (H200, profile builds):

    python3 scripts/profile_batch.py [--spec qwen3-tts-0.6b-talker] [--batches 1,8,16] [--context 128] [--json FILE]

Each phase's SM cycles (block 0's clock between grid barriers, the median of 20 steps) summed over the layers,
in microseconds at the measured clock, next to the step's CUDA-event time.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from mkport.bench.decode import _time_each
from mkport.runtime.backends import make_decoder
from mkport.kernel.spec import load_spec
from mkport.runtime.weights import Checkpoint, load_weights, random_weights_folder

PHASES = ("input", "qkv", "attention", "o_proj", "gate_up", "down", "lm_head", "sample", "final_norm")


def profile(spec, weights, batch: int, context: int, steps: int = 20) -> dict:
    gen = torch.Generator().manual_seed(0)
    dec = make_decoder(spec, weights, "megakernel", context + 2 * steps + 2, batch, profile=True)
    for b in range(batch):
        dec.prefill_slot(b, tokens=torch.randint(0, spec.vocab_size, (context - 1,), generator=gen))
    dec.step_batch(tokens=list(range(1, batch + 1)))
    per_phase = {name: [] for name in PHASES}
    total = []
    for _ in range(steps):
        dec.step_batch()
        cycles = dec.phase_cycles()
        for name in PHASES:
            per_phase[name].append(sum(v for k, v in cycles.items() if k.rsplit(".", 1)[-1] == name))
        total.append(sum(cycles.values()))
    step_us = statistics.median(_time_each(dec.step_batch, steps))
    clock_per_us = statistics.median(total) / step_us  # cycles of the whole step over its event time
    return {"batch": batch, "step_us": step_us,
            "phase_us": {k: statistics.median(v) / clock_per_us for k, v in per_phase.items() if any(v)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="qwen3-tts-0.6b-talker")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    spec = load_spec(args.spec)
    weights = load_weights(spec, Checkpoint.open(random_weights_folder(spec, 0)))
    rows = [profile(spec, weights, int(b), args.context) for b in args.batches.split(",")]
    names = [k for k in PHASES if any(k in r["phase_us"] for r in rows)]
    print(f"{spec.name}, context {args.context}: microseconds a step, by phase (summed over layers)")
    print("batch  step    " + "".join(f"{n:>10}" for n in names))
    for r in rows:
        print(f"{r['batch']:>5} {r['step_us']:7.1f} " + "".join(f"{r['phase_us'].get(n, 0):10.1f}" for n in names))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spec": spec.name, "context": args.context, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
