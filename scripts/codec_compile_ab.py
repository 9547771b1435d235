"""The speech decoder's calls with and without torch.compile's fusion (`serve --compile-codec`), in one process on
the same random weights (the released decoder's shapes), with torch's TF32 defaults, which the server keeps (cuDNN's
convolutions in TF32). Each variant runs a server's codec: calls sized to 1, 2, 4, ... up to the largest of --rows
(CodecStreams(sized=True), one frame a row; with the default 1,16 the batched server's five sizes), prepared from an
empty torch.compile cache (its warm-up, what a first `mkport serve` start pays). Then, for each row count of --rows:
the host ms a call (median of --reps graph replays), the CUDA kernels and device time of one call run outside a
graph, and how far its samples are from the plain graphs' (relative L2 over 8 calls from a fresh state).

Variants (`--variants`, comma-separated):
- `graphs`: the calls as CUDA graphs of the module's own kernels (`--no-compile-codec`), the reference;
- `compiled`: torch.compile's default mode, every shape static (what the server runs);
- `autotune`: torch.compile's `max-autotune-no-cudagraphs` mode (Triton templates for the convolutions and matmuls,
  autotuned; the 1-row call's ~180 cuDNN and cuBLAS kernels hold most of its time: docs/benchmarks.md);
- `dynamic`: the default mode with the rows dynamic from 2 rows on (codec.compiled_stream's `dynamic_rows`): fewer
  compiles at start-up, if its kernels are as fast.

    python3 scripts/codec_compile_ab.py [--variants graphs,compiled,autotune,dynamic] [--rows 1,16] [--reps 50]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from mkport.bench.decode import host_ms
from mkport.tts.codec import CodecStreams, SpeechDecoder, compiled_stream, write_random_codec
from mkport.tts.model import codec_config
from profile_first_audio import kernels  # this folder's: the kernels of one call

VARIANTS = {"graphs": None, "compiled": {}, "autotune": {"mode": "max-autotune-no-cudagraphs"},
            "dynamic": {"dynamic_rows": True}}


def one_call_kernels(decoder: SpeechDecoder, streams: CodecStreams, rows: int) -> tuple[int, float]:
    """(kernels, device ms) of one call of `rows` rows run outside its graph (every row spare: no state moves)."""
    codes = torch.zeros(rows, decoder.num_quantizers, 1, dtype=torch.long, device="cuda")
    streams.state.rows = torch.full((rows,), streams.state.spare, dtype=torch.long, device="cuda")
    with torch.no_grad():
        seen = kernels(lambda: decoder.captured_call(codes, streams.state))
    return seen["kernels"], seen["device_us"] / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="graphs,compiled")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    variants, row_counts = args.variants.split(","), [int(r) for r in args.rows.split(",")]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or variants[0] != "graphs":
        ap.error(f"variants: graphs first (the reference), then any of {', '.join(VARIANTS)}; got {args.variants}")
    folder = write_random_codec(Path(tempfile.mkdtemp()) / "codec", codec_config(), seed=0)
    frames = torch.randint(0, 2048, (64, max(row_counts), 16), generator=torch.Generator().manual_seed(1))
    plain_samples, results = {}, []
    for variant in variants:
        # empty caches each (inductor's and Triton's): the warm-up is what a first start pays
        cache = Path(tempfile.mkdtemp(prefix=f"compile-{variant}-"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"] = str(cache), str(cache / "triton")
        torch._dynamo.reset()
        decoder = SpeechDecoder.load(folder, "cuda")
        if VARIANTS[variant] is not None:
            decoder.captured_call = compiled_stream(decoder.module, **VARIANTS[variant])
        streams = CodecStreams(decoder, max(row_counts), sized=True)
        t0 = time.perf_counter()
        streams.prepare()
        prepare_s = time.perf_counter() - t0
        for rows in row_counts:
            ids = list(range(rows))
            for s in ids:
                streams.reset(s)
            samples = torch.cat([streams.decode(ids, frames[t, :rows]) for t in range(8)], dim=-1)
            step = [0]

            def call():
                step[0] += 1
                streams.decode(ids, frames[8 + step[0] % 56, :rows])

            ms = host_ms(call, args.reps)
            n_kernels, device_ms = one_call_kernels(decoder, streams, rows)
            plain_samples.setdefault(rows, samples)
            row = {"variant": variant, "rows": rows, "prepare_s": round(prepare_s, 1), "host_ms": round(ms, 3),
                   "kernels": n_kernels, "device_ms": round(device_ms, 3),
                   "rel_to_graphs": float((samples - plain_samples[rows]).norm() / plain_samples[rows].norm())}
            results.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n| variant | warm-up s (sizes 1-{max(row_counts)}) | rows | host ms a call | kernels | device ms | "
          "rel to graphs |\n|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['prepare_s']} | {r['rows']} | {r['host_ms']} | {r['kernels']} | "
              f"{r['device_ms']} | {r['rel_to_graphs']:.1e} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
