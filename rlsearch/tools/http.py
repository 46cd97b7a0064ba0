"""HTTP requests with retries and failover over endpoints (transport errors, timeouts, 429 and 5xx, with exponential
backoff); bearer tokens from environment variables."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import httpx

from ..failover import Failover
from .base import ToolError, ToolSetupError, ToolTimeout

E = TypeVar("E")

RETRIEVER_TOKEN_ENV = "RLSEARCH_RETRIEVER_TOKEN"  # default variable holding the retrieval server's bearer token
MCP_TOKEN_ENV = "RLSEARCH_MCP_TOKEN"  # default variable holding the MCP server's bearer token
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: the tool servers answer larger request bodies with 413


def read_token(token_env: str) -> str:
    """The token in the environment variable ``token_env`` ("" when the name is empty or the variable unset)."""
    return os.environ.get(token_env, "").strip() if token_env else ""


def api_key(variable: str, tool: str) -> str:
    key = os.environ.get(variable, "").strip()
    if not key:
        raise ToolSetupError(
            f"tool '{tool}' needs an API key in the environment variable {variable}, which is not set; "
            f"export {variable}=... or remove '{tool}' from tools.enabled"
        )
    return key


def bearer_headers(token_env: str) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}`` when the variable ``token_env`` holds a token, else no headers."""
    token = read_token(token_env)
    return {"Authorization": f"Bearer {token}"} if token else {}


def auth_hint(token_env: str, sent_token: bool, config_key: str) -> str:
    """What to do about a 401/403 answer, for a client that takes its token from the variable ``token_env``."""
    if not token_env:
        return f"the server requires a bearer token; set {config_key} to the variable that holds it"
    if sent_token:
        return f"the server refused the bearer token in {token_env}; set {token_env} to the server's token"
    return f"the server requires a bearer token: set {token_env} to it ({config_key} names the variable)"


def send_with_failover(
    client: httpx.Client,
    request: Callable[[E], httpx.Request],
    endpoints: Failover[E],
    what: str,
    max_retries: int,
    backoff_s: float,
    timeout_s: float,
    on_retry: Callable[[], None] | None = None,
    auth_hint: str = "",
    deadline_s: float = 0.0,
) -> httpx.Response:
    """The first response that is neither retried nor a 4xx rejection; ``request(endpoint)`` is the request to one
    endpoint, sent by ``client`` and read whole within ``timeout_s`` (`send_within`), all attempts within
    ``deadline_s`` (0: none).

    Transport errors, timeouts, 429 and 5xx put the endpoint in cool-down and the next attempt goes to the next
    endpoint (`Failover`), with exponential backoff between rounds. Raises ToolError naming ``what`` for a rejection
    (4xx other than 429, not retried; a 401/403 message ends with ``auth_hint``, e.g. which variable holds the token)
    or when the attempts run out; ToolTimeout instead when the last attempt timed out or the deadline passed. Both
    are ``unavailable`` (the service's failure, not the request's) but for a rejection other than 401/403.
    ``on_retry`` is called before every attempt after the first.
    """
    last_error, timed_out = "", False
    call = endpoints.call(max_retries, backoff_s, timeout_s, deadline_s)
    while (wait := call.wait_s()) is not None:
        time.sleep(wait)
        attempt = call.next()
        if attempt is None:  # the round ended while this one waited: the next round, if any
            continue
        if call.sent > 1 and on_retry is not None:
            on_retry()
        limit = call.request_timeout_s()
        try:
            response = send_within(client, request(attempt.endpoint), limit)
        except httpx.TimeoutException as error:
            last_error, timed_out = f"timed out after {limit:.3g} s ({type(error).__name__})", True
            endpoints.failed(attempt.endpoint)
            continue
        except httpx.TransportError as error:
            last_error, timed_out = f"{type(error).__name__}: {error}", False
            endpoints.failed(attempt.endpoint)
            continue
        if response.status_code >= 500 or response.status_code == 429:
            last_error, timed_out = f"HTTP {response.status_code}: {response.text[:200]}", False
            endpoints.failed(attempt.endpoint)
            continue
        endpoints.succeeded(attempt.endpoint, attempt.issued_at)
        if response.status_code in (401, 403) and auth_hint:
            raise ToolError(f"{what} rejected: HTTP {response.status_code}: {auth_hint}", unavailable=True)
        if response.status_code >= 400:
            raise ToolError(f"{what} rejected: HTTP {response.status_code} {response.text[:500]}")
        return response
    endpoints.give_up()
    error_type = ToolTimeout if timed_out or call.out_of_time else ToolError
    where = f" over {len(endpoints.endpoints)} endpoints" if len(endpoints.endpoints) > 1 else ""
    deadline = f" and its deadline of {deadline_s:g} s passed" if call.out_of_time else ""
    raise error_type(f"{what} failed after {call.sent} attempts{where}{deadline}; last error: {last_error}",
                     unavailable=True)


def send_within(client: httpx.Client, request: httpx.Request, timeout_s: float) -> httpx.Response:
    """The response to ``request``, read whole within ``timeout_s`` (else httpx.ReadTimeout). httpx's own timeouts
    bound each phase and each read in it, so a server that trickles a byte a second would never trip them: the body
    is read chunk by chunk against the clock (a read itself waits at most ``timeout_s``)."""
    request.extensions["timeout"] = httpx.Timeout(timeout_s).as_dict()
    response = client.send(request, stream=True)
    response.stream = _ReadBefore(response.stream, time.monotonic() + timeout_s, timeout_s, request)
    try:
        response.read()
    finally:
        response.close()
    return response


class _ReadBefore(httpx.SyncByteStream):
    """A response body whose chunks must all arrive before ``deadline``."""

    def __init__(self, stream, deadline: float, timeout_s: float, request: httpx.Request) -> None:
        self._stream, self._deadline, self._timeout_s, self._request = stream, deadline, timeout_s, request

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._stream:
            if time.monotonic() > self._deadline:
                raise httpx.ReadTimeout(f"the response was not read whole within {self._timeout_s:.3g} s",
                                        request=self._request)
            yield chunk

    def close(self) -> None:
        self._stream.close()
