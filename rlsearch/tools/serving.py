"""Run an ASGI app with uvicorn and announce the bound address (the real port matters when port 0 was asked)."""

from __future__ import annotations

import socket

import uvicorn


class _AnnouncingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, announcement: str) -> None:
        super().__init__(config)
        self._announcement = announcement

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.should_exit:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        print(self._announcement.format(url=f"http://{host}:{port}"), flush=True)


def serve_app(app, host: str, port: int, announcement: str) -> None:
    """Serve until interrupted; once listening, print ``announcement`` with ``{url}`` filled in."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning")
    _AnnouncingServer(config, announcement).run()
