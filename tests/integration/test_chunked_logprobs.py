"""Chunked token logprobs (rlsearch.actor.logits) give the numbers of scoring the full logits: logprobs, entropy and
the gradients w.r.t. the hidden states and the output-layer weight (own, or tied and passed in), at TP1 and TP2,
under a temperature and a logit bias on tokens in both TP halves; and those numbers are a plain full-vocabulary
float64 log_softmax's.

Two rank processes on gloo over the real vocabulary size (151936) with a small hidden size; they score at TP2 (own
weight, then tied), then re-form as TP1 (two data-parallel replicas) and score with the own weight."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.integration.rank_processes import run_rank_processes

VOCAB = 151936
HIDDEN = 64
POSITIONS = 150  # chunks of 7 end in a partial chunk of 3, chunks of 64 in one of 22
CHUNK_SIZES = (7, 64)
TEMPERATURE = 0.7
LOGIT_BIAS = {11: 6.0, VOCAB - 5: -3.0, VOCAB // 2 + 17: 4.0}  # in TP rank 0's half, and twice in rank 1's
# max |difference| per quantity (|logprob| <= 22, entropy <= 11, |gradients| <= 5), measured in parentheses.
# Chunked vs unchunked: logprobs and entropy are bit-identical (0). Gradients are float32 sums in another order:
# weight (3.8e-6); hidden (6.6e-5): its [chunk, vocab] @ [vocab, h] product sums over 151936 terms, and MKL's sgemm
# sums less accurately for the rows of a small matrix past its last multiple of 4 (plain torch autograd chunked by 7
# shows the same; 64-row chunks give bit-identical gradients).
CHUNKED_TOLERANCE = {"logprobs": 1e-6, "entropy": 1e-6, "weight_grad": 1e-5, "hidden_grad": 2e-4}
# TP2 vs TP1 (logprobs/entropy 1.9e-6, one float32 ulp at 21), and vs the float64 reference (1.3e-6 / 2.0e-6)
TOLERANCE = {"logprobs": 1e-5, "entropy": 1e-5, "weight_grad": 1e-5, "hidden_grad": 2e-4}


def _inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, VOCAB, (POSITIONS,), generator=generator)
    labels[::10] = torch.tensor(list(LOGIT_BIAS))[torch.arange(0, POSITIONS, 10) % len(LOGIT_BIAS)]
    return {
        # dyadic values (k/8, k/16): every logit is exact in float32 whatever order a matmul sums in, so the forward
        # numbers differ only if the chunking does (the BLAS picks other kernels for other row counts)
        "hidden": torch.randint(-8, 9, (POSITIONS, HIDDEN), generator=generator) / 8,
        "weight": torch.randint(-8, 9, (VOCAB, HIDDEN), generator=generator) / 16,
        "labels": labels,
        "loss_weights": torch.randn(POSITIONS, generator=generator),  # d loss / d logprob, different per position
    }


def _rank_main(rank: int, rendezvous: str, out_dir: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: before anything initialises CUDA
    torch.set_num_threads(1)  # two ranks share the cores
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rlsearch.megatron.parallel import init_megatron_parallel

    init_megatron_parallel(rank, 2, rendezvous, tp=2, backend="gloo")
    results = {2: _score_cases(tied_cases=(False, True))}
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    results[1] = _score_cases(tied_cases=(False,))
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _score_cases(tied_cases: tuple[bool, ...]) -> dict[tuple[bool, int | str], dict[str, torch.Tensor]]:
    """(tied, chunk_tokens) -> logprobs, entropy and full-vocabulary gradients, on this rank's TP layout; and
    (tied, "no_grad"): logprobs and entropy of a chunked pass without autograd."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    from rlsearch.actor.distribution import SamplingDistribution
    from rlsearch.actor.logits import token_logprobs

    inputs = _inputs()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    partition = VOCAB // tp
    shard = inputs["weight"][tp_rank * partition:(tp_rank + 1) * partition]
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, gradient_accumulation_fusion=False,
    )
    distribution = SamplingDistribution(TEMPERATURE, LOGIT_BIAS)
    results = {}
    for tied in tied_cases:
        layer = ColumnParallelLinear(
            HIDDEN, VOCAB, config=config, init_method=torch.nn.init.zeros_, bias=False, skip_bias_add=False,
            gather_output=False, skip_weight_param_allocation=tied,
        )
        weight = torch.nn.Parameter(shard.clone()) if tied else None
        if not tied:
            layer.weight.data.copy_(shard)
        trained = weight if tied else layer.weight
        for chunk_tokens in (0, *CHUNK_SIZES):
            hidden = inputs["hidden"].clone().requires_grad_()
            logprobs, entropy = token_logprobs(
                hidden, layer, weight, inputs["labels"], distribution, chunk_tokens, with_entropy=True
            )
            assert logprobs.dtype == entropy.dtype == torch.float32 and not entropy.requires_grad
            (logprobs * inputs["loss_weights"]).sum().backward()
            weight_grads = [torch.empty_like(trained.grad) for _ in range(tp)]
            dist.all_gather(weight_grads, trained.grad, group=ps.get_tensor_model_parallel_group())
            results[tied, chunk_tokens] = {
                "logprobs": logprobs.detach(), "entropy": entropy, "hidden_grad": hidden.grad,
                "weight_grad": torch.cat(weight_grads),
            }
            trained.grad = None
        with torch.no_grad():
            logprobs, entropy = token_logprobs(
                inputs["hidden"], layer, weight, inputs["labels"], distribution, CHUNK_SIZES[0], with_entropy=True
            )
        results[tied, "no_grad"] = {"logprobs": logprobs, "entropy": entropy}
    return results


def _reference(temperature: float, logit_bias: dict[int, float], grads: bool = True) -> dict[str, torch.Tensor]:
    """The same numbers from plain float64 torch over the full vocabulary on one process."""
    inputs = {key: value.double() if value.is_floating_point() else value for key, value in _inputs().items()}
    hidden = inputs["hidden"].clone().requires_grad_(grads)
    weight = inputs["weight"].clone().requires_grad_(grads)
    bias = torch.zeros(VOCAB, dtype=torch.float64)
    bias[list(logit_bias)] = torch.tensor(list(logit_bias.values()), dtype=torch.float64)
    logp = torch.log_softmax((hidden @ weight.T + bias) / temperature, dim=-1)
    logprobs = logp[torch.arange(POSITIONS), inputs["labels"]]
    entropy = -(logp.exp() * logp).sum(dim=-1)
    if not grads:
        return {"logprobs": logprobs, "entropy": entropy}
    (logprobs * inputs["loss_weights"]).sum().backward()
    return {"logprobs": logprobs.detach(), "entropy": entropy.detach(), "hidden_grad": hidden.grad,
            "weight_grad": weight.grad}


def _max_diff(value: torch.Tensor, expected: torch.Tensor) -> float:
    assert value.shape == expected.shape
    return (value.to(expected.dtype) - expected).abs().max().item()


@pytest.fixture(scope="module")
def scored(module_tmp) -> dict[int, dict]:
    """tp -> `_score_cases`'s results."""
    out_dir = module_tmp.mktemp("chunked_logprobs")
    run_rank_processes(_rank_main, 2, str(out_dir))
    return torch.load(out_dir / "results.pt")


@pytest.mark.parametrize("tp, tied", [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2_tied"])
def test_chunked_matches_unchunked(scored, tp, tied):
    unchunked = scored[tp][tied, 0]
    for chunk_tokens in (*CHUNK_SIZES, "no_grad"):
        for key, value in scored[tp][tied, chunk_tokens].items():
            assert _max_diff(value, unchunked[key]) <= CHUNKED_TOLERANCE[key], (chunk_tokens, key)


def test_tp2_and_tied_weight_match_tp1(scored):
    for chunk_tokens in (0, *CHUNK_SIZES):
        tp1 = scored[1][False, chunk_tokens]
        for tied in (False, True):
            for key, value in scored[2][tied, chunk_tokens].items():
                assert _max_diff(value, tp1[key]) <= TOLERANCE[key], (tied, chunk_tokens, key)


def test_matches_full_vocabulary_torch_reference(scored):
    reference = _reference(TEMPERATURE, LOGIT_BIAS)
    for tp, cases in scored.items():
        for (tied, chunk_tokens), case in cases.items():
            for key, value in case.items():
                assert _max_diff(value, reference[key]) <= TOLERANCE[key], (tp, tied, chunk_tokens, key)

    # the reference tells the sampled distribution from the model's own and from the unbiased one
    for other in (_reference(1.0, {}, grads=False), _reference(TEMPERATURE, {}, grads=False)):
        for key in ("logprobs", "entropy"):
            assert _max_diff(other[key], reference[key]) > 100 * TOLERANCE[key]
