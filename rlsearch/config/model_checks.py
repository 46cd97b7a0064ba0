"""The checks of a config against what it runs on: the model at model.path (its layers, heads and experts, which the
actor's layout must split) and the cluster's devices and dtype. The driver and the converter run them at start-up,
once they know the model and the devices; the config alone is checked by validate.py."""

from __future__ import annotations

import json
from pathlib import Path

from .loader import ConfigError
from .schema import ActorConfig, TrainConfig

# config.json's dropout probabilities that mbridge maps to Megatron's attention_dropout and hidden_dropout
MEGATRON_DROPOUT_KEYS = ("attention_dropout", "hidden_dropout")
# the files a HuggingFace tokenizer of the supported models is built from: one of these sets (transformers builds an
# empty tokenizer from a dir without any, and every prompt comes out empty)
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


def check_optimizer_offload_dtype(actor: ActorConfig, dtype: str) -> None:
    if actor.optimizer_offload_fraction > 0 and dtype == "float32":
        raise ConfigError(
            f"'actor.optimizer_offload_fraction' is {actor.optimizer_offload_fraction} with float32 weights "
            "(model.dtype): Megatron's hybrid optimizer offloads the distributed optimizer's float32 main copies of "
            "bfloat16 weights, and float32 weights have none (it refuses them: \"can't optimize a non-leaf Tensor\"); "
            "use model.dtype=bfloat16 or actor.optimizer_offload_fraction=0"
        )


def check_actor_devices(actor: ActorConfig, has_gpus: bool, dtype: str) -> None:
    """ConfigError when the actor's memory settings cannot run on the cluster's devices or in the model dtype
    (`dtype`, model.dtype resolved: auto follows the devices). Checked by the driver once it knows whether the cluster
    has GPUs, before any rank starts."""
    check_optimizer_offload_dtype(actor, dtype)
    if has_gpus and actor.lora.rank and actor.transformer_impl == "auto":
        raise ConfigError(
            f"'actor.lora.rank' is {actor.lora.rank} with actor.transformer_impl=auto on a cluster with GPUs: auto "
            "builds Transformer Engine's layer spec there, whose fused linear layers the adapters do not wrap yet; set "
            "actor.transformer_impl=local")
    if has_gpus:
        return
    if actor.activation_offload != "none":
        raise ConfigError(
            f"'actor.activation_offload' is {actor.activation_offload} but the cluster has no GPU: offloading moves "
            "activations from GPU memory to host memory, where a CPU rank keeps them already; use "
            "actor.activation_offload=none (actor.recompute saves memory on CPU)"
        )
    if actor.recompute == "selective" and "moe_act" in actor.recompute_modules:
        raise ConfigError(
            "'actor.recompute_modules' has moe_act but the cluster has no GPU: without one the actor builds the local "
            "layer spec, whose experts are not grouped-GEMM (Megatron recomputes the experts' activation only "
            "there); recompute moe (the whole MoE layer) instead"
        )


def read_hf_config(model_dir: str | Path) -> dict:
    """config.json of the HF model dir `model_dir`; ConfigError naming the file where it is no JSON object."""
    return _read_json_object(Path(model_dir) / "config.json")


def _read_json_object(path: Path) -> dict:
    try:
        found = json.loads(path.read_bytes())
    except json.JSONDecodeError as error:
        problem = f"not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}"
    except UnicodeDecodeError as error:
        problem = f"not UTF-8 text: byte {error.object[error.start]:#04x} at offset {error.start}"
    else:
        if isinstance(found, dict):
            return found
        problem = f"a JSON {type(found).__name__}, not an object"
    raise ConfigError(f"{path} is {problem}; restore the file (e.g. from the model's download)")


def _num_experts(hf_config: dict) -> int:
    """Routed experts per MoE layer of an HF config (0: a dense model)."""
    return hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0


def model_layout_problem(model_dir: str | Path, tp: int, pp: int, virtual_pipeline_stages: int = 0,
                         prefix: str = "", ep: int = 1, cp: int = 1) -> str | None:
    """Why tensor x pipeline (x virtual stages) x expert parallel `tp` x `pp` x `ep` cannot split the HF model at
    `model_dir`, or None. Keys are named with `prefix` ("actor." for a run's config, "" for the converter's flags)."""
    config = read_hf_config(model_dir)
    experts = _num_experts(config)
    if not experts and ep > 1:
        return f"{prefix}ep={ep} needs a mixture-of-experts model; {model_dir} is dense ({config.get('model_type')})"
    if experts:
        if experts % ep:
            return f"{prefix}ep={ep} must divide the {experts} experts of {model_dir}"
        if tp > 1:
            return (
                f"{prefix}tp={tp} with the mixture-of-experts model {model_dir}: MoE layers under tensor parallelism "
                "need sequence parallelism, which the actor does not run (the CPU layer spec's norms refuse it, and "
                f"the actor selects response positions from whole-sequence hidden states); use {prefix}tp=1 and "
                f"split the experts with {prefix}ep"
            )
        if cp > 1:
            return f"{prefix}cp={cp} with the mixture-of-experts model {model_dir}: not supported; use {prefix}cp=1"
    heads = config.get("num_attention_heads")
    stages = pp * max(virtual_pipeline_stages, 1)
    for value, key, size, flag in (
        (heads, "num_attention_heads", tp, "tp"),
        (config.get("num_key_value_heads") or heads, "num_key_value_heads", tp, "tp"),
        (config.get("vocab_size"), "vocab_size", tp, "tp"),
        (config.get("num_hidden_layers"), "num_hidden_layers", stages, "pp"),
    ):
        if value is not None and value % size:
            what = f"{prefix}{flag}={size}" if flag == "tp" or stages == pp else (
                f"{prefix}pp x {prefix}virtual_pipeline_stages={stages}")
            return f"{what} must divide {key}={value} of {model_dir}; choose another {prefix}{flag}"
    return None


def check_model_dir(path: str, key: str = "model.path") -> None:
    """`model.path` (or `key`) must be a HuggingFace model dir (the train, SFT and eval configs name one) whose
    config.json is a JSON object. `check_model_files` checks what a run loads from it besides."""
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"'{key}' is not a HuggingFace model dir (no config.json): {path}; "
            f"build the embedded default with: rlsearch make-tiny-model --out {path}"
        )
    read_hf_config(path)


def check_model_files(path: str, key: str = "model.path") -> None:
    """What a run loads from the model dir at `path` (the value of `key`), checked at start-up before anything
    starts: config.json, the tokenizer and the safetensors weights. ConfigError naming the file that would fail."""
    check_model_dir(path, key)
    model_dir = Path(path)
    _check_tokenizer_files(model_dir, key)
    _check_safetensors(model_dir, key)
    from transformers import AutoTokenizer  # last: the other checks read a few bytes, this imports transformers

    try:
        AutoTokenizer.from_pretrained(model_dir)
    except Exception as error:  # whatever transformers raises, the message says which dir and why
        raise ConfigError(f"'{key}': the tokenizer of {model_dir} does not load: {type(error).__name__}: "
                          f"{error}") from None


def check_train_model_files(config: TrainConfig) -> None:
    """`check_model_files` of a GRPO run's model dirs: model.path's, and critic.model.path's when it trains one."""
    check_model_files(config.model.path)
    if config.algo.advantage == "gae" and config.critic.model.path:
        check_model_files(config.critic.model.path, "critic.model.path")


def dropout_turned_off(config: TrainConfig) -> str:
    """The start-up line saying that actor.dropout=off trains without the dropout the config.json of the model (or of
    the critic's) has; empty where it has none, or with actor.dropout=model."""
    if config.actor.dropout == "model":
        return ""
    dirs = [config.model.path]
    if config.algo.advantage == "gae" and config.critic.model.path not in ("", config.model.path):
        dirs.append(config.critic.model.path)
    found = []
    for model_dir in dirs:
        hf_config = read_hf_config(model_dir)
        dropout = [f"{key} {hf_config[key]}" for key in MEGATRON_DROPOUT_KEYS if hf_config.get(key)]
        if dropout:
            found.append(f"{Path(model_dir) / 'config.json'} ({', '.join(dropout)})")
    if not found:
        return ""
    return (f"[rlsearch] actor.dropout=off: training without the dropout of {' and '.join(found)}, as the logprob "
            "passes and the engines run; actor.dropout=model trains with it")


def _check_tokenizer_files(model_dir: Path, key: str) -> None:
    """One of TOKENIZER_FILES' sets is there, and its JSON files parse (a JSON error names its file and line)."""
    if not any(all((model_dir / name).is_file() for name in files) for files in TOKENIZER_FILES):
        found = [name for files in TOKENIZER_FILES for name in files if (model_dir / name).is_file()]
        sets = ", ".join(" with ".join(files) for files in TOKENIZER_FILES)
        raise ConfigError(
            f"'{key}' ({model_dir}) has no tokenizer: none of {sets}"
            + (f" (only {', '.join(found)})" if found else "")
            + "; copy the tokenizer files of the model it was made from into it")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json"):
        if (model_dir / name).is_file():
            _read_json_object(model_dir / name)


def _check_safetensors(model_dir: Path, key: str) -> None:
    """Every *.safetensors file whole (its header's tensors end where the file ends), and every shard the index names
    present: read from the headers, no tensor loaded."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"'{key}' ({model_dir}) holds no *.safetensors file: the actor and the engines load the "
                          "model's weights from safetensors")
    for path in files:
        problem = _safetensors_problem(path)
        if problem:
            raise ConfigError(f"{path} {problem}; download or convert it again")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = set(_read_json_object(index).get("weight_map", {}).values())
        missing = sorted(shard for shard in shards if not (model_dir / shard).is_file())
        if missing:
            raise ConfigError(f"{index} names {len(missing)} shard(s) that are not there: {', '.join(missing)}; "
                              "download them")


def _safetensors_problem(path: Path) -> str | None:
    """Why `path` is no whole safetensors file (an 8-byte little-endian header length, the JSON header of each
    tensor's data_offsets, the data), or None."""
    size = path.stat().st_size
    with path.open("rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if size < 8 or 8 + length > size:
            return f"is truncated or no safetensors file: {size:,} bytes, too few for its header"
        header = file.read(length)
    try:
        tensors = {name: entry for name, entry in json.loads(header).items() if name != "__metadata__"}
        data_end = 8 + length + max((entry["data_offsets"][1] for entry in tensors.values()), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
        return f"has a damaged header ({type(error).__name__}: {error})"
    if size < data_end:
        return f"is truncated: {size:,} bytes, and its header's tensors end at byte {data_end:,}"
    if size > data_end:
        return f"is no whole safetensors file: {size:,} bytes, and its header's tensors end at byte {data_end:,}"
    return None


def check_same_tokenizer(policy_dir: str, critic_dir: str) -> None:
    """The critic scores the policy's token ids: its model dir must hold the same vocabulary (ConfigError naming both
    dirs and a token they disagree on)."""
    from transformers import AutoTokenizer

    policy, critic = (AutoTokenizer.from_pretrained(path).get_vocab() for path in (policy_dir, critic_dir))
    if policy == critic:
        return
    differing = sorted(set(policy.items()) ^ set(critic.items()), key=lambda item: item[1])[0]
    raise ConfigError(
        f"'critic.model.path' ({critic_dir}) has another tokenizer than model.path ({policy_dir}): "
        f"{len(critic)} against {len(policy)} tokens, e.g. {differing[0]!r} is id {critic.get(differing[0])} "
        f"in the critic's and {policy.get(differing[0])} in the policy's. The critic scores the policy's token "
        "ids: give it a model of the same tokenizer, or leave critic.model.path empty (the policy's weights)")


def check_model_layout(model_dir: str | Path, actor: ActorConfig, routing_replay: str = "none",
                       prefix: str = "actor.") -> None:
    """ConfigError when the actor's layout (the critic's: `prefix` "critic.") cannot split the model, or routing
    replay is asked of a dense model (checked at start-up, before any rank starts)."""
    problem = model_layout_problem(model_dir, actor.tp, actor.pp, actor.virtual_pipeline_stages, prefix=prefix,
                                   ep=actor.ep, cp=actor.cp)
    if problem:
        raise ConfigError(problem)
    if routing_replay != "none" and not _num_experts(read_hf_config(model_dir)):
        raise ConfigError(f"'algo.routing_replay' is {routing_replay} but {model_dir} is a dense model (no experts "
                          "to route); use algo.routing_replay=none")
    problem = _memory_settings_problem(model_dir, actor) or _lora_problem(model_dir, actor)
    if problem:
        raise ConfigError(problem)


def _memory_settings_problem(model_dir: str | Path, actor: ActorConfig) -> str | None:
    """Why recomputation or offloading as configured does not fit the model at `model_dir` (None: it does)."""
    config = read_hf_config(model_dir)
    layers = config.get("num_hidden_layers") or 0
    stage_layers = layers // (actor.pp * max(actor.virtual_pipeline_stages, 1))
    where = "a pipeline stage" if actor.virtual_pipeline_stages < 2 else "a virtual pipeline stage"
    count = actor.recompute_num_layers
    if actor.recompute == "full" and actor.recompute_method == "uniform" and stage_layers % count:
        return (f"'actor.recompute_num_layers' ({count}) must divide the {stage_layers} layers of {where} with "
                f"actor.recompute_method=uniform (groups of {count} layers recompute together)")
    if actor.recompute == "full" and actor.recompute_method == "block" and count > stage_layers:
        return (f"'actor.recompute_num_layers' ({count}) is more than the {stage_layers} layers of {where} "
                "(actor.recompute_method=block recomputes that many layers per stage)")
    if actor.recompute == "selective":
        modules = set(actor.recompute_modules)
        experts = _num_experts(config)
        moe_modules = sorted(modules & {"moe", "moe_act", "shared_experts"})
        if moe_modules and not experts:
            return (f"'actor.recompute_modules' has {', '.join(moe_modules)} but {model_dir} is a dense model (no MoE "
                    "layers to recompute); use core_attn, mlp or layernorm")
        if "shared_experts" in modules and not config.get("shared_expert_intermediate_size"):
            return (f"'actor.recompute_modules' has shared_experts but the MoE model {model_dir} has no shared "
                    "experts; use moe")
        dense_layers = config.get("mlp_only_layers") or (config.get("decoder_sparse_step") or 1) > 1
        if "mlp" in modules and experts and not dense_layers:
            return (f"'actor.recompute_modules' has mlp but every layer of {model_dir} is a MoE layer (mlp recomputes "
                    "dense MLPs); use moe")
    if actor.activation_offload == "layer" and layers < 2:
        return (f"'actor.activation_offload' is layer but {model_dir} has {layers} layer: the layer offload keeps the "
                "last layer's activations on the device, so it needs at least two")
    return None


def _lora_problem(model_dir: str | Path, actor: ActorConfig) -> str | None:
    """Why actor.lora's targets do not fit the model at `model_dir` (None: they do): a MoE model's MLPs are experts,
    which the adapters do not wrap."""
    mlp_targets = [target for target in ("fc1", "fc2") if target in actor.lora.targets]
    if actor.lora.rank and mlp_targets and _num_experts(read_hf_config(model_dir)):
        return (f"'actor.lora.targets' has {' and '.join(mlp_targets)} but the MLPs of {model_dir} are "
                "mixture-of-experts layers: adapters on experts are not supported (vLLM has no expert LoRA on CPU "
                "either); adapt the attention only (actor.lora.targets=[qkv,proj])")
    return None
