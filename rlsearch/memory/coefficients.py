"""The measured figures of the memory plan: what a transformer layer keeps per token for its backward pass, as
multiples of its widths, and the few constants beside it, per device kind and dtype, each with where it came from.

Where they come from:
- the layer's parts (norms, core_*, mlp, outside, dispatch): `bench/memory.py --fit --chunk 128` on this CPU
  (2026-11-27, torch 2.13, megatron-core 0.16.1, the local layer spec): every tensor autograd saves in the forward
  pass of one training step, by the module that saved it (parameters left out), over the tiny shape and four shapes
  that each change one width (hidden and heads, kv heads, head size, FFN). The linear layers save exactly their
  inputs (ratio 1.000 on every shape), which the plan counts exactly;
- the CPU transients (backward, logits, workspace, runtime): the peaks of `bench/memory.py` on this CPU
  (docs/benchmarks.md, "Memory"), and vLLM's and the driver's processes from bench/soak.py's RSS per process;
- the retriever servers: the RSS of `rlsearch serve-retriever` over the toy corpus (600 passages, 2026-12-01): BM25
  157,904 kB; with a prebuilt Flat index of it (0.92 MB) and all-MiniLM-L6-v2 (90.9 MB of weights) on the CPU
  610,260 kB, 0.533 GB beyond the index and the encoder;
- GPU bfloat16: the issue's H200 table (issue 46: one trajectory, the 0.5B shape, bf16, 1024-position logits
  chunks: 103.9 GiB at 65,065 tokens without recomputation, 100.1 GiB selective, 16.4 GiB full at 65,065 and 24.3 GiB
  full at 130,601). The CPU bf16 parts with the norms at 2 x hidden (CUDA's fused RMSNorm keeps its input and a
  per-row statistic; the CPU's composite one keeps fp32 copies: 8 x hidden in bf16) give 64.4 KB a token and layer,
  where the table's rows give 64.5; `backward` and `workspace` are then solved from the two full-recomputation rows,
  and the rows without recomputation and selective are predicted within 0.5% and 2.2%.
GPU float32 has not been measured: it takes the GPU bfloat16 figures. Nor have the host memory of a GPU host's actor
ranks and engine workers: estimates (the CPU processes' figures beyond their tensors, plus CUDA's and NCCL's
libraries); the other processes of a run (the driver, Ray, rollout workers, retrievers) are the CPU's."""

from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9


@dataclass(frozen=True)
class ActivationCoefficients:
    """A layer keeps per token, in units of the model dtype's bytes: the inputs of its four linear layers (exact:
    2 hidden + heads x head_dim / tp + ffn / tp) and
        norms x hidden + core_query x heads x head_dim / tp + core_kv x kv_heads x head_dim / tp
        + core_rotary x head_dim + mlp x ffn / tp
    (MoE: ffn is top-k x the expert FFN, plus dispatch x top-k x hidden for the routed copies of each token)."""

    norms: float  # the two RMSNorms
    core_query: float  # core attention: the rotated query, SDPA's output and log-sum-exp, per query width
    core_kv: float  # core attention, per key-value width (the rotated key, the value)
    core_rotary: float  # core attention, per head size (the rotary embedding's angles, per call)
    mlp: float  # the gated activation (SwiGLU) between fc1 and fc2: fc1's output and the activation's
    dispatch: float  # MoE: the token copies routed to experts, per top-k x hidden
    outside: float  # per token beyond the layers (embedding output, final norm, selected hidden states), x hidden
    backward: float  # a layer's backward pass beyond what it saved (its activations' gradients), in layers' worth
    logits: float  # fp32 copies of a logits chunk alive at once in its backward pass
    optimizer_step: float  # the optimizer step's workspace, in fp32 copies of this rank's optimized parameters
    workspace: float  # bytes a built rank holds beyond its tensors (CPU: RSS growth; GPU: cuBLAS and the like)
    runtime: float  # bytes of an actor rank's process before it builds anything (CPU) or outside torch (GPU)
    engine_runtime: float  # bytes of an engine worker beyond weights and KV cache (GPU: vLLM's activation room)
    engine_driver: float  # the rollout worker that drives each engine (a Ray actor), in host memory
    driver: float  # the driver's process (the trainer)
    ray: float  # Ray's own processes (GCS, raylet, the workers it keeps)
    bm25_server: float  # a retriever or MCP server with a BM25 index of a small corpus
    encoder_server: float  # a retriever server with an encoder, beyond its weights and a prebuilt index
    rank_host: float  # GPU: an actor rank's process in host memory beyond what it offloads
    engine_host: float  # GPU: an engine worker's process in host memory


# bench/memory.py --fit --dtype float32 --chunk 128: norms 4.013 (4.008-4.016), core 3.042 / 3.021 / 3.875, mlp
# 4.000, outside 3.032 (2.997-3.056), MoE dispatch 1.586; the transients from the bench's CPU peaks
CPU_FLOAT32 = ActivationCoefficients(
    norms=4.013, core_query=3.042, core_kv=3.021, core_rotary=3.875, mlp=4.0, dispatch=1.586, outside=3.032,
    backward=1.0, logits=3.0, optimizer_step=0.0, workspace=0.3 * GB, runtime=0.6 * GB,
    # bench/soak.py (docs/reliability.md, 2026-11-27): EngineCore 2,727 MiB less its tiny model's weights (0.16 GB)
    # and 1 GiB KV cache; the rollout worker 1,216 MiB; the driver 619 MiB and Ray's and the (BM25) retriever's
    # processes 1,023 MiB, the retriever's 154 MiB of them
    engine_runtime=1.63 * GB, engine_driver=1.28 * GB, driver=0.649 * GB, ray=0.911 * GB, bm25_server=0.162 * GB,
    encoder_server=0.533 * GB, rank_host=0.0, engine_host=0.0,
)
# bench/memory.py --fit --dtype bfloat16 --chunk 128: norms 8.025 (the CPU's RMSNorm keeps fp32 copies), core
# 3.083 / 3.042 / 3.750, mlp 4.000, outside 5.127, dispatch 1.672; a bf16 logits chunk beside the fp32 copies
CPU_BFLOAT16 = replace(CPU_FLOAT32, norms=8.025, core_query=3.083, core_kv=3.042, core_rotary=3.75, outside=5.127,
                       dispatch=1.672, logits=3.5)
# the H200 table (see above); vLLM's room beside weights and KV cache, the CUDA context and the host memory
# of a rank's and an engine worker's processes are estimates: the CPU rank's interpreter, libraries and workspace
# (0.9 GB) and the CPU EngineCore's process beyond its tensors (1.63 GB), each plus ~1 GB of CUDA's and NCCL's
GPU_BFLOAT16 = replace(
    CPU_BFLOAT16, norms=2.0, outside=2.0, backward=0.287, workspace=0.30 * GB, optimizer_step=1.0,
    runtime=1.0 * GB, engine_runtime=2.0 * GB, rank_host=2.0 * GB, engine_host=2.6 * GB,
)
_BY_DEVICE = {("cpu", "float32"): CPU_FLOAT32, ("cpu", "bfloat16"): CPU_BFLOAT16, ("gpu", "bfloat16"): GPU_BFLOAT16,
              ("gpu", "float32"): GPU_BFLOAT16}


def coefficients_for(device: str, dtype: str) -> ActivationCoefficients:
    """The figures of a device kind (gpu | cpu) and parameter dtype (float32 | bfloat16)."""
    return _BY_DEVICE[(device, dtype)]
