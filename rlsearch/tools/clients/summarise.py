"""The browse agent's summariser: a model that reads a fetched page for the policy (AgentRL's Browse Agent, ASearcher's
page summaries). Either OpenAI-compatible chat endpoints tried in order with failover, or a frozen engine of the run
(a Ray actor the run started, found by its name). Both answer greedily; calls and failovers are counted."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import httpx

from ...config import EndpointConfig, SummariserConfig
from ...failover import Failover
from ..base import ToolError, ToolSetupError
from ..http import api_key, send_with_failover

SUMMARY_PROMPT = Path(__file__).resolve().parent / "prompts" / "summarise.txt"


class Summariser(Protocol):
    def summarise(self, prompt: str) -> str: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


class EndpointSummariser:
    """``POST {url}/chat/completions`` of the first endpoint that answers (`Failover`)."""

    def __init__(self, endpoints: Sequence[EndpointConfig], max_tokens: int, timeout_s: float, max_retries: int,
                 backoff_s: float, cooldown_s: float, deadline_s: float = 0.0) -> None:
        keys = [api_key(endpoint.api_key_env, "browse (summariser)") if endpoint.api_key_env else ""
                for endpoint in endpoints]
        self.endpoints = Failover(list(zip(endpoints, keys)), cooldown_s)
        self.max_tokens, self.timeout_s, self.deadline_s = max_tokens, timeout_s, deadline_s
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.calls = 0
        self._lock = threading.Lock()
        self._http = httpx.Client(timeout=timeout_s)

    def summarise(self, prompt: str) -> str:
        with self._lock:
            self.calls += 1

        def request(endpoint: tuple[EndpointConfig, str]) -> httpx.Request:
            config, key = endpoint
            body = {"model": config.model, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": self.max_tokens, "temperature": 0.0}
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return self._http.build_request("POST", f"{config.url.rstrip('/')}/chat/completions", json=body,
                                            headers=headers)

        response = send_with_failover(self._http, request, self.endpoints, "browse summariser", self.max_retries,
                                      self.backoff_s, self.timeout_s, deadline_s=self.deadline_s)
        try:
            return response.json()["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as error:
            raise ToolError(f"browse summariser: an unexpected answer: {response.text[:200]}") from error

    def stats(self) -> dict[str, int]:
        return {"summariser_calls": self.calls, "failovers": self.endpoints.failovers}

    def close(self) -> None:
        self._http.close()


class EngineSummariser:
    """The frozen engine of the run, a Ray actor named ``actor_name`` (`rlsearch.rollout.FrozenEngine`)."""

    def __init__(self, actor_name: str, max_tokens: int, timeout_s: float) -> None:
        import ray

        try:
            self._engine = ray.get_actor(actor_name)
        except ValueError as error:
            raise ToolSetupError(f"the browse summariser's frozen engine {actor_name!r} is not running in this Ray "
                                 "cluster (tools.browse.summariser.engine is started by the run)") from error
        self.max_tokens, self.timeout_s = max_tokens, timeout_s
        self.calls = 0
        self._lock = threading.Lock()

    def summarise(self, prompt: str) -> str:
        import ray

        with self._lock:
            self.calls += 1
        # the engine ends the call itself after timeout_s (its requests aborted); one still queued behind other calls
        # when this gives up is cancelled, so that it never starts
        summary = self._engine.complete.remote([prompt], self.max_tokens, self.timeout_s)
        try:
            return ray.get(summary, timeout=self.timeout_s)[0]
        except TimeoutError as error:  # Ray's GetTimeoutError here, or the engine's own (a RayTaskError of it)
            ray.cancel(summary)
            raise ToolError(f"browse summariser: the frozen engine took longer than {self.timeout_s:g} s") from error
        except ray.exceptions.RayError as error:
            raise ToolError(f"browse summariser: the frozen engine failed: {error}") from error

    def stats(self) -> dict[str, int]:
        return {"summariser_calls": self.calls}

    def close(self) -> None:
        return None


def build_summariser(config: SummariserConfig) -> Summariser | None:
    """The summariser tools.browse.summariser names; None without one (browse then shows the page itself)."""
    if config.endpoints:
        return EndpointSummariser(config.endpoints, config.max_tokens, config.timeout_s, config.max_retries,
                                  config.backoff_s, config.cooldown_s, config.deadline_s)
    if config.engine:
        if not config.engine_actor:
            raise ToolSetupError("tools.browse.summariser.engine is set but its frozen engine was not started: it "
                                 "starts with the run's rollout engines (rlsearch train / eval)")
        return EngineSummariser(config.engine_actor, config.max_tokens, config.timeout_s)
    return None
