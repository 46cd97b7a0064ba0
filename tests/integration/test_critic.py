"""The critic (algo.advantage=gae): Megatron ranks of the policy's transformer with a value head, against HF
transformers' token-classification model of the same weights, across TP x PP x DP x CP layouts and recomputation,
exported as an HF token-classification dir that transformers loads with the same values, saved and resumed across
layouts, and converted from a run checkpoint (`rlsearch convert mcore-to-hf --critic`).

Every layout starts from the same HF weights and head (its own seed), scores the same packed batch and takes one
value-loss step on it. Layout runs are cached per module: each group of ranks starts once (the lane's rank pool)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rlsearch.actor import CriticRanks, TrainSample
from rlsearch.algo import loss_token_weights
from rlsearch.config import CriticConfig
from rlsearch.megatron.model import VALUE_HEAD, VALUE_HEAD_INIT_STD
from tests.integration.actor_helpers import actor_spec, scored_batch

VALUE_CLIP = CriticConfig(value_clip=0.2)
# name -> (tp, pp, dp, extra critic settings)
LAYOUTS = {
    "tp1": (1, 1, 1, {}),
    "tp2": (2, 1, 1, {}),
    "pp2": (1, 2, 1, {}),
    "dp2": (1, 1, 2, {"use_distributed_optimizer": True}),
    "cp2": (1, 1, 1, {"cp": 2}),  # each sequence split over two ranks: its values gathered back in token order
    "recompute": (1, 1, 1, {"recompute": "full"}),  # the value loss's backward through recomputed layers
}


@dataclass
class LayoutRun:
    values: list[list[float]]  # before the step
    metrics: dict[str, float]  # of the value-loss step
    trained: dict[str, torch.Tensor]  # the HF export after the step
    values_after: list[list[float]]
    checkpoint: Path  # the critic's state after the step
    transformer_impl: str  # the layer spec its ranks built


def critic_spec(model_dir, tp: int, pp: int, dp: int, extra: dict):
    return dataclasses.replace(actor_spec(model_dir, tp, pp, dp, extra), value_model=True)


def hf_values(model_dir, samples: list[TrainSample], head: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """transformers' token-classification model (one label) of `model_dir`: each response token's value (at the
    position before it), with `head` as its `score` (default: the model dir's own)."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32).eval()
    if head is not None:
        model.score.load_state_dict(head)
    with torch.no_grad():
        return [model(torch.tensor([s.token_ids])).logits[0, s.response_start - 1: -1, 0] for s in samples]


def initial_head(hidden_size: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """The value head a critic of `seed` starts with (rlsearch.megatron.model.ValueHead)."""
    weight = torch.randn((1, hidden_size), generator=torch.Generator().manual_seed(seed)) * VALUE_HEAD_INIT_STD
    return {"weight": weight, "bias": torch.zeros(1)}


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    """`scored_batch`'s samples with value targets and old values (the clip acts on some tokens), token-mean weights."""
    samples, _ = scored_batch(lambda s: [torch.zeros(s_.response_len) for s_ in s])
    generator = torch.Generator().manual_seed(5)
    weights = loss_token_weights([s.loss_mask for s in samples], "token_mean")
    for sample, w in zip(samples, weights):
        sample.returns = torch.randn(sample.response_len, generator=generator).tolist()
        sample.old_values = (0.3 * torch.randn(sample.response_len, generator=generator)).tolist()
        sample.token_weights = w
    return samples


@pytest.fixture(scope="module")
def run_layout(rank_pool, tiny_model_dir, batch, tmp_path_factory):
    cache: dict[str, LayoutRun] = {}

    def run(name: str) -> LayoutRun:
        if name not in cache:
            tp, pp, dp, extra = LAYOUTS[name]
            checkpoint = tmp_path_factory.mktemp(f"critic-{name}")
            with rank_pool.group(critic_spec(tiny_model_dir, tp, pp, dp, extra), CriticRanks) as group:
                values = group.compute_values(batch)
                metrics = group.value_step(batch, VALUE_CLIP)
                trained = group.hf_state_dict()
                values_after = group.compute_values(batch)
                group.save_checkpoint(str(checkpoint))
                impl = group.infos[0].transformer_impl
            cache[name] = LayoutRun(values, metrics, trained, values_after, checkpoint, impl)
        return cache[name]

    return run


def worst(a: list[list[float]], b) -> float:
    return max((torch.tensor(x) - torch.as_tensor(y)).abs().max().item() for x, y in zip(a, b))


def test_critic_values_equal_hf_token_classification_of_the_same_weights(run_layout, tiny_model_dir, batch):
    hidden = json.loads((Path(tiny_model_dir) / "config.json").read_text())["hidden_size"]
    reference = hf_values(tiny_model_dir, batch, initial_head(hidden))
    assert worst(run_layout("tp1").values, reference) < 1e-5
    assert max(abs(v) for row in run_layout("tp1").values for v in row) > 1e-3  # the head is no zero


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "tp1"])
def test_critic_layouts_give_the_values_and_step_of_tp1(run_layout, layout):
    baseline, result = run_layout("tp1"), run_layout(layout)
    assert worst(result.values, baseline.values) < 1e-5
    assert baseline.metrics["critic/value_clip_fraction"] > 0.05  # the clip acts on some tokens
    for key in ("critic/value_loss", "critic/value_clip_fraction", "critic/grad_norm", "critic/explained_variance"):
        assert result.metrics[key] == pytest.approx(baseline.metrics[key], abs=1e-5), key
    assert set(result.trained) == set(baseline.trained)
    assert max((result.trained[n] - baseline.trained[n]).abs().max().item() for n in baseline.trained) < 1e-5
    assert worst(result.values_after, baseline.values_after) < 1e-5
    assert worst(baseline.values_after, baseline.values) > 1e-4  # the step moved the values: agreeing means something


def test_critic_exports_an_hf_token_classification_model_transformers_loads(run_layout, rank_pool, tiny_model_dir,
                                                                            batch, tmp_path):
    from rlsearch.checkpoint.convert import write_hf_model

    run = run_layout("tp1")
    assert {f"{VALUE_HEAD}.weight", f"{VALUE_HEAD}.bias"} <= set(run.trained)
    assert not any(name.startswith("lm_head") for name in run.trained)  # the head replaced the output layer
    assert run.trained[f"{VALUE_HEAD}.weight"].shape[0] == 1
    out = write_hf_model(run.trained.items(), tmp_path / "critic-hf", tiny_model_dir)
    config = json.loads((out / "config.json").read_text())
    config.update(architectures=["Qwen2ForTokenClassification"], num_labels=1, tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config))
    assert worst(run.values_after, hf_values(out, batch)) < 1e-5
    # a critic started from that dir (critic.model.path) takes its head too: the trained values
    with rank_pool.group(critic_spec(out, 1, 1, 1, {}), CriticRanks) as group:
        assert worst(group.compute_values(batch), run.values_after) < 1e-5


def test_critic_checkpoint_resumes_into_another_layout(run_layout, rank_pool, tiny_model_dir, batch):
    saved = run_layout("tp2")
    with rank_pool.group(critic_spec(tiny_model_dir, 1, 1, 1, {}), CriticRanks) as group:
        assert worst(group.compute_values(batch), saved.values) < 1e-5  # fresh: the initial values
        group.load_checkpoint(str(saved.checkpoint), restore_rng=False)
        assert worst(group.compute_values(batch), saved.values_after) < 1e-5


def test_an_offloaded_critic_comes_back_bit_for_bit(run_layout, rank_pool, tiny_model_dir, batch):
    """critic.offload: weights, gradient buffers and Adam's states leave for host memory between uses and come back in
    place: the values and the step equal those of the critic that never left (the same layout, bit for bit)."""
    stayed = run_layout("tp1")
    parameters = sum(tensor.numel() * 4 for tensor in stayed.trained.values())  # float32
    with rank_pool.group(critic_spec(tiny_model_dir, 1, 1, 1, {}), CriticRanks) as group:
        assert group.offload() >= 2 * parameters  # the weights and their gradient buffer at least
        assert group.offload() == 0  # already in host memory
        assert group.compute_values(batch) == stayed.values
        group.offload()
        assert group.value_step(batch, VALUE_CLIP) == stayed.metrics
        assert group.offload() >= 4 * parameters  # and now Adam's two moments
        assert group.compute_values(batch) == stayed.values_after


def run_checkpoint_with_critic(run_dir: Path, saved: LayoutRun, model_dir, layout: tuple) -> Path:
    """A gae run's checkpoint as `save_run_checkpoint` writes it (manifest, trainer state, hf/), its critic part the
    critic state `saved`; the actor's part is left empty (the policy is not converted here)."""
    import shutil
    from types import SimpleNamespace

    from rlsearch.checkpoint import CheckpointStore
    from rlsearch.config import TrainConfig
    from rlsearch.trainer.checkpoints import save_run_checkpoint
    from rlsearch.trainer.sampler import SamplerState

    config = TrainConfig()
    config.model.path, config.model.dtype, config.algo.advantage = str(model_dir), "float32", "gae"
    actor = SimpleNamespace(save_checkpoint=lambda path, timeout_s: None,
                            infos=[SimpleNamespace(transformer_impl=saved.transformer_impl)])
    critic = SimpleNamespace(spec=critic_spec(model_dir, *layout),
                             save_checkpoint=lambda path, timeout_s: shutil.copytree(saved.checkpoint, path,
                                                                                     dirs_exist_ok=True))
    return save_run_checkpoint(config, actor, CheckpointStore(run_dir), 1, SamplerState(), critic)


def test_convert_writes_a_run_checkpoints_critic_as_hf_token_classification(run_layout, rank_pool, tiny_model_dir,
                                                                             batch, tmp_path):
    """`rlsearch convert mcore-to-hf --critic --verify` of a checkpoint whose critic was saved at TP2 after a step:
    the trained critic's tensors, exactly, as a token-classification model of one label that transformers loads with
    the critic's values, and that a critic started from it (critic.model.path) scores with its trained head."""
    import time

    from transformers import AutoConfig

    from rlsearch.checkpoint import read_manifest
    from tests.integration.convert_checks import assert_bit_exact, convert_cli, converted_tensors

    saved = run_layout("tp2")
    checkpoint = run_checkpoint_with_critic(tmp_path / "run", saved, tiny_model_dir, LAYOUTS["tp2"])
    assert "critic" in read_manifest(checkpoint)["contents"]
    out = tmp_path / "critic-hf"
    started = time.perf_counter()
    run = convert_cli("mcore-to-hf", "--ckpt", str(checkpoint), "--out", str(out), "--critic", "--verify")
    print(f"mcore-to-hf --critic --verify: {time.perf_counter() - started:.1f} s")
    assert run.returncode == 0, run.stderr
    assert f"wrote HuggingFace critic (token classification, one label) {out}" in run.stdout
    diff = float(run.stdout.split("max |value diff| vs Megatron ")[1].split()[0])
    assert diff < 1e-5
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["num_labels"], config["tie_word_embeddings"]) == (
        ["Qwen2ForTokenClassification"], 1, False)
    assert AutoConfig.from_pretrained(out).num_labels == 1
    tensors = converted_tensors(out)
    assert tensors[f"{VALUE_HEAD}.weight"].shape[0] == 1 and tensors[f"{VALUE_HEAD}.bias"].shape == (1,)
    assert_bit_exact(tensors, saved.trained)  # the trunk and the head the critic trained, no lm_head
    assert worst(saved.values_after, hf_values(out, batch)) < 1e-5
    with rank_pool.group(critic_spec(out, 1, 1, 1, {}), CriticRanks) as group:
        assert worst(group.compute_values(batch), saved.values_after) < 1e-5  # its trained head, not a fresh one
