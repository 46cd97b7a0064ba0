"""The local tool servers a run starts (the retriever, ``rlsearch serve-mcp``); their URLs go into the config."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from ...config import MCPServerConfig, RetrieverConfig, ToolsConfig
from ..base import ToolError, ToolSetupError
from ..clients import RetrievalClient
from .process import MCPServerProcess, RetrieverProcess

if TYPE_CHECKING:
    from typing import Self


class ToolServers:
    """The local servers a run needs: the retriever (for ``search`` when ``tools.retriever.url`` is empty) and
    ``rlsearch serve-mcp`` (when ``tools.mcp.start_local``); none under ``tools.replay``. ``tools`` is the config
    with their URLs filled in. A retriever the run does not start (``tools.retriever.url``) must answer a search
    first (`check_remote_retriever`).

    Both bind 127.0.0.1 and inherit this process's environment: the retriever requires the token in
    ``tools.retriever.token_env`` when that variable is set, the MCP server the one in RLSEARCH_MCP_TOKEN."""

    def __init__(self, tools: ToolsConfig) -> None:
        self.config = tools
        self.tools = tools
        self.retriever: RetrieverProcess | None = None
        self.mcp: MCPServerProcess | None = None

    @property
    def retriever_url(self) -> str:
        return self.tools.retriever.url

    def start(self) -> Self:
        if self.config.replay:  # every call is answered from the recorded store
            return self
        retriever = self.config.retriever
        if "search" in self.config.enabled and retriever.url:
            check_remote_retriever(retriever)
        needs_retriever = "search" in self.config.enabled and not retriever.url
        if needs_retriever or self.config.mcp.start_local:
            if not Path(retriever.corpus).is_file():
                raise ToolSetupError(f"'tools.retriever.corpus' not found: {retriever.corpus}")
        if needs_retriever and retriever.index and not Path(retriever.index).is_file():
            raise ToolSetupError(f"'tools.retriever.index' not found: {retriever.index}")
        try:
            if needs_retriever:
                self.retriever = RetrieverProcess(
                    retriever.corpus, token_env=retriever.token_env, extra_arguments=_index_arguments(retriever),
                    # a prebuilt index's corpus is scanned for line starts once, and a GPU index is copied over
                    startup_timeout_s=1800.0 if retriever.index else 120.0, **_server_options(retriever),
                ).start()
                retriever = dataclasses.replace(retriever, url=self.retriever.url)
            mcp = self.config.mcp
            if mcp.start_local:
                token_env = MCPServerConfig().token_env  # the local server's entry keeps the default variable
                self.mcp = MCPServerProcess(retriever.corpus, token_env=token_env, **_server_options(retriever)).start()
                mcp = dataclasses.replace(mcp, servers=[*mcp.servers, MCPServerConfig(url=self.mcp.url)])
        except BaseException:
            self.stop()
            raise
        self.tools = dataclasses.replace(self.config, retriever=retriever, mcp=mcp)
        return self

    def revive(self) -> list[str]:
        """Start again, on its port, each server whose process has ended (killed, out of memory): the calls that met
        it dead ended as error observations. Returns a line for each server restarted."""
        revived = []
        for process in (self.retriever, self.mcp):
            status = process.exit_status() if process is not None else None
            if status is not None:
                how = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
                process.restart()
                revived.append(f"the local {process.kind} had ended ({how}); started again on port {process.port}")
        return revived

    def stop(self) -> None:
        for process in (self.mcp, self.retriever):
            if process is not None:
                process.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def check_remote_retriever(retriever: RetrieverConfig) -> None:
    """A search of one query on ``tools.retriever.url``, with the retries every search of the run gets (a server
    just starting): a run against a retriever that is down, refuses the token or answers in another shape stops
    here, before Ray, with what to do. A search rather than ``/health``: Search-R1's own server has no /health."""
    client = RetrievalClient(retriever.url, topk=1, timeout_s=retriever.timeout_s, max_retries=retriever.max_retries,
                             backoff_s=retriever.backoff_s, token_env=retriever.token_env)
    try:
        client.search(["health check"])
    except ToolError as error:
        raise ToolSetupError(
            f"'tools.retriever.url' is {retriever.url}, but a test search there failed: {error}. Start the retriever "
            "(rlsearch serve-retriever --corpus CORPUS --port PORT), fix tools.retriever.url, or leave it empty for "
            "the run to start one over tools.retriever.corpus"
        ) from error
    finally:
        client.close()


def _server_options(retriever: RetrieverConfig) -> dict:
    return {"cache_dir": retriever.index_cache_dir, "backend": retriever.backend, "encoder": retriever.encoder}


def _index_arguments(retriever: RetrieverConfig) -> list[str]:
    """``serve-retriever``'s options for tools.retriever.index (none without one)."""
    if not retriever.index:
        return []
    arguments = ["--index", retriever.index]
    if retriever.encoder_family:
        arguments.append(f"--encoder-family={retriever.encoder_family}")
    if retriever.pooling != "auto":
        arguments.append(f"--pooling={retriever.pooling}")
    if retriever.query_prefix is not None:
        arguments.append(f"--query-prefix={retriever.query_prefix}")  # one token: the prefix may start with "-"
    if retriever.faiss_gpu:
        arguments.append("--faiss-gpu")
    arguments += [f"--{option}={getattr(retriever, option)}" for option in ("nprobe", "efSearch")
                  if getattr(retriever, option)]
    return [*arguments, f"--encoder-device={retriever.encoder_device}"]
