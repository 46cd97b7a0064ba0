"""The CPU cores a run's processes share (RLSEARCH_CPU_CORES, the test suite's per-lane share): the actor ranks' torch
threads and the vLLM engines' OpenMP threads come from it; unset, they come from the cores the process may use (its
CPU affinity, its cgroup's CPU quota), not the host's."""

from __future__ import annotations

import os

import pytest
import torch

from rlsearch.devices import CPU_CORES_VARIABLE, cpu_cores, cpu_threads_each, usable_cpu_cores
from rlsearch.rollout.engine import EngineSpec, configure_vllm_environment

VLLM_THREAD_VARIABLES = ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "VLLM_ENABLE_V1_MULTIPROCESSING",
                         "VLLM_HOST_IP", "VLLM_PORT", "VLLM_CPU_KVCACHE_SPACE")


@pytest.fixture
def environment(monkeypatch):
    """os.environ restored after the test, with the variables configure_vllm_environment writes unset."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in (CPU_CORES_VARIABLE, *VLLM_THREAD_VARIABLES):
        monkeypatch.setenv(name, "placeholder")  # recorded, so the code's own writes are undone too
        monkeypatch.delenv(name)
    return monkeypatch


def test_unset_means_every_core_the_process_may_use(environment):
    assert cpu_cores() == usable_cpu_cores() <= os.cpu_count()
    assert cpu_threads_each(1) == usable_cpu_cores()
    assert cpu_threads_each(10_000) == 1


@pytest.mark.parametrize(("affinity", "cpu_max", "cores"), [
    (64, None, 64), (4, None, 4), (64, "max 100000", 64), (64, "400000 100000", 4), (64, "150000 100000", 2),
    (64, "50000 100000", 1), (2, "400000 100000", 2), (64, "garbled", 64)])
def test_unset_the_cpu_affinity_and_the_cgroup_quota_bound_the_cores(environment, tmp_path, affinity, cpu_max, cores):
    """A container on a 64-core host: its cpuset (the affinity) or its quota (cpu.max, rounded up), the smaller."""
    environment.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)))
    environment.setattr(os, "cpu_count", lambda: 64)
    cpu_max_file = tmp_path / "cpu.max"
    if cpu_max is not None:
        cpu_max_file.write_text(cpu_max + "\n")
    assert cpu_cores(cpu_max_file) == cores
    environment.setenv(CPU_CORES_VARIABLE, "3")  # the variable still wins, above or below the limits
    assert cpu_cores(cpu_max_file) == 3


@pytest.mark.parametrize(("cores", "processes", "threads"), [("1", 1, 1), ("1", 2, 1), ("4", 2, 2), ("6", 4, 1)])
def test_set_cores_are_split_between_the_processes(environment, cores, processes, threads):
    environment.setenv(CPU_CORES_VARIABLE, cores)
    assert cpu_cores() == int(cores)
    assert cpu_threads_each(processes) == threads


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_a_value_that_is_not_a_count_of_cores_is_refused_naming_the_variable(environment, value):
    environment.setenv(CPU_CORES_VARIABLE, value)
    with pytest.raises(ValueError, match=f"{CPU_CORES_VARIABLE}={value!r}: set it to a whole number of cores"):
        cpu_cores()


@pytest.mark.parametrize(("cores", "tp", "threads"), [("2", 1, "2"), ("2", 2, "1"), ("1", 2, "1"), ("8", 2, "4")])
def test_engines_on_shared_cores_run_unbound_with_their_share_of_threads(environment, cores, tp, threads):
    environment.setenv(CPU_CORES_VARIABLE, cores)
    configure_vllm_environment(EngineSpec("model", tensor_parallel_size=tp))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert os.environ["OMP_NUM_THREADS"] == threads


def test_a_tp1_engine_on_the_whole_machine_decodes_on_all_its_cores_not_its_ray_actors_one(environment):
    environment.setenv("OMP_NUM_THREADS", "1")  # what Ray gives an actor of num_cpus=1 (the engine's, at TP1)
    configure_vllm_environment(EngineSpec("model"))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # vLLM binds no TP1 worker
    assert os.environ["OMP_NUM_THREADS"] == str(usable_cpu_cores())
    configure_vllm_environment(EngineSpec("model", cpu_threads=3))
    assert os.environ["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize(("cores", "engines", "tp", "async_steps", "threads"), [
    ("2", 1, 1, 0, 2), ("2", 2, 1, 0, 1), ("8", 2, 2, 0, 2), ("1", 2, 2, 0, 1), ("8", 1, 2, 1, 2), ("2", 1, 1, 1, 1)])
def test_a_runs_engines_split_its_cores_between_their_workers(environment, cores, engines, tp, async_steps, threads):
    from rlsearch.config import ModelConfig, RolloutConfig

    rollout = RolloutConfig(num_engines=engines, tensor_parallel_size=tp, async_steps=async_steps)
    # the spec is made by the driver, which has other cores than the engine's node or container: it counts none
    environment.setenv(CPU_CORES_VARIABLE, "64")
    spec = EngineSpec.from_config(ModelConfig(path="model"), rollout, seed=1)
    assert spec.cpu_threads == 0 and spec.cpu_processes == engines * tp * (2 if async_steps else 1)
    environment.setenv(CPU_CORES_VARIABLE, cores)  # the engine's own process counts its cores
    configure_vllm_environment(spec)
    assert os.environ["OMP_NUM_THREADS"] == str(threads)


@pytest.mark.parametrize(("cores", "ranks", "async_steps", "threads"), [
    ("8", 2, 0, 4), ("8", 2, 1, 2), ("2", 1, 1, 1), ("2", 2, 1, 1)])
def test_actor_ranks_take_half_the_cores_while_the_engines_roll_out_beside_them(
    environment, monkeypatch, cores, ranks, async_steps, threads
):
    """Under rollout.async_steps the ranks train while the engines (which take half) roll out: the other half."""
    import torch

    from rlsearch.actor import worker
    from rlsearch.config import load_train_config
    from rlsearch.trainer.startup import _actor_spec

    config = load_train_config(None, [f"rollout.async_steps={async_steps}"])
    spec = _actor_spec(config, {})
    rank = worker.MegatronActorWorker.__new__(worker.MegatronActorWorker)
    rank.spec, rank.rank, rank.world_size = spec, 0, ranks
    monkeypatch.setattr(worker, "init_megatron_parallel", lambda *args, **kwargs: None)
    monkeypatch.setattr(worker.MegatronActorWorker, "build", lambda self: None)
    chosen = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    environment.setenv(CPU_CORES_VARIABLE, cores)
    rank.initialize("tcp://127.0.0.1:1")
    assert chosen == [threads]


def test_an_explicit_binding_wins_over_the_shared_cores(environment):
    environment.setenv(CPU_CORES_VARIABLE, "2")
    environment.setenv("OMP_NUM_THREADS", "7")
    configure_vllm_environment(EngineSpec("model", tensor_parallel_size=2, cpu_threads_bind="0|1"))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert os.environ["OMP_NUM_THREADS"] == "7"


def test_the_cli_refuses_a_bad_value_before_it_starts_anything(environment, capsys):
    from rlsearch.cli import main

    environment.setenv(CPU_CORES_VARIABLE, "all")
    assert main(["train", "--config", "examples/configs/search_grpo_tiny.yaml"]) == 2
    assert f"rlsearch: {CPU_CORES_VARIABLE}='all': set it to a whole number of cores" in capsys.readouterr().err


def test_an_explicit_binding_applies_to_a_tp1_engine_on_the_whole_machine(environment):
    configure_vllm_environment(EngineSpec("model", cpu_threads_bind="0"))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_decode_step_tries_threads_and_binding_through_the_engines_spec(environment):
    """bench/decode_step.py --try threads=1: the engine's spec, which sets its workers' threads (an environment
    variable would be overwritten by the engine's own)."""
    from bench.decode_step import apply_setting

    environment.setenv("OMP_NUM_THREADS", "2")  # what the bench's environment said, to no effect
    fields = {}
    for setting in ("threads=1", "eager=true", "kvspace=2"):
        apply_setting(setting, fields)
    assert fields == {"cpu_threads": 1, "enforce_eager": True}
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"
    configure_vllm_environment(EngineSpec("model", **fields))
    assert os.environ["OMP_NUM_THREADS"] == "1"
    bound = {}
    apply_setting("bind=0", bound)
    assert bound == {"cpu_threads_bind": "0"}
