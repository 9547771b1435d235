"""The prefill's time with its two matmul paths, in one process on the GPU: torch_model.linear (float32
inputs split into two bf16 parts, tensor cores) against float32 F.linear on the weights cast to float32.
A 102-row prompt (bucket 128), graph replay and eager, median host time of 20; and how far the hidden
states of the two paths are apart. Usage: python3 scripts/prefill_matmul_ab.py [--json FILE]"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import mkport.runtime.torch_model as tm
from mkport.bench.decode import host_ms
from mkport.runtime.backends import make_decoder
from mkport.kernel.spec import load_spec
from mkport.runtime.weights import Checkpoint, load_weights, random_weights_folder

SPECS = ("qwen3-tts-0.6b-talker", "qwen3-tts-1.7b-talker")
ROWS = 102  # the bench text's prompt


def fp32_linear(x, w, b=None):
    return F.linear(x, w.float(), None if b is None else b.float())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    split_linear, out = tm.linear, {}
    for name in SPECS:
        spec = load_spec(name)
        w = load_weights(spec, Checkpoint.open(random_weights_folder(spec, 0)))
        x = (torch.randn(ROWS, spec.input_dim, generator=torch.Generator().manual_seed(0)) * 0.1).cuda()
        res, hidden = {}, {}
        for label, linear in (("split_bf16", split_linear), ("fp32", fp32_linear)):
            tm.linear = linear
            try:
                for graphs in (True, False):
                    dec = make_decoder(spec, w, "megakernel", 256, prefill_graphs=graphs)

                    def prefill():
                        dec.reset()
                        return dec.prefill(embeds=x)

                    hidden[label] = prefill()  # the graph's capture, untimed
                    res[f"{label}_{'graph' if graphs else 'eager'}_ms"] = host_ms(prefill, 20)
                    del dec
            finally:
                tm.linear = split_linear
        res["hidden_rel_l2"] = float((hidden["split_bf16"] - hidden["fp32"]).norm() / hidden["fp32"].norm())
        out[name] = res
        print(name, {k: round(v, 6) for k, v in res.items()}, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
