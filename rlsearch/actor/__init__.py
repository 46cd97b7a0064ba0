"""Megatron-core actor: model from HF via mbridge, logprobs and GRPO steps through the pipeline schedule."""

from .batch import TrainSample
from .group import ActorGroup
from .worker import ActorWorkerSpec, MegatronActorWorker, RankInfo

__all__ = ["ActorGroup", "ActorWorkerSpec", "MegatronActorWorker", "RankInfo", "TrainSample"]
