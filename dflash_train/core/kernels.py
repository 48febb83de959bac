"""Element-wise rules of the drafter as Triton kernels, for inference on CUDA.

Each computes what its eager rule in drafter.py computes, with the same roundings, in one or two
launches where eager PyTorch launches several (each paying its launch even inside a CUDA graph). The
decoding engine runs them on a GPU (engine/fusion.py); training keeps the eager rules.

- `triton_rms_norm(x, weight, eps)`: drafter.rms_norm_rule in one pass over the input instead of
  eight kernels (float32 copy, square, mean, eps, rsqrt, scale, cast back, weight). The inverse
  root mean square in float32, the normalised row rounded to the input's dtype, then multiplied
  by the weight and rounded again (what transformers' Llama-style norms and serving engines'
  norm kernels do). Only the order of the float32 sum of squares differs from torch's mean, so
  an output can differ by one unit in the last place where a value lies on a rounding boundary.
  Used for the drafter's norms (34 a cycle of an 8-layer drafter) and the target's norms that
  follow the same rule (transformers' Llama and Qwen norms: two a layer).
- `triton_qk_rotation(q, k, cos, sin)`: drafter.QKRotation (RoPE of a layer's queries and keys)
  in two launches instead of ten (two products, a negation, a concatenation and a sum, for each).
  Each product and the sum are rounded to the input's dtype as eager PyTorch rounds them (the
  kernel is compiled without fused multiply-adds, which would skip a product's rounding), and
  there is nothing else to round: it equals the eager rule bit for bit.

tests/test_kernels.py holds them to the eager rules on CPU in Triton's interpreter;
tests/test_gpu.py on the GPU.

Shape legend: M rows (every leading dimension), N the normalised size; B batch, H heads, Q / S
query / key positions, D the head dimension.
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


@triton.jit
def _rotation_rows_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, H, P, cos_batch_stride, HALF: tl.constexpr,
                          BLOCK: tl.constexpr):
    """RoPE of one row (b, p, h) of a contiguous [B, P, H, 2 * HALF] tensor, at the angle of row p
    of batch b of cos / sin (rows of 2 * HALF, contiguous; batch b starts cos_batch_stride * b in)."""
    row = tl.program_id(0).to(tl.int64)
    p = (row // H) % P
    b = row // (H * P)
    cols = tl.arange(0, BLOCK)
    inside = cols < HALF
    x, out = x_ptr + row * (2 * HALF), out_ptr + row * (2 * HALF)
    angle = b * cos_batch_stride + p * (2 * HALF)
    dtype = out_ptr.dtype.element_ty
    x1 = tl.load(x + cols, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF + cols, mask=inside, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + angle + cols, mask=inside, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + angle + HALF + cols, mask=inside, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + angle + cols, mask=inside, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + angle + HALF + cols, mask=inside, other=0.0).to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype, as eager does
    first = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    second = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    tl.store(out + cols, first.to(dtype), mask=inside)
    tl.store(out + HALF + cols, second.to(dtype), mask=inside)


def triton_qk_rotation(q_BHQD: torch.Tensor, k_BHSD: torch.Tensor, cos_B1SD: torch.Tensor,
                       sin_B1SD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafter.QKRotation in one launch for each: the queries at the last Q of the S angles, the
    keys at all of them. Inputs of one dtype; cos and sin of batch B or 1. Outputs laid out as the
    drafter's queries and keys are (transposed views of [B, P, H, D])."""
    Q, S = q_BHQD.shape[2], k_BHSD.shape[2]
    return (_rotated(q_BHQD, cos_B1SD[:, :, S - Q:], sin_B1SD[:, :, S - Q:]),
            _rotated(k_BHSD, cos_B1SD, sin_B1SD))


def _rotated(x_BHPD: torch.Tensor, cos_B1PD: torch.Tensor, sin_B1PD: torch.Tensor) -> torch.Tensor:
    """x rotated at the P angles of cos / sin, one program a row of D, read and written as
    [B, P, H, D] (copied there first where x is not a view of that layout)."""
    x_BPHD = x_BHPD.transpose(1, 2)
    if not x_BPHD.is_contiguous():
        x_BPHD = x_BPHD.contiguous()
    B, P, H, D = x_BPHD.shape
    cos, sin = cos_B1PD, sin_B1PD
    if cos.stride() != sin.stride() or cos.stride(-1) != 1 or cos.stride(-2) != D:
        cos, sin = cos.contiguous(), sin.contiguous()
    out_BPHD = torch.empty_like(x_BPHD)
    if out_BPHD.numel():
        half = D // 2
        # No fused multiply-adds: with them the compiler contracts a product into the sum and skips
        # that product's rounding, which eager does not (the probe then refuses the kernel).
        _rotation_rows_kernel[(B * P * H,)](x_BPHD, out_BPHD, cos, sin, H, P, cos.stride(0) if cos.shape[0] > 1 else 0,
                                            HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1,
                                            enable_fp_fusion=False)
    return out_BPHD.transpose(1, 2)
