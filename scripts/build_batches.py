"""Builds the batched decode step (kernel v5 at batch sizes above 1) of several specs at once, so that the GPU
tests and `mkport bench --batch` that follow find every library cached:

    python3 scripts/build_batches.py --specs a,b --batches 2,4,8,16 [--kinds fast,trace] [--jobs 16] [--arch sm_90]

A batch size whose vectors do not fit a block's shared memory for a spec is reported and skipped.
"""

from __future__ import annotations

import argparse

from mkport.kernel.build import build_libraries
from mkport.kernel.cache import BUILDS, cache_root
from mkport.errors import MkportError
from mkport.kernel.gpu import target_for_arch
from mkport.kernel.render import render
from mkport.kernel.spec import bundled_names, load_spec
from mkport.kernel.launch_plan import plan_launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specs", default=",".join(bundled_names()))
    ap.add_argument("--batches", default="2,4,8,16")
    ap.add_argument("--kinds", default="fast", help="fast, trace, profile, comma-separated")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args()
    target = target_for_arch(args.arch)
    jobs = []
    for name in args.specs.split(","):
        spec = load_spec(name)
        for batch in (int(b) for b in args.batches.split(",")):
            try:
                plan = plan_launch(spec, target, batch=batch)
            except MkportError as e:
                print(f"skipped {name} batch {batch}: {e}")
                continue
            src = render(spec, plan).write(cache_root() / BUILDS)
            jobs += [(src, kind) for kind in args.kinds.split(",")]

    build_libraries(jobs, args.arch, args.jobs, log=lambda message: print(message, flush=True))


if __name__ == "__main__":
    main()
