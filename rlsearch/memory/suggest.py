"""What would fit: the cheapest change of the actor's keys that makes a plan fit, LoRA adapters in place of training
every weight, the longest micro-batch that fits, and layouts for a number of GPUs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .plan import Device, Layout, MemoryInputs, MemoryPlan, plan_memory
from .shape import ModelShape, lora_targets_of

# the config key of each ActorMemorySettings field and Layout field a suggestion may change
_SETTING_KEYS = {
    "tokens": "actor.max_tokens_per_microbatch", "logits_chunk_tokens": "actor.logits_chunk_tokens",
    "recompute": "actor.recompute", "recompute_method": "actor.recompute_method",
    "recompute_num_layers": "actor.recompute_num_layers", "activation_offload": "actor.activation_offload",
    "optimizer_offload_fraction": "actor.optimizer_offload_fraction",
    "distributed_optimizer": "actor.use_distributed_optimizer",
    "lora_rank": "actor.lora.rank", "lora_targets": "actor.lora.targets",
}
_LAYOUT_KEYS = {"tp": "actor.tp", "pp": "actor.pp", "cp": "actor.cp", "dp": "actor.dp", "ep": "actor.ep"}
# relative step time of each recomputation mode (the H200 0.5B rows at 64k: selective 1.19x, full 1.24x)
_RECOMPUTE_COST = {"none": 0, "selective": 1, "full": 2}
SMALL_LOGITS_CHUNK = 256
# the rank a LoRA suggestion names: "LoRA Without Regret" (Schulman et al., 2025) finds ranks this small match full
# fine-tuning in policy-gradient RL
SUGGESTED_LORA_RANK = 16
TOKEN_STEP = 256  # the longest fitting micro-batch is searched in these steps
MAX_MODEL_PARALLEL = 16


@dataclass(frozen=True)
class Change:
    """Config overrides (key=value) and the plan they give."""

    overrides: dict[str, object]
    plan: MemoryPlan
    ranks_factor: int = 1  # the change needs this many times the actor's ranks

    def describe(self) -> str:
        text = " ".join(f"{key}={_value(value)}" for key, value in self.overrides.items())
        if self.ranks_factor > 1:
            text += f" ({self.ranks_factor}x the actor ranks)"
        return text


def _value(value: object) -> str:
    if isinstance(value, tuple):
        return f"[{','.join(map(str, value))}]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _changed(inputs: MemoryInputs, layout: dict | None = None, **settings) -> tuple[MemoryInputs, dict[str, object]]:
    """`inputs` with some actor settings and layout sizes replaced, and the config overrides that say so (only the
    values that differ)."""
    actor = inputs.actor
    overrides = {_SETTING_KEYS[name]: value for name, value in settings.items() if getattr(actor, name) != value}
    new_layout = actor.layout
    if layout:
        overrides.update({_LAYOUT_KEYS[name]: value for name, value in layout.items()
                          if getattr(actor.layout, name) != value})
        new_layout = dataclasses.replace(actor.layout, **layout)
    new_actor = dataclasses.replace(actor, layout=new_layout, **settings)
    return dataclasses.replace(inputs, actor=new_actor), overrides


# full recomputation as the suggestions use it: whole layers, one at a time
FULL_RECOMPUTE = dict(recompute="full", recompute_method="uniform", recompute_num_layers=1, activation_offload="none")


def _candidates(inputs: MemoryInputs, window: int) -> list[tuple[MemoryInputs, dict, int]]:
    """Changes to try, cheapest first: (inputs, overrides, ranks factor)."""
    shape, on_gpu = inputs.shape, inputs.device.kind == "gpu"
    tried: list[tuple[MemoryInputs, dict, int]] = []
    first: dict[str, object] = {}  # a change every later one builds on

    def add(layout: dict | None = None, factor: int = 1, **settings) -> None:
        changed, overrides = _changed(inputs, layout, **settings)
        tried.append((changed, {**first, **overrides}, factor))

    if window and inputs.actor.tokens > window:  # a micro-batch need not hold more than one whole trajectory
        add(tokens=window)
        inputs, first = tried[-1][0], tried[-1][1]
    actor = inputs.actor
    if actor.recompute == "none":
        add(recompute="selective")
    add(**FULL_RECOMPUTE)
    if actor.logits_chunk_tokens == 0 or actor.logits_chunk_tokens > SMALL_LOGITS_CHUNK:
        add(**FULL_RECOMPUTE, logits_chunk_tokens=SMALL_LOGITS_CHUNK)
    sharded = dict(FULL_RECOMPUTE, distributed_optimizer=actor.layout.dp * actor.layout.cp > 1
                   or actor.distributed_optimizer)
    if sharded["distributed_optimizer"] and not actor.distributed_optimizer:
        add(**sharded)
    if on_gpu and actor.layout.pp == 1 and actor.recompute == "none":  # activations offload without PP only
        add(activation_offload="layer")
    offloaded = dict(sharded, distributed_optimizer=True, optimizer_offload_fraction=1.0)
    if on_gpu:  # Megatron offloads the optimizer's states from the distributed optimizer only
        add(**offloaded)
    for factor in (2, 4, 8, 16):
        for name in ("cp", "tp", "pp"):
            layout = {name: getattr(actor.layout, name) * factor}
            if _splits(shape, dataclasses.replace(actor.layout, **layout), actor.tokens):
                add(layout, factor, **(offloaded if on_gpu else sharded))
    return tried


def _splits(shape: ModelShape, layout: Layout, tokens: int) -> bool:
    """Whether Megatron can split `shape` so (the divisibility the config validation checks)."""
    if layout.tp * layout.pp * layout.cp > MAX_MODEL_PARALLEL:
        return False
    if shape.experts and (layout.tp > 1 or layout.cp > 1):
        return False
    stages = layout.pp * max(layout.virtual_stages, 1)
    return (shape.heads % layout.tp == 0 and shape.kv_heads % layout.tp == 0 and shape.vocab % layout.tp == 0
            and shape.layers % stages == 0 and tokens >= 2 * layout.cp)


def _actor_fits(plan: MemoryPlan, host_short: bool) -> bool:
    """The actor's ranks fit their devices, and the run the host's memory (offloading moves states there) unless the
    host was short before any change of the actor's keys (`host_short`: its tool servers, say, which none helps)."""
    return plan.actor_fits and (plan.host_fits or host_short)


def _host_short(inputs: MemoryInputs) -> bool:
    return not plan_memory(inputs).host_fits


def fitting_change(inputs: MemoryInputs, window: int = 0) -> Change | None:
    """The first change (cheapest first: a micro-batch no longer than the trajectory window, recomputation, a smaller
    logits chunk, the distributed optimizer, offloading, then more context-, tensor- or pipeline-parallel ranks) whose
    plan fits; None when none does."""
    host_short = _host_short(inputs)
    for changed, overrides, factor in _candidates(inputs, window):
        plan = plan_memory(changed)
        if _actor_fits(plan, host_short):
            return Change(overrides, plan, factor)
    return None


def lora_change(inputs: MemoryInputs, window: int = 0) -> Change | None:
    """For an actor that trains every weight: LoRA adapters of rank SUGGESTED_LORA_RANK on every linear layer the model
    can adapt (a MoE model's attention only), alone or with the first of `fitting_change`'s changes on the same ranks
    whose plan fits; None when the actor trains adapters already or none fits."""
    if inputs.actor.lora_rank:
        return None
    adapted, overrides = _changed(inputs, lora_rank=SUGGESTED_LORA_RANK, lora_targets=lora_targets_of(inputs.shape))
    host_short = _host_short(inputs)
    for changed, more, factor in [(adapted, {}, 1), *_candidates(adapted, window)]:
        plan = plan_memory(changed)
        if factor == 1 and _actor_fits(plan, host_short):
            return Change({**overrides, **more}, plan)
    return None


def longest_fitting_tokens(inputs: MemoryInputs) -> int:
    """The most tokens per micro-batch that fit with full recomputation (and, on GPU, the optimizer offloaded); 0 when
    not even a short one does."""
    changes = dict(FULL_RECOMPUTE, logits_chunk_tokens=min(inputs.actor.logits_chunk_tokens or SMALL_LOGITS_CHUNK,
                                                           SMALL_LOGITS_CHUNK))
    if inputs.device.kind == "gpu":
        changes.update(distributed_optimizer=True, optimizer_offload_fraction=1.0)
    base, _ = _changed(inputs, **changes)
    host_short = _host_short(inputs)

    def fits(tokens: int) -> bool:
        return _actor_fits(plan_memory(dataclasses.replace(base, actor=dataclasses.replace(base.actor, tokens=tokens))),
                           host_short)

    low, high = 0, inputs.actor.tokens // TOKEN_STEP  # in steps of TOKEN_STEP tokens: low fits, above high not
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle * TOKEN_STEP):
            low = middle
        else:
            high = middle - 1
    return low * TOKEN_STEP


def not_fitting_message(plan: MemoryPlan, window: int = 0) -> str:
    """What does not fit and what would, e.g. "needs 225 GB per rank at 32,768 tokens of 80.00 GB (NVIDIA H100);
    with actor.recompute=full, 31.02 GB"; and the host's, the engines' and the frozen engines' problems, if any."""
    device = plan.inputs.device
    others = [plan.host_problem()] + ([f"the rollout engines: {plan.engine_problem()}"] if not plan.engine_fits
                                      else []) + plan.frozen_problems()
    others = [problem for problem in others if problem]
    if plan.actor_fits:
        return "; ".join(others)
    text = f"needs {plan.headline()} of {_gb(device.memory)} ({device.name})"
    change = fitting_change(plan.inputs, window)
    if change is not None:
        text += f"; with {change.describe()}, {_gb(change.plan.needed)}"
    else:
        tokens = longest_fitting_tokens(plan.inputs)
        text += (f"; no change of recomputation, offloading or up to {MAX_MODEL_PARALLEL} model-parallel ranks fits; "
                 + (f"at most {tokens:,} tokens per micro-batch fit, with full recomputation" if tokens else
                    "nothing fits on this device, not even a short micro-batch with full recomputation"))
    adapters = lora_change(plan.inputs, window)
    if adapters is not None:
        text += (f"; or train LoRA adapters instead of every weight: with {adapters.describe()}, "
                 f"{_gb(adapters.plan.needed)} (a learning rate about 10x full fine-tuning's: docs/training.md)")
    return "; ".join([text, *others])


def _gb(value: float) -> str:
    return f"{value / 1e9:,.2f} GB" if value < 100e9 else f"{value / 1e9:,.0f} GB"


@dataclass(frozen=True)
class LayoutProposal:
    change: Change

    @property
    def plan(self) -> MemoryPlan:
        return self.change.plan


def _divisors(number: int) -> list[int]:
    return [value for value in range(1, number + 1) if number % value == 0]


def propose_layouts(inputs: MemoryInputs, gpus: int, gpu_memory: float, limit: int = 8) -> list[LayoutProposal]:
    """Layouts of `gpus` actor ranks of `gpu_memory` bytes each that fit, with the least recomputation and offloading
    each needs; more data parallelism first (fewer ranks share a model replica), then less recomputation."""
    device = Device("gpu", gpu_memory, f"{gpus} GPU(s) of {gpu_memory / 1e9:,.0f} GB")
    inputs = dataclasses.replace(inputs, device=device)
    shape, actor = inputs.shape, inputs.actor
    host_short = _host_short(inputs)
    found = []
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            for cp in (size for size in _divisors(gpus // (tp * pp)) if size & (size - 1) == 0):
                dp = gpus // (tp * pp * cp)
                eps = [size for size in _divisors(dp) if shape.experts % size == 0] if shape.experts else [1]
                layout = Layout(tp=tp, pp=pp, cp=cp, dp=dp, ep=max(eps))
                if not _splits(shape, layout, actor.tokens):
                    continue
                proposal = _cheapest_fit(inputs, layout, host_short)
                if proposal is not None:
                    found.append(proposal)
    found.sort(key=lambda p: (p.plan.inputs.actor.layout.tp * p.plan.inputs.actor.layout.pp
                              * p.plan.inputs.actor.layout.cp, _RECOMPUTE_COST[p.plan.inputs.actor.recompute],
                              p.plan.inputs.actor.optimizer_offload_fraction, p.plan.needed))
    return found[:limit]


def _cheapest_fit(inputs: MemoryInputs, layout: Layout, host_short: bool) -> LayoutProposal | None:
    sharded = layout.dp * layout.cp > 1
    for recompute in ("none", "selective", "full"):
        for offload in (0.0, 1.0):
            settings = dict(recompute=recompute, optimizer_offload_fraction=offload,
                            distributed_optimizer=sharded or offload > 0, activation_offload="none")
            if recompute == "full":
                settings.update(recompute_method="uniform", recompute_num_layers=1)
            changed, overrides = _changed(inputs, layout={name: getattr(layout, name) for name in _LAYOUT_KEYS},
                                          **settings)
            plan = plan_memory(changed)
            if _actor_fits(plan, host_short):
                return LayoutProposal(Change(overrides, plan))
    return None
