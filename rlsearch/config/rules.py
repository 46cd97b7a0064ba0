"""The rules of single keys, declared once on the schema's fields (`rule`): the allowed values, the bounds, the shape
of a string and which sibling key a key needs. `check_fields` enforces them on a whole config (each error names the
dotted key), `describe` renders them for the configuration reference. Rules between sections live in validate.py."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

_KEY = "rlsearch.rule"  # the dataclasses.field metadata key the rule is stored under
_URL = r"https?://.*"
ENV_NAME = r"[A-Za-z_][A-Za-z0-9_]*"


@dataclass(frozen=True)
class Needs:
    """When the key is set (truthy; or equal to `when`), its sibling `other` must be set (or be one of `wanted`).
    `message` is formatted with key, value, other and other_value."""

    other: str
    message: str
    wanted: tuple = ()
    when: Any = None

    def applies(self, value: Any) -> bool:
        return bool(value) if self.when is None else value == self.when

    def holds(self, other_value: Any) -> bool:
        return other_value in self.wanted if self.wanted else bool(other_value)


@dataclass(frozen=True)
class Rule:
    """What one key accepts. Bounds (ge, gt, le, within) apply to numbers and to each value of a mapping; choices and
    pattern to strings (and bools); items, includes and nonempty to lists. Errors say it as "'KEY' must be ...; got
    VALUE", a list's as "'KEY[i]' is VALUE; ITEMS_ARE are ..."."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    within: str = ""  # an interval, "[0, 1]" or "(0, 1]"
    off: str = ""  # 0 is also allowed and means this (with ge: "0 (off) or >= 2")
    choices: tuple = ()
    either: bool = False  # say the choices as "a, b or c" (else "one of a, b, c")
    items: tuple = ()  # what each item of a list may be
    items_are: str = ""  # how the error calls them: "the reasons"
    includes: str = ""  # an item the list must hold
    pattern: str = ""  # what a string must (full)match
    shape: str = ""  # the pattern in words: "be an http(s) URL"
    nonempty: str = ""  # the list must not be empty; what to do instead
    needs: tuple[Needs, ...] = ()
    note: str = ""  # said in parentheses after the rule (a list's: after `includes` when it has one)
    says: str = ""  # the bound in words, instead of the generated ">= 0"


def rule(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, **rules: Any) -> Any:
    """A dataclass field with `default` (or `factory`) and the `Rule` of its key."""
    needs = rules.pop("needs", ())
    declared = Rule(needs=(needs,) if isinstance(needs, Needs) else tuple(needs), **rules)
    return dataclasses.field(default=default, default_factory=factory, metadata={_KEY: declared})


def url(default: str = "", *, required: bool = False) -> Any:
    """An http(s) URL; empty (none) unless `required`."""
    return rule(default, pattern=_URL if required else f"(?:{_URL})?", shape="be an http(s) URL")


def env_name(default: str = "") -> Any:
    """The name of an environment variable, or empty (none)."""
    return rule(default, pattern=f"(?:{ENV_NAME})?",
                shape="name an environment variable (letters, digits, _) or be empty")


def directory(default: str) -> Any:
    """A directory the command writes into: not empty, which would write into the current directory."""
    return rule(default, pattern=r".*\S.*", shape="name a directory (empty would write into the current directory)")


def rule_of(spec: dataclasses.Field) -> Rule | None:
    return spec.metadata.get(_KEY)


def check_fields(config: Any, prefix: str = "") -> None:
    """ConfigError naming the first key of `config` (a config dataclass, sections and list items included) that
    breaks its field's rule."""
    from .loader import ConfigError

    for spec in dataclasses.fields(config):
        value, key = getattr(config, spec.name), f"{prefix}{spec.name}"
        declared = rule_of(spec)
        problem = declared and _problem(declared, key, value, config)
        if problem:
            raise ConfigError(problem)
        if dataclasses.is_dataclass(value):
            check_fields(value, f"{key}.")
        for index, item in enumerate(value if isinstance(value, list) else ()):
            if dataclasses.is_dataclass(item):
                check_fields(item, f"{key}[{index}].")


def _problem(declared: Rule, key: str, value: Any, section: Any) -> str | None:
    if isinstance(value, dict):  # a mapping's values are bounded one by one
        return next(filter(None, (_scalar(declared, f"{key}.{name}", item) for name, item in value.items())), None)
    if isinstance(value, list):
        return _list(declared, key, value)
    problem = _scalar(declared, key, value)
    if problem:
        return problem
    for need in declared.needs:
        other = getattr(section, need.other)
        if need.applies(value) and not need.holds(other):
            other_key = f"{key.rpartition('.')[0]}.{need.other}".lstrip(".")
            return need.message.format(key=key, value=_show(value), other=other_key, other_value=_show(other))
    return None


def _list(declared: Rule, key: str, value: list) -> str | None:
    if declared.nonempty and not value:
        return f"'{key}' is empty: {declared.nonempty}"
    for index, item in enumerate(value):
        if declared.items and item not in declared.items:
            return (f"'{key}[{index}]' is {item!r}; {declared.items_are} are {', '.join(declared.items)}"
                    f"{'' if declared.includes else _note(declared)}")
    if declared.includes and declared.includes not in value:
        return f"'{key}' must include {declared.includes}{_note(declared)}"
    return None


def _scalar(declared: Rule, key: str, value: Any) -> str | None:
    if value is None:
        return None
    if declared.choices and value not in declared.choices:
        return f"'{key}' must be {_alternatives(declared)}; got {value!r}"
    if declared.pattern and not re.fullmatch(declared.pattern, value, re.DOTALL):
        return f"'{key}' must {declared.shape}; got {value!r}"
    broken = _broken_bound(declared, value) if isinstance(value, (int, float)) else None
    if broken:
        return f"'{key}' must be {broken}{_note(declared)}; got {value!r}"
    return None


_SIDES = ((">=", "ge", float.__ge__), (">", "gt", float.__gt__), ("<=", "le", float.__le__))


def _broken_bound(declared: Rule, value: float) -> str | None:
    """The bound `value` breaks, in words ("> 0", "in (0, 1]", "0 (off) or >= 2"); None when it keeps them all. NaN
    and infinities break every bound: NaN compares false with all of them, and no bounded key means anything by inf."""
    if bounded(declared) and not math.isfinite(value):
        return f"{_bounds(declared)} and finite"
    if declared.off and value == 0:
        return None
    if declared.within:
        low, high = (float(end) for end in declared.within[1:-1].split(","))
        above = low <= value if declared.within[0] == "[" else low < value
        below = value <= high if declared.within[-1] == "]" else value < high
        return None if above and below else declared.says or f"in {declared.within}"
    for sign, name, holds in _SIDES:
        bound = getattr(declared, name)
        if bound is not None and not holds(float(value), float(bound)):
            return declared.says or (f"0 ({declared.off}) or {sign} {bound}" if declared.off else f"{sign} {bound}")
    return None


def bounded(declared: Rule) -> bool:
    """Whether the rule declares a range (ge, gt, le or within)."""
    return bool(declared.within) or any(getattr(declared, name) is not None for _, name, _ in _SIDES)


def _bounds(declared: Rule) -> str:
    """All the bounds in words, for the reference."""
    if declared.within:
        return declared.says or f"in {declared.within}"
    sides = " and ".join(f"{sign} {getattr(declared, name)}" for sign, name, _ in _SIDES
                         if getattr(declared, name) is not None)
    return f"0 ({declared.off}) or {sides}" if declared.off else sides


def _alternatives(declared: Rule) -> str:
    names = [_show(choice) for choice in declared.choices]
    return f"{', '.join(names[:-1])} or {names[-1]}" if declared.either else f"one of {', '.join(names)}"


def _note(declared: Rule) -> str:
    return f" ({declared.note})" if declared.note else ""


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "empty" if value == "" else str(value)


def choices_by_key(config: Any, prefix: str = "") -> dict[str, tuple]:
    """Dotted key -> its allowed values, for every key of `config` (sections included) that declares them."""
    found: dict[str, tuple] = {}
    for spec in dataclasses.fields(config):
        value, declared = getattr(config, spec.name), rule_of(spec)
        if dataclasses.is_dataclass(value):
            found.update(choices_by_key(value, f"{prefix}{spec.name}."))
        elif declared and (declared.choices or declared.items):
            found[f"{prefix}{spec.name}"] = declared.choices or declared.items
    return found


def describe(spec: dataclasses.Field) -> str:
    """The field's rule for the configuration reference ("" when it has none)."""
    declared = rule_of(spec)
    if declared is None:
        return ""
    parts = []
    if declared.choices:
        parts.append(" \\| ".join(f"`{_show(choice)}`" for choice in declared.choices))
    if declared.items:
        parts.append("each of " + " \\| ".join(f"`{item}`" for item in declared.items))
    if declared.includes:
        parts.append(f"must include `{declared.includes}`")
    if declared.nonempty:
        parts.append("not empty")
    if declared.pattern:
        parts.append(f"must {declared.shape}")
    if bounded(declared):
        parts.append(_bounds(declared))
    parts += [f"needs `{need.other}`" + (f" {' or '.join(map(str, need.wanted))}" if need.wanted else "")
              + (f" when {_show(need.when)}" if need.when is not None else "") for need in declared.needs]
    return "; ".join(parts)
