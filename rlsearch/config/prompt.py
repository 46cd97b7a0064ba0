"""A prompt file named by a config key, whose ``{name}`` placeholders are filled in (the judge's, the browse
summariser's): checked at start-up for the placeholders it needs, naming the key."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .loader import ConfigError

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class PromptFile:
    """The text of a prompt file; other braces (JSON examples) stay as written when it is rendered."""

    path: Path
    text: str

    @classmethod
    def load(cls, path: str, default: Path, required: tuple[str, ...], key: str) -> PromptFile:
        """``path``, or ``default`` when it is empty; ConfigError naming ``key`` when it is missing or lacks one of
        the ``required`` placeholders."""
        resolved = Path(path) if path else default
        if not resolved.is_file():
            raise ConfigError(f"'{key}' not found: {resolved}")
        text = resolved.read_text(encoding="utf-8")
        missing = [name for name in required if f"{{{name}}}" not in text]
        if missing:
            raise ConfigError(f"'{key}' ({resolved}) lacks the placeholder {{{missing[0]}}}; it needs "
                              + ", ".join(f"{{{name}}}" for name in required))
        return cls(resolved, text)

    def render(self, **values: str) -> str:
        return _PLACEHOLDER.sub(lambda match: values.get(match[1], match[0]), self.text)
