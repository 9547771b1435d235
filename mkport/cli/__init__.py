"""mkport command line: the Typer app, every command registered here (each command group has its own module), and
main(). The commands parse, call the library and show results with rich; no logic of their own."""

from __future__ import annotations

import sys

import typer

from ..errors import MkportError
from . import bench, cache, check, kernel, run, serve, speak  # modules, so that no command hides its module
from .table import err

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Port, validate and benchmark decode megakernels.",
)
app.command()(kernel.specs)
app.command()(kernel.generate)
app.command()(check.diff)
app.command()(bench.bench)
app.command("bench-tts")(bench.bench_tts)
app.command("plan")(bench.plan_command)
app.add_typer(cache.cache_app, name="cache")
app.command()(speak.speak)
app.command()(run.run)
app.command()(serve.serve)
app.command()(serve.loadtest)


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

