"""`mkport specs` and `mkport generate`: the bundled specs, and the megakernel rendered (and compiled) for MODEL.
Nothing here needs torch."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..errors import MkportError
from ..kernel.gpu import KNOWN_TARGETS, target_for_arch
from ..kernel.launch_plan import DEFAULT_KERNEL, KERNELS, check_batch, plan_launch, check_kernel_support
from ..kernel.spec import bundled_names, load_spec
from .options import check_kernels, split_list
from .table import NAME, NUMBER, TEXT, show_table


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



def generate(
    model: str = typer.Argument(..., help="Bundled spec name, config.json path, or model folder (TTS: DIR:talker)."),
    arch: list[str] = typer.Option(["sm_90"], "--arch", help=f"Target(s), comma-separated or repeated: "
                                   f"{', '.join(KNOWN_TARGETS)}."),
    out_dir: Path = typer.Option(Path("generated"), "--out", help="Where <name>-<digest>/ is written."),
    check: bool = typer.Option(False, "--check", help="Compile with nvcc and check registers, spills, smem."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    kernel: str = typer.Option(DEFAULT_KERNEL, "--kernel", help=f"Kernel design: {', '.join(KERNELS)}."),
    batch: int = typer.Option(1, "--batch", help="Sequences a step: the batch decoder's kernel."),
):
    """Render the decode-step megakernel for MODEL (and with --check, compile it)."""
    from ..kernel.build import DECODE_KERNEL, compile_check
    from ..kernel.render import render

    spec = load_spec(model)
    check_kernel_support(spec, batch)
    targets = [target_for_arch(a) for a in split_list(arch, "--arch")]  # all checked before anything is written
    check_kernels([kernel])
    check_batch(batch, "--batch")
    if out_dir.exists() and not out_dir.is_dir():
        raise MkportError(f"--out {out_dir} is a file: give a folder (<name>-<digest>/ is written into it)")
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
