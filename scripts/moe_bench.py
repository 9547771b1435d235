"""Issue 30's table on the GPU: each bundled mixture-of-experts spec at full size, its megakernel step at batch 1 timed
as `mkport bench` times it (CUDA events, warm-up, tokens fed back on the device), against the bandwidth floor of the
bytes a step reads (its chosen experts) and of all experts; the phases of one step (profile build) in shares; a
transformers baseline in bf16 (--hf; built without a float32 copy, so a 30B model fits beside the kernel's
weights): eager, and with a static cache in a CUDA graph, its experts decoded as transformers' generate does on a GPU
(bench.decode.decoding_experts: 'batched_mm', which a graph captures). Weights are the counter-based random ones, made on the GPU (a 30B checkpoint would not fit the disk). Every
build first, nvcc runs side by side; then one JSON line a spec.

    python scripts/moe_bench.py [--specs qwen3-30b-a3b,olmoe-1b-7b] [--steps 100] [--hf olmoe-1b-7b] [--no-phases]
                                [--expert-slices]

--expert-slices also times the plan variants with a sparse layer's gate/up and down in one phase (moe_slices.cuh),
without and with its gate and up rows brought by bulk copies into a ring (`slices_*` and `ring_*`), on the same
weights, right after the plain plan, and checks that each gives the plain plan's greedy tokens and close hidden states.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the tests' greedy loop (agreement)

from mkport.bench.decode import (HFStep, bench_hf_eager, bench_hf_graph, bench_megakernel, copy_bandwidth,  # noqa: E402
                                 phase_shares)
from mkport.kernel.build import build_libraries  # noqa: E402
from mkport.kernel.cache import BUILDS, cache_root  # noqa: E402
from mkport.kernel.launch_plan import plan_launch, with_slice_ring, with_expert_slices  # noqa: E402
from mkport.kernel.render import render  # noqa: E402
from mkport.kernel.spec import open_model  # noqa: E402
from mkport.runtime.decoder import Decoder, current_device_target  # noqa: E402
from mkport.runtime.weights import CounterCheckpoint, load_weights  # noqa: E402
from test_gpu_decode import generate_greedy  # noqa: E402

SPECS = "qwen3-30b-a3b,olmoe-1b-7b,qwen1.5-moe-a2.7b,mixtral-8x7b"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--specs", default=SPECS)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--hf", default="", help="specs that also time transformers (bf16, eager and CUDA graph), comma-separated")
    parser.add_argument("--no-phases", action="store_true", help="skip the profile build's phase shares")
    parser.add_argument("--expert-slices", action="store_true",
                        help="also the plan variant with gate/up and down in one phase (LaunchPlan.expert_slice)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    target = current_device_target()
    kinds = ("fast",) + (() if args.no_phases else ("profile",))
    plans = {name: [plan_launch(spec, target)] + (variants(spec, target) if args.expert_slices else [])
             for name, spec in ((name, open_model(name).spec) for name in args.specs.split(","))}
    builds = [(render(open_model(name).spec, plan).write(cache_root() / BUILDS), kind)
              for name, its in plans.items() for i, plan in enumerate(its) for kind in (kinds if i == 0 else ("fast",))]
    build_libraries(builds, target.arch, os.cpu_count() or 4)
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
        for variant in plans[name][1:]:
            key = "ring" if variant.slice_ring_at else "slices"
            timed = bench_megakernel(spec, weights, args.context, args.steps, 16, 20, plan=variant).summary()
            row.update({"expert_slice": variant.expert_slice, f"{key}_step_us": timed["median_us"],
                        f"{key}_p90_us": timed["p90_us"], f"{key}_vs_plain": timed["median_us"] / row["step_us"],
                        **agreement(spec, weights, variant, args.context, key)})
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


def variants(spec, target) -> list:
    """The rule's plan with expert slices (their width for this grid), and with their ring where it fits."""
    sliced = with_expert_slices(plan_launch(spec, target), spec)
    if sliced is None:
        return []
    ring = with_slice_ring(sliced, spec, target)
    return [sliced] + ([ring] if ring is not None else [])


def agreement(spec, weights, variant, context: int, key: str, steps: int = 16) -> dict:
    """The plain plan and `variant` from the same prompt, greedy, tokens fed back on the device: how many tokens agree
    and the hidden states' relative L2 difference over the steps before the first that parts."""
    gen = torch.Generator().manual_seed(context + 1)
    prompt = torch.randint(0, spec.vocab_size, (context,), generator=gen)
    (t0, h0), (t1, h1) = [generate_greedy(Decoder(spec, weights, max_seq=context + steps + 1, plan=plan), prompt, steps)
                          for plan in (None, variant)]
    same = int((t0 == t1).long().cumprod(0).sum())
    upto = max(1, same)
    rel = float((h1[:upto] - h0[:upto]).norm() / h0[:upto].norm())
    return {f"{key}_tokens_agree": f"{same}/{steps}", f"{key}_hidden_rel": rel}


if __name__ == "__main__":
    main()
