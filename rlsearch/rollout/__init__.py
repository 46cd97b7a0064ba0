"""Rollout: vLLM engines, the multi-turn tool-use agent loop and the Trajectory contract."""

from ..trajectory import ToolCallRecord, Trajectory, Turn
from .agent_loop import AgentLoop, PromptItem, request_seed, token_logit_bias
from .engine import EngineSpec, VLLMEngine, configure_vllm_environment, fork_vllm_processes_in_this_process
from .frozen import FrozenEngine, FrozenJudge, start_frozen_judge, start_frozen_summariser
from .pool import EnginePool, NoEngineLeftError, dispatch_groups, new_rollout_worker, stop_detached_engines
from .startup import start_engines, start_tool_servers
from .worker import RolloutWorker

__all__ = [
    "AgentLoop", "EnginePool", "EngineSpec", "FrozenEngine", "FrozenJudge", "NoEngineLeftError", "PromptItem",
    "RolloutWorker", "ToolCallRecord", "Trajectory", "Turn", "VLLMEngine", "configure_vllm_environment",
    "dispatch_groups", "fork_vllm_processes_in_this_process", "new_rollout_worker", "request_seed", "start_engines",
    "start_frozen_judge", "start_frozen_summariser", "start_tool_servers", "stop_detached_engines",
    "token_logit_bias",
]
