"""The table printer the benches share: a header, a rule and rows, each column a title and a format spec."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence


def _cell(value: object, spec: str) -> str:
    """`value` in `spec`; a value the spec does not take (a text in a number's column) only aligned and padded."""
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        align, width = re.match(r"([<>^]?)(\d*)", spec).groups()
        return format(str(value), f"{align or '>'}{width}")


def table_lines(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[object]], rule: bool = True) -> list[str]:
    """The lines of a table: `columns` as (title, format spec such as ">8.2f"), the titles aligned and padded as the
    spec says; a rule of dashes under the header (`rule`); a row a value per column."""
    header = " ".join(_cell(title, re.match(r"[<>^]?\d*", spec).group()) for title, spec in columns)
    lines = [header, "-" * len(header)] if rule else [header]
    return lines + [" ".join(_cell(value, spec) for value, (_, spec) in zip(row, columns)) for row in rows]


def print_table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[object]], rule: bool = True) -> None:
    print("\n".join(table_lines(columns, rows, rule)), flush=True)
