"""Files that readers never see half-written (written under a staging name, then renamed into place), and a file's
content hash."""

from __future__ import annotations

import hashlib
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


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read a MiB at a time (any size)."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
