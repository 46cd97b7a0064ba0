"""Run the retrieval server (``python -m rlsearch.tools.retrieval``) as a managed subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

import rlsearch

if TYPE_CHECKING:
    from typing import Self

_ANNOUNCEMENT = re.compile(r"retriever listening on http://\S+:(\d+) ")
_LOG_TAIL_CHARS = 4000


class RetrieverProcess:
    """Starts the server, waits until ``/health`` answers, and stops it (also as a context manager).

    With ``port=0`` the server binds a free port itself and announces it in its log, so no other process
    can grab the port between choosing and binding it.
    """

    def __init__(
        self,
        corpus: str,
        cache_dir: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        startup_timeout_s: float = 120.0,
    ) -> None:
        self.corpus = corpus
        self.cache_dir = cache_dir
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.log_path: Path | None = None
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self._process is None:
            raise RuntimeError("the retriever process is not running; call start() first")
        return f"http://{self.host}:{self.port}"

    def start(self) -> Self:
        if self._process is not None:
            raise RuntimeError("the retriever process is already running")
        self.log_path = self._new_log_path()
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                self._command(), stdout=log, stderr=subprocess.STDOUT, env=_child_env()
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

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _command(self) -> list[str]:
        command = [sys.executable, "-m", "rlsearch.tools.retrieval", "--corpus", str(self.corpus)]
        command += ["--host", self.host, "--port", str(self.port)]
        if self.cache_dir is not None:
            command += ["--cache-dir", str(self.cache_dir)]
        return command

    def _new_log_path(self) -> Path:
        if self.cache_dir is not None:
            Path(self.cache_dir).mkdir(parents=True, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="retriever-", suffix=".log", dir=self.cache_dir)
        os.close(fd)
        return Path(path)

    def _wait_until_ready(self) -> int:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            exit_code = self._process.poll()
            if exit_code is not None:
                raise RuntimeError(f"retriever exited with code {exit_code} on startup\n{self._log_tail()}")
            port = self._announced_port()
            if port is not None and _is_healthy(f"http://{self.host}:{port}"):
                return port
            time.sleep(0.1)
        raise RuntimeError(f"retriever not ready after {self.startup_timeout_s:.0f} s\n{self._log_tail()}")

    def _announced_port(self) -> int | None:
        match = _ANNOUNCEMENT.search(self.log_path.read_text(errors="replace"))
        return int(match.group(1)) if match else None

    def _log_tail(self) -> str:
        text = self.log_path.read_text(errors="replace")
        return f"--- last {_LOG_TAIL_CHARS} chars of {self.log_path} ---\n{text[-_LOG_TAIL_CHARS:]}"


def _child_env() -> dict[str, str]:
    # Put this checkout first on the child's path so `-m rlsearch...` resolves here even when rlsearch
    # is not installed and the caller's working directory is elsewhere.
    package_root = str(Path(rlsearch.__file__).resolve().parent.parent)
    inherited = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, inherited]))}


def _is_healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
