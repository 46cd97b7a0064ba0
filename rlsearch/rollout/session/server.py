"""The OpenAI-compatible endpoint of a rollout worker, scoped per trajectory: ``/sessions/{id}/v1``.

Routes: ``POST chat/completions`` (with ``tools``; vLLM's ``continue_final_message``, ``add_generation_prompt`` and
``chat_template_kwargs`` extensions), ``POST completions`` (a text prompt or token ids), ``GET models``. Every call
runs on the worker's engine with the rollout's sampling settings: a per-(example, sample, call) seed, at most
``rollout.max_tokens_per_turn`` tokens and never past the trajectory's ``rollout.max_response_tokens``. The text
returned always includes the stop string that ended it (its tokens were sampled). Responses also carry
``prompt_token_ids`` and ``token_ids``. With ``tools``, ``<tool_call>`` blocks come back as ``tool_calls`` (of the
whole message when it was continued, its ``content`` then being the text before the first call).

Every call samples from the rollout's distribution (``rollout.temperature``, ``top_p``, ``logit_bias``), the one the
actor trains the sampled tokens against: a request that asks for another (a different ``temperature`` or ``top_p``,
its own ``logit_bias``, ``top_k``, ``min_p`` or a penalty) is refused with a 400 naming the fields.

Errors: an unknown session is 404; a first prompt over ``rollout.max_prompt_tokens``, a trajectory whose response
budget is used up, ``n`` > 1, ``stream`` or another sampling distribution are 400 with the reason.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ...config import RolloutConfig
from ...tools.protocols.chat_tools import parse_tool_calls, template_end_of_turn
from ..agent_loop import PromptItem, common_prefix_length, request_seed
from ..engine import chosen_logprobs
from .render import ChatRenderer, RequestError, normalise_message
from .session import AgentSession, ModelCall
from .tokens import PlannedPrompt, SessionTokens

MODEL_NAME = "rlsearch-policy"


class SessionNotFound(LookupError):
    pass


class SessionEndpoint:
    """Owns the sessions and answers their calls with ``engine``; ``app`` is the ASGI app, ``serve`` runs it on
    127.0.0.1 on the current event loop (the engine's)."""

    def __init__(self, engine, tools, config: RolloutConfig, seed: int, logit_bias: dict[int, float] | None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.renderer = ChatRenderer(self.tokenizer)
        self.end_of_turn, _ = template_end_of_turn(self.tokenizer)
        self.tools = tools
        self.config = config
        self.seed = seed
        self.logit_bias = logit_bias or {}
        self.base_url = ""
        self._sessions: dict[str, tuple[AgentSession, PromptItem, int]] = {}
        self._server = None
        self._serving: asyncio.Task | None = None
        self._starting = asyncio.Lock()
        self._response_ids = itertools.count()
        self.app = self._build_app()

    async def serve(self, timeout_s: float = 30.0) -> str:
        """Start serving (once, however many rollouts start at the same time); returns the base URL."""
        async with self._starting:
            if self._serving is None:
                await self._start(timeout_s)
        return self.base_url

    async def _start(self, timeout_s: float) -> None:
        self._server, self._serving, self.base_url = await serve_app(
            self.app, "127.0.0.1", timeout_s, "the agent session endpoint")

    async def stop(self) -> None:
        if self._serving is not None:
            await stop_app(self._server, self._serving)
            self._serving = None

    def open(self, item: PromptItem, step: int) -> AgentSession:
        session_id = uuid.uuid4().hex
        tokens = SessionTokens(self.tokenizer, self.end_of_turn)
        session = AgentSession(
            session_id, f"{self.base_url}/sessions/{session_id}/v1", MODEL_NAME, tokens, self.tools,
            self.config.max_turns, self.config.assistant_prefix, question=item.question,
        )
        self._sessions[session_id] = (session, item, step)
        return session

    def close(self, session: AgentSession) -> None:
        self._sessions.pop(session.id, None)

    def _lookup(self, session_id: str) -> tuple[AgentSession, PromptItem, int]:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise SessionNotFound(f"no agent session {session_id!r} (finished, or never opened)") from None

    async def chat(self, session_id: str, body: dict) -> dict:
        session, item, step = self._lookup(session_id)
        _check_single_choice(body)
        messages = [normalise_message(message) for message in _required(body, "messages", list)]
        tools = body.get("tools") or None
        continue_final = bool(body.get("continue_final_message", False))
        add_generation_prompt = bool(body.get("add_generation_prompt", not continue_final))
        template_kwargs = body.get("chat_template_kwargs") or {}

        def render(conversation: list[dict], generation_prompt: bool) -> str:
            return self.renderer.render(conversation, generation_prompt, tools, template_kwargs=template_kwargs)

        text = self.renderer.render(messages, add_generation_prompt, tools, continue_final, template_kwargs)
        prompt = session.tokens.plan_text(text, None if continue_final else messages, render)
        call, sampled, logprobs = await self._generate(session, item, step, prompt, body)
        # a continued message's text is its earlier content plus what was sampled: it is parsed, and kept, whole
        written = messages[-1]["content"] + call.text if continue_final else call.text
        message: dict[str, Any] = {"role": "assistant", "content": call.text}
        kept = {"role": "assistant", "content": written}
        finish = call.finish_reason
        parsed, error = parse_tool_calls(written) if tools else ([], None)
        if parsed and error is None:
            kept["content"] = message["content"] = written[: written.find("<tool_call>")].strip()
            kept["tool_calls"] = message["tool_calls"] = [
                {"id": f"call_{len(session.calls)}_{index}", "type": "function",
                 "function": {"name": c.name, "arguments": _json(c.arguments or {})}}
                for index, c in enumerate(parsed)
            ]
            call.answered_tool_calls = True
            finish = "tool_calls"
        returned = [*messages[:-1], kept] if continue_final else [*messages, kept]
        session.tokens.record(prompt, text, sampled, logprobs, returned)
        choice = {"index": 0, "message": message, "finish_reason": finish, "token_ids": sampled}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": self._logprob_entries(sampled, logprobs)}
        return self._response("chat.completion", choice, prompt.ids, sampled)

    async def completion(self, session_id: str, body: dict) -> dict:
        session, item, step = self._lookup(session_id)
        _check_single_choice(body)
        given = body.get("prompt")
        if isinstance(given, list) and len(given) == 1 and isinstance(given[0], (str, list)):
            given = given[0]  # the client's batch form with one prompt
        if isinstance(given, str):
            prompt, text = session.tokens.plan_text(given), given
        elif isinstance(given, list) and given and all(isinstance(token, int) for token in given):
            prompt, text = session.tokens.plan_ids(given), self.tokenizer.decode(given, skip_special_tokens=False)
        else:
            raise RequestError("'prompt' must be a string or a list of token ids")
        call, sampled, logprobs = await self._generate(session, item, step, prompt, body)
        session.tokens.record(prompt, text, sampled, logprobs)
        choice = {"index": 0, "text": call.text, "finish_reason": call.finish_reason, "token_ids": sampled}
        if body.get("logprobs") is not None:
            choice["logprobs"] = {
                "tokens": [self.tokenizer.decode([token]) for token in sampled], "token_logprobs": logprobs,
            }
        return self._response("text_completion", choice, prompt.ids, sampled)

    async def _generate(
        self, session: AgentSession, item: PromptItem, step: int, prompt: PlannedPrompt, body: dict
    ) -> tuple[ModelCall, list[int], list[float]]:
        config = self.config
        if not session.tokens.segments and len(prompt.ids) > config.max_prompt_tokens:
            raise RequestError(
                f"the prompt has {len(prompt.ids)} tokens, over the limit of rollout.max_prompt_tokens="
                f"{config.max_prompt_tokens}"
            )
        budget = config.max_response_tokens - session.tokens.tokens_after_first_prompt(prompt)
        if budget <= 0:
            session.refused_for = "response_budget"
            raise RequestError(
                f"the trajectory's token budget is used up: rollout.max_response_tokens={config.max_response_tokens} "
                "tokens after the first prompt (model and tool tokens, also those a rewritten history sends again); "
                "finish the trajectory"
            )
        room = config.window - len(prompt.ids)
        if room <= 0:
            session.refused_for = "context_window"
            raise RequestError(
                f"the prompt has {len(prompt.ids)} tokens and fills the context window (rollout.context_window="
                f"{config.window}); fold or drop history to go on, or finish the trajectory"
            )
        _check_distribution(body, config)
        requested = body.get("max_completion_tokens") or body.get("max_tokens") or config.max_tokens_per_turn
        limits = {"turn_tokens": int(requested), "response_budget": budget, "context_window": room}
        cut_by = min(limits, key=limits.__getitem__)  # what ends the call if it runs out of tokens
        params = self._sampling_params(body, limits[cut_by], request_seed(
            self.seed, step, item.group_id, item.sample_index, len(session.calls)
        ))
        # of this prompt, what the previous call sent or got back (its segment as recorded): what the cache can hold
        ceiling = common_prefix_length(prompt.ids, session.tokens.current.ids) if session.tokens.current else 0
        started, version_before = time.perf_counter(), self.engine.weight_version
        (output,) = await self.engine.generate([prompt.ids], [params])
        session.generate_s += time.perf_counter() - started
        versions = sorted({version_before, self.engine.weight_version})
        session.weight_versions.update(versions)
        completion = output.outputs[0]
        sampled = list(completion.token_ids)
        logprobs = chosen_logprobs(sampled, completion.logprobs)
        shown = sampled[:-1] if sampled and sampled[-1] == session.tokens.end_of_turn_id else sampled
        finish = "length" if completion.finish_reason == "length" else "stop"
        call = ModelCall(
            self.tokenizer.decode(shown, skip_special_tokens=False), len(sampled), finish,
            cut_by=cut_by if finish == "length" else "", weight_versions=versions, context_tokens=len(prompt.ids),
            cached_tokens=output.num_cached_tokens or 0, cache_ceiling=ceiling,
        )
        session.calls.append(call)
        return call, sampled, logprobs

    def _sampling_params(self, body: dict, max_tokens: int, seed: int):
        from vllm import SamplingParams

        config = self.config
        stop = body.get("stop") or []
        return SamplingParams(
            max_tokens=max(1, max_tokens),
            temperature=config.temperature,
            top_p=config.top_p,
            stop=[stop] if isinstance(stop, str) else list(stop),
            include_stop_str_in_output=True,
            logprobs=0,
            seed=seed,
            logit_bias=self.logit_bias or None,
        )

    def _logprob_entries(self, sampled: list[int], logprobs: list[float]) -> list[dict]:
        return [
            {"token": self.tokenizer.decode([token]), "logprob": logprob, "top_logprobs": []}
            for token, logprob in zip(sampled, logprobs)
        ]

    def _response(self, kind: str, choice: dict, prompt_ids: list[int], sampled: list[int]) -> dict:
        return {
            "id": f"rlsearch-{next(self._response_ids)}", "object": kind, "created": int(time.time()),
            "model": MODEL_NAME, "choices": [choice], "prompt_token_ids": prompt_ids,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(sampled),
                      "total_tokens": len(prompt_ids) + len(sampled)},
        }

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="rlsearch agent sessions")

        def error(status: int, message: str, kind: str) -> JSONResponse:
            return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

        async def answer(handler, session_id: str, request: Request) -> JSONResponse:
            try:
                body = await request.json()
                if not isinstance(body, dict):
                    raise RequestError("the request body must be a JSON object")
                return JSONResponse(await handler(session_id, body))
            except SessionNotFound as missing:
                return error(404, str(missing), "not_found_error")
            except RequestError as bad:
                return error(400, str(bad), "invalid_request_error")
            except ValueError as bad:  # a body that is not JSON
                return error(400, f"invalid request: {bad}", "invalid_request_error")

        @app.post("/sessions/{session_id}/v1/chat/completions")
        async def chat(session_id: str, request: Request) -> JSONResponse:
            return await answer(self.chat, session_id, request)

        @app.post("/sessions/{session_id}/v1/completions")
        async def completions(session_id: str, request: Request) -> JSONResponse:
            return await answer(self.completion, session_id, request)

        @app.get("/sessions/{session_id}/v1/models")
        async def models(session_id: str) -> JSONResponse:
            if session_id not in self._sessions:
                return error(404, f"no agent session {session_id!r} (finished, or never opened)", "not_found_error")
            model = {"id": MODEL_NAME, "object": "model", "owned_by": "rlsearch"}
            return JSONResponse({"object": "list", "data": [model]})

        return app


async def serve_app(app, host: str, timeout_s: float, what: str) -> tuple[uvicorn.Server, asyncio.Task, str]:
    """`app` served by uvicorn on `host` (a free port) on the running event loop, once it listens: the server, its
    task and its base URL; RuntimeError naming `what` when it does not start within `timeout_s`."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning", lifespan="off"))
    serving = asyncio.get_running_loop().create_task(server.serve())
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if serving.done() or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start on {host}")
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, serving, f"http://{host}:{port}"


async def stop_app(server: uvicorn.Server, serving: asyncio.Task) -> None:
    server.should_exit = True
    await asyncio.wait_for(serving, timeout=10)


def _check_single_choice(body: dict) -> None:
    if body.get("stream"):
        raise RequestError("streaming is not supported by the rollout endpoint; call without stream")
    if int(body.get("n") or 1) != 1:
        raise RequestError("n must be 1: each sample of a group is its own session")


def _required(body: dict, key: str, kind: type):
    value = body.get(key)
    if not isinstance(value, kind):
        raise RequestError(f"'{key}' is required ({kind.__name__})")
    return value


# request fields that change the sampled distribution, and the values that leave it as it is
_NEUTRAL_SAMPLING = {
    "top_k": (-1, 0), "min_p": (0,), "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
}


def _check_distribution(body: dict, config: RolloutConfig) -> None:
    """Refuse a request that asks for another distribution than the rollout's (the one its tokens are trained on)."""
    refused = [
        f"{key}={body[key]} (rollout.{key} is {getattr(config, key)})"
        for key in ("temperature", "top_p") if body.get(key) is not None and body[key] != getattr(config, key)
    ]
    if body.get("logit_bias"):
        refused.append("logit_bias (rollout.logit_bias sets the run's)")
    refused += [f"{key}={body[key]}" for key, neutral in _NEUTRAL_SAMPLING.items()
                if body.get(key) is not None and body[key] not in neutral]
    if refused:
        raise RequestError(
            f"this endpoint samples from the distribution the run trains on; the request asks for another: "
            f"{', '.join(refused)}. Drop these fields, or set the rollout's temperature/top_p/logit_bias in the config"
        )


def _json(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)
