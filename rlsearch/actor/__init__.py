"""Megatron-core actor: model from HF via mbridge, logprobs and GRPO steps through the pipeline schedule."""

from .batch import TrainSample
from .distribution import MODEL_DISTRIBUTION, SamplingDistribution
from .group import ActorGroup
from .worker import ActorWorkerSpec, MegatronActorWorker, RankInfo

__all__ = [
    "MODEL_DISTRIBUTION", "ActorGroup", "ActorWorkerSpec", "MegatronActorWorker", "RankInfo", "SamplingDistribution",
    "TrainSample",
]
