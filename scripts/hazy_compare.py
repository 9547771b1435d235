"""Hazy Research's low-latency-llama megakernel beside mkport's, on the same random weights (issue 27).

Run through scripts/hazy_compare.sh on the GPU machine (it builds their extension first); their sources are read from
.thirdparty/ (scripts/hazy_fetch.sh), never copied into the repository. Stages, each recorded in OUT/hazy_compare.json
and OUT/hazy_compare.md as soon as it ends, so that a failure (or a hang cut by the caller's timeout) keeps what came
before it:

  config     the model config, read by mkport (mkport.kernel.spec.open_model)
  env        GPU, clocks, versions, the copy bandwidth and the step's floor (mkport.bench.decode)
  weights    mkport's seeded random checkpoint of the config (what `--random-weights` uses), and a folder that shows
             the same file to Hazy's loader with the config beside it
  mkport     mkport's step as `mkport bench` times it (bench_megakernel: context, warm-up, CUDA events around each
             step, positions advancing), its kernel launch alone at a fixed position, and a host-clocked loop
  reference  mkport's float32 reference (mkport.check.reference.Reference, transformers' own Llama) on one random
             sequence of context + check_steps tokens: the logits at the last check_steps positions
  mkport_acc mkport's kernel teacher-forced on that sequence, decode steps from position 0, twice
  hazy       Hazy's model through its own loader (LlamaForCausalLM.from_pretrained, interleaved RoPE) and its own
             latency schedule (LatencyScheduleBuilder, round-robin over the SMs), driven by its MK_Generator.run
  hazy_time  Hazy's kernel launch alone at a fixed position (counters zeroed before the start event), its whole step
             (MK_Generator.run: embedding, counter zeroing, launch, argmax; token fed back on the device, positions
             advancing from the same start as mkport's), and a host-clocked loop
  hazy_acc   Hazy's kernel teacher-forced on the same sequence from position 0, twice

--dry-run runs on a CPU: the config, the random weights, the folder for Hazy's loader, and Hazy's own PyTorch model
(not its kernel) loaded from it and compared with mkport's reference on the same weights (use a tiny --config).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # mkport from this checkout, whether or not it is installed
    sys.path.insert(0, str(REPO))
DEFAULT_CONFIG = REPO / "scripts" / "llama-3.2-1b.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/hazy_compare.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for hazy_compare.json and hazy_compare.md")
    p.add_argument("--hazy-src", type=Path, default=REPO / ".thirdparty" / "Megakernels",
                   help="Megakernels' exported tree (scripts/hazy_fetch.sh)")
    p.add_argument("--hazy-module-dir", type=Path, default=None,
                   help="folder holding the built mk_llama extension (scripts/hazy_compare.sh)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the Llama config.json (Hazy's kernel is "
                   "built for Llama-3.2-1B's shapes only)")
    p.add_argument("--context", type=int, default=128, help="tokens in the cache at the first timed step (as "
                   "`mkport bench --contexts`)")
    p.add_argument("--steps", type=int, default=200, help="timed steps")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    p.add_argument("--prompt-len", type=int, default=32, help="mkport bench's prompt for its time to first token")
    p.add_argument("--check-steps", type=int, default=8, help="positions compared with the reference, from --context")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed (--weights-seed)")
    p.add_argument("--data-seed", type=int, default=1, help="the seed of the checked token sequence")
    p.add_argument("--hazy-max-len", type=int, default=16384, help="Hazy's KV cache length (its generate.py's)")
    p.add_argument("--skip", default="", help="comma-separated stages to leave out (mkport, reference, mkport_acc, "
                   "hazy, hazy_time, hazy_acc)")
    p.add_argument("--dry-run", action="store_true", help="CPU only: config, weights, Hazy's PyTorch model against "
                   "the reference; no kernel")
    args = p.parse_args(argv)
    if args.context < 2 or args.steps < 1 or args.warmup < 0 or args.check_steps < 1:
        p.error("--context must be >= 2, --steps and --check-steps >= 1, --warmup >= 0")
    if args.context + args.warmup + args.steps + 2 > args.hazy_max_len:
        p.error("--hazy-max-len must hold context + warmup + steps + 2 positions")
    args.skip = {s for s in args.skip.split(",") if s}
    return args


# ----------------------------------------------------------------------------------------------------------------
# Recording


class Run:
    """The result dict, written whole after every stage; a stage that raises records one line and the rest go on
    (a stage whose inputs are missing records why it was skipped)."""

    def __init__(self, out: Path, args):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.result: dict = {"args": {k: str(v) if isinstance(v, Path) else sorted(v) if isinstance(v, set) else v
                                      for k, v in vars(args).items()},
                             "started": time.strftime("%Y-%m-%d %H:%M:%S"), "stages": {}, "errors": {}}
        path = out / "hazy_compare.json"
        if path.exists():  # the build's failure as hazy_compare.sh recorded it, if any (an older run's rest is replaced)
            with contextlib.suppress(ValueError, OSError, AttributeError):
                build = json.loads(path.read_text()).get("errors", {}).get("build")
                if build:
                    self.result["errors"]["build"] = build
        self.state: dict = {}
        self.write()

    @contextlib.contextmanager
    def stage(self, name: str, needs: tuple[str, ...] = (), skip: set | None = None):
        missing = [n for n in needs if n not in self.state]
        if skip and name in skip:
            self.result["stages"][name] = "skipped (--skip)"
            self.write()
            yield False
            return
        if missing:
            self.result["stages"][name] = f"skipped: needs {', '.join(missing)}"
            print(f"hazy_compare: stage {name} skipped (needs {', '.join(missing)})", flush=True)
            self.write()
            yield False
            return
        print(f"hazy_compare: stage {name}", flush=True)
        t = time.perf_counter()
        try:
            yield True
            self.result["stages"][name] = f"ok in {time.perf_counter() - t:.1f} s"
        except Exception as e:  # noqa: BLE001 - every failure is reported, the next stage still runs
            frame = traceback.extract_tb(e.__traceback__)[-1]
            line = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''} " \
                   f"({Path(frame.filename).name}:{frame.lineno})"
            self.result["stages"][name] = "FAILED"
            self.result["errors"][name] = line
            traceback.print_exc()
            print(f"hazy_compare: FAILED stage {name}: {line}", flush=True)
        finally:
            self.write()

    def write(self) -> None:
        (self.out / "hazy_compare.json").write_text(json.dumps(self.result, indent=1, default=str))
        (self.out / "hazy_compare.md").write_text(markdown(self.result))


def summary(step_us: list[float]) -> dict:
    s = sorted(step_us)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731 - as mkport.bench.decode.EngineTiming
    return {"median_us": statistics.median(s), "p10_us": pick(0.1), "p90_us": pick(0.9), "n": len(s), "step_us": step_us}


def fmt(t: dict | None) -> str:
    if not t:
        return "-"
    return f"{t['median_us']:.1f} us (p10 {t['p10_us']:.1f}, p90 {t['p90_us']:.1f}; n={t['n']})"


def markdown(r: dict) -> str:
    env = r.get("env", {})
    mk, hz = r.get("mkport", {}), r.get("hazy", {})
    floor = env.get("floor_us")
    smi = ", ".join(f"{k} {v}" for k, v in (env.get("nvidia_smi") or {}).items() if k.startswith("clocks"))

    def frac(t):
        return f"{floor / t['median_us']:.0%}" if floor and t else "-"

    def acc(a):
        if not a:
            return "-"
        return f"{a['rel_l2']:.2%} (max over steps {a['rel_l2_max_step']:.2%})"

    lines = [
        "# Hazy's low-latency-llama beside mkport (scripts/hazy_compare.py)",
        "",
        f"{env.get('gpu', '?')} ({smi}); torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, "
        f"transformers {env.get('transformers', '?')}; Hazy: {env.get('hazy_sources', '?')}; mkport kernel "
        f"{mk.get('kernel', '?')}. Config {r['args'].get('config')}, random weights seed {r['args'].get('seed')}; "
        f"context {r['args'].get('context')}, warm-up {r['args'].get('warmup')}, {r['args'].get('steps')} timed steps, "
        f"CUDA events. Floor: {env.get('weight_bytes', 0) / 1e6:.0f} MB at "
        f"{env.get('copy_bandwidth', 0) / 1e12:.2f} TB/s = {floor or 0:.1f} us.",
        "",
        "| what | Hazy | mkport |",
        "|---|---|---|",
        f"| kernel launch alone, position fixed at {r['args'].get('context')} | {fmt(hz.get('kernel_alone'))} | "
        f"{fmt(mk.get('kernel_alone'))} |",
        f"| whole step, events around each, positions advancing | {fmt(hz.get('step'))} | {fmt(mk.get('step'))} |",
        f"| host loop, us a step (wall clock over the timed steps) | "
        f"{hz.get('loop_us', float('nan')):.1f} | {mk.get('loop_us', float('nan')):.1f} |",
        f"| fraction of the floor (kernel alone / whole step) | {frac(hz.get('kernel_alone'))} / {frac(hz.get('step'))} | "
        f"{frac(mk.get('kernel_alone'))} / {frac(mk.get('step'))} |",
        f"| logits vs float32 reference, rel L2 (positions {r['args'].get('context')}.."
        f"{r['args'].get('context', 0) + r['args'].get('check_steps', 0) - 1}) | {acc(hz.get('accuracy'))} | "
        f"{acc(mk.get('accuracy'))} |",
        f"| next token = the reference's (of checked steps) | {hz.get('accuracy', {}).get('argmax_agree', '-')} | "
        f"{mk.get('accuracy', {}).get('argmax_agree', '-')} |",
        f"| top-5 overlap with the reference's top-5 (mean) | {hz.get('accuracy', {}).get('top5_overlap', '-')} | "
        f"{mk.get('accuracy', {}).get('top5_overlap', '-')} |",
        f"| the same inputs twice | {hz.get('determinism', {}).get('verdict', '-')} | "
        f"{mk.get('determinism', {}).get('verdict', '-')} |",
        "",
        "Stages: " + ", ".join(f"{k} {v}" for k, v in r.get("stages", {}).items()),
    ]
    if r.get("errors"):
        lines += ["", "Errors:"] + [f"- {k}: {v}" for k, v in r["errors"].items()]
    if r.get("dry_run"):
        lines += ["", "Dry run (CPU): " + json.dumps(r["dry_run"])]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# Shared pieces


def hazy_folder(config: Path, checkpoint_folder: Path, where: Path) -> Path:
    """A model folder for Hazy's loader: the config and mkport's model.safetensors (a link, not a copy)."""
    folder = where / "hazy-model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config.read_text())
    link = folder / "model.safetensors"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to((checkpoint_folder / "model.safetensors").resolve())
    return folder


def import_hazy(src: Path):
    """Hazy's Python package, from the exported tree."""
    if not (src / "megakernels" / "llama.py").is_file():
        raise FileNotFoundError(f"no Megakernels package under {src} (run scripts/hazy_fetch.sh, carry .thirdparty)")
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    import megakernels.llama as llama  # noqa: F401
    from megakernels.model_types import ExtraModelConfig

    return llama.LlamaForCausalLM, ExtraModelConfig


def load_hazy_model(src: Path, folder: Path, device: str, max_len: int):
    import torch

    LlamaForCausalLM, ExtraModelConfig = import_hazy(src)
    extra = ExtraModelConfig(interleave_rope=True, max_len_override=max_len, max_batch_size=1)
    return LlamaForCausalLM.from_pretrained(str(folder), extra_config=extra, device=device, dtype=torch.bfloat16)


def compare_logits(kernel, reference) -> dict:
    """kernel, reference: [steps, vocab]."""
    k, r = kernel.float().cpu(), reference.float().cpu()
    per = ((k - r).norm(dim=-1) / r.norm(dim=-1)).tolist()
    top_k = k.topk(5, dim=-1).indices
    top_r = r.topk(5, dim=-1).indices
    overlap = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top_k, top_r)]
    return {
        "rel_l2": float((k - r).norm() / r.norm()),
        "rel_l2_per_step": per,
        "rel_l2_max_step": max(per),
        "max_abs": float((k - r).abs().max()),
        "argmax_agree": f"{int((k.argmax(-1) == r.argmax(-1)).sum())} of {k.shape[0]}",
        "top5_overlap": round(sum(overlap) / len(overlap), 2),
    }


def determinism(first, second) -> dict:
    a, b = first.float(), second.float()
    same = bool(a.shape == b.shape and (a == b).all())
    diff = float((a - b).abs().max())
    return {"bit_identical": same, "max_abs_diff": diff,
            "rel_l2": float((a - b).norm() / a.norm()),
            "verdict": "bit-identical" if same else f"different (max abs diff {diff:.3g}, rel L2 {float((a - b).norm() / a.norm()):.2e})"}


def host_loop_us(fn, n: int) -> float:
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


# ----------------------------------------------------------------------------------------------------------------
# The GPU run


def gpu_run(args, run: Run) -> None:
    import torch

    torch.set_grad_enabled(False)
    R, S = run.result, run.state
    ctx, steps, warmup, check = args.context, args.steps, args.warmup, args.check_steps
    skip = args.skip

    with run.stage("config") as go:
        if go:
            from mkport.kernel.spec import open_model

            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device")
            S["source"] = open_model(str(args.config))

    with run.stage("env", needs=("source",)) as go:
        if go:
            from mkport.bench.decode import copy_bandwidth, environment

            sources = args.hazy_src.parent / "SOURCES"
            R["env"] = env = {"hazy_sources": sources.read_text().strip().replace("\n", ", ") if sources.exists() else "?",
                              "weight_bytes": S["source"].spec.weight_bytes_per_step()}
            env.update(environment())
            env["copy_bandwidth"] = copy_bandwidth()
            env["floor_us"] = env["weight_bytes"] / env["copy_bandwidth"] * 1e6

    with run.stage("weights", needs=("source",)) as go:
        if go:
            from mkport.runtime.weights import load_weights, random_weights

            t = time.perf_counter()
            checkpoint = random_weights(S["source"].spec, args.seed)
            S["checkpoint"] = checkpoint
            S["weights"] = load_weights(S["source"].spec, checkpoint)
            S["hazy_folder"] = hazy_folder(args.config, checkpoint.folder, Path(tempfile.mkdtemp(prefix="hazy-")))
            R["weights"] = {"folder": str(checkpoint.folder), "seconds": time.perf_counter() - t}

    # one checked sequence for everybody
    gen = torch.Generator().manual_seed(args.data_seed)
    n_seq = ctx + check
    tokens = None
    if "source" in S:
        tokens = torch.randint(0, S["source"].spec.vocab_size, (n_seq,), generator=gen)

    R.setdefault("mkport", {})
    with run.stage("mkport", needs=("weights",), skip=skip) as go:
        if go:
            from mkport.bench.decode import _time_each, bench_megakernel
            from mkport.kernel.launch_plan import DEFAULT_KERNEL
            from mkport.runtime.backends import make_decoder

            spec, weights = S["source"].spec, S["weights"]
            R["mkport"]["kernel"] = DEFAULT_KERNEL
            timing = bench_megakernel(spec, weights, ctx, steps, args.prompt_len, warmup)
            R["mkport"]["step"] = summary(timing.step_us)
            R["mkport"]["ttft_ms"] = timing.ttft_ms
            run.write()
            dec = make_decoder(spec, weights, "megakernel", max(ctx + warmup + steps, n_seq) + 2)
            S["mkport_decoder"] = dec
            dec.prefill(torch.randint(0, spec.vocab_size, (ctx,), generator=torch.Generator().manual_seed(ctx)))
            dec.step(1)  # the kernel's parameters now hold position ctx; launches below repeat that step
            stream = torch.cuda.current_stream().cuda_stream
            launch = lambda: dec.kernel.launch(dec._params, stream)  # noqa: E731 - the launch alone, host work done
            _time_each(launch, warmup)
            R["mkport"]["kernel_alone"] = summary(_time_each(launch, steps))
            dec.reset()
            dec.prefill(torch.randint(0, spec.vocab_size, (ctx - 1,), generator=torch.Generator().manual_seed(ctx)))
            dec.step(1)
            for _ in range(warmup):
                dec.step()
            R["mkport"]["loop_us"] = host_loop_us(dec.step, steps)

    with run.stage("reference", needs=("checkpoint",), skip=skip) as go:
        if go:
            from mkport.check.reference import Reference

            ref = Reference(S["source"], S["checkpoint"], device="cuda")
            out = ref.run(tokens=tokens)
            S["ref_logits"] = out.logits[ctx:].float().cpu()
            R["reference"] = {"rows": list(out.logits.shape), "argmax": S["ref_logits"].argmax(-1).tolist()}
            del ref, out
            torch.cuda.empty_cache()

    with run.stage("mkport_acc", needs=("mkport_decoder",), skip=skip) as go:
        if go:
            dec = S["mkport_decoder"]

            def teacher_forced(prefill: bool):
                dec.reset()
                rows = []
                start = ctx if prefill else 0
                if prefill:  # mkport's own prefill for the first ctx tokens, as `mkport diff` runs it
                    dec.prefill(tokens[:ctx])
                for t in range(start, n_seq):  # decode steps: from position 0, every K/V comes from the kernel
                    dec.step(int(tokens[t]))
                    rows.append(dec.logits.clone())
                return torch.stack(rows)[-check:]

            try:
                runs = [teacher_forced(False) for _ in range(2)]
                R["mkport"]["acc_mode"] = "decode steps from position 0"
            except Exception as e:  # noqa: BLE001 - a kernel that refuses an empty cache: the prefill path instead
                R["mkport"]["acc_mode"] = f"prefill of {ctx} tokens, then decode ({type(e).__name__}: {e} from 0)"
                runs = [teacher_forced(True) for _ in range(2)]
            R["mkport"]["determinism"] = determinism(runs[0], runs[1])
            if "ref_logits" in S:
                R["mkport"]["accuracy"] = compare_logits(runs[0], S["ref_logits"])
            del runs
            S.pop("mkport_decoder")
            del dec
            torch.cuda.empty_cache()

    R.setdefault("hazy", {})
    with run.stage("hazy", needs=("hazy_folder",), skip=skip) as go:
        if go:
            if args.hazy_module_dir is None or not any(args.hazy_module_dir.glob("mk_llama*.so")):
                raise FileNotFoundError(f"no built mk_llama extension in {args.hazy_module_dir} (hazy_compare.sh builds it)")
            import_hazy(args.hazy_src)
            from megakernels.demos.latency.mk import LatencyMK_Interpreter
            from megakernels.demos.latency.scheduler import LatencyScheduleBuilder
            from megakernels.generators import MK_Generator
            from megakernels.scheduler import assign_to_sms, tensorize_instructions

            model = load_hazy_model(args.hazy_src, S["hazy_folder"], "cuda", args.hazy_max_len)
            schedule = LatencyScheduleBuilder.build(model)
            tensorize_instructions(schedule.globs, assign_to_sms("rr", schedule=schedule))
            interpreter = LatencyMK_Interpreter(args.hazy_module_dir)
            S["hazy_gen"] = MK_Generator(model, interpreter, schedule)
            S["hazy_interpreter"] = interpreter
            R["hazy"]["instructions"] = list(schedule.globs.instructions.shape)
            # one step, synchronized: a kernel that hangs or faults shows here, before the loops
            out = S["hazy_gen"].run(torch.ones(1, 1, dtype=torch.long, device="cuda"), pos_id=0)
            torch.cuda.synchronize()
            R["hazy"]["first_step_token"] = int(out)

    with run.stage("hazy_time", needs=("hazy_gen",), skip=skip) as go:
        if go:
            from mkport.bench.decode import _time_each

            g = S["hazy_gen"]
            globs = g.schedule.globs
            interp = S["hazy_interpreter"]
            globs.pos_id = ctx
            launch = lambda: interp.interpret(globs)  # noqa: E731
            _time_each(launch, warmup, before=g.fill)
            R["hazy"]["kernel_alone"] = summary(_time_each(launch, steps, before=g.fill))
            run.write()
            # the whole step as their generator runs it, the token fed back on the device, positions as mkport's
            state = {"ids": torch.ones(1, 1, dtype=torch.long, device="cuda"), "pos": ctx - 1}

            def step():
                state["ids"] = g.run(state["ids"], pos_id=state["pos"]).view(1, 1)
                state["pos"] += 1

            step()
            _time_each(step, warmup)
            R["hazy"]["step"] = summary(_time_each(step, steps))
            state["pos"] = ctx + warmup
            R["hazy"]["loop_us"] = host_loop_us(step, steps)

    with run.stage("hazy_acc", needs=("hazy_gen",), skip=skip) as go:
        if go:
            g = S["hazy_gen"]
            runs = []
            for _ in range(2):
                rows = []
                for t in range(n_seq):  # decode steps from position 0: every K/V read was written in this pass
                    g.run(tokens[t : t + 1].view(1, 1).cuda(), pos_id=t)
                    rows.append(g.schedule.globs.logits.float().clone())
                runs.append(torch.stack(rows))
            R["hazy"]["determinism"] = determinism(runs[0][ctx:], runs[1][ctx:])  # the checked positions, as mkport's
            R["hazy"]["determinism"]["all_positions_bit_identical"] = bool((runs[0] == runs[1]).all())
            if "ref_logits" in S:
                R["hazy"]["accuracy"] = compare_logits(runs[0][ctx:], S["ref_logits"])


# ----------------------------------------------------------------------------------------------------------------
# The CPU dry run


def dry_run(args, run: Run) -> None:
    import torch

    torch.set_grad_enabled(False)
    R, S = run.result, run.state
    R["dry_run"] = {}
    with run.stage("env") as go:
        if go:
            from mkport.kernel.spec import open_model

            S["source"] = open_model(str(args.config))
            spec = S["source"].spec
            R["dry_run"]["spec"] = {"name": spec.name, "layers": spec.num_layers, "hidden": spec.hidden_size,
                                    "heads": [spec.num_heads, spec.num_kv_heads, spec.head_dim],
                                    "weight_bytes": spec.weight_bytes_per_step()}
            R["dry_run"]["hazy_sources"] = all(
                (args.hazy_src / p).exists() for p in ("demos/low-latency-llama/llama.cu", "megakernels/llama.py",
                                                       "ThunderKittens/include/kittens.cuh"))
    with run.stage("weights", needs=("source",)) as go:
        if go:
            from mkport.runtime.weights import random_weights

            checkpoint = random_weights(S["source"].spec, args.seed)
            S["checkpoint"] = checkpoint
            S["hazy_folder"] = hazy_folder(args.config, checkpoint.folder, Path(tempfile.mkdtemp(prefix="hazy-")))
            R["dry_run"]["weights"] = str(checkpoint.folder)
    with run.stage("hazy_torch", needs=("hazy_folder",), skip=args.skip) as go:
        if go:
            from mkport.check.reference import Reference

            n = args.context + args.check_steps
            tokens = torch.randint(0, S["source"].spec.vocab_size, (n,), generator=torch.Generator().manual_seed(args.data_seed))
            reference = Reference(S["source"], S["checkpoint"], device="cpu").run(tokens=tokens).logits
            model = load_hazy_model(args.hazy_src, S["hazy_folder"], "cpu", max(args.hazy_max_len, n))
            from megakernels.model_types import BatchState

            out = model.model(BatchState(input_ids=tokens[None], position_ids=torch.arange(n)[None]))
            logits = model.lm_head.lm_head(model.lm_head.input_norm(out.hidden_states))[0]
            R["dry_run"]["hazy_torch_vs_reference"] = {
                k: v for k, v in compare_logits(logits[args.context :], reference[args.context :]).items()
                if k != "rel_l2_per_step"}


def main(argv=None) -> int:
    args = parse_args(argv)
    run = Run(args.out, args)
    (dry_run if args.dry_run else gpu_run)(args, run)
    run.result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    run.write()
    print(markdown(run.result), flush=True)
    failed = [k for k, v in run.result["stages"].items() if v == "FAILED"] + \
             [k for k in run.result["errors"] if k == "build"]
    if failed:
        print(f"hazy_compare: FAILED stages: {', '.join(failed)} (see errors in {args.out / 'hazy_compare.json'})")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
