"""The multi-turn agent loop: generate until a tool call's closing tag, run the tool, append, continue.

Token ids are the source of truth: the engine's sampled ids are appended as they are (loss mask 1), an
observation is the tokenisation of the observation text alone (loss mask 0), and the next turn continues
from the concatenated ids. Model output is never decoded and re-encoded.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import RolloutConfig
from ..tools import ErrorKind, ToolCall, ToolProtocol, ToolRegistry, ToolResult, TurnKind
from .observation import fit_observation
from .trajectory import ToolCallRecord, Trajectory, Turn


@dataclass
class PromptItem:
    example_id: str
    question: str
    group_id: int
    sample_index: int


def request_seed(base_seed: int, step: int, group_id: int, sample_index: int, turn: int) -> int:
    """A per-request sampling seed: a fixed seed gives the same trajectories regardless of batching."""
    key = f"{base_seed}/{step}/{group_id}/{sample_index}/{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") & 0x7FFFFFFF


class AgentLoop:
    """Runs prompts to finished trajectories: the protocol parses each turn, the registry runs the calls.

    Limits: ``rollout.max_turns``, ``rollout.max_tool_calls`` (per trajectory) and ``rollout.max_calls_per_tool``
    refuse further calls with an error observation; ``rollout.max_observation_tokens`` cuts long tool output
    (keeping the closing tags). Every failure the model causes or meets is an observation, never an exception.
    """

    def __init__(self, engine, protocol: ToolProtocol, tools: ToolRegistry, config: RolloutConfig, seed: int) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.protocol = protocol
        self.tools = tools
        self.config = config
        self.seed = seed
        self.logit_bias = self._token_logit_bias(config.logit_bias) or None

    def prompt_ids(self, question: str) -> list[int]:
        system = self.protocol.system_prompt()
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": self.protocol.instruction(question)})
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text + self.config.assistant_prefix, add_special_tokens=False)

    def run(self, items: Sequence[PromptItem], step: int) -> list[Trajectory]:
        trajectories = []
        for item in items:
            prompt = self.prompt_ids(item.question)
            if len(prompt) > self.config.max_prompt_tokens:
                raise ValueError(
                    f"prompt of example '{item.example_id}' has {len(prompt)} tokens, more than "
                    f"rollout.max_prompt_tokens={self.config.max_prompt_tokens}; raise it or shorten the question"
                )
            trajectories.append(
                Trajectory(item.example_id, item.group_id, item.sample_index, prompt,
                           assistant_prefix=self.config.assistant_prefix)
            )
        active = list(trajectories)
        for turn_index in range(self.config.max_turns):
            if not active:
                break
            outputs = self.engine.generate(
                [t.token_ids for t in active], [self._sampling_params(t, step, turn_index) for t in active]
            )
            calls: list[Turn] = []
            still_active = []
            for trajectory, output in zip(active, outputs):
                turn = self._record_turn(trajectory, output.outputs[0], turn_index)
                if trajectory.finish_reason:
                    continue
                if turn_index == self.config.max_turns - 1:
                    trajectory.finish_reason = "max_turns"
                    continue
                if turn.kind != TurnKind.TOOL_CALL.value:
                    turn.observation = self.protocol.error_observation(turn.error or "invalid tool call")
                elif refusal := self._over_limit(trajectory, turn.tool_call.name):
                    self._refuse(turn, refusal)
                else:
                    calls.append(turn)
                still_active.append(trajectory)
            self._run_tool_calls(calls)
            active = [t for t in still_active if self._append_observation(t)]
        return trajectories

    def _sampling_params(self, trajectory: Trajectory, step: int, turn_index: int):
        from vllm import SamplingParams

        budget = self.config.max_response_tokens - len(trajectory.response_ids)
        return SamplingParams(
            max_tokens=max(1, min(self.config.max_tokens_per_turn, budget)),
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            stop=list(self.protocol.stop_strings),
            include_stop_str_in_output=True,
            logprobs=0,
            seed=request_seed(self.seed, step, trajectory.group_id, trajectory.sample_index, turn_index),
            logit_bias=self.logit_bias,
        )

    def _record_turn(self, trajectory: Trajectory, completion, turn_index: int) -> Turn:
        token_ids = list(completion.token_ids)
        logprobs = [entry[token].logprob for token, entry in zip(token_ids, completion.logprobs)]
        trajectory.append_model_tokens(token_ids, logprobs)
        stopped_on_tag = completion.finish_reason == "stop" and completion.stop_reason in self.protocol.stop_strings
        # a prefilled opening tag belongs to the first turn's call even though it sits in the prompt
        text = (trajectory.assistant_prefix if turn_index == 0 else "") + completion.text
        parsed = self.protocol.parse_turn(text) if stopped_on_tag else None
        kind = parsed.kind.value if parsed else TurnKind.NONE.value
        turn = Turn(text=completion.text, num_tokens=len(token_ids), kind=kind)
        if parsed and parsed.error_kind:
            turn.error, turn.error_kind = parsed.error, parsed.error_kind.value
        if parsed and parsed.call:
            call = parsed.call
            turn.tool_call = ToolCallRecord(name=call.name, query=call.query, ok=True, attrs=dict(call.attrs))
        trajectory.turns.append(turn)
        if parsed and parsed.kind == TurnKind.ANSWER:
            trajectory.finish_reason = "answer"
        elif not stopped_on_tag:
            trajectory.finish_reason = "eos" if completion.finish_reason == "stop" else "length"
        elif len(trajectory.response_ids) >= self.config.max_response_tokens:
            trajectory.finish_reason = "length"
        return turn

    def _over_limit(self, trajectory: Trajectory, tool_name: str) -> str | None:
        """Why this call (the last turn's) may not run, or None. Earlier refused calls do not count."""
        earlier = [
            turn.tool_call for turn in trajectory.turns[:-1]
            if turn.tool_call is not None and turn.error_kind != ErrorKind.OVER_LIMIT.value
        ]
        limit = self.config.max_tool_calls
        if limit and len(earlier) >= limit:
            return f"the limit of {limit} tool calls is reached; answer with what you know"
        tool_limit = self.config.max_calls_per_tool.get(tool_name, 0)
        if tool_limit and sum(call.name == tool_name for call in earlier) >= tool_limit:
            return f"the limit of {tool_limit} calls to '{tool_name}' is reached; use another tool or answer"
        return None

    def _refuse(self, turn: Turn, message: str) -> None:
        turn.tool_call.ok = False
        turn.tool_call.error = message
        turn.error_kind = ErrorKind.OVER_LIMIT.value
        turn.observation = self.protocol.error_observation(message)

    def _run_tool_calls(self, turns: list[Turn]) -> None:
        """All of a turn's calls go to the registry together: each tool gets its calls as one batch."""
        if not turns:
            return
        records = [turn.tool_call for turn in turns]
        results = self.tools.run([ToolCall(record.name, record.query, record.attrs) for record in records])
        for turn, result in zip(turns, results):
            self._record_result(turn, result)

    def _record_result(self, turn: Turn, result: ToolResult) -> None:
        record = turn.tool_call
        record.latency_s = result.latency_s
        record.cached = result.cached
        if result.ok:
            turn.observation = fit_observation(
                self.protocol, result.documents, self.config.max_observation_tokens, self.tokenizer
            )
            return
        record.ok = False
        record.error = result.error
        turn.error_kind = result.error_kind.value
        unknown = result.error_kind == ErrorKind.UNKNOWN_TOOL
        message = result.error if unknown else f"{record.name} failed: {result.error}"
        turn.observation = self.protocol.error_observation(message)

    def _append_observation(self, trajectory: Trajectory) -> bool:
        """Append the last turn's observation; False (finished for length) when it does not fit."""
        observation_ids = self.tokenizer.encode(trajectory.turns[-1].observation, add_special_tokens=False)
        if len(trajectory.response_ids) + len(observation_ids) >= self.config.max_response_tokens:
            trajectory.finish_reason = "length"
            return False
        trajectory.append_observation_tokens(observation_ids)
        return True

    def _token_logit_bias(self, text_bias: dict[str, float]) -> dict[int, float]:
        """Per-token bias from per-text bias: every token of the text, tokenised alone and after a space."""
        token_bias: dict[int, float] = {}
        for text, bias in text_bias.items():
            for variant in (text, " " + text):
                for token in self.tokenizer.encode(variant, add_special_tokens=False):
                    token_bias[token] = bias
        return token_bias
