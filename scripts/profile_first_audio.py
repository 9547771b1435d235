"""Where a warm request's first audio goes (docs/benchmarks.md, "First audio"): in one process, after two
warm-up requests, the parts of a request up to its first chunk, each timed on its own (median of --reps,
synchronised) and profiled once (CUDA kernels: how many, device time, the costliest):

    set-up       build_prompt (tokenizer, text projection), host only plus its queued copies
    prefill      the talker's prompt prefill (a CUDA-graph replay; fused kernels, and torch's for comparison)
    first frame  the talker's last prompt row as a kernel step, then the 16 code-predictor launches
    codec        the first 1-frame chunk through the speech tokenizer decoder

    python3 scripts/profile_first_audio.py [--size 0.6b] [--reps 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from mkport.bench.decode import host_times_ms
from mkport.tts.codec import StreamingCodec
from mkport.tts.model import TtsModel, random_model_folder
from mkport.tts.pipeline import TtsSampling, generate_frames, make_decoders, synthesize
from mkport.tts.prompt import build_prompt

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the quiet forest."


def kernels(fn) -> dict:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_name: dict[str, list] = {}
    for e in events:
        by_name.setdefault(e.name[:90], []).append(e.device_time_total)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {"kernels": len(events), "device_us": sum(e.device_time_total for e in events),
            "top": [{"name": n, "count": len(v), "us": sum(v)} for n, v in top]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="0.6b")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()

    tts = TtsModel.load(random_model_folder(args.size), device="cuda")
    speaker = tts.config.default_speaker
    make_prompt = lambda: build_prompt(tts.config, tts.encode, tts.text, tts.talker_weights.embed[0], TEXT, speaker,
                                       "auto")
    prompt = make_prompt()
    talker, predictor = make_decoders(tts, "megakernel", prompt.embeds.shape[0] + 64)
    request = dict(speaker=speaker, backend="megakernel", decoders=(talker, predictor))
    for _ in range(2):
        list(synthesize(tts, TEXT, max_frames=8, **request))

    def first_chunk():
        next(iter(synthesize(tts, TEXT, max_frames=8, **request)))

    embeds = prompt.embeds.to("cuda")

    def prefill():
        talker.reset()
        talker.prefill(embeds=embeds[:-1])

    from mkport.runtime.backends import make_decoder

    plain = make_decoder(tts.talker_spec, tts.talker_weights, "megakernel", talker.max_seq, fused_prefill=False)

    def prefill_torch():  # the same prefill through torch_model (the reference for the fused kernels)
        plain.reset()
        plain.prefill(embeds=embeds[:-1])

    sampling = TtsSampling.from_generation_config(tts.generation, seed=0)

    def first_frame():  # the prefill included: subtract the prefill's time
        next(generate_frames(tts, prompt, talker, predictor, sampling, 1))

    frame = next(generate_frames(tts, prompt, talker, predictor, sampling, 1))

    def codec():
        StreamingCodec(tts.codec).push(frame)

    parts = {"request_first_chunk": first_chunk, "setup": make_prompt, "prefill": prefill, "prefill_torch": prefill_torch,
             "prefill_and_first_frame": first_frame, "codec_first_chunk": codec}
    result = {"size": args.size, "prompt_rows": prompt.embeds.shape[0], "gpu": torch.cuda.get_device_name()}
    for name, fn in parts.items():
        ms = host_times_ms(fn, args.reps)
        result[name] = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms),
                        **kernels(fn)}
        r = result[name]
        print(f"{name:26s} median {r['median_ms']:7.3f} ms  min {r['min_ms']:7.3f}  max {r['max_ms']:7.3f}  "
              f"{r['kernels']:5d} kernels  {r['device_us'] / 1e3:7.3f} ms on the device", flush=True)
        for t in r["top"][:6]:
            print(f"    {t['us'] / 1e3:7.3f} ms  {t['count']:4d}x  {t['name']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
