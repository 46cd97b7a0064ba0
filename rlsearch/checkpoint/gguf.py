"""GGUF (llama.cpp's single-file format) -> HuggingFace model dir, dequantised to float32.

`gguf_to_hf` checks the file before it loads anything: its architecture must be one rlsearch trains (llama, qwen2,
qwen3), every tensor's storage type one that transformers' GGUF loader dequantises (it reads llama, Qwen2 and Qwen3
files with the `gguf` package's numpy dequantize), and every model field of the metadata one the loader reads (a
field it would drop, such as a RoPE scaling, would make the HF model compute something other than the GGUF's). Then
transformers loads the file (tokenizer with its chat template, config, weights dequantised to float32), the weights go
into a plain model of the same class, and the dir is written with its tokenizer, generation config and a
gguf_conversion.json naming the source. Before the dir is published the written model is loaded back and its logits
on a fixed batch compared with the GGUF load's: the same float32 weights through the same code, so they must be
equal, bit for bit (a difference fails the conversion). Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import file_sha256
from .convert import VERIFY_BATCH_SHAPE, ConversionError, _publish, _staged

# GGUF general.architecture -> the HF model_type it loads as
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
CONVERSION_RECORD = "gguf_conversion.json"
# model fields of the metadata that the loader does not read into the config, checked here against what it built
HEAD_DIM_FIELDS = ("rope.dimension_count", "attention.key_length", "attention.value_length")
VERIFY_CONVERSATION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


class GGUFError(ValueError):
    """A GGUF file that cannot be converted; the message says why and what to do instead."""


@dataclass
class GGUFConversion:
    """What `gguf_to_hf` wrote."""

    out_dir: Path
    architecture: str  # HF model_type
    num_parameters: int
    num_bytes: int  # float32 tensor data written
    tensor_types: dict[str, int]  # GGUF storage type -> tensors of it
    max_logit_diff: float  # written dir vs transformers' GGUF load, float32 (0.0: equal)
    gguf_sha256: str


def gguf_to_hf(
    gguf_file: str | os.PathLike, out_dir: str | os.PathLike, progress: Callable[[str], None] | None = None,
) -> GGUFConversion:
    """Convert the GGUF `gguf_file` (llama, qwen2 or qwen3; any storage type transformers dequantises) into a
    float32 HuggingFace model dir `out_dir` (new or empty): safetensors, config, generation config, tokenizer with
    the GGUF's chat template. `progress` gets a line per step. GGUFError (a ValueError) for a file that cannot be
    converted; ConversionError when the written model's logits differ from the GGUF load's."""
    say = progress or (lambda line: None)
    source, out = Path(gguf_file), Path(out_dir)
    contents = _check_gguf(source)
    types = ", ".join(f"{count} {name}" for name, count in contents.tensor_types.items())
    say(f"read {source.name}: {contents.architecture}, {len(contents.tensor_names)} tensors ({types})")
    _require_loader()
    gguf_sha256 = file_sha256(source)
    with _staged(out) as staging:
        say("dequantising to float32 with transformers' GGUF loader")
        tokenizer, loaded = _load_gguf(source, contents)
        config = loaded.config
        say(f"writing {out}: {config.model_type}, {loaded.num_parameters() / 1e6:.1f}M parameters, float32")
        num_bytes = _save_plain(loaded, tokenizer, staging)
        say(f"verifying: the written model's logits against the GGUF load's on {VERIFY_BATCH_SHAPE[0]} x "
            f"{VERIFY_BATCH_SHAPE[1]} tokens")
        max_diff = _max_logit_diff(loaded, tokenizer, staging)
        if max_diff != 0.0:
            raise ConversionError(f"the written model's logits differ from transformers' load of {source} by up to "
                                  f"{max_diff:.3g}; nothing was written to {out}")
        conversion = GGUFConversion(
            out_dir=out, architecture=config.model_type, num_parameters=loaded.num_parameters(), num_bytes=num_bytes,
            tensor_types=contents.tensor_types, max_logit_diff=max_diff, gguf_sha256=gguf_sha256,
        )
        _write_record(staging, source, conversion)
        _publish(staging, out)
    return conversion


@dataclass(frozen=True)
class _Contents:
    """What the checks read from the file's header."""

    architecture: str  # GGUF general.architecture
    tensor_types: dict[str, int]  # storage type -> tensors of it, most first
    tensor_names: tuple[str, ...]
    head_dim_fields: dict[str, int]  # HEAD_DIM_FIELDS the file sets -> their values


def _check_gguf(gguf_file: Path) -> _Contents:
    """GGUFError unless the file is a GGUF of a supported architecture whose tensors the loader dequantises and
    whose model fields it reads."""
    reader = _reader(gguf_file)
    architecture = _field(reader, "general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise GGUFError(f"{gguf_file}: GGUF architecture '{architecture}' is not one rlsearch converts (supported: "
                        f"{', '.join(GGUF_ARCHITECTURES)}); convert the model's HuggingFace release instead, or a "
                        "GGUF of one of these architectures")
    types = Counter(tensor.tensor_type for tensor in reader.tensors)
    unreadable = [tensor_type for tensor_type in types if not _dequantisable(tensor_type)]
    if unreadable:
        found = ", ".join(f"{tensor_type.name} ({types[tensor_type]} tensors, e.g. "
                          f"{next(t.name for t in reader.tensors if t.tensor_type == tensor_type)})"
                          for tensor_type in unreadable)
        raise GGUFError(f"{gguf_file} stores tensors as {found}, which transformers' GGUF loader cannot dequantise; "
                        f"re-quantise the original model to a type it reads ({', '.join(_readable_types())}), e.g. "
                        "with llama.cpp's llama-quantize, or convert the model's HuggingFace release")
    _check_model_fields(reader, architecture, gguf_file)
    head_dim_fields = {suffix: _field(reader, f"{architecture}.{suffix}") for suffix in HEAD_DIM_FIELDS
                       if f"{architecture}.{suffix}" in reader.fields}
    return _Contents(architecture, {tensor_type.name: count for tensor_type, count in types.most_common()},
                     tuple(tensor.name for tensor in reader.tensors), head_dim_fields)


def _check_config(gguf_file: Path, contents: _Contents, config) -> None:
    """GGUFError unless transformers read the config as a supported model_type with the GGUF's head size."""
    if config.model_type not in GGUF_ARCHITECTURES.values():
        raise GGUFError(f"{gguf_file} loads as a '{config.model_type}' model, which rlsearch does not train "
                        f"(supported: {', '.join(GGUF_ARCHITECTURES.values())})")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for suffix, value in contents.head_dim_fields.items():
        if value != head_dim:
            raise GGUFError(f"{gguf_file}: {contents.architecture}.{suffix} is {value} but transformers' GGUF loader "
                            f"builds heads of {head_dim}, so it cannot load this file as it is meant; convert the "
                            "model's HuggingFace release instead")


# ---- reading the file ---------------------------------------------------------------------------------------


def _reader(gguf_file: Path):
    from gguf import GGUFReader

    if not gguf_file.is_file():
        raise GGUFError(f"{gguf_file} is not a file; pass the .gguf file itself")
    try:
        return GGUFReader(gguf_file)
    except (ValueError, KeyError) as error:  # bad magic, a version or a storage type gguf does not know
        raise GGUFError(f"{gguf_file} is not a GGUF file the gguf package reads ({error})") from None


def _field(reader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _dequantisable(tensor_type) -> bool:
    """Whether the gguf package's dequantize, which transformers' loader calls, handles this storage type: tried
    on one block of zeros, so the answer is the installed package's."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, dequantize

    _, block_bytes = GGML_QUANT_SIZES[tensor_type]
    try:
        dequantize(np.zeros((1, block_bytes), np.uint8), tensor_type)
    except NotImplementedError:
        return False
    return True


def _readable_types() -> list[str]:
    from gguf import GGMLQuantizationType

    return [tensor_type.name for tensor_type in GGMLQuantizationType if _dequantisable(tensor_type)]


def _check_model_fields(reader, architecture: str, gguf_file: Path) -> None:
    """GGUFError for a model field (`<architecture>.*`) the loader neither reads nor leaves to `_check_config`:
    dropping it would change what the model computes."""
    from transformers.integrations import GGUF_CONFIG_MAPPING

    read = GGUF_CONFIG_MAPPING[GGUF_ARCHITECTURES[architecture]]
    prefix = f"{architecture}."
    unread = [key for key in reader.fields if key.startswith(prefix)
              and key[len(prefix):] not in read and key[len(prefix):] not in HEAD_DIM_FIELDS]
    if unread:
        values = ", ".join(f"{key} = {_field(reader, key)!r}" for key in unread)
        raise GGUFError(f"{gguf_file} sets {values}, which transformers' GGUF loader does not read, so the converted "
                        "model would not compute what the GGUF does; convert the model's HuggingFace release instead")


# ---- loading, writing, checking ------------------------------------------------------------------------------


def _require_loader() -> None:
    from transformers.utils import is_accelerate_available, is_gguf_available

    missing = [name for name, available in (("gguf", is_gguf_available()), ("accelerate", is_accelerate_available()))
               if not available]
    if missing:
        raise ConversionError(f"transformers' GGUF loader needs {' and '.join(missing)}: run `bash scripts/setup.sh` "
                              "(requirements/cpu.txt and gpu.txt pin them)")


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars while transformers loads and saves in the block (the commands print a line per step). Its GGUF
    dequantisation bar is a tqdm of its own that no setting turns off, so the module's tqdm is swapped for the
    block."""
    from functools import partial

    from transformers import modeling_gguf_pytorch_utils
    from transformers.utils import logging

    bars_were_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    gguf_bar = modeling_gguf_pytorch_utils.tqdm
    modeling_gguf_pytorch_utils.tqdm = partial(gguf_bar, disable=True)
    try:
        yield
    finally:
        modeling_gguf_pytorch_utils.tqdm = gguf_bar
        if bars_were_on:
            logging.enable_progress_bar()


def _load_gguf(gguf_file: Path, contents: _Contents):
    """transformers' own load of the file: tokenizer and the float32 model (eval mode)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    location = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    config = AutoConfig.from_pretrained(**location)
    _check_config(gguf_file, contents, config)  # before the weights, which a wrong head size would not fit
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(**location)
        model, loading = AutoModelForCausalLM.from_pretrained(**location, config=config, dtype=torch.float32,
                                                              output_loading_info=True)
    if loading["missing_keys"]:
        raise GGUFError(f"{gguf_file} lacks weights the {type(model).__name__} needs: "
                        f"{', '.join(sorted(loading['missing_keys']))}; it is not a complete model")
    # the loader skips a tensor it has no parameter for (llama 3's rope_freqs, say), which would change the model
    placed = _gguf_names_of(model, contents.architecture)
    dropped = [name for name in contents.tensor_names if name not in placed]
    if dropped:
        raise GGUFError(f"{gguf_file} holds tensors {', '.join(dropped)} that transformers' {type(model).__name__} "
                        "has no place for, so the converted model would not compute what the GGUF does; convert the "
                        "model's HuggingFace release instead")
    return tokenizer, model.eval()


def _gguf_names_of(model, architecture: str) -> set[str]:
    """The GGUF names of the model's parameters, by the gguf package's name map (the one the loader uses)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(arch for arch, name in MODEL_ARCH_NAMES.items() if name == architecture)
    name_map = get_tensor_name_map(arch, model.config.num_hidden_layers)
    names = set()
    for key in model.state_dict():
        module, _, kind = key.rpartition(".")
        gguf_name = name_map.get_name(module)
        if gguf_name is not None:
            names.add(f"{gguf_name}.{kind}")
    return names


def _save_plain(loaded, tokenizer, out: Path) -> int:
    """Write the loaded weights from a plain model of the same class (transformers will not save the GGUF-quantised
    one), with the tokenizer and generation config; the bytes of tensor data written."""
    import torch
    from transformers import AutoModelForCausalLM

    config = loaded.config
    del config.quantization_config
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    with quiet_transformers():
        plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(parameter.numel() * parameter.element_size() for parameter in plain.parameters())


def _max_logit_diff(loaded, gguf_tokenizer, written_dir: Path) -> float:
    """Max |logit diff| between the written dir (loaded back by transformers) and the GGUF load on fixed random
    token ids; a ConversionError when the written tokenizer does not encode the chat prompt as the GGUF's does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_transformers():
        written_tokenizer = AutoTokenizer.from_pretrained(written_dir)
        written = AutoModelForCausalLM.from_pretrained(written_dir, dtype=torch.float32).eval()
    prompt = dict(conversation=VERIFY_CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False)
    if written_tokenizer.apply_chat_template(**prompt) != gguf_tokenizer.apply_chat_template(**prompt):
        raise ConversionError(f"the tokenizer written to {written_dir} encodes the chat prompt differently from the "
                              "GGUF's")
    tokens = torch.randint(0, loaded.config.vocab_size, VERIFY_BATCH_SHAPE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (written(tokens).logits - loaded(tokens).logits).abs().max().item()


def _write_record(out: Path, source: Path, conversion: GGUFConversion) -> None:
    from importlib.metadata import version

    record = {
        "source": source.name, "gguf_sha256": conversion.gguf_sha256, "architecture": conversion.architecture,
        "tensor_types": conversion.tensor_types, "dtype": "float32", "max_logit_diff": conversion.max_logit_diff,
        "converted_with": {package: version(package) for package in ("transformers", "gguf")},
    }
    (out / CONVERSION_RECORD).write_text(json.dumps(record, indent=2) + "\n")
