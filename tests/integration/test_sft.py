"""`rlsearch sft` on the real Megatron actor (gloo): the loss it reports is HF transformers' NLL of the same tokens,
and the model it writes is one vLLM-compatible HF dir that fits the demonstrations better than the model it started
from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlsearch.config import ActorConfig, SFTConfig, SFTDataConfig
from rlsearch.data import make_toy_data
from rlsearch.data.chat import load_chat_dataset
from rlsearch.data.demos import bm25_search, write_demonstrations
from rlsearch.runlog import read_scalars
from rlsearch.trainer import EpochSampler, run_sft

STEPS = 6
BATCH = 4


def _mean_nll(model, examples) -> float:
    """Token-mean negative log-likelihood of the examples' assistant tokens under an HF model (fp32)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            ids = torch.tensor([example.token_ids])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            targets = ids[0, 1:]
            token_logprobs = logprobs.gather(1, targets[:, None])[:, 0][example.response_start - 1:]
            mask = torch.tensor(example.loss_mask, dtype=torch.float)
            total += float(-(token_logprobs * mask).sum())
            count += int(mask.sum())
    return total / count


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> Path:
    toy = make_toy_data(tmp_path_factory.mktemp("sft_toy"), seed=2, num_entities=20, learnable=True)
    return write_demonstrations(toy.train, toy.train.parent / "sft.jsonl", bm25_search(toy.corpus), topk=1,
                                flawed_fraction=0.25).path


def test_sft_loss_is_hf_nll_and_the_model_learns(ray_local, tiny_model_dir: Path, demos: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = SFTConfig(
        data=SFTDataConfig(train_files=[str(demos)], batch_size=BATCH, max_steps=STEPS),
        actor=ActorConfig(lr=2e-3), output_dir=str(tmp_path / "sft"), seed=3, log_interval=2,
    )
    config.model.path = str(tiny_model_dir)
    summary = run_sft(config)

    examples = load_chat_dataset(demos, AutoTokenizer.from_pretrained(tiny_model_dir), max_tokens=2048)
    first_batch = EpochSampler(examples, seed=3).next_batch(BATCH)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    # the first step's loss is computed on the initial weights: Megatron's packed forward equals HF's NLL
    assert summary.first_loss == pytest.approx(_mean_nll(initial, first_batch), abs=1e-5)

    tuned = AutoModelForCausalLM.from_pretrained(summary.model_dir, dtype=torch.float32)
    before, after = _mean_nll(initial, examples), _mean_nll(tuned, examples)
    assert after < before - 0.5, (before, after)
    assert summary.model_dir == tmp_path / "sft" / "hf"
    assert json.loads((summary.model_dir / "config.json").read_text())["model_type"] == "qwen2"
    assert (summary.model_dir / "tokenizer.json").is_file()

    losses = read_scalars(tmp_path / "sft" / "tensorboard")["sft/loss"]
    assert [step for step, _ in losses] == list(range(1, STEPS + 1))
    assert losses[0][1] == pytest.approx(summary.first_loss, rel=1e-5)
    assert summary.curves == tmp_path / "sft" / "tensorboard" / "curves.png" and summary.curves.is_file()
    assert f"loss {summary.first_loss:.3f} -> {summary.last_loss:.3f}" in summary.render()


def test_sft_refuses_an_output_dir_with_a_model(tiny_model_dir: Path, demos: Path, tmp_path: Path) -> None:
    from rlsearch.config import ConfigError

    (tmp_path / "sft" / "hf").mkdir(parents=True)
    (tmp_path / "sft" / "hf" / "config.json").write_text("{}")
    config = SFTConfig(data=SFTDataConfig(train_files=[str(demos)]), output_dir=str(tmp_path / "sft"))
    config.model.path = str(tiny_model_dir)
    with pytest.raises(ConfigError, match="already holds a fine-tuned model"):
        run_sft(config)
