"""The commands' consoles and their table renderer: tables that never cut a name."""

from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

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
