"""The shm transport's /dev/shm check on a real, small tmpfs: a full tmpfs kills the process writing a mapped page
(SIGBUS), so a sync must stop before it with an error saying what it needs and how to get it."""

from __future__ import annotations

import os
import subprocess

import pytest

from rlsearch.config import ConfigError
from rlsearch.weights.shm import StagingSpaceError, check_staging_space

MIB = 2**20


@pytest.fixture
def small_tmpfs(tmp_path):
    """An 8 MiB tmpfs (as root in this sandbox; skipped where mounting is not permitted)."""
    mount = tmp_path / "shm"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_tmpfs_stops_the_sync_with_what_it_needs(small_tmpfs):
    check_staging_space(str(small_tmpfs), 4 * MIB, "a test's buckets")  # room: nothing raised
    (small_tmpfs / "other").write_bytes(os.urandom(6 * MIB))  # someone else's 6 MiB: about 2 MiB left
    with pytest.raises(StagingSpaceError) as raised:
        check_staging_space(str(small_tmpfs), 4 * MIB, "1 sender(s) x 4 staged buckets x 1 MiB (weights.bucket_mb)")
    message = str(raised.value)
    assert f"{small_tmpfs} on " in message
    assert "has 0.00 GiB free, but 1 sender(s) x 4 staged buckets x 1 MiB (weights.bucket_mb) need 0.00 GiB" in message
    for advice in ("--shm-size=2g", "medium: Memory", "lower weights.bucket_mb", "weights.transport=broadcast"):
        assert advice in message
    assert isinstance(raised.value, ConfigError)  # the command line reports it as bad input, without a traceback
    check_staging_space(str(small_tmpfs), 1 * MIB, "a test's buckets")



def test_a_sender_bucket_file_past_a_full_tmpfs_is_an_error_not_a_killed_sender(small_tmpfs):
    """Past the check (another process filled the tmpfs meanwhile), a sender's bucket file that does not fit raises
    StagingSpaceError when it is made, instead of a SIGBUS at the write that reaches a page the tmpfs cannot give.
    In a child process, so that a regression kills the child and not the test run."""
    import sys

    (small_tmpfs / "other").write_bytes(os.urandom(6 * MIB))
    script = (
        "import torch\n"
        "from rlsearch.weights import shm\n"
        f"shm.STAGING_DIR = {str(small_tmpfs)!r}\n"
        "staged = shm.StagedBuckets()\n"
        "staged.start(keep_all=False)\n"
        "try:\n"
        "    staged.stage([('w', torch.ones(4 * 2**20, dtype=torch.uint8))])\n"
        "except shm.StagingSpaceError as error:\n"
        "    print('refused:', error)\n"
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])  # -7 would be SIGBUS
    assert "refused:" in child.stdout and "the sender's next weight bucket file need 0.00 GiB" in child.stdout
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["other"]  # the file that did not fit is gone
