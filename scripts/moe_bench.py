"""Issue 30's table on the GPU: each bundled mixture-of-experts spec at full size, its megakernel step at batch 1 timed
as `mkport bench` times it (CUDA events, warm-up, tokens fed back on the device), against the bandwidth floor of the
bytes a step reads (its chosen experts) and of all experts; the phases of one step (profile build) in shares; a
transformers baseline in bf16 (--hf; built without a float32 copy, so a 30B model fits beside the kernel's
weights): eager, and with a static cache in a CUDA graph, its experts decoded as transformers' generate does on a GPU
(bench.decode.decoding_experts: 'batched_mm', which a graph captures). Weights are the counter-based random ones, made on the GPU (a 30B checkpoint would not fit the disk). Every
build first, nvcc runs side by side; then one JSON line a spec.

    python scripts/moe_bench.py [--specs qwen3-30b-a3b,olmoe-1b-7b] [--steps 100] [--hf olmoe-1b-7b] [--no-phases]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mkport.bench.decode import (HFStep, bench_hf_eager, bench_hf_graph, bench_megakernel, copy_bandwidth,  # noqa: E402
                                 phase_shares)
from mkport.kernel.build import build_libraries  # noqa: E402
from mkport.kernel.cache import BUILDS, cache_root  # noqa: E402
from mkport.kernel.launch_plan import plan_launch  # noqa: E402
from mkport.kernel.render import render  # noqa: E402
from mkport.kernel.spec import open_model  # noqa: E402
from mkport.runtime.decoder import current_device_target  # noqa: E402
from mkport.runtime.weights import CounterCheckpoint, load_weights  # noqa: E402

SPECS = "qwen3-30b-a3b,olmoe-1b-7b,qwen1.5-moe-a2.7b,mixtral-8x7b"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--specs", default=SPECS)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--hf", default="", help="specs that also time transformers (bf16, eager and CUDA graph), comma-separated")
    parser.add_argument("--no-phases", action="store_true", help="skip the profile build's phase shares")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    target = current_device_target()
    kinds = ("fast",) + (() if args.no_phases else ("profile",))
    sources = [render(s, plan_launch(s, target)).write(cache_root() / BUILDS)
               for s in (open_model(name).spec for name in args.specs.split(","))]
    build_libraries([(src, kind) for src in sources for kind in kinds], target.arch, os.cpu_count() or 4)
    for name in args.specs.split(","):
        source = open_model(name)
        spec = source.spec
        checkpoint = CounterCheckpoint(spec, 0, "cuda")
        weights = load_weights(spec, checkpoint)
        mk = bench_megakernel(spec, weights, args.context, args.steps, 16, 20).summary()
        row = {"spec": name, "context": args.context, "step_us": mk["median_us"], "p90_us": mk["p90_us"],
               "floor_us": spec.weight_bytes_per_step() / bandwidth * 1e6,
               "floor_all_experts_us": spec.weight_bytes_per_step(all_experts=True) / bandwidth * 1e6,
               "bandwidth_GBps": bandwidth / 1e9}
        row["floor_fraction"] = row["floor_us"] / row["step_us"]
        if not args.no_phases:
            row["phases"] = phase_shares(spec, weights, args.context)
        if name in args.hf.split(","):
            del weights
            gc.collect()
            torch.cuda.empty_cache()
            timings = (("hf_eager", lambda hf: bench_hf_eager(hf, args.context, 20, 16, 3)),
                       ("hf_graph", lambda hf: bench_hf_graph(hf, args.context, args.steps, 10)))
            hf = None
            for engine, timed in timings:
                try:  # a baseline that cannot run here is reported, not fatal
                    hf = hf or HFStep(source, checkpoint, spec)
                    row[f"{engine}_us"] = timed(hf).summary()["median_us"]
                    row[f"speedup_vs_{engine}"] = row[f"{engine}_us"] / row["step_us"]
                except Exception as e:  # noqa: BLE001
                    row[f"{engine}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            hf = None
        print(json.dumps(row), flush=True)
        weights = checkpoint = None
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
