"""A checkpoint written onto a full disk (a real 24 MiB tmpfs, mounted in a private mount namespace): the write fails
with an error that says the disk is full and which checkpoint is intact; that one still loads, nothing is staged."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.constants import REPO_ROOT

SCENARIO = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    from rlsearch.checkpoint import CheckpointError, CheckpointStore, load_run_checkpoint

    run_dir, hf_dir = Path(sys.argv[1]), sys.argv[2]
    store = CheckpointStore(run_dir, keep=3)

    def writer(megabytes):
        def write_model(path):
            with open(Path(path) / "model.bin", "wb") as out:
                for _ in range(megabytes * 16):
                    out.write(b"w" * 65536)
        return write_model

    info = {"layout": {"tp": 1, "pp": 1, "dp": 1, "virtual_pipeline_stages": 0}, "architecture": "qwen2"}
    store.save(1, writer(1), {"sampler": {}, "seed": 1}, hf_dir, info)
    try:
        store.save(2, writer(24), {"sampler": {}, "seed": 1}, hf_dir, info)  # alone as large as the disk
    except CheckpointError as error:
        message = str(error)
    else:
        raise SystemExit("the second checkpoint did not fail on a full disk")
    newest, skipped = store.newest_complete()
    manifest, state = load_run_checkpoint(newest)
    left = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    print(json.dumps({"message": message, "newest": newest.name, "step": state["step"], "left": left}))
''')


def _in_private_tmpfs(mount_dir, command: list[str]) -> list[str]:
    """``command`` with a 24 MiB tmpfs on ``mount_dir``, seen by it alone (root: a mount namespace; otherwise a user
    namespace too)."""
    namespace = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--map-root-user", "--mount"]
    script = f'mount -t tmpfs -o size=24m tmpfs "{mount_dir}" && exec "$@"'
    return [*namespace, "sh", "-c", script, "sh", *command]


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare for a private tmpfs")
def test_a_full_disk_fails_the_checkpoint_and_keeps_the_previous_one(tmp_path, tiny_model_dir):
    import json

    mount_dir = tmp_path / "disk"
    mount_dir.mkdir()
    result = subprocess.run(
        _in_private_tmpfs(mount_dir, [sys.executable, "-c", SCENARIO, str(mount_dir / "run"), str(tiny_model_dir)]),
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["message"].startswith("writing checkpoint step_000002 failed, the disk is full under ")
    assert outcome["message"].endswith(f"the previous checkpoint {mount_dir / 'run' / 'checkpoints' / 'step_000001'} "
                                       "is intact")
    assert outcome["newest"] == "step_000001" and outcome["step"] == 1
    assert outcome["left"] == ["latest", "step_000001"]  # the partial step 2 is gone
    assert not any(mount_dir.iterdir()), "the tmpfs leaked out of its mount namespace"
