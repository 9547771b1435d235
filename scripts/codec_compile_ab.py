"""The speech decoder's graphs with and without torch.compile's fusion (`serve --compile-codec`), in one process on
the same random weights (the released decoder's shapes), TF32 as served: for a call of 1 row and one of 16 rows
(CodecStreams, one frame a row, as the batched server calls it), the compile time of its shape, the host ms a
call (median of --reps graph replays), the CUDA kernels and device time of one call run outside a graph, and how far
the compiled call's samples are from the plain one's (relative L2 over a few calls with the state kept).

    python3 scripts/codec_compile_ab.py [--rows 1,16] [--reps 50] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from mkport.bench.decode import host_ms
from mkport.tts.codec import CodecStreams, SpeechDecoder, write_random_codec
from mkport.tts.model import codec_config
from profile_first_audio import kernels  # this folder's: the kernels of one call


def one_call_kernels(decoder: SpeechDecoder, streams: CodecStreams, rows: int) -> tuple[int, float]:
    """(kernels, device ms) of one call of `rows` rows run outside its graph (every row spare: no state moves)."""
    codes = torch.zeros(rows, decoder.num_quantizers, 1, dtype=torch.long, device="cuda")
    streams.state.rows = torch.full((rows,), streams.state.spare, dtype=torch.long, device="cuda")
    with torch.no_grad():
        seen = kernels(lambda: decoder.captured_call(codes, streams.state))
    return seen["kernels"], seen["device_us"] / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    folder = write_random_codec(Path(tempfile.mkdtemp()) / "codec", codec_config(), seed=0)
    frames = torch.randint(0, 2048, (64, 16, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        got = {}
        for compiled in (False, True):
            decoder = SpeechDecoder.load(folder, "cuda", compiled=compiled)
            streams = CodecStreams(decoder, rows)
            t0 = time.perf_counter()
            streams.prepare()
            prepare_s = time.perf_counter() - t0
            samples = torch.cat([streams.decode(list(range(rows)), frames[t, :rows]) for t in range(8)], dim=-1)
            step = [0]

            def call():
                step[0] += 1
                streams.decode(list(range(rows)), frames[8 + step[0] % 56, :rows])

            ms = host_ms(call, args.reps)
            kernels, device_ms = one_call_kernels(decoder, streams, rows)
            got[compiled] = samples
            row = {"rows": rows, "compiled": compiled, "prepare_s": round(prepare_s, 1), "host_ms": round(ms, 3),
                   "kernels": kernels, "device_ms": round(device_ms, 3)}
            if compiled:
                row["rel_to_plain"] = float((got[True] - got[False]).norm() / got[False].norm())
            results.append(row)
            print(json.dumps(row), flush=True)
    print("\n| rows | codec | prepare s | host ms a call | kernels | device ms | rel to plain |\n|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']} | {'compiled' if r['compiled'] else 'graphs'} | {r['prepare_s']} | {r['host_ms']} | "
              f"{r['kernels']} | {r['device_ms']} | {r.get('rel_to_plain', '-')} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
