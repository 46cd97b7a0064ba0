"""The memory check at the start of `rlsearch train`: a run whose plan does not fit the memory given stops with exit
code 2 and what would fit, before Ray, the tool servers or any actor start; trainer.memory_check=warn runs past it;
`rlsearch plan` prints the plan and proposes layouts. Each part the run starts is planned where it runs: on a GPU
host (its GPU faked where the driver reads it, NVML) the ranks, the engines and the summariser's frozen engine on
GPUs, and their processes, a prebuilt index and its encoder, the driver and Ray in the host's memory; a CPU cluster
joined with trainer.ray_address once Ray has joined it (its devices unknown before). A remote retriever that does
not answer stops the run before Ray too."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rlsearch.cli import main
from rlsearch.config import ConfigError, load_train_config
from rlsearch.memory import (
    GB,
    QUIET_BELOW,
    Device,
    ModelShape,
    check_train_memory,
    plan_memory,
    plan_train_config,
    train_memory_inputs,
    waits_for_cluster,
)
from tests.constants import REPO_ROOT
from tests.drivers import Started
from tests.integration.threaded_server import closed_port

EXAMPLE = str(REPO_ROOT / "examples" / "configs" / "search_grpo_tiny.yaml")
LONG = 131_072  # a context window whose activations do not fit the memory the tests give


def _overrides(tiny_model_dir, toy_data, tmp_path) -> list[str]:
    return [f"model.path={tiny_model_dir}", f"data.train_files=[{toy_data.train}]",
            f"tools.retriever.corpus={toy_data.corpus}", f"trainer.output_dir={tmp_path / 'run'}",
            f"rollout.context_window={LONG}", f"actor.max_tokens_per_microbatch={LONG}"]


def test_a_dead_remote_retriever_stops_the_run_before_ray(tiny_model_dir, toy_data, tmp_path, capsys, monkeypatch):
    """tools.retriever.url that nothing answers: exit code 2 naming the key and what to do, before Ray starts."""
    import rlsearch.trainer.startup

    def started(*_args, **_kwargs):
        raise Started

    monkeypatch.setattr(rlsearch.trainer.startup, "init_ray", started)
    dead = f"http://127.0.0.1:{closed_port()}"
    code = main(["train", "--config", EXAMPLE, "--verbose", f"model.path={tiny_model_dir}",
                 f"data.train_files=[{toy_data.train}]", f"trainer.output_dir={tmp_path / 'run'}",
                 f"tools.retriever.url={dead}", "tools.retriever.max_retries=0"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"'tools.retriever.url' is {dead}, but a test search there failed: {dead}/retrieve failed after 1 " in err


def _memory_between_full_and_the_rest(overrides: list[str]) -> float:
    """GB of host memory in which this config fits with full recomputation and not without it (nor selective)."""
    config = load_train_config(EXAMPLE, overrides)
    inputs = train_memory_inputs(config, Device("cpu", 1e15, "any"))

    def needed(recompute: str) -> float:
        return plan_memory(dataclasses.replace(inputs, actor=dataclasses.replace(
            inputs.actor, recompute=recompute))).needed

    low, high = needed("full"), min(needed("selective"), needed("none"))
    assert low < high
    return (low + high) / 2 / GB


def test_a_run_that_does_not_fit_stops_before_anything_starts(tiny_model_dir, toy_data, tmp_path, capsys,
                                                              nothing_may_start):
    overrides = _overrides(tiny_model_dir, toy_data, tmp_path)
    memory = _memory_between_full_and_the_rest(overrides)
    code = main(["train", "--config", EXAMPLE, "--verbose", *overrides, f"trainer.device_memory_gb={memory}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "the memory plan does not fit: needs " in err, err
    assert f"of host memory at {LONG:,} tokens of {memory:,.2f} GB (host memory, trainer.device_memory_gb)" in err
    assert "; with actor.recompute=full, " in err and "trainer.memory_check=warn runs it anyway" in err
    assert "verdict : does NOT fit" in err  # the plan itself follows the message
    # the same under the supervisor (train --restarts): stopped before it starts a driver or Ray
    code = main(["train", "--config", EXAMPLE, "--verbose", "--restarts", "1", *overrides,
                 f"trainer.device_memory_gb={memory}"])
    assert code == 2 and "; with actor.recompute=full, " in capsys.readouterr().err


def test_memory_check_warn_runs_past_it_and_fits_with_the_suggested_change(tiny_model_dir, toy_data, tmp_path,
                                                                          capsys, nothing_may_start):
    from rlsearch.trainer import GRPOTrainer

    overrides = _overrides(tiny_model_dir, toy_data, tmp_path)
    memory = _memory_between_full_and_the_rest(overrides)
    config = load_train_config(EXAMPLE, [*overrides, f"trainer.device_memory_gb={memory}",
                                         "trainer.memory_check=warn"])
    with pytest.raises(Started):  # the next start-up phase: the tool servers start
        GRPOTrainer(config).train()
    out = capsys.readouterr().out
    assert "[rlsearch] warning: the memory plan does not fit: needs " in out
    assert "(trainer.memory_check=warn: running anyway)" in out
    config = load_train_config(EXAMPLE, [*overrides, f"trainer.device_memory_gb={memory}", "actor.recompute=full"])
    with pytest.raises(Started):
        GRPOTrainer(config).train()
    out = capsys.readouterr().out
    assert "warning" not in out, out
    fitting = plan_train_config(config)
    # between full recomputation's need and the others' it fits with little to spare (94%), which start-up says
    assert fitting.fits and fitting.needed >= QUIET_BELOW * fitting.inputs.device.memory
    assert f"[rlsearch] memory plan: {fitting.headline()} of {memory:,.1f} GB: fits" in out, out
    # with twice the memory it fits within QUIET_BELOW of it: start-up says nothing of the plan
    config = load_train_config(EXAMPLE, [*overrides, f"trainer.device_memory_gb={2 * memory}", "actor.recompute=full"])
    with pytest.raises(Started):
        GRPOTrainer(config).train()
    assert "[rlsearch] memory plan" not in capsys.readouterr().out


def test_rlsearch_plan_prints_the_plan_and_proposes_layouts(tmp_path, capsys):
    seven_b = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
               "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152_064,
               "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(seven_b))
    overrides = [f"model.path={tmp_path}", "model.dtype=bfloat16", "rollout.context_window=32768",
                 "actor.max_tokens_per_microbatch=32768"]
    assert main(["plan", "--config", EXAMPLE, *overrides, "--gpu-memory-gb", "80"]) == 2
    out = capsys.readouterr().out
    assert "verdict : does NOT fit" in out and "what would fit: needs " in out and "with actor.recompute=full" in out
    assert main(["plan", "--config", EXAMPLE, *overrides, "--gpu-memory-gb", "80", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    proposals = out.split("then no offloading):")[1].strip().splitlines()
    assert proposals and all(" GB per GPU  actor." in line for line in proposals)
    assert "actor.dp=8" in proposals[0]


H200 = ("NVIDIA H200", 150_000_000_000)  # what NVML reports of the faked GPU: its name and memory in bytes


@pytest.fixture
def driver_host(monkeypatch):
    """The driver's machine at the boundary it is read through: `set(gpu, host_memory)` makes NVML report `gpu`
    (None: no GPU) and the host `host_memory` bytes. torch.cuda is never to be asked: it would start CUDA in the
    driver."""
    import torch

    import rlsearch.memory.check as check

    def started_cuda(*_args, **_kwargs):
        raise AssertionError("the driver asked torch.cuda for its GPU, which starts CUDA in the driver")

    monkeypatch.setattr(torch.cuda, "get_device_properties", started_cuda)

    def set_machine(gpu: tuple[str, int] | None, host_memory: float) -> None:
        monkeypatch.setattr(check, "local_gpu_index", lambda: None if gpu is None else 0)
        monkeypatch.setattr(check, "gpu_name_and_memory", lambda index: gpu, raising=False)
        monkeypatch.setattr(check, "host_memory", lambda: host_memory)

    return set_machine


def _prebuilt_index(corpus, path) -> int:
    """A Flat inner-product index over the corpus's rows (random 384-dimensional vectors, all-MiniLM-L6-v2's width);
    its size on disk."""
    import faiss
    import numpy as np

    rows = len(corpus.read_text().splitlines())
    index = faiss.IndexFlatIP(384)
    index.add(np.random.default_rng(0).standard_normal((rows, 384), dtype=np.float32))
    faiss.write_index(index, str(path))
    return path.stat().st_size


def test_a_gpu_host_plans_each_part_of_the_run_where_it_runs(tiny_model_dir, toy_data, tmp_path, driver_host):
    from rlsearch.tools.servers.dense import default_encoder_path

    encoder = default_encoder_path()
    index_bytes = _prebuilt_index(toy_data.corpus, tmp_path / "toy_Flat.index")
    encoder_bytes = sum(path.stat().st_size for path in Path(encoder).glob("*.safetensors"))
    config = load_train_config(EXAMPLE, [
        f"model.path={tiny_model_dir}", f"data.train_files=[{toy_data.train}]",
        f"tools.retriever.corpus={toy_data.corpus}", f"trainer.output_dir={tmp_path / 'run'}",
        f"tools.retriever.index={tmp_path / 'toy_Flat.index'}", "tools.retriever.backend=dense",
        f"tools.retriever.encoder={encoder}",
        "tools.enabled=[search,browse]", f"tools.browse.summariser.engine={tiny_model_dir}",
        f"reward.judge.engine={tiny_model_dir}", "reward.judge.engine_max_model_len=2048",
    ])
    driver_host(H200, 2e12)
    plan = plan_train_config(config)
    coefficients = plan.coefficients
    assert plan.inputs.device == Device("gpu", H200[1], "NVIDIA H200")
    assert plan.host == Device("cpu", 2e12, "this machine")
    # the GPUs: the rank and the engine worker each on its own, the summariser's and the judge's frozen engines
    # (float32) each on its own, the judge's KV cache needed for its shorter window
    summariser, judge = plan.frozen
    for engine in (summariser, judge):
        assert engine.weights == ModelShape.from_model_dir(tiny_model_dir).total_parameters() * 4
        assert engine.limit == 0.85 * H200[1]
        assert engine.kv_cache == engine.limit - engine.weights - engine.runtime
    assert judge.kv_needed * 2 == summariser.kv_needed < summariser.kv_cache and plan.frozen_fits
    assert [settings.name for settings in plan.inputs.run.frozen] == ["summariser", "judge"]
    # the host: every process's host side, the prebuilt index and the encoder by their size on disk
    parts = {part.name: part.memory for part in plan.host_parts}
    assert list(parts) == ["actor ranks", "rollout engines", "rollout workers", "summariser", "judge", "Ray",
                           "tool server", "driver"]
    assert parts == {
        "actor ranks": coefficients.rank_host, "rollout engines": coefficients.engine_host,
        "rollout workers": coefficients.engine_driver,
        "summariser": coefficients.engine_host + coefficients.engine_driver,
        "judge": coefficients.engine_host + coefficients.engine_driver, "Ray": coefficients.ray,
        "tool server": coefficients.encoder_server + (index_bytes + encoder_bytes), "driver": coefficients.driver,
    }
    assert plan.host_total == sum(parts.values())
    rendered = plan.render()
    assert "on the host (this machine, 2,000 GB):" in rendered and "prebuilt index toy_Flat.index" in rendered
    assert plan.fits and check_train_memory(config) == ""  # within QUIET_BELOW of the GPU and of the host
    # the GPU fits, the host does not: the run stops, saying so
    driver_host(H200, plan.host_total - 1)
    with pytest.raises(ConfigError) as refused:
        check_train_memory(config)
    message = str(refused.value).splitlines()[0]
    assert message.startswith("the memory plan does not fit: the host's memory: the run's processes need "
                              f"{plan.host_total / GB:,.2f} GB of {(plan.host_total - 1) / GB:,.2f} GB (this machine)")


def test_a_cpu_cluster_is_planned_as_cpus_once_ray_has_joined_it(tiny_model_dir, toy_data, tmp_path, driver_host,
                                                                 ray_local, monkeypatch):
    import rlsearch.trainer.startup
    from rlsearch.trainer import GRPOTrainer

    def started(*_args, **_kwargs):
        raise Started

    for name in ("start_engines", "ActorRanks"):  # the check must stop the run before any of these starts
        monkeypatch.setattr(rlsearch.trainer.startup, name, started)
    address = ray_local.get_runtime_context().gcs_address  # the session's local instance: a CPU cluster
    overrides = [f"model.path={tiny_model_dir}", f"data.train_files=[{toy_data.train}]",
                 f"tools.retriever.corpus={toy_data.corpus}", f"trainer.output_dir={tmp_path / 'run'}",
                 f"trainer.ray_address={address}", "trainer.device_memory_gb=1"]
    config = load_train_config(EXAMPLE, overrides)
    driver_host(None, 2e12)
    assert waits_for_cluster(config) and check_train_memory(config) == ""  # its devices are not known yet
    assert plan_train_config(config) is None
    on_cpus = plan_train_config(config, cluster_gpus=False)
    assert on_cpus.inputs.device == Device("cpu", 1 * GB, "a cluster node's memory, trainer.device_memory_gb")
    assert on_cpus.needed == on_cpus.host_total > 1 * GB
    on_gpus = plan_train_config(config, cluster_gpus=True)
    assert on_gpus.inputs.device == Device("gpu", 1 * GB, "the cluster's GPUs, trainer.device_memory_gb")
    # the ranks' and engines' processes are on the cluster's nodes: this host holds the driver and its tool server
    assert [part.name for part in on_gpus.host_parts] == ["tool server", "driver"]
    with pytest.raises(ConfigError) as refused:
        GRPOTrainer(config).train()
    assert str(refused.value).startswith(
        f"the memory plan does not fit: needs {on_cpus.headline()} of 1.00 GB (a cluster node's memory, "
        "trainer.device_memory_gb)")
