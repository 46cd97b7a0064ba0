"""The CPU compatibility layer for megatron-core (rlsearch/megatron/cpu_compat.py), checked in a fresh interpreter:
the patches change torch.cuda and megatron module state for the whole process."""

import subprocess
import sys

from tests.constants import REPO_ROOT

PROBE = r"""
import numpy as np
import torch
from rlsearch.megatron.cpu_compat import apply_cpu_patches, define_missing_te_names

apply_cpu_patches()
define_missing_te_names()  # on every device: init_megatron_parallel calls both


class AllocatesOnTheDefaultDevice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        # as megatron's _gather_along_first_dim does in the allgather dispatcher's backward pass
        buffer = torch.empty(grad.shape, device=torch.cuda.current_device())
        return buffer.copy_(grad) * 2


x = torch.ones(3, requires_grad=True)
AllocatesOnTheDefaultDevice.apply(x).sum().backward()
assert torch.equal(x.grad, torch.full((3,), 2.0)), x.grad

from megatron.core.transformer.moe import moe_utils, token_dispatcher

assert moe_utils.te_general_gemm is None  # read by every router forward; defined only with Transformer Engine
split = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
assert isinstance(split, np.ndarray) and split.tolist() == [3, 1]  # all_to_all_single takes these split sizes
stream = token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
stream.record_event().synchronize()
with torch.cuda.stream(stream):
    torch.cuda.current_stream().wait_stream(stream)
print("ok")
"""


def test_cpu_patches_cover_custom_backward_passes_and_the_moe_dispatcher():
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


GRAD_NORM_PROBE = r"""
import math
import tempfile

import torch
import torch.distributed as dist
from rlsearch.megatron.cpu_compat import apply_cpu_patches

apply_cpu_patches()
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
generator = torch.Generator().manual_seed(0)
# a dense gradient of the tests' output layer (16,512 x 128), and small ones
grads = [torch.randn(16_512, 128, generator=generator) * 1e-3, torch.randn(256, 128, generator=generator) * 1e-2,
         torch.randn(128, generator=generator) * 1e-4]
exact = math.sqrt(sum(float(grad.double().square().sum()) for grad in grads))
norm = get_grad_norm_fp32(grads, grad_stats_parallel_group=dist.group.WORLD)
print(f"relative error {norm / exact - 1:+.2e}")
assert abs(norm / exact - 1) < 1e-6, (norm, exact)
print("ok")
"""


def test_the_optimizers_grad_norm_is_the_norm_of_the_gradients():
    # torch's CPU 2-norm kernel sums float32 squares in float32 accumulators: 1.2e-5 short on the norm of these
    result = subprocess.run([sys.executable, "-c", GRAD_NORM_PROBE], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr[-3000:]
