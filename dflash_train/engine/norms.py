"""The norms of the decoding engine's models as one kernel each (core/norm_kernel.py), on CUDA.

Owns where the engine runs the RMSNorm rule (drafter.rms_norm_rule) as one Triton kernel
instead of its eight eager kernels, each launched alone even inside a CUDA graph:
- the drafter's norms (`use_norm_kernel`): drafter.RMSNorm takes the kernel handed to
  drafter.py, process-wide, in inference;
- the target's (`fuse_target_norms`): each norm module of the target whose own forward computes
  that rule, bit for bit on a probe (transformers' Llama, Qwen, Mistral norms do; Gemma's, which
  scale by 1 + weight in float32, do not), runs it as the kernel in inference. Its forward
  becomes an instance attribute (never over one set by someone else, such as a hook);
  `fuse_target_norms(model, False)` gives the class's back.
Training never takes the kernel: where autograd records (the drafter's steps), under autocast
(the walk's float32 master weights), in code being compiled and on CPU tensors each module keeps
its own forward.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from dflash_train.core import drafter as drafter_code
from dflash_train.core.drafter import rms_norm_rule

PROBE_ROWS = 8  # rows of the probe, of scales 1e-3 .. 1e3


def kernel_runs_on(device: torch.device) -> bool:
    """The kernel needs a CUDA device and Triton (which CUDA builds of torch bring)."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def use_norm_kernel(device: torch.device, wanted: bool = True) -> bool:
    """The drafter's norms in inference as one kernel each where `wanted` and the device allow
    (kernel_runs_on), else by the eager rule; returns whether the kernel is on. Process-wide
    (drafter.norm_kernel)."""
    on = wanted and kernel_runs_on(device)
    if on:
        drafter_code.norm_kernel = _kernel()
    elif device.type == "cuda":
        drafter_code.norm_kernel = None
    return on


def fuse_target_norms(model: torch.nn.Module, wanted: bool = True) -> int:
    """The target's norm modules that follow the rule run it as one kernel in inference, where
    `wanted` and the device allow; else (and for the others) their own forward. Returns how many
    run the kernel."""
    device = model.get_input_embeddings().weight.device
    on = wanted and kernel_runs_on(device)
    verdicts: dict[type, bool] = {}
    fused = 0
    for module in model.modules():
        if not _norm_like(module):
            continue
        if _fused(module):
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
            and not isinstance(module, drafter_code.RMSNorm) and next(module.children(), None) is None)


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
