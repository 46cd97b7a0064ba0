"""Where the actor ranks and the rollout engines run on the Ray cluster (`trainer.placement`), and a check that the
rollout engines can reach the retriever from there."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..config import ConfigError, ToolsConfig

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Placement:
    pool_options: dict[str, Any] = field(default_factory=dict)  # EnginePool keyword arguments (placement)
    actor_options: dict[str, Any] = field(default_factory=dict)  # ActorRanks keyword arguments


def plan_placement(
    placement: str, world: int, gpus: int, ray_address: str, num_engines: int = 1, tensor_parallel_size: int = 1,
) -> Placement:
    """colocated: ActorRanks packs the ranks; the EnginePool makes its own placement group (one bundle of
    `tensor_parallel_size` CPUs, and GPUs with `gpus`, per engine) wherever Ray finds room.
    split: one placement group of two bundles that Ray must put on two different nodes (STRICT_SPREAD): bundle 0
    holds every actor rank (so TP/PP/DP peers share a node), bundle 1 every rollout engine (num_engines x
    tensor_parallel_size CPUs, and GPUs). Ray reserves both at once: no node picked by hand, no race with other
    jobs."""
    import ray
    from ray.util.placement_group import placement_group

    pool_options: dict[str, Any] = {"gpus_per_rank": gpus}
    if placement != "split":
        return Placement(pool_options=pool_options)
    engine_ranks = num_engines * tensor_parallel_size
    bundles = [{"CPU": world, "GPU": world * gpus}, {"CPU": engine_ranks, "GPU": engine_ranks * gpus}]
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
            f"another node with {need[1]} for the {num_engines} rollout engine(s) x TP{tensor_parallel_size}, but "
            f"the Ray cluster at {ray_address} has {len(nodes)} node(s) ({have}). Add a node "
            "(ray start --address HEAD:6379) or set trainer.placement=colocated"
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
        pool_options={**pool_options, "placement_group": split, "bundle_index": 1},
        actor_options={"placement_group": split, "bundle_index": 0},
    )


def describe_placement(placement: str, actor_workers: list, engines: list) -> tuple[str, list[str]]:
    """A line saying where the actor ranks and the rollout engines (`EnginePool.engines`) run, and each engine's
    node IP."""
    import ray

    ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    actor_nodes = ray.get([worker.node_id.remote() for worker in actor_workers])
    engine_nodes = ray.get([engine.node_id.remote() for engine in engines])

    def spans(nodes: list[str]) -> str:
        listed = []
        for node in dict.fromkeys(nodes):  # in index order
            indices = [index for index, on in enumerate(nodes) if on == node]
            contiguous = len(indices) > 1 and indices == list(range(indices[0], indices[-1] + 1))
            numbers = f"{indices[0]}-{indices[-1]}" if contiguous else ",".join(map(str, indices))
            listed.append(f"{numbers} on node {node[:8]} ({ips.get(node, '?')})")
        return ", ".join(listed)

    line = f"[rlsearch] placement {placement}: actor ranks {spans(actor_nodes)}; rollout engines {spans(engine_nodes)}"
    return line, [ips.get(node, "?") for node in engine_nodes]


def check_retriever_reachable(tools: ToolsConfig, rollout_ips: list[str]) -> None:
    """A retriever on this machine's loopback is out of reach of a rollout engine on another machine."""
    import ray

    retriever_host = urlsplit(tools.retriever.url).hostname if "search" in tools.enabled else None
    here = ray.util.get_node_ip_address()
    elsewhere = sorted({ip for ip in rollout_ips if ip != here})
    if retriever_host in _LOOPBACK and elsewhere:
        raise ConfigError(
            f"'tools.retriever.url' is {tools.retriever.url} (this machine's loopback: the trainer's local retriever "
            f"when the key is empty), but rollout engines run on {', '.join(elsewhere)} and cannot reach it. Run the "
            "retriever where the workers can reach it (rlsearch serve-retriever --host 0.0.0.0) and set "
            "tools.retriever.url=http://NODE:PORT"
        )
