"""trainer.placement=split on a real multi-node Ray cluster: two raylets on this machine (`ray.cluster_utils.Cluster`,
run by this module as a helper process), which the trainer joins from its own process through trainer.ray_address.
With the head node alone the trainer stops with an error naming trainer.placement; with a second node a TP2 actor
lands on one node, the rollout worker on the other, and the weights cross nodes every step.

The pytest process never touches the cluster: it may hold its own local Ray (the `ray_local` fixture), and
`Cluster.shutdown` resets process-wide Ray state. The cluster runs with Ray's token auth on and a private temp dir:
Ray records the newest cluster's address under its temp dir, where a plain `ray.init()` elsewhere on this machine
would otherwise find and join it.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from tests.constants import REPO_ROOT, SHORT_TURNS

# each node: 2 logical CPUs (the TP2 actor's bundle fits one node, the rollout worker's CPU the other) and room in
# the object store for the weight buckets in flight (weights.bucket_mb=64, two at a time)
NODE = {"num_cpus": 2, "node_ip_address": "127.0.0.1", "object_store_memory": 400 * 1024 * 1024}


def serve_cluster() -> None:
    """A head node (prints the address and its node id), a second node after a line on stdin (prints both node ids);
    runs until stdin closes."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False, head_node_args={**NODE, "include_dashboard": False})
    try:
        print(cluster.address, cluster.head_node.node_id, flush=True)
        if sys.stdin.readline():
            cluster.add_node(**NODE)
            cluster.wait_for_nodes()
            print(*(node.node_id for node in cluster.list_all_nodes()), flush=True)
            sys.stdin.read()
    finally:
        cluster.shutdown()


def _train(address: str, output_dir, assets, env: dict, *extra: str) -> subprocess.CompletedProcess:
    model, data, index_cache = assets
    return subprocess.run([
        sys.executable, "-m", "rlsearch", "train", "--config", "examples/configs/search_grpo_tiny.yaml",
        f"model.path={model}", f"data.train_files=[{data.train}]", f"tools.retriever.corpus={data.corpus}",
        f"tools.retriever.index_cache_dir={index_cache}", f"trainer.ray_address={address}",
        "trainer.placement=split", "actor.tp=2", SHORT_TURNS, f"trainer.output_dir={output_dir}", *extra,
    ], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_split_placement_multinode_trains_two_steps(tmp_path, tiny_model_dir, toy_data):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    started = time.perf_counter()
    ray_tmp = tempfile.mkdtemp(prefix="rlsray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    # the nodes listen on 127.0.0.1 only; Ray keeps a 127.0.0.1 address as it is (instead of swapping in this
    # machine's outward IP) when this is set before ray is imported
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    env.pop("RAY_ADDRESS", None)
    assets = (tiny_model_dir, toy_data, tmp_path / "bm25")
    cluster_log = tmp_path / "cluster.log"
    with cluster_log.open("w") as log:
        helper = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.test_multinode"], cwd=REPO_ROOT, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
        )
    watchdog = threading.Timer(600, helper.kill)  # a cluster that never comes up ends the reads below
    watchdog.start()
    try:
        address, head_id = (helper.stdout.readline().split() + ["", ""])[:2]
        assert head_id, f"the cluster did not start:\n{cluster_log.read_text()[-3000:]}"
        # one node: split cannot place the rollout engines apart from the actor; the trainer says so and stops
        # (no tools: the error comes right after joining the cluster)
        single = _train(address, tmp_path / "single", assets, env, "tools.enabled=[]")
        assert single.returncode == 2, single.stdout[-3000:] + single.stderr[-3000:]
        assert "'trainer.placement' is split: it needs one node with 2 CPU for the 2 actor ranks and another node " \
               "with 1 CPU for the 1 rollout engine(s) x TP1" in single.stderr
        assert "has 1 node(s) (127.0.0.1: 2 CPU, 0 GPU)" in single.stderr

        helper.stdin.write("add a node\n")
        helper.stdin.flush()
        node_ids = helper.stdout.readline().split()
        assert len(node_ids) == 2, f"the second node did not start:\n{cluster_log.read_text()[-3000:]}"
        watchdog.cancel()
        cluster_up = time.perf_counter() - started
        out = tmp_path / "run"
        result = _train(address, out, assets, env, "trainer.total_steps=2", "data.batch_size=2", "weights.bucket_mb=64",
                        "trainer.log_trajectories=false")
    finally:
        watchdog.cancel()
        helper.stdin.close()  # the helper shuts the cluster down
        try:
            helper.wait(timeout=120)
        except subprocess.TimeoutExpired:
            helper.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(f"\nsingle-node check and cluster up in {cluster_up:.0f} s, split-placement run of 2 steps in "
          f"{time.perf_counter() - started - cluster_up:.0f} s")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 2/2 | reward" in result.stdout

    placed = re.search(r"\[rlsearch\] placement split: actor ranks 0-1 on node (\w+) \(127\.0\.0\.1\); "
                       r"rollout engines 0 on node (\w+) \(127\.0\.0\.1\)", result.stdout)
    assert placed, result.stdout[-3000:]
    print(placed.group(0))
    actor_node, rollout_node = placed.groups()
    assert actor_node != rollout_node
    assert {actor_node, rollout_node} == {node_id[:8] for node_id in node_ids}

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("actor/update_ok")] == [(1, 1.0), (2, 1.0)]
    assert max(e.value for e in events.Scalars("weights/logprob_mismatch_max")) < 1e-4


if __name__ == "__main__":
    serve_cluster()
