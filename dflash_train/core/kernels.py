"""Element-wise rules of the drafter as one Triton kernel each, for inference on CUDA.

Each computes what its eager rule in drafter.py computes, with the same roundings, in one launch
where eager PyTorch launches several (each paying its launch even inside a CUDA graph). The
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
  in one launch instead of ten (two products, a negation, a concatenation and a sum, for each).
  Each product and the sum are rounded to the input's dtype as eager PyTorch rounds them, and
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
def _rotate_row(x_ptr, row, H, P, sb, sh, sp, c_ptr, s_ptr, shift, cb, cp, o_ptr, ob, oh, op,
                HALF: tl.constexpr, BLOCK: tl.constexpr):
    """RoPE of one row (b, h, p) of a [B, H, P, 2 * HALF] tensor of any strides, at the angle of
    position shift + p of cos / sin [B, 1, shift + P, 2 * HALF] (last stride 1)."""
    p = row % P
    h = (row // P) % H
    b = row // (P * H)
    cols = tl.arange(0, BLOCK)
    inside = cols < HALF
    x = x_ptr + b * sb + h * sh + p * sp
    c = c_ptr + b * cb + (shift + p) * cp
    s = s_ptr + b * cb + (shift + p) * cp
    out = o_ptr + b * ob + h * oh + p * op
    dtype = o_ptr.dtype.element_ty
    x1 = tl.load(x + cols, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF + cols, mask=inside, other=0.0).to(tl.float32)
    c1 = tl.load(c + cols, mask=inside, other=0.0).to(tl.float32)
    c2 = tl.load(c + HALF + cols, mask=inside, other=0.0).to(tl.float32)
    s1 = tl.load(s + cols, mask=inside, other=0.0).to(tl.float32)
    s2 = tl.load(s + HALF + cols, mask=inside, other=0.0).to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype, as eager does
    first = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    second = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    tl.store(out + cols, first.to(dtype), mask=inside)
    tl.store(out + HALF + cols, second.to(dtype), mask=inside)


@triton.jit
def _qk_rotation_kernel(q_ptr, qo_ptr, Hq, Q, qsb, qsh, qsp, qob, qoh, qop,
                        k_ptr, ko_ptr, Hk, S, ksb, ksh, ksp, kob, koh, kop,
                        c_ptr, s_ptr, cb, cp, q_rows, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """One program a row: the queries' rows first (at the last Q of the S angles), then the keys'."""
    row = tl.program_id(0).to(tl.int64)
    if row < q_rows:
        _rotate_row(q_ptr, row, Hq, Q, qsb, qsh, qsp, c_ptr, s_ptr, S - Q, cb, cp, qo_ptr, qob, qoh, qop,
                    HALF, BLOCK)
    else:
        _rotate_row(k_ptr, row - q_rows, Hk, S, ksb, ksh, ksp, c_ptr, s_ptr, 0, cb, cp, ko_ptr, kob, koh, kop,
                    HALF, BLOCK)


def triton_qk_rotation(q_BHQD: torch.Tensor, k_BHSD: torch.Tensor, cos_B1SD: torch.Tensor,
                       sin_B1SD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafter.QKRotation in one launch: the queries at the last Q of the S angles, the keys at
    all of them. Inputs of one dtype, of any strides (cos and sin alike, with a last stride of
    1; their batch dimension may broadcast); outputs laid out as the inputs."""
    q_BHQD, k_BHSD = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_BHQD, k_BHSD))
    B, Hq, Q, D = q_BHQD.shape
    Hk, S = k_BHSD.shape[1], k_BHSD.shape[2]
    cos, sin = cos_B1SD.expand(B, 1, S, D), sin_B1SD.expand(B, 1, S, D)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    q_out, k_out = torch.empty_like(q_BHQD), torch.empty_like(k_BHSD)
    q_rows, rows = B * Hq * Q, B * Hq * Q + B * Hk * S
    if rows:
        half = D // 2
        _qk_rotation_kernel[(rows,)](q_BHQD, q_out, Hq, Q, *_strides3(q_BHQD), *_strides3(q_out),
                                     k_BHSD, k_out, Hk, S, *_strides3(k_BHSD), *_strides3(k_out),
                                     cos, sin, cos.stride(0), cos.stride(2), q_rows,
                                     HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1)
    return q_out, k_out


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    """A [B, H, P, D] tensor's strides of its first three dimensions (its last is 1)."""
    return t.stride(0), t.stride(1), t.stride(2)
