"""`rlsearch doctor` on this machine: every check named, ready here (exit 0); a dead retriever fails with what to do."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.constants import REPO_ROOT

CHECKS = ("python", "torch", "devices", "vllm", "megatron.core", "mbridge", "transformers", "ray", "mcp",
          "transformer_engine", "process group")


def doctor(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlsearch", "doctor", *arguments], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


def test_doctor_is_ready_here_and_names_its_checks(retriever):
    result = doctor("--retriever-url", retriever.url)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for name in CHECKS:
        assert any(line[6:].startswith(name) for line in lines), name
    assert any(line.startswith("ok    process group        gloo: 2 ranks") for line in lines)
    assert f"ok    retriever            {retriever.url} answers /health" in lines
    assert lines[-1] == f"rlsearch doctor: {len(CHECKS) + 2} checks, ready"


def test_doctor_fails_on_an_unreachable_retriever_and_says_what_to_do():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    result = doctor("--retriever-url", url)
    assert result.returncode == 1
    assert f"FAIL  retriever            {url} unreachable (ConnectError); start it with `rlsearch serve-retriever" \
        in result.stdout
    assert result.stdout.splitlines()[-1] == "rlsearch doctor: 13 checks, 1 failed: retriever"
