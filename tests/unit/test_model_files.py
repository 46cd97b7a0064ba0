"""A model dir's files are checked at start-up, before anything starts: an invalid config.json, a dir without tokenizer
files and a truncated safetensors file are each refused naming the file, and `rlsearch train` and `rlsearch eval` stop
with exit code 2 before Ray, the tool servers or any write to the run's dir, leaving the model dir as it was."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlsearch.cli import main
from rlsearch.config import ConfigError, check_model_files
from tests.constants import REPO_ROOT
from tests.models import linked_model

TRAIN_EXAMPLE = str(REPO_ROOT / "examples" / "configs" / "search_grpo_tiny.yaml")
EVAL_EXAMPLE = str(REPO_ROOT / "examples" / "configs" / "eval_search.yaml")


def _invalid_config_json(tiny_model_dir: Path, tmp_path: Path) -> tuple[Path, str]:
    model = linked_model(tiny_model_dir, tmp_path / "model", but=("config.json",))
    (model / "config.json").write_text('{"model_type": "qwen2",\n  "hidden_size": 128,\n}\n')
    return model, (f"{model / 'config.json'} is not valid JSON: Expecting property name enclosed in double quotes at "
                   "line 3, column 1; restore the file (e.g. from the model's download)")


def _no_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> tuple[Path, str]:
    model = linked_model(tiny_model_dir, tmp_path / "model", but=("tokenizer.json", "tokenizer_config.json"))
    return model, (f"'model.path' ({model}) has no tokenizer: none of tokenizer.json, tokenizer.model, vocab.json "
                   "with merges.txt; copy the tokenizer files of the model it was made from into it")


def _truncated_safetensors(tiny_model_dir: Path, tmp_path: Path) -> tuple[Path, str]:
    model = linked_model(tiny_model_dir, tmp_path / "model", but=("model.safetensors",))
    whole = (tiny_model_dir / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    return model, (f"{model / 'model.safetensors'} is truncated: {len(whole) // 2:,} bytes, and its header's tensors "
                   f"end at byte {len(whole):,}; download or convert it again")


BROKEN = {"invalid config.json": _invalid_config_json, "no tokenizer": _no_tokenizer,
          "truncated safetensors": _truncated_safetensors}


@pytest.mark.parametrize("broken", BROKEN.values(), ids=BROKEN.keys())
def test_a_broken_model_dir_is_refused_naming_the_file(tiny_model_dir, tmp_path, broken):
    check_model_files(str(tiny_model_dir))  # the whole model passes
    model, message = broken(tiny_model_dir, tmp_path)
    with pytest.raises(ConfigError) as refused:
        check_model_files(str(model))
    assert str(refused.value) == message


def test_what_else_a_model_dir_can_lack_is_named(tiny_model_dir, tmp_path):
    vocab_only = linked_model(tiny_model_dir, tmp_path / "vocab", but=("tokenizer.json",))
    (vocab_only / "vocab.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"has no tokenizer: .* \(only vocab\.json\); copy"):
        check_model_files(str(vocab_only))
    no_weights = linked_model(tiny_model_dir, tmp_path / "bare", but=("model.safetensors",))
    with pytest.raises(ConfigError, match=re.escape(f"'model.path' ({no_weights}) holds no *.safetensors file")):
        check_model_files(str(no_weights))
    sharded = linked_model(tiny_model_dir, tmp_path / "sharded")
    index = sharded / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ConfigError, match=re.escape(
            f"{index} names 1 shard(s) that are not there: model-00002-of-00002.safetensors")):
        check_model_files(str(sharded))


def _files(model: Path) -> dict[str, tuple[int, int]]:
    return {path.name: (path.stat().st_size, path.stat().st_mtime_ns) for path in model.iterdir()}


@pytest.mark.parametrize("broken", BROKEN.values(), ids=BROKEN.keys())
def test_train_and_eval_stop_naming_the_file_before_anything_starts(tiny_model_dir, toy_data, tmp_path, capsys,
                                                                    nothing_may_start, broken):
    model, message = broken(tiny_model_dir, tmp_path)
    before = _files(model)
    run_dir = tmp_path / "run"
    train = ["train", "--config", TRAIN_EXAMPLE, f"model.path={model}", f"data.train_files=[{toy_data.train}]",
             f"tools.retriever.corpus={toy_data.corpus}", f"trainer.output_dir={run_dir}"]
    evaluate = ["eval", "--config", EVAL_EXAMPLE, f"model.path={model}", f"eval.files=[{toy_data.test}]",
                f"tools.retriever.corpus={toy_data.corpus}", f"output_dir={run_dir}"]
    for command in (train, [*train, "--restarts", "1"], evaluate):
        assert main(command) == 2
        assert capsys.readouterr().err == f"rlsearch {command[0]}: {message}\n"
        assert not run_dir.exists()  # not even the run's logs dir
    assert _files(model) == before
