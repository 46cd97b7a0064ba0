"""Tool servers (the retriever, the MCP server) as managed subprocesses on 127.0.0.1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

import rlsearch
from rlsearch.lifetime import die_with_parent
from rlsearch.runlog import process_log_dir

from ..http import MCP_TOKEN_ENV, RETRIEVER_TOKEN_ENV, bearer_headers

if TYPE_CHECKING:
    from typing import Self

_LOG_TAIL_CHARS = 4000


class CorpusServerProcess:
    """Starts a server over a corpus (``python -m MODULE --corpus ...``), waits until ``/health`` answers, and
    stops it (also as a context manager).

    With ``port=0`` the server binds a free port itself and announces it in its log, so no other process can
    grab the port between choosing and binding it. After ``stop()``, ``start()`` reuses the same port. The server
    inherits this process's environment: when the variable ``token_env`` holds a token, the server requires it
    (and the health check here sends it).
    """

    kind = "server"  # names the process in messages, in its announcement and in log file names
    module = ""
    url_path = ""  # appended to http://host:port to form ``url``
    default_token_env = ""

    def __init__(
        self,
        corpus: str,
        cache_dir: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        startup_timeout_s: float = 120.0,
        backend: str = "bm25",
        encoder: str = "",
        token_env: str | None = None,
        extra_arguments: Sequence[str] = (),
    ) -> None:
        self.corpus = corpus
        self.extra_arguments = list(extra_arguments)  # more command-line options of the server
        self.cache_dir = cache_dir
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.backend = backend
        self.encoder = encoder
        self.token_env = self.default_token_env if token_env is None else token_env
        self.log_path: Path | None = None
        self._process: subprocess.Popen | None = None
        self._announcement = re.compile(rf"{self.kind} listening on http://\S+:(\d+) ")

    @property
    def url(self) -> str:
        if self._process is None:
            raise RuntimeError(f"the {self.kind} process is not running; call start() first")
        return f"http://{self.host}:{self.port}{self.url_path}"

    def start(self) -> Self:
        if self._process is not None:
            raise RuntimeError(f"the {self.kind} process is already running")
        self.log_path = self._new_log_path()
        command = [sys.executable, "-m", self.module, *self._arguments(), "--host", self.host, "--port", str(self.port)]
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=_child_env(), preexec_fn=die_with_parent
            )
        try:
            self.port = self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    @property
    def pid(self) -> int | None:
        """The server's process id while this object holds it, else None."""
        return None if self._process is None else self._process.pid

    def exit_status(self) -> int | None:
        """The exit status of a server that ended by itself (killed, crashed; negative: the signal), else None."""
        return None if self._process is None else self._process.poll()

    def restart(self) -> Self:
        """Start a server that ended by itself again, on the same port."""
        self._process = None
        return self.start()

    def kill(self) -> None:
        """End the server at once (SIGKILL), as a crash would; ``start()`` brings it back on the same port."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _arguments(self) -> list[str]:
        arguments = ["--corpus", str(self.corpus), "--backend", self.backend, "--token-env", self.token_env]
        if self.encoder:
            arguments += ["--encoder", self.encoder]
        if self.cache_dir is not None:
            arguments += ["--cache-dir", str(self.cache_dir)]
        return arguments + self.extra_arguments

    def _new_log_path(self) -> Path:
        """A new file in the run's logs dir, else in cache_dir (or the temp dir)."""
        directory = process_log_dir() or self.cache_dir
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=f"{self.kind.replace(' ', '-')}-", suffix=".log", dir=directory)
        os.close(fd)
        return Path(path)

    def _wait_until_ready(self) -> int:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            exit_code = self._process.poll()
            if exit_code is not None:
                raise RuntimeError(f"{self.kind} exited with code {exit_code} on startup\n{self._log_tail()}")
            port = self._announced_port()
            if port is not None and _is_healthy(f"http://{self.host}:{port}", bearer_headers(self.token_env)):
                return port
            time.sleep(0.1)
        raise RuntimeError(f"{self.kind} not ready after {self.startup_timeout_s:.0f} s\n{self._log_tail()}")

    def _announced_port(self) -> int | None:
        match = self._announcement.search(self.log_path.read_text(errors="replace"))
        return int(match.group(1)) if match else None

    def _log_tail(self) -> str:
        text = self.log_path.read_text(errors="replace")
        return f"--- last {_LOG_TAIL_CHARS} chars of {self.log_path} ---\n{text[-_LOG_TAIL_CHARS:]}"


class RetrieverProcess(CorpusServerProcess):
    """The retrieval server (``python -m rlsearch.tools.servers.retrieval``); ``url`` is its base URL."""

    kind = "retriever"
    module = "rlsearch.tools.servers.retrieval"
    default_token_env = RETRIEVER_TOKEN_ENV


class MCPServerProcess(CorpusServerProcess):
    """``rlsearch serve-mcp`` (``python -m rlsearch.tools.servers.mcp``); ``url`` is its streamable HTTP endpoint."""

    kind = "mcp server"
    module = "rlsearch.tools.servers.mcp"
    url_path = "/mcp"
    default_token_env = MCP_TOKEN_ENV


def _child_env() -> dict[str, str]:
    # Put this checkout first on the child's path so `-m rlsearch...` resolves here even when rlsearch
    # is not installed and the caller's working directory is elsewhere.
    package_root = str(Path(rlsearch.__file__).resolve().parent.parent)
    inherited = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, inherited]))}


def _is_healthy(url: str, headers: dict[str, str]) -> bool:
    try:
        return httpx.get(f"{url}/health", headers=headers, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
