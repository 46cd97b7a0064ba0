"""Rollout: vLLM engines, the multi-turn tool-use agent loop and the Trajectory contract."""

from .agent_loop import AgentLoop, PromptItem, request_seed
from .engine import EngineSpec, VLLMEngine, configure_vllm_environment
from .trajectory import ToolCallRecord, Trajectory, Turn
from .worker import RolloutWorker

__all__ = [
    "AgentLoop", "EngineSpec", "PromptItem", "RolloutWorker", "ToolCallRecord", "Trajectory", "Turn", "VLLMEngine",
    "configure_vllm_environment", "request_seed",
]
