"""Where a prompt's prefill goes (issue 31: Qwen3.5's 512-token prompt): a decoder on seeded random weights prefills
the prompt --reps times (median wall time, synchronised), then once under torch's profiler: the CUDA kernels (how
many, device time, the costliest) and the host ops that launched the most device time.

    python3 scripts/profile_prefill.py [--spec qwen3.5-0.8b] [--prompt-len 512] [--reps 5] [--json FILE]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="qwen3.5-0.8b")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    spec = load_spec(a.spec)
    dec = Decoder(spec, load_weights(spec, random_weights(spec, seed=0)), max_seq=a.prompt_len + 8)
    tokens = torch.randint(0, spec.vocab_size, (a.prompt_len,), generator=torch.Generator().manual_seed(0))

    def prefill():
        dec.reset()
        dec.prefill(tokens)

    prefill()
    wall = statistics.median(host_times_ms(prefill, reps=a.reps))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_name: dict[str, list] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.device_time_total)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:15]
    ops = sorted((e for e in prof.key_averages() if e.device_type == DeviceType.CPU),
                 key=lambda e: -e.device_time_total)[:15]
    out = {"spec": a.spec, "prompt_len": a.prompt_len, "wall_ms": wall, "kernels": len(kernels),
           "device_ms": sum(e.device_time_total for e in kernels) / 1e3,
           "top_kernels": [{"name": n, "count": len(t), "ms": sum(t) / 1e3} for n, t in top],
           "top_host_ops": [{"name": e.key, "count": e.count, "device_ms": e.device_time_total / 1e3,
                             "host_ms": e.cpu_time_total / 1e3} for e in ops]}
    print(f"{a.spec} prefill of {a.prompt_len} rows: {wall:.1f} ms wall (median of {a.reps}), {out['kernels']} "
          f"kernels, {out['device_ms']:.1f} ms of device time")
    for k in out["top_kernels"]:
        print(f"  {k['ms']:8.2f} ms  {k['count']:5d} x  {k['name']}")
    for o in out["top_host_ops"]:
        print(f"  op {o['name']:40s} {o['count']:5d} x  device {o['device_ms']:8.2f} ms  host {o['host_ms']:8.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
