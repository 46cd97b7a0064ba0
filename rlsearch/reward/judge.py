"""An LLM judge behind OpenAI-compatible endpoints tried in order with failover: bounded concurrency, a request-rate
limit, a timeout, retries with exponential backoff on transient errors, and an on-disk cache of replies. Lives on one
event loop."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlsearch.config import ConfigError, EndpointConfig, JudgeConfig, store_dir
from rlsearch.failover import Failover
from rlsearch.files import atomic_path
from rlsearch.reward.verdict import parse_verdict

if TYPE_CHECKING:
    import openai  # imported where a judge is made: 0.55 s of every trainer's start-up, most of which use none

PROMPTS_DIR = Path(__file__).parent / "prompts"
_RETRYABLE_STATUS = frozenset({408, 429})


class JudgeError(Exception):
    """The judge gave no usable verdict (retries exhausted, a refused request, an unparseable reply)."""


class JudgeReplayMissError(RuntimeError):
    """reward.judge.replay: a prompt the recorded replies lack. It stops the run (a JudgeError only fails a
    trajectory)."""


@dataclass
class JudgeCounters:
    requests: int = 0  # HTTP requests sent (each retry is one)
    cache_hits: int = 0


@dataclass(frozen=True, eq=False)
class JudgeEndpoint:
    url: str
    model: str
    client: openai.AsyncOpenAI


# the frozen judge engine's URL before the run has started it (a replay, which sends nothing, never does)
FROZEN_JUDGE_NOT_STARTED = "http://frozen-judge-engine.invalid/v1"


def judge_endpoints(config: JudgeConfig) -> list[EndpointConfig]:
    """reward.judge.endpoints, or the one endpoint of base_url, model and api_key_env; the frozen engine of
    reward.judge.engine first."""
    given = list(config.endpoints) or [EndpointConfig(config.base_url, config.model, config.api_key_env)]
    if not config.engine:
        return given
    frozen = EndpointConfig(config.engine_url or FROZEN_JUDGE_NOT_STARTED, config.engine)
    return [frozen, *(endpoint for endpoint in given if endpoint.url)]


class ReplyCache:
    """Judge replies as files ``<dir>/<key[:2]>/<key>.json``, written atomically (a reader sees whole files only)."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory) if store_dir(directory) else None
        self.write_failed = False

    def get(self, key: str) -> str | None:
        """The reply kept under `key`; None when there is none (absent, damaged, or a recorded failure: asked again
        and rewritten)."""
        return self._field(key, "reply")

    def failure(self, key: str) -> str | None:
        """Why the request under `key` failed when it was last asked and got no reply (what a replay repeats)."""
        return self._field(key, "failed")

    def _field(self, key: str, name: str) -> str | None:
        if self.directory is None:
            return None
        try:
            value = json.loads((self.directory / key[:2] / f"{key}.json").read_text(encoding="utf-8"))[name]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return value if isinstance(value, str) else None

    def put(self, key: str, record: dict) -> None:
        if self.directory is None:
            return
        path = self.directory / key[:2] / f"{key}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as staging:
                staging.write_text(json.dumps(record, ensure_ascii=False), encoding="utf-8")
        except OSError as error:  # a full disk: the verdict stands, it is only not kept
            if not self.write_failed:
                print(f"[rlsearch] the judge cache {self.directory} cannot be written ({error}); replies are not "
                      "kept, so a replay of this run will miss them", file=sys.stderr, flush=True)
            self.write_failed = True


class RateLimiter:
    """Request starts at least 60 / requests_per_minute seconds apart (no bursts); 0 per minute: no limit."""

    def __init__(self, requests_per_minute: float) -> None:
        self.interval = 60.0 / requests_per_minute if requests_per_minute > 0 else 0.0
        self._next_start = 0.0
        self._lock = asyncio.Lock()

    async def wait(self) -> None:
        if not self.interval:
            return
        async with self._lock:
            now = time.monotonic()
            start = max(now, self._next_start)
            self._next_start = start + self.interval
        await asyncio.sleep(start - now)


class Judge:
    """Asks the judge model one prompt at a time (many in flight); every coroutine runs on the loop that made it."""

    def __init__(self, config: JudgeConfig, key: str = "reward.judge") -> None:
        """``key``: the config section whose endpoints ``config`` holds (errors name it); the rubric generator's
        is reward.rubric.evolve."""
        endpoints = judge_endpoints(config)
        if not all(endpoint.url and endpoint.model for endpoint in endpoints):
            raise ConfigError("'reward.judge.base_url' and 'reward.judge.model' are needed by the judge and rubric "
                              "scorers (or a list of judges in 'reward.judge.endpoints')")
        self.config = config
        self.key = key
        self.model = endpoints[0].model  # replies are cached under the first judge's name, whichever answered
        self.endpoints = Failover([self._endpoint(index, endpoint) for index, endpoint in enumerate(endpoints)],
                                  config.cooldown_s)
        self.cache = ReplyCache(config.cache_dir)
        self.limiter = RateLimiter(config.requests_per_minute)
        self.in_flight = asyncio.Semaphore(config.max_concurrency)

    def _endpoint(self, index: int, endpoint: EndpointConfig) -> JudgeEndpoint:
        import openai

        api_key = "EMPTY"  # the client needs one; a local server ignores it
        if endpoint.api_key_env:
            api_key = os.environ.get(endpoint.api_key_env, "")
            if not api_key:
                index -= bool(self.config.engine)  # the frozen engine's comes first, and has no key
                key = f"{self.key}.endpoints[{index}].api_key_env" if self.config.endpoints else \
                    f"{self.key}.api_key_env"
                raise ConfigError(f"'{key}' names {endpoint.api_key_env}, which is not set")
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key=api_key, timeout=self.config.timeout_s,
                                    max_retries=0)
        return JudgeEndpoint(endpoint.url, endpoint.model, client)

    async def close(self) -> None:
        for endpoint in self.endpoints.endpoints:
            await endpoint.client.close()

    async def score(self, prompt: str, counters: JudgeCounters, scale: float | None = None) -> float:
        """The verdict on ``prompt`` as a score in [0, 1] (`parse_verdict`); `JudgeError` when there is none."""
        reply = await self.reply(prompt, counters)
        score = parse_verdict(reply, scale)
        if score is None:
            raise JudgeError(f"no verdict in the reply {reply[:200]!r}")
        return score

    async def reply(self, prompt: str, counters: JudgeCounters) -> str:
        """The judge's reply to ``prompt``, from the cache when it was asked before. A request that fails
        (`JudgeError`: every endpoint and retry) is kept as a failure: asked again by a run, failed again the same
        way by a replay, which so gives the recorded run's rewards even where its judge timed out."""
        key = hashlib.sha256(json.dumps([self.model, self.config.max_tokens, prompt]).encode()).hexdigest()
        cached = self.cache.get(key)
        if cached is not None:
            counters.cache_hits += 1
            return cached
        if self.config.replay:
            if (failure := self.cache.failure(key)) is not None:
                counters.cache_hits += 1
                raise JudgeError(failure)
            raise JudgeReplayMissError(
                f"reward.judge.replay: {self.config.cache_dir} has no reply of {self.model} to the prompt "
                f"{prompt[:300]!r} (key {key}; the recorded run never asked it)")
        try:
            reply, model = await self._ask_with_failover(prompt, counters)
        except JudgeError as error:
            self.cache.put(key, {"model": self.model, "prompt": prompt, "failed": str(error)})
            raise
        self.cache.put(key, {"model": self.model, "answered_by": model, "prompt": prompt, "reply": reply})
        return reply

    async def _ask_with_failover(self, prompt: str, counters: JudgeCounters) -> tuple[str, str]:
        """(the reply, the model that gave it): the endpoints in order (`Failover`), rounds over them with backoff,
        all within reward.judge.deadline_s. A retry's backoff holds no concurrency slot; each attempt picks its
        endpoint once it holds one, so requests queued behind a judge that died meanwhile go straight to the next
        one. A request is given its whole time limit, the reply read in full, not each phase of it."""
        import openai

        config = self.config
        call = self.endpoints.call(config.max_retries, config.backoff_s, config.timeout_s, config.deadline_s)
        last_error = "none was sent: the deadline passed while it waited for a concurrency slot"
        while (wait := call.wait_s()) is not None:
            await asyncio.sleep(wait)
            async with self.in_flight:
                attempt = call.next()
                if attempt is None:  # the round ended while this one waited: the next round, if any
                    continue
                await self.limiter.wait()
                endpoint: JudgeEndpoint = attempt.endpoint
                counters.requests += 1
                limit = call.request_timeout_s()
                try:
                    response = await asyncio.wait_for(endpoint.client.chat.completions.create(
                        model=endpoint.model, messages=[{"role": "user", "content": prompt}],
                        max_tokens=config.max_tokens, temperature=0.0,
                    ), limit)
                    self.endpoints.succeeded(endpoint, attempt.issued_at)
                    return response.choices[0].message.content or "", endpoint.model
                except openai.APIStatusError as error:
                    transient = error.status_code in _RETRYABLE_STATUS or error.status_code >= 500
                    if not transient:
                        raise JudgeError(f"HTTP {error.status_code}: {error.message}") from error
                    last_error = f"HTTP {error.status_code}"
                except (openai.APITimeoutError, TimeoutError):
                    last_error = f"timed out after {limit:.3g} s"
                except openai.APIConnectionError as error:
                    last_error = f"connection error ({error.__cause__ or error})"
            self.endpoints.failed(endpoint)
            if len(self.endpoints.endpoints) > 1:
                last_error = f"{endpoint.url}: {last_error}"
        self.endpoints.give_up()
        deadline = f" within reward.judge.deadline_s ({config.deadline_s:g} s)" if call.out_of_time else ""
        raise JudgeError(f"{call.sent} attempt(s) failed{deadline}, the last: {last_error}")
