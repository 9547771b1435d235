"""The timing commands: `mkport bench` (decode steps), `mkport bench-tts` (a Qwen3-TTS request) and `mkport plan`
(Qwen3-TTS compositions timed and chosen)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..errors import MkportError, check_range
from ..kernel.launch_plan import DEFAULT_KERNEL, KERNELS, check_batch, check_kernel_support
from .options import (check_json_path, check_kernels, check_seeds, choose, int_list, llm_model, tts_model,
                      weights_seed_of)
from .table import NAME, NUMBER, TEXT, err, out, show_table


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
    batches: Optional[list[str]] = typer.Option(None, "--batch", help="Batch sizes of the megakernel, "
                                                "comma-separated or repeated (default 1): a step of B sequences."),
    tts: bool = typer.Option(False, "--tts", hidden=True),  # moved to bench-tts; says so
):
    """Time decode steps: the megakernel against transformers eager and static-cache CUDA graphs.

    A whole Qwen3-TTS request: mkport bench-tts."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..bench.decode import ENGINES, check_bench_lengths, plot, run_bench
    from ..bench.plots import check_plot_path
    from ..runtime.decoder import require_gpu

    if tts:
        raise MkportError("bench --tts is now its own command: mkport bench-tts (DIR | --random-weights 0.6b|1.7b) "
                          "[--steps FRAMES] [--engines ...] [--text T] [--json FILE]")
    llm = llm_model(model, weights, random_weights, weights_seed)
    source, spec = llm.source, llm.source.spec
    check_kernel_support(spec)  # before weights are read or written
    ctx_list = int_list(contexts or ["128,512,2048"], "--contexts")
    chosen = choose(engines, "--engines", ENGINES)
    kernel_list = check_kernels(kernels)
    batch_list = int_list(batches or ["1"], "--batch")
    for batch in batch_list:
        check_batch(batch, "--batch")
        check_kernel_support(spec, batch)
    check_bench_lengths(spec, ctx_list, steps, prompt_len)
    check_json_path(json_out)
    if plot_out:
        check_plot_path(plot_out, png=False)  # plot() saves in the format the name gives
    require_gpu(spec)
    checkpoint = llm.checkpoint()
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
    for line in floor_lines(result):
        out.print(line)
    if result.get("transformers_linear_attention"):
        ops = ", ".join(f"{op}: {code}" for op, code in result["transformers_linear_attention"].items())
        out.print(f"transformers' Gated DeltaNet decode ops: {ops}", highlight=False)
    for kernel, ph in (result["phases"] or {}).items():
        shares = ", ".join(f"{k} {100 * v / ph['total_cycles']:.0f}%" for k, v in ph["cycles"].items())
        out.print(f"megakernel {kernel} phases at context {ph['context']}: {shares}")
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))
    if plot_out:
        plot(result, plot_out)


def floor_lines(result: dict) -> list[str]:
    """The bandwidth floor under the table; an MoE step's floor reads its chosen experts, all of them beside it."""
    tbs = result["copy_bandwidth_bytes_per_s"] / 1e12
    lines = [f"bandwidth floor {result['floor_us']:.1f} us: {result['weight_bytes_per_step'] / 1e6:.0f} MB a step "
             f"at {tbs:.2f} TB/s (device copy, measured in this run)"]
    if "weight_bytes_all_experts" in result:
        lines.append(f"all experts: {result['weight_bytes_all_experts'] / 1e6:.0f} MB, "
                     f"{result['floor_all_experts_us']:.1f} us at {tbs:.2f} TB/s (the floor above reads the chosen ones)")
    for r in result.get("results", ()):  # a batch of a mixture of experts reads the union of its sequences' experts
        if "weight_bytes_per_step" in r:
            bandwidth = result["copy_bandwidth_bytes_per_s"]
            lines.append(f"{r['engine']} at context {r['context']}: {r['experts_read']:.1f} experts a sparse layer (the "
                         f"union of its sequences'), {r['weight_bytes_per_step'] / 1e6:.0f} MB a step, floor "
                         f"{r['weight_bytes_per_step'] / bandwidth * 1e6:.1f} us (its 'of floor')")
    return lines


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
    from ..tts.bench_tts import DEFAULT_TEXT, TTS_ENGINES, run_tts_bench
    from ..runtime.decoder_api import DEFAULT_MAX_SEQ

    check_seeds(seed=seed)
    tts_arg = tts_model(model, random_weights, weights_seed_of(random_weights is not None, weights_seed),
                    command="bench-tts")
    check_range(steps, "--steps", 1, DEFAULT_MAX_SEQ, " (frames)")
    chosen = choose(engines, "--engines", TTS_ENGINES)
    if text is not None and not text.strip():
        raise MkportError("--text is empty: give the words to speak")
    check_json_path(json_out)
    if plot_out:
        check_plot_path(plot_out)
        if "mkport" not in chosen:
            raise MkportError("--plot draws mkport's request: add mkport to --engines")
    if plan is not None and "mkport" not in chosen:
        raise MkportError("--plan says how mkport runs: add mkport to --engines")
    require_gpu()
    folder = tts_arg.folder()
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
    from ..tts.compose import make_plan

    tts_arg = tts_model(model, random_weights, command="plan")
    batch_list = int_list(batches or ["1,8,16,32"], "--batch")
    for batch in batch_list:
        check_range(batch, "--batch", 1, MAX_BATCH, " (streams)")
    check_range(runs, "--runs", 1, 20)
    check_json_path(json_out)
    require_gpu()
    folder = tts_arg.folder()
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
