"""The DFlash training objective and the acceptance count.

Owns: the per-row losses of draft blocks with a chunked lm_head (full [rows, vocab] logits never
exist at once): cross-entropy towards hard labels (the data's tokens or the target's greedy ones)
or KL divergence from the target's whole next-token distribution (distillation: the target's
logits are recomputed chunk by chunk from its final hidden state and the same frozen lm_head);
the weighting of block positions (the paper's fixed decay, or D-PACE's weights from the
drafter's own confidence); per-position accuracy; and `accepted_run_length`, the one definition
of "how many proposals would be accepted" used by training metrics, evaluation and benchmarks.

The loss comes back as (weighted sum, weight sum): dividing the totals over micro-batches and
ranks gives the exact mean, never a mean of means.

Shape legend: N blocks, B block size, K = B - 1 predicted positions, M = N*B rows, R = N*K
scored rows (a block's anchor row is never scored), C rows of one chunk, H hidden size, V
vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_train.core.compiler import raise_recompile_limit
from dflash_train.core.config import DEFAULT_GAMMA, ObjectiveSection

WEIGHTINGS = ("decay", "dpace", "dpace_prefix", "dpace_continuation")


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
    # A product, not w[0] = 0.0: a Python number written into a GPU tensor is a host sync.
    return torch.exp(-(k - 1) / gamma) * (k > 0)


@torch.no_grad()
def dpace_weights(confidence_NB: torch.Tensor, valid_NB: torch.Tensor, alpha: float,
                  weighting: str = "dpace") -> torch.Tensor:
    """D-PACE position weights [N, B] from the drafter's probability of each position's label.

    With s_k = (1 - alpha) q_k + alpha (smoothed confidence; 1 at positions without a target,
    which leaves the products unchanged) and P_k = s_1 ... s_k (the smoothed chance that the
    first k proposals are all accepted), the expected accepted length is approximated by
    sum_j P_j. Its derivative with respect to log s_k is sum_{j >= k} P_j: that is the weight
    of position k ("dpace"). The two components alone: P_k ("dpace_prefix", cumulative
    confidence) and sum_{j >= k} P_j / P_k ("dpace_continuation", the expected run after k).
    The weights are detached (a constant per step) and 0 where there is no target.
    """
    if weighting not in WEIGHTINGS[1:]:
        raise ValueError(f"not a D-PACE weighting: {weighting!r}")
    valid = valid_NB.to(torch.bool)
    q = confidence_NB.detach().to(torch.float32)
    smooth_NB = torch.where(valid, (1.0 - alpha) * q + alpha, torch.ones_like(q))
    prefix_NB = torch.cumprod(smooth_NB, dim=-1)
    if weighting == "dpace_prefix":
        w_NB = prefix_NB
    else:
        counted = prefix_NB * valid
        suffix_NB = counted.flip(-1).cumsum(-1).flip(-1)
        w_NB = suffix_NB if weighting == "dpace" else suffix_NB / prefix_NB.clamp_min(torch.finfo(torch.float32).tiny)
    return w_NB * valid


def accepted_run_length(matches_NK: torch.Tensor) -> torch.Tensor:
    """Per block, the length of the leading run of True: how many proposals in a row a
    greedy verifier accepts. matches [..., K] bool -> [...] long."""
    return matches_NK.to(torch.long).cumprod(dim=-1).sum(dim=-1)


def hard_chunk_loss(h_CH, weight_VH, labels_C, need_grad: bool):
    """One chunk of rows towards hard labels: (CE per row, argmax of the logits, the label's
    log-probability, d CE_row / d h or None).

    Written for few passes over the [C, V] logits, which dominate the loss's memory traffic:
    argmax on the logits as they come out of the matmul (no float copy), one log_softmax that
    reads them and writes float32 log-probabilities, and one exp that writes the softmax
    straight in the weight's dtype for the input-gradient matmul. d CE / d logits = softmax -
    onehot(label); the label column is expm1(log p) in float32, so p - 1 keeps its precision
    near p = 1. Row weights are applied later, to the [C, H] product (autograd backward).
    Compiled (`compile=True` in `block_loss`), inductor fuses the same math into about two
    passes over bf16 logits.
    """
    logits_CV = h_CH @ weight_VH.t()
    preds_C = logits_CV.argmax(dim=-1)
    logp_CV = torch.log_softmax(logits_CV, dim=-1, dtype=torch.float32)
    del logits_CV
    picked_C = logp_CV.gather(-1, labels_C[:, None]).squeeze(-1)
    if not need_grad:
        return -picked_C, preds_C, picked_C, None
    probs_CV = torch.empty_like(logp_CV, dtype=weight_VH.dtype)
    torch.exp(logp_CV, out=probs_CV)  # one pass, written in the weight's dtype
    del logp_CV
    probs_CV.scatter_(-1, labels_C[:, None], torch.expm1(picked_C).to(weight_VH.dtype)[:, None])
    return -picked_C, preds_C, picked_C, probs_CV @ weight_VH


def _soft_chunk_loss(h_CH, weight_VH, target_CH, need_grad: bool):
    """One chunk of rows towards the target's distribution: (KL(target || drafter) per row,
    argmax of the drafter's logits, the target's argmax (its greedy token), the drafter's
    log-probability of that token, d KL_row / d h or None).

    The target's logits come from its final hidden state `target_CH` and the same frozen
    lm_head, chunk by chunk like the drafter's. Both log-softmaxes are float32; KL = sum p (log
    p - log q) is reduced by two row dot products (no [C, V] temporary); d KL / d logits = q -
    p is formed in float32 (both near 1 at the argmax: no cancellation in the weight's dtype)
    and written once in the weight's dtype for the input-gradient matmul. Peak: three float32
    [C, V] buffers (log p, log q, p), twice the hard-label chunk's.
    """
    t_logits_CV = target_CH @ weight_VH.t()
    greedy_C = t_logits_CV.argmax(dim=-1)
    logp_CV = torch.log_softmax(t_logits_CV, dim=-1, dtype=torch.float32)
    del t_logits_CV
    logits_CV = h_CH @ weight_VH.t()
    preds_C = logits_CV.argmax(dim=-1)
    logq_CV = torch.log_softmax(logits_CV, dim=-1, dtype=torch.float32)
    del logits_CV
    picked_C = logq_CV.gather(-1, greedy_C[:, None]).squeeze(-1)
    p_CV = logp_CV.exp()
    kl_C = torch.einsum("cv,cv->c", p_CV, logp_CV) - torch.einsum("cv,cv->c", p_CV, logq_CV)
    del logp_CV
    if not need_grad:
        return kl_C, preds_C, greedy_C, picked_C, None
    logq_CV.exp_().sub_(p_CV)  # q - p, float32
    del p_CV
    return kl_C, preds_C, greedy_C, picked_C, logq_CV.to(weight_VH.dtype) @ weight_VH


TAIL_ROW_MULTIPLE = 512
"""On CUDA, a last, shorter lm_head chunk is padded to a multiple of this many rows (`tail_rows`).

The tail's row count follows the step's anchor count, so unpadded it takes a new value almost
every step, and the cuBLAS products of some of those row counts hold the host until the GPU has
run out of queued work (docs/PERFORMANCE.md). Padded, a tail has one of chunk_rows / 512 shapes
(8 for chunks of 4,096 rows), for at most 511 rows of extra lm_head work. On CPU, with no launch
queue to run dry, padding would only add work: none there."""


def tail_multiple(device: torch.device) -> int:
    """The row multiple a last chunk is padded to on `device`: TAIL_ROW_MULTIPLE on CUDA, else 1."""
    return TAIL_ROW_MULTIPLE if device.type == "cuda" else 1


def tail_rows(rows: int, chunk_rows: int, multiple: int = TAIL_ROW_MULTIPLE) -> int:
    """The rows a chunk of `rows` (at most `chunk_rows`) is run with: `rows` rounded up to a
    multiple of `multiple`, at most `chunk_rows` (a whole chunk stays as it is)."""
    return min(chunk_rows, -(-rows // multiple) * multiple)


class _ChunkedLinearLoss(torch.autograd.Function):
    """Per-row loss of hidden @ W^T, computed chunk by chunk: CE towards `labels_M`, or, given
    `target_MH` (the target's final hidden state per row), KL from the target's distribution.

    Returns (loss per row, drafter argmax, the label each row is scored against (the target's
    argmax with `target_MH`), the drafter's log-probability of that label). The gradient of
    each row's loss with respect to `hidden` is formed in the forward, chunk by chunk, so only
    one chunk of logits is ever alive; backward only scales row m by the incoming d loss /
    d row_m (the row weights, which may therefore depend on this forward's outputs). The
    lm_head weight and the target belong to the frozen target and get no gradient. Every chunk
    but the last has `chunk_rows` rows; a last, shorter chunk is padded with zero rows (label 0,
    outputs dropped) to `tail_rows`: on CUDA a multiple of TAIL_ROW_MULTIPLE, at most a whole
    chunk (`tail_multiple`).
    With `compiled`, whole chunks run one static graph and a padded tail shorter than a chunk
    its own graph, compiled once with the row count dynamic. `kernel="triton"` (hard labels
    only): each chunk runs `loss_kernel.triton_hard_chunk_loss` (the same math, its
    element-wise middle one kernel).
    """

    @staticmethod
    def forward(ctx, hidden_MH, weight_VH, labels_M, target_MH, chunk_rows: int, compiled: bool,
                kernel: str = "torch"):
        M = hidden_MH.shape[0]
        device = hidden_MH.device
        need_grad = ctx.needs_input_grad[0]
        soft = target_MH is not None
        row_M = torch.empty(M, dtype=torch.float32, device=device)
        preds_M = torch.empty(M, dtype=torch.long, device=device)
        scored_M = torch.empty(M, dtype=torch.long, device=device) if soft else labels_M
        logq_M = torch.empty(M, dtype=torch.float32, device=device)
        grad_MH = torch.empty_like(hidden_MH) if need_grad else None
        if kernel == "triton":
            # Triton comes with CUDA builds of torch only: imported where the kernel runs.
            from dflash_train.core.loss_kernel import triton_hard_chunk_loss

            assert not soft, "the Triton loss kernel scores hard labels"
            full = tail = triton_hard_chunk_loss
        elif compiled:
            full, tail = compiled_chunk(soft), compiled_chunk(soft, tail=True)
        else:
            full = tail = _soft_chunk_loss if soft else hard_chunk_loss
        multiple = tail_multiple(device)
        # Detached, so that a chunk is the same input to a compiled chunk whether it is a slice
        # (whole chunks, of a tensor that requires grad) or padded (a new tensor), in training
        # and in evaluation alike: one graph per shape (requires_grad is one of its guards).
        rows_MH = hidden_MH.detach()
        for s in range(0, M, chunk_rows):
            e = min(s + chunk_rows, M)
            n = e - s
            h, aux = rows_MH[s:e], (target_MH if soft else labels_M)[s:e]
            padded = tail_rows(n, chunk_rows, multiple)
            if padded > n:  # zero rows with label 0 (zero target rows): scored, then dropped
                h = torch.nn.functional.pad(h, (0, 0, 0, padded - n))
                aux = torch.nn.functional.pad(aux, (0, 0, 0, padded - n) if soft else (0, padded - n))
            chunk = full
            if padded < chunk_rows:
                chunk = tail
                if compiled and kernel == "torch":  # one graph for any row count (a 1-row tail gets its own)
                    torch._dynamo.maybe_mark_dynamic(h, 0)
                    torch._dynamo.maybe_mark_dynamic(aux, 0)
            out = chunk(h, weight_VH, aux, need_grad)
            if soft:
                row_M[s:e], preds_M[s:e], scored_M[s:e], logq_M[s:e] = (t[:n] for t in out[:4])
            else:
                row_M[s:e], preds_M[s:e], logq_M[s:e] = (t[:n] for t in out[:3])
            grad = out[-1]
            if grad_MH is not None:
                grad_MH[s:e] = grad[:n]
        ctx.save_for_backward(grad_MH if grad_MH is not None else hidden_MH.new_empty(0))
        ctx.mark_non_differentiable(preds_M, scored_M, logq_M)
        return row_M, preds_M, scored_M, logq_M

    @staticmethod
    def backward(ctx, grad_row_M, *_):
        (grad_MH,) = ctx.saved_tensors
        # One kernel: each product is formed in float32 (the common dtype of the gradient and
        # the float32 row weights) and rounded to the gradient's dtype once as it is stored (as
        # when the weight scaled it in the forward); no float32 temporary.
        out_MH = torch.empty_like(grad_MH)
        torch.mul(grad_MH, grad_row_M[:, None], out=out_MH)
        return (out_MH, None, None, None, None, None, None)


@dataclass
class BlockLossOutput:
    """Device tensors; nothing here forces a host sync."""

    loss_sum: torch.Tensor  # sum of w * loss over supervised block positions (differentiable)
    weight_sum: torch.Tensor  # the normaliser of the same positions (see block_loss)
    correct_K: torch.Tensor  # per block index k = 1..B-1: correct predictions
    count_K: torch.Tensor  # per block index k = 1..B-1: supervised positions
    run_sum: torch.Tensor  # sum over counted blocks of the accepted run length
    num_blocks: torch.Tensor  # blocks counted (those with a target at k = 1)
    run_hist: torch.Tensor  # [B] blocks by accepted run length 0..B-1

    def loss(self) -> torch.Tensor:
        return self.loss_sum / self.weight_sum.clamp(min=1e-12)


@dataclass(frozen=True)
class LossSettings:
    """How block_loss weighs and computes the rows (the objective's settings, plus how the
    lm_head's chunks run)."""

    gamma: float | None = None
    """The decay of weighting="decay" (None: the default for the block size)."""
    chunk_rows: int = ObjectiveSection.lm_head_chunk_rows
    """Rows per lm_head chunk."""
    compile: bool = False
    """Run each chunk's math through torch.compile (one fused graph per chunk shape; chunks
    are min(chunk_rows, R) long, a shorter last one padded to `tail_rows` on CUDA and,
    shorter than a chunk, its own graph with dynamic rows)."""
    kernel: str = "torch"
    """"torch" (the chunk's math as torch operations, compiled with `compile`) or "triton" (hard
    labels only: `loss_kernel.triton_hard_chunk_loss`, one Triton kernel between the two cuBLAS
    products; CUDA, or Triton's interpreter on CPU)."""
    weighting: str = ObjectiveSection.weighting
    """"decay" weighs block index k by exp(-(k-1)/gamma) and normalises by the sum of those
    weights; the D-PACE weightings (`dpace_weights`, smoothing `dpace_alpha`) weigh each row by a
    detached function of the drafter's probability of its label and normalise by the number of
    supervised rows, so the weights keep their absolute size."""
    dpace_alpha: float = ObjectiveSection.dpace_alpha

    @classmethod
    def of(cls, objective: ObjectiveSection, compile: bool = False, kernel: str = "torch") -> "LossSettings":
        """The settings of a run's objective section, with the compilation's choices."""
        return cls(gamma=objective.gamma, chunk_rows=objective.lm_head_chunk_rows, compile=compile, kernel=kernel,
                   weighting=objective.weighting, dpace_alpha=objective.dpace_alpha)

    def problems(self, distill: bool) -> list[str]:
        problems = []
        if self.kernel not in ("torch", "triton"):
            problems.append(f"block_loss kernel must be torch or triton, got {self.kernel!r}")
        if self.kernel == "triton" and distill:
            problems.append("the Triton loss kernel scores hard labels: distillation (target_hidden_MH) needs "
                            "kernel=torch")
        if self.weighting not in WEIGHTINGS:
            problems.append(f"objective.weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}")
        return problems


def block_loss(
    hidden_MH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    labels_M: torch.Tensor,
    valid_M: torch.Tensor,
    block_size: int,
    settings: LossSettings = LossSettings(),
    *,
    target_hidden_MH: torch.Tensor | None = None,
) -> BlockLossOutput:
    """Weighted loss of draft blocks plus the statistics of what would be accepted.

    Rows are N blocks of `block_size` (block-major). `valid_M` marks rows with a supervised
    target (k >= 1, inside the anchor's document). Labels of invalid rows are ignored. A block's
    first row (k = 0, the anchor, which the drafter is given) is never scored: the lm_head runs
    over the R = N*K other rows only.
    `target_hidden_MH`: the target's final hidden state that predicts each row's token
    (distillation): the row loss is KL(target || drafter), and accuracy and accepted runs are
    counted against the target's greedy token instead of `labels_M`. Otherwise the row loss
    is the cross-entropy of `labels_M`. `settings`: the weighting and how chunks run.
    """
    M = hidden_MH.shape[0]
    assert M % block_size == 0, "rows must be whole blocks"
    assert not lm_head_weight_VH.requires_grad, "the target's lm_head is frozen"
    problems = settings.problems(distill=target_hidden_MH is not None)
    if problems:
        raise ValueError("; ".join(problems))
    N, K = M // block_size, block_size - 1
    # Position k = 0 of a block is its anchor, given to the drafter and never scored: only the
    # K = B - 1 rows after it go through the lm_head (1/B of its work saved).
    valid_NK = valid_M.reshape(N, block_size)[:, 1:].to(torch.bool)

    def rows_NK(t: torch.Tensor) -> torch.Tensor:  # [M, ...] -> the scored rows [N*K, ...]
        return t.reshape(N, block_size, *t.shape[1:])[:, 1:].reshape(N * K, *t.shape[1:])

    labels_R = rows_NK(labels_M)
    labels_R = torch.where(valid_NK.flatten(), labels_R, torch.zeros_like(labels_R))
    chunk_rows = max(1, min(int(settings.chunk_rows), N * K)) if settings.compile else max(1, int(settings.chunk_rows))
    if target_hidden_MH is not None:
        assert target_hidden_MH.shape == hidden_MH.shape, "one target hidden state per row"
        target_hidden_MH = rows_NK(target_hidden_MH.to(lm_head_weight_VH.dtype))
    row_R, preds_R, scored_R, logq_R = _ChunkedLinearLoss.apply(
        rows_NK(hidden_MH), lm_head_weight_VH, labels_R, target_hidden_MH, chunk_rows, settings.compile,
        settings.kernel)
    row_w_R, weight_sum = row_weights(settings, valid_NK, logq_R)
    # Rows without a target have weight 0; where() also keeps their finite junk out of the sum.
    loss_sum = torch.where(row_w_R > 0, row_w_R * row_R, torch.zeros_like(row_R)).sum()
    return acceptance_statistics(loss_sum, weight_sum, (preds_R == scored_R).view(N, K), valid_NK)


@torch.no_grad()
def row_weights(settings: LossSettings, valid_NK: torch.Tensor, logq_R: torch.Tensor):
    """(weight of each scored row [N*K], the normaliser) under `settings.weighting`."""
    N, K = valid_NK.shape
    device = valid_NK.device
    if settings.weighting == "decay":
        row_w_R = (position_weights(K + 1, settings.gamma, device)[None, 1:] * valid_NK).flatten()
        return row_w_R, row_w_R.sum()
    ones_N1 = torch.ones(N, 1, device=device, dtype=torch.float32)
    confidence_NB = torch.cat([ones_N1, logq_R.exp().view(N, K)], dim=1)
    valid_NB = torch.cat([torch.zeros_like(valid_NK[:, :1]), valid_NK], dim=1)
    row_w_R = dpace_weights(confidence_NB, valid_NB, settings.dpace_alpha, settings.weighting)[:, 1:].flatten()
    return row_w_R, valid_NK.sum().to(torch.float32)


@torch.no_grad()
def acceptance_statistics(loss_sum, weight_sum, hit_NK: torch.Tensor, valid_NK: torch.Tensor) -> BlockLossOutput:
    """The loss sums with per-position accuracy and the accepted runs of the blocks (`hit_NK`:
    each scored row's prediction equals its label)."""
    correct_NK = hit_NK & valid_NK
    run_N = accepted_run_length(correct_NK)
    counted_N = valid_NK[:, 0]
    # One-hot sum instead of bincount of a masked selection: no data-dependent shape, so
    # no host sync on the GPU.
    run_hist = (torch.nn.functional.one_hot(run_N, valid_NK.shape[1] + 1) * counted_N[:, None]).sum(0)
    return BlockLossOutput(loss_sum=loss_sum, weight_sum=weight_sum, correct_K=correct_NK.sum(0),
                           count_K=valid_NK.sum(0), run_sum=(run_N * counted_N).sum(), num_blocks=counted_N.sum(),
                           run_hist=run_hist)


_compiled_chunks: dict[tuple[bool, bool], object] = {}  # (distillation, tail) -> compiled chunk


def compiled_chunk(soft: bool = False, tail: bool = False):
    """The compiled per-chunk loss (`hard_chunk_loss`, or `_soft_chunk_loss` for distillation);
    block_loss(compile=True) calls it. Full chunks run a static graph; `tail`: the last, shorter
    chunk's function, whose row count the caller marks dynamic (one graph for every tail length
    instead of one per length)."""
    key = (soft, tail)
    if key not in _compiled_chunks:
        raise_recompile_limit()
        _compiled_chunks[key] = torch.compile(_soft_chunk_loss if soft else hard_chunk_loss,
                                              dynamic=None if tail else False, fullgraph=True)
    return _compiled_chunks[key]
