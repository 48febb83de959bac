"""The DFlash training objective and the acceptance count.

Owns: the position-decayed cross-entropy over draft blocks with a chunked lm_head (full
[rows, vocab] logits never exist at once), per-position accuracy, and `accepted_run_length`,
the one definition of "how many proposals would be accepted" used by training metrics,
evaluation and benchmarks.

The loss comes back as (weighted sum, weight sum): dividing the totals over micro-batches and
ranks gives the exact mean, never a mean of means.

Shape legend: N blocks, B block size, K = B - 1 predicted positions, M = N*B rows,
H hidden size, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_train.config import DEFAULT_GAMMA, ObjectiveSection


def default_gamma(block_size: int) -> float:
    """The paper's decay constant for a block size (16 -> 7, 10 -> 5, 8 -> 4)."""
    if block_size not in DEFAULT_GAMMA:
        raise ValueError(
            f"no published loss decay gamma for block_size={block_size} "
            f"(known: {sorted(DEFAULT_GAMMA)}); set objective.gamma explicitly"
        )
    return DEFAULT_GAMMA[block_size]


def position_weights(block_size: int, gamma: float | None = None, device=None) -> torch.Tensor:
    """w[k] = exp(-(k - 1) / gamma) for block index k >= 1; w[0] = 0 (the anchor is given)."""
    gamma = default_gamma(block_size) if gamma is None else float(gamma)
    if gamma <= 0 or not math.isfinite(gamma):
        raise ValueError(f"objective.gamma must be a positive number, got {gamma}")
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def accepted_run_length(matches_NK: torch.Tensor) -> torch.Tensor:
    """Per block, the length of the leading run of True: how many proposals in a row a
    greedy verifier accepts. matches [..., K] bool -> [...] long."""
    return matches_NK.to(torch.long).cumprod(dim=-1).sum(dim=-1)


def _chunk_loss(h_CH, weight_VH, labels_C, w_C, need_grad: bool):
    """One chunk of rows: (sum w * CE, argmax of the logits, d(sum w * CE)/dh or None).

    Written for few passes over the [C, V] logits, which dominate the loss's memory traffic:
    argmax on the logits as they come out of the matmul (no float copy), one log_softmax that
    reads them and writes float32 log-probabilities, and one exp that writes the softmax
    straight in the weight's dtype for the input-gradient matmul. d CE / d logits = softmax -
    onehot(label); the label column is expm1(log p) in float32, so p - 1 keeps its precision
    near p = 1. The row weights scale the [C, H] product instead of the [C, V] softmax.
    Compiled (`compile=True` in `block_loss`), inductor fuses the same math into about two
    passes over bf16 logits.
    """
    logits_CV = h_CH @ weight_VH.t()
    preds_C = logits_CV.argmax(dim=-1)
    logp_CV = torch.log_softmax(logits_CV, dim=-1, dtype=torch.float32)
    del logits_CV
    picked_C = logp_CV.gather(-1, labels_C[:, None]).squeeze(-1)
    loss = -(w_C * picked_C).sum()
    if not need_grad:
        return loss, preds_C, None
    probs_CV = torch.empty_like(logp_CV, dtype=weight_VH.dtype)
    torch.exp(logp_CV, out=probs_CV)  # one pass, written in the weight's dtype
    del logp_CV
    probs_CV.scatter_(-1, labels_C[:, None], torch.expm1(picked_C).to(weight_VH.dtype)[:, None])
    grad_CH = (probs_CV @ weight_VH) * w_C[:, None]
    return loss, preds_C, grad_CH


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_m w_m * CE(hidden_m @ W^T, label_m), computed chunk by chunk.

    The gradient with respect to `hidden` is formed in the forward, chunk by chunk, so only one
    chunk of logits is ever alive; backward only scales it. The lm_head weight belongs to the
    frozen target and gets no gradient. With `compiled`, every chunk has exactly `chunk_rows`
    rows (the last one padded with zero rows of weight 0).
    """

    @staticmethod
    def forward(ctx, hidden_MH, weight_VH, labels_M, row_w_M, chunk_rows: int, compiled: bool):
        M = hidden_MH.shape[0]
        need_grad = ctx.needs_input_grad[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden_MH.device)
        preds_M = torch.empty(M, dtype=torch.long, device=hidden_MH.device)
        grad_MH = torch.empty_like(hidden_MH) if need_grad else None
        w_M = row_w_M.to(torch.float32)
        if compiled:
            from dflash_train.compilation import loss_chunk

            chunk = loss_chunk()
        else:
            chunk = _chunk_loss
        for s in range(0, M, chunk_rows):
            e = min(s + chunk_rows, M)
            h, lab, w = hidden_MH[s:e], labels_M[s:e], w_M[s:e]
            pad = chunk_rows - (e - s) if compiled else 0
            if pad:
                h = torch.nn.functional.pad(h, (0, 0, 0, pad))
                lab = torch.nn.functional.pad(lab, (0, pad))
                w = torch.nn.functional.pad(w, (0, pad))
            part, preds, grad = chunk(h, weight_VH, lab, w, need_grad)
            loss += part
            preds_M[s:e] = preds[: e - s]
            if grad_MH is not None:
                grad_MH[s:e] = grad[: e - s]
        ctx.save_for_backward(grad_MH if grad_MH is not None else hidden_MH.new_empty(0))
        ctx.mark_non_differentiable(preds_M)
        return loss, preds_M

    @staticmethod
    def backward(ctx, grad_loss, grad_preds):
        (grad_MH,) = ctx.saved_tensors
        return (grad_MH * grad_loss.to(grad_MH.dtype), None, None, None, None, None)


@dataclass
class BlockLossOutput:
    """Device tensors; nothing here forces a host sync."""

    loss_sum: torch.Tensor  # sum of w * CE over supervised block positions (differentiable)
    weight_sum: torch.Tensor  # sum of w over the same positions
    correct_K: torch.Tensor  # per block index k = 1..B-1: correct predictions
    count_K: torch.Tensor  # per block index k = 1..B-1: supervised positions
    run_sum: torch.Tensor  # sum over counted blocks of the accepted run length
    num_blocks: torch.Tensor  # blocks counted (those with a target at k = 1)
    run_hist: torch.Tensor  # [B] blocks by accepted run length 0..B-1

    def loss(self) -> torch.Tensor:
        return self.loss_sum / self.weight_sum.clamp(min=1e-12)


def block_loss(
    hidden_MH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    labels_M: torch.Tensor,
    valid_M: torch.Tensor,
    block_size: int,
    gamma: float | None = None,
    chunk_rows: int = ObjectiveSection.lm_head_chunk_rows,
    compile: bool = False,
) -> BlockLossOutput:
    """Decayed cross-entropy of draft blocks plus the statistics of what would be accepted.

    Rows are N blocks of `block_size` (block-major). `valid_M` marks rows with a supervised
    target (k >= 1, inside the anchor's document). Labels of invalid rows are ignored.
    `compile`: run each chunk's math through torch.compile (one fused graph per chunk shape;
    chunks are min(chunk_rows, rows) long, the last one padded).
    """
    M = hidden_MH.shape[0]
    assert M % block_size == 0, "rows must be whole blocks"
    assert not lm_head_weight_VH.requires_grad, "the target's lm_head is frozen"
    N = M // block_size
    device = hidden_MH.device
    w_B = position_weights(block_size, gamma, device)
    valid_NB = valid_M.view(N, block_size).to(torch.bool)
    row_w_M = (w_B[None, :] * valid_NB).flatten()
    labels_M = torch.where(valid_M.to(torch.bool), labels_M, torch.zeros_like(labels_M))
    chunk_rows = max(1, min(int(chunk_rows), M)) if compile else max(1, int(chunk_rows))
    loss_sum, preds_M = _ChunkedLinearCrossEntropy.apply(
        hidden_MH, lm_head_weight_VH, labels_M, row_w_M, chunk_rows, compile
    )
    with torch.no_grad():
        correct_NB = (preds_M == labels_M).view(N, block_size) & valid_NB
        correct_NK, valid_NK = correct_NB[:, 1:], valid_NB[:, 1:]
        run_N = accepted_run_length(correct_NK)
        counted_N = valid_NK[:, 0]
        # One-hot sum instead of bincount of a masked selection: no data-dependent shape, so
        # no host sync on the GPU.
        run_hist = (torch.nn.functional.one_hot(run_N, block_size) * counted_N[:, None]).sum(0)
        return BlockLossOutput(
            loss_sum=loss_sum,
            weight_sum=row_w_M.sum(),
            correct_K=correct_NK.sum(0),
            count_K=valid_NK.sum(0),
            run_sum=(run_N * counted_N).sum(),
            num_blocks=counted_N.sum(),
            run_hist=run_hist,
        )
