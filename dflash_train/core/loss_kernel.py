"""The hard-label loss chunk as one Triton kernel over the lm_head's logits (train.loss_kernel).

Owns: `triton_hard_chunk_loss`, a drop-in for `loss.hard_chunk_loss` (same arguments, same
results): the lm_head's two matrix products stay cuBLAS's; what lies between them, the
per-row log-softmax, argmax, the label's log-probability and the softmax that the input
gradient multiplies, is one kernel with one program per row. It reads a row of logits twice
and writes the softmax over the logits, in their dtype, in place: at most three passes of
memory traffic over the [C, V] logits where the compiled torch chunk makes more, and no float32
[C, V] buffer. The second read runs from the row's last columns back, so that it starts on what
the first read left in L2 last (a row of SmolLM2's vocabulary is 96 KiB, and by occupancy up to
about a thousand rows are in flight, more than L2 holds; docs/PERFORMANCE.md). The softmax is element-wise once the
row's max and sum are known, so the order changes no result.

The pure-torch twin of this math is `loss.hard_chunk_loss` (float32 log-softmax of the logits
as the matmul produced them, argmax on the same logits, the label column of the gradient as
expm1 of the label's log-probability); the tests hold the kernel to it and to float64
autograd, on CPU in Triton's interpreter (TRITON_INTERPRET=1) and on the GPU.

Shape legend: C rows of one chunk, H hidden size, V vocabulary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per loop step, and the warps of one row's program: the pair that ran fastest for
# V = 49,152 and 151,936 (docs/PERFORMANCE.md).
BLOCK_V = 4096
NUM_WARPS = 8


@triton.jit
def _hard_rows_kernel(logits_ptr, row_stride, labels_ptr, loss_ptr, preds_ptr, picked_ptr, V,
                      WRITE_SOFTMAX: tl.constexpr, BLOCK: tl.constexpr):
    """One row: online max / sum of exp / first argmax over V columns, then (WRITE_SOFTMAX) the
    softmax written over the row in the logits' dtype."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    offs = tl.arange(0, BLOCK)
    run_max = tl.full([], float("-inf"), tl.float32)
    run_sum = tl.zeros([], tl.float32)
    run_arg = tl.zeros([], tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        blk_max, blk_arg = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        new_max = tl.maximum(run_max, blk_max)
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        # Strictly greater: a tie with an earlier step keeps the earlier (lower) column, as
        # torch.argmax returns the first maximal index.
        run_arg = tl.where(blk_max > run_max, start + blk_arg, run_arg)
        run_max = new_max
    lse = run_max + tl.log(run_sum)
    label = tl.load(labels_ptr + row)
    # A label outside the vocabulary reads no memory: its loss is NaN (the step is skipped as
    # non-finite), where torch's gather would raise.
    inside = (label >= 0) & (label < V)
    x_label = tl.load(base + label, mask=inside, other=float("nan")).to(tl.float32)
    picked = x_label - lse
    tl.store(loss_ptr + row, -picked)
    tl.store(picked_ptr + row, picked)
    tl.store(preds_ptr + row, run_arg.to(tl.int64))
    if WRITE_SOFTMAX:
        # From the last step back: the columns the first pass read last are the likeliest to be
        # in L2 still.
        steps = tl.cdiv(V, BLOCK)
        for back in range(0, steps):
            cols = (steps - 1 - back) * BLOCK + offs
            keep = cols < V
            x = tl.load(base + cols, mask=keep, other=float("-inf")).to(tl.float32)
            tl.store(base + cols, tl.exp(x - lse).to(logits_ptr.dtype.element_ty), mask=keep)


def triton_hard_chunk_loss(h_CH: torch.Tensor, weight_VH: torch.Tensor, labels_C: torch.Tensor,
                           need_grad: bool, block: int = BLOCK_V, num_warps: int = NUM_WARPS):
    """`loss.hard_chunk_loss` with its element-wise middle as one kernel: (CE per row, argmax
    of the logits, the label's log-probability, d CE_row / d h or None). Labels must lie in
    [0, V) (block_loss zeroes those of unscored rows)."""
    logits_CV = h_CH @ weight_VH.t()
    C, V = logits_CV.shape
    device = logits_CV.device
    loss_C = torch.empty(C, dtype=torch.float32, device=device)
    picked_C = torch.empty(C, dtype=torch.float32, device=device)
    preds_C = torch.empty(C, dtype=torch.long, device=device)
    if C:
        _hard_rows_kernel[(C,)](logits_CV, logits_CV.stride(0), labels_C.contiguous(), loss_C, preds_C,
                                picked_C, V, WRITE_SOFTMAX=need_grad, BLOCK=block, num_warps=num_warps)
    if not need_grad:
        return loss_C, preds_C, picked_C, None
    # The kernel left softmax over the logits; d CE / d logits = softmax - onehot(label), whose
    # label column is expm1(log p) (p - 1 with its precision near p = 1).
    probs_CV = logits_CV
    probs_CV.scatter_(-1, labels_C[:, None], torch.expm1(picked_C).to(probs_CV.dtype)[:, None])
    return loss_C, preds_C, picked_C, probs_CV @ weight_VH
