"""The norms of the decoding engine's models as one kernel each (core/norm_kernel.py), on CUDA.

Owns where the engine runs the RMSNorm rule (drafter.rms_norm_rule) as one Triton kernel
instead of its eight eager kernels, each launched alone even inside a CUDA graph:
`fuse_norms(model)` gives each norm module of a model (the target's, the drafter's) whose own
forward computes that rule, bit for bit on a probe, the kernel in inference. The drafter's
norms do, and so do transformers' Llama, Mistral and Qwen norms; Gemma's, which scale by
1 + weight in float32, do not. Its forward becomes an instance attribute (never over one set by
someone else, such as a hook); `fuse_norms(model, False)` gives the class's back.
Training never takes the kernel: where autograd records (the drafter's steps), under autocast
(the walk's float32 master weights), in code being compiled and on CPU tensors each module keeps
its own forward. Exports carry drafter.py as it is: consumers run their own norms.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from dflash_train.core.drafter import rms_norm_rule

PROBE_ROWS = 8  # rows of the probe, of scales 1e-3 .. 1e3


def kernel_runs_on(device: torch.device) -> bool:
    """The kernel needs a CUDA device and Triton (which CUDA builds of torch bring)."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def fuse_norms(model: torch.nn.Module, wanted: bool = True) -> int:
    """The model's norm modules that follow the rule run it as one kernel in inference, where
    `wanted` and the device allow; else (and for the others) their own forward. Returns how many
    run the kernel."""
    on = wanted and kernel_runs_on(next(model.parameters()).device)
    verdicts: dict[type, bool] = {}
    fused = 0
    for module in model.modules():
        if not _norm_like(module):
            continue
        if _fused(module):
            if on:  # already: the probe said so when it was fused
                fused += 1
                continue
            del module.forward  # the class's own forward again
        if "forward" in module.__dict__:  # a forward set by someone else (a hook): left as it is
            continue
        if on and type(module) not in verdicts:
            verdicts[type(module)] = _follows_the_rule(module)
        if on and verdicts[type(module)]:
            module.forward = functools.partial(_kernel_or_own, module, _kernel())
            fused += 1
    return fused


def _fused(module: torch.nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _kernel_or_own


def _kernel():
    # Triton comes with CUDA builds of torch only: imported where the kernel runs.
    from dflash_train.core.norm_kernel import triton_rms_norm

    return triton_rms_norm


def _eps(module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _norm_like(module: torch.nn.Module) -> bool:
    """A leaf module with a 1-D weight and an epsilon: a norm the probe may check."""
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.nn.Parameter) and weight.dim() == 1 and _eps(module) is not None
            and next(module.children(), None) is None)


def _follows_the_rule(module: torch.nn.Module) -> bool:
    """Whether the module's own forward equals drafter.rms_norm_rule bit for bit on a probe of
    rows of very different scales, at its weight's dtype and device."""
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


def _kernel_or_own(module, kernel, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if (not args and not kwargs and not (torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad))
            and x.is_cuda and x.dtype == module.weight.dtype and not torch.is_autocast_enabled(x.device.type)
            and not torch.compiler.is_compiling()):
        return kernel(x, module.weight, _eps(module))
    return type(module).forward(module, x, *args, **kwargs)
