"""rlsearch: reinforcement learning for LLM search agents (Megatron-core actor, vLLM rollout, Ray)."""

import time

__version__ = "0.1.0"
# when rlsearch started in this process: the process itself may be older, a script's that exec'd it (run_search_grpo.sh
# makes its SFT warm start first)
STARTED_AT = time.time()
