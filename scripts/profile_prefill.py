"""Where a prompt's prefill goes (issue 31: Qwen3.5's 512-token prompt): a decoder on seeded random weights prefills
the prompt --reps times (median wall time, synchronised), then under torch's profiler: the CUDA kernels (how many,
device time, the costliest: profile_first_audio.kernels) and the host ops that launched the most device time.

    python3 scripts/profile_prefill.py [--spec qwen3.5-0.8b] [--prompt-len 512] [--reps 5] [--eager] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from mkport.bench.decode import host_times_ms
from mkport.kernel.spec import load_spec
from mkport.runtime.decoder import Decoder
from mkport.runtime.weights import load_weights, random_weights
from profile_first_audio import kernels  # this folder's: the kernels of one call, by name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="qwen3.5-0.8b")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--eager", action="store_true", help="no CUDA graph: each op launched from the host")
    ap.add_argument("--json")
    a = ap.parse_args()
    spec = load_spec(a.spec)
    dec = Decoder(spec, load_weights(spec, random_weights(spec, seed=0)), max_seq=a.prompt_len + 8,
                  prefill_graphs=not a.eager)
    tokens = torch.randint(0, spec.vocab_size, (a.prompt_len,), generator=torch.Generator().manual_seed(0))

    def prefill():
        dec.reset()
        dec.prefill(tokens)

    prefill()
    wall = statistics.median(host_times_ms(prefill, reps=a.reps))
    device = kernels(prefill)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill()
        torch.cuda.synchronize()
    ops = sorted((e for e in prof.key_averages() if e.device_type == DeviceType.CPU),
                 key=lambda e: -e.device_time_total)[:15]
    out = {"spec": a.spec, "prompt_len": a.prompt_len, "eager": a.eager, "wall_ms": wall, **device,
           "top_host_ops": [{"name": e.key, "count": e.count, "device_ms": e.device_time_total / 1e3,
                             "host_ms": e.cpu_time_total / 1e3} for e in ops]}
    print(f"{a.spec} {'eager' if a.eager else 'graphed'} prefill of {a.prompt_len} rows: {wall:.1f} ms wall "
          f"(median of {a.reps}), {out['kernels']} kernels, {out['device_us'] / 1e3:.1f} ms of device time")
    for k in out["top"]:
        print(f"  {k['us'] / 1e3:8.2f} ms  {k['count']:5d} x  {k['name']}")
    for o in out["top_host_ops"]:
        print(f"  op {o['name']:40s} {o['count']:5d} x  device {o['device_ms']:8.2f} ms  host {o['host_ms']:8.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
