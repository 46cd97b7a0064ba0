"""The multi-turn agent loop: generate a turn (until a tool call's closing tag, or the end of the turn for native
tool calls), run its tool calls, append their output, continue.

Token ids are the source of truth: the engine's sampled ids are appended as they are (loss mask 1), an
observation is the tokenisation of the observation text alone (loss mask 0), and the next turn continues
from the concatenated ids. Model output is never decoded and re-encoded.

Two schedules share every per-turn step (sampling parameters, recording, limits, tool dispatch, observations):
``per_sample`` runs each trajectory's turn loop as its own asyncio task, ``turn_barrier`` runs all active
trajectories' turns together and then all of their tool calls. Per-request seeds make both give the same
trajectories.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

from ..config import RolloutConfig
from ..tools import ErrorKind, ToolCall, ToolProtocol, ToolRegistry, ToolResult, TurnKind
from .engine import chosen_logprobs
from .observation import fit_observation
from .trajectory import ToolCallRecord, Trajectory, Turn


@dataclass
class PromptItem:
    example_id: str
    question: str
    group_id: int
    sample_index: int
    data_source: str = ""  # what a user agent (rollout.agent) sees of the example besides the question
    golden_answers: tuple[str, ...] = ()


def request_seed(base_seed: int, step: int, group_id: int, sample_index: int, turn: int) -> int:
    """A per-request sampling seed: a fixed seed gives the same trajectories regardless of batching."""
    key = f"{base_seed}/{step}/{group_id}/{sample_index}/{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") & 0x7FFFFFFF


def token_logit_bias(tokenizer, text_bias: dict[str, float]) -> dict[int, float]:
    """Per-token bias from ``rollout.logit_bias``'s per-text bias: every token of the text, tokenised alone and after
    a space."""
    token_bias: dict[int, float] = {}
    for text, bias in text_bias.items():
        for variant in (text, " " + text):
            for token in tokenizer.encode(variant, add_special_tokens=False):
                token_bias[token] = bias
    return token_bias


class AgentLoop:
    """Runs prompts to finished trajectories: the protocol parses each turn, the registry runs the calls.

    Limits: ``rollout.max_turns``, ``rollout.max_tool_calls`` (per trajectory) and ``rollout.max_calls_per_tool``
    refuse further calls with an error observation (counted per call: a turn may hold several);
    ``rollout.max_observation_tokens`` cuts long tool output (keeping the closing tags). Every failure the model
    causes or meets is an observation, never an exception.
    """

    def __init__(self, engine, protocol: ToolProtocol, tools: ToolRegistry, config: RolloutConfig, seed: int) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.protocol = protocol
        self.tools = tools
        self.config = config
        self.seed = seed
        self.logit_bias = token_logit_bias(self.tokenizer, config.logit_bias)

    def prompt_messages(self, question: str) -> list[dict]:
        """The conversation a trajectory starts from: the protocol's system prompt (if any) and instruction."""
        system = self.protocol.system_prompt()
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": self.protocol.instruction(question)})
        return messages

    def prompt_ids(self, question: str) -> list[int]:
        messages = self.prompt_messages(question)
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.protocol.template_kwargs
        )
        return self.tokenizer.encode(text + self.config.assistant_prefix, add_special_tokens=False)

    async def run(self, items: Sequence[PromptItem], step: int) -> list[Trajectory]:
        """Finished trajectories, in item order; scheduled by ``rollout.agent_loop``. Runs on the engine's loop."""
        trajectories = [self._new_trajectory(item) for item in items]
        schedule = self._run_per_sample if self.config.agent_loop == "per_sample" else self._run_turn_barrier
        # the tool clients block: their calls run in threads, at most one per trajectory at a time
        with ThreadPoolExecutor(max_workers=max(1, len(trajectories)), thread_name_prefix="agent-tools") as pool:
            await schedule(trajectories, step, pool)
        return trajectories

    async def _run_per_sample(self, trajectories: list[Trajectory], step: int, pool: Executor) -> None:
        """Every trajectory runs its own turn loop: one waiting on a tool never holds the others."""

        async def run_one(trajectory: Trajectory) -> None:
            for turn_index in range(self.config.max_turns):
                (completion,) = await self._generate([trajectory], step, turn_index)
                turn = self._after_turn(trajectory, completion, turn_index)
                if trajectory.finish_reason:
                    return
                await self._run_tool_calls(pool, [(trajectory, turn)] if turn else [])
                if not self._append_observation(trajectory):
                    return

        tasks = [asyncio.ensure_future(run_one(trajectory)) for trajectory in trajectories]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one failure ends the rollout: no orphaned tasks keep generating
                task.cancel()
            raise

    async def _run_turn_barrier(self, trajectories: list[Trajectory], step: int, pool: Executor) -> None:
        """All active trajectories generate a turn together, then all of the turn's tool calls run (one batch)."""
        active = list(trajectories)
        for turn_index in range(self.config.max_turns):
            if not active:
                break
            completions = await self._generate(active, step, turn_index)
            calling = []
            for trajectory, completion in zip(active, completions):
                if turn := self._after_turn(trajectory, completion, turn_index):
                    calling.append((trajectory, turn))
            active = [t for t in active if not t.finish_reason]
            await self._run_tool_calls(pool, calling)
            active = [t for t in active if self._append_observation(t)]

    def _new_trajectory(self, item: PromptItem) -> Trajectory:
        prompt = self.prompt_ids(item.question)
        if len(prompt) > self.config.max_prompt_tokens:
            raise ValueError(
                f"prompt of example '{item.example_id}' has {len(prompt)} tokens, more than "
                f"rollout.max_prompt_tokens={self.config.max_prompt_tokens}; raise it or shorten the question"
            )
        return Trajectory(item.example_id, item.group_id, item.sample_index, prompt,
                          assistant_prefix=self.config.assistant_prefix)

    async def _generate(self, trajectories: list[Trajectory], step: int, turn_index: int) -> list:
        """The next turn of each trajectory (one engine call); the wait counts into each one's ``generate_s``."""
        started, version_before = time.perf_counter(), self.engine.weight_version
        outputs = await self.engine.generate(
            [t.token_ids for t in trajectories], [self._sampling_params(t, step, turn_index) for t in trajectories]
        )
        waited = time.perf_counter() - started
        versions = sorted({version_before, self.engine.weight_version})
        for trajectory in trajectories:
            trajectory.generate_s += waited
            trajectory.weight_versions = sorted(set(trajectory.weight_versions).union(versions))
        return [output.outputs[0] for output in outputs]

    def _after_turn(self, trajectory: Trajectory, completion, turn_index: int) -> Turn | None:
        """Record a generated turn and decide what follows: returns the turn if any of its tool calls is to run;
        otherwise the trajectory is finished or the turn already holds its (error) observation."""
        turn = self._record_turn(trajectory, completion, turn_index)
        if trajectory.finish_reason:
            return None
        if turn_index == self.config.max_turns - 1:
            trajectory.finish_reason = "max_turns"
            return None
        if turn.kind != TurnKind.TOOL_CALL.value:
            turn.tool_outputs = [self.protocol.error_observation(turn.error or "invalid tool call")]
        else:
            turn.tool_outputs = [""] * len(turn.tool_calls)  # each call's, set when it is refused or answered
            for index, record in enumerate(turn.tool_calls):
                if refusal := self._over_limit(trajectory, record):
                    self._fail(turn, index, ErrorKind.OVER_LIMIT, refusal, refusal)
            if any(record.error_kind is None for record in turn.tool_calls):
                return turn
        self._set_observation(trajectory, turn)
        return None

    def sampling_params(self, max_tokens: int, seed: int, **options):
        """vLLM sampling parameters at the rollout's distribution (temperature, top_p, logit bias), reporting the
        sampled token's logprob under it (the engine runs with processed logprobs)."""
        from vllm import SamplingParams

        return SamplingParams(
            max_tokens=max_tokens, temperature=self.config.temperature, top_p=self.config.top_p, logprobs=0,
            seed=seed, logit_bias=self.logit_bias or None, **options,
        )

    def _sampling_params(self, trajectory: Trajectory, step: int, turn_index: int):
        budget = self.config.max_response_tokens - len(trajectory.response_ids)
        return self.sampling_params(
            max(1, min(self.config.max_tokens_per_turn, budget)),
            request_seed(self.seed, step, trajectory.group_id, trajectory.sample_index, turn_index),
            stop=list(self.protocol.stop_strings), stop_token_ids=list(self.protocol.stop_token_ids),
            include_stop_str_in_output=True,
        )

    async def sample_probe(self, prompt_ids: list[int], num_tokens: int, seed: int) -> tuple[list[int], list[float]]:
        """`num_tokens` tokens sampled after `prompt_ids` at the rollout's distribution, and their logprobs: the
        engine's side of the probe check (rlsearch.weights.probe)."""
        (output,) = await self.engine.generate([prompt_ids], [self.sampling_params(num_tokens, seed, ignore_eos=True)])
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        return token_ids, chosen_logprobs(token_ids, completion.logprobs)

    def _record_turn(self, trajectory: Trajectory, completion, turn_index: int) -> Turn:
        token_ids = list(completion.token_ids)
        logprobs = chosen_logprobs(token_ids, completion.logprobs)
        trajectory.append_model_tokens(token_ids, logprobs)
        # a prefilled opening tag belongs to the first turn's call even though it sits in the prompt
        text = (trajectory.assistant_prefix if turn_index == 0 else "") + completion.text
        action = self.protocol.parse_completion(text, completion.finish_reason, completion.stop_reason)
        turn = Turn(text=completion.text, num_tokens=len(token_ids), kind=action.kind.value, error=action.error,
                    error_kind=action.error_kind.value if action.error_kind else None)
        turn.tool_calls = [
            ToolCallRecord(name=call.name, query=call.query, ok=True, attrs=dict(call.attrs), arguments=call.arguments)
            for call in action.calls
        ]
        trajectory.turns.append(turn)
        if action.kind == TurnKind.ANSWER:
            trajectory.finish_reason = "answer"
        elif action.kind == TurnKind.NONE:
            trajectory.finish_reason = "eos" if completion.finish_reason == "stop" else "length"
        elif len(trajectory.response_ids) >= self.config.max_response_tokens:
            trajectory.finish_reason = "length"
        return turn

    def _over_limit(self, trajectory: Trajectory, record: ToolCallRecord) -> str | None:
        """Why this call may not run, or None. The calls before it (in earlier turns and earlier in its own) count,
        except those refused for a limit."""
        earlier = [
            call for call in itertools.takewhile(lambda call: call is not record, trajectory.tool_calls)
            if call.error_kind != ErrorKind.OVER_LIMIT.value
        ]
        limit = self.config.max_tool_calls
        if limit and len(earlier) >= limit:
            return f"the limit of {limit} tool calls is reached; answer with what you know"
        tool_limit = self.config.max_calls_per_tool.get(record.name, 0)
        if tool_limit and sum(call.name == record.name for call in earlier) >= tool_limit:
            return f"the limit of {tool_limit} calls to '{record.name}' is reached; use another tool or answer"
        return None

    def _fail(self, turn: Turn, index: int, kind: ErrorKind, error: str, shown: str) -> None:
        """Call ``index`` of ``turn`` is not answered: ``error`` is recorded, its output shows ``shown``."""
        record = turn.tool_calls[index]
        record.ok, record.error, record.error_kind = False, error, kind.value
        turn.error_kind = turn.error_kind or kind.value
        turn.tool_outputs[index] = self.protocol.error_observation(shown)

    async def _run_tool_calls(self, pool: Executor, calling: list[tuple[Trajectory, Turn]]) -> None:
        """The calls of these turns not refused go to the registry together (each tool gets its calls as one batch,
        different tools run at once) on a thread of ``pool``; the wait counts into each trajectory's ``tool_s``.
        Each turn then gets its observation."""
        if not calling:
            return
        pending = [
            (turn, index) for _, turn in calling for index, record in enumerate(turn.tool_calls)
            if record.error_kind is None
        ]
        records = [turn.tool_calls[index] for turn, index in pending]
        calls = [ToolCall(record.name, record.query, record.attrs, record.arguments) for record in records]
        started = time.perf_counter()
        results = await asyncio.get_running_loop().run_in_executor(pool, self.tools.run, calls)
        waited = time.perf_counter() - started
        for (turn, index), result in zip(pending, results):
            self._record_result(turn, index, result)
        for trajectory, turn in calling:
            trajectory.tool_s += waited
            self._set_observation(trajectory, turn)

    def _record_result(self, turn: Turn, index: int, result: ToolResult) -> None:
        record = turn.tool_calls[index]
        record.latency_s = result.latency_s
        record.cached = result.cached
        if result.ok:
            turn.tool_outputs[index] = fit_observation(
                self.protocol, result.documents, self.config.max_observation_tokens, self.tokenizer
            )
            return
        unknown = result.error_kind == ErrorKind.UNKNOWN_TOOL
        shown = result.error if unknown else f"{record.name} failed: {result.error}"
        self._fail(turn, index, result.error_kind, result.error, shown)

    def _set_observation(self, trajectory: Trajectory, turn: Turn) -> None:
        """The turn's observation from its outputs; its sampled tokens are the trajectory's last ones."""
        turn.observation = self.protocol.turn_observation(turn.tool_outputs, trajectory.response_ids[-1])

    def _append_observation(self, trajectory: Trajectory) -> bool:
        """Append the last turn's observation; False (finished for length) when it does not fit."""
        observation_ids = self.tokenizer.encode(trajectory.turns[-1].observation, add_special_tokens=False)
        if len(trajectory.response_ids) + len(observation_ids) >= self.config.max_response_tokens:
            trajectory.finish_reason = "length"
            return False
        trajectory.append_observation_tokens(observation_ids)
        return True
