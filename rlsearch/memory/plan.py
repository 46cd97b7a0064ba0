"""The arithmetic of the memory plan: one actor rank per pipeline stage and the rollout engines, for a model shape,
a layout, a dtype, recomputation, offloading and the tokens of one micro-batch, against one device's memory.

A rank's peak is its static part (weights, fp32 gradients, the optimizer's states, a frozen reference model), plus
the larger of the backward pass's peak and the optimizer step's workspace, plus the process's workspace and runtime.
The backward pass holds the activations kept for it and, one at a time, either the logits chunk (first) or a layer's
backward (what recomputation runs again and the gradients of that layer's activations). On CPU the actor ranks and
the engines share the host, so the plan adds them up against the host's memory; on GPUs each rank has its own, and
the engines their own."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .coefficients import ActivationCoefficients, coefficients_for
from .shape import ModelShape, stage_parameters

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
    reference_model: bool = False  # algo.kl_coef > 0: a frozen copy of the weights

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
        return text


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
class MemoryInputs:
    shape: ModelShape
    actor: ActorMemorySettings
    device: Device
    engines: EngineMemorySettings = EngineMemorySettings()


@dataclass(frozen=True)
class RankMemory:
    """One actor rank of a pipeline stage, in bytes."""

    stage: int
    parameters: int  # on this rank (dense and expert)
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
class MemoryPlan:
    inputs: MemoryInputs
    ranks: list[RankMemory]  # one per pipeline stage
    engine: EngineMemory | None
    coefficients: ActivationCoefficients
    host_overhead: float = 0.0  # CPU: the driver, Ray and the tool servers
    notes: list[str] = field(default_factory=list)

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda rank: rank.total)

    @property
    def on_cpu(self) -> bool:
        return self.inputs.device.kind == "cpu"

    @property
    def host_total(self) -> float:
        """CPU: everything the run puts on the host (every actor rank, every engine, the driver's side)."""
        layout, engines = self.inputs.actor.layout, self.inputs.engines
        per_stage_ranks = layout.ranks // layout.pp
        ranks = sum(rank.total + rank.host for rank in self.ranks) * per_stage_ranks
        if self.engine is None:
            return ranks + self.host_overhead
        engines_total = (self.engine.total * engines.tp + self.coefficients.engine_driver) * engines.count
        return ranks + engines_total + self.host_overhead

    @property
    def needed(self) -> float:
        """What is checked against the device's memory: the host's total on CPU, the worst rank on GPU."""
        return self.host_total if self.on_cpu else self.worst.total

    @property
    def actor_fits(self) -> bool:
        """The worst actor rank fits its GPU; on CPU everything fits the host."""
        return self.needed <= self.inputs.device.memory

    @property
    def engine_fits(self) -> bool:
        return self.engine is None or self.engine.fits

    @property
    def fits(self) -> bool:
        return self.actor_fits and self.engine_fits

    def headline(self) -> str:
        """e.g. "225 GB per rank at 32,768 tokens" or "30.2 GB of host memory at 4,096 tokens"."""
        where = "of host memory" if self.on_cpu else "per rank"
        return f"{_gb(self.needed)} {where} at {self.inputs.actor.tokens:,} tokens"

    def render(self) -> str:
        inputs = self.inputs
        actor, shape, device = inputs.actor, inputs.shape, inputs.device
        rank = self.worst
        lines = [
            f"model   : {shape.describe()}",
            f"actor   : {actor.describe()}; {actor.tokens:,} tokens per micro-batch"
            + (f" ({math.ceil(actor.tokens / actor.layout.cp):,} per context-parallel rank)"
               if actor.layout.cp > 1 else ""),
            f"device  : {device.name}, {_gb(device.memory)}",
            f"per actor rank (pipeline stage {rank.stage} of {actor.layout.pp}, the fullest):",
        ]
        dtype = actor.dtype
        optimizer = "Adam moments" + (" and fp32 master weights" if dtype != "float32" else "")
        if actor.distributed_optimizer:
            optimizer += f", sharded over {_optimizer_shards(actor.layout)} data-parallel ranks"
        if actor.optimizer_offload_fraction:
            optimizer += f"; {actor.optimizer_offload_fraction:.0%} on the host ({_gb(rank.host)})"
        positions = _logit_positions(actor)
        rows = [
            ("weights", rank.weights, f"{rank.parameters / 1e6:,.1f}M parameters in {dtype}"),
            ("gradients", rank.gradients, "fp32 (Megatron's gradient buffer)"),
            ("optimizer states", rank.optimizer, optimizer),
        ]
        if rank.reference:
            rows.append(("reference model", rank.reference, "frozen weights for the KL term (algo.kl_coef > 0)"))
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
        lines += [f"  {name:<17}{_gb(value):>11}  {what}" for name, value, what in rows]
        if self.engine is not None:
            lines.append(self._engine_line())
        if self.on_cpu:
            ranks = actor.layout.ranks
            engines = inputs.engines
            lines.append(
                f"host    : {ranks} actor rank(s) {_gb(sum(r.total + r.host for r in self.ranks) / len(self.ranks))} "
                f"each, {engines.count} engine(s) x {engines.tp} worker(s) "
                f"{_gb(self.engine.total if self.engine else 0)} each and a rollout worker "
                f"{_gb(self.coefficients.engine_driver)} per engine, the driver, Ray and tool servers "
                f"{_gb(self.host_overhead)}: {_gb(self.host_total)} of {_gb(device.memory)}"
            )
        lines += [f"note    : {note}" for note in self.notes]
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"verdict : {verdict}: {self.headline()} of {_gb(device.memory)} ({device.name})"
                     + ("" if self.engine_fits else f"; {self.engine_problem()}"))
        return "\n".join(lines)

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

    def _engine_line(self) -> str:
        engine, engines = self.engine, self.inputs.engines
        kv = (f"KV cache {_gb(engine.kv_cache)}" + (" (what gpu_memory_utilization leaves)"
                                                    if not engines.kv_cache_gib and not self.on_cpu else ""))
        where = "each on its own GPU(s)" if not self.on_cpu else "on the host"
        return (f"engines : {engines.count} x TP{engines.tp}, {where}; per worker: weights {_gb(engine.weights)}, "
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
        "linear_inputs": 2 * h + query + ffn,  # the inputs of linear_qkv, fc1 (h each), linear_proj and fc2
        "core_attn": coefficients.core_query * query + coefficients.core_kv * key_value
        + coefficients.core_rotary * shape.head_dim
        # the local spec's context parallelism gathers every rank's keys and values before attending
        + coefficients.core_kv * key_value * (cp - 1),
        "mlp": coefficients.mlp * ffn + dispatch,
    }
    return {name: value * size for name, value in parts.items()}


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
        ffn_inputs = parts["linear_inputs"] - (2 * shape.hidden + shape.heads * shape.head_dim / tp) * size
        saved += parts["mlp"] + ffn_inputs  # fc1's input stays as the checkpoint's
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
    size = DTYPE_BYTES[actor.dtype]
    # Adam's two fp32 moments, and Megatron's fp32 master copy of 16-bit weights; the distributed optimizer shards
    # them over the data-parallel ranks (experts over the expert-data-parallel ones)
    per_parameter = 8 + (4 if size < 4 else 0)
    if actor.distributed_optimizer:
        expert_shards = max(layout.dp * layout.cp // layout.ep, 1)
        optimizer = per_parameter * (parameters.dense / _optimizer_shards(layout) + parameters.expert / expert_shards)
    else:
        optimizer = per_parameter * count
    offloaded = optimizer * actor.optimizer_offload_fraction if device.kind == "gpu" else 0.0
    activations, per_token_layer, backward, activation_host = _activations(shape, actor, coefficients, stage)
    if device.kind == "cpu":  # offloading moves nothing off a CPU rank: the host is its device
        activation_host = 0.0
    positions = _logit_positions(actor)
    last_stage = stage == layout.pp - 1
    logits = coefficients.logits * positions * (shape.vocab // layout.tp) * 4 if last_stage else 0.0
    return RankMemory(
        stage=stage, parameters=count, weights=count * size, gradients=count * 4.0,
        optimizer=optimizer - offloaded, reference=count * size if actor.reference_model else 0.0,
        activations=activations, activations_per_token_layer=per_token_layer, backward=backward, logits=logits,
        optimizer_step=coefficients.optimizer_step * (optimizer - offloaded) / per_parameter * 4,
        workspace=coefficients.workspace, runtime=coefficients.runtime, host=offloaded + activation_host,
    )


def _engine(shape: ModelShape, actor: ActorMemorySettings, engines: EngineMemorySettings, device: Device,
            coefficients: ActivationCoefficients) -> EngineMemory | None:
    if not engines.count:
        return None
    size = DTYPE_BYTES[actor.dtype]
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


def plan_memory(inputs: MemoryInputs) -> MemoryPlan:
    """Every pipeline stage's rank and one engine worker (an engine of TP n has n alike)."""
    actor, shape, device = inputs.actor, inputs.shape, inputs.device
    coefficients = coefficients_for(device.kind, actor.dtype)
    ranks = [_rank(shape, actor, device, coefficients, stage) for stage in range(actor.layout.pp)]
    notes = []
    if actor.activation_offload != "none":
        notes.append("activation offloading: estimated (the layers on the GPU at once), not yet measured")
    if device.kind == "cpu" and (actor.activation_offload != "none" or actor.optimizer_offload_fraction):
        notes.append("offloading saves nothing on CPU: the host is the ranks' device")
    return MemoryPlan(
        inputs=inputs, ranks=ranks, engine=_engine(shape, actor, inputs.engines, device, coefficients),
        coefficients=coefficients, host_overhead=coefficients.host_overhead if device.kind == "cpu" else 0.0,
        notes=notes,
    )
