"""The device, backend and layer spec a process picks from its own devices, and Transformer Engine counted as present
only when its torch part imports.

No GPU exists here: `torch.cuda.is_available` / `device_count` and Ray's GPU assignment (`_ray_gpu_ids`) are
stand-ins for one, patched per test. The real Ray worker path is in tests/integration/test_gpu_stack_ray_workers.py."""

from __future__ import annotations

import sys

import pytest
import torch

from rlsearch import devices
from rlsearch.doctor import _transformer_engine
from rlsearch.megatron.model import resolve_transformer_impl


@pytest.fixture
def gpus(monkeypatch):
    """A stand-in node with `count` visible GPUs (0: none) where Ray assigned `assigned` (None: not a Ray worker)."""

    def make(count: int, assigned: list | None = None, visible: str | None = None, local_rank: str | None = None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(devices, "_ray_gpu_ids", lambda: assigned)
        for name, value in (("CUDA_VISIBLE_DEVICES", visible), ("LOCAL_RANK", local_rank)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)

    return make


def test_no_gpu_means_cpu_and_gloo(gpus):
    gpus(0, assigned=[3])
    assert devices.local_gpu_index() is None
    assert devices.local_device() == torch.device("cpu")
    assert devices.process_group_backend() == "gloo"


def test_ray_narrowed_visible_devices_to_the_assignment(gpus):
    gpus(1, assigned=["5"], visible="5")  # Ray's default: this worker sees only its GPU
    assert devices.local_gpu_index() == 0
    assert devices.local_device() == torch.device("cuda", 0)
    assert devices.process_group_backend() == "nccl"


def test_ray_left_every_gpu_visible(gpus):
    # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1: the node's GPUs are all visible, the worker must pick its own
    gpus(8, assigned=[6], visible=None)
    assert devices.local_gpu_index() == 6
    gpus(4, assigned=["7", "5"], visible="4,5,6,7")  # the node was started on GPUs 4-7; the first assigned wins
    assert devices.local_gpu_index() == 1


def test_a_ray_worker_given_no_gpu_computes_on_cpu_although_gpus_are_visible(gpus):
    gpus(8, assigned=[], visible=None)
    assert devices.local_gpu_index() is None
    assert devices.process_group_backend() == "gloo"


def test_an_assignment_outside_the_visible_devices_is_an_error(gpus):
    gpus(2, assigned=["3"], visible="0,1")
    with pytest.raises(RuntimeError, match="Ray assigned this worker GPU 3 but CUDA_VISIBLE_DEVICES=0,1"):
        devices.local_gpu_index()


def test_outside_ray_local_rank_picks_the_gpu(gpus):
    gpus(4, assigned=None, local_rank="2")
    assert devices.local_gpu_index() == 2
    gpus(1, assigned=None, local_rank=None)  # a spawned converter rank: its one visible GPU
    assert devices.local_gpu_index() == 0


@pytest.fixture
def fake_transformer_engine(tmp_path, monkeypatch):
    """A broken Transformer Engine on sys.path: its top-level package swallows the ImportError of its torch part, as
    the real one does, and the torch part cannot import (an extension built for another torch)."""
    package = tmp_path / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text(
        '__version__ = "9.9.9"\ntry:\n    from . import pytorch\nexcept ImportError:\n    pass\n'
    )
    (package / "pytorch" / "__init__.py").write_text(
        'raise ImportError("transformer_engine_torch.so: undefined symbol: _ZN3c104cuda9SetDeviceEab")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [name for name in sys.modules if name.startswith("transformer_engine")]:
        monkeypatch.delitem(sys.modules, name)
    yield package
    for name in [name for name in sys.modules if name.startswith("transformer_engine")]:
        del sys.modules[name]


def test_a_broken_transformer_engine_is_not_present(fake_transformer_engine, gpus):
    import transformer_engine  # the top-level import succeeds: what the old check looked at

    assert transformer_engine.__version__ == "9.9.9"
    status = devices.transformer_engine_status()
    assert status.state == "broken"
    assert "undefined symbol" in status.detail
    assert "--no-build-isolation" in status.problem()
    gpus(1, assigned=[0], visible="0")
    assert resolve_transformer_impl("auto") == "local"
    with pytest.raises(RuntimeError, match="transformer_engine.pytorch does not import"):
        resolve_transformer_impl("transformer_engine")


def test_doctor_fails_a_broken_transformer_engine_and_says_what_to_do(fake_transformer_engine):
    check = _transformer_engine()
    assert (check.name, check.status) == ("transformer_engine", "FAIL")
    assert "transformer_engine.pytorch does not import (ImportError: transformer_engine_torch.so" in check.detail
    assert "pip install --no-build-isolation -r requirements/gpu-te.txt" in check.detail


def test_a_working_transformer_engine_is_picked_on_a_gpu_only(fake_transformer_engine, gpus):
    (fake_transformer_engine / "pytorch" / "__init__.py").write_text("")
    assert devices.transformer_engine_status() == devices.TransformerEngineStatus("ok", "9.9.9")
    assert _transformer_engine().status == "ok"
    gpus(0)
    assert resolve_transformer_impl("auto") == "local"
    with pytest.raises(RuntimeError, match="needs a GPU and this process has none"):
        resolve_transformer_impl("transformer_engine")
    gpus(1, assigned=[0], visible="0")
    assert resolve_transformer_impl("auto") == "transformer_engine"


def test_an_absent_transformer_engine_is_optional(monkeypatch, gpus):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # not importable, whatever is installed here
    assert devices.transformer_engine_status().state == "absent"
    check = _transformer_engine()
    assert (check.status, check.detail.split(":")[0]) == ("--", "not installed")
    gpus(1, assigned=[0], visible="0")
    assert resolve_transformer_impl("auto") == "local"
    with pytest.raises(RuntimeError, match="Transformer Engine is not installed"):
        resolve_transformer_impl("transformer_engine")
