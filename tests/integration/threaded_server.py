"""A real HTTP server on 127.0.0.1 (uvicorn in a thread) for tests that need one speaking a given API, a log of the
responses an app sent (`ResponseLog`), and a retriever answering what a test scripts (`scripted_retriever`)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


class ResponseLog:
    """An ASGI app in front of ``app``: ``responses`` holds (request method, response status) of every HTTP response
    it sent, in order (how a test counts the requests a server got, retries included)."""

    def __init__(self, app) -> None:
        self.app = app
        self.responses: list[tuple[str, int]] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan: the app's own start-up and shutdown
            await self.app(scope, receive, send)
            return

        async def logged(message) -> None:
            if message["type"] == "http.response.start":
                self.responses.append((scope["method"], message["status"]))
            await send(message)

        await self.app(scope, receive, logged)


@contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """Serve the ASGI ``app`` on a free loopback port; yields its base URL and stops it afterwards."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test HTTP server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def closed_port() -> int:
    """A loopback port nothing listens on (a dead server's)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def scripted_retriever(replies: list[tuple[int, object]]) -> Iterator[str]:
    """A server answering the n-th ``POST /retrieve`` with the n-th (status, JSON body) of ``replies`` (the last one
    from then on); no /health, as Search-R1's own retrieval_server.py. Yields its base URL."""
    import fastapi

    app = fastapi.FastAPI()
    answered = []

    @app.post("/retrieve")
    def retrieve() -> fastapi.responses.JSONResponse:
        status, body = replies[min(len(answered), len(replies) - 1)]
        answered.append(status)
        return fastapi.responses.JSONResponse(body, status_code=status)

    with serve_in_thread(app) as url:
        yield url
