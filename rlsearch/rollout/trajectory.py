"""The Trajectory: the contract between rollout, reward, algo and actor. Plain data, token ids are the truth."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class ToolCallRecord:
    name: str
    query: str
    ok: bool  # False: not answered (tool failed or timed out, unknown tool, over a limit); see Turn.error_kind
    error: str | None = None
    latency_s: float = 0.0
    attrs: dict[str, str] = field(default_factory=dict)  # extra attributes of a <call_tool> tag
    cached: bool = False  # answered from tools.cache_dir


@dataclass
class Turn:
    text: str  # what the model produced in this turn (the engine's text, cut at the stop string)
    num_tokens: int
    kind: str  # tool_call | answer | invalid_call | none (see tools.TurnKind)
    tool_call: ToolCallRecord | None = None
    observation: str | None = None  # text appended after this turn (tool output or error), if any
    error: str | None = None  # why an invalid call was invalid
    # what went wrong with this turn's call, if anything (tools.ErrorKind): unparseable | empty_query |
    # unknown_tool | over_limit | timeout | tool_error
    error_kind: str | None = None


@dataclass
class Trajectory:
    example_id: str
    group_id: int  # trajectories of the same prompt share a group (GRPO)
    sample_index: int
    prompt_ids: list[int]
    assistant_prefix: str = ""  # text prefilled at the end of the prompt (part of the first turn's call)
    response_ids: list[int] = field(default_factory=list)  # model and observation tokens after the prompt
    loss_mask: list[int] = field(default_factory=list)  # 1 exactly on tokens the policy sampled
    rollout_logprobs: list[float] = field(default_factory=list)  # engine logprob per token (0.0 on masked)
    turns: list[Turn] = field(default_factory=list)
    finish_reason: str = ""  # answer | eos | length | max_turns
    reward: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)
    generate_s: float = 0.0  # seconds this trajectory waited on the engine, summed over its turns
    tool_s: float = 0.0  # seconds it waited on its tool calls
    # the engine's weight versions in effect while it generated (two or more: a weight update landed mid-rollout)
    weight_versions: list[int] = field(default_factory=list)
    engine: int = -1  # the rollout engine that ran it (EnginePool's index); -1: a single engine outside a pool

    def append_model_tokens(self, token_ids: list[int], logprobs: list[float]) -> None:
        self.response_ids.extend(token_ids)
        self.loss_mask.extend([1] * len(token_ids))
        self.rollout_logprobs.extend(logprobs)

    def append_observation_tokens(self, token_ids: list[int]) -> None:
        self.response_ids.extend(token_ids)
        self.loss_mask.extend([0] * len(token_ids))
        self.rollout_logprobs.extend([0.0] * len(token_ids))

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def model_text(self) -> str:
        """What the assistant turn says without observations (prefill included): rewards are computed on this."""
        return self.assistant_prefix + "".join(turn.text for turn in self.turns)

    @property
    def tool_calls(self) -> list[ToolCallRecord]:
        return [turn.tool_call for turn in self.turns if turn.tool_call is not None]

    @property
    def dispatched_calls(self) -> list[ToolCallRecord]:
        """Calls that reached their tool (not refused as unknown or over a limit)."""
        refused = ("unknown_tool", "over_limit")
        return [turn.tool_call for turn in self.turns if turn.tool_call is not None and turn.error_kind not in refused]

    @property
    def num_invalid_calls(self) -> int:
        return sum(turn.kind == "invalid_call" for turn in self.turns)

    def to_json(self) -> dict:
        record = asdict(self)
        record["num_turns"] = len(self.turns)
        return record
