"""Run an ASGI app with uvicorn and announce the bound address (the real port matters when port 0 was asked).

Both tool servers (retriever, MCP) run behind ``ServiceGuard``: an optional bearer token taken from an environment
variable, and a bound on request body size.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import socket
import sys

import uvicorn

from ..http import DEFAULT_MAX_BODY_BYTES, read_token

_JSONRPC_UNAUTHORIZED = -32001  # server-defined JSON-RPC error codes lie in -32000..-32099
_JSONRPC_INVALID_REQUEST = -32600


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ServiceGuard:
    """ASGI middleware: with a token, every HTTP request must carry ``Authorization: Bearer <token>`` (else 401);
    request bodies over ``max_body_bytes`` are refused with 413 before the app sees them.

    The body is read here (at most ``max_body_bytes`` of it) and handed to the app in one piece, so a chunked
    upload without Content-Length is bounded too. ``token_env`` only names the variable in the 401 message.
    Refusals are ``{"detail": message}``, or with ``jsonrpc`` a JSON-RPC error (what MCP clients surface).
    """

    def __init__(
        self, app, token: str = "", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, token_env: str = "",
        jsonrpc: bool = False,
    ) -> None:
        self.app = app
        self._token = token.encode()
        self.max_body_bytes = max_body_bytes
        self.token_env = token_env
        self.jsonrpc = jsonrpc

    @property
    def requires_token(self) -> bool:
        return bool(self._token)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # neither server speaks websockets; refuse rather than pass them unguarded
            await send({"type": "websocket.close", "code": 1008})
            return
        if self._token and not self._authorized(scope):
            where = f" (the server reads it from {self.token_env})" if self.token_env else ""
            detail = f"this server requires a bearer token: send 'Authorization: Bearer <token>'{where}"
            await self._refuse(send, 401, detail, [(b"www-authenticate", b"Bearer")])
            return
        declared = _header(scope, b"content-length")
        if declared is not None and not declared.isdigit():
            await self._refuse(send, 400, "invalid Content-Length header")
            return
        if declared is not None and int(declared) > self.max_body_bytes:
            await self._refuse(send, 413, self._too_large(int(declared)))
            return
        body, more_body, disconnect = bytearray(), True, None
        while more_body:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before sending its body
                disconnect = message
                break
            body += message.get("body", b"")
            more_body = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                await self._refuse(send, 413, self._too_large(len(body), at_least=more_body))
                return
        await self.app(scope, _replay(bytes(body), disconnect, receive), send)

    def _authorized(self, scope) -> bool:
        scheme, _, credentials = (_header(scope, b"authorization") or "").partition(" ")
        # the header's bytes as sent (decoded as latin-1 above) against the token's UTF-8 bytes
        return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode("latin-1"), self._token)

    async def _refuse(self, send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        if self.jsonrpc:  # id null: the request was refused before its id was read
            code = _JSONRPC_UNAUTHORIZED if status == 401 else _JSONRPC_INVALID_REQUEST
            body = {"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": detail}}
        else:
            body = {"detail": detail}
        await _send_json(send, status, body, headers)

    def _too_large(self, size: int, at_least: bool = False) -> str:
        more = "more than " if at_least else ""
        return f"request body of {more}{size} bytes is over this server's limit of {self.max_body_bytes} bytes"


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _replay(body: bytes, disconnect: dict | None, receive):
    """A ``receive`` that gives the buffered body first, then whatever the connection sends next (disconnect)."""
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            if disconnect is not None:
                return disconnect
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps(body).encode()
    await send({
        "type": "http.response.start", "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                    *(headers or [])],
    })
    await send({"type": "http.response.body", "body": payload})


def guard(app, token_env: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, jsonrpc: bool = False) -> ServiceGuard:
    """``app`` behind a ServiceGuard whose token is read now from the variable ``token_env`` (none when unset)."""
    return ServiceGuard(app, read_token(token_env), max_body_bytes, token_env, jsonrpc)


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


def exposure_warning(host: str, guarded: ServiceGuard) -> str | None:
    """The warning for serving on ``host`` without a token when other machines may reach it, else None."""
    if is_loopback(host) or guarded.requires_token:
        return None
    variable = guarded.token_env or "a token variable (--token-env)"
    return (
        f"WARNING: listening on {host} without a bearer token: anyone who can reach this host can send requests. "
        f"Set {variable} before starting the server (clients send it from the same variable), or bind 127.0.0.1."
    )


def serve_app(app: ServiceGuard, host: str, port: int, announcement: str) -> None:
    """Serve until interrupted; once listening, print ``announcement`` with ``{url}`` filled in. Warns (stderr) when
    ``host`` may be reachable from other machines and the app takes requests without a token."""
    warning = exposure_warning(host, app)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning")
    _AnnouncingServer(config, announcement).run()
