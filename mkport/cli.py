"""mkport command line: parses, calls the library, shows results with rich. No logic of its own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from .errors import MkportError
from .gpu import KNOWN_TARGETS, target_for_arch
from .spec import bundled_names, load_spec
from .tiling import plan_launch

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Port, validate and benchmark decode megakernels.",
)
out = Console()
err = Console(stderr=True)


@app.command()
def specs(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")):
    """List the bundled model specs."""
    rows = [load_spec(name) for name in bundled_names()]
    if as_json:
        print(json.dumps([{**s.to_dict(), "weight_bytes_per_step": s.weight_bytes_per_step()} for s in rows], indent=2))
        return
    table = Table(title="bundled specs")
    for col in ("name", "family", "layers", "hidden", "heads/kv", "head_dim", "vocab", "rope", "head", "MB/step"):
        table.add_column(col, justify="left" if col in ("name", "family", "rope", "head") else "right")
    for s in rows:
        rope = s.rope.variant + (" (interleaved)" if s.rope.mrope_interleaved else "")
        head = "tied" if s.tie_embeddings else "untied"
        if s.num_output_heads > 1:
            head += f" x{s.num_output_heads}"
        table.add_row(
            s.name,
            s.family,
            str(s.num_layers),
            str(s.hidden_size),
            f"{s.num_heads}/{s.num_kv_heads}",
            str(s.head_dim),
            str(s.vocab_size),
            rope,
            head,
            f"{s.weight_bytes_per_step() / 1e6:.0f}",
        )
    out.print(table)


@app.command()
def generate(
    model: str = typer.Argument(..., help="Bundled spec name, config.json path, or model folder (TTS: DIR:talker)."),
    arch: list[str] = typer.Option(["sm_90"], "--arch", help=f"Target(s): {', '.join(KNOWN_TARGETS)}."),
    out_dir: Path = typer.Option(Path("generated"), "--out", help="Where <name>-<digest>/ is written."),
    check: bool = typer.Option(False, "--check", help="Compile with nvcc and check registers, spills, smem."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
):
    """Render the decode-step megakernel for MODEL (and with --check, compile it)."""
    from .build import compile_check
    from .render import render

    spec = load_spec(model)
    results = []
    failed = False
    for a in arch:
        target = target_for_arch(a)
        plan = plan_launch(spec, target)
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
        table = Table(title=f"{spec.name}: decode step megakernel")
        for col in ("arch", "sources", "grid x threads", "regs", "spills", "smem (dyn+static)", "status"):
            table.add_column(col)
        for e in results:
            c = e.get("check")
            if c:
                k = c["kernels"][0]
                status = "[green]ok[/]" if c["ok"] else "[red]" + "; ".join(c["problems"]) + "[/]"
                row = (str(k["registers"]), f"{k['spill_stores']}+{k['spill_loads']} B", f"{e['smem_bytes']}+{k['static_smem']} B", status)
            else:
                row = ("-", "-", f"{e['smem_bytes']} B", "rendered (no --check)")
            table.add_row(e["arch"], e["dir"], f"{e['grid']} x {e['threads']}", *row)
        out.print(table)
    if failed:
        raise typer.Exit(1)


from .tts.cli import speak  # noqa: E402  (the command lives with the TTS pipeline)

app.command()(speak)


def main() -> None:
    """Entry point: bad input and unsupported configs end in one line on stderr and exit code 2."""
    try:
        app()
    except MkportError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
