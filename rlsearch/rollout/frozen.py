"""Frozen engines of the run: second models in the run's Ray cluster, never trained and never synced. The browse
agent's summariser is one (its tools call ``complete`` through Ray); the reward judge is another (reward.judge.engine:
its OpenAI-compatible ``/v1/chat/completions`` on the actor's node is the judge's and the rubric generator's first
endpoint). One vLLM engine (`VLLMEngine`) on its own event loop, as a rollout worker holds it."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..config import JudgeConfig, ToolsConfig
from ..loop_thread import LoopThread
from ..runlog import redirect_worker_output
from .engine import EngineSpec, VLLMEngine
from .session.server import serve_app, stop_app

FROZEN_ENGINE_NAME_PREFIX = "rlsearch-frozen-"
START_TIMEOUT_S = 900.0


class FrozenEngine:
    """Chat completions of one model, greedy unless a request asks for a temperature; thread-safe (a threaded Ray
    actor serves the rollout workers at once). `limit_key` is the config key of its context length (errors name
    it)."""

    def __init__(self, spec: EngineSpec, limit_key: str) -> None:
        redirect_worker_output("frozen-engine")
        self._events = LoopThread("frozen-engine")

        async def start() -> VLLMEngine:  # AsyncLLM binds to the loop it is first used on
            return VLLMEngine(spec)

        self.engine = self._events.run(start())
        self.model_name = spec.model_path
        self.max_model_len = spec.max_model_len
        self.limit_key = limit_key
        self.calls = 0  # prompts answered
        self._lock = threading.Lock()
        self._server = self._serving = None

    def _prompt_ids(self, messages: list[dict], max_tokens: int) -> list[int]:
        tokenizer = self.engine.tokenizer
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"a prompt of {len(ids)} tokens and {max_tokens} to write do not fit the frozen engine's "
                             f"{self.max_model_len} ({self.limit_key}; or shorten the prompt)")
        return ids

    async def _answer(self, messages_of: list[list[dict]], max_tokens: int, temperature: float = 0.0) -> list:
        from vllm import SamplingParams

        ids = [self._prompt_ids(messages, max_tokens) for messages in messages_of]
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature) for _ in ids]
        outputs = await self.engine.generate(ids, params)
        with self._lock:
            self.calls += len(ids)
        return [output.outputs[0] for output in outputs]

    def complete(self, prompts: list[str], max_tokens: int, timeout_s: float | None = None) -> list[str]:
        """Each prompt as one user message under the model's chat template, answered greedily; TimeoutError after
        ``timeout_s``, its requests aborted in the engine (a caller that gave up on them leaves nothing running)."""
        messages = [[{"role": "user", "content": prompt}] for prompt in prompts]
        outputs = self._events.run(asyncio.wait_for(self._answer(messages, max_tokens), timeout_s))
        return [output.text for output in outputs]

    def serve_openai(self) -> str:
        """Serve ``POST /v1/chat/completions`` (and ``GET /v1/models``) at a free port of this actor's node (its
        Ray address: the driver reaches it on one machine or a cluster), on the engine's loop; returns the base URL
        (…/v1) an OpenAI client takes."""
        if self._serving is None:
            import ray

            self._server, self._serving, url = self._events.run(serve_app(
                self._openai_app(), ray.util.get_node_ip_address(), 30.0, "the frozen engine's OpenAI endpoint"))
            self.base_url = f"{url}/v1"
        return self.base_url

    def _openai_app(self) -> FastAPI:
        app = FastAPI(title="rlsearch frozen engine")

        def error(status: int, message: str) -> JSONResponse:
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                                status_code=status)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            try:
                body = await request.json()
                messages, max_tokens = body["messages"], int(body.get("max_completion_tokens")
                                                             or body.get("max_tokens") or 256)
                if body.get("stream") or int(body.get("n") or 1) != 1:
                    raise ValueError("this endpoint answers one choice, not streamed")
                (output,) = await self._answer([messages], max_tokens, float(body.get("temperature") or 0.0))
            except (ValueError, KeyError, TypeError) as bad:  # the body, or a prompt that does not fit
                return error(400, f"invalid request: {bad}")
            finish = "length" if output.finish_reason == "length" else "stop"
            return JSONResponse({
                "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": output.text},
                             "finish_reason": finish}],
                "usage": {"completion_tokens": len(output.token_ids)},
            })

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model"}]})

        return app

    def stats(self) -> dict[str, int]:
        return {"calls": self.calls}

    def shutdown(self) -> None:
        if self._serving is not None:
            self._events.run(stop_app(self._server, self._serving))
        self._events.run(self.engine.shutdown())
        self._events.stop()


def _frozen_engine(role: str, model: str, max_model_len: int, limit_key: str, seed: int, gpus: int) -> tuple[str, Any]:
    """A frozen engine's Ray actor (Ray running), created, not waited for: its name and handle."""
    import ray

    key = hashlib.sha256(f"{role}-{model}-{ray.get_runtime_context().get_job_id()}".encode()).hexdigest()[:12]
    name = f"{FROZEN_ENGINE_NAME_PREFIX}{role}-{key}"
    # one thread, as its Ray actor's (num_cpus 0) had: it answers while the policy's engines roll out on the cores
    spec = EngineSpec(model, seed=seed, max_model_len=max_model_len, cpu_threads=1)
    actor = ray.remote(FrozenEngine).options(name=name, num_cpus=0, num_gpus=gpus, max_concurrency=64).remote(
        spec, limit_key)
    return name, actor


def _wait(actor: Any, call) -> Any:
    import ray

    try:
        return ray.get(call, timeout=START_TIMEOUT_S)
    except BaseException:
        ray.kill(actor)
        raise


def start_frozen_summariser(tools: ToolsConfig, seed: int, gpus: int = 0) -> tuple[ToolsConfig, Any]:
    """The Ray actor of tools.browse.summariser.engine (Ray running), started and ready, and `tools` with its name
    filled in (what the rollout workers' browse tools look up); (tools, None) when no engine is asked for or one
    runs already."""
    import dataclasses

    summariser = tools.browse.summariser
    if not summariser.engine or summariser.engine_actor:
        return tools, None
    name, actor = _frozen_engine("summariser", summariser.engine, summariser.engine_max_model_len,
                                 "tools.browse.summariser.engine_max_model_len; or lower max_page_chars", seed, gpus)
    _wait(actor, actor.__ray_ready__.remote())
    browse = dataclasses.replace(tools.browse, summariser=dataclasses.replace(summariser, engine_actor=name))
    return dataclasses.replace(tools, browse=browse), actor


class FrozenJudge:
    """The frozen engine of reward.judge.engine, starting (`start_frozen_judge`); `ready` waits for it and gives the
    judge config whose first endpoint it is."""

    def __init__(self, judge: JudgeConfig, seed: int, gpus: int) -> None:
        self.judge = judge
        _, self.actor = _frozen_engine("judge", judge.engine, judge.engine_max_model_len,
                                       "reward.judge.engine_max_model_len", seed, gpus)

    def ready(self) -> JudgeConfig:
        import dataclasses

        url = _wait(self.actor, self.actor.serve_openai.remote())
        return dataclasses.replace(self.judge, engine_url=url)


def start_frozen_judge(judge: JudgeConfig, seed: int, gpus: int = 0) -> FrozenJudge | None:
    """reward.judge.engine's frozen engine (Ray running), starting while the caller starts the rest; None when no
    engine is asked for, or a replay (reward.judge.replay) sends no request."""
    if not judge.starts_engine:
        return None
    return FrozenJudge(judge, seed, gpus)

