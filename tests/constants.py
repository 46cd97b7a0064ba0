"""Constants the tests share: the repository's root, the drivers' turn length, the test engines' settings."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# The training runs of the random-init model (tests/e2e, tests/faults, test_multinode): its turns mostly run to the
# token limit, and 24 tokens a turn instead of the tiny config's 48 take a step from 4.5 s to 2.5 s here (rollout,
# logprobs and training all scale with the sampled tokens) while every step still has searches, invalid calls and
# truncations
SHORT_TURNS = "rollout.max_tokens_per_turn=24"

TEST_KV_CACHE_GIB = 0.25  # each test engine's KV cache: plenty for the tiny model, 0.75 GiB of host memory less
TEST_ROLLOUT = {
    "max_turns": 3, "max_response_tokens": 256, "max_tokens_per_turn": 48, "assistant_prefix": "<search>",
    "logit_bias": {"</search>": 12.0},
}
