"""Conversion between HuggingFace model dirs and Megatron distributed checkpoints (torch_dist, layout.py).

- `hf_to_mcore`: tp x pp x ep ranks each build their shard of the model, load the HF safetensors into it
  through mbridge and save together: a model-only checkpoint for that layout. With expert parallelism (MoE models)
  the ep data-parallel replicas each hold and save their own experts.
- `mcore_to_hf`: one rank (TP1PP1EP1) loads the "model" part of any checkpoint, a training run's or a
  converted one (Megatron reshards whatever layout it was saved from; expert weights are keyed by global expert id,
  so every expert of an expert-parallel checkpoint lands in the one rank), exports HF-named tensors through mbridge
  and writes safetensors shards with their index, config and tokenizer; `verify` compares the logits of the written
  dir (HF transformers) with the Megatron model's. With `critic` it writes a gae run's critic (CRITIC_DIR) the same
  way, as a token-classification model of one label (its value head as `score`), and `verify` compares its values.
  With `peft_adapter_dir` it writes a LoRA run's adapters (actor.lora) as a PEFT adapter of the HF model, beside
  the merged model or alone.

Ranks are processes on gloo over 127.0.0.1 (one GPU each when there are enough GPUs, else CPU), started by
rlsearch.megatron.processes (on CPU forked from a server that imports Megatron once). An error in a rank surfaces in
the caller: CheckpointError for a checkpoint that does not fit, ConversionError with the rank's traceback otherwise.
Output is staged in `.incomplete_<name>` beside the output dir and renamed when complete, so a failed conversion
leaves no half-written model behind. Nothing here imports megatron until a rank runs.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.model_checks import model_layout_problem
from .layout import (
    CRITIC_DIR,
    HF_DIR,
    MODEL_DIR,
    TRAINER_STATE,
    CheckpointError,
    checkpoint_model_shape,
    copy_hf_metadata,
    model_shape,
    read_manifest,
    shape_differences,
    write_manifest,
)

# --dtype names -> HF config / manifest names
OUTPUT_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
SAFETENSORS_INDEX = "model.safetensors.index.json"
VERIFY_BATCH_SHAPE = (2, 32)  # sequences x tokens of random ids


@dataclass
class PeftExport:
    """The PEFT adapter `mcore_to_hf` wrote (`peft_adapter_dir`)."""

    adapter_dir: Path
    num_tensors: int  # lora_A and lora_B of each HF module adapted
    num_bytes: int
    modules: list[str]  # the HF modules' own names (adapter_config.json's target_modules)


@dataclass
class HFExport:
    """What `mcore_to_hf` wrote: the HF model (none when only a PEFT adapter was asked for: `out_dir` None, counts 0)
    and the PEFT adapter, if asked for."""

    out_dir: Path | None
    num_tensors: int
    num_bytes: int  # tensor data
    num_shards: int
    dtype: str  # float32 | bfloat16
    # verify only: max |logits of the written HF model - Megatron model's| (a critic's: its values)
    max_logit_diff: float | None
    peft: PeftExport | None = None


class ConversionError(RuntimeError):
    """A conversion rank failed; the message carries its error and traceback."""


def hf_to_mcore(
    hf_dir: str | os.PathLike, out_dir: str | os.PathLike, tp: int = 1, pp: int = 1, ep: int = 1,
) -> Path:
    """Write the HF model at `hf_dir` as a model-only Megatron checkpoint for tensor x pipeline x expert parallel
    `tp` x `pp` x `ep` into `out_dir` (new or empty); `ep` > 1 (MoE models only) splits the experts over that many
    data-parallel ranks. Returns `out_dir`."""
    from ..megatron.model import MOE_ARCHITECTURES

    source, out = Path(hf_dir), Path(out_dir)
    config = _read_hf_config(source)
    if not list(source.glob("*.safetensors")):
        raise ValueError(f"{source} has no *.safetensors weights; re-save the model with "
                         "save_pretrained(dir, safe_serialization=True)")
    if min(tp, pp, ep) < 1:
        raise ValueError(f"tp={tp}, pp={pp} and ep={ep} must be >= 1")
    problem = model_layout_problem(source, tp, pp, ep=ep)
    if problem:
        raise ValueError(problem)
    dtype = _checkpoint_dtype(config)
    with _staged(out) as staging:
        megatron_dir = staging / MODEL_DIR
        megatron_dir.mkdir()
        impl, *_ = _spawn(_save_model_shard, (tp, pp, ep), (str(source), str(megatron_dir), dtype))
        copy_hf_metadata(source, staging / HF_DIR)
        layout = {"tp": tp, "pp": pp, "dp": ep, "virtual_pipeline_stages": 0}
        if config["model_type"] in MOE_ARCHITECTURES:
            layout["ep"] = ep  # a dense model has no experts to split
        write_manifest(staging, {
            "kind": "model", "step": None, "layout": layout,
            "architecture": config["model_type"], "dtype": dtype, "transformer_impl": impl, "contents": ["model"],
        })
        return _publish(staging, out)


def mcore_to_hf(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike | None,
    dtype: str | None = None,
    base_hf_dir: str | os.PathLike | None = None,
    verify: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    critic: bool = False,
    peft_adapter_dir: str | os.PathLike | None = None,
) -> HFExport:
    """Write the model of the checkpoint `ckpt_dir` (any layout) as a HuggingFace model dir `out_dir` (new or empty)
    loadable by transformers and vLLM. `dtype`: "bf16" or "fp32" (None: the checkpoint's). Config and tokenizer come
    from the checkpoint's hf/ dir, or from `base_hf_dir` when given. `verify`: compare the logits of the written
    model (transformers, fp32) with the Megatron model's on a fixed batch; the max |diff| is in the result.

    `critic`: write the run's critic instead (algo.advantage=gae checkpoints), as an `<Arch>ForTokenClassification`
    model of one label that transformers loads with the critic's values and a run takes as critic.model.path; its
    config and tokenizer from the model it started from (`_critic_base`; `base_hf_dir` when given).

    `peft_adapter_dir`: also (or, with `out_dir` None, only) write a LoRA checkpoint's adapters as a PEFT adapter dir
    (adapter_config.json, adapter_model.safetensors) that `peft.PeftModel.from_pretrained` loads onto the base model
    the run started from (`rlsearch.megatron.lora.peft_named_factors`)."""
    ckpt = Path(ckpt_dir)
    out = Path(out_dir) if out_dir is not None else None
    adapter = Path(peft_adapter_dir) if peft_adapter_dir is not None else None
    if out is None and adapter is None:
        raise ValueError("nothing to write: give the HF model's output dir (--out), a PEFT adapter dir "
                         "(--peft-adapter), or both")
    if out is None and verify:
        raise ValueError("--verify compares the logits of the written HF model with the checkpoint's: give --out")
    if out is not None and adapter is not None and out.resolve() == adapter.resolve():
        raise ValueError(f"--out and --peft-adapter are both {out}: write the model and the adapter to two dirs")
    manifest = read_manifest(ckpt, check_contents=True)
    contents = manifest.get("contents", [])
    lora = None if critic else manifest.get("lora")
    if adapter is not None and critic:
        raise ValueError("--peft-adapter with --critic: the critic trains all its weights (actor.lora adapts the "
                         "policy only); convert the critic without --peft-adapter")
    if adapter is not None and not lora:
        raise CheckpointError(f"{ckpt} holds no LoRA adapters (its manifest.json has no actor.lora: the run trained "
                              "every weight), so there is no PEFT adapter to write; convert its weights with --out "
                              "alone")
    if critic and "critic" not in contents:
        raise CheckpointError(f"{ckpt} holds no critic (contents: {contents}): only a run with algo.advantage=gae "
                              "trains one; convert its policy without --critic")
    if not critic and "model" not in contents:
        raise CheckpointError(f"{ckpt} holds no model weights (contents: {contents})")
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise ValueError(f"unknown dtype '{dtype}'; choose one of {', '.join(OUTPUT_DTYPES)}")
    checkpoint_dtype = manifest.get("dtype")
    if checkpoint_dtype not in OUTPUT_DTYPES.values():
        raise CheckpointError(f"{ckpt}: unsupported checkpoint dtype {checkpoint_dtype!r} in its manifest")
    out_dtype = OUTPUT_DTYPES[dtype] if dtype else checkpoint_dtype
    policy_metadata = ckpt / HF_DIR
    metadata_dir = Path(base_hf_dir) if base_hf_dir else _critic_base(ckpt) if critic else policy_metadata
    config = _read_hf_config(metadata_dir)
    # the policy's architecture and shape are the checkpoint's: a critic started from a model of its own is checked
    # on load
    if not critic or metadata_dir == policy_metadata:
        differences = shape_differences(checkpoint_model_shape(ckpt, manifest), model_shape(metadata_dir))
        if differences:
            raise CheckpointError(f"{ckpt} holds another model than {metadata_dir} describes ({'; '.join(differences)})"
                                  "; pass the base model the run was trained from as --base-hf-dir, or leave it out "
                                  "to take the checkpoint's own hf/ copy")
    with _staged(out) as staging, _staged(adapter) as adapter_staging:
        if staging is not None:
            copy_hf_metadata(metadata_dir, staging)
            config["dtype"] = out_dtype
            config.pop("torch_dtype", None)  # the transformers 4 name of the same field
            if critic:
                config.update(_value_model_config(config))
                for name in ("id2label", "label2id"):  # num_labels is the one that counts: a label per value
                    config.pop(name, None)
            (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (written,) = _spawn(_export_model, (1, 1, 1), (
            str(metadata_dir), str(ckpt / (CRITIC_DIR if critic else MODEL_DIR)),
            None if staging is None else str(staging), checkpoint_dtype,
            manifest.get("transformer_impl", "auto"), out_dtype, max_shard_bytes, verify, critic,
            _load_remedy(base_hf_dir is not None), lora,
            None if adapter_staging is None else str(adapter_staging), _run_model_path(ckpt),
        ))
        peft = written.pop("peft")
        if peft is not None:
            peft = PeftExport(adapter_dir=_publish(adapter_staging, adapter), **peft)
        return HFExport(out_dir=None if staging is None else _publish(staging, out), dtype=out_dtype, peft=peft,
                        **written)


def write_hf_model(
    named_tensors: Iterable[tuple[str, Any]], out_dir: str | os.PathLike, base_hf_dir: str | os.PathLike,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write HF-named tensors (e.g. an actor's `hf_state_dict`) as a HuggingFace model dir `out_dir` (new or empty),
    with config, generation config and tokenizer from `base_hf_dir` (the model they were trained from), in its
    dtype. Staged and renamed like the conversions."""
    import torch

    out = Path(out_dir)
    config = _read_hf_config(Path(base_hf_dir))
    with _staged(out) as staging:
        copy_hf_metadata(base_hf_dir, staging)
        _write_safetensors(named_tensors, staging, getattr(torch, _checkpoint_dtype(config)), max_shard_bytes)
        return _publish(staging, out)


# ---- parent side --------------------------------------------------------------------------------------------


def _read_hf_config(hf_dir: Path) -> dict[str, Any]:
    """config.json of an HF dir of a supported architecture; ValueError saying what is wrong otherwise."""
    from ..megatron.model import check_architecture

    path = hf_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{hf_dir} is not a HuggingFace model dir (no config.json)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from error
    check_architecture(config.get("model_type"), str(hf_dir))
    return config


def _checkpoint_dtype(config: dict[str, Any]) -> str:
    """The HF model's dtype as the checkpoint's: bfloat16 stays, anything else is stored as float32 (lossless)."""
    return "bfloat16" if (config.get("dtype") or config.get("torch_dtype")) == "bfloat16" else "float32"


def _run_config(ckpt: Path) -> dict[str, Any]:
    """The run config a run checkpoint's trainer state holds ({} for a converted checkpoint)."""
    state_path = ckpt / TRAINER_STATE
    return json.loads(state_path.read_text()).get("config", {}) if state_path.is_file() else {}


def _run_model_path(ckpt: Path) -> str | None:
    """The model.path the run of a checkpoint started from (None when its trainer state does not tell)."""
    return _run_config(ckpt).get("model", {}).get("path") or None


def _critic_base(ckpt: Path) -> Path:
    """The HF dir a run checkpoint's critic was built from: the run's critic.model.path (the config in its trainer
    state), else the policy's model (the checkpoint's hf/ copy)."""
    path = _run_config(ckpt).get("critic", {}).get("model", {}).get("path") or ""
    if not path:
        return ckpt / HF_DIR
    if not (Path(path) / "config.json").is_file():
        raise CheckpointError(f"the critic of {ckpt} started from critic.model.path {path}, which is not here (no "
                              "config.json); pass that model's dir (its config and tokenizer) as --base-hf-dir")
    return Path(path)


def _load_remedy(base_given: bool) -> str:
    """What to do about a checkpoint the conversion rank cannot load (its sha256 and shape were checked before)."""
    if base_given:
        return "--base-hf-dir must be the model the run started from, and the checkpoint intact"
    return ("the checkpoint is damaged (it predates the sha256 in manifest.json that tell it) or not of the model its "
            "hf/ dir describes: convert an earlier checkpoint (a step_* dir beside it)")


def _value_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config.json keys of a critic written as transformers' token-classification model of one label: its value
    head is `score`, and it shares no weight with the embedding."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    architecture = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.get(config["model_type"])
    if architecture is None:
        raise CheckpointError(f"transformers has no token-classification model of '{config['model_type']}' to "
                              "write a critic as")
    return {"architectures": [architecture], "num_labels": 1, "tie_word_embeddings": False}


def _staging_dir(out: Path) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output {out} exists and is not empty; choose a new directory or remove it")
    staging = out.parent / f".incomplete_{out.name}"
    shutil.rmtree(staging, ignore_errors=True)  # left by a conversion that was killed
    staging.mkdir(parents=True)
    return staging


@contextmanager
def _staged(out: Path | None) -> Iterator[Path | None]:
    """A fresh staging dir beside `out` (see `_staging_dir`), removed when the block fails; the block publishes it.
    None for no `out` (nothing of that kind to write)."""
    if out is None:
        yield None
        return
    staging = _staging_dir(out)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _publish(staging: Path, out: Path) -> Path:
    if out.exists():
        out.rmdir()
    staging.rename(out)
    return out


def _spawn(job: Callable[..., Any], layout: tuple[int, int, int], job_args: tuple) -> list[Any]:
    """Run `job(*job_args)` on tp x pp x ep Megatron rank processes (`layout`; data-parallel size ep, each replica
    holding its own experts); their results in rank order."""
    import multiprocessing

    from torch.multiprocessing.spawn import ProcessException

    from ..megatron.parallel import PROCESS_GROUP_TIMEOUT_S
    from ..megatron.processes import rank_start_method, start_rank_processes
    from ..rendezvous import Rendezvous

    world_size = math.prod(layout)
    gpus = _gpu_per_rank(world_size)
    queue = multiprocessing.get_context(rank_start_method(on_gpus=gpus is not None)).SimpleQueue()
    rendezvous = Rendezvous("127.0.0.1", PROCESS_GROUP_TIMEOUT_S)  # listening until the ranks are done
    try:
        start_rank_processes(_rank_main, (world_size, rendezvous.address, layout, gpus, queue, job, job_args),
                             world_size, on_gpus=gpus is not None)
    except ProcessException as failure:
        reports = _drain(queue)
        failed = next((report for report in reports if report[1] == "error"), None)
        if failed is None:  # killed without a Python error (e.g. out of memory)
            raise ConversionError(f"a conversion process died: {failure}") from None
        rank, _, (kind, message, trace) = failed
        if kind == CheckpointError.__name__:
            raise CheckpointError(message) from None
        raise ConversionError(f"conversion rank {rank} failed: {kind}: {message}\n{trace}") from None
    finally:
        rendezvous.close()
    return [result for _, _, result in sorted(_drain(queue), key=lambda report: report[0])]


def _drain(queue) -> list[tuple[int, str, Any]]:
    reports = []
    while not queue.empty():
        reports.append(queue.get())
    return reports


def _gpu_per_rank(world_size: int) -> list[str] | None:
    """A visible GPU id for every rank, or None (the ranks run on CPU) when there are fewer GPUs than ranks."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < world_size:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(index) for index in range(torch.cuda.device_count())]
    return ids[:world_size]


# ---- rank side ----------------------------------------------------------------------------------------------


def _rank_main(
    rank: int, world_size: int, rendezvous: str, layout: tuple[int, int, int], gpus: list[str] | None, queue,
    job: Callable[..., Any], job_args: tuple,
) -> None:
    """Entry of a rank process: join the group, run the job, report its result or error to the parent."""
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[rank] if gpus else ""  # before anything initialises CUDA
    import warnings

    import torch
    import torch.distributed as dist

    from ..devices import cpu_threads_each
    from ..megatron.parallel import init_megatron_parallel

    # megatron and mbridge warn about missing Apex / Transformer Engine and deprecated settings on every import, and
    # the checkpoint code uses deprecated torch APIs: noise in a command's output
    warnings.filterwarnings("ignore", module=r"(megatron|mbridge)\.")
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        torch.set_num_threads(cpu_threads_each(world_size))
        tp, pp, ep = layout
        init_megatron_parallel(rank, world_size, rendezvous, tp=tp, pp=pp, ep=ep)
        queue.put((rank, "ok", job(*job_args)))
    except BaseException as error:  # torch's checkpoint errors derive from BaseException
        queue.put((rank, "error", (type(error).__name__, str(error), traceback.format_exc())))
        sys.exit(1)  # the parent reports the error
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _build(hf_dir: str, dtype: str, transformer_impl: str, value_model: bool = False):
    """mbridge bridge and this rank's (random-initialised) model chunk for the HF config at `hf_dir`; `value_model`:
    a critic's (a value head for the output layer)."""
    import torch

    from ..megatron.cpu_compat import cuda_available
    from ..megatron.model import build_model_chunks, make_bridge, resolve_transformer_impl

    try:
        impl = resolve_transformer_impl(transformer_impl)
    except RuntimeError as error:
        raise CheckpointError(f"the checkpoint was written with the Transformer Engine layer spec; convert it on a "
                              f"machine with a GPU and a working Transformer Engine ({error})") from None
    bridge = make_bridge(hf_dir, getattr(torch, dtype), impl, on_cpu=not cuda_available(), value_model=value_model)
    # the head's initialisation is overwritten by the checkpoint's
    return bridge, build_model_chunks(bridge, value_head_seed=0 if value_model else None), impl


def _save_model_shard(hf_dir: str, megatron_dir: str, dtype: str) -> str:
    """Rank job of hf_to_mcore; returns the layer spec used."""
    from ..megatron.parallel import model_sharded_state, save_sharded

    bridge, chunks, impl = _build(hf_dir, dtype, "auto")
    bridge.load_weights(chunks, hf_dir)
    save_sharded({"model": model_sharded_state(chunks)}, megatron_dir)
    return impl


def _export_model(
    hf_dir: str, megatron_dir: str, out_dir: str | None, checkpoint_dtype: str, transformer_impl: str, out_dtype: str,
    max_shard_bytes: int, verify: bool, value_model: bool, load_remedy: str, lora: dict | None,
    adapter_dir: str | None, base_model: str | None,
) -> dict[str, Any]:
    """Rank job of mcore_to_hf (a single rank): load the checkpoint's model (`value_model`: its critic; `lora`: the
    run's actor.lora, whose adapters the model holds and the export merges), write safetensors to `out_dir`
    (optionally verified) and the adapters as a PEFT adapter to `adapter_dir` (`base_model`: the run's model.path)."""
    import torch

    from ..config.schema import LoRAConfig
    from ..megatron.lora import install_adapters, peft_named_factors
    from ..megatron.model import export_hf_named
    from ..megatron.parallel import CheckpointLoadError, load_sharded, model_sharded_state

    bridge, (model,), _ = _build(hf_dir, checkpoint_dtype, transformer_impl, value_model)
    if lora:
        install_adapters(model, LoRAConfig(**lora), seed=0)  # their values come from the checkpoint
    try:
        state = load_sharded({"model": model_sharded_state([model])}, megatron_dir, load_remedy)
    except CheckpointLoadError as error:
        raise CheckpointError(str(error)) from None
    model.load_state_dict(state["model"])
    written: dict[str, Any] = {"num_tensors": 0, "num_bytes": 0, "num_shards": 0, "max_logit_diff": None}
    if out_dir is not None:
        written.update(_write_safetensors(export_hf_named(bridge, [model]), Path(out_dir), getattr(torch, out_dtype),
                                          max_shard_bytes))
        if verify:
            written["max_logit_diff"] = _max_logit_diff(model, out_dir, bridge.hf_config.vocab_size, value_model)
    written["peft"] = None if adapter_dir is None else _write_peft_adapter(
        peft_named_factors(bridge, model), Path(adapter_dir), getattr(torch, out_dtype), LoRAConfig(**lora),
        base_model)
    return written


def _write_peft_adapter(named: Iterable[tuple[str, Any]], out: Path, dtype, lora, base_model: str | None
                        ) -> dict[str, Any]:
    """adapter_config.json and adapter_model.safetensors of a PEFT LoRA adapter: the factors `named` (PEFT's names)
    and the config PEFT and vLLM read, whose lora_alpha / r is actor.lora's scale."""
    import torch
    from safetensors.torch import save_file

    from ..megatron.lora import peft_config

    tensors = {name: tensor.to("cpu", dtype, copy=True, memory_format=torch.contiguous_format)
               for name, tensor in named}
    save_file(tensors, str(out / PEFT_WEIGHTS), metadata={"format": "pt"})
    config = {**peft_config(lora.rank, lora.alpha, tensors, lora.dropout), "base_model_name_or_path": base_model}
    modules = config["target_modules"]
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return {"num_tensors": len(tensors), "num_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "modules": modules}


def _write_safetensors(named: Iterable[tuple[str, Any]], out: Path, dtype, max_shard_bytes: int) -> dict[str, int]:
    """Stream HF tensors into model-0000i-of-0000n.safetensors shards of at most `max_shard_bytes` (a larger tensor
    gets a shard of its own) plus model.safetensors.index.json."""
    import torch
    from safetensors.torch import save_file

    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total_bytes = 0

    def flush() -> None:
        save_file(pending, str(out / f"shard-{len(shards)}.tmp"), metadata={"format": "pt"})
        shards.append(list(pending))
        pending.clear()

    for name, tensor in named:
        # a standalone contiguous copy: exported tensors can be views sharing storage (safetensors refuses those)
        tensor = tensor.to("cpu", dtype, copy=True, memory_format=torch.contiguous_format)
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
            pending_bytes = 0
        pending[name] = tensor
        pending_bytes += size
        total_bytes += size
    if pending:
        flush()
    weight_map = {}
    for index, names in enumerate(shards):
        filename = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        (out / f"shard-{index}.tmp").rename(out / filename)
        weight_map.update(dict.fromkeys(names, filename))
    index_file = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / SAFETENSORS_INDEX).write_text(json.dumps(index_file, indent=2) + "\n")
    return {"num_tensors": len(weight_map), "num_bytes": total_bytes, "num_shards": len(shards)}


def _max_logit_diff(model, hf_dir: str, vocab_size: int, value_model: bool = False) -> float:
    """Max |logit diff| between the written HF model (transformers, fp32) and the Megatron model on a fixed batch of
    random token ids (unpacked causal attention); `value_model`: a critic's values, transformers' token-classification
    logits of its one label. transformers runs MoE experts one after another, as Megatron's SequentialMLP does, rather
    than through its default grouped GEMM (on the tiny models both stay within 8e-7)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
    from transformers.utils import logging

    logging.disable_progress_bar()
    tokens = torch.randint(0, vocab_size, VERIFY_BATCH_SHAPE, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        megatron_logits = model(tokens.to(device), positions.to(device), None).float().cpu()
        auto_class = AutoModelForTokenClassification if value_model else AutoModelForCausalLM
        hf_model = auto_class.from_pretrained(hf_dir, dtype=torch.float32, experts_implementation="eager").eval()
        hf_logits = hf_model(tokens).logits.float()
    return (hf_logits - megatron_logits).abs().max().item()
