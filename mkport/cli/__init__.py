"""mkport command line: parses, calls the library, shows results with rich. No logic of its own."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from ..errors import MkportError, check_range
from ..kernel.gpu import KNOWN_TARGETS, target_for_arch
from .options import check_seeds, choose, int_list, open_checkpoint, split_list, weights_seed_of
from ..kernel.spec import bundled_names, load_spec, open_model
from ..kernel.launch_plan import DEFAULT_KERNEL, KERNELS, check_batch, plan_launch, refuse_removed_kernel

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Port, validate and benchmark decode megakernels.",
)
out = Console()
err = Console(stderr=True)


NAME = dict(no_wrap=True)  # a name a user types (spec, engine, arch, op): never wrapped or cut
NUMBER = dict(justify="right", overflow="fold")
TEXT = dict(overflow="fold")  # paths and messages: folded onto more lines, never cut


def show_table(title: str | None, columns: dict[str, dict], rows: list[list[str]], optional: tuple[str, ...] = ()) -> None:
    """Prints rows under columns (header -> rich column options) with no word cut. In a pipe or a file the
    table gets its natural width. In a terminal each column gets at least its longest word (header or cell)
    and shares the width left in proportion to what it lacks to fit its cells on one line; while even the
    longest words do not fit, the headers in `optional` are left out, in that order, and a line says which."""
    keep = list(columns)

    def build(widths: dict[str, int]) -> Table:
        table = Table(title=title)
        for header in keep:
            table.add_column(header, width=widths.get(header), **columns[header])
        for row in rows:
            table.add_row(*(cell for header, cell in zip(columns, row) if header in keep))
        return table

    def need(header: str) -> Measurement:  # (longest word, longest line) of the column's header and cells
        i = list(columns).index(header)
        found = [Measurement.get(out, out.options, out.render_str(c)) for c in [header] + [r[i] for r in rows]]
        return Measurement(max(m.minimum for m in found), max(m.maximum for m in found))

    if not out.is_terminal:  # print() cannot go wider than its console: a console as wide as the table
        table = build({})
        natural = Measurement.get(out, out.options.update_width(10**4), table).maximum
        Console(file=out.file, width=natural).print(table)
        return
    widths: dict[str, int] = {}
    left_out = []
    while True:
        room = out.width - 3 * len(keep) - 1  # the box: a border and a space of padding each side of a column
        needs = {h: need(h) for h in keep}
        words, lines = sum(m.minimum for m in needs.values()), sum(m.maximum for m in needs.values())
        if lines <= room:
            break
        if words <= room:
            widths = {h: m.minimum + (room - words) * (m.maximum - m.minimum) // (lines - words) for h, m in needs.items()}
            break
        if len(left_out) == len(optional):
            break  # rich wraps and folds what it must; NAME columns do not wrap
        keep.remove(optional[len(left_out)])
        left_out.append(optional[len(left_out)])
    out.print(build(widths))
    if left_out:
        out.print(f"[dim](not shown at {out.width} columns: {', '.join(left_out)}; see --json or a pipe)[/]",
                  highlight=False)


@app.command()
def specs(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")):
    """List the bundled model specs."""
    rows = [load_spec(name) for name in bundled_names()]
    if as_json:
        print(json.dumps([{**s.to_dict(), "weight_bytes_per_step": s.weight_bytes_per_step()} for s in rows], indent=2))
        return
    cells = []
    for s in rows:
        rope = s.rope.variant + (" (interleaved)" if s.rope.mrope_interleaved else "")
        head = "tied" if s.tie_embeddings else "untied"
        if s.num_output_heads > 1:
            head += f" x{s.num_output_heads}"
        cells.append([s.name, s.family, str(s.num_layers), str(s.hidden_size), f"{s.num_heads}/{s.num_kv_heads}",
                      str(s.head_dim), str(s.vocab_size), rope, head, f"{s.weight_bytes_per_step() / 1e6:.0f}"])
    columns = {"name": NAME, "family": TEXT, "layers": NUMBER, "hidden": NUMBER, "q/kv heads": NUMBER,
               "head_dim": NUMBER, "vocab": NUMBER, "rope": TEXT, "head": TEXT, "MB/step": NUMBER}
    show_table("bundled specs", columns, cells, optional=("rope", "head", "vocab", "head_dim", "q/kv heads", "family"))


def _kernels(values: list[str]) -> list[str]:
    """--kernel's designs (all when none given); a removed design gets a line saying why it is gone."""
    for kernel in split_list(values, "--kernel"):
        refuse_removed_kernel(kernel, "--kernel")
    return choose(values, "--kernel", KERNELS)


@app.command()
def generate(
    model: str = typer.Argument(..., help="Bundled spec name, config.json path, or model folder (TTS: DIR:talker)."),
    arch: list[str] = typer.Option(["sm_90"], "--arch", help=f"Target(s), comma-separated or repeated: "
                                   f"{', '.join(KNOWN_TARGETS)}."),
    out_dir: Path = typer.Option(Path("generated"), "--out", help="Where <name>-<digest>/ is written."),
    check: bool = typer.Option(False, "--check", help="Compile with nvcc and check registers, spills, smem."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    kernel: str = typer.Option(DEFAULT_KERNEL, "--kernel", help=f"Kernel design: {', '.join(KERNELS)}."),
    batch: int = typer.Option(1, "--batch", help="Sequences a step (kernel v5): the batch decoder's kernel."),
):
    """Render the decode-step megakernel for MODEL (and with --check, compile it)."""
    from ..kernel.build import DECODE_KERNEL, compile_check
    from ..kernel.render import render

    spec = load_spec(model)
    targets = [target_for_arch(a) for a in split_list(arch, "--arch")]  # all checked before anything is written
    _kernels([kernel])
    check_batch(batch, "--batch")
    results = []
    failed = False
    for target in targets:
        a = target.arch
        plan = plan_launch(spec, target, kernel, batch=batch)
        path = render(spec, plan).write(out_dir)
        entry = {"arch": a, "dir": str(path), "grid": plan.grid, "threads": plan.threads, "smem_bytes": plan.smem_bytes}
        if check:
            res = compile_check(path, plan, target)
            entry["check"] = res.to_dict()
            failed |= not res.ok
        results.append(entry)
    if as_json:
        print(json.dumps({"spec": spec.name, "results": results}, indent=2))
    else:
        rows = []
        for e in results:
            c = e.get("check")
            if c:
                k = next(k for k in c["kernels"] if k["kernel"] == DECODE_KERNEL)
                status = "[green]ok[/]" if c["ok"] else "[red]" + "; ".join(c["problems"]) + "[/]"
                row = [str(k["registers"]), f"{k['spill_stores']}+{k['spill_loads']} B",
                       f"{e['smem_bytes']}+{k['static_smem']} B", status]
            else:
                row = ["-", "-", f"{e['smem_bytes']} B", "rendered (no --check)"]
            rows.append([e["arch"], e["dir"], f"{e['grid']} x {e['threads']}", *row])
        columns = {"arch": NAME, "sources": TEXT, "grid x threads": NUMBER, "regs": NUMBER, "spills": NUMBER,
                   "smem (dyn+static)": NUMBER, "status": TEXT}
        title = f"{spec.name}: decode step megakernel" + (f", batch {batch}" if batch > 1 else "")
        show_table(title, columns, rows, optional=("grid x threads", "smem (dyn+static)"))
    if failed:
        raise typer.Exit(1)


@app.command()
def diff(
    model: str = typer.Argument(..., help="Bundled spec name, config.json path, or model folder (TTS: DIR:talker)."),
    layer_by_layer: bool = typer.Option(False, "--layer-by-layer", help="Compare every traced state of every layer."),
    weights: Optional[Path] = typer.Option(None, "--weights", help="Local model folder with safetensors."),
    random_weights: bool = typer.Option(False, "--random-weights", help="Seeded random weights (cached)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the test tokens (and of an --inject fault)."),
    weights_seed: Optional[int] = typer.Option(None, "--weights-seed", help="Seed of --random-weights (default 0)."),
    prompt_len: int = typer.Option(16, "--prompt-len", help="Tokens prefilled before the checked steps."),
    steps: int = typer.Option(8, "--steps", help="Decode steps compared."),
    inject_at: Optional[str] = typer.Option(None, "--inject", help="LAYER:OP to perturb in the kernel's weights only."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the full report as JSON to this file."),
    plot_out: Optional[Path] = typer.Option(None, "--plot", help="Draw error / tolerance per layer and op (PNG)."),
    kernel: str = typer.Option(DEFAULT_KERNEL, "--kernel", help=f"Kernel design: {', '.join(KERNELS)}."),
    batch: int = typer.Option(1, "--batch", help="Sequences a step (kernel v5): each diffed against its own "
                              "reference run."),
):
    """Diff the megakernel against the float32 reference; exit 0 on pass, 1 on a divergence."""
    from ..check.diff import kernel_diff, parse_inject
    from ..bench.plots import check_plot_path, diff_heatmap
    from ..runtime.decoder import require_gpu

    source = open_model(model)
    spec = source.spec
    where = parse_inject(inject_at, spec) if inject_at else None
    check_seeds(seed=seed, weights_seed=weights_seed)
    _kernels([kernel])
    check_batch(batch, "--batch")
    if plot_out:
        check_plot_path(plot_out)
    require_gpu()
    checkpoint = open_checkpoint(spec, weights, random_weights, weights_seed)
    with err.status(f"building and running {spec.name}"):
        result = kernel_diff(source, checkpoint, prompt_len, steps, seed, layer_by_layer, where, log=err.print,
                             kernel=kernel, batch=batch)
    report = result.report
    rows = [["" if r.layer is None else str(r.layer), r.op, f"{r.max_abs:.2e}", f"{r.rel_l2:.2e}", f"{r.cosine:.6f}",
             f"{r.tol:.1e}", "[green]ok[/]" if r.ok else "[bold red]FAIL[/]"] for r in report.rows]
    columns = {"layer": NUMBER, "op": NAME, "max abs": NUMBER, "rel L2": NUMBER, "min cos": NUMBER, "tol": NUMBER,
               "status": TEXT}
    batched = f", {batch} sequences a step" if batch > 1 else ""
    show_table(f"{spec.name}: megakernel {kernel} vs float32 reference, {steps} steps after {prompt_len} "
               f"prefilled ({result.positions} rope positions{batched})", columns, rows, optional=("tol",))
    out.print(f"greedy tokens agree on {result.token_agreement}/{steps * batch} steps")
    out.print(report.verdict(), highlight=False)
    if where is not None:
        found = "found exactly there" if result.caught_injection else "[bold red]NOT found there[/]"
        out.print(f"injected fault at layer {where[0]} {where[1]}: {found}")
    if json_out or plot_out:
        payload = {"spec": spec.name, **result.to_dict()}  # the picture draws what the JSON holds
        if json_out:
            json_out.write_text(json.dumps(payload, indent=2))
        if plot_out:
            diff_heatmap(payload, plot_out)
    raise typer.Exit(0 if report.passed else 1)


@app.command()
def bench(
    model: str = typer.Argument(..., help="Bundled spec name, config.json path, or model folder (TTS: DIR:talker)."),
    weights: Optional[Path] = typer.Option(None, "--weights", help="Local model folder with safetensors."),
    random_weights: bool = typer.Option(False, "--random-weights", help="Seeded random weights (cached)."),
    weights_seed: Optional[int] = typer.Option(None, "--weights-seed", help="Seed of --random-weights (default 0)."),
    prompt_len: int = typer.Option(32, "--prompt-len", help="Prompt tokens for time to first token."),
    steps: int = typer.Option(100, "--steps", help="Timed decode steps per engine and context."),
    contexts: Optional[list[str]] = typer.Option(None, "--contexts", help="Context lengths, comma-separated or "
                                                 "repeated (default 128,512,2048)."),
    engines: Optional[list[str]] = typer.Option(None, "--engines", help="Engines to time, comma-separated or repeated "
                                                "(default megakernel,hf_graph,hf_eager)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write every raw number as JSON to this file."),
    plot_out: Optional[Path] = typer.Option(None, "--plot", help="Draw step latency against context (PNG)."),
    phases: bool = typer.Option(False, "--phases", help="Also profile where the megakernel's step time goes."),
    kernels: list[str] = typer.Option([DEFAULT_KERNEL], "--kernel", help=f"Kernel design(s) to time, comma-separated "
                                      f"or repeated: {', '.join(KERNELS)} (ratios are to the first)."),
    batches: Optional[list[str]] = typer.Option(None, "--batch", help="Batch sizes of the megakernel (v5), "
                                                "comma-separated or repeated (default 1): a step of B sequences."),
    tts: bool = typer.Option(False, "--tts", hidden=True),  # moved to bench-tts; says so
):
    """Time decode steps: the megakernel against transformers eager and static-cache CUDA graphs.

    A whole Qwen3-TTS request: mkport bench-tts."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..bench.decode import ENGINES, plot, run_bench
    from ..runtime.decoder import require_gpu

    if tts:
        raise MkportError("bench --tts is now its own command: mkport bench-tts (DIR | --random-weights 0.6b|1.7b) "
                          "[--steps FRAMES] [--engines ...] [--text T] [--json FILE]")
    source = open_model(model)
    spec = source.spec
    check_seeds(weights_seed=weights_seed)
    ctx_list = int_list(contexts or ["128,512,2048"], "--contexts")
    chosen = choose(engines, "--engines", ENGINES)
    kernel_list = _kernels(kernels)
    batch_list = int_list(batches or ["1"], "--batch")
    for batch in batch_list:
        check_batch(batch, "--batch")
    require_gpu()
    checkpoint = open_checkpoint(spec, weights, random_weights, weights_seed)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err) as bar:
        task = bar.add_task("starting")
        result = run_bench(source, checkpoint, ctx_list, steps, prompt_len, engines=tuple(chosen), phases=phases,
                           progress=lambda message: bar.update(task, description=message), kernels=tuple(kernel_list),
                           batches=tuple(batch_list))
    env = result["environment"]
    rows = []
    for r in result["results"]:
        if "error" in r:
            rows.append([r["engine"], str(r["context"]), f"[red]{r['error']}[/]", *[""] * 6])
            continue
        ttft = "" if r["ttft_ms"] is None else f"{r['ttft_ms']:.2f}"
        speed = f"{r['megakernel_speedup']:.2f}" if "megakernel_speedup" in r else ""
        if "batch_step_ratio" in r:
            speed = f"{r['batch_step_ratio']:.2f} (of batch 1)"
        rows.append([r["engine"], str(r["context"]), f"{r['median_us']:.1f}", f"{r['p10_us']:.1f}", f"{r['p90_us']:.1f}",
                     f"{r['tokens_per_s']:.0f}", ttft, f"{100 * r['floor_fraction']:.0f}%", speed])
    columns = {"engine": NAME, "context": NUMBER, "median us": NUMBER, "p10": NUMBER, "p90": NUMBER, "tok/s": NUMBER,
               "TTFT ms": NUMBER, "of floor": NUMBER, "megakernel x": NUMBER}
    show_table(f"{spec.name} decode step on {env['gpu']} (bf16; -bN rows: N sequences a step)", columns, rows,
               optional=("p10", "p90", "tok/s", "TTFT ms"))
    out.print(f"bandwidth floor {result['floor_us']:.1f} us: {result['weight_bytes_per_step'] / 1e6:.0f} MB a step "
              f"at {result['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (device copy, measured in this run)")
    for kernel, ph in (result["phases"] or {}).items():
        shares = ", ".join(f"{k} {100 * v / ph['total_cycles']:.0f}%" for k, v in ph["cycles"].items())
        out.print(f"megakernel {kernel} phases at context {ph['context']}: {shares}")
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))
    if plot_out:
        plot(result, plot_out)


@app.command("bench-tts")
def bench_tts(
    model: Optional[str] = typer.Argument(None, metavar="DIR", help="A Qwen3-TTS-12Hz CustomVoice model folder (or --random-weights)."),
    random_weights: Optional[str] = typer.Option(None, "--random-weights", help="Seeded random model instead of DIR: "
                                                 "0.6b or 1.7b."),
    seed: int = typer.Option(0, "--seed", help="The sampling seed."),
    weights_seed: Optional[int] = typer.Option(None, "--weights-seed", help="Seed of --random-weights (default 0)."),
    steps: int = typer.Option(100, "--steps", help="Frames of the timed request (80 ms each)."),
    engines: Optional[list[str]] = typer.Option(None, "--engines", help="Engines to time, comma-separated or repeated "
                                                "(default mkport,official,faster-qwen3-tts)."),
    text: Optional[str] = typer.Option(None, "--text", help="The text to speak (default: a fixed English sentence)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write every raw number as JSON to this file."),
    plot_out: Optional[Path] = typer.Option(None, "--plot", help="Draw mkport's request as a timeline (PNG)."),
    plan: Optional[Path] = typer.Option(None, "--plan", help="A `mkport plan` file: mkport runs its pick for batch 1."),
):
    """Time a Qwen3-TTS request on mkport, the official pipeline and faster-qwen3-tts.

    First chunk, time per frame, real-time factor; exit 1 when an engine could not be timed (its row says why)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..bench.plots import check_plot_path, tts_timeline
    from ..runtime.decoder import require_gpu
    from ..tts.bench_tts import DEFAULT_TEXT, TTS_ENGINES, resolve_tts_model, run_tts_bench
    from ..tts.model import random_model_folder
    from ..runtime.decoder import DEFAULT_MAX_SEQ

    source = resolve_tts_model(model, random_weights)
    check_seeds(seed=seed, weights_seed=weights_seed)
    check_range(steps, "--steps", 1, DEFAULT_MAX_SEQ, " (frames)")
    chosen = choose(engines, "--engines", TTS_ENGINES)
    if text is not None and not text.strip():
        raise MkportError("--text is empty: give the words to speak")
    if plot_out:
        check_plot_path(plot_out)
        if "mkport" not in chosen:
            raise MkportError("--plot draws mkport's request: add mkport to --engines")
    if plan is not None and "mkport" not in chosen:
        raise MkportError("--plan says how mkport runs: add mkport to --engines")
    require_gpu()
    weights_seed = weights_seed_of(random_weights is not None, weights_seed)
    folder = random_model_folder(source, weights_seed) if random_weights else source
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err) as bar:
        task = bar.add_task("starting")
        result = run_tts_bench(folder, DEFAULT_TEXT if text is None else text, steps, seed, tuple(chosen), plan=plan,
                               progress=lambda message: bar.update(task, description=message))
    ms = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    rows, notes = [], []
    for r in result["results"]:
        if "error" in r:
            rows.append([r["engine"], "[red]-[/]", *["-"] * 7])
            notes.append(f"[red]{r['engine']}: {r['error']}[/]")
            continue
        first = ms(r["first_chunk_ms"]) + ("" if r["streamed"] else " *")
        rows.append([r["engine"], first, str(r["first_chunk_frames"]), ms(r["frame_median_ms"]), ms(r["frame_p10_ms"]),
                     ms(r["frame_p90_ms"]), "-" if r["rtf"] is None else f"{r['rtf']:.3f}", str(r["frames"]),
                     f"{r['audio_s']:.2f}"])
        notes.append(f"{r['engine']}: frame time = {r['frame_method']}")
    columns = {"engine": NAME, "first chunk ms": NUMBER, "its frames": NUMBER, "frame ms": NUMBER, "p10": NUMBER,
               "p90": NUMBER, "RTF": NUMBER, "frames": NUMBER, "audio s": NUMBER}
    planned = f", mkport on {result['composition']} (the plan's pick)" if result.get("composition") else ""
    show_table(f"Qwen3-TTS request on {result['environment']['gpu']}: {Path(result['folder']).name}, {steps} frames, "
               f"speaker {result['speaker']}{planned}", columns, rows, optional=("p10", "p90", "its frames"))
    for r in result["results"]:
        if r.get("first_chunk_parts_ms"):
            parts = r["first_chunk_parts_ms"]
            show_table(f"{r['engine']}: where its first chunk went (ms)",
                       {"set-up": NUMBER, "prefill": NUMBER, "first frame": NUMBER, "codec": NUMBER,
                        "first chunk": NUMBER},
                       [[ms(parts[k]) for k in ("setup", "prefill", "first_frame", "codec")] + [ms(r["first_chunk_ms"])]])
    out.print("first chunk: text in to the first PCM samples on the host (* not streamed: all of its audio); RTF: "
              "request wall time / audio seconds; frame ms: the frames after the first (docs/tts.md)")
    for note in notes:
        out.print(note, highlight=False)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))
    if plot_out:
        tts_timeline(result, plot_out)
    if any("error" in r for r in result["results"]):
        raise typer.Exit(1)  # a comparison with an engine missing is not the one asked for


@app.command("plan")
def plan_command(
    model: Optional[str] = typer.Argument(None, metavar="DIR", help="A Qwen3-TTS-12Hz CustomVoice model folder (or --random-weights)."),
    random_weights: Optional[str] = typer.Option(None, "--random-weights", help="Seeded random model instead of DIR: "
                                                 "0.6b or 1.7b."),
    batches: Optional[list[str]] = typer.Option(None, "--batch", help="Batch sizes (concurrent streams) to plan for, "
                                                "comma-separated or repeated (default 1,8,16,32)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the plan, with every time measured, to this "
                                            "file."),
    validate: bool = typer.Option(False, "--validate", help="Then run every supported composition end to end and "
                                  "compare the pick with the measured best."),
    runs: int = typer.Option(3, "--runs", help="With --validate: end-to-end runs of each composition (their median)."),
):
    """Choose how Qwen3-TTS runs at each batch size: backends of talker and predictor, codec beside or after them.

    Times each group alone (prefill, talker, code predictor, codec), scores every composition with a model of the
    streaming schedule and picks the lowest frame time that stays real time (docs/planning.md)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..tts.planner import MAX_BATCH, PLAN_COLUMNS, VALIDATION_COLUMNS, plan_rows, validation_rows, write_plan
    from ..runtime.decoder import require_gpu
    from ..tts.bench_tts import resolve_tts_model
    from ..tts.compose import make_plan
    from ..tts.model import random_model_folder

    source = resolve_tts_model(model, random_weights, "plan")
    batch_list = int_list(batches or ["1,8,16,32"], "--batch")
    for batch in batch_list:
        check_range(batch, "--batch", 1, MAX_BATCH, " (streams)")
    check_range(runs, "--runs", 1, 20)
    if json_out is not None and not json_out.parent.is_dir():
        raise MkportError(f"--json {json_out}: the folder {json_out.parent} does not exist")
    require_gpu()
    folder = random_model_folder(source) if random_weights else source
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err) as bar:
        task = bar.add_task("starting")
        result = make_plan(folder, batch_list, check=validate, runs=runs,
                           progress=lambda message: bar.update(task, description=message))
    times = result.times
    styles = {"batch": NUMBER, "composition": NAME, "chosen": TEXT}
    show_table(f"Qwen3-TTS plan on {times.gpu} ({times.sm_count} SMs): {Path(result.model).name}",
               {c: styles.get(c, NUMBER) for c in PLAN_COLUMNS}, plan_rows(result),
               optional=("measured first chunk ms", "first chunk ms", "RTF"))
    out.print("frame ms: a frame of every stream (80 ms of audio each), estimated from the groups alone; first chunk: "
              "a stream joining the batch, prompt in to first audio; mk = megakernel, split K = the codec on K SMs "
              "beside the megakernels (docs/planning.md)", highlight=False)
    for where, why in times.notes.items():
        out.print(f"not timed: {where.replace('/', ' at batch ')}: {why}", highlight=False)
    if result.validation:
        show_table("the pick against every composition run end to end (median of runs)",
                   {c: NAME if c in ("pick", "measured best") else NUMBER for c in VALIDATION_COLUMNS},
                   validation_rows(result))
    if json_out:
        write_plan(result, json_out)


cache_app = typer.Typer(no_args_is_help=True, help="List or remove what mkport keeps in its cache ($MKPORT_CACHE).")
app.add_typer(cache_app, name="cache")


@cache_app.command("list")
def cache_list(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")):
    """Show the cached builds, random weights and random TTS models, with their sizes."""
    from ..kernel.cache import cache_root, list_cache

    entries = list_cache()
    if as_json:
        print(json.dumps({"root": str(cache_root()), "entries": [e.to_dict() for e in entries]}, indent=2))
        return
    out.print(f"cache root: {cache_root()}", highlight=False, soft_wrap=True)
    if entries:
        show_table(None, {"kind": NAME, "name": TEXT, "MB": NUMBER},
                   [[e.kind, e.name, f"{e.size / 1e6:.1f}"] for e in entries])
    out.print(f"{len(entries)} entries, {sum(e.size for e in entries) / 1e6:.1f} MB", highlight=False)


@cache_app.command("clear")
def cache_clear(
    builds: bool = typer.Option(False, "--builds", help="Remove the kernel builds."),
    weights: bool = typer.Option(False, "--weights", help="Remove the random weights and random TTS models."),
    everything: bool = typer.Option(False, "--all", help="Remove both."),
):
    """Remove cached builds and/or random weights (only mkport's own folders under the cache root)."""
    from ..kernel.cache import clear_cache

    chosen = [name for name, flag in (("builds", builds), ("weights", weights), ("all", everything)) if flag]
    if len(chosen) != 1:
        raise MkportError("give one of --builds, --weights or --all")
    removed = clear_cache(chosen[0])
    out.print(f"removed {len(removed)} entries, {sum(e.size for e in removed) / 1e6:.1f} MB", highlight=False)


from .speak import speak  # noqa: E402  (a command group's own module, registered here)

app.command()(speak)

from .run import run  # noqa: E402  (a ported language model generating text)

app.command()(run)

from .serve import loadtest, serve  # noqa: E402

app.command()(serve)
app.command()(loadtest)


def main() -> None:
    """Entry point: bad input and unsupported configs end in one line on stderr and exit code 2."""
    try:
        app()
    except MkportError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except OSError as e:  # a file or folder mkport needs cannot be made or read (cache root, output folder)
        where = f": {e.filename}" if e.filename else ""
        err.print(f"[bold red]error:[/] {e.strerror or e}{where}", highlight=False, soft_wrap=True)
        sys.exit(2)

