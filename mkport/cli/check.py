"""`mkport diff`: the megakernel against the float32 reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..kernel.launch_plan import DEFAULT_KERNEL, KERNELS, check_batch, check_kernel_support
from .options import check_json_path, check_kernels, check_seeds, llm_model
from .table import NAME, NUMBER, TEXT, err, out, show_table


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
    batch: int = typer.Option(1, "--batch", help="Sequences a step: each diffed against its own "
                              "reference run."),
):
    """Diff the megakernel against the float32 reference; exit 0 on pass, 1 on a divergence."""
    from ..check.diff import check_diff_lengths, check_reference_fits, kernel_diff, parse_inject
    from ..bench.plots import check_plot_path, diff_heatmap
    from ..runtime.decoder import require_gpu

    llm = llm_model(model, weights, random_weights, weights_seed)
    source, spec = llm.source, llm.source.spec
    check_kernel_support(spec, batch)  # before weights are read or written
    where = parse_inject(inject_at, spec) if inject_at else None
    check_seeds(seed=seed)
    check_kernels([kernel])
    check_batch(batch, "--batch")
    check_diff_lengths(spec, prompt_len, steps, batch)
    check_json_path(json_out)
    if plot_out:
        check_plot_path(plot_out)
    require_gpu(spec)
    check_reference_fits(source)  # before llm.checkpoint() makes any weight
    checkpoint = llm.checkpoint()
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
