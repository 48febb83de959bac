"""The decayed block loss against F.cross_entropy, chunking, and the acceptance count."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_train.core import loss
from dflash_train.core.loss import (
    LossSettings,
    _ChunkedLinearLoss,
    accepted_run_length,
    block_loss,
    default_gamma,
    dpace_weights,
    position_weights,
    tail_rows,
)


def _case(seed=0, N=7, B=4, H=16, V=50):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N * B, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N * B,), generator=g)
    valid = torch.rand(N * B, generator=g) < 0.7
    valid.view(N, B)[:, 0] = False
    return hidden, weight, labels, valid


def test_loss_equals_weighted_cross_entropy_reference():
    B, gamma = 4, 2.5
    hidden, weight, labels, valid = _case(B=B)
    h = hidden.clone().requires_grad_(True)
    out = block_loss(h, weight, labels, valid, B, LossSettings(gamma=gamma, chunk_rows=5))
    # Reference: explicit weights w_k = exp(-(k-1)/gamma) for k >= 1 on valid rows.
    k = torch.arange(h.shape[0]) % B
    w = torch.where(valid, torch.exp(-(k - 1).double() / gamma), torch.zeros((), dtype=torch.float64))
    h_ref = hidden.clone().requires_grad_(True)
    ce = F.cross_entropy(h_ref @ weight.t(), labels, reduction="none")
    ref = (w * ce).sum() / w.sum()
    torch.testing.assert_close(out.loss().double(), ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.weight_sum.double(), w.sum(), atol=1e-6, rtol=1e-6)
    out.loss().backward()
    ref.backward()
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-6, rtol=1e-5)


def _reference(hidden, weight, labels, valid, B, gamma):
    """Whole [M, V] logits in float64, F.cross_entropy, autograd: loss sum, argmax, gradient."""
    h = hidden.detach().double().requires_grad_(True)
    logits = h @ weight.double().t()
    k = torch.arange(h.shape[0]) % B
    w = torch.where(valid, torch.exp(-(k - 1).double() / gamma), torch.zeros((), dtype=torch.float64))
    loss_sum = (w * F.cross_entropy(logits, torch.where(valid, labels, 0), reduction="none")).sum()
    loss_sum.backward()
    return loss_sum.detach(), logits.argmax(-1), h.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_preds_and_gradient_equal_full_logits_reference(dtype):
    """The chunked math (argmax on the raw logits, float32 log-softmax, softmax written in the
    weight's dtype, row weights after the matmul) against whole float64 logits: invalid rows,
    out-of-vocabulary labels on them, a last partial chunk; bf16 as on the GPU."""
    B, gamma = 4, 7.0
    hidden, weight, labels, valid = _case(seed=11, N=9, B=B, H=32, V=300)
    labels = torch.where(valid, labels, torch.full_like(labels, 10**6))
    hidden, weight = (hidden * 0.5).to(dtype), weight.to(dtype)
    ref_loss, ref_preds, ref_grad = _reference(hidden, weight, labels, valid, B, gamma)
    h = hidden.clone().requires_grad_(True)
    out = block_loss(h, weight, labels, valid, B, LossSettings(gamma=gamma, chunk_rows=16))  # 36 rows: 16 + 16 + 4
    out.loss_sum.backward()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.loss_sum.double(), ref_loss, **tol)
    torch.testing.assert_close(h.grad.double(), ref_grad, **tol)
    # Predictions: the argmax of the logits the matmul produced, every row (invalid ones too).
    _, preds, _, _ = _ChunkedLinearLoss.apply(hidden, weight, torch.where(valid, labels, 0), None, 16, False)
    assert torch.equal(preds, (hidden @ weight.t()).argmax(-1))
    if dtype == torch.float32:
        assert torch.equal(preds, ref_preds)


@pytest.mark.parametrize("soft", [False, True])
def test_compiled_chunks_equal_eager(soft):
    """The torch.compile path (train.compile on CUDA) against the eager one, on CPU: padded
    last chunk, loss, predictions and gradient, with hard labels and with distillation (the
    target's states). Skipped without a C++ compiler."""
    import shutil

    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    B = 4
    if soft:
        hidden, weight, labels, valid, target = _soft_case(23, N=7)
        target = target.float()
    else:
        hidden, weight, labels, valid = _case(seed=13, N=7, B=B, H=32, V=300)
        target = None
    hidden, weight = hidden.float(), weight.float()
    outs = []
    for compile in (False, True):
        h = hidden.clone().requires_grad_(True)
        out = block_loss(h, weight, labels, valid, B, LossSettings(gamma=7.0, chunk_rows=12, compile=compile),  # 12 + 12 + 4
                         target_hidden_MH=target)
        out.loss_sum.backward()
        outs.append((out, h.grad))
    (eager, g_eager), (comp, g_comp) = outs
    torch.testing.assert_close(comp.loss_sum, eager.loss_sum, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_comp, g_eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(comp.correct_K, eager.correct_K) and torch.equal(comp.run_hist, eager.run_hist)


def test_compiled_tail_chunks_share_one_graph(monkeypatch):
    """A last, shorter chunk is padded to the tail multiple: padded to a whole chunk it runs the
    full chunks' graph, shorter the tail graph, whose later lengths reuse it; the results equal
    the eager path. Skipped without a C++ compiler."""
    import shutil

    from torch._dynamo.utils import counters


    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    calls = []
    real_chunk = loss.compiled_chunk

    def spied(soft=False, tail=False):
        fn = real_chunk(soft, tail)

        def call(h, *args):
            calls.append((tail, h.shape[0]))
            return fn(h, *args)
        return call

    monkeypatch.setattr(loss, "compiled_chunk", spied)
    monkeypatch.setattr(loss, "tail_multiple", lambda device: 4)  # CUDA's padding, on CPU
    B = 4
    hidden, weight, labels, valid = _case(seed=29, N=12, B=B, H=32, V=300)  # 36 scored rows
    hidden, weight = hidden.float(), weight.float()
    graphs = []
    for rows in (36, 33, 30, 27):  # 3 scored rows a block: no tail, then tails of 9, 6, 3 rows (12, 8, 4 padded)
        n = rows // (B - 1) * B
        h = hidden[:n].clone().requires_grad_(True)
        comp = block_loss(h, weight, labels[:n], valid[:n], B, LossSettings(gamma=7.0, chunk_rows=12, compile=True))
        comp.loss_sum.backward()
        g = hidden[:n].clone().requires_grad_(True)
        eager = block_loss(g, weight, labels[:n], valid[:n], B, LossSettings(gamma=7.0, chunk_rows=12, compile=False))
        eager.loss_sum.backward()
        torch.testing.assert_close(comp.loss_sum, eager.loss_sum, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h.grad, g.grad, atol=1e-5, rtol=1e-5)
        assert torch.equal(comp.correct_K, eager.correct_K) and torch.equal(comp.run_hist, eager.run_hist)
        graphs.append(int(counters["stats"]["unique_graphs"]))
    assert calls == [(False, 12)] * 3 + [(False, 12)] * 3 + [(False, 12)] * 2 + [(True, 8)] \
        + [(False, 12)] * 2 + [(True, 4)]
    # a tail padded to a whole chunk compiles nothing new; after the first shorter tail (30
    # rows), tails of other lengths neither
    assert graphs[1] == graphs[0] and graphs[3] == graphs[2], graphs


def test_tail_rows():
    assert loss.tail_multiple(torch.device("cuda")) == 512 and loss.tail_multiple(torch.device("cpu")) == 1
    assert [tail_rows(n, 4096) for n in (1, 469, 512, 513, 3397, 3585, 4096)] == [512, 512, 512, 1024, 3584, 4096, 4096]
    assert tail_rows(9, 12) == 12  # never past a whole chunk
    assert [tail_rows(n, 4096, 1) for n in (1, 469, 4096)] == [1, 469, 4096]


def test_a_shorter_last_chunk_is_padded_with_zero_rows(monkeypatch):
    """With a tail multiple (CUDA's padding, forced here on CPU), the last chunk's rows are
    padded with zero rows and label 0, the padding's outputs dropped: what the chunk function
    receives, and loss, gradient and statistics equal to one unpadded chunk. On CPU by default
    nothing is padded. (The Triton kernel's chunks go through the same loop; tests/test_gpu.py
    runs it on CUDA.)"""
    B = 4
    hidden, weight, labels, valid = _case(seed=31, N=40, B=B, H=16, V=300)  # 120 scored rows
    hidden, weight = hidden.float(), weight.float()
    real = loss.hard_chunk_loss
    seen = []

    def spied(h, w, labels_C, need_grad):
        seen.append((h.shape[0], labels_C.shape[0], h[h.shape[0] - 1].abs().sum().item(), labels_C[-1].item()))
        return real(h, w, labels_C, need_grad)

    monkeypatch.setattr(loss, "hard_chunk_loss", spied)
    block_loss(hidden, weight, labels, valid, B, LossSettings(gamma=7.0, chunk_rows=48))
    assert [r[0] for r in seen] == [48, 48, 24]  # CPU: the tail as it is
    seen.clear()
    monkeypatch.setattr(loss, "tail_multiple", lambda device: 16)
    outs = []
    for chunk in (48, 120):  # 48 + 48 + 24 rows (the last padded to 32), then one chunk of 120
        h = hidden.clone().requires_grad_(True)
        out = block_loss(h, weight, labels, valid, B, LossSettings(gamma=7.0, chunk_rows=chunk))
        out.loss_sum.backward()
        outs.append((out, h.grad))
    assert [r[:2] for r in seen] == [(48, 48), (48, 48), (32, 32), (120, 120)]
    assert seen[2][2:] == (0.0, 0)  # the padding: a zero row, label 0
    (padded, g_padded), (whole, g_whole) = outs
    torch.testing.assert_close(padded.loss_sum, whole.loss_sum, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_padded, g_whole, atol=1e-5, rtol=1e-5)
    for field in ("correct_K", "count_K", "run_sum", "num_blocks", "run_hist"):
        assert torch.equal(getattr(padded, field), getattr(whole, field)), field


@pytest.mark.parametrize("soft,weighting", [(False, "decay"), (False, "dpace"), (True, "decay"), (True, "dpace")])
def test_chunked_and_unchunked_agree(soft, weighting):
    """Loss and gradient do not depend on the chunk size: hard labels and distillation, the
    decay and D-PACE (whose weights come from the whole block, across chunk boundaries)."""
    B = 4
    if soft:
        hidden, weight, labels, valid, target = _soft_case(19)
        target = target.float()
    else:
        hidden, weight, labels, valid = _case(seed=3, N=9, B=B)
        target = None
    hidden, weight = hidden.float(), weight.float()
    grads, losses = [], []
    for chunk in (1, 7, 4096):
        h = hidden.clone().requires_grad_(True)
        out = block_loss(h, weight, labels, valid, B, LossSettings(gamma=7.0 if weighting == "decay" else None, chunk_rows=chunk, weighting=weighting),
                         target_hidden_MH=target)
        (out.loss() * 3.0).backward()
        losses.append(out.loss().detach())
        grads.append(h.grad)
    for l, g in zip(losses[1:], grads[1:]):  # float32: equal up to the summation order of the products
        torch.testing.assert_close(l, losses[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g, grads[0], atol=1e-5, rtol=1e-5)


def test_sum_form_is_exact_across_micro_batches():
    B = 4
    hidden, weight, labels, valid = _case(seed=5, N=10, B=B)
    whole = block_loss(hidden, weight, labels, valid, B, LossSettings(gamma=3.0))
    a = block_loss(hidden[:12], weight, labels[:12], valid[:12], B, LossSettings(gamma=3.0))
    b = block_loss(hidden[12:], weight, labels[12:], valid[12:], B, LossSettings(gamma=3.0))
    torch.testing.assert_close((a.loss_sum + b.loss_sum) / (a.weight_sum + b.weight_sum), whole.loss())


def test_invalid_rows_and_their_labels_do_not_matter():
    B = 4
    hidden, weight, labels, valid = _case(seed=9, B=B)
    junk = torch.where(valid, labels, torch.full_like(labels, 10**6))  # out-of-vocab where invalid
    a = block_loss(hidden, weight, labels, valid, B, LossSettings(gamma=3.0))
    b = block_loss(hidden, weight, junk, valid, B, LossSettings(gamma=3.0))
    assert torch.equal(a.loss_sum, b.loss_sum) and torch.equal(a.correct_K, b.correct_K)


def test_accepted_run_length_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    m = torch.rand(200, 15, generator=g) < 0.8
    runs = accepted_run_length(m)
    for row, r in zip(m.tolist(), runs.tolist()):
        n = 0
        while n < len(row) and row[n]:
            n += 1
        assert r == n
    assert accepted_run_length(torch.ones(3, 15, dtype=torch.bool)).tolist() == [15] * 3
    assert accepted_run_length(torch.zeros(2, 15, dtype=torch.bool)).tolist() == [0, 0]


def test_accuracy_and_run_statistics():
    """Hidden states built so that predictions are right exactly where planned."""
    B, V = 4, 8
    weight = torch.eye(V)
    # Block 0: all correct; block 1: wrong at k=2; block 2: cut after k=1 (document end).
    labels = torch.tensor([0, 1, 2, 3, 0, 4, 5, 6, 0, 7, 1, 1])
    preds = torch.tensor([9, 1, 2, 3, 9, 4, 0, 6, 9, 7, 1, 1]) % V
    hidden = F.one_hot(preds, V).float() * 10
    valid = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 0, 0], dtype=torch.bool)
    out = block_loss(hidden, weight, labels, valid, B, LossSettings(gamma=3.0))
    assert out.correct_K.tolist() == [3, 1, 2]
    assert out.count_K.tolist() == [3, 2, 2]
    # Runs: 3, 1, 1 (block 2's run stops where its document ends).
    assert out.run_sum.item() == 5 and out.num_blocks.item() == 3
    assert out.run_hist.tolist() == [0, 2, 0, 1]


def test_gamma_defaults_and_weights():
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    with pytest.raises(ValueError, match="objective.gamma"):
        default_gamma(12)
    w = position_weights(16)
    assert w[0] == 0 and w[1] == 1 and math.isclose(float(w[8]), math.exp(-1), rel_tol=1e-6)
    with pytest.raises(ValueError, match="positive"):
        position_weights(16, gamma=0)


# --------------------------------------------------------------------------- distillation


def _soft_reference(hidden, weight, target, valid, B, gamma):
    """Whole [M, V] logits of drafter and target in float64, autograd: sum of decayed
    KL(target || drafter), the gradient, and the target's argmax."""
    h = hidden.detach().double().requires_grad_(True)
    logq = torch.log_softmax(h @ weight.double().t(), dim=-1)
    logp = torch.log_softmax(target.double() @ weight.double().t(), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    k = torch.arange(h.shape[0]) % B
    w = torch.where(valid, torch.exp(-(k - 1).double() / gamma), torch.zeros((), dtype=torch.float64))
    loss_sum = (w * kl).sum()
    loss_sum.backward()
    return loss_sum.detach(), h.grad, logp.argmax(-1), w.sum()


def _soft_case(seed, N=9, B=4, H=32, V=300):
    hidden, weight, labels, valid = _case(seed=seed, N=N, B=B, H=H, V=V)
    g = torch.Generator().manual_seed(seed + 100)
    # The target's state: near the drafter's, so the two distributions overlap (a KL of a few
    # nats, not hundreds), and with a sharper head.
    target = 2.0 * hidden + 0.5 * torch.randn(hidden.shape, generator=g, dtype=torch.float64)
    return hidden * 0.5, weight, labels, valid, target * 0.5


def test_soft_label_loss_equals_float64_reference():
    """labels=distill: KL(target || drafter) from the target's final state through the same lm_head,
    chunked (last chunk partial), against whole float64 logits and autograd; accuracy counted
    against the target's greedy token; the data labels play no part."""
    B, gamma = 4, 7.0
    hidden, weight, labels, valid, target = _soft_case(17)
    ref_loss, ref_grad, ref_greedy, ref_w = _soft_reference(hidden, weight, target, valid, B, gamma)
    h = hidden.clone().requires_grad_(True)
    out = block_loss(h, weight, labels, valid, B, LossSettings(gamma=gamma, chunk_rows=16), target_hidden_MH=target)
    out.loss_sum.backward()
    torch.testing.assert_close(out.loss_sum.double(), ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.weight_sum.double(), ref_w, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h.grad, ref_grad, atol=1e-6, rtol=1e-5)
    preds = (hidden @ weight.t()).argmax(-1)
    correct = ((preds == ref_greedy) & valid).view(-1, B)[:, 1:].sum(0)
    assert torch.equal(out.correct_K, correct)
    junk = block_loss(hidden, weight, torch.randint(0, 300, labels.shape), valid, B, LossSettings(gamma=gamma, chunk_rows=16), target_hidden_MH=target)
    assert torch.equal(junk.loss_sum, out.loss_sum.detach()) and torch.equal(junk.correct_K, out.correct_K)


# --------------------------------------------------------------------------- D-PACE weightings


def test_dpace_weights_by_hand():
    """One block of 5 with alpha 0.5: q = (-, 0.5, 1, 0, 0.5) -> s = (1, 0.75, 1, 0.5, 0.75),
    prefix P = (1, 0.75, 0.75, 0.375, 0.28125); a second block with position 2 unsupervised
    (s = 1 there: the products pass through it, and it gets no weight)."""
    q = torch.tensor([[0.9, 0.5, 1.0, 0.0, 0.5], [0.9, 0.5, 0.3, 0.0, 0.5]])
    valid = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 0, 1, 1]], dtype=torch.bool)
    w = {name: dpace_weights(q, valid, 0.5, name) for name in ("dpace", "dpace_prefix", "dpace_continuation")}
    # Suffix sums of P over supervised positions: 2.15625, 1.40625, 0.65625, 0.28125.
    torch.testing.assert_close(w["dpace"][0], torch.tensor([0, 2.15625, 1.40625, 0.65625, 0.28125]))
    torch.testing.assert_close(w["dpace_prefix"][0], torch.tensor([0, 0.75, 0.75, 0.375, 0.28125]))
    torch.testing.assert_close(w["dpace_continuation"][0], torch.tensor([0, 2.875, 1.875, 1.75, 1.0]))
    # Second block: P = (1, 0.75, 0.75, 0.375, 0.28125) again (position 2 passes through).
    torch.testing.assert_close(w["dpace"][1], torch.tensor([0, 1.40625, 0, 0.65625, 0.28125]))
    torch.testing.assert_close(w["dpace_prefix"][1], torch.tensor([0, 0.75, 0, 0.375, 0.28125]))
    # alpha = 1: every s = 1, the weights ignore the confidence (prefix: uniform).
    torch.testing.assert_close(dpace_weights(q, valid, 1.0, "dpace_prefix"), valid.float())
    with pytest.raises(ValueError, match="D-PACE"):
        dpace_weights(q, valid, 0.5, "decay")


@pytest.mark.parametrize("weighting", ["dpace", "dpace_prefix", "dpace_continuation"])
def test_dpace_loss_and_gradient_equal_a_loop_reference(weighting):
    """block_loss with a D-PACE weighting: sum over rows of w * CE with w from a per-block Python
    loop over the float64 reference's label probabilities, held constant in the gradient, and
    normalised by the number of supervised rows."""
    B, alpha = 4, 0.3
    hidden, weight, labels, valid = _case(seed=29, N=9, B=B, H=32, V=300)
    hidden = hidden * 0.3  # label probabilities well away from 0: the weights differ by position
    h_ref = hidden.clone().requires_grad_(True)
    ce = F.cross_entropy(h_ref @ weight.t(), torch.where(valid, labels, 0), reduction="none")
    q = torch.exp(-ce.detach()).view(-1, B).tolist()
    w_ref = []
    for q_block, v_block in zip(q, valid.view(-1, B).tolist()):
        prefix, run = [], 1.0
        for qk, vk in zip(q_block, v_block):
            run *= (1 - alpha) * qk + alpha if vk else 1.0
            prefix.append(run)
        for k in range(B):
            suffix = sum(prefix[j] for j in range(k, B) if v_block[j])
            value = {"dpace": suffix, "dpace_prefix": prefix[k], "dpace_continuation": suffix / prefix[k]}[weighting]
            w_ref.append(value if v_block[k] else 0.0)
    w_ref = torch.tensor(w_ref, dtype=torch.float64)
    ref = (w_ref * ce).sum()
    ref.backward()
    h = hidden.clone().requires_grad_(True)
    out = block_loss(h, weight, labels, valid, B, LossSettings(chunk_rows=5, weighting=weighting, dpace_alpha=alpha))
    out.loss_sum.backward()
    torch.testing.assert_close(out.loss_sum.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-6, rtol=1e-5)
    assert out.weight_sum.item() == valid.sum().item()
    assert len(set(round(v, 6) for v in w_ref.tolist())) > 3  # really position-dependent


def test_dpace_with_distillation_scores_the_targets_greedy_token():
    """labels=distill with D-PACE: the confidence is the drafter's probability of the target's
    greedy token, the row loss the KL."""
    B, alpha = 4, 0.5
    hidden, weight, labels, valid, target = _soft_case(31)
    logq = torch.log_softmax(hidden @ weight.t(), -1)
    logp = torch.log_softmax(target @ weight.t(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    conf = logq.gather(-1, logp.argmax(-1, keepdim=True)).squeeze(-1).exp()
    w = dpace_weights(conf.view(-1, B), valid.view(-1, B), alpha).flatten().double()
    out = block_loss(hidden, weight, labels, valid, B, LossSettings(weighting="dpace", dpace_alpha=alpha), target_hidden_MH=target)
    torch.testing.assert_close(out.loss_sum.double(), (w * kl).sum(), atol=1e-5, rtol=1e-5)


def test_chunked_loss_backward_scales_each_rows_gradient_and_rounds_once():
    """_ChunkedLinearLoss's backward: the input gradient of row m is the forward's d loss_m / d h
    (formed chunk by chunk) times the incoming d total / d loss_m, the product formed in float32
    and rounded to bf16 once: bit for bit, whatever the chunking (one kernel over all rows, no
    float32 temporary)."""
    from dflash_train.core.loss import hard_chunk_loss

    torch.manual_seed(0)
    M, H, V = 37, 16, 50
    h = torch.randn(M, H).to(torch.bfloat16)
    weight = (torch.randn(V, H) * 0.3).to(torch.bfloat16)
    labels = torch.randint(0, V, (M,))
    row_weights = torch.rand(M) * 3 + 0.01
    for chunk_rows in (5, 37, 64):
        per_row = torch.cat([hard_chunk_loss(h[s:s + chunk_rows], weight, labels[s:s + chunk_rows], True)[3]
                             for s in range(0, M, chunk_rows)])  # d loss_m / d h as the forward forms it, bf16
        want = (per_row.float() * row_weights[:, None]).to(torch.bfloat16)
        x = h.clone().requires_grad_()
        rows = _ChunkedLinearLoss.apply(x, weight, labels, None, chunk_rows, False, "torch")[0]
        (rows * row_weights).sum().backward()
        assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, want), chunk_rows
