"""The distribution the actor scores tokens under: the one the rollout engine sampled them from.

vLLM (with ``logprobs_mode="processed_logprobs"``) samples from, and reports logprobs of,
``log_softmax((logits + logit_bias) / temperature)``; the actor computes exactly that, so importance weights and the
KL compare like with like. top-p / top-k masks are not reproduced: training refuses them (rlsearch.config).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingDistribution:
    temperature: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias added to its logit

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"a sampled distribution needs temperature > 0; got {self.temperature}")

    def bias_shard(self, vocab_start: int, vocab_end: int, device: torch.device) -> torch.Tensor | None:
        """The bias over the vocabulary slice [vocab_start, vocab_end) (a tensor-parallel rank's logits); None when
        no biased token falls in it."""
        local = {token - vocab_start: bias for token, bias in self.logit_bias.items()
                 if vocab_start <= token < vocab_end}
        if not local:
            return None
        shard = torch.zeros(vocab_end - vocab_start, dtype=torch.float32, device=device)
        shard[torch.tensor(list(local), device=device)] = torch.tensor(list(local.values()), device=device)
        return shard

    def describe(self) -> str:
        bias = f", logit bias on {len(self.logit_bias)} token(s)" if self.logit_bias else ""
        return f"temperature {self.temperature:g}{bias}"


MODEL_DISTRIBUTION = SamplingDistribution()  # the model's own: temperature 1, no bias (supervised training)
