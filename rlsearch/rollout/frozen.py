"""A frozen engine of the run: a second model in the run's Ray cluster that the tools call (the browse agent's
summariser), never trained and never synced. One vLLM engine (`VLLMEngine`) on its own event loop, as a rollout
worker holds it; ``complete`` answers chat prompts greedily."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from typing import Any

from ..config import ToolsConfig
from ..loop_thread import LoopThread
from ..runlog import redirect_worker_output
from .engine import EngineSpec, VLLMEngine

FROZEN_ENGINE_NAME_PREFIX = "rlsearch-frozen-summariser-"
START_TIMEOUT_S = 900.0


class FrozenEngine:
    """Greedy chat completions of one model; thread-safe (a threaded Ray actor serves the rollout workers at once)."""

    def __init__(self, spec: EngineSpec) -> None:
        redirect_worker_output("frozen-engine")
        self._events = LoopThread("frozen-engine")

        async def start() -> VLLMEngine:  # AsyncLLM binds to the loop it is first used on
            return VLLMEngine(spec)

        self.engine = self._events.run(start())
        self.max_model_len = spec.max_model_len
        self.calls = 0  # prompts answered
        self._lock = threading.Lock()

    def complete(self, prompts: list[str], max_tokens: int, timeout_s: float | None = None) -> list[str]:
        """Each prompt as one user message under the model's chat template, answered greedily; TimeoutError after
        ``timeout_s``, its requests aborted in the engine (a caller that gave up on them leaves nothing running)."""
        from vllm import SamplingParams

        tokenizer = self.engine.tokenizer
        ids = []
        for prompt in prompts:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 tokenize=False)
            ids.append(tokenizer.encode(text, add_special_tokens=False))
            if len(ids[-1]) + max_tokens > self.max_model_len:
                raise ValueError(
                    f"a summary prompt of {len(ids[-1])} tokens and {max_tokens} to write do not fit the frozen "
                    f"engine's {self.max_model_len} (tools.browse.summariser.engine_max_model_len; or lower "
                    "max_page_chars)")
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.0) for _ in prompts]
        outputs = self._events.run(asyncio.wait_for(self.engine.generate(ids, params), timeout_s))
        with self._lock:
            self.calls += len(prompts)
        return [output.outputs[0].text for output in outputs]

    def stats(self) -> dict[str, int]:
        return {"calls": self.calls}

    def shutdown(self) -> None:
        self._events.run(self.engine.shutdown())
        self._events.stop()


def start_frozen_summariser(tools: ToolsConfig, seed: int, gpus: int = 0) -> tuple[ToolsConfig, Any]:
    """The Ray actor of tools.browse.summariser.engine (Ray running), started and ready, and `tools` with its name
    filled in (what the rollout workers' browse tools look up); (tools, None) when no engine is asked for or one
    runs already."""
    import dataclasses

    import ray

    summariser = tools.browse.summariser
    if not summariser.engine or summariser.engine_actor:
        return tools, None
    key = hashlib.sha256(f"{summariser.engine}-{ray.get_runtime_context().get_job_id()}".encode()).hexdigest()[:12]
    name = f"{FROZEN_ENGINE_NAME_PREFIX}{key}"
    # one thread, as its Ray actor's (num_cpus 0) had: it summarises while the policy's engines roll out on the cores
    spec = EngineSpec(summariser.engine, seed=seed, max_model_len=summariser.engine_max_model_len, cpu_threads=1)
    actor = ray.remote(FrozenEngine).options(name=name, num_cpus=0, num_gpus=gpus, max_concurrency=64).remote(spec)
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=START_TIMEOUT_S)
    except BaseException:
        ray.kill(actor)
        raise
    browse = dataclasses.replace(tools.browse, summariser=dataclasses.replace(summariser, engine_actor=name))
    return dataclasses.replace(tools, browse=browse), actor
