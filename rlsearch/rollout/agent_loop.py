"""The multi-turn agent loop: generate a turn (until a tool call's closing tag, or the end of the turn for native
tool calls), run its tool calls, append their output, continue.

Token ids are the source of truth: the engine's sampled ids are appended as they are (loss mask 1), an
observation is the tokenisation of the observation text alone (loss mask 0), and the next turn continues
from the concatenated ids. Model output is never decoded and re-encoded.

Two schedules share every per-turn step (sampling parameters, recording, limits, tool dispatch, observations):
``per_sample`` runs each trajectory's turn loop as its own asyncio task, ``turn_barrier`` runs all active
trajectories' turns together and then all of their tool calls. Per-request seeds make both give the same
trajectories.

Long horizons: a trajectory's context is kept within ``rollout.context_window`` by ``rollout.context`` (fold:
the model summarises and goes on from prompt and summary; drop_observations: old tool outputs become a
placeholder), each rewrite starting a new segment. Every cut is recorded by reason (``Trajectory.truncations``).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

from ..config import RolloutConfig
from ..tools import ErrorKind, ToolCall, ToolProtocol, ToolRegistry, ToolResult, TurnKind
from ..tools.protocols.folding import FOLD_INSTRUCTION, FOLDED_QUESTION, SUMMARY_CLOSE, summary_text
from ..trajectory import ToolCallRecord, Trajectory, Turn
from .engine import chosen_logprobs
from .observation import TRUNCATION_MARK, fitted_observation


@dataclass
class PromptItem:
    example_id: str
    question: str
    group_id: int
    sample_index: int
    data_source: str = ""  # what a user agent (rollout.agent) sees of the example besides the question
    golden_answers: tuple[str, ...] = ()


DROPPED_OBSERVATION = "(an earlier tool output, removed to save room)"


@dataclass
class _Generated:
    """One engine request's result for a trajectory: the completion and what the request saw."""

    completion: object  # vLLM's CompletionOutput
    weight_versions: list[int]
    context_tokens: int
    cached_tokens: int
    cache_ceiling: int


@dataclass
class _Context:
    """What the loop keeps of a running trajectory besides the trajectory itself."""

    question: str
    observations: list[tuple[int, int]] = field(default_factory=list)  # tool outputs' spans in token_ids, undropped
    prefilled: bool = True  # the context ends with rollout.assistant_prefix (a segment's start)
    seen: list[int] = field(default_factory=list)  # the last request's context and sampled tokens


def request_seed(base_seed: int, step: int, group_id: int, sample_index: int, turn: int | str) -> int:
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
        self._contexts: dict[int, _Context] = {}  # id(trajectory) -> its context, while it runs

    def prompt_messages(self, question: str) -> list[dict]:
        """The conversation a trajectory starts from: the protocol's system prompt (if any) and instruction."""
        system = self.protocol.system_prompt()
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": self.protocol.instruction(question)})
        return messages

    def prompt_ids(self, question: str) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            self.prompt_messages(question), add_generation_prompt=True, tokenize=False, **self.protocol.template_kwargs
        )
        return self._encode(text + self.config.assistant_prefix)

    def folded_prompt_ids(self, question: str, summary: str) -> list[int]:
        """The prompt a folded trajectory goes on from: the question with the summary of what was found."""
        return self.prompt_ids(FOLDED_QUESTION.format(question=question, summary=summary))

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def run(self, items: Sequence[PromptItem], step: int) -> list[Trajectory]:
        """Finished trajectories, in item order; scheduled by ``rollout.agent_loop``. Runs on the engine's loop."""
        trajectories = [self._new_trajectory(item) for item in items]
        schedule = self._run_per_sample if self.config.agent_loop == "per_sample" else self._run_turn_barrier
        # the tool clients block: their calls run in threads, at most one per trajectory at a time
        try:
            with ThreadPoolExecutor(max_workers=max(1, len(trajectories)), thread_name_prefix="agent-tools") as pool:
                await schedule(trajectories, step, pool)
        finally:
            for trajectory in trajectories:
                self._contexts.pop(id(trajectory), None)
        return trajectories

    async def _run_per_sample(self, trajectories: list[Trajectory], step: int, pool: Executor) -> None:
        """Every trajectory runs its own turn loop: one waiting on a tool never holds the others."""

        async def run_one(trajectory: Trajectory) -> None:
            for turn_index in range(self.config.max_turns):
                await self._make_room([trajectory], step, turn_index)
                if trajectory.finish_reason:
                    return
                (generated,) = await self._generate([trajectory], step, turn_index)
                turn = self._after_turn(trajectory, generated, turn_index)
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
            await self._make_room(active, step, turn_index)
            active = [t for t in active if not t.finish_reason]
            if not active:
                break
            generated = await self._generate(active, step, turn_index)
            calling = []
            for trajectory, result in zip(active, generated):
                if turn := self._after_turn(trajectory, result, turn_index):
                    calling.append((trajectory, turn))
            active = [t for t in active if not t.finish_reason]
            await self._run_tool_calls(pool, calling)
            active = [t for t in active if self._append_observation(t)]

    def _new_trajectory(self, item: PromptItem) -> Trajectory:
        prompt, cut = self._fitted_prompt(item)
        trajectory = Trajectory(item.example_id, item.group_id, item.sample_index, prompt,
                                assistant_prefix=self.config.assistant_prefix)
        if cut:
            trajectory.truncations.append("prompt")
        self._contexts[id(trajectory)] = _Context(item.question)
        return trajectory

    def _fitted_prompt(self, item: PromptItem) -> tuple[list[int], bool]:
        """The item's prompt ids within rollout.max_prompt_tokens, and whether its question was cut to get there
        (rollout.long_prompts=cut; error: a longer prompt is an error naming the row)."""
        limit = self.config.max_prompt_tokens
        prompt = self.prompt_ids(item.question)
        if len(prompt) <= limit:
            return prompt, False
        if self.config.long_prompts == "error":
            raise ValueError(
                f"prompt of example '{item.example_id}' has {len(prompt)} tokens, more than "
                f"rollout.max_prompt_tokens={limit}; raise it, shorten the question or set rollout.long_prompts=cut"
            )
        question_ids = self._encode(item.question)
        keep = len(question_ids) - (len(prompt) - limit)
        while keep > 0:
            # a cut inside a multi-byte character decodes to U+FFFD: drop that partial character
            question = self.tokenizer.decode(question_ids[:keep]).rstrip("\ufffd") + TRUNCATION_MARK
            prompt = self.prompt_ids(question)
            if len(prompt) <= limit:
                return prompt, True
            keep -= len(prompt) - limit
        raise ValueError(
            f"example '{item.example_id}': the prompt template alone is longer than rollout.max_prompt_tokens={limit}"
        )

    async def _generate(
        self, trajectories: list[Trajectory], step: int, turn_index: int, summary: bool = False
    ) -> list[_Generated]:
        """The next turn (``summary``: a fold's summary) of each trajectory, one engine call; the wait counts into
        each one's ``generate_s``."""
        started, version_before = time.perf_counter(), self.engine.weight_version
        contexts = [t.token_ids for t in trajectories]
        params = [
            self._summary_params(t, step, turn_index) if summary else self._sampling_params(t, step, turn_index)
            for t in trajectories
        ]
        outputs = await self.engine.generate(contexts, params)
        waited = time.perf_counter() - started
        versions = sorted({version_before, self.engine.weight_version})
        generated = []
        for trajectory, context, output in zip(trajectories, contexts, outputs):
            trajectory.generate_s += waited
            trajectory.weight_versions = sorted(set(trajectory.weight_versions).union(versions))
            completion = output.outputs[0]
            state = self._contexts[id(trajectory)]
            ceiling = common_prefix_length(context, state.seen)
            state.seen = context + list(completion.token_ids)
            generated.append(_Generated(completion, versions, len(context), output.num_cached_tokens or 0, ceiling))
        return generated

    def _after_turn(self, trajectory: Trajectory, generated: _Generated, turn_index: int) -> Turn | None:
        """Record a generated turn and decide what follows: returns the turn if any of its tool calls is to run;
        otherwise the trajectory is finished or the turn already holds its (error) observation."""
        turn = self._record_turn(trajectory, generated)
        if not trajectory.finish_reason and turn_index == self.config.max_turns - 1:
            trajectory.cut("max_turns")
        if trajectory.finish_reason:
            for record in turn.tool_calls:  # only a cut ends a trajectory on a turn with calls: they never run
                record.ok, record.error_kind = False, ErrorKind.NOT_RUN.value
                record.error = f"not run: the trajectory was cut after this turn ({trajectory.truncations[-1]})"
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

    def _turn_limit(self, trajectory: Trajectory) -> tuple[int, str]:
        """The most tokens the next turn may take, and the limit that sets it (a truncation reason)."""
        limits = {
            "turn_tokens": self.config.max_tokens_per_turn,
            "response_budget": self.config.max_response_tokens - trajectory.num_response_tokens,
            "context_window": self.config.window - trajectory.num_context_tokens,
        }
        reason = min(limits, key=limits.__getitem__)
        return limits[reason], reason

    def _sampling_params(self, trajectory: Trajectory, step: int, turn_index: int):
        return self.sampling_params(
            max(1, self._turn_limit(trajectory)[0]),
            request_seed(self.seed, step, trajectory.group_id, trajectory.sample_index, turn_index),
            stop=list(self.protocol.stop_strings), stop_token_ids=list(self.protocol.stop_token_ids),
            include_stop_str_in_output=True,
        )

    def _summary_params(self, trajectory: Trajectory, step: int, turn_index: int):
        return self.sampling_params(
            max(1, min(self.config.summary_tokens, self._turn_limit(trajectory)[0])),
            request_seed(self.seed, step, trajectory.group_id, trajectory.sample_index, f"fold-{turn_index}"),
            stop=[SUMMARY_CLOSE], include_stop_str_in_output=True,
        )

    async def sample_probe(self, prompt_ids: list[int], num_tokens: int, seed: int) -> tuple[list[int], list[float]]:
        """`num_tokens` tokens sampled after `prompt_ids` at the rollout's distribution, and their logprobs: the
        engine's side of the probe check (rlsearch.weights.probe)."""
        (output,) = await self.engine.generate([prompt_ids], [self.sampling_params(num_tokens, seed, ignore_eos=True)])
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        return token_ids, chosen_logprobs(token_ids, completion.logprobs)

    def _append_turn(self, trajectory: Trajectory, generated: _Generated, kind: str) -> Turn:
        """The generated tokens appended (loss mask 1), and a turn of ``kind`` recording them."""
        completion = generated.completion
        token_ids = list(completion.token_ids)
        trajectory.append_model_tokens(token_ids, chosen_logprobs(token_ids, completion.logprobs))
        turn = Turn(text=completion.text, num_tokens=len(token_ids), kind=kind,
                    weight_versions=generated.weight_versions, context_tokens=generated.context_tokens,
                    cached_tokens=generated.cached_tokens, cache_ceiling=generated.cache_ceiling)
        trajectory.turns.append(turn)
        return turn

    def _record_turn(self, trajectory: Trajectory, generated: _Generated) -> Turn:
        completion = generated.completion
        _, binding_limit = self._turn_limit(trajectory)
        state = self._contexts[id(trajectory)]
        # a prefilled opening tag belongs to the call of a segment's first turn even though it sits in the prompt
        text = (trajectory.assistant_prefix if state.prefilled else "") + completion.text
        state.prefilled = False
        action = self.protocol.parse_completion(text, completion.finish_reason, completion.stop_reason)
        turn = self._append_turn(trajectory, generated, action.kind.value)
        turn.error, turn.error_kind = action.error, action.error_kind.value if action.error_kind else None
        turn.tool_calls = [
            ToolCallRecord(name=call.name, query=call.query, ok=True, attrs=dict(call.attrs), arguments=call.arguments)
            for call in action.calls
        ]
        if action.kind == TurnKind.ANSWER:
            trajectory.finish_reason = "answer"
        elif action.kind == TurnKind.NONE and completion.finish_reason == "stop":
            trajectory.finish_reason = "eos"
        elif action.kind == TurnKind.NONE:
            trajectory.cut(binding_limit)
        elif trajectory.num_response_tokens >= self.config.max_response_tokens:
            trajectory.cut("response_budget")
        elif trajectory.num_context_tokens >= self.config.window:
            trajectory.cut("context_window")
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
            (trajectory, turn, index) for trajectory, turn in calling for index, record in enumerate(turn.tool_calls)
            if record.error_kind is None
        ]
        calls = [
            ToolCall(record.name, record.query, record.attrs, record.arguments,
                     question=self._contexts[id(trajectory)].question)
            for trajectory, turn, index in pending for record in [turn.tool_calls[index]]
        ]
        started = time.perf_counter()
        results = await asyncio.get_running_loop().run_in_executor(pool, self.tools.run, calls)
        waited = time.perf_counter() - started
        for (trajectory, turn, index), result in zip(pending, results):
            if self._record_result(turn, index, result):
                trajectory.truncations.append("tool_output")
        for trajectory, turn in calling:
            trajectory.tool_s += waited
            self._set_observation(trajectory, turn)

    def _record_result(self, turn: Turn, index: int, result: ToolResult) -> bool:
        """The call's output (or error) on its turn; True when the output was cut to rollout.max_observation_tokens."""
        record = turn.tool_calls[index]
        record.latency_s = result.latency_s
        record.cached = result.cached
        record.unavailable = result.unavailable
        if result.ok:
            fitted = fitted_observation(
                self.protocol, result.documents, self.config.max_observation_tokens, self.tokenizer
            )
            turn.tool_outputs[index] = fitted.text
            return fitted.cut
        unknown = result.error_kind == ErrorKind.UNKNOWN_TOOL
        shown = result.error if unknown else f"{record.name} failed: {result.error}"
        self._fail(turn, index, result.error_kind, result.error, shown)
        return False

    def _set_observation(self, trajectory: Trajectory, turn: Turn) -> None:
        """The turn's observation from its outputs; its sampled tokens are the trajectory's last ones."""
        turn.observation = self.protocol.turn_observation(turn.tool_outputs, trajectory.response_ids[-1])

    def _append_observation(self, trajectory: Trajectory) -> bool:
        """Append the last turn's observation; False (the trajectory is cut) when it does not fit the response budget
        or the context window with a token to spare."""
        observation_ids = self._encode(trajectory.turns[-1].observation)
        if trajectory.num_response_tokens + len(observation_ids) >= self.config.max_response_tokens:
            trajectory.cut("response_budget")
            return False
        if trajectory.num_context_tokens + len(observation_ids) >= self.config.window:
            trajectory.cut("context_window")
            return False
        start = trajectory.num_context_tokens
        trajectory.append_observation_tokens(observation_ids)
        self._contexts[id(trajectory)].observations.append((start, start + len(observation_ids)))
        return True

    async def _make_room(self, trajectories: list[Trajectory], step: int, turn_index: int) -> None:
        """rollout.context: fold or drop the observations of the trajectories whose context reached
        rollout.manage_context_at tokens (at most once per turn: a fresh segment is never folded again at once)."""
        if self.config.context == "append":
            return
        full = [
            t for t in trajectories
            if t.response_ids and t.num_context_tokens >= self.config.manage_context_threshold
        ]
        if not full:
            return
        if self.config.context == "drop_observations":
            for trajectory in full:
                self._drop_observations(trajectory)
            return
        await self._fold(full, step, turn_index)

    async def _fold(self, trajectories: list[Trajectory], step: int, turn_index: int) -> None:
        """Each trajectory is asked to summarise (an observation), writes the summary (sampled, trained) and goes on
        from the prompt with the summary as a new segment."""
        asking = []
        for trajectory in trajectories:
            notice = self._encode(self.protocol.turn_observation(
                [self.protocol.wrap(FOLD_INSTRUCTION)], trajectory.response_ids[-1]
            ))
            if trajectory.num_context_tokens + len(notice) >= self.config.window:
                trajectory.cut("context_window")
                continue
            trajectory.append_observation_tokens(notice)
            asking.append(trajectory)
        if not asking:
            return
        for trajectory, generated in zip(asking, await self._generate(asking, step, turn_index, summary=True)):
            turn = self._append_turn(trajectory, generated, "summary")
            summary = summary_text(turn.text)
            state = self._contexts[id(trajectory)]
            trajectory.start_segment(self.folded_prompt_ids(state.question, summary))
            state.observations, state.prefilled = [], True

    def _drop_observations(self, trajectory: Trajectory) -> None:
        """Every tool output of the context but the last rollout.keep_observations becomes a placeholder; the
        trajectory goes on from the shortened context as a new segment. Nothing happens when none is left to drop."""
        state = self._contexts[id(trajectory)]
        num_dropped = max(0, len(state.observations) - self.config.keep_observations)
        if not num_dropped:
            return
        token_ids, context, kept, cursor = trajectory.token_ids, [], [], 0
        for index, (start, end) in enumerate(state.observations):
            context.extend(token_ids[cursor:start])
            if index < num_dropped:
                context.extend(self._encode(self.protocol.turn_observation(
                    [self.protocol.wrap(DROPPED_OBSERVATION)], token_ids[start - 1]
                )))
            else:
                kept.append((len(context), len(context) + end - start))
                context.extend(token_ids[start:end])
            cursor = end
        context.extend(token_ids[cursor:])
        trajectory.start_segment(context)
        state.observations = kept


def common_prefix_length(first: list[int], second: list[int]) -> int:
    """Length of the longest common prefix of two token lists (slices compare in C: a binary search on them)."""
    low, high = 0, min(len(first), len(second))
    if first[:high] == second[:high]:
        return high
    while low < high:  # invariant: first[:low] == second[:low], first[:high + 1] != second[:high + 1]
        middle = (low + high + 1) // 2
        if first[:middle] == second[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
