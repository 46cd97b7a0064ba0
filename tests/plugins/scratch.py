"""Each module's scratch directories, removed after its last test unless one failed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


class ModuleScratch:
    """`tmp_path_factory` for a module's fixtures (models, checkpoints, runs), whose directories go after the module's
    last test unless one of its tests failed, instead of staying to the end of the run: with them kept, a run's
    scratch peaked at 19 GB (a tiny model's checkpoint with Adam's state is 0.44 GB)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._made: list[Path] = []

    def mktemp(self, name: str) -> Path:
        path = self._factory.mktemp(name)
        self._made.append(path)
        return path

    def remove(self) -> None:
        for path in self._made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def module_tmp(request, tmp_path_factory) -> ModuleScratch:
    scratch = ModuleScratch(tmp_path_factory)
    failed = request.session.testsfailed
    yield scratch
    if request.session.testsfailed == failed:
        scratch.remove()

