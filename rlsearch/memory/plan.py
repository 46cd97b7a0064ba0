"""The arithmetic of the memory plan: one actor rank per pipeline stage and the rollout engines, for a model shape,
a layout, a dtype, recomputation, offloading and the tokens of one micro-batch, against one device's memory.

A rank's peak is its static part (weights, fp32 gradients, the optimizer's states, a frozen reference model), plus
the larger of the backward pass's peak and the optimizer step's workspace, plus the process's workspace and runtime.
The backward pass holds the activations kept for it and, one at a time, either the logits chunk (first) or a layer's
backward (what recomputation runs again and the gradients of that layer's activations). On CPU the actor ranks,
the engines and every other process of the run share the host, so the plan adds them up against the host's memory;
on GPUs each rank has its own, the engines and the frozen engines (the browse summariser's, the judge's) their own,
and what their processes, the driver, Ray and the tool servers hold in host memory is added up against the host's.

With a critic (algo.advantage=gae) its ranks are planned as the actor's are, for its model with a value head and its
own layout, and its rank r shares actor rank r's device: a device holds both processes' peaks (each process's caching
allocator keeps what it freed for itself), or with critic.offload one model's tensors at a time.

With LoRA (actor.lora) the rank holds the model's weights frozen (no gradients, no optimizer states) and the adapters,
which alone have gradients and Adam's states; the reference policy of algo.kl_coef > 0 is the actor with its adapters
off (no frozen copy); a linear layer keeps its input for the backward pass only where an adapter needs it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .coefficients import ActivationCoefficients, coefficients_for
from .shape import LORA_TARGETS, ModelShape, adapter_parameters, stage_parameters

GB = 1e9
GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts")
ACTIVATION_OFFLOAD = ("none", "layer", "fine_grained")
# layers whose activations stay on the GPU under activation offloading: the one computing and the one moving
OFFLOAD_RESIDENT_LAYERS = 2
# vLLM's KV cache when rollout.kv_cache_gib is 0 on CPU (VLLM_CPU_KVCACHE_SPACE's default)
CPU_DEFAULT_KV_CACHE_GIB = 1.0


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    virtual_stages: int = 0

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def describe(self) -> str:
        text = f"tp{self.tp} pp{self.pp} cp{self.cp} dp{self.dp}"
        if self.ep > 1:
            text += f" ep{self.ep}"
        if self.virtual_stages:
            text += f" ({self.virtual_stages} virtual stages)"
        return text


@dataclass(frozen=True)
class ActorMemorySettings:
    """What decides an actor rank's memory (the actor.* keys, the model's dtype, the tokens of a micro-batch)."""

    tokens: int  # of one micro-batch, before a context-parallel split
    layout: Layout = Layout()
    dtype: str = "float32"  # float32 | bfloat16
    logits_chunk_tokens: int = 1024  # 0: one chunk of every position
    recompute: str = "none"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    recompute_modules: tuple[str, ...] = ("core_attn",)
    activation_offload: str = "none"
    optimizer_offload_fraction: float = 0.0
    distributed_optimizer: bool = False
    # algo.kl_coef > 0: a frozen copy of the weights (none with LoRA: the reference is the actor, its adapters off)
    reference_model: bool = False
    lora_rank: int = 0  # actor.lora.rank (0: every weight trains)
    lora_targets: tuple[str, ...] = LORA_TARGETS
    lora_dropout: float = 0.0

    def __post_init__(self) -> None:
        checks = (("dtype", self.dtype, DTYPE_BYTES), ("recompute", self.recompute, RECOMPUTE),
                  ("recompute_method", self.recompute_method, RECOMPUTE_METHODS),
                  ("activation_offload", self.activation_offload, ACTIVATION_OFFLOAD))
        for name, value, choices in checks:
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
        unknown = set(self.recompute_modules) - set(RECOMPUTE_MODULES)
        if unknown:
            raise ValueError(f"recompute_modules: unknown {sorted(unknown)}; known: {', '.join(RECOMPUTE_MODULES)}")
        if self.tokens < 1 or self.recompute_num_layers < 1 or not 0 <= self.optimizer_offload_fraction <= 1:
            raise ValueError("tokens and recompute_num_layers must be >= 1, optimizer_offload_fraction in [0, 1]")
        unknown = set(self.lora_targets) - set(LORA_TARGETS)
        if self.lora_rank < 0 or unknown or (self.lora_rank and not self.lora_targets):
            raise ValueError(f"lora_rank must be >= 0 and lora_targets some of {', '.join(LORA_TARGETS)}; got "
                             f"{self.lora_rank} and {list(self.lora_targets)}")

    def describe(self) -> str:
        recompute = self.recompute
        if recompute == "full":
            recompute += f" ({self.recompute_method}, {self.recompute_num_layers} layer(s))"
        elif recompute == "selective":
            recompute += f" ({', '.join(self.recompute_modules)})"
        text = f"{self.layout.describe()}, {self.dtype}, recompute {recompute}"
        if self.activation_offload != "none":
            text += f", activation offload {self.activation_offload}"
        if self.optimizer_offload_fraction:
            text += f", optimizer offload {self.optimizer_offload_fraction:g}"
        if self.distributed_optimizer:
            text += ", distributed optimizer"
        if self.lora_rank:
            text += f", LoRA rank {self.lora_rank} on {','.join(self.lora_targets)}"
        return text


@dataclass(frozen=True)
class CriticMemorySettings:
    """The critic of algo.advantage=gae (the critic section): its model, its layout and critic.offload. Its ranks'
    other settings are the actor's (the tokens of a micro-batch, dtype, recomputation, optimizer), as
    CriticConfig.ranks_config gives them, without a reference model or adapters; its rank r shares actor rank r's
    device."""

    shape: ModelShape  # critic.model.path's (default the policy's); planned with a value head for its output layer
    tp: int = 0  # 0: the actor's, as are pp, cp and dp
    pp: int = 0
    cp: int = 0
    dp: int = 0
    offload: bool = False  # one model's weights, gradients and optimizer states on the device at a time (GPU)

    def settings(self, actor: ActorMemorySettings) -> ActorMemorySettings:
        """The critic ranks' settings beside `actor`'s (CriticConfig.ranks_config's layout: virtual stages only with
        the actor's pipeline)."""
        layout = actor.layout
        return dataclasses.replace(actor, reference_model=False, lora_rank=0, layout=Layout(
            tp=self.tp or layout.tp, pp=self.pp or layout.pp, cp=self.cp or layout.cp, dp=self.dp or layout.dp,
            ep=layout.ep, virtual_stages=0 if self.pp else layout.virtual_stages))


@dataclass(frozen=True)
class EngineMemorySettings:
    count: int = 0
    tp: int = 1  # GPUs (CPU: worker processes) per engine
    kv_cache_gib: float = 0.0  # per engine worker; 0: CPU 1 GiB, GPU what gpu_memory_utilization leaves
    gpu_memory_utilization: float = 0.85
    window: int = 0  # tokens one trajectory may reach (vLLM's max_model_len)


@dataclass(frozen=True)
class Device:
    kind: str  # gpu | cpu
    memory: float  # bytes: one GPU's, or the host's on CPU
    name: str  # what it is and how it is known, for the printout

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"device kind must be gpu or cpu; got {self.kind!r}")


@dataclass(frozen=True)
class ServerMemory:
    """A local tool server the run starts (the retriever, `tools.mcp.start_local`'s MCP server)."""

    what: str  # for the printout, e.g. "retriever: prebuilt index e5_Flat.index (...), encoder e5-base-v2 (...)"
    encoder: bool  # the process loads an encoder (dense retrieval, a prebuilt index); else BM25 only
    files: float = 0.0  # bytes it reads into host memory: a prebuilt index (memory-mapped) and the encoder's weights


@dataclass(frozen=True)
class FrozenEngineSettings:
    """A frozen vLLM engine of the run (tools.browse.summariser.engine, reward.judge.engine): one worker, never
    trained."""

    name: str  # what the plan calls it: summariser, judge
    key: str  # its config section, e.g. tools.browse.summariser
    shape: ModelShape
    dtype: str
    engine: EngineMemorySettings  # count 1, tp 1


@dataclass(frozen=True)
class RunParts:
    """What the run starts beside the actor ranks and the rollout engines, and where."""

    servers: tuple[ServerMemory, ...] = ()
    frozen: tuple[FrozenEngineSettings, ...] = ()  # the frozen engines it starts
    # the actor ranks, the engines and Ray run on the host checked (a local Ray instance); False: on the nodes of a
    # cluster (trainer.ray_address), and the host checked is the driver's (its servers and itself)
    local: bool = True
    notes: tuple[str, ...] = ()  # what is left out of the plan, and why


@dataclass(frozen=True)
class MemoryInputs:
    shape: ModelShape
    actor: ActorMemorySettings
    device: Device
    engines: EngineMemorySettings = EngineMemorySettings()
    # GPUs: the host memory the run's processes share (None: not checked, e.g. planning GPUs of another machine);
    # on CPU the device is the host
    host: Device | None = None
    run: RunParts = RunParts()
    critic: CriticMemorySettings | None = None  # algo.advantage=gae


@dataclass(frozen=True)
class RankMemory:
    """One actor rank of a pipeline stage, in bytes."""

    stage: int
    parameters: int  # on this rank (dense and expert); with LoRA frozen
    weights: float
    gradients: float
    optimizer: float  # on the device; the offloaded share is in `host`
    reference: float
    activations: float  # kept for the backward pass by the layers whose forward passes are in flight
    activations_per_token_layer: float  # what one layer keeps per token (after recomputation's savings)
    backward: float  # one layer's backward at a time: what recomputation runs again, its activations' gradients
    logits: float  # one chunk of the output layer in the backward pass (last stage)
    optimizer_step: float  # the optimizer step's workspace (activations are freed by then)
    workspace: float  # what the process holds beyond the tensors above once built (buffers, caches)
    runtime: float  # the process beyond its tensors (CPU: the interpreter and libraries; GPU: CUDA context)
    host: float  # offloaded to host memory (optimizer states, activations)
    adapters: int = 0  # actor.lora's adapter parameters on this rank: the only ones trained

    @property
    def static(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.reference

    @property
    def step(self) -> float:
        """The tensors at the step's peak: what bench/memory.py measures (allocated on GPU, RSS growth on CPU)."""
        return self.static + max(self.activations + max(self.backward, self.logits), self.optimizer_step) + (
            self.workspace)

    @property
    def total(self) -> float:
        return self.step + self.runtime


@dataclass(frozen=True)
class SharedDevice:
    """A device of actor ranks of one pipeline stage and the critic's rank beside each (None: none), in bytes."""

    actor: RankMemory
    critic: RankMemory | None
    offload: bool  # critic.offload
    count: int  # the devices alike

    @property
    def total(self) -> float:
        """Without critic.offload both processes hold their peaks (PyTorch's caching allocator keeps a process's freed
        memory for that process); with it the device holds one model's tensors at a time, the larger step, beside
        both processes' runtimes."""
        if self.critic is None:
            return self.actor.total
        if self.offload:
            return max(self.actor.step, self.critic.step) + self.actor.runtime + self.critic.runtime
        return self.actor.total + self.critic.total


@dataclass(frozen=True)
class EngineMemory:
    """One rollout engine worker (one GPU, or one process on CPU), in bytes."""

    weights: float
    kv_cache: float
    kv_needed: float  # the KV cache of one whole trajectory (rollout's window)
    runtime: float  # CPU: the engine's processes beyond weights and KV cache; GPU: vLLM's activations and graphs
    limit: float  # GPU: what vLLM may take (gpu_memory_utilization x the GPU, or the GPU with a KV cache size given)

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.runtime

    @property
    def fits(self) -> bool:
        """vLLM starts only when its KV cache holds one whole trajectory (max_model_len), on a GPU beside the
        weights."""
        return self.kv_cache >= self.kv_needed and self.total <= self.limit


@dataclass(frozen=True)
class HostPart:
    """What one kind of process (or file) of the run holds in host memory, in bytes."""

    name: str
    memory: float
    what: str


@dataclass(frozen=True)
class MemoryPlan:
    inputs: MemoryInputs
    ranks: list[RankMemory]  # one per pipeline stage
    engine: EngineMemory | None
    coefficients: ActivationCoefficients
    frozen: tuple[EngineMemory, ...] = ()  # the frozen engines', as inputs.run.frozen lists them
    host_parts: list[HostPart] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    critic_ranks: list[RankMemory] = field(default_factory=list)  # one per pipeline stage of the critic's layout
    devices: list[SharedDevice] = field(default_factory=list)  # the actor ranks' devices, by what they hold

    @property
    def worst(self) -> RankMemory:
        """The fullest actor rank."""
        return max(self.ranks, key=lambda rank: rank.total)

    @property
    def worst_device(self) -> SharedDevice:
        """The fullest device: its actor rank and the critic rank beside it."""
        return max(self.devices, key=lambda device: device.total)

    @property
    def on_cpu(self) -> bool:
        return self.inputs.device.kind == "cpu"

    @property
    def host(self) -> Device | None:
        """The host memory the run's processes are checked against: the device on CPU."""
        return self.inputs.device if self.on_cpu else self.inputs.host

    @property
    def host_total(self) -> float:
        """Everything the run puts in the host's memory (on CPU every actor rank and engine too)."""
        return sum(part.memory for part in self.host_parts)

    @property
    def needed(self) -> float:
        """What is checked against the device's memory: the host's total on CPU, the fullest device on GPU."""
        return self.host_total if self.on_cpu else self.worst_device.total

    @property
    def actor_fits(self) -> bool:
        """The worst actor rank fits its GPU; on CPU everything fits the host."""
        return self.needed <= self.inputs.device.memory

    @property
    def host_fits(self) -> bool:
        """The run's processes fit the host's memory (on CPU: `actor_fits`; a host not checked fits)."""
        return self.host is None or self.host_total <= self.host.memory

    @property
    def engine_fits(self) -> bool:
        return self.engine is None or self.engine.fits

    @property
    def frozen_fits(self) -> bool:
        return all(engine.fits for engine in self.frozen)

    @property
    def fits(self) -> bool:
        return self.actor_fits and self.host_fits and self.engine_fits and self.frozen_fits

    def headline(self) -> str:
        """e.g. "225 GB per rank at 32,768 tokens" or "30.2 GB of host memory at 4,096 tokens"."""
        where = "of host memory" if self.on_cpu else "per rank" if not self.critic_ranks else (
            "per device (an actor and a critic rank)")
        return f"{_gb(self.needed)} {where} at {self.inputs.actor.tokens:,} tokens"

    def render(self) -> str:
        inputs = self.inputs
        actor, shape, device = inputs.actor, inputs.shape, inputs.device
        rank = self.worst_device.actor
        lines = [
            f"model   : {shape.describe()}",
            f"actor   : {actor.describe()}; {actor.tokens:,} tokens per micro-batch"
            + (f" ({math.ceil(actor.tokens / actor.layout.cp):,} per context-parallel rank)"
               if actor.layout.cp > 1 else ""),
            f"device  : {device.name}, {_gb(device.memory)}",
            f"per actor rank (pipeline stage {rank.stage} of {actor.layout.pp}, "
            f"{'on the fullest device' if self.critic_ranks else 'the fullest'}):",
        ]
        dtype = actor.dtype
        optimizer = "Adam moments" + (" and fp32 master weights" if dtype != "float32" else "")
        if actor.distributed_optimizer:
            optimizer += f", sharded over {_optimizer_shards(actor.layout)} data-parallel ranks"
        if actor.optimizer_offload_fraction:
            optimizer += f"; {actor.optimizer_offload_fraction:.0%} on the host ({_gb(rank.host)})"
        positions = _logit_positions(actor)
        trained = ""
        weights = f"{rank.parameters / 1e6:,.1f}M parameters in {dtype}"
        if rank.adapters:
            weights += f", frozen, and {rank.adapters:,} of LoRA adapters (rank {actor.lora_rank})"
            trained = " of the adapters only"
        rows = [
            ("weights", rank.weights, weights),
            ("gradients", rank.gradients, "fp32 (Megatron's gradient buffer)" + trained),
            ("optimizer states", rank.optimizer, optimizer + trained),
        ]
        if rank.reference:
            rows.append(("reference model", rank.reference, "frozen weights for the KL term (algo.kl_coef > 0)"))
        elif actor.reference_model:
            rows.append(("reference model", 0.0, "none: the KL term's reference is the actor with its adapters off"))
        layers = shape.layers // actor.layout.pp
        rows += [
            ("activations", rank.activations,
             f"{math.ceil(actor.tokens / actor.layout.cp):,} tokens x {layers} layers, "
             f"{rank.activations_per_token_layer / 1e3:,.1f} KB a token and layer kept"),
            ("backward", rank.backward, "a layer's backward at a time" + (
                ": what recomputation runs again and its gradients" if actor.recompute != "none" else
                ": the gradients of its activations") + (" (the larger of this and the logits chunk counts)"
                                                         if rank.logits else "")),
        ]
        if rank.logits:
            rows.append(("logits chunk", rank.logits, f"{positions:,} positions x {shape.vocab // actor.layout.tp:,} "
                         "vocabulary rows: fp32 logits and the softmax's copies"))
        if rank.optimizer_step > rank.activations + max(rank.backward, rank.logits):
            rows.append(("optimizer step", rank.optimizer_step, "its workspace, larger than the backward pass's peak"))
        rows += [
            ("workspace", rank.workspace, "buffers and caches of the built model beyond its tensors"),
            ("runtime", rank.runtime, "the interpreter and its libraries" if self.on_cpu
             else "CUDA context, NCCL and allocator headroom"),
            ("total", rank.total, ""),
        ]
        rows += self._critic_rows()
        lines += [f"  {name:<17}{_gb(value):>11}  {what}" for name, value, what in rows]
        if self.engine is not None:
            lines.append(self._engine_line("engines ", self.engine, inputs.engines))
        for settings, engine in zip(inputs.run.frozen, self.frozen):
            lines.append(self._engine_line(f"{settings.name:<8}", engine, settings.engine))
        if self.host is not None:
            lines.append("on the host (the device above):" if self.on_cpu
                         else f"on the host ({self.host.name}, {_gb(self.host.memory)}):")
            lines += [f"  {part.name:<17}{_gb(part.memory):>11}  {part.what}" for part in self.host_parts]
            lines.append(f"  {'total':<17}{_gb(self.host_total):>11}")
        lines += [f"note    : {note}" for note in self.notes]
        verdict = "fits" if self.fits else "does NOT fit"
        problems = [problem for problem in (self.host_problem(), self.engine_problem(), *self.frozen_problems())
                    if problem]
        lines.append(f"verdict : {verdict}: {self.headline()} of {_gb(device.memory)} ({device.name})"
                     + "".join(f"; {problem}" for problem in problems))
        return "\n".join(lines)

    def _critic_rows(self) -> list[tuple[str, float, str]]:
        """The critic's rank beside the fullest device's actor rank, and the device's total (none without a critic)."""
        device = self.worst_device
        critic = device.critic
        if critic is None:
            return []
        layout = self.inputs.critic.settings(self.inputs.actor).layout
        parts = ", ".join(f"{name} {value / GB:,.2f}" for name, value in (
            ("weights", critic.weights), ("gradients", critic.gradients), ("optimizer", critic.optimizer),
            ("activations", critic.activations), ("backward", critic.backward)))
        if device.offload:
            shared = (f"critic.offload: one model's tensors at a time (the larger step, "
                      f"{_gb(max(device.actor.step, critic.step))}) and both processes' runtimes")
        else:
            shared = "both processes' peaks: each one's allocator keeps what it freed"
        return [
            ("critic rank", critic.total, f"beside it: {layout.describe()} stage {critic.stage} of {layout.pp}, "
             f"{critic.parameters / 1e6:,.1f}M parameters (a value head, no logits); {parts} GB"),
            ("device total", device.total, shared),
        ]

    def host_problem(self) -> str:
        """GPUs: what does not fit the host's memory, its largest parts first (empty when it fits)."""
        if self.on_cpu or self.host_fits:
            return ""
        largest = sorted(self.host_parts, key=lambda part: -part.memory)[:3]
        return (f"the host's memory: the run's processes need {_gb(self.host_total)} of {_gb(self.host.memory)} "
                f"({self.host.name}), the most {', '.join(f'{part.name} {_gb(part.memory)}' for part in largest)}")

    def frozen_problems(self) -> list[str]:
        """Why each frozen engine that cannot start cannot (none when all can)."""
        problems = []
        for settings, engine in zip(self.inputs.run.frozen, self.frozen):
            if engine.fits:
                continue
            needed = f"one {settings.engine.window:,}-token prompt needs {_gb(engine.kv_needed)} of KV cache"
            if self.on_cpu:
                problems.append(f"the {settings.name} engine: {needed}, and vLLM's default on CPU is "
                                f"{_gb(engine.kv_cache)}")
            else:
                problems.append(f"the {settings.name} engine: {needed} beside its weights ({_gb(engine.weights)}) "
                                f"on one GPU: lower {settings.key}.engine_max_model_len, or give it a smaller model")
        return problems

    def engine_problem(self) -> str:
        """Why the engines cannot start, and what to do (empty when they can)."""
        if self.engine_fits:
            return ""
        engine, engines = self.engine, self.inputs.engines
        needed = (f"one {engines.window:,}-token trajectory needs {_gb(engine.kv_needed)} of KV cache per engine "
                  f"worker")
        if engine.kv_cache < engine.kv_needed and engines.kv_cache_gib:
            return (f"{needed}, rollout.kv_cache_gib gives {_gb(engine.kv_cache)}: raise it"
                    + ("" if self.on_cpu else " (or 0: what rollout.gpu_memory_utilization leaves)"))
        if self.on_cpu:
            return f"{needed}, and vLLM's default on CPU is {_gb(engine.kv_cache)}: set rollout.kv_cache_gib"
        return (f"{needed} beside its weights ({_gb(engine.weights)}): raise rollout.tensor_parallel_size or "
                "rollout.gpu_memory_utilization, or shorten the window")

    def _engine_line(self, label: str, engine: EngineMemory, engines: EngineMemorySettings) -> str:
        kv = (f"KV cache {_gb(engine.kv_cache)}" + (" (what gpu_memory_utilization leaves)"
                                                    if not engines.kv_cache_gib and not self.on_cpu else ""))
        where = "each on its own GPU(s)" if not self.on_cpu else "on the host"
        return (f"{label}: {engines.count} x TP{engines.tp}, {where}; per worker: weights {_gb(engine.weights)}, "
                f"{kv}, one {engines.window:,}-token trajectory needs {_gb(engine.kv_needed)} of KV cache, runtime "
                f"{_gb(engine.runtime)}")


def _gb(value: float) -> str:
    return f"{value / GB:,.2f} GB" if value < 100 * GB else f"{value / GB:,.0f} GB"


def _optimizer_shards(layout: Layout) -> int:
    """Megatron's distributed optimizer shards dense parameters over the data-parallel ranks with context parallel."""
    return layout.dp * layout.cp


def _logit_positions(actor: ActorMemorySettings) -> int:
    local = math.ceil(actor.tokens / actor.layout.cp)
    return min(actor.logits_chunk_tokens or local, local)


def _ffn_width(shape: ModelShape, tp: int) -> float:
    """The FFN width one token passes through on this rank, per token of the micro-batch. MoE: each token's top-k
    copies go through their experts, whose FFNs are split over the expert-tensor-parallel ranks (as many as tp);
    Megatron trains MoE layers under tensor parallelism only with sequence parallelism, so an expert's rank takes the
    copies of its tensor-parallel group's tokens (1/tp of the sequence each) through 1/tp of each FFN."""
    if shape.experts:
        return (shape.experts_per_token * shape.expert_ffn + shape.shared_expert_ffn) / tp
    return shape.ffn / tp


def layer_activation_bytes(shape: ModelShape, actor: ActorMemorySettings, coefficients: ActivationCoefficients
                           ) -> dict[str, float]:
    """What one layer keeps per token for its backward pass without recomputation, in bytes, by part (each a
    coefficient measured by bench/memory.py times a width of the layer on this rank)."""
    size = DTYPE_BYTES[actor.dtype]
    tp, cp = actor.layout.tp, actor.layout.cp
    h = shape.hidden
    query = shape.heads * shape.head_dim / tp
    key_value = shape.kv_heads * shape.head_dim / tp
    ffn = _ffn_width(shape, tp)
    dispatch = coefficients.dispatch * shape.experts_per_token * h if shape.experts else 0.0
    parts = {
        "norms": coefficients.norms * h,
        "core_attn": coefficients.core_query * query + coefficients.core_kv * key_value
        + coefficients.core_rotary * shape.head_dim
        # the local spec's context parallelism gathers every rank's keys and values before attending
        + coefficients.core_kv * key_value * (cp - 1),
        "mlp": coefficients.mlp * ffn + dispatch,
    }
    parts = {name: value * size for name, value in parts.items()}
    parts["linear_inputs"] = sum(_linear_saved(shape, actor).values())
    return parts


def _linear_saved(shape: ModelShape, actor: ActorMemorySettings) -> dict[str, float]:
    """Bytes per token that each linear layer of a transformer layer keeps for its backward pass: its input, which
    its weight's gradient needs. With LoRA only the adapted layers keep it (Megatron's linear_with_frozen_weight
    keeps no input; the adapter's A needs it), with the adapter's rank-wide product A x for B's gradient, and with
    dropout the dropped copy in place of the input and its mask (a byte an element)."""
    size = DTYPE_BYTES[actor.dtype]
    h, tp = shape.hidden, actor.layout.tp
    inputs = {"qkv": h, "proj": shape.heads * shape.head_dim / tp, "fc1": h, "fc2": _ffn_width(shape, tp)}
    if not actor.lora_rank:
        return {target: width * size for target, width in inputs.items()}
    mask = 1 if actor.lora_dropout else 0
    return {target: inputs[target] * (size + mask) + actor.lora_rank * size for target in actor.lora_targets}


def _selective_savings(parts: dict[str, float], shape: ModelShape, actor: ActorMemorySettings) -> float:
    """Bytes per token and layer that recomputing actor.recompute_modules saves: a recomputed module keeps only its
    inputs (the checkpoint's), not what it saved inside."""
    size = DTYPE_BYTES[actor.dtype]
    tp = actor.layout.tp
    modules = set(actor.recompute_modules)
    saved = 0.0
    if "core_attn" in modules:
        inputs = (shape.heads + 2 * shape.kv_heads) * shape.head_dim / tp * size
        saved += max(parts["core_attn"] - inputs, 0.0)
    if "layernorm" in modules:
        saved += parts["norms"]
    mlp_modules = {"mlp"} if not shape.experts else {"moe"}
    if modules & mlp_modules:
        linear = _linear_saved(shape, actor)
        # fc1's input stays as the checkpoint's
        saved += parts["mlp"] + linear.get("fc2", 0.0) + max(linear.get("fc1", 0.0) - shape.hidden * size, 0.0)
    elif shape.experts and "moe_act" in modules:
        saved += parts["mlp"] * 0.5  # the activation's half of the experts' saved tensors
    return saved


def _activations(shape: ModelShape, actor: ActorMemorySettings, coefficients: ActivationCoefficients,
                 stage: int) -> tuple[float, float, float, float]:
    """Of pipeline stage `stage`, in bytes: (activations kept on the device, what a token and layer keeps, one
    layer's backward at a time, activations offloaded to the host)."""
    layout = actor.layout
    tokens = math.ceil(actor.tokens / layout.cp)
    size = DTYPE_BYTES[actor.dtype]
    parts = layer_activation_bytes(shape, actor, coefficients)
    full_layer = sum(parts.values())
    layer_input = shape.hidden * size
    chunks = max(layout.virtual_stages, 1)
    layers = shape.layers // (layout.pp * chunks)  # per model chunk
    if actor.recompute == "full":
        if actor.recompute_method == "uniform":
            group = min(actor.recompute_num_layers, layers)
            kept = math.ceil(layers / group) * layer_input
            rerun = group * full_layer  # one group's activations, made again in its backward pass
        else:  # block: the first N layers of each chunk keep only their input
            recomputed = min(actor.recompute_num_layers, layers)
            kept = recomputed * layer_input + (layers - recomputed) * full_layer
            rerun = full_layer if recomputed else 0.0
    elif actor.recompute == "selective":
        rerun = _selective_savings(parts, shape, actor)
        kept = layers * (full_layer - rerun)
    else:
        kept, rerun = layers * full_layer, 0.0
    # model chunks whose forward passes are in flight on this stage when its first backward pass starts: 1F1B's
    # warm-up (pp - stage), and with virtual stages Megatron's interleaved warm-up
    if chunks > 1:
        in_flight = (layout.pp - stage - 1) * 2 + (chunks - 1) * layout.pp + 1
    else:
        in_flight = layout.pp - stage
    kept_total = in_flight * kept
    if actor.activation_offload == "layer":  # every layer but the last leaves the GPU after its forward pass
        resident = min(OFFLOAD_RESIDENT_LAYERS, layers) * full_layer
    elif actor.activation_offload == "fine_grained":  # the attention's and norms' saved tensors leave, the MLP's stay
        resident = layers * in_flight * (parts["mlp"] + (shape.hidden + _ffn_width(shape, layout.tp)) * size)
    else:
        resident = kept_total
    host = max(kept_total - resident, 0.0) * tokens
    kept_total = min(kept_total, resident)
    outside = coefficients.outside * shape.hidden * size
    backward = tokens * (rerun + coefficients.backward * full_layer)
    return tokens * (kept_total + outside), kept / layers, backward, host


def _rank(shape: ModelShape, actor: ActorMemorySettings, device: Device, coefficients: ActivationCoefficients,
          stage: int) -> RankMemory:
    layout = actor.layout
    parameters = stage_parameters(shape, layout.tp, layout.pp, layout.ep, stage)
    count = parameters.dense + parameters.expert
    adapters = adapter_parameters(shape, layout.tp, layout.pp, actor.lora_rank, actor.lora_targets)
    # what trains: every parameter, or (LoRA) only the adapters, all dense
    dense, expert = (parameters.dense, parameters.expert) if not actor.lora_rank else (adapters, 0)
    size = DTYPE_BYTES[actor.dtype]
    # Adam's two fp32 moments, and Megatron's fp32 master copy of 16-bit weights; the distributed optimizer shards
    # them over the data-parallel ranks (experts over the expert-data-parallel ones)
    per_parameter = 8 + (4 if size < 4 else 0)
    if actor.distributed_optimizer:
        expert_shards = max(layout.dp * layout.cp // layout.ep, 1)
        optimizer = per_parameter * (dense / _optimizer_shards(layout) + expert / expert_shards)
    else:
        optimizer = per_parameter * (dense + expert)
    offloaded = optimizer * actor.optimizer_offload_fraction if device.kind == "gpu" else 0.0
    activations, per_token_layer, backward, activation_host = _activations(shape, actor, coefficients, stage)
    if device.kind == "cpu":  # offloading moves nothing off a CPU rank: the host is its device
        activation_host = 0.0
    positions = _logit_positions(actor)
    last_stage = stage == layout.pp - 1
    # a critic's value head projects to one value per position: no logits chunk
    logits = coefficients.logits * positions * (shape.vocab // layout.tp) * 4 if (
        last_stage and not shape.value_head) else 0.0
    return RankMemory(
        stage=stage, parameters=count, weights=(count + adapters) * size, gradients=(dense + expert) * 4.0,
        optimizer=optimizer - offloaded,
        reference=count * size if actor.reference_model and not actor.lora_rank else 0.0,
        activations=activations, activations_per_token_layer=per_token_layer, backward=backward, logits=logits,
        optimizer_step=coefficients.optimizer_step * (optimizer - offloaded) / per_parameter * 4,
        workspace=coefficients.workspace, runtime=coefficients.runtime, host=offloaded + activation_host,
        adapters=adapters,
    )


def _engine(shape: ModelShape, dtype: str, engines: EngineMemorySettings, device: Device,
            coefficients: ActivationCoefficients) -> EngineMemory | None:
    if not engines.count:
        return None
    size = DTYPE_BYTES[dtype]
    weights = shape.total_parameters() * size / engines.tp
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * size / engines.tp
    kv_needed = kv_per_token * engines.window
    runtime = coefficients.engine_runtime
    if device.kind == "cpu":  # the host's total is checked as a whole
        kv = (engines.kv_cache_gib or CPU_DEFAULT_KV_CACHE_GIB) * GIB
        return EngineMemory(weights, kv, kv_needed, runtime, limit=float("inf"))
    if engines.kv_cache_gib:
        return EngineMemory(weights, engines.kv_cache_gib * GIB, kv_needed, runtime, limit=device.memory)
    budget = engines.gpu_memory_utilization * device.memory
    return EngineMemory(weights, max(budget - weights - runtime, 0.0), kv_needed, runtime, limit=budget)


def _ranks_part(name: str, ranks: list[RankMemory], layout: Layout, on_cpu: bool,
                coefficients: ActivationCoefficients) -> HostPart:
    """What the ranks of a layout (one RankMemory per pipeline stage) hold in host memory."""
    per_rank = [rank.host + (rank.total if on_cpu else coefficients.rank_host) for rank in ranks]
    return HostPart(name, sum(per_rank) * (layout.ranks // layout.pp), f"{layout.ranks} x {_gb(max(per_rank))}"
                    + ("" if on_cpu else ": the processes and what they offload"))


def _host_parts(inputs: MemoryInputs, ranks: list[RankMemory], engine: EngineMemory | None,
                frozen: tuple[EngineMemory, ...], coefficients: ActivationCoefficients,
                critic_ranks: list[RankMemory], devices: list[SharedDevice]) -> list[HostPart]:
    """What each kind of the run's processes holds in host memory. On CPU the actor ranks (and the critic's) and the
    engines hold everything there; on GPUs their processes' host side and what they offload (critic.offload: on each
    device's behalf the larger of the two models' states, the one waiting there while the other has the device). Off
    a local Ray instance (a cluster) only the driver and its tool servers are on the host checked."""
    on_cpu, run = inputs.device.kind == "cpu", inputs.run
    parts = []
    if run.local or on_cpu:
        engines = inputs.engines
        parts.append(_ranks_part("actor ranks", ranks, inputs.actor.layout, on_cpu, coefficients))
        if critic_ranks:
            parts.append(_ranks_part("critic ranks", critic_ranks, inputs.critic.settings(inputs.actor).layout,
                                     on_cpu, coefficients))
            if inputs.critic.offload and not on_cpu:
                states = sum(d.count * max(d.actor.static, d.critic.static) for d in devices if d.critic is not None)
                parts.append(HostPart("critic.offload", states, "per device the larger of the actor's and the "
                                      "critic's weights, gradients and optimizer states: one waits here at a time"))
        if engine is not None:
            worker = engine.total if on_cpu else coefficients.engine_host
            parts += [HostPart("rollout engines", worker * engines.tp * engines.count,
                               f"{engines.count} x {engines.tp} worker(s) x {_gb(worker)}"),
                      HostPart("rollout workers", coefficients.engine_driver * engines.count,
                               f"{engines.count} x {_gb(coefficients.engine_driver)}: the Ray actor of each engine")]
        for settings, engine in zip(inputs.run.frozen, frozen):
            worker = engine.total if on_cpu else coefficients.engine_host
            parts.append(HostPart(settings.name, worker + coefficients.engine_driver,
                                  f"the frozen engine of {settings.key}.engine and its Ray actor"))
        parts.append(HostPart("Ray", coefficients.ray, "Ray's own processes"))
    for server in run.servers:
        baseline = coefficients.encoder_server if server.encoder else coefficients.bm25_server
        parts.append(HostPart("tool server", baseline + server.files, server.what))
    parts.append(HostPart("driver", coefficients.driver, "the trainer's process"))
    return parts


def _shared_devices(actor: Layout, ranks: list[RankMemory], critic: Layout | None, critic_ranks: list[RankMemory],
                    offload: bool) -> list[SharedDevice]:
    """The actor ranks' devices by (actor stage, critic stage beside it): Megatron numbers ranks tensor-, context- and
    data-parallel first, so rank r is on stage r // (ranks / pp); the critic's rank r shares actor rank r's device."""
    counts: dict[tuple[int, int | None], int] = {}
    for rank in range(actor.ranks):
        beside = rank // (critic.ranks // critic.pp) if critic is not None and rank < critic.ranks else None
        key = (rank // (actor.ranks // actor.pp), beside)
        counts[key] = counts.get(key, 0) + 1
    return [SharedDevice(ranks[stage], None if beside is None else critic_ranks[beside], offload, count)
            for (stage, beside), count in counts.items()]


def plan_memory(inputs: MemoryInputs) -> MemoryPlan:
    """Every pipeline stage's rank, one engine worker (an engine of TP n has n alike), the frozen engines
    and what the run's processes hold in host memory."""
    actor, shape, device, run = inputs.actor, inputs.shape, inputs.device, inputs.run
    coefficients = coefficients_for(device.kind, actor.dtype)
    ranks = [_rank(shape, actor, device, coefficients, stage) for stage in range(actor.layout.pp)]
    critic_layout, critic_ranks = None, []
    if inputs.critic is not None:
        critic = inputs.critic.settings(actor)
        critic_shape = dataclasses.replace(inputs.critic.shape, value_head=True)
        critic_layout = critic.layout
        critic_ranks = [_rank(critic_shape, critic, device, coefficients, stage) for stage in range(critic_layout.pp)]
    devices = _shared_devices(actor.layout, ranks, critic_layout, critic_ranks,
                              inputs.critic is not None and inputs.critic.offload)
    engine = _engine(shape, actor.dtype, inputs.engines, device, coefficients)
    frozen = tuple(_engine(settings.shape, settings.dtype, settings.engine, device,
                           coefficients_for(device.kind, settings.dtype)) for settings in run.frozen)
    notes = list(run.notes)
    if actor.activation_offload != "none":
        notes.append("activation offloading: estimated (the layers on the GPU at once), not yet measured")
    critic_offload = inputs.critic is not None and inputs.critic.offload
    if device.kind == "cpu" and (actor.activation_offload != "none" or actor.optimizer_offload_fraction
                                 or critic_offload):
        notes.append("offloading saves nothing on CPU: the host is the ranks' device")
    return MemoryPlan(
        inputs=inputs, ranks=ranks, engine=engine, coefficients=coefficients, frozen=frozen,
        host_parts=_host_parts(inputs, ranks, engine, frozen, coefficients, critic_ranks, devices), notes=notes,
        critic_ranks=critic_ranks, devices=devices,
    )
