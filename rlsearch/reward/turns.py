"""Turn rewards, for turn-level credit (algo.advantage turn_returns | gigpo): a turn scorer gives every model turn of
a trajectory a reward for what its tool calls brought back (Turn.reward). A row's turn scorer is its own
`turn_scorer` field, else reward.turn_scorers[its data_source], else reward.turn_scorer. Built in:

- retrieved_answer: 1 for a turn whose answered calls returned a golden answer (a normalised substring of their
  output, as `substring_match` reads an answer): the search that found the passage holding the fact asked for; else 0.
- new_information: the share of the distinct (normalised) words of a turn's answered output that no earlier turn's
  output held: a repeated search earns 0, the first search what it found.

Any other is ``package.module:function``, called as ``function(trajectory, golden_answers)`` and returning one reward
per turn. Only answered calls count: a failed, refused or invalid call retrieved nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rlsearch.config import RewardConfig
from rlsearch.data import QAExample
from rlsearch.reward.qa import normalize_answer, substring_match
from rlsearch.reward.registry import ScorerError, load_function

if TYPE_CHECKING:
    from rlsearch.trajectory import Trajectory, Turn

TurnScorer = Callable[["Trajectory", Sequence[str]], Sequence[float]]
"""(trajectory, golden_answers) -> a reward per turn of the trajectory, in order"""


def answered_outputs(turn: Turn) -> list[str]:
    """What the turn's answered tool calls returned (a tag protocol's one output, or one per call)."""
    return [output for call, output in zip(turn.tool_calls, turn.tool_outputs) if call.ok]


def retrieved_answer(trajectory: Trajectory, golden_answers: Sequence[str]) -> list[float]:
    """1.0 for each turn whose answered calls returned a golden answer, else 0.0."""
    return [substring_match("\n".join(outputs), golden_answers) if (outputs := answered_outputs(turn)) else 0.0
            for turn in trajectory.turns]


def new_information(trajectory: Trajectory, golden_answers: Sequence[str]) -> list[float]:
    """Per turn, the share of the distinct words of its answered output that no earlier turn's output held."""
    seen: set[str] = set()
    rewards = []
    for turn in trajectory.turns:
        words = set(normalize_answer("\n".join(answered_outputs(turn))).split())
        rewards.append(len(words - seen) / len(words) if words else 0.0)
        seen |= words
    return rewards


TURN_SCORERS: dict[str, TurnScorer] = {"retrieved_answer": retrieved_answer, "new_information": new_information}


def turn_scorer_name_for(example: QAExample, config: RewardConfig) -> str:
    """A row's turn scorer: its own, else its source's (reward.turn_scorers), else reward.turn_scorer."""
    return example.turn_scorer or config.turn_scorers.get(example.data_source) or config.turn_scorer


def get_turn_scorer(name: str) -> TurnScorer:
    """The built-in turn scorer ``name``, or the function ``package.module:function`` names."""
    scorer = TURN_SCORERS.get(name)
    return scorer if scorer is not None else load_function(name, "turn scorer", list(TURN_SCORERS))


def probe_trajectory() -> Trajectory:
    """Three turns as a rollout records them: a search that returned the golden answer ("probe answer"), a failed
    search, and an answer without a call: what the start-up check scores each turn scorer on."""
    from rlsearch.trajectory import ToolCallRecord, Trajectory, Turn

    found = Turn("<search>probe</search>", 5, "tool_call", [ToolCallRecord("search", "probe", ok=True)],
                 observation="Doc 1: the probe answer", tool_outputs=["Doc 1: the probe answer"])
    failed = Turn("<search>probe again</search>", 6, "tool_call",
                  [ToolCallRecord("search", "probe again", ok=False, error="timed out", error_kind="timeout")],
                  observation="error: timed out", tool_outputs=["error: timed out"])
    answer = Turn("<answer>probe answer</answer>", 6, "answer")
    return Trajectory("probe", 0, 0, [1], turns=[found, failed, answer], finish_reason="answer")


def check_turn_scorers(examples: Sequence[QAExample], config: RewardConfig) -> None:
    """The start-up check: every turn scorer the config and the rows name is known or loads, and gives one finite
    reward per turn of a probe trajectory (`ScorerError` naming the key, or the row's file:line), rather than after
    the first rollout."""
    import math

    probe = probe_trajectory()
    named = [("'reward.turn_scorer'", config.turn_scorer),
             *((f"'reward.turn_scorers.{source}'", name) for source, name in config.turn_scorers.items()),
             *((example.location or f"row {example.id!r}", example.turn_scorer) for example in examples
               if example.turn_scorer)]
    checked = set()
    for where, name in named:
        if name in checked:
            continue
        try:
            scorer = get_turn_scorer(name)
        except ScorerError as error:
            raise ScorerError(f"{where}: {error}") from None
        try:
            rewards = [float(reward) for reward in scorer(probe, ["probe answer"])]
        except Exception as error:  # a user's function: whatever it raises is its defect, named here
            raise ScorerError(f"{where}: the turn scorer {name!r} failed on a probe trajectory of 3 turns: "
                              f"{type(error).__name__}: {error}") from error
        if len(rewards) != len(probe.turns) or not all(map(math.isfinite, rewards)):
            raise ScorerError(f"{where}: the turn scorer {name!r} gave {rewards} for a probe trajectory of 3 turns; "
                              "it must give one finite reward per turn")
        checked.add(name)


def score_turns(trajectories: Sequence[Trajectory], examples: Sequence[QAExample],
                config: RewardConfig) -> dict[str, float]:
    """Set the reward of every turn of the trajectories that did not fail (``examples[i]`` is the row of
    ``trajectories[i]``), with the row's turn scorer. Returns reward/turn_reward_mean and reward/rewarded_turns (the
    share of turns with a reward above 0), over those turns."""
    rewards = []
    for trajectory, example in zip(trajectories, examples, strict=True):
        if trajectory.failed:
            continue
        name = turn_scorer_name_for(example, config)
        scored = [float(reward) for reward in get_turn_scorer(name)(trajectory, example.golden_answers)]
        if len(scored) != len(trajectory.turns):
            raise ValueError(f"the turn scorer {name!r} gave {len(scored)} rewards for a trajectory of "
                             f"{len(trajectory.turns)} turns ({example.id!r}); it must give one per turn")
        for turn, reward in zip(trajectory.turns, scored):
            turn.reward = reward
        rewards += scored
    return {
        "reward/turn_reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward/rewarded_turns": sum(reward > 0 for reward in rewards) / len(rewards) if rewards else 0.0,
    }
