"""The tests' models: the tiny random-init shapes of rlsearch.data.tiny_model with a small vocabulary, the first
TEST_VOCAB_RANKS ranks of the real Qwen2 BPE (the same pre-tokenisation, chat template and special tokens).

A tiny model with the whole vocabulary (151,643 ranks) spends almost all of its time and memory on its embedding and
output layers: 39M of its parameters, the sampler's and the loss's passes over the vocabulary, checkpoints of 0.44 GB
with Adam's state, weight syncs of 156 MB. With 16,384 ranks a 4-step training run took 50 s instead of 98 here
(steps 2-4 s instead of 4-9 s). The tests of the real tokenizer itself, the README's default run and the benches'
own runs keep the whole vocabulary.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

TEST_VOCAB_RANKS = 16384
TEST_VOCAB_SIZE = 16_512  # the model's rows: the ranks and the three special tokens, padded to a multiple of 128
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe")  # the MoE modules' models (tests/integration/conftest.py)


def model_spec(**fields):
    """A TinyModelSpec of the tests' vocabulary; `fields` as TinyModelSpec's."""
    from rlsearch.data.tiny_model import TinyModelSpec

    return TinyModelSpec(vocab_ranks=TEST_VOCAB_RANKS, **fields)


def make_test_model(out: str | os.PathLike, **fields) -> Path:
    """A random-init model dir of `model_spec(**fields)` at `out`."""
    from rlsearch.data.tiny_model import make_tiny_model

    return make_tiny_model(out, model_spec(**fields))


def linked_model(model: Path, out: Path, but: tuple[str, ...] = ()) -> Path:
    """A model dir at `out` of symbolic links to the files of `model`, but those named in `but` (the caller writes
    its own: writing through a link would change `model`)."""
    out.mkdir()
    for path in model.iterdir():
        if path.name not in but:
            os.symlink(path, out / path.name)
    return out


def shared_test_model(**fields) -> Path:
    """The model of `model_spec(**fields)`, built once in the temporary directory (the suite's scratch: test.sh sets
    TMPDIR) and shared by the lanes and the training drivers they run."""
    shape = model_spec(**fields)
    key = hashlib.sha1(repr(sorted(asdict(shape).items())).encode()).hexdigest()[:10]
    root = Path(tempfile.gettempdir()) / "rlsearch-test-models"
    root.mkdir(exist_ok=True)
    path = root / f"tiny-{shape.architecture}-v{TEST_VOCAB_RANKS}-{key}"
    with (root / f"{path.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other lane builds it, or has built it
        if not (path / "config.json").is_file():
            from rlsearch.data.tiny_model import make_tiny_model

            partial = path.with_name(path.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            make_tiny_model(partial, shape)
            partial.rename(path)
    return path


def model_override(**fields) -> str:
    """The `model.path=` override that points a training driver (`rlsearch train`, the run script) at
    `shared_test_model(**fields)`."""
    return f"model.path={shared_test_model(**fields)}"
