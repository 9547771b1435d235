"""Times kernel designs and plan variants against each other, in one process on the same weights, for the
version log in docs/benchmarks.md (a kernel change is measured against the one it replaces).

    python3 scripts/plan_variants.py [--specs a,b] [--contexts 128,2048] [--steps 200] [--json FILE]
    python3 scripts/plan_variants.py --build-only --arch sm_90   # prebuild here, carry MKPORT_CACHE
    python3 scripts/plan_variants.py --build-only --batches 2,4,8,16 --kinds fast   # the batched decode steps

With --build-only, a batch size whose vectors do not fit a block's shared memory for a spec is reported and skipped.

What batch invariance costs (`--invariant-cost N`, issue 29; `mkport serve --batch-invariant`):

    python3 scripts/plan_variants.py --invariant-cost 16 --specs qwen3-tts-0.6b-talker,qwen3-tts-1.7b-talker \
        --contexts 128,512,2048 --steps 100 [--batches 1,2,4,8,16] [--json FILE]

times, at each batch b and context, a step of b live sequences on the plain plan for b against the plan an invariant
server runs them on: b invariant to N (its attention splits N's), and for b = 1 a batch of 2 invariant to N with its
second row idle (batch 1's CUDA-core kernel sums otherwise than a batch's). Also the step of the full batch N, what
--fixed-batch pays at any load. Prints the medians and each ratio; --build-only with --invariant-cost N builds them.
`--invariant-splits M,...` adds, for each M, the invariant plan with every size's attention split as batch M's instead
of N's (`invariant-sM`: a split policy fixed for all sizes is what invariance needs, N's is only the one that keeps
batch N's steps as they are; more splits shorten a lone stream's attention and add passes over the grid at batch N).
The same kernels: only the splits the host asks for differ.

Variants (`variants`):
- `v20`: the kept design (launch_plan.KERNELS), the reference of the comparison. A new design is added beside it in
  KERNELS (kernels v2, v5-v7, v11-v17 were, until each was removed: docs/benchmarks.md).
- `v20-sN` (`--split-positions N,...`): attention splits of at least N positions instead of 16 (fewer, longer
  chains; at N >= the context, one block a KV head and no combine).
- `v20-mN` (`--max-splits N,...`): at most N splits a KV head instead of launch_plan.ATTN_MAX_SPLITS (and never more
  than launch_plan.attention_max_splits allows: the grid's blocks a KV head, the partials the combine holds).
- `v20-t` (`--tail-split`): batch 1's matvecs whose last round has no more rows than the grid's warp pairs split
  those rows in k over warp pairs (matvec.cuh's TAIL_SPLITS).
- `v20-a` (`--vector-act`): batch 1's dense down reads its input act(gate) * up with 16-byte loads, a group of 4 pairs
  of them in flight (mlp.cuh's gated_to_smem_vec), not scalar loads; the same values: hidden states equal bit for bit.

Every variant's final hidden state after the timed steps is compared with the reference's (the math is the same;
the order of some sums differs), and greedy tokens must agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # mkport from this checkout, installed or not

from mkport.bench.decode import _time_each, layer_timeline, phase_shares
from mkport.errors import MkportError
from mkport.kernel.build import build_libraries
from mkport.kernel.cache import BUILDS, cache_root
from mkport.kernel.gpu import target_for_arch
from mkport.kernel.launch_plan import DEFAULT_KERNEL, KERNELS, LaunchPlan, attention_max_splits, plan_launch
from mkport.kernel.render import render
from mkport.kernel.spec import bundled_names, load_spec
from mkport.runtime.backends import make_decoder
from mkport.runtime.decoder import current_device_target
from mkport.runtime.weights import load_weights, random_weights


REFERENCE = DEFAULT_KERNEL


def variants(spec, target, batch: int = 1, split_positions=(), max_splits=(), tail_split=False,
             vector_act=False) -> dict:
    plans = {k: plan_launch(spec, target, k, batch=batch) for k in KERNELS}
    ref = plans[REFERENCE]
    if batch == 1 and tail_split:
        plans[f"{REFERENCE}-t"] = dataclasses.replace(ref, tail_split=True)
    if batch == 1 and vector_act:
        plans[f"{REFERENCE}-a"] = dataclasses.replace(ref, vector_act=True)
    for n in split_positions:
        plans[f"{REFERENCE}-s{n}"] = dataclasses.replace(ref, attn_split_positions=n)
    for n in max_splits:
        plans[f"{REFERENCE}-m{n}"] = dataclasses.replace(
            ref, attn_max_splits=attention_max_splits(spec, ref.grid, ref.attn_tile, n))
    return plans


def chosen(found: dict, labels) -> dict:
    return {k: v for k, v in found.items() if labels is None or k in labels}


def build_only(specs, arch: str, jobs_at_once: int, labels, kinds, batches, split_positions=(), max_splits=(),
               tail_split=False, vector_act=False) -> None:
    """The libraries time_variants, `mkport diff` and `mkport bench --batch` load (the builds `kinds` of the
    variants `labels`, all when None, at each of `batches`), several nvcc at once."""
    target = target_for_arch(arch)
    jobs = []
    for name in specs:
        spec = load_spec(name)
        for batch in batches:
            try:
                plans = chosen(variants(spec, target, batch, split_positions, max_splits, tail_split, vector_act), labels)
            except MkportError as e:
                print(f"skipped {name} batch {batch}: {e}", flush=True)
                continue
            for plan in plans.values():
                src = render(spec, plan).write(cache_root() / BUILDS)
                jobs += [(src, kind) for kind in kinds]

    build_libraries(jobs, arch, jobs_at_once, log=lambda message: print(message, flush=True))


class SplitsOf(LaunchPlan):
    """A plan whose every sequence's attention splits are batch `splits_batch`'s whatever its batch (--invariant-splits;
    not a field of the plan: its files, and so its build, are the plan's own). SplitsOf.of(plan, m) makes one."""

    @classmethod
    def of(cls, plan: LaunchPlan, splits_batch: int) -> "SplitsOf":
        out = cls(**dataclasses.asdict(plan))
        object.__setattr__(out, "splits_batch", splits_batch)
        return out

    def attention_splits(self, context: int) -> int:
        return max(1, min(self.attn_max_splits // self.splits_batch, -(-context // self.attn_split_positions)))


def invariant_plans(spec, target, n: int, batches, split_batches=()) -> dict:
    """(b, kind) -> (plan, live rows) for --invariant-cost: `plain` (b's own plan), `invariant` (b invariant to n; for b
    1, batch 2 invariant to n with one live row), `invariant-sM` (the same with batch M's attention splits), `fixed`
    (batch n, b live: --fixed-batch)."""
    out = {}
    for b in batches:
        if b > n:
            continue
        out[b, "plain"] = (plan_launch(spec, target, batch=b), b)
        inv = plan_launch(spec, target, batch=max(b, 2), invariant_to=n)
        out[b, "invariant"] = (inv, b)
        for m in split_batches:
            out[b, f"invariant-s{m}"] = (SplitsOf.of(inv, m), b)
        out[b, "fixed"] = (plan_launch(spec, target, batch=n), b)
    return out


def invariant_cost(name: str, contexts, steps: int, n: int, batches, split_batches=()) -> dict:
    """Median step time (us) of b live sequences on each plan of invariant_plans, at each context (every live
    sequence at that context; the idle rows of a larger batch left out of the step, as a server's free slots)."""
    from mkport.runtime.decoder import Decoder

    spec = load_spec(name)
    weights = load_weights(spec, random_weights(spec, 0))
    target = current_device_target()
    plans = invariant_plans(spec, target, n, batches, split_batches)
    decoders = {}
    out = {}
    for (b, kind), (plan, live) in plans.items():
        key = (plan.batch, plan.invariant_to, getattr(plan, "splits_batch", 0))
        if key not in decoders:
            decoders[key] = Decoder(spec, weights, max(contexts) + steps + 12, plan=plan, prefill_graphs=False)
        dec = decoders[key]
        active = [i < live for i in range(plan.batch)]
        for ctx in contexts:
            gen = torch.Generator().manual_seed(ctx)
            dec.reset()
            for i in range(live):
                dec.prefill_slot(i, tokens=torch.randint(0, spec.vocab_size, (ctx - 1,), generator=gen))
            first = [1 if on else None for on in active]
            dec.step_batch(tokens=first, active=active)
            step = lambda: dec.step_batch(active=active)  # noqa: E731
            _time_each(step, 10)
            times = _time_each(step, steps)
            out.setdefault(str(ctx), {}).setdefault(str(b), {})[kind] = statistics.median(times)
    return {"spec": name, "invariant_to": n, "median_us": out}


def time_variants(name: str, contexts, steps: int, labels=None, split_positions=(), max_splits=(),
                  tail_split=False, vector_act=False) -> dict:
    spec = load_spec(name)
    weights = load_weights(spec, random_weights(spec, 0))
    out = {}
    plans = chosen(variants(spec, current_device_target(), 1, split_positions, max_splits, tail_split, vector_act), labels)
    for label, plan in plans.items():
        dec = make_decoder(spec, weights, "megakernel", max(contexts) + steps + 12, plan=plan)
        for ctx in contexts:
            gen = torch.Generator().manual_seed(ctx)
            dec.reset()
            dec.prefill(torch.randint(0, spec.vocab_size, (ctx - 1,), generator=gen))
            tokens = [int(dec.step(1))]
            _time_each(dec.step, 10)
            times = _time_each(dec.step, steps)
            tokens.append(int(dec.token_out))
            out.setdefault(str(ctx), {})[label] = {
                "median_us": statistics.median(times), "p10_us": sorted(times)[len(times) // 10],
                "p90_us": sorted(times)[9 * len(times) // 10], "hidden": dec.hidden.clone(), "tokens": tokens,
            }
        del dec
    for ctx, per in out.items():
        ref = per[REFERENCE]
        for label, r in per.items():
            r["hidden_rel"] = float((r.pop("hidden") - ref["hidden"]).norm() / ref["hidden"].norm()) if label != REFERENCE else 0.0
            r["tokens_equal"] = r["tokens"] == ref["tokens"]
        ref.pop("hidden", None)
    profile, timelines = {}, {}
    for label, plan in plans.items():
        profile[label] = phase_shares(spec, weights, 128, plan=plan)
        timelines[label] = layer_timeline(spec, weights, 128, plan=plan)
    return {"spec": name, "contexts": out, "phases_ctx128": profile, "timeline_ctx128": timelines}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", default=",".join(bundled_names()))
    ap.add_argument("--contexts", default="128,2048")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--jobs", type=int, default=4, help="nvcc processes at once with --build-only")
    ap.add_argument("--variants", help=f"comma-separated variants to build or time (default: all; {REFERENCE} always timed)")
    ap.add_argument("--kinds", default="fast,profile,trace", help="builds to make with --build-only")
    ap.add_argument("--clock-mhz", type=float, default=1980.0, help="SM clock to print the timelines' cycles in us")
    ap.add_argument("--batches", default="1", help="batch sizes to build with --build-only, comma-separated")
    ap.add_argument("--split-positions", default="", help="plan variants: attention splits of at least N positions")
    ap.add_argument("--max-splits", default="", help="plan variants: at most N attention splits a KV head")
    ap.add_argument("--tail-split", action="store_true", help="plan variant v20-t: batch 1's matvecs' short last "
                    "round split in k over warp pairs")
    ap.add_argument("--vector-act", action="store_true", help="plan variant v20-a: batch 1's down input read with "
                    "16-byte loads")
    ap.add_argument("--invariant-cost", type=int, default=0, metavar="N",
                    help="time batch-invariant plans (invariant to N) against plain ones at --batches (default 1,2,4,8,16)")
    ap.add_argument("--invariant-splits", default="", help="with --invariant-cost: also the invariant plans with batch "
                    "M's attention splits at every size, for each M of this comma list")
    a = ap.parse_args()
    specs = a.specs.split(",")
    split_positions = [int(n) for n in a.split_positions.split(",") if n]
    max_splits = [int(n) for n in a.max_splits.split(",") if n]
    if a.invariant_cost:
        batches = [int(b) for b in (a.batches if a.batches != "1" else "1,2,4,8,16").split(",")]
        specs = a.specs.split(",") if a.specs != ",".join(bundled_names()) else ["qwen3-tts-0.6b-talker"]
        return invariant_main(a, specs, batches)
    if a.build_only:
        build_only(specs, a.arch, a.jobs, a.variants and a.variants.split(","), a.kinds.split(","),
                   [int(b) for b in a.batches.split(",")], split_positions, max_splits, a.tail_split,
                   a.vector_act)
        return 0
    results, ok = [], True
    for name in specs:
        contexts = [min(c, load_spec(name).max_position - a.steps - 12) for c in map(int, a.contexts.split(","))]
        labels = a.variants and {REFERENCE, *a.variants.split(","), *(f"{REFERENCE}-s{n}" for n in split_positions),
                                 *(f"{REFERENCE}-m{n}" for n in max_splits),
                                 f"{REFERENCE}-t", f"{REFERENCE}-a"}
        r = time_variants(name, contexts, a.steps, labels, split_positions, max_splits, a.tail_split, a.vector_act)
        results.append(r)
        for ctx, per in r["contexts"].items():
            row = "  ".join(f"{k} {v['median_us']:7.1f} us" for k, v in per.items())
            checks = "  ".join(f"{k}: rel {v['hidden_rel']:.1e} tokens {'=' if v['tokens_equal'] else '!='}"
                               for k, v in per.items() if k != REFERENCE)
            ok &= all(v["hidden_rel"] < 1e-2 for v in per.values())
            print(f"{name:32s} ctx {ctx:>5}  {row}  | {checks}", flush=True)
        for label, ph in r["phases_ctx128"].items():
            total = ph["total_cycles"]
            print(f"{'':32s} phases {label}: " + ", ".join(f"{k} {100 * c / total:.0f}%" for k, c in ph["cycles"].items())
                  + f" (total {total} cycles)", flush=True)
        for label, tl in r["timeline_ctx128"].items():
            print(f"{'':32s} timeline {label} (us at {a.clock_mhz} MHz, median/latest block): "
                  + ", ".join(f"{k} {v['median'] / a.clock_mhz:.1f}/{v['latest'] / a.clock_mhz:.1f}" for k, v in tl.items()),
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


def split_batches(a) -> list[int]:
    return [int(m) for m in a.invariant_splits.split(",") if m]


def invariant_main(a, specs, batches) -> int:
    n = a.invariant_cost
    if a.build_only:
        target = target_for_arch(a.arch)
        jobs = []
        for name in specs:
            spec = load_spec(name)
            found = {(p.batch, p.invariant_to): p for p, _ in invariant_plans(spec, target, n, batches).values()}
            jobs += [(render(spec, p).write(cache_root() / BUILDS), "fast") for p in found.values()]
        build_libraries(jobs, a.arch, a.jobs, log=lambda message: print(message, flush=True))
        return 0
    results = []
    for name in specs:
        contexts = [min(c, load_spec(name).max_position - a.steps - 12) for c in map(int, a.contexts.split(","))]
        r = invariant_cost(name, contexts, a.steps, n, batches, split_batches(a))
        results.append(r)
        for ctx, per in r["median_us"].items():
            for b, t in per.items():
                others = "  ".join(f"{k} {v:7.1f} us ({v / t['plain']:.2f}x)" for k, v in t.items() if k != "plain")
                print(f"{name:32s} ctx {ctx:>5} b {b:>2}: plain {t['plain']:7.1f} us  {others}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
