"""The commands' tables: ids whole, borders whole, at any width (docs/operations.md).

A table's id and number columns never wrap (an id split mid-word cannot be copied back); only
prose (a failure's reason) wraps, at its words. When the table would not fit the console even
so, the listing is one block per row instead, whose lines the terminal may wrap: nothing is
ever cut, and no border is cropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

_PROSE_MIN = 12  # the narrowest a wrapping column gets


def needed(headers: Sequence[str], rows: Sequence[Sequence[str]], prose: str | None = None) -> int:
    """The columns a table needs with every cell but ``prose`` whole on one line: each column's widest
    line, a space either side, and a border between columns and at both ends."""
    width = 1
    for n, header in enumerate(headers):
        cells = [header.splitlines() or [""], *([row[n]] for row in rows)]
        widest = max(cell_len(line) for lines in cells for line in lines)
        width += (_PROSE_MIN if header == prose else widest) + 3
    return width


def fits(console: Console, table: Table) -> bool:
    """True when ``table`` can be drawn within the console's width with every id and number whole."""
    return getattr(table, "needed", 0) <= console.width


def inbox_table(database: str, stats: Mapping[str, Mapping[str, Any]], columns: Sequence[str]) -> Table:
    table = Table(title=f"inbox statistics: {database}")
    table.add_column("handler", no_wrap=True)
    for column in columns:
        # Two-line headers ("outbox" over "published") keep the table narrow.
        table.add_column(column.replace("_", "\n"), justify="right", no_wrap=True)
    rows = [[handler, *(str(values[c]) for c in columns)] for handler, values in sorted(stats.items())]
    for row in rows:
        table.add_row(*row)
    table.needed = needed(["handler", *(c.replace("_", "\n") for c in columns)], rows)  # type: ignore[attr-defined]
    return table


def inbox_blocks(
    database: str, stats: Mapping[str, Mapping[str, Any]], columns: Sequence[str]
) -> list[tuple[str, bool]]:
    """The narrow form: per handler, its id on a line of its own (never wrapped by us), then its
    counts (wrapped at their words); each line with whether it may wrap."""
    lines = [(f"inbox statistics: {database}", True)]
    for handler, values in sorted(stats.items()):
        counts = "  " + ", ".join(f"{c}={values[c]}" for c in columns)  # a count never apart from its name
        lines += [("", True), (handler, False), (counts, True)]
    return lines


def print_inbox(
    console: Console, database: str, stats: Mapping[str, Mapping[str, Any]], columns: Sequence[str]
) -> None:
    table = inbox_table(database, stats, columns)
    if fits(console, table):
        console.print(table)
        return
    for line, wraps in inbox_blocks(database, stats, columns):
        console.print(line, markup=False, highlight=False, soft_wrap=not wraps)


def listing_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], *, prose: str) -> Table:
    """A table whose only wrapping column is ``prose`` (wrapped at its words); the others stay whole."""
    table = Table(title=title, show_lines=False)
    for name in headers:
        if name == prose:
            table.add_column(name, overflow="fold", min_width=12, ratio=1)
        else:
            table.add_column(name, no_wrap=True)
    for row in rows:
        table.add_row(*row)
    table.needed = needed(headers, rows, prose)  # type: ignore[attr-defined]
    return table


def print_wide(console: Console, table: Table) -> None:
    """The table even where it does not fit (``--wide``): drawn at its own width, the terminal wraps it."""
    width = console.width
    console.width = max(width, getattr(table, "needed", 0))
    try:
        console.print(table)
    finally:
        console.width = width
