"""The Triton loss kernel (train.loss_kernel=triton) against its torch twin and float64
autograd, run on CPU in Triton's interpreter (TRITON_INTERPRET=1, in a child process: the
interpreter is chosen when the kernel is defined). tests/test_gpu.py runs it compiled."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import in_triton_interpreter
from dflash_train.core.config import ConfigError, load_config, validate
from dflash_train.core.loss import LossSettings
from dflash_train.train.compilation import Compilation, loss_kernel


def _chunk_case(seed: int, C: int, H: int, V: int, dtype):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(C, H, generator=g) * 0.5).to(dtype)
    w = torch.randn(V, H, generator=g).to(dtype)
    labels = torch.randint(0, V, (C,), generator=g)
    labels[0], labels[1] = 0, V - 1  # the first and last column
    return h, w, labels


def check_chunk_against_torch_and_float64() -> None:
    from dflash_train.core.loss import hard_chunk_loss
    from dflash_train.core.loss_kernel import triton_hard_chunk_loss

    assert os.environ.get("TRITON_INTERPRET") == "1"
    # V = 300 in steps of 64 columns: four whole steps and a partial one.
    for dtype in (torch.float32, torch.bfloat16):
        h, w, labels = _chunk_case(1, C=37, H=16, V=300, dtype=dtype)
        loss, preds, picked, grad = triton_hard_chunk_loss(h, w, labels, True, block=64, num_warps=4)
        t_loss, t_preds, t_picked, t_grad = hard_chunk_loss(h, w, labels, True)
        assert loss.dtype == picked.dtype == torch.float32 and preds.dtype == torch.long and grad.dtype == dtype
        torch.testing.assert_close(loss, t_loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(picked, -loss, atol=0, rtol=0)
        assert torch.equal(preds, t_preds)
        # float64 autograd of the same logits: CE per row and its gradient with respect to h.
        h64 = h.double().requires_grad_(True)
        logits = h64 @ w.double().t()
        ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        ce.sum().backward()
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(loss.double(), ce.detach(), **tol)
        torch.testing.assert_close(grad.double(), h64.grad, **tol)
        # The interpreter rounds float32 to bf16 by truncation, the GPU to nearest: one bf16 step apart.
        torch.testing.assert_close(grad.double(), t_grad.double(), **tol)
        # Without the gradient: the same three results and no product.
        n_loss, n_preds, n_picked, n_grad = triton_hard_chunk_loss(h, w, labels, False, block=64, num_warps=4)
        assert n_grad is None and torch.equal(n_loss, loss) and torch.equal(n_preds, preds)


def check_argmax_ties_take_the_first_column() -> None:
    from dflash_train.core.loss_kernel import _hard_rows_kernel

    V, block = 200, 64
    logits = torch.randn(4, V)
    top = logits.max() + 1
    # Ties inside one step (cols 5, 9), across steps (70 and 130, then 10), in the last partial step.
    for row, cols in enumerate([(5, 9), (130, 70), (199, 10), (150, 190)]):
        logits[row, list(cols)] = top
    labels = torch.zeros(4, dtype=torch.long)
    loss, picked, preds = torch.empty(4), torch.empty(4), torch.empty(4, dtype=torch.long)
    _hard_rows_kernel[(4,)](logits, logits.stride(0), labels, loss, preds, picked, V,
                            WRITE_SOFTMAX=False, BLOCK=block)
    assert preds.tolist() == [5, 70, 10, 150] == logits.argmax(-1).tolist()


def check_softmax_covers_every_column() -> None:
    """The softmax pass (run from the last step back) writes every column exactly, whether V
    is a whole number of steps, has a partial last step, or is under one step."""
    from dflash_train.core.loss_kernel import _hard_rows_kernel

    block = 64
    for V in (256, 300, 50):
        logits = torch.randn(3, V) * 4
        expected = torch.softmax(logits, dim=-1)
        loss, picked, preds = torch.empty(3), torch.empty(3), torch.empty(3, dtype=torch.long)
        labels = torch.zeros(3, dtype=torch.long)
        _hard_rows_kernel[(3,)](logits, logits.stride(0), labels, loss, preds, picked, V,
                                WRITE_SOFTMAX=True, BLOCK=block)
        torch.testing.assert_close(logits, expected, atol=1e-6, rtol=1e-5)


def check_block_loss_kernels_agree() -> None:
    """block_loss(LossSettings(kernel=triton)) against kernel=torch: loss, weights, statistics and the gradient
    through the row weights (decay and D-PACE), chunks of 16 rows with a shorter last one."""
    from dflash_train.core.loss import block_loss

    B = 4
    g = torch.Generator().manual_seed(3)
    N, H, V = 9, 32, 300
    hidden = torch.randn(N * B, H, generator=g) * 0.5
    weight = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (N * B,), generator=g)
    valid = torch.rand(N * B, generator=g) < 0.8
    valid.view(N, B)[:, 0] = False
    labels = torch.where(valid, labels, torch.full_like(labels, 10**6))  # unscored rows' labels never read
    for weighting in ("decay", "dpace"):
        outs = []
        for kernel in ("torch", "triton"):
            h = hidden.clone().requires_grad_(True)
            out = block_loss(h, weight, labels, valid, B, LossSettings(gamma=2.5, chunk_rows=16, kernel=kernel, weighting=weighting))
            out.loss().backward()
            outs.append((out, h.grad))
        (a, ga), (b, gb) = outs
        torch.testing.assert_close(b.loss_sum, a.loss_sum, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.weight_sum, a.weight_sum, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(gb, ga, atol=1e-5, rtol=1e-5)
        for field in ("correct_K", "count_K", "run_sum", "num_blocks", "run_hist"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field


def test_kernel_chunk_equals_torch_chunk_and_float64_autograd():
    in_triton_interpreter("test_loss_kernel", "check_chunk_against_torch_and_float64")


def test_kernel_softmax_covers_every_column():
    in_triton_interpreter("test_loss_kernel", "check_softmax_covers_every_column")


def test_kernel_argmax_takes_the_first_maximal_column():
    in_triton_interpreter("test_loss_kernel", "check_argmax_ties_take_the_first_column")


def test_block_loss_with_the_kernel_equals_torch():
    in_triton_interpreter("test_loss_kernel", "check_block_loss_kernels_agree")


def test_block_loss_refuses_the_kernel_for_distillation():
    h = torch.randn(8, 4)
    with pytest.raises(ValueError, match="distillation"):
        from dflash_train.core.loss import block_loss

        block_loss(h, torch.randn(10, 4), torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.bool), 4, LossSettings(kernel="triton"), target_hidden_MH=h)


def test_loss_kernel_setting_resolves_by_device_and_labels(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert loss_kernel("auto", cpu, "data") == "torch"
    assert loss_kernel("torch", cuda, "data") == "torch"
    assert loss_kernel("auto", cuda, "distill") == "torch"
    assert loss_kernel("triton", cuda, "target") == "triton"
    with pytest.raises(ConfigError, match="CUDA"):
        loss_kernel("triton", cpu, "data")
    with pytest.raises(ConfigError, match="distill"):
        loss_kernel("triton", cuda, "distill")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert loss_kernel("auto", cuda, "data") == "torch"  # no triton package: torch's chunk
    monkeypatch.undo()
    if real("triton") is not None:
        assert loss_kernel("auto", cuda, "data") == "triton"
    # The compiled torch chunk only where the kernel is not used.
    cfg = load_config(None, ["train.compile=true"])
    comp = Compilation.decide(cfg, cpu, "sdpa")
    assert comp.loss_kernel == "torch" and not comp.loss_chunks


def test_loss_kernel_config_errors_name_the_fix():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.loss_kernel=triton", "objective.labels=distill", "train.device=cpu"])
    assert "train.loss_kernel=triton scores hard labels" in str(err.value)
    assert "train.loss_kernel=triton runs on CUDA GPUs" in str(err.value)
    assert not validate(load_config(None, ["train.loss_kernel=triton", "train.device=cuda"]))
    with pytest.raises(ConfigError, match="loss_kernel"):
        load_config(None, ["train.loss_kernel=cuda"])
