"""trainer.loggers: [tensorboard, wandb]: an offline wandb run (WANDB_MODE=offline, nothing to reach) holds the run's
config, every scalar the TensorBoard events hold and each step's sample table.

wandb 0.31 ships no Python reader of a run's .wandb file (its datastore module is gone; `wandb.Api` needs the
server): the records are read here with wandb's own protobuf schema (`wandb_internal_pb2.Record`) from the log
framing wandb-core writes (a ":W&B" header, then LevelDB-log chunks in 32 KiB blocks)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from rlsearch.config import TrainConfig, to_dict
from rlsearch.runlog import read_scalars

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:_HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a .wandb log of the known format"
    records, pending, position = [], b"", _HEADER
    while position + _HEADER <= len(data):
        if _BLOCK - position % _BLOCK < _HEADER:  # a block's tail too short for a chunk header is padding
            position += _BLOCK - position % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + _HEADER])
        if position + _HEADER + length > len(data):  # a chunk still being written
            break
        chunk = data[position + _HEADER : position + _HEADER + length]
        position += _HEADER + length
        if kind in (_FULL, _FIRST):
            pending = chunk
        elif kind in (_MIDDLE, _LAST):
            pending += chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _items(items) -> dict:
    """wandb's key/value items as a dict; a nested key (a path) becomes nested dicts."""
    values: dict = {}
    for item in items:
        *parents, last = [item.key] if item.key else list(item.nested_key)
        node = values
        for parent in parents:
            node = node.setdefault(parent, {})
        node[last] = json.loads(item.value_json)
    return values


def complete_records(run_file: Path, timeout_s: float = 60.0) -> list:
    """The run file's records once its last, the exit record, is there: `run.finish()` returns when wandb-core has
    taken the exit, and its writer may flush the file's last block a moment later (on a loaded machine, after the
    test read it: the history records were missing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = wandb_records(run_file)
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        assert time.monotonic() < deadline, (f"{run_file} has no exit record {timeout_s:g} s after the run finished",
                                             [record.WhichOneof("record_type") for record in records])
        time.sleep(0.2)


def read_offline_run(output_dir: Path) -> tuple[dict, dict[str, list[tuple[int, float]]], dict[int, dict]]:
    """(config, scalars by key as (step, value), the non-scalar items of each step) of the run under output_dir."""
    (run_file,) = (output_dir / "wandb").glob("offline-run-*/run-*.wandb")
    config, scalars, others = {}, {}, {}
    for record in complete_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):
            config.update(_items((record.run.config if kind == "run" else record.config).update))
        elif kind == "history":
            items = _items(record.history.item)
            step = items.pop("_step")
            for key, value in items.items():
                if key.startswith("_"):
                    continue
                if isinstance(value, (int, float)):
                    scalars.setdefault(key, []).append((step, float(value)))
                else:
                    others.setdefault(step, {})[key] = value
    return config, scalars, others


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


def _record(step: int, sample: int, reward: float) -> dict:
    return {"example_id": f"q{step}", "sample_index": sample, "question": "Who founded Velmora?",
            "golden_answers": ["Ada Brun"], "reward": reward, "finish_reason": "answer", "num_turns": 2,
            "turns": [{"text": "<search> Velmora </search>", "observation": "<information>...</information>"},
                      {"text": "<answer> Ada Brun </answer>", "observation": None}]}


def test_wandb_offline_run_holds_the_config_and_the_scalars_tensorboard_holds(offline, tiny_model_dir, toy_data,
                                                                                tmp_path):
    from rlsearch.trainer.grpo import GRPOTrainer
    from rlsearch.trainer.step_log import new_logger

    config = TrainConfig()
    config.model.path = str(tiny_model_dir)
    config.data.train_files = [str(toy_data.train)]
    config.trainer.output_dir = str(tmp_path / "run")
    config.trainer.loggers = ["tensorboard", "wandb"]
    trainer = GRPOTrainer(config)  # loads the data and checks the model; starts nothing
    logger = new_logger(trainer.config, trainer.output_dir, resumed_step=0)
    steps = {1: {"reward/mean": 0.25, "actor/policy_loss": -0.125, "rollout/turns_mean": 2.0},
             2: {"reward/mean": 0.5, "actor/policy_loss": 0.0625, "rollout/turns_mean": 1.5,
                 "weights/nan": float("nan")}}
    for step, metrics in steps.items():
        logger.log_metrics(step, metrics)
        logger.log_trajectories(step, [_record(step, sample, metrics["reward/mean"]) for sample in range(2)])
    logger.close()

    run_dir = Path(config.trainer.output_dir)
    wandb_config, wandb_scalars, tables = read_offline_run(run_dir)
    tensorboard = read_scalars(run_dir / "tensorboard")
    assert wandb_scalars == tensorboard  # every scalar, every step (the NaN in neither)
    assert set(tensorboard) == {"reward/mean", "actor/policy_loss", "rollout/turns_mean"}
    expected = json.loads(json.dumps(to_dict(trainer.config)))
    assert {key: wandb_config[key] for key in expected} == expected  # the run's config, section by section
    assert wandb_config["trainer"]["loggers"] == ["tensorboard", "wandb"]
    # each step's sample table: a table file of the run with one row per sample
    assert sorted(tables) == [1, 2]
    table_path = next((run_dir / "wandb").glob("offline-run-*/files")) / tables[2]["samples"]["path"]
    table = json.loads(table_path.read_text())
    assert table["columns"][:3] == ["example_id", "sample_index", "question"]
    assert [row[:2] for row in table["data"]] == [["q2", 0], ["q2", 1]]
    assert table["data"][0][4] == ("<search> Velmora </search><information>...</information>"
                                   "<answer> Ada Brun </answer>")
