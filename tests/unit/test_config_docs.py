"""docs/configuration.md is generated from the config schema: it must be what the schema renders to now."""

from __future__ import annotations

import dataclasses

from rlsearch.config import TrainConfig
from rlsearch.config.reference import field_comments, render_reference
from tests.constants import REPO_ROOT


def test_config_docs_equal_the_schema():
    written = (REPO_ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert written == render_reference(), (
        "docs/configuration.md is stale: run `python -m rlsearch.config.reference > docs/configuration.md`"
    )


def test_every_training_key_is_documented():
    comments = field_comments()
    undocumented = []

    def walk(config, prefix: str) -> None:
        for spec in dataclasses.fields(config):
            value = getattr(config, spec.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{spec.name}.")
            elif not comments.get((type(config).__name__, spec.name)):
                undocumented.append(f"{prefix}{spec.name}")

    walk(TrainConfig(), "")
    assert undocumented == [], f"keys without a field comment in rlsearch/config/schema.py: {undocumented}"
    assert "| `rollout.agent` | `builtin` |" in render_reference()
