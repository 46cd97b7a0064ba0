"""The Trajectory: the contract between rollout, reward, algo and actor. Plain data, token ids are the truth."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class ToolCallRecord:
    name: str
    query: str
    ok: bool  # False: not answered (tool failed or timed out, unknown tool, over a limit, not run); see error_kind
    error: str | None = None
    latency_s: float = 0.0
    attrs: dict[str, str] = field(default_factory=dict)  # extra attributes of a <call_tool> tag
    cached: bool = False  # answered from tools.cache_dir
    arguments: dict | None = None  # typed JSON arguments (a native tool call, a JSON <call_tool> body)
    error_kind: str | None = None  # why it was not answered (tools.ErrorKind); None when it was
    # the tool's service failed, not the call (unreachable, retries exhausted, a malformed reply): an eval does not
    # resume a trajectory that holds such a call
    unavailable: bool = False


@dataclass
class Turn:
    text: str  # what the model produced in this turn (the engine's text, cut at the stop string)
    num_tokens: int
    kind: str  # tool_call | answer | invalid_call | none (see tools.TurnKind)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)  # in the order written; tag protocols: one
    observation: str | None = None  # text appended after this turn (tool output or error), if any
    # what the observation shows, one per call in call order (documents or an error), or one error for an invalid
    # call; a tag protocol's one output is its whole observation, chat_tools renders them as tool messages
    tool_outputs: list[str] = field(default_factory=list)
    error: str | None = None  # why an invalid call was invalid
    # what went wrong with this turn, if anything (tools.ErrorKind): unparseable | empty_query for an invalid call;
    # else the first failed call's unknown_tool | over_limit | timeout | tool_error (each call's is on its record)
    error_kind: str | None = None
    # the engine's weight versions while it generated this turn (two: an update landed in the middle of it)
    weight_versions: list[int] = field(default_factory=list)
    context_tokens: int = 0  # tokens of the context it was generated from (the request's prompt)
    cached_tokens: int = 0  # of those, how many the engine's prefix cache held (vLLM's num_cached_tokens)
    # of those, how many this trajectory had already sent to or received from the engine: the most the cache can hold
    cache_ceiling: int = 0
    reward: float | None = None  # the turn scorer's (turn-level credit, algo.advantage); None: not scored


@dataclass
class RubricScore:
    """The rubric scorer's judgement of a trajectory on one rubric (reward.scorers X=rubric)."""

    text: str
    weight: float  # negative: a pitfall, which subtracts when met
    score: float  # the judge's 0-2 read as 0, 0.5 or 1


@dataclass
class Segment:
    """Tokens of one prompt-extending run of model calls. A user agent that rewrites its history (drops or edits
    turns) starts a new segment; every segment of a trajectory is trained with that trajectory's advantage."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]


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
    finish_reason: str = ""  # answer | eos | length | max_turns | context (truncations says which cut)
    # every cut, one entry per event, in order (rlsearch.config.TRUNCATION_REASONS): a cut that ends the trajectory
    # is the last entry; tool output cut to rollout.max_observation_tokens and a prompt cut to fit
    # rollout.max_prompt_tokens can occur along the way
    truncations: list[str] = field(default_factory=list)
    reward: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)
    # the rubric scorer's score per rubric the trajectory was judged on, in order (the row's rubrics; with
    # reward.rubric.evolve the question's persistent then active ones); empty for other scorers
    rubric_scores: list[RubricScore] = field(default_factory=list)
    generate_s: float = 0.0  # seconds this trajectory waited on the engine, summed over its turns
    tool_s: float = 0.0  # seconds it waited on its tool calls
    # the engine's weight versions in effect while it generated (two or more: a weight update landed mid-rollout)
    weight_versions: list[int] = field(default_factory=list)
    engine: int = -1  # the rollout engine that ran it (EnginePool's index); -1: a single engine outside a pool
    # a user agent (rollout.agent): the segments before the last one (the fields above hold the last), and the
    # answer or reward it returned
    earlier_segments: list[Segment] = field(default_factory=list)
    agent_answer: str | None = None
    agent_reward: float | None = None
    # why it is left out of training, empty when it is not: an agent failure (raised, timed out), a judge failure
    # ("judge: ...": no verdict after retries, rlsearch.reward.score); its reward then means nothing
    failed: str = ""

    def append_model_tokens(self, token_ids: list[int], logprobs: list[float]) -> None:
        self.response_ids.extend(token_ids)
        self.loss_mask.extend([1] * len(token_ids))
        self.rollout_logprobs.extend(logprobs)

    def append_observation_tokens(self, token_ids: list[int]) -> None:
        self.response_ids.extend(token_ids)
        self.loss_mask.extend([0] * len(token_ids))
        self.rollout_logprobs.extend([0.0] * len(token_ids))

    @property
    def segments(self) -> list[Segment]:
        """Every segment, the last one (this trajectory's own fields) included."""
        last = Segment(self.prompt_ids, self.response_ids, self.loss_mask, self.rollout_logprobs)
        return [*self.earlier_segments, last]

    def cut(self, reason: str) -> None:
        """End the trajectory for a limit (one of rlsearch.config.TRUNCATION_REASONS): the cut is recorded and the
        finish reason says which kind it was."""
        self.truncations.append(reason)
        self.finish_reason = {"max_turns": "max_turns", "context_window": "context"}.get(reason, "length")

    @property
    def num_response_tokens(self) -> int:
        """Response tokens (model and observation) over every segment: what rollout.max_response_tokens bounds."""
        return sum(len(segment.response_ids) for segment in self.earlier_segments) + len(self.response_ids)

    def start_segment(self, prompt_ids: list[int]) -> None:
        """Close the current segment (it is trained as it stands) and continue from ``prompt_ids``: a rewritten
        context (rollout.context)."""
        self.earlier_segments.append(
            Segment(self.prompt_ids, self.response_ids, self.loss_mask, self.rollout_logprobs)
        )
        self.prompt_ids, self.response_ids, self.loss_mask, self.rollout_logprobs = list(prompt_ids), [], [], []

    @property
    def num_context_tokens(self) -> int:
        """Tokens of the current context (prompt and response of the last segment): len(token_ids), without a copy."""
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def model_text(self) -> str:
        """What the assistant turn says without observations (prefill included): rewards are computed on this."""
        return self.assistant_prefix + "".join(turn.text for turn in self.turns)

    @property
    def tool_calls(self) -> list[ToolCallRecord]:
        return [call for turn in self.turns for call in turn.tool_calls]

    @property
    def dispatched_calls(self) -> list[ToolCallRecord]:
        """Calls that reached their tool (not refused as unknown or over a limit, not cut with their trajectory)."""
        refused = ("unknown_tool", "over_limit", "not_run")
        return [call for call in self.tool_calls if call.error_kind not in refused]

    @property
    def num_invalid_calls(self) -> int:
        return sum(turn.kind == "invalid_call" for turn in self.turns)

    def to_json(self) -> dict:
        record = asdict(self)
        record["num_turns"] = len(self.turns)
        return record
