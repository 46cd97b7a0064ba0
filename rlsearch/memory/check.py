"""The memory plan of a training config, and the check `rlsearch train` runs before anything starts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..config import (
    ConfigError,
    EngineSpec,
    RetrieverConfig,
    TrainConfig,
    auto_dtype,
    check_model_dir,
    default_encoder_path,
)
from ..devices import gpu_name_and_memory, local_gpu_index
from .plan import (
    GB,
    ActorMemorySettings,
    CriticMemorySettings,
    Device,
    EngineMemorySettings,
    FrozenEngineSettings,
    Layout,
    MemoryInputs,
    MemoryPlan,
    RunParts,
    ServerMemory,
    plan_memory,
)
from .shape import ModelShape
from .suggest import not_fitting_message

QUIET_BELOW = 0.75  # a plan that fits within this share of the memory says nothing at start-up


def host_memory() -> float:
    """The host's memory in bytes: MemTotal, or a lower cgroup limit (a container's)."""
    total = float("inf")
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            total = int(line.split()[1]) * 1024
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


@dataclass(frozen=True)
class DriverMachine:
    """What the driver's machine has: its GPU's name and memory in bytes (None: no GPU; memory 0: NVML could not
    tell) and its host memory."""

    gpu: tuple[str, float] | None
    host_memory: float


def driver_machine() -> DriverMachine:
    """This machine, as the driver sees it before Ray starts; its GPU read through NVML, without starting CUDA."""
    index = local_gpu_index()
    gpu = None
    if index is not None:
        try:
            gpu = gpu_name_and_memory(index)
        except (OSError, RuntimeError) as error:
            gpu = (f"a GPU whose memory NVML cannot tell ({error})", 0.0)
    return DriverMachine(gpu, host_memory())


@dataclass(frozen=True)
class PlanDevices:
    """What a run's plan is checked against: the device an actor rank computes on (None: not known, `unknown` says
    why), the host memory the run's processes share on a GPU machine (None: not checked) and whether the actor ranks
    and engines run on that host (a local Ray instance) or on a cluster's nodes."""

    device: Device | None
    host: Device | None = None
    local: bool = True
    unknown: str = ""


def plan_devices(config: TrainConfig, machine: DriverMachine, cluster_gpus: bool | None = None) -> PlanDevices:
    """Where the run's parts will run, as the driver can know it: on its GPUs and its host, or (without one) on its
    host. A cluster (trainer.ray_address) joined from a driver without a GPU has GPUs or only CPUs, known once Ray
    has joined it (`cluster_gpus`; None before), and trainer.device_memory_gb gives their memory (a GPU's, or a
    node's); the driver's host then holds the driver and its tool servers."""
    given = config.trainer.device_memory_gb * GB
    cluster = bool(config.trainer.ray_address)
    host = Device("cpu", machine.host_memory, "this machine")
    if machine.gpu is not None:
        name, memory = machine.gpu
        if not (given or memory):
            return PlanDevices(None, unknown=f"{name}: set trainer.device_memory_gb to its memory")
        device = Device("gpu", given or memory, f"{name}, trainer.device_memory_gb" if given else name)
        return PlanDevices(device, host, local=not cluster)
    if not cluster:
        if given:
            return PlanDevices(Device("cpu", given, "host memory, trainer.device_memory_gb"))
        return PlanDevices(Device("cpu", machine.host_memory, "host memory"))
    if cluster_gpus is None:
        return PlanDevices(None, unknown="this driver has no GPU, and the cluster's devices (trainer.ray_address) are "
                                         "known once Ray has joined it")
    if not given:
        devices = "GPUs" if cluster_gpus else "CPU nodes"
        return PlanDevices(None, unknown=f"this driver has no GPU to tell the memory of the cluster's {devices}: set "
                                         "trainer.device_memory_gb to it, or run `rlsearch plan --gpus N "
                                         "--gpu-memory-gb M`")
    if cluster_gpus:
        return PlanDevices(Device("gpu", given, "the cluster's GPUs, trainer.device_memory_gb"), host, local=False)
    return PlanDevices(Device("cpu", given, "a cluster node's memory, trainer.device_memory_gb"))


def waits_for_cluster(config: TrainConfig, machine: DriverMachine | None = None) -> bool:
    """Whether the start-up check runs once Ray has joined the cluster (a driver without a GPU, trainer.ray_address),
    where the cluster's devices are known, instead of before anything starts."""
    machine = machine or driver_machine()
    return bool(config.trainer.ray_address) and machine.gpu is None and config.trainer.memory_check != "off"


def micro_batch_tokens(config: TrainConfig) -> int:
    """The most tokens one micro-batch of this run can hold: actor.max_tokens_per_microbatch, or fewer when a whole
    update's trajectories on one data-parallel rank cannot fill it (each at most the context window, or a window per
    turn when rollout.context folds or drops observations and starts new segments)."""
    rollout, algo, actor = config.rollout, config.algo, config.actor
    per_trajectory = rollout.window * (1 if rollout.context == "append" else rollout.max_turns)
    trajectories = math.ceil(config.data.batch_size * rollout.group_size / (algo.num_minibatches * actor.dp))
    return min(actor.max_tokens_per_microbatch, trajectories * per_trajectory)


def _weights_bytes(model: str) -> float | None:
    """The size on disk of a HuggingFace model's weights (a dir, or a hub name in the local cache); None when they
    are not found."""
    directory = Path(model)
    if not directory.is_dir():
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

        try:
            directory = Path(snapshot_download(model, local_files_only=True))
        except (HFValidationError, LocalEntryNotFoundError, OSError):
            return None
    for pattern in ("*.safetensors", "*.bin"):  # transformers loads the safetensors where both are there
        files = list(directory.glob(pattern))
        if files:
            return float(sum(path.stat().st_size for path in files))
    return None


def _encoder(path: str, on_host: bool, where: str, notes: list[str]) -> tuple[float, str]:
    """(bytes in host memory, its description) of a retriever's query encoder."""
    name = path.rstrip("/")
    if not on_host:
        notes.append(f"the retriever's encoder {name} runs on {where} (tools.retriever.encoder_device): its weights "
                     "there are not planned")
        return 0.0, f"encoder {name} on {where}"
    size = _weights_bytes(path)
    if size is None:
        notes.append(f"the retriever's encoder {path}: its weights are not on this machine, not counted")
        return 0.0, f"encoder {name}"
    return size, f"encoder {name} ({size / GB:,.2f} GB of weights)"


def _retriever_server(what: str, retriever: RetrieverConfig, on_gpu: bool, notes: list[str],
                      prebuilt: bool) -> ServerMemory:
    """The local retriever (`prebuilt`: with tools.retriever.index when given) or MCP server and what it reads."""
    if prebuilt and retriever.index:
        index = Path(retriever.index)
        files, parts = 0.0, []
        if retriever.faiss_gpu and on_gpu:
            notes.append(f"the prebuilt index {index.name} is searched on the GPUs (tools.retriever.faiss_gpu): its "
                         "float16 shards there are not planned")
        else:
            files = float(index.stat().st_size) if index.is_file() else 0.0
            parts.append(f"prebuilt index {index.name} ({files / GB:,.2f} GB, memory-mapped: searches read it)")
        device = retriever.encoder_device
        on_host = device == "cpu" or (device == "auto" and not on_gpu)
        encoder, described = _encoder(retriever.encoder, on_host, "the first GPU" if device == "auto" else device,
                                      notes)
        return ServerMemory(f"{what}: {', '.join([*parts, described])}", encoder=True, files=files + encoder)
    corpus = Path(retriever.corpus)
    files = float(corpus.stat().st_size) if corpus.is_file() else 0.0
    described = f"{what}: {retriever.backend} over {corpus.name} ({files / GB:,.2f} GB, read whole)"
    if retriever.backend == "bm25":
        return ServerMemory(described, encoder=False, files=files)
    notes.append(f"the {what}'s {retriever.backend} backend: its corpus embeddings (passages x the encoder's width x "
                 "4 bytes) are not counted")
    encoder, encoder_described = _encoder(retriever.encoder or default_encoder_path(), True, "", notes)
    return ServerMemory(f"{described}, {encoder_described}", encoder=True, files=files + encoder)


def _frozen_engine(name: str, key: str, model: str, max_model_len: int) -> FrozenEngineSettings:
    """The frozen engine of `key`.engine (`model`), started with the rollout engines (EngineSpec's defaults)."""
    if not (Path(model) / "config.json").is_file():
        raise ConfigError(f"'{key}.engine' is not a HuggingFace model dir (no config.json): {model}; give the "
                          f"{name} model's dir, or empty for no frozen engine")
    spec = EngineSpec(model, max_model_len=max_model_len)
    return FrozenEngineSettings(
        name, key, ModelShape.from_model_dir(model), spec.dtype,
        EngineMemorySettings(count=1, tp=spec.tensor_parallel_size, kv_cache_gib=spec.kv_cache_gib,
                             gpu_memory_utilization=spec.gpu_memory_utilization, window=spec.max_model_len),
    )


def _frozen_engines(config: TrainConfig) -> tuple[FrozenEngineSettings, ...]:
    """The frozen engines the run starts: the browse summariser's and the reward judge's (not for a replay)."""
    summariser, judge = config.tools.browse.summariser, config.reward.judge
    engines = []
    if summariser.engine and not summariser.engine_actor:
        engines.append(_frozen_engine("summariser", "tools.browse.summariser", summariser.engine,
                                      summariser.engine_max_model_len))
    if judge.starts_engine:
        engines.append(_frozen_engine("judge", "reward.judge", judge.engine, judge.engine_max_model_len))
    return tuple(engines)


def run_parts(config: TrainConfig, on_gpu: bool, local: bool = True) -> RunParts:
    """What the run starts beside its actor ranks and rollout engines: the local tool servers (as ToolServers starts
    them) and the frozen engines (the browse summariser's, the reward judge's)."""
    tools, notes, servers = config.tools, [], []
    if not tools.replay:  # a replayed run starts no tool server
        retriever = tools.retriever
        if "search" in tools.enabled and not retriever.url:
            servers.append(_retriever_server("retriever", retriever, on_gpu, notes, prebuilt=True))
        if tools.mcp.start_local:
            servers.append(_retriever_server("MCP server", retriever, on_gpu, notes, prebuilt=False))
    if not local:
        notes.append("the cluster's nodes: the host memory of the actor ranks' and engines' processes is not planned")
    return RunParts(tuple(servers), _frozen_engines(config), local, tuple(notes))


def train_memory_inputs(config: TrainConfig, device: Device, host: Device | None = None,
                        local: bool = True) -> MemoryInputs:
    """The plan's inputs from a training config (the model's config.json, the actor's layout and keys, the critic's
    with algo.advantage=gae, the rollout's window and engines, the tool servers and the frozen engine it starts) for
    `device` (and, on GPUs, `host`)."""
    actor, rollout = config.actor, config.rollout
    settings = ActorMemorySettings(
        tokens=micro_batch_tokens(config),
        layout=Layout(tp=actor.tp, pp=actor.pp, cp=actor.cp, dp=actor.dp, ep=actor.ep,
                      virtual_stages=actor.virtual_pipeline_stages),
        dtype=auto_dtype(config.model.dtype, device.kind == "gpu"),
        logits_chunk_tokens=actor.logits_chunk_tokens,
        # the recomputation and offloading keys (issue 46) read with their defaults where a config lacks them
        recompute=getattr(actor, "recompute", "none"),
        recompute_method=getattr(actor, "recompute_method", "uniform"),
        recompute_num_layers=getattr(actor, "recompute_num_layers", 1),
        recompute_modules=tuple(getattr(actor, "recompute_modules", ("core_attn",))),
        activation_offload=getattr(actor, "activation_offload", "none"),
        optimizer_offload_fraction=getattr(actor, "optimizer_offload_fraction", 0.0),
        distributed_optimizer=actor.use_distributed_optimizer,
        reference_model=config.algo.kl_coef > 0,
        lora_rank=actor.lora.rank, lora_targets=tuple(actor.lora.targets), lora_dropout=actor.lora.dropout,
    )
    engines = EngineMemorySettings(
        count=rollout.num_engines, tp=rollout.tensor_parallel_size, kv_cache_gib=rollout.kv_cache_gib,
        gpu_memory_utilization=rollout.gpu_memory_utilization, window=rollout.window,
    )
    return MemoryInputs(ModelShape.from_model_dir(config.model.path), settings, device, engines,
                        host=None if device.kind == "cpu" else host,
                        run=run_parts(config, device.kind == "gpu", local), critic=_critic(config))


def _critic(config: TrainConfig) -> CriticMemorySettings | None:
    """The critic section as the plan reads it (None without algo.advantage=gae): its layout's 0s stay the actor's,
    so the changes the plan suggests to the actor's layout move the critic's along, as CriticConfig.ranks_config
    does."""
    if config.algo.advantage != "gae":
        return None
    critic = config.critic
    return CriticMemorySettings(ModelShape.from_model_dir(critic.model.path or config.model.path), tp=critic.tp,
                                pp=critic.pp, cp=critic.cp, dp=critic.dp, offload=critic.offload)


def plan_train_config(config: TrainConfig, device: Device | None = None, machine: DriverMachine | None = None,
                      cluster_gpus: bool | None = None) -> MemoryPlan | None:
    """The plan of a training config on `device` (default: where `plan_devices` says the run goes, on this machine
    or `machine`); None when that is not known."""
    if device is not None:
        return plan_memory(train_memory_inputs(config, device))
    devices = plan_devices(config, machine or driver_machine(), cluster_gpus)
    if devices.device is None:
        return None
    return plan_memory(train_memory_inputs(config, devices.device, devices.host, devices.local))


def check_train_memory(config: TrainConfig, machine: DriverMachine | None = None,
                       cluster_gpus: bool | None = None) -> str:
    """The start-up check (trainer.memory_check): a line to print when the plan fits with little to spare (empty when
    it fits within QUIET_BELOW of the memory, or waits for the cluster: `waits_for_cluster`), is not checked or is
    only warned about; a ConfigError saying what would fit when it does not fit and the check is `error`. `machine`
    (default: this one) and `cluster_gpus` (once Ray has joined a cluster) say where the run goes."""
    mode = config.trainer.memory_check
    if mode == "off":
        return "[rlsearch] memory plan: not checked (trainer.memory_check=off)"
    check_model_dir(config.model.path)
    machine = machine or driver_machine()
    if cluster_gpus is None and waits_for_cluster(config, machine):
        return ""
    devices = plan_devices(config, machine, cluster_gpus)
    if devices.device is None:
        return f"[rlsearch] memory plan: not checked: {devices.unknown}"
    plan = plan_memory(train_memory_inputs(config, devices.device, devices.host, devices.local))
    if plan.fits:
        host = plan.host if not plan.on_cpu else None
        if plan.needed < QUIET_BELOW * plan.inputs.device.memory and (
                host is None or plan.host_total < QUIET_BELOW * host.memory):
            return ""
        return (f"[rlsearch] memory plan: {plan.headline()} of {plan.inputs.device.memory / GB:,.1f} GB"
                + (f", {plan.host_total / GB:,.1f} GB of host memory of {host.memory / GB:,.1f} GB" if host else "")
                + ": fits")
    message = f"the memory plan does not fit: {not_fitting_message(plan, config.rollout.window)}"
    if mode == "warn":
        return f"[rlsearch] warning: {message} (trainer.memory_check=warn: running anyway)"
    raise ConfigError(f"{message}. `rlsearch plan --config ...` prints the plan; trainer.memory_check=warn runs it "
                      f"anyway\n{plan.render()}")
