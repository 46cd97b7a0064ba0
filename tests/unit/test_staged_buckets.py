"""A sender's bucket files in /dev/shm (rlsearch/weights/shm.py `StagedBuckets`): rewritten sync after sync, each
bucket read back bit-exact through its checksum, and no file left behind by a sender that is gone."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import torch

from rlsearch.weights.bucket import FlatLayout, unflatten_tensors
from rlsearch.weights.shm import SENDER_FILE_PREFIX, SENDER_FILES_AT_ONCE, STAGING_DIR, StagedBuckets


def _read(staged: dict) -> dict[str, torch.Tensor]:
    """What an engine worker loads from a staged file (its checksum verified)."""
    layout = FlatLayout.from_wire(staged["layout"])
    flat = torch.from_numpy(np.fromfile(staged["path"], dtype=np.uint8)[:layout.total_bytes].copy())
    return {name: tensor.clone() for name, tensor in unflatten_tensors(layout, flat)}


def _bucket(index: int, elements: int) -> list[tuple[str, torch.Tensor]]:
    # odd element counts of 2-byte and 4-byte tensors: the flat form pads between them
    return [(f"a{index}", torch.full((elements,), float(index + 1), dtype=torch.bfloat16)),
            (f"b{index}", torch.arange(elements + 3, dtype=torch.float32) * (index + 1))]


def test_buckets_reuse_a_ring_of_files_and_read_back_exactly_over_stale_bytes():
    staged = StagedBuckets()
    try:
        for sync, sizes in enumerate(([1001, 7, 513, 3, 999, 5], [5, 999, 3, 513, 7, 1001])):
            staged.start(keep_all=False)
            paths = []
            for index, elements in enumerate(sizes):
                tensors = _bucket(index + 10 * sync, elements)
                descriptor = staged.stage(tensors)
                paths.append(descriptor["path"])
                received = _read(descriptor)  # the file held a larger bucket before: stale bytes in the padding
                assert list(received) == [name for name, _ in tensors]
                for name, tensor in tensors:
                    assert torch.equal(received[name].view(torch.uint8), tensor.view(torch.uint8))
            assert len(set(paths)) == SENDER_FILES_AT_ONCE
            assert paths[SENDER_FILES_AT_ONCE] == paths[0]  # bucket j goes to file j mod SENDER_FILES_AT_ONCE
        staged.start(keep_all=True)  # staged first: every bucket of the sync in its own file
        paths = [staged.stage(_bucket(index, 11))["path"] for index in range(SENDER_FILES_AT_ONCE + 2)]
        assert len(set(paths)) == SENDER_FILES_AT_ONCE + 2
    finally:
        staged.close()
    assert not any(Path(path).exists() for path in paths)


def test_a_new_sender_removes_the_files_of_senders_that_are_gone():
    host = socket.gethostname()
    gone = Path(STAGING_DIR) / f"{SENDER_FILE_PREFIX}{host}-{2**22 + 12345}-0"  # above the kernel's pid limit
    alive = Path(STAGING_DIR) / f"{SENDER_FILE_PREFIX}{host}-{os.getpid()}-99"
    for path in (gone, alive):
        path.write_bytes(b"x")
    try:
        StagedBuckets().close()
        assert not gone.exists()
        assert alive.exists()
    finally:
        for path in (gone, alive):
            path.unlink(missing_ok=True)
