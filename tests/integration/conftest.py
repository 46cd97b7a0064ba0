"""Fixtures that several integration modules define alike, each module still getting its own (module scope): an MCP
server over the toy corpus, and the two tiny MoE models."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models import MOE_ARCHITECTURES, make_test_model


@pytest.fixture(scope="module")
def mcp_server(toy_data, tmp_path_factory):
    from rlsearch.tools import MCPServerProcess

    with MCPServerProcess(str(toy_data.corpus), cache_dir=str(tmp_path_factory.mktemp("mcp-cache"))) as process:
        yield process


@pytest.fixture(scope="module")
def moe_model_dirs(module_tmp) -> dict[str, Path]:
    """A random-init model dir of each of MOE_ARCHITECTURES, by architecture."""
    root = module_tmp.mktemp("moe-models")
    return {arch: make_test_model(root / arch, architecture=arch) for arch in MOE_ARCHITECTURES}
