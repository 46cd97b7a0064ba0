"""The memory plan's arithmetic: parameters, gradients and Adam's states per rank counted by hand for a small model
at TP2/PP2/DP2 (with and without the distributed optimizer), the measured peaks it must predict (the issue's H200
table, bench/memory.py's CPU rows), what it says would fit, the layouts it proposes, a critic's ranks beside the
actor's (algo.advantage=gae), and a LoRA actor's ranks (actor.lora: the base frozen, only the adapters trained)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from rlsearch.memory import (
    GB,
    ActorMemorySettings,
    CriticMemorySettings,
    Device,
    Layout,
    MemoryInputs,
    ModelShape,
    fitting_change,
    plan_memory,
    propose_layouts,
    stage_parameters,
)
from rlsearch.memory.suggest import not_fitting_message
from tests.models import TEST_VOCAB_SIZE

GIB = 2**30
# the embedded default: Qwen2, hidden 128, 2 layers, 4 heads (2 kv) of 32, FFN 256, the padded Qwen vocabulary
TINY = ModelShape(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, ffn=256, vocab=151_680, qkv_bias=True)
# Qwen2.5-0.5B (bench/common "0.5b"): tied embeddings, 151,936 rows
HALF_B = ModelShape(hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, ffn=4864, vocab=151_936,
                    tied_embeddings=True, qkv_bias=True)
# Qwen2.5-7B
SEVEN_B = ModelShape(hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128, ffn=18944, vocab=152_064,
                     qkv_bias=True)

# one layer of TINY on one of two tensor-parallel ranks, tensor by tensor (Megatron's local spec)
TINY_LAYER_TP2 = {
    "input_layernorm.weight": 128,  # norms are replicated over TP
    "self_attention.linear_qkv.weight": (4 + 2 + 2) * 32 * 128 // 2,  # 16,384: q, k, v rows split over TP
    "self_attention.linear_qkv.bias": (4 + 2 + 2) * 32 // 2,  # 128
    "self_attention.linear_proj.weight": 128 * (4 * 32) // 2,  # 8,192: columns split
    "pre_mlp_layernorm.weight": 128,
    "mlp.linear_fc1.weight": (2 * 256) * 128 // 2,  # 32,768: gate and up
    "mlp.linear_fc2.weight": 128 * 256 // 2,  # 16,384
}
TINY_VOCAB_TP2 = 151_680 * 128 // 2  # the embedding (first stage) and the output layer (last), vocab rows split
TINY_STAGE_TP2 = [
    TINY_VOCAB_TP2 + sum(TINY_LAYER_TP2.values()),  # stage 0: embedding, layer 0
    sum(TINY_LAYER_TP2.values()) + 128 + TINY_VOCAB_TP2,  # stage 1: layer 1, final norm, output layer
]


GPU_80GB = Device("gpu", 80 * GB, "an 80 GB GPU")


def _plan(shape, tokens=4096, device=GPU_80GB, **settings):
    return plan_memory(MemoryInputs(shape, ActorMemorySettings(tokens=tokens, **settings), device))


def test_tiny_model_parameters_are_the_hf_checkpoints(tiny_model_dir):
    from safetensors import safe_open

    shape = ModelShape.from_model_dir(tiny_model_dir)
    assert shape == dataclasses.replace(TINY, vocab=TEST_VOCAB_SIZE)  # the tests' model: TINY with a small vocabulary
    numel = 0
    for path in tiny_model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                dims = handle.get_slice(name).get_shape()
                numel += dims[0] * (dims[1] if len(dims) > 1 else 1)
    # the embedding and the output layer, then the two layers and the final norm (39,126,144 with TINY's vocabulary)
    assert shape.total_parameters() == numel == 2 * TEST_VOCAB_SIZE * 128 + 296_064


@pytest.mark.parametrize("stage", [0, 1])
def test_parameters_per_rank_at_tp2_pp2_are_counted_by_hand(stage):
    parameters = stage_parameters(TINY, tp=2, pp=2, ep=1, stage=stage)
    assert (parameters.dense, parameters.expert) == (TINY_STAGE_TP2[stage], 0)


@pytest.mark.parametrize(
    ("dtype", "distributed", "per_parameter"),
    [
        ("float32", False, {"weights": 4, "gradients": 4, "optimizer": 8}),  # fp32: Adam's two moments
        ("float32", True, {"weights": 4, "gradients": 4, "optimizer": 8 / 2}),  # sharded over DP2
        ("bfloat16", False, {"weights": 2, "gradients": 4, "optimizer": 12}),  # + Megatron's fp32 master weights
        ("bfloat16", True, {"weights": 2, "gradients": 4, "optimizer": 12 / 2}),
    ],
)
def test_weights_gradients_and_adam_per_rank_at_tp2_pp2_dp2(dtype, distributed, per_parameter):
    layout = Layout(tp=2, pp=2, dp=2)
    plan = _plan(TINY, layout=layout, dtype=dtype, distributed_optimizer=distributed)
    for stage, rank in enumerate(plan.ranks):
        count = TINY_STAGE_TP2[stage]
        assert rank.parameters == count
        assert {name: getattr(rank, name) for name in per_parameter} == {
            name: pytest.approx(bytes_each * count, rel=1e-12) for name, bytes_each in per_parameter.items()}
        assert rank.host == 0


def test_optimizer_offload_moves_its_share_to_the_host_on_gpu_only():
    on_gpu = _plan(TINY, dtype="bfloat16", distributed_optimizer=True, optimizer_offload_fraction=0.75)
    rank = on_gpu.ranks[0]
    states = 12 * TINY.total_parameters()
    assert (rank.optimizer, rank.host) == (pytest.approx(0.25 * states), pytest.approx(0.75 * states))
    on_cpu = _plan(TINY, dtype="bfloat16", distributed_optimizer=True, optimizer_offload_fraction=0.75,
                   device=Device("cpu", 24 * GB, "host"))
    assert (on_cpu.ranks[0].optimizer, on_cpu.ranks[0].host) == (pytest.approx(states), 0)


# bench/memory.py --fit --dtype float32 --chunk 128 on this CPU (2026-11-27): what each part of a layer saves per
# token in its forward pass, in float32 units; and outside the layers, per token
MEASURED_FIT = {
    # shape: (hidden, heads, kv heads, head dim, ffn) -> norms, linear_inputs, core_attn, mlp, outside
    (128, 4, 2, 32, 256): (514.0, 640.0, 708.0, 1024.0, 391.2),
    (256, 8, 2, 32, 256): (1026.0, 1024.0, 1096.0, 1024.0, 767.2),
    (128, 4, 4, 32, 256): (514.0, 640.0, 900.0, 1024.0, 391.2),
    (256, 4, 2, 64, 256): (1026.0, 1024.0, 1412.0, 1024.0, 767.2),
    (128, 4, 2, 32, 1024): (514.0, 1408.0, 708.0, 4096.0, 391.2),
}


@pytest.mark.parametrize("widths", MEASURED_FIT)
def test_a_layers_activations_are_the_measured_table(widths):
    from rlsearch.memory import coefficients_for
    from rlsearch.memory.plan import layer_activation_bytes

    hidden, heads, kv_heads, head_dim, ffn = widths
    shape = ModelShape(hidden=hidden, layers=2, heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=ffn,
                       vocab=151_680, qkv_bias=True)
    coefficients = coefficients_for("cpu", "float32")
    parts = layer_activation_bytes(shape, ActorMemorySettings(tokens=1024), coefficients)
    measured = dict(zip(("norms", "linear_inputs", "core_attn", "mlp", "outside"), MEASURED_FIT[widths]))
    planned = {name: value / 4 for name, value in parts.items()} | {"outside": coefficients.outside * hidden}
    assert planned == {name: pytest.approx(value, rel=0.02) for name, value in measured.items()}
    # the plan's rank keeps per token and layer exactly these parts; selective recomputation of core_attn keeps its
    # inputs (query, key and value: (heads + 2 kv_heads) x head_dim) instead of what it saved
    layer = sum(value for name, value in measured.items() if name != "outside") * 4
    for recompute, kept in (("none", layer), ("selective", layer - (measured["core_attn"] - (
            heads + 2 * kv_heads) * head_dim) * 4)):
        plan = _plan(shape, dtype="float32", recompute=recompute, device=Device("cpu", 24 * GB, "host"))
        assert plan.worst.activations_per_token_layer == pytest.approx(kept, rel=0.02)


# the H200 table (bench/gpu_actor_check.py's worker, the 0.5B shape, bf16, one trajectory, 1024-position
# logits chunks): tokens, actor keys, peak torch.cuda.max_memory_allocated in GiB
H200_TABLE = [
    (65_065, {}, 103.9),
    (65_065, {"recompute": "selective"}, 100.1),
    (65_065, {"recompute": "full"}, 16.4),
    (130_601, {"recompute": "full"}, 24.3),
]


@pytest.mark.parametrize(("tokens", "keys", "peak_gib"), H200_TABLE)
def test_the_plan_predicts_the_h200_table_within_15_percent(tokens, keys, peak_gib):
    plan = _plan(HALF_B, tokens=tokens, dtype="bfloat16", device=Device("gpu", 141 * GB, "H200"), **keys)
    assert plan.worst.step / GIB == pytest.approx(peak_gib, rel=0.15)


def test_a_7b_model_at_32k_tokens_does_not_fit_an_80gb_gpu_and_the_plan_says_what_would():
    plan = _plan(SEVEN_B, tokens=32_768, dtype="bfloat16")
    assert not plan.fits and plan.worst.activations > 150 * GB  # the issue's ~7 MB a token
    message = not_fitting_message(plan)
    match = re.fullmatch(r"needs ([\d,.]+) GB per rank at 32,768 tokens of 80\.00 GB \(an 80 GB GPU\); with "
                         r"(actor\.\S+=\S+(?: actor\.\S+=\S+)*), ([\d.]+) GB; or train LoRA adapters .*", message)
    assert match, message
    change = fitting_change(plan.inputs)
    assert match.group(2) == change.describe() and "actor.recompute=full" in change.describe()
    assert change.plan.fits and change.plan.worst.total == pytest.approx(float(match.group(3)) * GB, rel=1e-3)


def test_proposed_layouts_fit_use_every_gpu_and_put_data_parallelism_first():
    proposals = propose_layouts(MemoryInputs(SEVEN_B, ActorMemorySettings(tokens=32_768, dtype="bfloat16"),
                                             Device("gpu", 1.0, "unused")), gpus=8, gpu_memory=80 * GB)
    assert proposals
    model_parallel = []
    for proposal in proposals:
        plan = proposal.plan
        layout = plan.inputs.actor.layout
        assert plan.fits and plan.worst.total <= 80 * GB and layout.ranks == 8
        assert f"actor.dp={layout.dp}" in proposal.change.describe() or layout.dp == 1
        model_parallel.append(layout.tp * layout.pp * layout.cp)
    assert model_parallel == sorted(model_parallel)
    # one GPU of 80 GB cannot hold a 7B model's Adam states at 32k tokens without offloading: tp1 pp1 cp1 dp8 needs
    # the states sharded over the 8 ranks
    first = proposals[0].plan.inputs.actor
    assert (first.layout.dp, first.distributed_optimizer) == (8, True)


def test_the_cpu_plan_adds_the_ranks_and_engines_up_against_the_host():
    from rlsearch.memory import EngineMemorySettings

    device = Device("cpu", 24 * GB, "host")
    settings = ActorMemorySettings(tokens=4096, layout=Layout(tp=2, dp=2))
    engines = EngineMemorySettings(count=2, tp=2, window=768)
    plan = plan_memory(MemoryInputs(TINY, settings, device, engines))
    rank, engine = plan.ranks[0], plan.engine
    coefficients = plan.coefficients
    drivers = 2 * coefficients.engine_driver  # the rollout worker of each engine
    # no tool server or summariser engine in these inputs: the driver's process and Ray's beside the ranks and engines
    assert [part.name for part in plan.host_parts] == ["actor ranks", "rollout engines", "rollout workers", "Ray",
                                                       "driver"]
    assert plan.host_total == pytest.approx(4 * rank.total + 4 * engine.total + drivers + coefficients.driver
                                            + coefficients.ray)
    assert engine.kv_cache == 1 * GIB and engine.weights == pytest.approx(TINY.total_parameters() * 4 / 2)
    tight = plan_memory(MemoryInputs(TINY, settings, Device("cpu", plan.host_total - 1, "host"), engines))
    assert not tight.fits and tight.headline().endswith("of host memory at 4,096 tokens")


def test_hf_configs_of_moe_and_qwen3_models_are_read(tmp_path):
    config = {"model_type": "qwen3_moe", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "vocab_size": 151_680,
              "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.from_model_dir(tmp_path)
    assert (shape.qk_norm, shape.qkv_bias, shape.experts, shape.expert_ffn) == (True, False, 8, 128)
    # EP2: each rank holds 4 of the 8 experts of each layer (gate, up and down: 3 x 128 x 128)
    per_rank = stage_parameters(shape, tp=1, pp=1, ep=2, stage=0)
    assert per_rank.expert == 2 * 4 * 3 * 128 * 128


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_critic_of_the_actors_layout_adds_its_static_bytes_less_the_output_layer(dtype):
    """Each device holds an actor rank and the critic's rank r beside it: the policy's shape with a value head
    (hidden + 1 parameters, whole on each TP rank) for the vocabulary projection, no reference model, no logits."""
    layout = Layout(tp=2, pp=2, dp=2)
    settings = ActorMemorySettings(tokens=4096, layout=layout, dtype=dtype, reference_model=True)
    host = Device("cpu", 512 * GB, "host")
    alone = plan_memory(MemoryInputs(TINY, settings, GPU_80GB, host=host))
    plan = plan_memory(MemoryInputs(TINY, settings, GPU_80GB, host=host, critic=CriticMemorySettings(TINY)))
    per_parameter = {"float32": 4 + 4 + 8, "bfloat16": 2 + 4 + 12}[dtype]  # weights, fp32 gradients, Adam (+ master)
    head = [0, TINY_VOCAB_TP2 - (128 + 1)]  # the last stage's output layer, less the value head
    for stage, (actor, critic) in enumerate(zip(plan.ranks, plan.critic_ranks)):
        assert actor == alone.ranks[stage]
        assert critic.parameters == TINY_STAGE_TP2[stage] - head[stage]
        assert critic.static == pytest.approx(actor.static - actor.reference - head[stage] * per_parameter)
        assert (critic.reference, critic.logits, critic.activations) == (0, 0, actor.activations)
    assert plan.ranks[1].logits > 0
    # Megatron's rank order (tensor, context, data parallel, then pipeline): ranks 0-3 on stage 0, 4-7 on stage 1
    assert [(d.actor.stage, d.critic.stage, d.count) for d in plan.devices] == [(0, 0, 4), (1, 1, 4)]
    worst = max(alone.ranks[stage].total + plan.critic_ranks[stage].total for stage in (0, 1))
    assert plan.needed == pytest.approx(worst) and plan.headline().startswith(f"{worst / GB:,.2f} GB per device")
    parts = {part.name: part.memory for part in plan.host_parts}
    assert parts["critic ranks"] == pytest.approx(parts["actor ranks"])  # 8 processes each, nothing offloaded
    text = plan.render()
    assert "  critic rank" in text and "  device total" in text and "a value head, no logits" in text
    assert "critic" not in alone.render()


def test_critic_offload_holds_one_models_tensors_on_the_device_and_the_other_on_the_host():
    settings = ActorMemorySettings(tokens=4096, layout=Layout(pp=2), dtype="bfloat16")
    host = Device("cpu", 512 * GB, "host")
    plan = plan_memory(MemoryInputs(TINY, settings, GPU_80GB, host=host,
                                    critic=CriticMemorySettings(TINY, offload=True)))
    for device in plan.devices:
        actor, critic = device.actor, device.critic
        assert device.total == pytest.approx(max(actor.step, critic.step) + actor.runtime + critic.runtime)
    offloaded = {part.name: part.memory for part in plan.host_parts}["critic.offload"]
    assert offloaded == pytest.approx(sum(max(d.actor.static, d.critic.static) for d in plan.devices))
    on_cpu = plan_memory(MemoryInputs(TINY, settings, Device("cpu", 24 * GB, "host"),
                                      critic=CriticMemorySettings(TINY, offload=True)))
    assert "critic.offload" not in {part.name for part in on_cpu.host_parts}  # the host is the device: it adds up
    assert "offloading saves nothing on CPU: the host is the ranks' device" in on_cpu.notes


def test_a_gae_configs_plan_has_the_critic_of_its_layout(tiny_model_dir):
    """The start-up check plans the critic's ranks in critic.tp/pp/cp/dp (0: the actor's) as ranks_config gives them,
    and a smaller critic layout leaves the devices past its ranks to the actor alone."""
    from rlsearch.config import TrainConfig
    from rlsearch.memory import train_memory_inputs

    config = TrainConfig()
    config.model.path, config.algo.advantage = str(tiny_model_dir), "gae"
    config.actor.tp, config.actor.pp = 2, 2
    config.critic.tp = 1
    inputs = train_memory_inputs(config, GPU_80GB)
    expected = config.critic.ranks_config(config.actor)
    critic = inputs.critic.settings(inputs.actor)
    assert (critic.layout.tp, critic.layout.pp, critic.layout.cp, critic.layout.dp, critic.layout.virtual_stages) == (
        expected.tp, expected.pp, expected.cp, expected.dp, expected.virtual_pipeline_stages) == (1, 2, 1, 1, 0)
    assert (critic.tokens, critic.reference_model) == (inputs.actor.tokens, False)
    plan = plan_memory(inputs)
    # the actor's four ranks: stage 0 on 0-1, stage 1 on 2-3; the critic's two ranks (tp1 pp2) beside 0 and 1
    assert sorted((d.actor.stage, d.critic and d.critic.stage, d.count) for d in plan.devices) == [
        (0, 0, 1), (0, 1, 1), (1, None, 2)]
    config.algo.advantage = "grpo"
    assert train_memory_inputs(config, GPU_80GB).critic is None


# actor.lora rank 4 on one layer of TINY on one of two tensor-parallel ranks, factor by factor (rlsearch.megatron.lora)
TINY_ADAPTERS_TP2 = {
    "qkv": 4 * 128 + (4 + 2 + 2) * 32 // 2 * 4,  # A [4, 128] whole (column-parallel), B [256 / 2, 4]: 1,024
    "proj": 4 * (4 * 32) // 2 + 128 * 4,  # A [4, 128 / 2] split like the weight's columns (row-parallel), B whole: 768
    "fc1": 4 * 128 + (2 * 256) // 2 * 4,  # gate and up rows of B split: 1,536
    "fc2": 4 * 256 // 2 + 128 * 4,  # 1,024
}


def test_lora_adapters_per_rank_at_tp2_pp2_are_counted_by_hand():
    from rlsearch.memory.shape import LORA_TARGETS, adapter_parameters

    assert adapter_parameters(TINY, tp=2, pp=2, rank=4, targets=LORA_TARGETS) == sum(TINY_ADAPTERS_TP2.values()) == 4352
    assert adapter_parameters(TINY, tp=2, pp=2, rank=4, targets=("qkv", "proj")) == 1024 + 768
    assert adapter_parameters(TINY, tp=1, pp=1, rank=0, targets=LORA_TARGETS) == 0
    moe = dataclasses.replace(TINY, experts=8, experts_per_token=2, expert_ffn=128)
    with pytest.raises(ValueError, match=r"actor\.lora\.targets has fc1, fc2: the model's MLPs are mixture-of-experts "
                                         r"layers, which take no adapters; adapt the attention only"):
        adapter_parameters(moe, tp=1, pp=1, rank=4, targets=LORA_TARGETS)


@pytest.mark.parametrize(
    ("dtype", "distributed", "adam"),
    [("float32", False, 8), ("bfloat16", False, 12), ("bfloat16", True, 12 / 2)],  # Adam's moments (+ fp32 master)
)
def test_a_lora_rank_holds_the_base_frozen_and_trains_only_its_adapters(dtype, distributed, adam):
    """The base weights stay, with no gradient or optimizer state; the adapters add their weights, fp32 gradients and
    Adam's states; algo.kl_coef > 0 adds no reference model (the actor with its adapters off)."""
    layout = Layout(tp=2, pp=2, dp=2)
    size = {"float32": 4, "bfloat16": 2}[dtype]
    settings = dict(layout=layout, dtype=dtype, distributed_optimizer=distributed, reference_model=True)
    full, lora = _plan(TINY, **settings), _plan(TINY, lora_rank=4, **settings)
    adapters = sum(TINY_ADAPTERS_TP2.values())
    for stage, rank in enumerate(lora.ranks):
        count = TINY_STAGE_TP2[stage]
        assert (rank.parameters, rank.adapters) == (count, adapters)
        assert (rank.weights, rank.gradients, rank.reference) == ((count + adapters) * size, adapters * 4, 0)
        assert rank.optimizer == pytest.approx(adam * adapters, rel=1e-12)
        assert full.ranks[stage].reference == count * size
        # all four linear layers adapted: each keeps its input as in full training, and the rank-wide A x
        assert rank.activations_per_token_layer == full.ranks[stage].activations_per_token_layer + 4 * 4 * size
    text = lora.render()
    assert f"parameters in {dtype}, frozen, and 4,352 of LoRA adapters (rank 4)" in text
    assert "none: the KL term's reference is the actor with its adapters off" in text


@pytest.mark.parametrize(("targets", "dropout", "linear_inputs"), [
    (None, 0.0, (128 + 128 + 128 + 256) * 4),  # full training: the inputs of qkv, proj (heads x dim), fc1, fc2
    (("qkv", "proj", "fc1", "fc2"), 0.0, (128 + 128 + 128 + 256) * 4 + 4 * 4 * 4),  # + each adapter's A x (rank 4)
    (("qkv", "proj"), 0.0, (128 + 128) * 4 + 2 * 4 * 4),  # the MLP's frozen linear layers keep no input
    (("qkv", "proj"), 0.1, (128 + 128) * (4 + 1) + 2 * 4 * 4),  # the dropped copy and a byte of mask an element
])
def test_a_lora_layer_keeps_the_inputs_of_its_adapted_linear_layers_only(targets, dropout, linear_inputs):
    from rlsearch.memory import coefficients_for
    from rlsearch.memory.plan import layer_activation_bytes

    coefficients = coefficients_for("cpu", "float32")
    full = layer_activation_bytes(TINY, ActorMemorySettings(tokens=1024), coefficients)
    lora = {} if targets is None else dict(lora_rank=4, lora_targets=targets, lora_dropout=dropout)
    parts = layer_activation_bytes(TINY, ActorMemorySettings(tokens=1024, **lora), coefficients)
    assert parts["linear_inputs"] == linear_inputs
    assert {name: value for name, value in parts.items() if name != "linear_inputs"} == {
        name: value for name, value in full.items() if name != "linear_inputs"}


def test_a_7b_model_that_trains_every_weight_does_not_fit_and_the_plan_suggests_lora():
    """Qwen2.5-7B in bf16 at 4,096 tokens with a KL term: 185 GB with every weight trained; rank-16 adapters on its
    linear layers (35.6M parameters) fit as they are, which the refusal says beside the full-weight change."""
    plan = _plan(SEVEN_B, dtype="bfloat16", reference_model=True)
    assert not plan.fits
    adapters = 28 * 16 * ((3584 + (28 + 2 * 4) * 128) + (28 * 128 + 3584) + (3584 + 2 * 18944) + (18944 + 3584))
    adapted = _plan(SEVEN_B, dtype="bfloat16", reference_model=True, lora_rank=16)
    rank, full = adapted.worst, plan.worst
    assert (rank.adapters, adapters) == (adapters, 35_553_280)
    assert rank.static == (full.parameters + adapters) * 2 + adapters * (4 + 12)  # no reference model
    assert adapted.fits and rank.total < 0.3 * full.total
    message = not_fitting_message(plan)
    assert message.endswith(f"; or train LoRA adapters instead of every weight: with actor.lora.rank=16, "
                            f"{adapted.needed / GB:,.2f} GB (a learning rate about 10x full fine-tuning's: "
                            "docs/training.md)")
    # at 32k tokens the adapters fit only with recomputation too; a LoRA actor is not told to train adapters
    long = _plan(SEVEN_B, tokens=32_768, dtype="bfloat16", lora_rank=16)
    assert not long.fits
    assert "or train LoRA adapters" not in not_fitting_message(long)
    assert "with actor.lora.rank=16 actor.recompute=full" in not_fitting_message(_plan(SEVEN_B, tokens=32_768,
                                                                                       dtype="bfloat16"))


def test_a_lora_configs_plan_counts_its_adapters_and_no_reference_model(tiny_model_dir):
    from rlsearch.config import TrainConfig
    from rlsearch.memory import train_memory_inputs

    config = TrainConfig()
    config.model.path, config.algo.kl_coef = str(tiny_model_dir), 0.01
    config.actor.tp, config.actor.pp = 2, 2
    config.actor.lora.rank, config.actor.lora.targets, config.actor.lora.dropout = 4, ["qkv", "fc2"], 0.05
    inputs = train_memory_inputs(config, GPU_80GB)
    assert (inputs.actor.lora_rank, inputs.actor.lora_targets, inputs.actor.lora_dropout) == (4, ("qkv", "fc2"), 0.05)
    plan = plan_memory(inputs)
    for rank in plan.ranks:
        assert (rank.adapters, rank.reference) == (TINY_ADAPTERS_TP2["qkv"] + TINY_ADAPTERS_TP2["fc2"], 0)
    config.actor.lora.rank = 0
    assert plan_memory(train_memory_inputs(config, GPU_80GB)).ranks[0].reference > 0
