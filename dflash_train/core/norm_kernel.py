"""The RMSNorm rule of the drafter (drafter.RMSNorm) as one Triton kernel, for inference on CUDA.

Owns `triton_rms_norm(x, weight, eps)`: what `RMSNorm.forward` computes, in one pass over the
input instead of the eight kernels of the eager rule (float32 copy, square, mean, eps, rsqrt,
scale, cast back, weight). The same rounding as the eager rule: the inverse root mean square in
float32, the normalised row rounded to the input's dtype, then multiplied by the weight and
rounded again (what transformers' Llama-style norms and serving engines' norm kernels do). Only
the order of the float32 sum of squares differs from torch's mean, so an output can differ by
one unit in the last place where a value lies on a rounding boundary.

The decoding engine runs it on a GPU (engine/norms.py) for the drafter's norms (a speculative
cycle of an 8-layer drafter runs 34 of them) and for the target's norms that follow the same
rule (transformers' Llama and Qwen norms: two a layer). Training keeps the eager rule.
tests/test_norm_kernel.py holds it to the eager rule on CPU in Triton's interpreter;
tests/test_gpu.py on the GPU.

Shape legend: M rows (every leading dimension), N the normalised size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_rows_kernel(x_ptr, w_ptr, out_ptr, N, eps, BLOCK: tl.constexpr):
    """One row of N: float32 inverse RMS, the row rounded to the output dtype, times the weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=inside, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=inside)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `x` over its last dimension with `weight` (of x's dtype), in x's dtype."""
    N = x.shape[-1]
    x_MN = x.reshape(-1, N)
    if not x_MN.is_contiguous():
        x_MN = x_MN.contiguous()
    out_MN = torch.empty_like(x_MN)
    if x_MN.shape[0]:
        block = triton.next_power_of_2(N)
        _rms_norm_rows_kernel[(x_MN.shape[0],)](x_MN, weight, out_MN, N, float(eps), BLOCK=block,
                                                num_warps=max(1, min(8, block // 256)))
    return out_MN.view(x.shape)
