"""Files that readers never see half-written: written under a staging name, then renamed into place."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A staging path beside `path` to write to; on a clean exit it replaces `path` in one rename, on an error it is
    removed. The staging name is this process's and thread's, so concurrent writers of one path never share it."""
    staging = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        yield staging
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
