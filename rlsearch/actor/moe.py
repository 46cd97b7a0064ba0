"""The MoE layers of a rank's model chunks: how many tokens each expert receives (the load metrics) and Megatron's
router replay (algo.routing_replay=old: record the routing of the old-logprob pass, replay it in every update).

Every router's forward is observed through a hook: it reports (probs, routing_map [tokens, experts]). Replay goes
through Megatron's `RouterReplay` object on each router (built when `moe_enable_routing_replay` is set): its top-k
is recorded (RECORD) or taken from given indices (REPLAY_FORWARD) instead of computed; a recomputation in the backward
pass (actor.recompute) replays the routing of the forward pass it repeats.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..devices import local_device


class MoERouters:
    """The routers of `chunks` (a rank's model chunks, DDP-wrapped or bare), keyed by global layer index.

    With activation recomputation (actor.recompute) a router runs again in the backward pass, after the forward passes
    of later micro-batches (pipeline schedules run several forwards ahead): every router call inside `forward_pass`
    is a micro-batch's forward and queues the routing it used, any other call is a recomputation and routes as the
    oldest queued forward did. A recomputation is not counted in the expert load."""

    def __init__(self, chunks: list[torch.nn.Module], num_layers: int, num_experts: int, topk: int) -> None:
        self.num_layers, self.num_experts, self.topk = num_layers, num_experts, topk
        self._by_chunk: dict[int, list[tuple[int, torch.nn.Module]]] = {}
        for chunk in chunks:
            module = getattr(chunk, "module", chunk)
            routers = []
            for layer in getattr(getattr(module, "decoder", None), "layers", []):
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    routers.append((layer.layer_number - 1, router))
                    router.register_forward_pre_hook(self._before_route(layer.layer_number - 1))
                    router.register_forward_hook(self._on_route(layer.layer_number - 1))
            self._by_chunk[id(chunk)] = routers
        self.counting = False
        # kept where the routers run, so a forward never waits on a copy to the host (read once a step)
        device = local_device()
        self.tokens_per_expert = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.routed_tokens = torch.zeros(num_layers, dtype=torch.float64, device=device)  # tokens routed, per layer
        self._replaying: dict[int, torch.Tensor] = {}  # layer -> the indices the next forward replays
        self._in_forward = False
        # layer -> the replayed indices (None: computed) of each forward not recomputed yet, oldest first
        self._queued: dict[int, deque[torch.Tensor | None]] = defaultdict(deque)
        self._call_target: dict[int, torch.Tensor | None] = {}  # layer -> what its running call replays
        self._replay_mismatches = torch.zeros(num_layers, dtype=torch.long, device=device)  # tokens, per layer

    @contextlib.contextmanager
    def forward_pass(self) -> Iterator[None]:
        """Router calls in this context are a micro-batch's forward pass (outside it: recomputations)."""
        self._in_forward = True
        try:
            yield
        finally:
            self._in_forward = False

    def _before_route(self, layer: int):
        def hook(router, _inputs) -> None:
            if self._in_forward:
                target = self._replaying.get(layer)
                self._queued[layer].append(target)
            else:
                if not self._queued[layer]:
                    raise RuntimeError(f"MoE layer {layer} routed outside a forward pass with no forward to recompute")
                target = self._queued[layer].popleft()
                if router.router_replay is not None:
                    _set_replay(router.router_replay, target)
            self._call_target[layer] = target

        return hook

    def _on_route(self, layer: int):
        def hook(_router, _inputs, output) -> None:
            _, routing_map = output
            target = self._call_target.pop(layer, None)
            if target is not None:
                replayed = torch.zeros_like(routing_map).scatter(1, target.to(routing_map.device), True)
                self._replay_mismatches[layer] += (replayed != routing_map).any(1).sum()
            if self.counting and self._in_forward:
                self.tokens_per_expert[layer] += routing_map.sum(0)
                self.routed_tokens[layer] += routing_map.shape[0]

        return hook

    def start_counting(self) -> None:
        self.tokens_per_expert.zero_()
        self.routed_tokens.zero_()
        self.counting = True

    def stop_counting(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens per expert [layers, experts], tokens routed per layer) since `start_counting`, summed over every
        rank (each data-parallel rank routes its own tokens; each pipeline stage its own layers). A collective."""
        self.counting = False
        counts = torch.cat([self.tokens_per_expert.flatten(), self.routed_tokens])
        if dist.get_backend() != "nccl":
            counts = counts.cpu()
        dist.all_reduce(counts)
        counts = counts.cpu()
        split = self.num_layers * self.num_experts
        return counts[:split].view(self.num_layers, self.num_experts), counts[split:]

    def route(self, chunk: torch.nn.Module, record: bool = False, replay: torch.Tensor | None = None) -> None:
        """How `chunk`'s routers route its next forward pass: recording their top-k (`record`, read with
        `recorded`), replaying `replay` ([rows, layers, k]: each layer's recorded top-k), or computing it."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._replaying = {}
        for layer, router in self._by_chunk[id(chunk)]:
            if router.router_replay is None:
                continue
            target = None
            if replay is not None:
                target = replay[:, layer].to(local_device(), torch.long)
                if (target < 0).any():
                    raise ValueError(f"routing replay: no recorded routing for some tokens of MoE layer {layer}")
                self._replaying[layer] = target
            _set_replay(router.router_replay, target)
            if record:
                router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)

    def recorded(self, chunk: torch.nn.Module) -> list[tuple[int, torch.Tensor]]:
        """(layer, top-k expert ids [rows, k]) of `chunk`'s routers in its last recorded forward."""
        return [(layer, router.router_replay.recorded_topk_idx) for layer, router in self._by_chunk[id(chunk)]]

    def check_replayed(self) -> None:
        """Raise if a replayed forward (or its recomputation) since the last check routed any token to other experts
        than replayed."""
        layers = torch.nonzero(self._replay_mismatches).flatten().tolist()
        self._replay_mismatches.zero_()
        if layers:
            raise RuntimeError(f"routing replay: MoE layer(s) {layers} routed tokens to other experts than replayed")

    def free(self, chunk: torch.nn.Module) -> None:
        """`chunk`'s routers compute their top-k again (no recording, no replay, no forward left to recompute)."""
        self._replaying = {}
        for layer, router in self._by_chunk[id(chunk)]:
            self._queued.pop(layer, None)
            if router.router_replay is not None:
                router.router_replay.clear_router_replay_action()
                router.router_replay.clear_indices()


def _set_replay(replay, target: torch.Tensor | None) -> None:
    """A router's Megatron `RouterReplay` replays `target` (top-k expert ids [rows, k]) in its next call, or computes
    its top-k when None."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replay.clear_indices()
    if target is None:
        replay.clear_router_replay_action()
    else:
        replay.target_topk_idx = target
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def expert_load_metrics(tokens_per_expert: torch.Tensor, routed_tokens: torch.Tensor, topk: int) -> dict[str, float]:
    """moe/* metrics from a step's routing counts: per MoE layer the busiest expert's tokens over the mean (1.0: a
    perfect balance, num_experts: one expert takes every token), the worst layer's, and the share of token-expert
    assignments dropped by a capacity limit (0 without one)."""
    metrics: dict[str, float] = {}
    layers = [layer for layer in range(len(routed_tokens)) if routed_tokens[layer] > 0]
    if not layers:
        return metrics
    for layer in layers:
        counts = tokens_per_expert[layer]
        metrics[f"moe/expert_load_max_over_mean/layer_{layer}"] = float(counts.max() / counts.mean().clamp(min=1e-12))
    metrics["moe/expert_load_max_over_mean"] = max(metrics.values())
    assigned = float(tokens_per_expert[layers].sum())
    wanted = float(routed_tokens[layers].sum()) * topk
    metrics["moe/dropped_token_fraction"] = 1.0 - assigned / wanted
    return metrics
