"""The table printer the benches share: a header, a rule and rows, each column a title and a format spec."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

Columns = Sequence[tuple[str, str]]  # (title, format spec such as ">8.2f" or "<22")


def _cell(value: object, spec: str) -> str:
    """`value` in `spec`; a value the spec does not take (a text in a number's column) only aligned and padded."""
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        align, width = re.match(r"([<>^]?)(\d*)", spec).groups()
        return format(str(value), f"{align or '>'}{width}")


def header_lines(columns: Columns, rule: bool = True) -> list[str]:
    """The titles, aligned and padded as their specs say; a rule of dashes under them (`rule`)."""
    header = " ".join(_cell(title, re.match(r"[<>^]?\d*", spec).group()) for title, spec in columns)
    return [header, "-" * len(header)] if rule else [header]


def row_line(columns: Columns, row: Sequence[object]) -> str:
    """A row, a value per column (a shorter row leaves the last columns out): for a table printed as it is measured."""
    return " ".join(_cell(value, spec) for value, (_, spec) in zip(row, columns))


def print_table(columns: Columns, rows: Iterable[Sequence[object]], rule: bool = True) -> None:
    print("\n".join([*header_lines(columns, rule), *(row_line(columns, row) for row in rows)]), flush=True)
