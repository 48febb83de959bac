"""The drafter's RMSNorm as one Triton kernel (core/norm_kernel.py) against the eager rule of
drafter.RMSNorm, run on CPU in Triton's interpreter (TRITON_INTERPRET=1, in a child process: the
interpreter is chosen when the kernel is defined). tests/test_gpu.py runs it compiled and checks
where the engine uses it."""

from __future__ import annotations

import os

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from conftest import in_triton_interpreter, tiny_target_config
from dflash_train.core.drafter import RMSNorm
from dflash_train.engine import norms
from dflash_train.engine.norms import fuse_norms


def eager_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps).to(x.device, x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


def truncated_rule(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """drafter.RMSNorm's rule in bfloat16 with each rounding a truncation (Triton's interpreter)."""
    def truncate(t):
        return (t.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)

    x32 = x.float()
    normed = truncate(x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))
    return truncate(normed * weight.float()).to(torch.bfloat16)


def check_kernel_equals_the_eager_rule() -> None:
    from dflash_train.core.norm_kernel import triton_rms_norm

    assert os.environ.get("TRITON_INTERPRET") == "1"
    g = torch.Generator().manual_seed(0)
    # the drafter's shapes: a head (64), SmolLM2's hidden size (576, not a power of two); rows of
    # very different scales (Qwen3's outliers), and a row of zeros (eps alone)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((3, 5, 64), (7, 576), (2, 1, 3, 64)):
            x = (torch.randn(*shape, generator=g) * torch.logspace(-2, 2, shape[-2])[:, None]).to(dtype)
            x[..., 0, :] = 0
            w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
            got, want = triton_rms_norm(x, w, 1e-6), eager_norm(x, w, 1e-6)
            assert got.dtype == dtype and got.shape == x.shape
            assert torch.equal(got[..., 0, :], torch.zeros_like(got[..., 0, :]))
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
            else:
                # Triton's interpreter rounds to bfloat16 by truncation where the GPU rounds to
                # nearest even (tests/test_gpu.py holds the kernel to the eager rule there): here
                # it equals the rule with both roundings truncated, but for values whose float32
                # sum of squares, summed in another order, moved them across a boundary
                assert (got == truncated_rule(x, w, 1e-6)).float().mean() > 0.99
                ulp = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp_min(1e-30))) - 7)
                assert ((got.float() - want.float()).abs() <= 3 * ulp).all()
        # a strided input (a transposed view) is read as its values
        x = torch.randn(64, 6, generator=g).to(dtype).t()
        w = torch.ones(64, dtype=dtype)
        torch.testing.assert_close(triton_rms_norm(x, w, 1e-5).float(), eager_norm(x, w, 1e-5).float(),
                                   rtol=2 ** -7, atol=1e-6)
    # no rows: nothing launched
    assert triton_rms_norm(torch.zeros(0, 64), torch.ones(64), 1e-6).shape == (0, 64)


def test_kernel_equals_the_eager_rule_in_the_interpreter():
    in_triton_interpreter("test_norm_kernel", "check_kernel_equals_the_eager_rule")


def test_the_engine_turns_the_kernel_on_only_on_cuda(monkeypatch):
    """On CPU the drafter's norms keep the eager rule whatever is asked, also where a kernel is
    handed in (tests/test_gpu.py checks grad, autocast and dtypes on the GPU)."""
    norm = RMSNorm(8, 1e-6)
    assert fuse_norms(norm) == 0
    assert "forward" not in norm.__dict__
    calls = []
    monkeypatch.setattr(norms, "kernel_runs_on", lambda device: True)
    monkeypatch.setattr(norms, "_kernel", lambda: lambda x, w, eps: calls.append(x) or x)
    assert fuse_norms(norm) == 1  # the drafter's own rule passes the probe
    x = torch.randn(2, 8)
    with torch.no_grad():
        norm(x)  # a CPU tensor: the eager rule
    assert calls == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_probe_finds_the_rule_in_llama_and_qwen_norms_not_in_gemma(dtype):
    """Norms run the kernel only where their own forward computes the drafter's
    rule bit for bit (engine/norms.py): transformers' Llama, Mistral, Qwen2 and Qwen3 norms do; Gemma's
    (1 + weight, in float32) does not."""
    for cls, follows in ((LlamaRMSNorm, True), (MistralRMSNorm, True), (Qwen2RMSNorm, True), (Qwen3RMSNorm, True),
                         (GemmaRMSNorm, False)):
        norm = cls(64, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.normal_(0.5, 0.1)
        assert norms._follows_the_rule(norm) is follows, cls.__name__


def test_target_norms_are_fused_where_the_kernel_runs_and_given_back(monkeypatch):
    """On a CUDA device (here pretended, with a kernel that records its calls), every norm of a
    Llama-shaped target is fused; on CPU tensors the fused forward is the module's own; `False`
    gives every module its class's forward back. On a real CPU nothing is fused."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_target_config()).eval()
    assert fuse_norms(model) == 0
    layers = model.config.num_hidden_layers
    calls = []
    monkeypatch.setattr(norms, "kernel_runs_on", lambda device: True)
    monkeypatch.setattr(norms, "_kernel", lambda: lambda x, w, eps: calls.append(x) or x)
    assert fuse_norms(model) == 2 * layers + 1  # two a layer and the final one
    assert fuse_norms(model) == 2 * layers + 1  # again: the same modules, not wrapped twice
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        fused = model(ids).logits
    assert calls == []  # CPU tensors: each module's own forward
    assert fuse_norms(model, False) == 0
    assert not any("forward" in m.__dict__ for m in model.modules())
    hooked = model.model.norm
    hooked.forward = lambda x: x  # a forward someone else set (an offloading hook, say)
    assert fuse_norms(model) == 2 * layers and fuse_norms(model, False) == 0
    assert "forward" in hooked.__dict__
    del hooked.forward
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fused)
