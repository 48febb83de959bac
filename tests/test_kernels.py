"""The drafter's element-wise rules as one Triton kernel each (core/kernels.py: the RMSNorm and
the queries' and keys' rotation) against their eager rules in drafter.py, run on CPU in Triton's
interpreter (TRITON_INTERPRET=1, in a child process: the interpreter is chosen when a kernel is
defined), and where the engine gives modules their kernel (engine/fusion.py). tests/test_gpu.py
runs the kernels compiled, bit for bit against the eager rules."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from conftest import in_triton_interpreter, tiny_drafter, tiny_target_config
from dflash_train.core.drafter import QKRotation, RMSNorm
from dflash_train.engine import fusion
from dflash_train.engine.fusion import fuse_kernels


def eager_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps).to(x.device, x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


def truncate(t: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to bfloat16's precision by truncation, as Triton's interpreter rounds."""
    return (t.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)


def truncated_rule(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """drafter.RMSNorm's rule in bfloat16 with each rounding a truncation (Triton's interpreter)."""
    x32 = x.float()
    normed = truncate(x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))
    return truncate(normed * weight.float()).to(torch.bfloat16)


def check_kernel_equals_the_eager_rule() -> None:
    from dflash_train.core.kernels import triton_rms_norm

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
    in_triton_interpreter("test_kernels", "check_kernel_equals_the_eager_rule")


def rotation_inputs(B: int, Hq: int, Hk: int, Q: int, S: int, D: int, dtype, g: torch.Generator, batch_cos: bool):
    """Queries and keys as the drafter's attention has them (transposed views of [B, P, H, D]) and
    the cos / sin of S positions ([B or 1, 1, S, D], halves repeated, as the rotary embedding's)."""
    q = torch.randn(B, Q, Hq, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, generator=g).to(dtype).transpose(1, 2)
    angles = torch.rand(B if batch_cos else 1, S, D // 2, generator=g) * 100
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def truncated_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """drafter's RoPE in bfloat16 with each rounding a truncation (Triton's interpreter)."""
    half = x.shape[-1] // 2
    x32, c, s = x.float(), cos.float(), sin.float()
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return truncate(truncate(x32 * c) + truncate(rotated * s)).to(torch.bfloat16)


def check_rotation_equals_the_eager_rule() -> None:
    from dflash_train.core.kernels import triton_qk_rotation

    assert os.environ.get("TRITON_INTERPRET") == "1"
    g = torch.Generator().manual_seed(0)
    rotation = QKRotation()
    # SmolLM2's heads (9 and 3 of 64) at a block of 16 after 16 of context; a head of 80 (a
    # half that is not a power of two); two rows with one cos / sin and with their own
    for B, Hq, Hk, Q, S, D, batch_cos in ((1, 9, 3, 16, 32, 64, False), (2, 4, 2, 5, 12, 80, True),
                                         (3, 2, 1, 16, 16, 64, False)):
        for dtype in (torch.float32, torch.bfloat16):
            q, k, cos, sin = rotation_inputs(B, Hq, Hk, Q, S, D, dtype, g, batch_cos)
            (got_q, got_k), (want_q, want_k) = triton_qk_rotation(q, k, cos, sin), rotation(q, k, cos, sin)
            assert got_q.shape == want_q.shape and got_k.shape == want_k.shape
            if dtype == torch.float32:  # no rounding to model: the same float32 operations
                assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
            else:  # the interpreter truncates where the GPU rounds to nearest even
                assert torch.equal(got_q, truncated_rotation(q, cos[:, :, -Q:], sin[:, :, -Q:]))
                assert torch.equal(got_k, truncated_rotation(k, cos, sin))
                torch.testing.assert_close(got_q.float(), want_q.float(), rtol=2 ** -6, atol=2 ** -6)
    # a contiguous query (not a view) and a key whose head dimension is strided: read as values
    q, k, cos, sin = rotation_inputs(1, 3, 1, 4, 8, 64, torch.float32, g, False)
    q, k = q.contiguous(), k.transpose(-1, -2).contiguous().transpose(-1, -2)
    (got_q, got_k), (want_q, want_k) = triton_qk_rotation(q, k, cos, sin), rotation(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_rotation_kernel_equals_the_eager_rule_in_the_interpreter():
    in_triton_interpreter("test_kernels", "check_rotation_equals_the_eager_rule")


def test_the_engine_turns_the_kernels_on_only_on_cuda(monkeypatch):
    """On CPU the drafter's norms keep the eager rule whatever is asked, also where a kernel is
    handed in (tests/test_gpu.py checks grad, autocast and dtypes on the GPU)."""
    norm = RMSNorm(8, 1e-6)
    assert fuse_kernels(norm) == 0
    assert "forward" not in norm.__dict__
    calls = []
    monkeypatch.setattr(fusion, "kernel_runs_on", lambda device: True)
    monkeypatch.setattr(fusion, "_norm", lambda module, x: calls.append(x) or x)
    assert fuse_kernels(norm) == 1  # the drafter's own rule passes the probe
    x = torch.randn(2, 8)
    with torch.no_grad():
        norm(x)  # a CPU tensor: the eager rule
    assert calls == []


def test_a_drafter_gets_its_norms_and_rotations_fused_by_kind(monkeypatch):
    """On a CUDA device (pretended), each of a drafter's layers has four norms and one rotation
    fused, and its two outer norms; `kinds` picks which; () gives every class's forward back."""
    drafter = tiny_drafter(num_layers=3).to(torch.bfloat16)
    layers = drafter.config.num_hidden_layers
    monkeypatch.setattr(fusion, "kernel_runs_on", lambda device: True)
    probed = []

    def rule(module, q, k, cos, sin):  # the probe runs the kernel: here the rule itself
        probed.append(q.shape[-1])
        return QKRotation.forward(module, q, k, cos, sin)

    monkeypatch.setattr(fusion, "_rotation", rule)
    assert fuse_kernels(drafter) == 5 * layers + 2
    assert probed == [drafter.config.head_dim]  # probed once, at the drafter's head dimension
    assert fuse_kernels(drafter, ("norms",)) == 4 * layers + 2
    assert not any("forward" in m.__dict__ for m in drafter.modules() if isinstance(m, QKRotation))
    assert fuse_kernels(drafter, ("rotations",)) == layers
    assert fuse_kernels(drafter, ()) == 0
    assert not any("forward" in m.__dict__ for m in drafter.modules())
    assert fuse_kernels(drafter.float()) == 4 * layers + 2  # float32: the rotations keep their rule


def test_a_rotation_kernel_that_fails_or_differs_on_its_probe_is_not_used(monkeypatch):
    """The rotations take the kernel only where it ran on the model's device and gave the eager
    rule's result bit for bit: a kernel that raises (a compiler's error, say) is said in a warning,
    one off by a unit is left silently; the norms are fused either way."""
    drafter = tiny_drafter(num_layers=2).to(torch.bfloat16)
    monkeypatch.setattr(fusion, "kernel_runs_on", lambda device: True)

    def fails(module, *inputs):
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(fusion, "_rotation", fails)
    with pytest.warns(UserWarning, match="rotation kernel does not run"):
        assert fuse_kernels(drafter) == 4 * 2 + 2
    fuse_kernels(drafter, ())

    def off_by_a_unit(module, q, k, cos, sin):
        q, k = QKRotation.forward(module, q, k, cos, sin)
        return q, torch.nextafter(k, torch.full_like(k, float("inf")))

    monkeypatch.setattr(fusion, "_rotation", off_by_a_unit)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fuse_kernels(drafter) == 4 * 2 + 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_probe_finds_the_rule_in_llama_and_qwen_norms_not_in_gemma(dtype):
    """Norms run the kernel only where their own forward computes the drafter's
    rule bit for bit (engine/fusion.py): transformers' Llama, Mistral, Qwen2 and Qwen3 norms do; Gemma's
    (1 + weight, in float32) does not."""
    for cls, follows in ((LlamaRMSNorm, True), (MistralRMSNorm, True), (Qwen2RMSNorm, True), (Qwen3RMSNorm, True),
                         (GemmaRMSNorm, False)):
        norm = cls(64, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.normal_(0.5, 0.1)
        assert fusion._follows_the_rule(norm) is follows, cls.__name__


def test_target_norms_are_fused_where_the_kernel_runs_and_given_back(monkeypatch):
    """On a CUDA device (here pretended, with a kernel that records its calls), every norm of a
    Llama-shaped target is fused; on CPU tensors the fused forward is the module's own; `False`
    gives every module its class's forward back. On a real CPU nothing is fused."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_target_config()).eval()
    assert fuse_kernels(model) == 0
    layers = model.config.num_hidden_layers
    calls = []
    monkeypatch.setattr(fusion, "kernel_runs_on", lambda device: True)
    monkeypatch.setattr(fusion, "_norm", lambda module, x: calls.append(x) or x)
    assert fuse_kernels(model) == 2 * layers + 1  # two a layer and the final one
    assert fuse_kernels(model) == 2 * layers + 1  # again: the same modules, not wrapped twice
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        fused = model(ids).logits
    assert calls == []  # CPU tensors: each module's own forward
    assert fuse_kernels(model, ()) == 0
    assert not any("forward" in m.__dict__ for m in model.modules())
    hooked = model.model.norm
    hooked.forward = lambda x: x  # a forward someone else set (an offloading hook, say)
    assert fuse_kernels(model) == 2 * layers and fuse_kernels(model, ()) == 0
    assert "forward" in hooked.__dict__
    del hooked.forward
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fused)
