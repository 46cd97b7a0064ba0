"""The trainer composes actor, rollout, bridge, tools, reward and algo into the GRPO loop."""

from .grpo import GRPOTrainer, RunSummary
from .ray_setup import init_ray
from .sampler import EpochSampler, SamplerState

__all__ = ["EpochSampler", "GRPOTrainer", "RunSummary", "SamplerState", "init_ray"]
