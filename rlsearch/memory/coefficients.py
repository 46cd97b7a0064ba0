"""The measured figures of the memory plan: what a transformer layer keeps per token for its backward pass, as
multiples of its widths, and the few constants beside it. Placeholder values until bench/memory.py fits them."""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class ActivationCoefficients:
    """A layer keeps per token, in units of the model dtype's bytes: the inputs of its four linear layers (exact:
    2 hidden + heads x head_dim / tp + ffn / tp) and
        norms x hidden + core_query x heads x head_dim / tp + core_kv x kv_heads x head_dim / tp + mlp x ffn / tp
    (MoE: ffn is top-k x the expert FFN, plus dispatch x top-k x hidden for the routed copies of each token)."""

    norms: float  # the two RMSNorms
    core_query: float  # core attention (rotary embedding, SDPA's saved query, output and log-sum-exp)
    core_kv: float  # core attention, per key-value width
    mlp: float  # the gated activation (SwiGLU) between fc1 and fc2
    dispatch: float  # MoE: the token copies routed to experts
    outside: float  # per token beyond the layers (embedding output, final norm, selected hidden states), x hidden
    backward: float  # a backward pass's transient (gradients of one layer's activations), in layers' worth
    logits: float  # fp32 copies of a logits chunk alive at once in its backward pass
    optimizer_step: float  # the optimizer step's workspace, in fp32 copies of this rank's optimized parameters
    workspace: float  # bytes a built rank holds beyond its tensors (CPU: RSS growth; GPU: cuBLAS workspace)
    runtime: float  # bytes of an actor rank's process before it builds anything (CPU) or outside torch (GPU)
    engine_runtime: float  # bytes of an engine worker beyond weights and KV cache (GPU: vLLM's activation room)
    host_overhead: float  # CPU: the driver, Ray's processes and the tool servers


CPU_FLOAT32 = ActivationCoefficients(
    norms=4.0, core_query=4.0, core_kv=2.0, mlp=4.0, dispatch=2.0, outside=8.0, backward=1.0, logits=3.0,
    optimizer_step=0.0, workspace=0.3 * GB, runtime=0.6 * GB, engine_runtime=2.6 * GB, host_overhead=1.6 * GB,
)
GPU_BFLOAT16 = ActivationCoefficients(
    norms=4.0, core_query=4.0, core_kv=2.0, mlp=4.0, dispatch=2.0, outside=8.0, backward=1.0, logits=3.0,
    optimizer_step=1.0, workspace=0.0, runtime=1.0 * GB, engine_runtime=2.0 * GB, host_overhead=0.0,
)


def coefficients_for(device: str, dtype: str) -> ActivationCoefficients:
    """The figures of a device kind (gpu | cpu) and parameter dtype."""
    return CPU_FLOAT32 if device == "cpu" else GPU_BFLOAT16
