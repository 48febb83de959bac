"""CUDA paths: compiled flex attention with the layout's BlockMask, forward and backward, against
the dense path; bf16 train/serve consistency; the chunked loss on the GPU, compiled and eager,
with hard labels and with distillation, and the Triton loss kernel against the torch chunk; the norm and rotation kernels against their eager rules, where the engine takes them for the drafter's and the target's modules;
the BlockMask read off the layout against create_block_mask, with no host sync; the target's
CUDA graphs against its forward without them; the side-stream packer against the plain one; and on two GPUs (NCCL), the losses of one GPU from colocated and
disaggregated runs and from a checkpoint resumed on another topology. Skipped without a GPU (CI
has none); run on the GPU machine with `python -m pytest tests/test_gpu.py`."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TINY, losses, random_packed_row, subprocess_env, tiny_target_config
from dflash_train.bench.harness import build_run
from dflash_train.core.drafter import DFlashDrafter, build_drafter_config
from dflash_train.core.loss import LossSettings, block_loss
from dflash_train.core.masks import build_attention_masks, build_layout, sample_anchors, step_generator
from dflash_train.train.compilation import SMALL_HEAD_FLEX_OPTIONS, compile_flex_attention, flex_kernel_options

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

B = 16
H = 256


def _setup(seed=0, window=None, dtype=torch.float32):
    torch.manual_seed(seed)
    target = tiny_target_config(hidden_size=H, intermediate_size=512, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=64, num_hidden_layers=12, vocab_size=1000)
    cfg = build_drafter_config(target, num_layers=3, block_size=B, mask_token_id=999, sliding_window=window)
    drafter = DFlashDrafter(cfg).cuda().to(dtype)
    gen = torch.Generator().manual_seed(seed)
    lengths, loss_mask = random_packed_row(gen, 5, max_len=200, pad=37)
    anchors = sample_anchors(loss_mask, lengths, 24, step_generator(seed, 0), pad_to_multiple=8)
    layout = build_layout(anchors.cuda(), loss_mask.cuda(), lengths.cuda(), B)
    T = loss_mask.numel()
    feats = torch.randn(1, T, 3 * H, device="cuda", dtype=dtype)
    embed = torch.randn(1, layout.num_blocks * B, H, device="cuda", dtype=dtype)
    return drafter, layout, feats, embed, lengths


def _run(drafter, layout, feats, embed, backend, kernel_options=None):
    compile_flex_attention(kernel_options)  # as a training run on CUDA does
    drafter.zero_grad(set_to_none=True)
    masks = build_attention_masks(layout, drafter.layer_types, drafter.config.sliding_window, backend)
    out = drafter(feats, embed, layout.position_ids(), attention_mask=masks)
    (out.float() * torch.linspace(-1, 1, out.shape[-1], device="cuda")).sum().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in drafter.named_parameters()}


@pytest.mark.parametrize("window", [None, 64])
def test_compiled_flex_equals_dense_forward_and_backward(window):
    torch.backends.cuda.matmul.allow_tf32 = False
    drafter, layout, feats, embed, _ = _setup(window=window)
    out_f, grads_f = _run(drafter, layout, feats, embed, "flex")
    out_d, grads_d = _run(drafter, layout, feats, embed, "sdpa")
    torch.testing.assert_close(out_f, out_d, atol=1e-4, rtol=1e-4)
    for name in grads_d:
        rel = (grads_f[name] - grads_d[name]).norm() / grads_d[name].norm()
        assert rel < 1e-4, (name, float(rel))


@pytest.mark.parametrize("options", [{"BLOCK_M": 64, "BLOCK_N": 64}, {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32},
                                     {"BLOCK_M": 64, "BLOCK_N": 64, "USE_TMA": True, "PRESCALE_QK": True},
                                     flex_kernel_options(None, 64)])
def test_flex_kernel_options_change_tiles_not_results(options):
    """train.flex_kernel_options reach the compiled kernels and leave forward and gradients
    those of the dense path (the last case: the default for this head dim, 64: the small-head
    tiles, TMA in the forward)."""
    assert flex_kernel_options(None, 64) == SMALL_HEAD_FLEX_OPTIONS  # _setup: head dim 64
    torch.backends.cuda.matmul.allow_tf32 = False
    drafter, layout, feats, embed, _ = _setup(seed=2)
    out_o, grads_o = _run(drafter, layout, feats, embed, "flex", options)
    out_d, grads_d = _run(drafter, layout, feats, embed, "sdpa")
    compile_flex_attention()
    torch.testing.assert_close(out_o, out_d, atol=1e-4, rtol=1e-4)
    for name in grads_d:
        rel = (grads_o[name] - grads_d[name]).norm() / grads_d[name].norm()
        assert rel < 1e-4, (name, float(rel))


@pytest.mark.parametrize("divisible", [False, True], ids=["any-length", "multiples-of-128"])
def test_flex_with_exact_anchor_counts_compiles_once_more_and_matches_dense(divisible):
    """train.anchor_buckets_per_doubling=0: flex compiled with torch's default shape handling
    meets three anchor counts (and row lengths) with one graph more than the first, and each
    matches the dense path, forward and gradients; with rows of multiples of 128 tokens (as
    training packs them), the symbolic lengths' kernels run with IS_DIVISIBLE (no bounds checks)."""
    from dflash_train.bench.harness import compiled_graph_count

    torch.backends.cuda.matmul.allow_tf32 = False
    options = flex_kernel_options(None, 64)
    graphs = []
    for seed, num_anchors in ((3, 16), (4, 32), (5, 48)):
        torch.manual_seed(seed)
        drafter, _, _, _, _ = _setup(seed=seed)
        gen = torch.Generator().manual_seed(seed)
        lengths, loss_mask = random_packed_row(gen, 6, max_len=200, pad=11)
        if divisible:  # queries are whole anchor multiples of 8 blocks of 16: 128 tokens
            loss_mask = torch.cat([loss_mask, loss_mask.new_zeros(-loss_mask.numel() % 128)])
        anchors = sample_anchors(loss_mask, lengths, num_anchors, step_generator(seed, 0), pad_to_multiple=8,
                                 buckets_per_doubling=0)
        layout = build_layout(anchors.cuda(), loss_mask.cuda(), lengths.cuda(), B)
        assert ((loss_mask.numel() + layout.num_blocks * B) % 128 == 0) == divisible
        feats = torch.randn(1, loss_mask.numel(), 3 * H, device="cuda")
        embed = torch.randn(1, layout.num_blocks * B, H, device="cuda")
        compile_flex_attention(options, dynamic=True)
        drafter.zero_grad(set_to_none=True)
        masks = build_attention_masks(layout, drafter.layer_types, None, "flex")
        out_f = drafter(feats, embed, layout.position_ids(), attention_mask=masks)
        (out_f.float() * torch.linspace(-1, 1, out_f.shape[-1], device="cuda")).sum().backward()
        grads_f = {n: p.grad.detach().clone() for n, p in drafter.named_parameters()}
        graphs.append(compiled_graph_count())
        out_d, grads_d = _run(drafter, layout, feats, embed, "sdpa")
        torch.testing.assert_close(out_f.detach(), out_d, atol=1e-4, rtol=1e-4)
        for name in grads_d:
            rel = (grads_f[name] - grads_d[name]).norm() / grads_d[name].norm()
            assert rel < 1e-4, (seed, name, float(rel))
    compile_flex_attention()
    assert graphs[2] - graphs[0] <= 1, graphs


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 matrix products need compute capability 8.9")
def test_fp8_drafter_steps_on_gpu_track_bf16():
    """train.fp8 (each recipe) on the GPU with compiled layers (the bench's tiny workload, hidden 64):
    every linear layer of the drafter is a Float8Linear, and 8 steps' losses stay within a few
    percent of the bf16 run's, step by step."""
    pytest.importorskip("torchao", reason="train.fp8 needs torchao (the fp8 extra)")
    from dflash_train.bench import harness
    from dflash_train.train.loop import take_step

    curves = {}
    for fp8 in ("null", "tensorwise", "rowwise", "rowwise_with_gw_hp"):
        run, _ = harness.build_run("tiny", [f"train.fp8={fp8}", "train.compile=true"], log=lambda *a: None)
        linears = [type(m).__name__ for m in run.step.drafter.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all((n == "Float8Linear") == (fp8 != "null") for n in linears), linears
        curve = []
        for _ in range(8):
            run.step.acc.reset()
            assert take_step(run).applied
            curve.append(float(run.step.acc.sums["loss_sum"] / run.step.acc.sums["weight_sum"]))
        curves[fp8] = curve
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        for step, (full, fp8) in enumerate(zip(curves["null"], curves[recipe])):
            assert fp8 == pytest.approx(full, rel=0.05), (recipe, step, curves)
        assert curves[recipe] != curves["null"]


def test_bf16_train_serve_consistency_with_flex():
    drafter, layout, feats, embed, lengths = _setup(seed=1, dtype=torch.bfloat16)
    compile_flex_attention()
    with torch.no_grad():
        masks = build_attention_masks(layout, drafter.layer_types, None, "flex")
        out = drafter(feats, embed, layout.position_ids(), attention_mask=masks)[0].view(-1, B, H)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).tolist()
        worst = 0.0
        for n, a in enumerate(layout.anchors_N.tolist()):
            if a < 0:
                continue
            s = starts[int(layout.doc_T[a])]
            ref = drafter(feats[:, s:a], embed.view(-1, B, H)[n][None], torch.arange(a - s + B, device="cuda")[None])[0]
            worst = max(worst, float((out[n].float() - ref.float()).norm() / ref.float().norm()))
    assert worst < 2e-2, worst


def random_loss_inputs(seed: int, M: int, V: int = 5000):
    """bf16 hidden rows [M, H] and lm_head [V, H], labels, and ~80% valid rows, on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(M, H, device="cuda", generator=g, dtype=torch.bfloat16)
    weight = (torch.randn(V, H, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    labels = torch.randint(0, V, (M,), device="cuda", generator=g)
    valid = torch.rand(M, device="cuda", generator=g) < 0.8
    return hidden, weight, labels, valid


def test_chunked_loss_on_gpu_matches_fp32_reference():
    M = 64 * B
    hidden, weight, labels, valid = random_loss_inputs(0, M)
    out = block_loss(hidden, weight, labels, valid, B, LossSettings(chunk_rows=128))
    ref = block_loss(hidden.float(), weight.float(), labels, valid, B, LossSettings(chunk_rows=M))
    assert abs(out.loss().item() - ref.loss().item()) / ref.loss().item() < 1e-2


def test_compiled_loss_chunks_equal_eager_on_gpu():
    """block_loss(LossSettings(compile=True)), as the trainer runs it with train.compile on CUDA: bf16, a
    shorter last chunk (the tail graph, rows dynamic), with and without the input gradient."""
    hidden, weight, labels, valid = random_loss_inputs(1, 40 * B)
    outs = []
    for compile in (False, True):
        h = hidden.clone().requires_grad_(True)
        out = block_loss(h, weight, labels, valid, B, LossSettings(chunk_rows=256, compile=compile))  # 256 + 256 + 128
        out.loss_sum.backward()
        with torch.no_grad():
            again = block_loss(hidden, weight, labels, valid, B, LossSettings(chunk_rows=256, compile=compile))
        outs.append((out, h.grad.float(), again))
    (eager, g_eager, ng_eager), (comp, g_comp, ng_comp) = outs
    assert abs(comp.loss_sum.item() - eager.loss_sum.item()) / eager.loss_sum.item() < 1e-3
    assert ((g_comp - g_eager).norm() / g_eager.norm()).item() < 2e-2
    assert abs(ng_comp.loss_sum.item() - comp.loss_sum.item()) / comp.loss_sum.item() < 1e-3
    assert (comp.correct_K - eager.correct_K).abs().sum().item() <= 2  # bf16 near-ties may differ


@pytest.mark.parametrize("V", [5000, 49152, 151936])
def test_triton_loss_kernel_equals_the_torch_chunk_on_gpu(V):
    """train.loss_kernel=triton's chunk (loss_kernel.triton_hard_chunk_loss) against the eager
    torch chunk on the same bf16 logits, at SmolLM2's and Qwen's vocabularies: loss and label
    log-probability, argmax exactly, the input gradient (bf16, rounded once each way)."""
    from dflash_train.core.loss import hard_chunk_loss
    from dflash_train.core.loss_kernel import triton_hard_chunk_loss

    hidden, weight, labels, _ = random_loss_inputs(5, 1000, V)
    labels[0], labels[1] = 0, V - 1
    loss, preds, picked, grad = triton_hard_chunk_loss(hidden, weight, labels, True)
    t_loss, t_preds, t_picked, t_grad = hard_chunk_loss(hidden, weight, labels, True)
    torch.testing.assert_close(loss, t_loss, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(picked, t_picked, atol=1e-4, rtol=1e-5)
    assert torch.equal(preds, t_preds)
    assert ((grad.float() - t_grad.float()).norm() / t_grad.float().norm()).item() < 1e-2
    n_loss, n_preds, _, n_grad = triton_hard_chunk_loss(hidden, weight, labels, False)
    assert n_grad is None and torch.equal(n_loss, loss) and torch.equal(n_preds, preds)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_kernel_equals_the_eager_rule_on_gpu(dtype):
    """The drafter's RMSNorm as one Triton kernel (core/kernels.py) against its eager rule on
    the drafter's shapes: bit for bit but for values a float32 sum in another order moves across
    a rounding boundary (one unit in the last place, rare)."""
    from dflash_train.core.kernels import triton_rms_norm

    from test_kernels import eager_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in ((16, 9, 64), (1, 16, 576), (4, 33, 3, 64), (512, 576)):
        x = (torch.randn(*shape, device="cuda", generator=g) * 3).to(dtype)
        w = (1 + 0.1 * torch.randn(shape[-1], device="cuda", generator=g)).to(dtype)
        got, want = triton_rms_norm(x, w, 1e-5), eager_norm(x, w, 1e-5)
        if dtype == torch.bfloat16:  # serving's dtype: the roundings are the rule's
            assert (got == want).float().mean().item() > 0.999
            # the rest: a unit of the normalised row, times the weight
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6)
        else:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotation_kernel_equals_the_eager_rule_on_gpu(dtype):
    """The queries' and keys' rotation as one Triton kernel (core/kernels.py) against
    drafter.QKRotation's eager rule, bit for bit, on the drafter's shapes (SmolLM2's heads, a
    batch of rows, a head of 128, a head of 80)."""
    from dflash_train.core.drafter import QKRotation
    from dflash_train.core.kernels import triton_qk_rotation

    from test_kernels import rotation_inputs

    g = torch.Generator().manual_seed(0)
    rotation = QKRotation()
    for B, Hq, Hk, Q, S, D, batch_cos in ((1, 9, 3, 16, 32, 64, False), (64, 9, 3, 16, 48, 64, True),
                                         (2, 32, 8, 16, 1040, 128, True), (3, 4, 2, 16, 16, 80, False)):
        q, k, cos, sin = (t.cuda() for t in rotation_inputs(B, Hq, Hk, Q, S, D, dtype, g, batch_cos))
        (got_q, got_k), (want_q, want_k) = triton_qk_rotation(q, k, cos, sin), rotation(q, k, cos, sin)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k), (B, Hq, Hk, Q, S, D)


def test_drafter_modules_take_their_kernel_only_in_inference_at_their_own_dtype(monkeypatch):
    """Fused by the engine (fusion.fuse_kernels), a drafter norm takes the kernel where autograd
    records nothing, at its weight's dtype; where it records (training), under autocast (the
    walk's float32 master weights) or at another dtype it keeps the eager rule. A rotation takes
    its kernel in half precision only."""
    from dflash_train.core.drafter import QKRotation, RMSNorm
    from dflash_train.engine import fusion

    calls = []

    def kernel(module, x):
        calls.append(x.dtype)
        return x

    monkeypatch.setattr(fusion, "_norm", kernel)
    norm = RMSNorm(64, 1e-6).cuda().to(torch.bfloat16)
    wide = RMSNorm(64, 1e-6).cuda()  # a float32 weight
    assert fusion.fuse_kernels(norm) == 1 and fusion.fuse_kernels(wide) == 1
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        norm(x)
    assert calls == [torch.bfloat16]
    norm(x)  # grad enabled, a weight that trains
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        norm(x)
        wide(x)
    assert calls == [torch.bfloat16]
    norm.requires_grad_(False)
    norm(x)  # grad enabled, but nothing to record (a frozen module, as the engine's are)
    assert calls == [torch.bfloat16] * 2

    rotated = []

    def rule(module, *qkcs):  # records its calls, and gives the rule's result (its probe passes)
        rotated.append(qkcs[0].dtype)
        return QKRotation.forward(module, *qkcs)

    monkeypatch.setattr(fusion, "_rotation", rule)
    rotation = QKRotation()
    model = torch.nn.Sequential(torch.nn.Linear(1, 1), rotation).cuda().to(torch.bfloat16)
    assert fusion.fuse_kernels(model) == 1 and rotated == [torch.bfloat16]  # the probe's call
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(1, 2, 4, 64, device="cuda", dtype=dtype)
        with torch.no_grad():
            rotation(q, q, q[:, :1], q[:, :1])
    assert rotated == [torch.bfloat16] * 2  # the float32 call kept the eager rule


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_additive_mask_attends_as_its_bool_mask_on_gpu(dtype):
    """The drafter's block step's additive masks (attention.additive_mask) attend as the bool
    masks they are made of, bit for bit, on the GPU's attention kernels."""
    from test_decode import check_additive_mask_attends_as_its_bool_mask

    check_additive_mask_attends_as_its_bool_mask("cuda", dtype)


def test_speculation_with_the_kernels_is_lossless_and_decodes_as_the_eager_rules():
    """Batch-1 decoding on the GPU with the target's and the drafter's norms and the drafter's
    rotations as one kernel each (and graphs): every norm of the Llama-shaped target is fused,
    and every norm and rotation of the drafter; speculative decoding gives the target-only
    output, and both give the tokens and acceptance lengths of the eager rules but for bf16
    near-ties."""
    from dflash_train.bench.decoding import build_models
    from dflash_train.engine.decoder import Decoder
    from dflash_train.engine.fusion import KINDS, fuse_kernels
    from dflash_train.engine.proposer import DFlashProposer

    model, drafter = build_models(None, torch.device("cuda"), torch.bfloat16, num_layers=3)
    prompt = torch.randint(0, 49000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    runs = {}
    try:
        for kernel in (True, False):
            kinds = KINDS if kernel else ()
            engine = Decoder(model, DFlashProposer.for_target(drafter, model, kernels=kinds))
            fused = fuse_kernels(model, kinds), fuse_kernels(drafter, kinds)
            assert fused == ((2 * model.config.num_hidden_layers + 1, 5 * 3 + 2) if kernel else (0, 0))
            base = engine.generate([prompt], 64)[0]
            spec = engine.speculate([prompt], 64)[0]
            engine.close()
            assert spec.output_ids == base.output_ids
            runs[kernel] = (base.output_ids, spec.acceptance_lengths)
    finally:
        fuse_kernels(model), fuse_kernels(drafter)
    same_tokens = sum(a == b for a, b in zip(runs[True][0], runs[False][0]))
    assert same_tokens >= 0.9 * len(runs[False][0])
    same = sum(a == b for a, b in zip(runs[True][1], runs[False][1]))
    assert same >= 0.9 * max(len(runs[True][1]), len(runs[False][1]))


def test_block_loss_with_the_triton_kernel_equals_the_compiled_chunks_on_gpu():
    """block_loss(LossSettings(kernel=triton)), as the trainer runs it by default on CUDA, against the compiled
    torch chunks: chunks of 256 rows and a shorter last one, loss, gradient, statistics, and the
    no-grad path."""
    hidden, weight, labels, valid = random_loss_inputs(1, 40 * B)
    outs = []
    for kw in (dict(compile=True), dict(kernel="triton")):
        h = hidden.clone().requires_grad_(True)
        out = block_loss(h, weight, labels, valid, B, LossSettings(chunk_rows=256, **kw))  # 256 + 256 + 88 scored rows
        out.loss_sum.backward()
        with torch.no_grad():
            again = block_loss(hidden, weight, labels, valid, B, LossSettings(chunk_rows=256, **kw))
        outs.append((out, h.grad.float(), again))
    (comp, g_comp, _), (kern, g_kern, ng_kern) = outs
    assert abs(kern.loss_sum.item() - comp.loss_sum.item()) / comp.loss_sum.item() < 1e-4
    assert ((g_kern - g_comp).norm() / g_comp.norm()).item() < 1e-2
    assert ng_kern.loss_sum.item() == kern.loss_sum.item()
    assert (kern.correct_K - comp.correct_K).abs().sum().item() <= 2  # inductor's argmax on near-ties


@pytest.mark.parametrize("compile", [False, True])
def test_distillation_loss_on_gpu_in_bf16_matches_fp32(compile):
    """labels=distill as the trainer runs it on CUDA: bf16 drafter states, target states and
    lm_head, chunks of 256 rows (compiled or eager, the last one padded), against the same loss
    in float32 in one chunk; with the decay and with D-PACE; the no-grad path gives the same sum."""
    M = 40 * B
    hidden, weight, labels, valid = random_loss_inputs(2, M)
    g = torch.Generator(device="cuda").manual_seed(3)
    target = (hidden.float() + 0.5 * torch.randn(hidden.shape, device="cuda", generator=g)).to(torch.bfloat16)
    for weighting in ("decay", "dpace"):
        settings = LossSettings(chunk_rows=256, compile=compile, weighting=weighting)
        h = hidden.clone().requires_grad_(True)
        out = block_loss(h, weight, labels, valid, B, settings, target_hidden_MH=target)
        out.loss_sum.backward()
        with torch.no_grad():
            again = block_loss(hidden, weight, labels, valid, B, settings, target_hidden_MH=target)
        h32 = hidden.float().requires_grad_(True)
        ref = block_loss(h32, weight.float(), labels, valid, B, LossSettings(chunk_rows=M, weighting=weighting),
                         target_hidden_MH=target.float())
        ref.loss_sum.backward()
        assert torch.isfinite(out.loss_sum) and torch.isfinite(h.grad).all()
        assert abs(out.loss_sum.item() - ref.loss_sum.item()) / ref.loss_sum.item() < 2e-2, weighting
        assert ((h.grad.float() - h32.grad).norm() / h32.grad.norm()).item() < 5e-2, weighting
        assert abs(again.loss_sum.item() - out.loss_sum.item()) / out.loss_sum.item() < 1e-3, weighting


@pytest.mark.parametrize("buckets", [1, 4])
def test_anchors_and_layout_on_gpu_with_the_host_count_wait_for_nothing(buckets):
    """With the anchor count known on the host (masks.anchor_count, as shipments carry it),
    sample_anchors and build_layout run on the GPU without a host sync, and draw the anchors
    the counting path draws on the CPU."""
    from dflash_train.core.masks import anchor_count

    gen = torch.Generator().manual_seed(4)
    rows, L = 9, 640
    lengths = torch.randint(1, L + 1, (rows,), generator=gen)
    loss_mask = (torch.rand(rows, L, generator=gen) < 0.8) & (torch.arange(L)[None, :] < lengths[:, None])
    packed = torch.zeros(8192, dtype=torch.bool)
    packed[: int(lengths.sum())] = torch.cat([loss_mask[r, : int(n)] for r, n in enumerate(lengths)])
    count = anchor_count(loss_mask, lengths, 300)
    want = sample_anchors(packed, lengths, 300, step_generator(0, 5, device="cpu"), pad_to_multiple=64,
                          buckets_per_doubling=buckets)
    mask_cuda, lengths_cuda = packed.cuda(), lengths.cuda()
    gen_cuda = step_generator(0, 5, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got, n = sample_anchors(mask_cuda, lengths_cuda, 300, gen_cuda, pad_to_multiple=64,
                                buckets_per_doubling=buckets, return_count=True, count=count)
        layout = build_layout(got, mask_cuda, lengths_cuda, B)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert n == count == int((want >= 0).sum()) and got.shape == want.shape
    # Another generator device draws other keys: the same count and padding, each anchor a candidate.
    assert torch.equal(got.cpu() < 0, want < 0)
    assert bool(layout.valid_NB[: count, 1].all()) or count == 0


def test_layout_block_mask_on_gpu_equals_create_block_mask_without_host_syncs():
    from dflash_train.core.masks import flex_block_mask, layout_block_mask

    gen = torch.Generator().manual_seed(3)
    lengths, loss_mask = random_packed_row(gen, 12, max_len=700, pad=77)
    anchors = sample_anchors(loss_mask, lengths, 200, step_generator(0, 0), pad_to_multiple=64, buckets_per_doubling=1)
    layout = build_layout(anchors.cuda(), loss_mask.cuda(), lengths.cuda(), B)
    Q = layout.num_blocks * B
    for window in (None, 256):
        torch.cuda.synchronize()
        # Covers torch's BlockMask.from_kv_blocks (the q-side transpose) as well as our part.
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = layout_block_mask(layout, window)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref = flex_block_mask(layout.mask_mod(window), Q, layout.num_ctx + Q, "cuda")
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), name


def test_bench_tiny_on_gpu_reports_mfu_and_idle_share(tmp_path):
    from dflash_train.bench import profile, training

    summary = tmp_path / "kernels.txt"
    for drafter_only, profile in ((False, None), (True, 2)):
        report = training.run_bench("tiny", steps=3, warmup=2, drafter_only=drafter_only, profile=profile,
                                 profile_summary=summary, peak_tflops=100.0, log=lambda *a: None)
        # A hidden-64 model is all launch overhead: the GPU must be seen idle most of the time
        # (annotation ranges spanning the gaps once made this read ~0).
        assert 0.3 <= report["gpu_idle_share"] <= 1.0
        assert report["mfu"] > 0 and report["samples_per_s"] > 0
        assert sum(report["stage_share"].values()) == pytest.approx(1.0, abs=1e-6)
        assert (report["flops_per_sample"]["target_forward"] == 0) == drafter_only
        text = summary.read_text()
        # The window's own work heads the summary. By default it replays every timed step's
        # batch: the same samples and context tokens as the timed steps.
        work = re.search(r"their work: (\d+) samples, (\d+) context tokens, (\d+) block rows", text.splitlines()[0])
        assert work and all(int(g) > 0 for g in work.groups()), text.splitlines()[0]
        if profile is None:
            timed_tokens = report["target_tokens_per_s"] * report["step_s"] * report["steps"]
            assert int(work.group(1)) == report["samples"]
            assert int(work.group(2)) == round(timed_tokens)
    assert "kernel" in text and "bench_window" not in text
    assert "host:" in text and "cudaLaunchKernel" in text  # the host's side: launches ranked by host time
    assert "host syncs:" in text and "step.py" not in text  # the skip decision stays on the device


def test_compiled_target_layers_give_the_eager_features():
    from dflash_train.bench.workloads import WORKLOADS, build_random_target, target_config
    from dflash_train.train.compilation import compile_target_layers

    config = target_config(WORKLOADS["tiny"])
    device = torch.device("cuda")
    eager = build_random_target(config, device, torch.bfloat16, 0)([1, 3], "data")
    compiled = build_random_target(config, device, torch.bfloat16, 0)([1, 3], "data")
    compile_target_layers(compiled)
    for shape in ((2, 40), (3, 64), (2, 40)):  # a second shape, then the first again
        ids = torch.randint(0, 500, shape, device=device)
        a, _ = eager.capture(ids)
        b, _ = compiled.capture(ids)
        assert a.shape == b.shape == (*shape, 2 * config.hidden_size)
        assert ((a.float() - b.float()).norm() / a.float().norm()).item() < 2e-2


@pytest.mark.parametrize("labels", ["data", "target", "distill"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager-layers", "compiled-layers"])
def test_graphed_target_replays_the_eager_forward(labels, compiled):
    """target.GraphedTarget with real CUDA graphs against the same target run without them, bit
    for bit: each prepared shape (a bucket's last batch with fewer rows among them) with new ids
    on every call and other shapes' graphs replayed in between, per-tap features (split fc)
    beside concatenated ones, a shape not prepared run eagerly, and what the labels need past
    the taps (greedy tokens, final hidden state); every result read after all the calls."""
    from dflash_train.bench.workloads import WORKLOADS, build_random_target, target_config
    from dflash_train.train.compilation import compile_target_layers
    from dflash_train.train.graphed_target import GraphedTarget

    config = target_config(WORKLOADS["tiny"])
    device = torch.device("cuda")
    target = build_random_target(config, device, torch.bfloat16, 0)([1, 3], labels)
    if compiled:
        compile_target_layers(target)
    logged = []
    graphed = GraphedTarget(target, device, logged.append)
    graphed.prepare([(4, 64), (3, 64), (2, 128)])
    graphed.prepare([(2, 128)], concat=False)
    gen = torch.Generator(device=device).manual_seed(0)
    kept = []
    for shape, concat in (((4, 64), True), ((2, 128), True), ((4, 64), True), ((3, 64), True), ((2, 128), False),
                          ((1, 128), False), ((2, 96), True), ((4, 64), True)):
        ids = torch.randint(0, 500, shape, device=device, generator=gen)
        want = target.capture(ids, concat)
        got = graphed.capture(ids, concat)
        kept.append((shape, want, got))
    for shape, want, got in kept:
        for a, b in zip(want, got):
            assert (a is None) == (b is None)
            if a is None:
                continue
            for x, y in zip(*((t if isinstance(t, list) else [t]) for t in (a, b))):
                assert x.shape == y.shape and x.shape[:2] == shape
                assert torch.equal(x, y), shape
    assert sorted(graphed.steps) == [(2, 128, False), (2, 128, True), (3, 64, True), (4, 64, True)]
    assert graphed.graphs.num_captured == 4
    assert not logged and graphed.refused is None


def test_graphed_target_captures_nothing_when_its_forward_waits_on_the_gpu():
    """A forward that reads a value on the host cannot be captured: the warm-up's check (CUDA's
    sync debug mode) finds the wait, nothing is captured, the target runs eagerly with the same
    results, the log says so once, and the GPU keeps working (no capture was attempted)."""
    from dflash_train.train.graphed_target import GraphedTarget

    class Syncing:
        def capture(self, ids, concat=True):
            scale = float(ids.float().mean().item())  # a host sync: not allowed while capturing
            return ids.float() * scale, None

    logged = []
    graphed = GraphedTarget(Syncing(), torch.device("cuda"), logged.append)
    graphed.prepare([(2, 16)])
    for _ in range(2):
        ids = torch.randint(0, 9, (2, 16), device="cuda")
        features, _ = graphed.capture(ids)
        assert torch.equal(features, Syncing().capture(ids)[0])
    assert graphed.refused and not graphed.steps and graphed.graphs.num_captured == 0
    assert len(logged) == 1 and "makes the host wait" in logged[0]
    assert torch.equal(torch.ones(4, device="cuda").cumsum(0).cpu(), torch.arange(1.0, 5.0))


def test_a_training_step_on_gpu_waits_for_nothing():
    """Once every shape of an epoch is warm, a whole optimizer step of a colocated run (batch,
    target forward replayed from its CUDA graph, packing, anchors, masks, drafter, loss, backward, clipping, the skip decision
    and AdamW) never makes the host wait for the GPU; the step's flag is read after."""
    from dflash_train.bench import harness
    from dflash_train.train.graphed_target import GraphedTarget
    from dflash_train.train.loop import take_step, warm_up

    run, _ = harness.build_run("tiny", ["train.compile=true"], log=lambda *a: None)
    assert run.step.skip_on_device
    warm_up(run)  # the target's CUDA graphs captured: the steps below replay them
    assert isinstance(run.producer.target, GraphedTarget) and run.producer.target.steps
    for _ in range(run.plan.num_batches):  # one epoch: every bucket and anchor shape compiled
        take_step(run)
    torch.cuda.synchronize()
    results = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            results.append(take_step(run))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not any(r.ready for r in results) and all(r.applied for r in results)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_target_capture_on_gpu_waits_for_nothing(compiled):
    """A target forward (the engine's causal attention, eager or compiled layers) makes the host
    wait for nothing once its shape is warm."""
    from dflash_train.bench.workloads import WORKLOADS, build_random_target, target_config
    from dflash_train.train.compilation import compile_target_layers

    target = build_random_target(target_config(WORKLOADS["tiny"]), torch.device("cuda"), torch.bfloat16, 0)([1, 3],
                                                                                                            "data")
    if compiled:
        compile_target_layers(target)
    ids = torch.randint(0, 500, (3, 96), device="cuda")
    want, _ = target.capture(ids)  # warm: compilation and lazy initialisation may wait
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got, _ = target.capture(ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)


def test_host_tensors_reach_the_gpu_without_the_host_waiting():
    """produce.to_device: the copy is queued behind a busy stream and the call returns before
    the stream gets to it (the stream is still busy afterwards), with the right values. (On the
    H200 where it was written, one pageable copy of this size alone returned at once too; the
    host was sampled waiting in such a copy in `pack`, after others: docs/PERFORMANCE.md.)"""
    from dflash_train.train.produce import to_device

    src = torch.arange(1 << 17)  # 1 MiB of int64, pageable, as the collated batches are
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # keeps the current stream busy for about a second
    out = to_device(src, torch.device("cuda"))
    still_busy = not torch.cuda.current_stream().query()
    assert torch.equal(out.cpu(), src)
    assert still_busy, "to_device waited for the work queued before it"


@pytest.mark.parametrize("given_ids", [False, True], ids=["host-ids", "device-ids"])
@pytest.mark.parametrize("split", [False, True], ids=["concat", "split-fc"])
def test_side_stream_packer_equals_the_plain_packer(split, given_ids):
    """SidePacker packs on its own CUDA stream; what it returns equals `pack` on the current
    stream, bit for bit (noise included). Both orderings are exercised: the features come late
    on the current stream (the side stream must wait for them) and the side stream is busy when
    the packer is called (the current stream must wait for the packed row before reading it).
    `given_ids`: as the Producer calls it, with the batch's ids already copied to the GPU on the
    current stream (the copy the target read), late like the features."""
    from dflash_train.data.batching import Batch
    from dflash_train.train.produce import FeatureNoise, SidePacker, pack

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    lengths, L, taps = [700, 31, 1024, 5], 1024, 3
    ids = torch.randint(1, 1000, (len(lengths), L), generator=gen)
    mask = torch.rand(len(lengths), L, generator=gen) < 0.7
    batch = Batch(ids, mask, torch.tensor(lengths), list(range(len(lengths))), 0, 0)
    noise = FeatureNoise("uniform", 0.05, seed=3, device=device)
    packer = SidePacker(device)

    def inputs():
        g = torch.Generator(device=device).manual_seed(1)
        feats = [torch.randn(len(lengths), L, H, device=device, generator=g, dtype=torch.bfloat16) for _ in range(taps)]
        greedy = torch.randint(0, 1000, (len(lengths), L), device=device, generator=g)
        return (feats if split else torch.cat(feats, dim=-1)), greedy

    with torch.cuda.stream(packer.stream):
        torch.cuda._sleep(20_000_000)  # the side stream is busy when the packer is called
    torch.cuda._sleep(100_000_000)  # the features below are made late on the current stream
    device_ids = ids.to(device) if given_ids else None
    side = packer(batch, 9, *inputs(), 4096, noise, input_ids_bL=device_ids)
    del device_ids  # the packer keeps what it needs alive for its stream
    got = [t.clone() for t in (side.features if split else [side.features])]  # read on the current stream
    got += [getattr(side, n).clone() for n in ("input_ids_T", "loss_mask_T", "labels_T", "doc_lengths")]
    torch.cuda.synchronize()
    plain = pack(batch, 9, *inputs(), 4096, noise)
    want = list(plain.features) if split else [plain.features]
    want += [getattr(plain, n) for n in ("input_ids_T", "loss_mask_T", "labels_T", "doc_lengths")]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert side.num_tokens == plain.num_tokens == sum(lengths)


def _train(out, nproc: int, *overrides: str) -> dict[int, float]:
    """`train` of the tiny config on the GPU, 8 steps: one process (nproc 0) or torchrun."""
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                                 if nproc else [])
    cmd = launch + ["-m", "dflash_train", "train", "--config", str(TINY), "--output-dir", str(out),
                    "train.device=cuda", "train.max_steps=8", *overrides]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=subprocess_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return losses(out)


def assert_same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    """Equal up to bf16 noise. The runs compare do the same fp32 arithmetic (the sum of two
    ranks' gradients is the one addition that accumulation does on one GPU; the features come
    from the same kernels), so they should agree almost bit for bit; training on other
    micro-batches moves the loss by percent."""
    assert sorted(got) == sorted(want) == list(range(1, 9))
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-3 * abs(loss), (step, got[step], loss)


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    """One GPU, grad_accum 2: the micro-batches that two GPUs take one each."""
    return _train(tmp_path_factory.mktemp("one-gpu"), 0, "train.grad_accum=2")


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@TWO_GPUS
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_two_gpus_train_the_losses_of_one(mode, one_gpu, tmp_path):
    """Colocated (gradients all-reduced over NCCL) or 1 target + 1 drafter GPU (shipments over
    NCCL point-to-point, grad_accum 2): the losses of one GPU."""
    setup = ["topology.mode=disaggregated", "topology.num_target_ranks=1", "train.grad_accum=2"] \
        if mode == "disaggregated" else []
    assert_same_losses(_train(tmp_path, 2, *setup), one_gpu)


@TWO_GPUS
def test_checkpoint_of_two_gpus_resumes_on_one(one_gpu, tmp_path):
    """2 colocated GPUs stopped by SIGTERM after step 4, resumed on one GPU with grad_accum 2."""
    first = _train(tmp_path, 2, "faults.sigterm_at_steps=[4]", "checkpoint.every=100")
    assert sorted(first) == [1, 2, 3, 4] and (tmp_path / "checkpoints" / "step-4").is_dir()
    assert_same_losses(_train(tmp_path, 0, "train.grad_accum=2"), one_gpu)


@TWO_GPUS
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_bench_tiny_under_torchrun_on_two_gpus(mode, tmp_path):
    """The NCCL paths of the torchrun bench: gradient all-reduce (colocated), point-to-point
    shipments between GPUs (disaggregated 1 + 1); rank 0 reports."""
    import json

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "dflash_train", "bench", "--workload", "tiny", "--steps", "3", "--warmup", "2",
           "train.num_threads=1", f"topology.mode={mode}"]
    cmd += ["topology.num_target_ranks=1"] if mode == "disaggregated" else []
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=subprocess_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2 and report["samples_per_s"] > 0 and report["mfu"] > 0
    assert report["device"] != "cpu"
    if mode == "disaggregated":
        assert report["transfer_bytes_per_step"] > 0 and report["transfer_gbytes_per_s"] > 0
        assert report["target_stage_s"]["target"] > 0


def test_a_sharded_drafter_is_gathered_on_the_gpu_for_evaluation_and_on_the_cpu_for_export():
    """train.fsdp in one process on the GPU: the whole drafter for the walk is on the GPU, the one an
    export writes is on the CPU (no second whole drafter on a GPU still holding the run), with the
    same float32 weights."""
    run, _ = build_run("tiny", ["train.fsdp=true", "train.device=cuda"])
    try:
        walked, exported = run.step.whole_drafter(), run.step.whole_drafter(on_device=False)
        assert {p.device.type for p in walked.parameters()} == {"cuda"}
        assert {p.device.type for p in exported.parameters()} == {"cpu"}
        for (name, a), (_, b) in zip(walked.state_dict().items(), exported.state_dict().items()):
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a.cpu(), b), name
    finally:
        run.step.sharding.close()
