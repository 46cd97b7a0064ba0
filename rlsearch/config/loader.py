"""YAML + dotted command-line overrides -> validated config dataclasses. Errors name the dotted key."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

# sections renamed since a release: the old name is refused with the new one, not silently dropped
RENAMED_SECTIONS = {"bridge": "weights"}
# keys removed since a release, with what to write instead: refused with that, not guessed at
REMOVED_KEYS = {
    "algo.icepop_beta": "IcePop's band is now [algo.icepop_low, algo.icepop_high] (the paper's 0.5 and 5), inside "
                        "which algo.rollout_correction=icepop weights each token by r; the old band [1/beta, beta] "
                        "with weight 1 is algo.rollout_correction=token_rs algo.mis_low=1/beta algo.mis_high=beta",
}


class ConfigError(ValueError):
    """A config problem; the message names the offending key and says what is accepted."""


def load_config(schema: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build `schema` from a YAML file (optional) with `key.sub=value` overrides applied on top."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    for override in overrides or []:
        _apply_override(raw, override)
    return from_dict(schema, raw)


def from_dict(schema: type[T], raw: dict[str, Any], prefix: str = "") -> T:
    if not isinstance(raw, dict):
        raise ConfigError(f"'{prefix.rstrip('.') or 'config'}' must be a mapping of keys (a section), got {raw!r}")
    hints = typing.get_type_hints(schema)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        key = unknown[0]
        if not prefix and RENAMED_SECTIONS.get(key) in fields:
            new = RENAMED_SECTIONS[key]
            first = next(iter(raw[key]), None) if isinstance(raw[key], dict) else None
            example = f": write '{new}.{first}' for '{key}.{first}'" if first else ""
            raise ConfigError(f"the config section '{key}' is now '{new}'{example}")
        dotted = f"{prefix}{key}"
        if dotted in REMOVED_KEYS:
            raise ConfigError(f"the config key '{dotted}' was removed: {REMOVED_KEYS[dotted]}")
        close = difflib.get_close_matches(str(key), fields, n=1)
        hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known keys: {', '.join(fields)}"
        raise ConfigError(f"unknown config key '{dotted}'{hint}")
    values = {name: _coerce(hints[name], raw[name], f"{prefix}{name}") for name in fields if name in raw}
    return schema(**values)


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from err
    if data is None:  # the same as no file, so more likely the wrong file than a wish for the defaults
        raise ConfigError(f"{path}: the config file is empty: every key would take its default; give the keys to "
                          "set, or leave the file out to run on the defaults")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"bad override '{override}': expected section.key=value, e.g. trainer.total_steps=3")
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{override}': '{part}' is not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(text) if text.strip() else ""


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value if value is not None else {}, prefix=f"{key}.")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if origin is list:
        (item_hint,) = typing.get_args(hint)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"'{key}' must be a list, got {value!r}")
        return [_coerce(item_hint, item, f"{key}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"'{key}' must be a mapping, got {value!r}")
        _, value_hint = typing.get_args(hint)
        return {name: _coerce(value_hint, item, f"{key}.{name}") for name, item in value.items()}
    return _coerce_scalar(hint, value, key)


def _coerce_scalar(hint: Any, value: Any, key: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"'{key}' must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"'{key}' must be an integer, got {value!r}")
    if hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads exponents without a dot (2e-4) as strings
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None or math.isnan(number):  # NaN is false in every comparison: a check "< 0" lets it through
            raise ConfigError(f"'{key}' must be a number, got {value!r}")
        return number
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"'{key}' must be a string, got {value!r}")
    return value
