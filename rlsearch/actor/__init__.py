"""Megatron-core actor: model from HF via mbridge, logprobs and GRPO steps through the pipeline schedule."""

from .batch import TrainSample
from .distribution import MODEL_DISTRIBUTION, SamplingDistribution
from .ranks import ActorRanks
from .worker import ActorWorkerSpec, MegatronActorWorker, RankInfo

__all__ = [
    "MODEL_DISTRIBUTION", "ActorRanks", "ActorWorkerSpec", "MegatronActorWorker", "RankInfo", "SamplingDistribution",
    "TrainSample",
]
