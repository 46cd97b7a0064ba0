"""The configuration reference (docs/configuration.md), generated from the config dataclasses: every key, its default,
the rule its field declares (rules.py) and its field comment in schema.py, the one source.
``python -m rlsearch.config.reference > docs/configuration.md`` writes it; a test fails when the file and the schema
drift apart."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import tokenize
from typing import Any

from . import schema
from .rules import describe

HEADER = """# Configuration reference

Generated from `rlsearch/config/schema.py` (`python -m rlsearch.config.reference > docs/configuration.md`): the
field comments there are the documentation. Set a key in the YAML config (`section: {key: value}`) or on the
command line (`section.key=value`). Unknown keys and bad values stop the run at start-up, naming the key. "accepts"
is the rule the key's field declares; the checks between keys are in `rlsearch/config/validate.py`.
"""


def field_comments() -> dict[tuple[str, str], str]:
    """(class name, field name) -> its comment: the comment lines right above the field, then the one after it."""
    source = inspect.getsource(schema)
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    found: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                continue
            above, line = [], statement.lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            trailing = comments.get(statement.end_lineno, "") if statement.end_lineno != line else ""
            found[node.name, statement.target.id] = " ".join(part for part in [*above, trailing] if part)
    sections = [cls for cls in vars(schema).values() if isinstance(cls, type) and dataclasses.is_dataclass(cls)]
    for cls in sections:  # a field a subclass inherits (or only gives another default) keeps its comment
        for spec in dataclasses.fields(cls):
            found[cls.__name__, spec.name] = next(
                filter(None, (found.get((base.__name__, spec.name)) for base in cls.__mro__)), "")
    return found


def render_reference() -> str:
    comments = field_comments()
    train = _rows(schema.TrainConfig(), "", comments)
    parts = [HEADER, "## `rlsearch train`\n", *_tables(train)]
    for title, config in (("`rlsearch eval`", schema.EvalConfig()), ("`rlsearch sft`", schema.SFTConfig())):
        shared = {key: default for key, default, *_ in train}
        own = [row for row in _rows(config, "", comments) if shared.get(row[0], _MISSING) != row[1]]
        parts += [f"## {title}\n", "The sections it shares with training take the same keys; these are its own, or "
                  "have another default there.\n", *_tables(own)]
    return "\n".join(parts)


_MISSING = object()


def _rows(config: Any, prefix: str, comments: dict) -> list[tuple[str, str, str, str]]:
    """(dotted key, default, comment, rule) of every leaf field, sections in field order."""
    rows = []
    for spec in dataclasses.fields(config):
        value = getattr(config, spec.name)
        key = f"{prefix}{spec.name}"
        if dataclasses.is_dataclass(value):
            rows += _rows(value, f"{key}.", comments)
        else:
            rows.append((key, _default(value), comments.get((type(config).__name__, spec.name), ""), describe(spec)))
    return rows


def _tables(rows: list[tuple[str, str, str, str]]) -> list[str]:
    """One table per section (the first part of the key)."""
    sections: dict[str, list[tuple[str, str, str, str]]] = {}
    for row in rows:
        sections.setdefault(row[0].split(".")[0] if "." in row[0] else "(top level)", []).append(row)
    tables = []
    for section, members in sections.items():
        lines = [f"### {section}\n", "| key | default | accepts | meaning |", "|---|---|---|---|"]
        lines += [f"| `{key}` | {default} | {accepts} | {comment.replace('|', '&#124;')} |"
                  for key, default, comment, accepts in members]
        tables.append("\n".join(lines) + "\n")
    return tables


def _default(value: Any) -> str:
    if isinstance(value, str):
        return f'`"{value}"`' if value == "" or " " in value else f"`{value}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, dict)) and not value:
        return f"`{value!r}`"
    if isinstance(value, (list, dict)):
        return "`" + repr(value).replace("'", "") + "`"
    return f"`{value}`"


if __name__ == "__main__":
    print(render_reference(), end="")
