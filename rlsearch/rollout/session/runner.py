"""Runs a user agent (``rollout.agent: package.module:function``) per prompt and turns its session into a
Trajectory.

The agent is ``async def agent(session, example)``. It returns its final answer (a string, scored by the data
source's scorer like an ``<answer>`` block), a reward (a float, used as is), or None (the reward then comes from
the model text, as for the built-in loop). An agent that raises or runs past ``rollout.agent_timeout_s`` fails its
trajectory: counted, kept in the logs, left out of training; the step goes on. An agent that stops on the
endpoint's 400 for a used-up token budget (and lets the error propagate) has simply finished, for length.

Agents run on an event loop of their own: one that blocks (a synchronous client, a slow computation) does not
stall the endpoint or the engine.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable, Sequence

from ...config import RolloutConfig
from ...loop_thread import LoopThread
from ...trajectory import Trajectory, Turn
from ..agent_loop import PromptItem
from .server import SessionEndpoint
from .session import AgentExample, AgentSession


def load_agent(spec: str) -> Callable:
    """The function named by ``package.module:function``; errors say what to fix."""
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"rollout.agent={spec!r}: cannot import {module_name!r} ({error}); the module must be importable from "
            "the directory you run rlsearch in, or installed"
        ) from error
    agent = getattr(module, function_name, None)
    if agent is None or not inspect.iscoroutinefunction(agent):
        raise ValueError(f"rollout.agent={spec!r}: {module_name} has no `async def {function_name}(session, example)`")
    return agent


class AgentRunner:
    """The rollout driver for user agents; ``run`` has the built-in ``AgentLoop.run``'s contract."""

    def __init__(
        self, endpoint: SessionEndpoint, agent: Callable, prompt_messages: Callable[[str], list[dict]],
        config: RolloutConfig,
    ) -> None:
        self.endpoint = endpoint
        self.agent = agent
        self.prompt_messages = prompt_messages
        self.config = config
        self._agents = LoopThread("user-agents")
        self._client = None  # one openai.AsyncOpenAI on the agents' loop; sessions use it with their own base_url

    async def run(self, items: Sequence[PromptItem], step: int) -> list[Trajectory]:
        """Finished trajectories in item order; runs on the engine's event loop (where the endpoint serves)."""
        await self.endpoint.serve()
        sessions = [self.endpoint.open(item, step) for item in items]
        try:
            futures = [
                asyncio.run_coroutine_threadsafe(self._drive(session, self._example(item)), self._agents.loop)
                for session, item in zip(sessions, items)
            ]
            outcomes = await asyncio.gather(*(asyncio.wrap_future(future) for future in futures))
        finally:
            for session in sessions:
                self.endpoint.close(session)
        return [to_trajectory(session, item, outcome) for session, item, outcome in zip(sessions, items, outcomes)]

    def stop(self) -> None:
        if self._client is not None:
            self._agents.run(self._client.close())
        self._agents.stop()

    def _example(self, item: PromptItem) -> AgentExample:
        return AgentExample(
            item.example_id, item.question, tuple(self.prompt_messages(item.question)), item.data_source,
            item.golden_answers, item.group_id, item.sample_index,
        )

    async def _drive(self, session: AgentSession, example: AgentExample) -> tuple[object, str]:
        """(what the agent returned, why it failed or "")."""
        timeout = self.config.agent_timeout_s
        if self._client is None:
            from openai import AsyncOpenAI

            self._client = AsyncOpenAI(base_url=session.base_url, api_key="rlsearch", max_retries=0)
        session.shared_client = self._client
        try:
            return await asyncio.wait_for(self.agent(session, example), timeout), ""
        except asyncio.TimeoutError:
            return None, f"the agent ran past rollout.agent_timeout_s={timeout}"
        except Exception as error:  # a user agent's bug fails its trajectory, not the run
            if session.refused_for:  # the endpoint refused a call for the budget or the window: it is complete
                return None, ""
            return None, f"the agent raised {type(error).__name__}: {error}"[:500]


def to_trajectory(session: AgentSession, item: PromptItem, outcome: tuple[object, str]) -> Trajectory:
    returned, failure = outcome
    segments = [segment.to_segment() for segment in session.tokens.segments]
    if not failure and not segments:
        failure = "the agent made no model call through session.base_url"
    if not failure and (isinstance(returned, bool) or not isinstance(returned, (str, int, float, type(None)))):
        failure = f"the agent returned {type(returned).__name__}; return the final answer (str), a reward or None"
    last = segments[-1] if segments else None
    trajectory = Trajectory(
        item.example_id, item.group_id, item.sample_index, last.prompt_ids if last else [],
        response_ids=last.response_ids if last else [], loss_mask=last.loss_mask if last else [],
        rollout_logprobs=last.rollout_logprobs if last else [], earlier_segments=segments[:-1],
        generate_s=session.generate_s, tool_s=session.tool_s, weight_versions=sorted(session.weight_versions),
        failed=failure,
    )
    for call in session.calls:
        kind = "tool_call" if call.tool_calls or call.answered_tool_calls else "none"
        failed = next((record.error_kind for record in call.tool_calls if record.error_kind), None)
        trajectory.turns.append(Turn(
            text=call.text, num_tokens=call.num_tokens, kind=kind, tool_calls=call.tool_calls, error_kind=failed,
            weight_versions=call.weight_versions, context_tokens=call.context_tokens, cached_tokens=call.cached_tokens,
            cache_ceiling=call.cache_ceiling,
        ))
    if not failure and isinstance(returned, str):
        trajectory.agent_answer = returned
    elif not failure and isinstance(returned, (int, float)):
        trajectory.agent_reward = float(returned)
    cut = session.refused_for or (session.calls[-1].cut_by if session.calls else "")
    if cut:
        trajectory.cut(cut)
    elif trajectory.agent_answer is not None or trajectory.agent_reward is not None:
        trajectory.finish_reason = "answer"
    else:
        trajectory.finish_reason = "eos"
    return trajectory
