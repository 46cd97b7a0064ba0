"""Megatron actor (Ray, gloo) and vLLM engine: logprob parity, and a GRPO step the engine follows (the tests are in
actor_engine_cases.py, which test_tied_sync.py collects too), on the session's shared engine and actor ranks."""

from tests.integration.actor_engine_cases import (  # noqa: F401  (collected here, with the session's fixtures)
    test_actor_matches_hf_and_engine_logprobs,
    test_grpo_step_changes_weights_and_engine_follows,
)
