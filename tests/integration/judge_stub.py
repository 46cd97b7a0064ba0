"""A scripted OpenAI-compatible judge (chat/completions) on 127.0.0.1 that records every request it gets, and one that
never finishes an answer (`trickling_chat_server`)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from rlsearch.data import QAExample
from rlsearch.rollout import Trajectory
from tests.concurrency import InFlight
from tests.integration.threaded_server import serve_in_thread


@dataclass(frozen=True)
class Scripted:
    reply: str = ""
    delay_s: float = 0.0
    status: int = 200


Script = Callable[[str, int], Scripted]
"""(prompt, attempt number of this prompt, from 1) -> what the stub does"""


@dataclass
class StubJudge:
    script: Script
    started: list[float] = field(default_factory=list)  # monotonic time each request arrived
    prompts: list[str] = field(default_factory=list)
    attempts: Counter = field(default_factory=Counter)
    in_flight: InFlight = field(default_factory=InFlight)  # the requests being answered

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def complete(request: Request):
            body = await request.json()
            prompt = body["messages"][-1]["content"]
            self.started.append(time.monotonic())
            self.prompts.append(prompt)
            self.attempts[prompt] += 1
            async with self.in_flight:
                action = self.script(prompt, self.attempts[prompt])
                await asyncio.sleep(action.delay_s)
            if action.status != 200:
                return JSONResponse({"error": {"message": f"scripted {action.status}"}}, status_code=action.status)
            return {
                "id": "stub", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": action.reply}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }

        return app


@contextmanager
def stub_judge(script: Script, meet: int = 0) -> Iterator[tuple[StubJudge, str]]:
    """The stub and its base URL (…/v1); with ``meet=n`` a request is answered only once n are in flight at once
    (`InFlight`)."""
    stub = StubJudge(script, in_flight=InFlight(meet))
    with serve_in_thread(stub.app()) as url:
        yield stub, f"{url}/v1"


def answered(text: str, index: int = 0) -> Trajectory:
    """A finished trajectory whose model text is ``text``."""
    return Trajectory(example_id=f"q{index}", group_id=index, sample_index=0, prompt_ids=[1], assistant_prefix=text)


def row(data_source: str = "judged", golden: tuple[str, ...] = ("Paris",), **fields) -> QAExample:
    return QAExample(id="q", question="What is the capital of France?", golden_answers=golden,
                     data_source=data_source, **fields)


@dataclass
class Trickler:
    """An OpenAI-compatible chat server that never finishes an answer: a 200, then a space every ``every_s``
    seconds for as long as the client reads. ``requests`` counts the requests, ``bytes_sent`` the spaces."""

    every_s: float = 0.2
    requests: int = 0
    bytes_sent: int = 0

    def app(self) -> Starlette:
        async def trickle():
            while True:
                yield b" "
                self.bytes_sent += 1
                await asyncio.sleep(self.every_s)

        async def complete(request: Request) -> StreamingResponse:
            self.requests += 1
            return StreamingResponse(trickle(), media_type="application/json")

        return Starlette(routes=[Route("/{path:path}", complete, methods=["POST"])])


@contextmanager
def trickling_chat_server(every_s: float = 0.2) -> Iterator[tuple[Trickler, str]]:
    """The trickler and its base URL (…/v1)."""
    trickler = Trickler(every_s)
    with serve_in_thread(trickler.app()) as url:
        yield trickler, f"{url}/v1"
