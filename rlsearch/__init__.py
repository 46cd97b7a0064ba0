"""rlsearch: reinforcement learning for LLM search agents (Megatron-core actor, vLLM rollout, Ray)."""

__version__ = "0.1.0"
