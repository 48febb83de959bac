"""Element-wise pieces of the decoding engine's models as Triton kernels (core/kernels.py), on CUDA.

Owns where the engine runs a chain of small eager kernels, each launched alone even inside a
CUDA graph, as one or two Triton kernels: `fuse_kernels(model)` gives each module of a kind below the
kernel of its rule, in inference:
- norms: each leaf module with a 1-D weight and an epsilon whose own forward computes
  drafter.rms_norm_rule, bit for bit on a probe. The drafter's norms do, and so do
  transformers' Llama, Mistral and Qwen norms; Gemma's, which scale by 1 + weight in float32,
  do not. The target's and the drafter's.
- the drafter's rotations (drafter.QKRotation, RoPE of a layer's queries and keys): two launches
  instead of ten, in half precision only (what the drafter serves in; the kernel's float32 path
  was never checked on a GPU), where the kernel gives the eager rule's result bit for bit on a
  probe run on the model's device.
The module's forward becomes an instance attribute (never over one set by someone else, such as
a hook); `fuse_kernels(model, ())` gives the class's back. Training never takes a kernel:
where autograd records (the drafter's steps), under autocast (the walk's float32 master
weights), in code being compiled and on CPU tensors each module keeps its own forward. Exports
carry drafter.py as it is: consumers run their own code.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Callable

import torch

from dflash_train.core.drafter import QKRotation, rms_norm_rule

PROBE_ROWS = 8  # rows of the norms' probe, of scales 1e-3 .. 1e3
HALF_PRECISION = (torch.bfloat16, torch.float16)
KINDS = ("norms", "rotations")


def kernel_runs_on(device: torch.device) -> bool:
    """The kernels need a CUDA device and Triton (which CUDA builds of torch bring)."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def fuse_kernels(model: torch.nn.Module, kinds: tuple[str, ...] = KINDS) -> int:
    """The model's modules of the `kinds` named (of KINDS; () for none) run their kernel in
    inference where the device allows; all others their own forward. Returns how many run a
    kernel."""
    weight = next(model.parameters())
    device_on = kernel_runs_on(weight.device)
    verdicts: dict[type, bool] = {}
    fused = 0
    for module in model.modules():
        kind, kernel = _kind_of(module)
        if kernel is None:
            continue
        on = device_on and kind in kinds
        if _fused(module):
            if on:  # already: its kind (and for a norm the probe) said so when it was fused
                fused += 1
                continue
            del module.forward  # the class's own forward again
        if "forward" in module.__dict__:  # a forward set by someone else (a hook): left as it is
            continue
        if on and type(module) not in verdicts:
            verdicts[type(module)] = (_rotation_runs_its_rule(weight.device, weight.dtype, _head_dim(model))
                                      if kind == "rotations" else _follows_the_rule(module))
        if on and verdicts[type(module)]:
            module.forward = functools.partial(_kernel_or_own, module, kernel)
            fused += 1
    return fused


def _fused(module: torch.nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _kernel_or_own


def _kind_of(module: torch.nn.Module) -> tuple[str | None, Callable | None]:
    """A module's kind (of KINDS) and its kernel call (module, *inputs) -> output; (None, None)
    for other modules."""
    if type(module) is QKRotation:
        return "rotations", _rotation
    if _norm_like(module):
        return "norms", _norm
    return None, None


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    # Triton comes with CUDA builds of torch only: the kernels are imported where they run.
    from dflash_train.core.kernels import triton_rms_norm

    return triton_rms_norm(x, module.weight, _eps(module))


def _rotation(module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    from dflash_train.core.kernels import triton_qk_rotation  # Triton: as _norm's

    return triton_qk_rotation(q, k, cos, sin)


def _eps(module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _norm_like(module: torch.nn.Module) -> bool:
    """A leaf module with a 1-D weight and an epsilon: a norm the probe may check."""
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.nn.Parameter) and weight.dim() == 1 and _eps(module) is not None
            and next(module.children(), None) is None)


def _follows_the_rule(module: torch.nn.Module) -> bool:
    """Whether a norm's own forward equals drafter.rms_norm_rule bit for bit on a probe of rows
    of very different scales, at its weight's dtype and device."""
    weight = module.weight
    gen = torch.Generator(device=weight.device).manual_seed(0)
    scales = torch.logspace(-3, 3, PROBE_ROWS, device=weight.device)[:, None]
    x = (torch.randn(PROBE_ROWS, weight.shape[0], device=weight.device, generator=gen) * scales).to(weight.dtype)
    with torch.no_grad():
        try:
            own = type(module).forward(module, x)
        except (TypeError, RuntimeError):  # a forward that takes more than the hidden states
            return False
        return isinstance(own, torch.Tensor) and torch.equal(own, rms_norm_rule(x, weight, _eps(module)))


def _head_dim(model: torch.nn.Module) -> int:
    """The model's attention head dimension (its config's; 64 where it names none)."""
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None)
    if not head_dim and getattr(config, "num_attention_heads", None):
        head_dim = config.hidden_size // config.num_attention_heads
    return int(head_dim or 64)


def _rotation_runs_its_rule(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the rotation kernel runs on this device and gives drafter.QKRotation's result bit for
    bit, on a probe of the drafter's shapes at the model's dtype (half precision: the kernel is
    taken in it only) and head dimension. A kernel that fails here is not used: the eager rule runs
    instead."""
    if dtype not in HALF_PRECISION:
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(2, positions, heads, head_dim, device=device, generator=gen).to(dtype).transpose(1, 2)
            for positions, heads in ((16, 3), (32, 1)))  # [2, 3, 16, D] and [2, 1, 32, D] views
    angles = torch.rand(2, 1, 32, head_dim // 2, device=device, generator=gen) * 1000
    cos, sin = (f(torch.cat([angles, angles], dim=-1)).to(dtype) for f in (torch.cos, torch.sin))
    rotation = QKRotation()
    with torch.no_grad():
        want = rotation(q, k, cos, sin)
        try:
            got = _rotation(rotation, q, k, cos, sin)
        except Exception as error:  # noqa: BLE001 (a compiler's or a driver's: any of them means not here)
            warnings.warn(f"the drafter's rotation kernel does not run on {device} ({error!r}); its eager rule runs")
            return False
    return all(torch.equal(a, b) for a, b in zip(got, want))


def _kernel_or_own(module, kernel, *inputs, **kwargs):
    if not kwargs and _inference_on_cuda(module, kernel, inputs):
        return kernel(module, *inputs)
    return type(module).forward(module, *inputs, **kwargs)


def _inference_on_cuda(module, kernel, inputs: tuple) -> bool:
    """Whether this call may take the kernel: its inputs (a norm's one, a rotation's four) and
    the module's weights are CUDA tensors of one dtype (a rotation's in half precision), nothing
    is recorded for autograd, no autocast, not in code being compiled."""
    tensors = [*inputs, *module.parameters(recurse=False)]
    if len(inputs) != (1 if kernel is _norm else 4) or not all(isinstance(t, torch.Tensor) for t in inputs):
        return False
    dtype = inputs[0].dtype
    return (all(t.is_cuda and t.dtype == dtype for t in tensors)
            and (kernel is _norm or dtype in HALF_PRECISION)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and not torch.is_autocast_enabled(inputs[0].device.type) and not torch.compiler.is_compiling())
