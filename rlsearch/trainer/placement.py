"""Where the actor ranks and the rollout worker run on the Ray cluster (`trainer.placement`), and a check that the
rollout worker can reach the retriever from there."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..config import ConfigError, ToolsConfig

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Placement:
    rollout_options: dict[str, Any]  # Ray options of the rollout worker
    actor_options: dict[str, Any] = field(default_factory=dict)  # ActorGroup keyword arguments


def plan_placement(placement: str, world: int, gpus: int, ray_address: str) -> Placement:
    """colocated: the rollout worker reserves no CPU and goes wherever Ray schedules it; ActorGroup packs the ranks.
    split: one placement group of two bundles that Ray must put on two different nodes (STRICT_SPREAD): bundle 0
    holds every actor rank (so TP/PP/DP peers share a node), bundle 1 the rollout worker, which asks a CPU there to
    have a real home. Ray reserves both at once: no node picked by hand, no race with other jobs."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if placement != "split":
        return Placement(rollout_options={"num_cpus": 0})
    bundles = [{"CPU": world, "GPU": world * gpus}, {"CPU": 1, "GPU": gpus}]
    bundles = [{key: float(value) for key, value in bundle.items() if value} for bundle in bundles]
    nodes = [node for node in ray.nodes() if node["Alive"]]
    homes = [
        {node["NodeID"] for node in nodes if all(node["Resources"].get(k, 0) >= v for k, v in bundle.items())}
        for bundle in bundles
    ]
    if not any(a != r for a in homes[0] for r in homes[1]):
        need = [" + ".join(f"{value:g} {key}" for key, value in bundle.items()) for bundle in bundles]
        have = "; ".join(
            f"{node['NodeManagerAddress']}: {node['Resources'].get('CPU', 0):g} CPU, "
            f"{node['Resources'].get('GPU', 0):g} GPU" for node in nodes
        )
        raise ConfigError(
            f"'trainer.placement' is split: it needs one node with {need[0]} for the {world} actor ranks and "
            f"another node with {need[1]} for the rollout worker, but the Ray cluster at {ray_address} has "
            f"{len(nodes)} node(s) ({have}). Add a node (ray start --address HEAD:6379) or set "
            "trainer.placement=colocated"
        )
    split = placement_group(bundles, strategy="STRICT_SPREAD")
    try:
        ray.get(split.ready(), timeout=600)
    except ray.exceptions.GetTimeoutError as error:
        raise ConfigError(
            f"'trainer.placement' is split: the Ray cluster did not free {bundles} on two nodes within 600 s "
            "(other jobs hold them?)"
        ) from error
    return Placement(
        rollout_options={"num_cpus": 1, "scheduling_strategy": PlacementGroupSchedulingStrategy(split, 1)},
        actor_options={"placement_group": split, "bundle_index": 0},
    )


def describe_placement(placement: str, actor_workers: list, rollout_worker) -> tuple[str, str]:
    """A line saying where the actor ranks and the rollout worker run, and the rollout worker's node IP."""
    import ray

    ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    actor_nodes = ray.get([worker.node_id.remote() for worker in actor_workers])
    rollout_node = ray.get(rollout_worker.node_id.remote())
    spans = []
    for node in dict.fromkeys(actor_nodes):  # in rank order
        ranks = [rank for rank, on in enumerate(actor_nodes) if on == node]
        contiguous = len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1))
        listed = f"{ranks[0]}-{ranks[-1]}" if contiguous else ",".join(map(str, ranks))
        spans.append(f"{listed} on node {node[:8]} ({ips.get(node, '?')})")
    rollout_ip = ips.get(rollout_node, "?")
    line = (f"[rlsearch] placement {placement}: actor ranks {', ranks '.join(spans)}, rollout worker on node "
            f"{rollout_node[:8]} ({rollout_ip})")
    return line, rollout_ip


def check_retriever_reachable(tools: ToolsConfig, rollout_ip: str) -> None:
    """A retriever on this machine's loopback is out of reach of a rollout worker on another machine."""
    import ray

    retriever_host = urlsplit(tools.retriever.url).hostname if "search" in tools.enabled else None
    if retriever_host in _LOOPBACK and rollout_ip != ray.util.get_node_ip_address():
        raise ConfigError(
            f"'tools.retriever.url' is {tools.retriever.url} (this machine's loopback: the trainer's local retriever "
            f"when the key is empty), but the rollout worker runs on {rollout_ip} and cannot reach it. Run the "
            "retriever where the workers can reach it (rlsearch serve-retriever --host 0.0.0.0) and set "
            "tools.retriever.url=http://NODE:PORT"
        )
