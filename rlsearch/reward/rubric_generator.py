"""The evolving rubrics' generator (DR Tulu's RLER): one request per prompt group, with the question, the group's
rollouts and the rubrics the question already has; its reply's JSON ``positive_rubrics`` / ``negative_rubrics``
become new active rubrics (weight +1 / -1). It is asked through the judge's machinery (`Judge`): endpoints in order
with failover, timeouts, retries, deadline, the reply cache and replay.

A failed generation (retries exhausted, a refused request, a reply with no usable JSON) is counted and gives no new
rubrics: the group keeps its active ones and the step goes on."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlsearch.config.prompt import PromptFile
from rlsearch.reward.evolving import GENERATED_WEIGHTS, EvolvingRubric
from rlsearch.reward.judge import PROMPTS_DIR, Judge, JudgeCounters, JudgeError
from rlsearch.reward.qa import trajectory_answer
from rlsearch.reward.verdict import without_thinking

if TYPE_CHECKING:
    from rlsearch.config import JudgeConfig, RewardConfig
    from rlsearch.data import Rubric
    from rlsearch.trajectory import Trajectory

MAX_NEW_RUBRICS = 5  # per reply, positives first (the prompt asks for 1 to 5 in all)
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$", re.MULTILINE)


@dataclass
class GeneratorCounters:
    calls: int = 0  # prompt groups asked
    failures: int = 0  # of them, those that gave no usable reply
    last_failure: str = ""  # why the last one failed
    requests: JudgeCounters = field(default_factory=JudgeCounters)  # HTTP requests and cache hits


def generator_config(reward: RewardConfig) -> tuple[JudgeConfig, str]:
    """The judge settings the generator runs with, and the config key its endpoints come from: reward.judge with
    reward.rubric.evolve's endpoints (when it lists any) and max_tokens."""
    evolve = reward.rubric.evolve
    judge = dataclasses.replace(reward.judge, max_tokens=evolve.max_tokens)
    if not evolve.endpoints:
        return judge, "reward.judge"
    return dataclasses.replace(judge, base_url="", model="", api_key_env="", engine="",
                               endpoints=list(evolve.endpoints)), "reward.rubric.evolve"


def rollout_text(trajectory: Trajectory, full_response: bool) -> str:
    """What the generator is shown of a rollout: all of it, each turn followed by what the tools returned; or, with
    ``full_response`` false, its answer only (empty without one)."""
    if not full_response or trajectory.agent_answer is not None:
        return trajectory_answer(trajectory) or ""
    return trajectory.assistant_prefix + "".join(turn.text + (turn.observation or "") for turn in trajectory.turns)


def parse_generated(reply: str) -> list[EvolvingRubric] | None:
    """The rubrics of a generator reply: the JSON object from its first ``{`` to its last ``}`` (code fences and
    ``<think>`` dropped) with lists ``positive_rubrics`` and/or ``negative_rubrics`` of ``{"description", "title"}``
    (or plain strings). None when there is no such object, or when its lists hold nothing usable; at most
    `MAX_NEW_RUBRICS`, positives first. Empty lists are a valid "nothing to add"."""
    text = _FENCE.sub("", without_thinking(reply))
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        return None
    try:
        obj = json.loads(text[start:end + 1])
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    lists = {kind: obj.get(f"{kind}_rubrics") for kind in GENERATED_WEIGHTS}
    if not any(isinstance(items, list) for items in lists.values()) or any(
            items is not None and not isinstance(items, list) for items in lists.values()):
        return None
    rubrics, offered = [], 0
    for kind, items in lists.items():
        for item in items or ():
            offered += 1
            rubric = _rubric(item, GENERATED_WEIGHTS[kind])
            if rubric is not None:
                rubrics.append(rubric)
    if offered and not rubrics:
        return None
    return rubrics[:MAX_NEW_RUBRICS]


def _rubric(item: object, weight: float) -> EvolvingRubric | None:
    if isinstance(item, str):
        return EvolvingRubric(item.strip(), weight) if item.strip() else None
    if not isinstance(item, dict):
        return None
    description, title = item.get("description"), item.get("title")
    if not isinstance(description, str) or not description.strip():
        return None
    return EvolvingRubric(description.strip(), weight, title=title.strip() if isinstance(title, str) else "")


class RubricGenerator:
    """Asks the generator model for new rubrics; every coroutine runs on the loop that made it (as `Judge`)."""

    def __init__(self, reward: RewardConfig) -> None:
        evolve = reward.rubric.evolve
        self.full_responses = evolve.use_full_responses_for_adaptive_rubric
        self.prompt = PromptFile.load(evolve.prompt_file, PROMPTS_DIR / "rubric_generation.txt",
                                      ("question", "responses", "existing_rubrics"), "reward.rubric.evolve.prompt_file")
        self.client = Judge(*generator_config(reward))

    async def close(self) -> None:
        await self.client.close()

    def render(self, question: str, trajectories: Sequence[Trajectory], existing: Sequence[Rubric]) -> str:
        responses = "\n\n".join(f"Response {index}:\n{rollout_text(trajectory, self.full_responses)}"
                                for index, trajectory in enumerate(trajectories, 1))
        rubrics = json.dumps([{"description": rubric.text, "weight": rubric.weight} for rubric in existing],
                             ensure_ascii=False)
        return self.prompt.render(question=question, responses=responses, existing_rubrics=rubrics)

    async def generate(self, question: str, trajectories: Sequence[Trajectory], existing: Sequence[Rubric],
                       counters: GeneratorCounters) -> list[EvolvingRubric] | None:
        """New rubrics for a prompt group (``existing``: the question's persistent and active rubrics, shown so that
        it does not repeat them), or None when the generation failed (counted in ``counters.failures``). A replay
        that lacks the prompt raises `JudgeReplayMissError`: the run stops."""
        counters.calls += 1
        try:
            reply = await self.client.reply(self.render(question, trajectories, existing), counters.requests)
        except JudgeError as error:
            counters.failures += 1
            counters.last_failure = str(error)
            return None
        rubrics = parse_generated(reply)
        if rubrics is None:
            counters.failures += 1
            counters.last_failure = f"no rubrics in the reply {reply[:200]!r}"
        return rubrics
