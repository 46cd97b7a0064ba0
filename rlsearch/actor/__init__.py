"""Megatron-core actor: model from HF via mbridge, logprobs and GRPO steps through the pipeline schedule.

`ActorRanks` (the ranks as Ray actors), `CriticRanks` (a critic's) and `stop_detached_ranks` are imported on first
use: a rank's worker runs without Ray too (the GPU benches start one in their own process where only torch and
Megatron are installed)."""

from .batch import TrainSample
from .distribution import MODEL_DISTRIBUTION, SamplingDistribution
from .worker import ActorWorkerSpec, MegatronActorWorker, RankInfo

__all__ = [
    "MODEL_DISTRIBUTION", "ActorRanks", "CriticRanks", "ActorWorkerSpec", "MegatronActorWorker", "RankInfo",
    "SamplingDistribution", "TrainSample", "stop_detached_ranks",
]


def __getattr__(name: str):
    if name in ("ActorRanks", "stop_detached_ranks"):
        from . import ranks

        return getattr(ranks, name)
    if name == "CriticRanks":
        from .critic import CriticRanks

        return CriticRanks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
