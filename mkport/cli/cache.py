"""`mkport cache list|clear`."""

from __future__ import annotations

import json

import typer

from ..errors import MkportError
from .table import NAME, NUMBER, TEXT, out, show_table

cache_app = typer.Typer(no_args_is_help=True, help="List or remove what mkport keeps in its cache ($MKPORT_CACHE).")


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
    builds: bool = typer.Option(False, "--builds", help="Remove the kernel builds and the compiled codec."),
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
