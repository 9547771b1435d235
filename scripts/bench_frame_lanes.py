"""Frames of several batches at once, each batch's megakernels on its own share of the SMs and its own CUDA stream
(frame lanes), against one batch on every SM, in one process on the same random weights:

    python3 scripts/bench_frame_lanes.py [--size 1.7b] [--batch 16] [--configs 1x132,1x66,2x66,...] [--rounds 40]
        [--json FILE]

A config `LxS` runs L lanes of S SMs each (L x S at most the GPU's SMs); `+codec` after it adds a codec call of the
batch's rows for each lane's frame, on a side stream beside the next round's frames (`+codec` with L x S = all SMs:
after the frames, on the same stream, as the serial server). A round is one frame of every lane (a talker step and
the code predictor's pass of every stream, their codes read on the host) and, with `+codec`, the codec calls; its
time is the wall clock between rounds (median). Reported: the round, and the device time a stream-frame
(round / (L x batch)), what bounds a server's throughput (docs/serving.md: 0.46 ms at 16 on one lane of 132 SMs).
Why: a megakernel frame at batch 16 is bound by its layers' fixed costs, which do not shrink with more SMs, so two
batches on half the SMs each might make more frames a second than one batch on all of them. Every config's
megakernels are compiled first, nvcc side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch

from mkport.kernel.build import build_libraries
from mkport.kernel.cache import BUILDS, cache_root
from mkport.kernel.launch_plan import plan_launch
from mkport.kernel.render import render
from mkport.tts.batch import FrameBatch
from mkport.kernel.spec import open_model
from mkport.tts.codec import CodecStreams
from mkport.tts.model import TtsModel, random_model_folder
from mkport.tts.pipeline import TtsSampling, make_decoders
from mkport.tts.prompt import build_prompt


def parse(config: str) -> tuple[int, int, bool, bool]:
    """(lanes, SMs a lane, codec calls, pipelined)."""
    shape, _, extra = config.partition("+")
    pipelined = shape.endswith("p")
    lanes, sms = (int(x) for x in shape.rstrip("p").split("x"))
    return lanes, sms, extra == "codec", pipelined


def lane(mk: TtsModel, batch: int, sms: int, frames: int, seed: int) -> FrameBatch:
    speaker = next(iter(mk.config.speakers))
    prompts = [build_prompt(mk.config, mk.encode, mk.text, mk.talker_weights.embed[0],
                            f"Sentence number {seed + b}, spoken.", speaker, "auto") for b in range(batch)]
    talker, predictor = make_decoders(mk, "megakernel", max(p.embeds.shape[0] for p in prompts) + frames + 1, batch,
                                      sms=sms)
    fb = FrameBatch(mk, talker, predictor)
    talker.reset()
    for b, prompt in enumerate(prompts):
        sampling = TtsSampling.from_generation_config(mk.generation, seed=seed + b)
        fb.add(b, prompt, sampling, frames)
    return fb


def round_of_frames(lanes: list[tuple[FrameBatch, torch.cuda.Stream]], codes: list) -> None:
    """One frame of every lane, all queued before any lane's codes are read (each step() reads its own)."""
    if not lanes:
        return
    (fb, stream), rest = lanes[0], lanes[1:]
    with torch.cuda.stream(stream):
        codes.append(fb.step(while_running=lambda: round_of_frames(rest, codes)))


def time_pipelined(lanes, rounds: int, sm_count: int, sms: int, codecs: list[CodecStreams]) -> list[float]:
    """Each lane's next frame queued as soon as its last one's codes are read, while the other lanes' frames run
    (no round barrier); its codec call right after, on its own stream (the SMs its frame just left) when the lanes
    hold every SM, else on a side stream, each lane's call at most a frame behind. A round: one frame of every lane."""
    side = torch.cuda.Stream() if codecs and len(lanes) * sms < sm_count else None
    calls: list = [None] * len(lanes)  # each lane's last codec call's event (side stream)
    queued = []
    for fb, stream in lanes:
        with torch.cuda.stream(stream):
            queued.append(fb.queue_frame())
    times, last = [], None
    for r in range(rounds + 3):
        for i, (fb, stream) in enumerate(lanes):
            with torch.cuda.stream(stream):
                frame = fb.finish_frame(queued[i])
                if not fb.requests:
                    return times
                ids = sorted(k for k, c in frame.items() if c is not None)
                codes = torch.stack([frame[k] for k in ids]) if ids else None
                if codecs and side is None and ids:
                    codecs[i].decode(ids, codes)  # before the lane's next frame, on the SMs it left
                queued[i] = fb.queue_frame()
                if codecs and side is not None and ids:
                    if calls[i] is not None:
                        calls[i].synchronize()
                    side.wait_stream(stream)
                    with torch.cuda.stream(side):
                        codecs[i].decode(ids, codes)
                        calls[i] = torch.cuda.Event()
                        calls[i].record(side)
        now = time.perf_counter()
        if last is not None and r >= 3:
            times.append(now - last)
        last = now
    return times


def time_rounds(lanes, rounds: int, sm_count: int, sms: int, codecs: list[CodecStreams]) -> list[float]:
    """Rounds: every lane's frame queued, then all their codes read; with codecs, each lane's codec call after the
    round, on the frames' stream when the lanes hold every SM (serial), else on a side stream beside the next round
    (at most a round behind, as a split server keeps it)."""
    serial = len(lanes) * sms >= sm_count
    side = torch.cuda.current_stream() if serial else torch.cuda.Stream()
    times, last = [], None
    for r in range(rounds + 3):
        codes: list = []
        round_of_frames(lanes, codes)  # innermost lane first: each lane's codes keep their place in the list
        if codecs:
            side.synchronize()  # the last round's calls
            for frame, codec in zip(codes, codecs):
                ids = sorted(i for i, c in frame.items() if c is not None)
                if ids:
                    with torch.cuda.stream(side):
                        codec.decode(ids, torch.stack([frame[i] for i in ids]))
            if serial:
                side.synchronize()
        now = time.perf_counter()
        if last is not None and r >= 3:
            times.append(now - last)
        last = now
        if any(not fb.requests for fb, _ in lanes):
            break
    return times


def time_config(mk, config: str, batch: int, rounds: int, sm_count: int, codecs: list[CodecStreams]) -> dict:
    n, sms, with_codec, pipelined = parse(config)
    lanes = [(lane(mk, batch, sms, rounds + 8, 1000 * i), torch.cuda.Stream(priority=-1)) for i in range(n)]
    timer = time_pipelined if pipelined else time_rounds
    times = timer(lanes, rounds, sm_count, sms, codecs[:n] if with_codec else [])
    torch.cuda.synchronize()
    ms = 1e3 * statistics.median(times)
    return {"config": config, "lanes": n, "sms": sms, "codec": with_codec, "rounds": len(times),
            "round_ms": round(ms, 3), "ms_a_stream_frame": round(ms / (n * batch), 4)}


def build_all(folder: Path, configs: list[str], batch: int) -> None:
    from mkport.runtime.decoder import current_device_target

    target = current_device_target()
    talker = open_model(f"{folder}:talker")
    specs = (talker.spec, talker.with_part("code_predictor").spec)
    sources = [render(spec, plan_launch(spec, dataclasses.replace(target, sm_count=sms), batch=batch)).write(
        cache_root() / BUILDS) for sms in sorted({parse(c)[1] for c in configs}) for spec in specs]
    build_libraries([(src, "fast") for src in sources], target.arch, os.cpu_count() or 4, log=print)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1.7b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--configs", default="1x132,1x132+codec,1x66,2x66,2x66+codec,1x44,3x44,1x58,2x58+codec,"
                                          "1x116+codec")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    configs = args.configs.split(",")
    folder = random_model_folder(args.size, seed=0)
    build_all(folder, configs, args.batch)
    mk = TtsModel.load(folder, device="cuda")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    # a codec state, graph pool and capture stream a lane (their calls run side by side), as `serve
    # --no-compile-codec` calls it: graphs, every row
    codecs = [CodecStreams(mk.codec, args.batch, pool=torch.cuda.graph_pool_handle(),
                           capture_stream=torch.cuda.Stream(priority=-1))
              for _ in range(max(parse(c)[0] for c in configs))]
    for codec in codecs:
        codec.prepare()
    rows = []
    for config in configs:
        n, sms, _, _ = parse(config)
        if n * sms > sm_count:
            print(f"{config}: {n} x {sms} SMs is more than the GPU's {sm_count}; skipped")
            continue
        row = time_config(mk, config, args.batch, args.rounds, sm_count, codecs)
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    print("\n| config | round ms | ms a stream-frame |\n|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['round_ms']} | {r['ms_a_stream_frame']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
