"""HTTP requests with retries: transport errors, timeouts, 429 and 5xx are retried with exponential backoff."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from .base import ToolError, ToolTimeout


def send_with_retries(
    send: Callable[[], httpx.Response],
    what: str,
    max_retries: int,
    backoff_s: float,
    timeout_s: float,
    on_retry: Callable[[], None] | None = None,
) -> httpx.Response:
    """The first response that is neither retried nor a 4xx rejection.

    Raises ToolError naming ``what`` for a rejection (4xx other than 429, not retried) or when the attempts run
    out; ToolTimeout instead when the last attempt timed out.
    """
    last_error, timed_out = "", False
    for attempt in range(max_retries + 1):
        if attempt > 0:
            if on_retry is not None:
                on_retry()
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            response = send()
        except httpx.TimeoutException as error:
            last_error, timed_out = f"timed out after {timeout_s:g} s ({type(error).__name__})", True
            continue
        except httpx.TransportError as error:
            last_error, timed_out = f"{type(error).__name__}: {error}", False
            continue
        if response.status_code >= 500 or response.status_code == 429:
            last_error, timed_out = f"HTTP {response.status_code}: {response.text[:200]}", False
            continue
        if response.status_code >= 400:
            raise ToolError(f"{what} rejected: HTTP {response.status_code} {response.text[:500]}")
        return response
    error_type = ToolTimeout if timed_out else ToolError
    raise error_type(f"{what} failed after {max_retries + 1} attempts; last error: {last_error}")
