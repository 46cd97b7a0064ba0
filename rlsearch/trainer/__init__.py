"""The trainer composes actor, rollout, bridge, tools, reward and algo into the GRPO loop."""

from ..ray_setup import init_ray
from ..runlog import RunSummary
from .grpo import GRPOTrainer
from .mismatch_gate import RolloutMismatchError
from .recovery import WorkerDiedError
from .sampler import EpochSampler, SamplerState
from .sft import SFTSummary, run_sft
from .skip_guard import NonFiniteStepsError

__all__ = [
    "EpochSampler", "GRPOTrainer", "NonFiniteStepsError", "RolloutMismatchError", "RunSummary", "SFTSummary",
    "SamplerState", "WorkerDiedError", "init_ray", "run_sft",
]
