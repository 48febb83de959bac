"""What a training run compiles with torch.compile, with which settings, and the recompile limit.

Owns every torch.compile of training and benchmarks, decided from the config and the device in
`Compilation.decide` and applied by `apply`:
- flex attention (the drafter's attention under a BlockMask): always on CUDA, the eager
  fallback materialises the whole score matrix; one kernel per (queries, keys) shape, or with
  exact anchor counts (train.anchor_buckets_per_doubling=0) torch's default shape handling (a
  second shape recompiles once, dynamic in the query count); with the kernel options of
  `flex_kernel_options` (train.flex_kernel_options, or tiles chosen by head dim).
- the drafter's layers and its two norms outside them (`train.compile`), each as a module,
  with torch's default shape handling (a second shape recompiles once, dynamic in the
  dimensions that changed).
- the loss's per-chunk math (`train.compile`, CUDA only, where `train.loss_kernel` leaves the
  chunk to torch operations, i.e. distillation or loss_kernel=torch: there it is memory-bound
  passes over [chunk, vocab] logits that inductor fuses; CPU runs are tests and tiny benches);
  one graph for full chunks and one, rows dynamic, for a shorter last chunk, per kind (hard
  labels, distillation), full graph. Hard labels on CUDA run the Triton kernel of
  `loss_kernel.py` by default instead (`loss_kernel`).
- the target's kept decoder layers (`target.compile`): each layer's forward only, so the
  hooks that tap its output run around it, eagerly; default shape handling, every bucket's
  shape seen during warm-up.
Also the float8 swap of the drafter's linear layers (train.fp8, `fp8_linear_layers`), which must
precede their compilation. Bucketed batches, packed rows of one length and bucketed anchor counts
keep the shapes to a handful, and the recompile limit is raised so that a long run never falls
back to eager code late (eager flex attention would materialise the score matrix).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import flex_attention

from dflash_train.core import drafter
from dflash_train.core.compiler import raise_recompile_limit
from dflash_train.core.config import ConfigError, loss_kernel_problems
from dflash_train.core.target import Target

_flex: dict[bool, object] = {}  # dynamic query count -> compiled flex_attention


@dataclass(frozen=True)
class Compilation:
    flex_attention: bool
    drafter_layers: bool
    loss_chunks: bool
    target_layers: bool
    loss_kernel: str = "torch"
    """What block_loss runs per chunk: "triton" (loss_kernel.py) or "torch" (compiled where
    `loss_chunks`)."""
    flex_options: tuple = ()
    """The flex kernels' options as sorted (name, value) pairs (`flex_kernel_options`)."""
    flex_dynamic: bool = False
    """Exact anchor counts (train.anchor_buckets_per_doubling=0): flex compiled with torch's
    default shape handling instead of one kernel per shape."""

    @classmethod
    def decide(cls, cfg, device: torch.device, attention: str, head_dim: int | None = None) -> "Compilation":
        """From the config; `attention` is the drafter's resolved backend (flex | sdpa),
        `head_dim` the drafter's (for the flex kernels' default tiles)."""
        cuda = device.type == "cuda"
        kernel = loss_kernel(cfg.train.loss_kernel, device, cfg.objective.labels)
        return cls(flex_attention=cuda and attention == "flex", drafter_layers=cfg.train.compile,
                   loss_chunks=cuda and cfg.train.compile and kernel == "torch", target_layers=cfg.target.compile,
                   flex_options=tuple(sorted(flex_kernel_options(cfg.train.flex_kernel_options, head_dim).items())),
                   loss_kernel=kernel, flex_dynamic=cfg.train.anchor_buckets_per_doubling == 0)

    def apply(self, *, drafter=None, target=None) -> None:
        """Compile what this plan says of the parts a rank holds (None: a part it lacks). The
        loss's chunks are compiled where block_loss runs them (`loss.compiled_chunk`)."""
        if self.flex_attention and drafter is not None:
            compile_flex_attention(dict(self.flex_options), dynamic=self.flex_dynamic)
        if self.drafter_layers and drafter is not None:
            compile_drafter_layers(drafter)
        if self.target_layers and isinstance(target, Target):  # stand-ins without layers: nothing to compile
            compile_target_layers(target)


def loss_kernel(setting: str, device: torch.device, labels: str) -> str:
    """train.loss_kernel resolved for a device and objective.labels: "triton" or "torch"."""
    problems = loss_kernel_problems(setting, device.type, labels)
    if problems:
        raise ConfigError(problems)
    if setting == "triton":
        return "triton"
    if setting == "auto" and device.type == "cuda" and labels != "distill" and importlib.util.find_spec("triton"):
        return "triton"
    return "torch"


SMALL_HEAD_FLEX_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64,
                           "BLOCK_N2": 64, "bwd_num_warps": 4, "bwd_num_stages": 2, "fwd_USE_TMA": True}
"""The kernel options for head dims <= 64, chosen on SmolLM2's shape (head dim 64, the `smollm2`
bench; docs/PERFORMANCE.md has the measurements): 64 x 64 forward tiles; 64-row and 64-key
backward tiles with 4 warps and 2 pipeline stages (torch's choice: 64/128/128/64 with 8 warps and
3 stages); TMA loads in the forward only (in the backward they were slower)."""


def flex_kernel_options(configured: dict | None, head_dim: int | None) -> dict:
    """train.flex_kernel_options resolved: as given, or by default (None) the small-head tiles
    for head dims <= 64 and torch's choice otherwise."""
    if configured is not None:
        return dict(configured)
    return dict(SMALL_HEAD_FLEX_OPTIONS) if head_dim is not None and head_dim <= 64 else {}


FLEX_DIVISOR = 128  # inductor's flex kernels skip bounds checks where both lengths are multiples of this


def compile_flex_attention(kernel_options: dict | None = None, dynamic: bool = False) -> None:
    """Route the drafter's flex attention through one compiled kernel (drafter.py imports
    nothing from this package: it is copied into every export, so it is handed the kernel),
    with `kernel_options` (train.flex_kernel_options) when given; `dynamic`: torch's default
    shape handling (exact anchor counts) instead of one kernel per shape.

    Each call whose query and key lengths are both multiples of FLEX_DIVISOR also passes
    IS_DIVISIBLE=True. Inductor sets it itself from static lengths, but not from symbolic ones:
    once the drafter's compiled layers run flex dynamic in the anchor count, its kernels checked
    the bounds of every load, and the backward ran markedly slower per attention pair than with
    static lengths (docs/PERFORMANCE.md). The test on the
    lengths is a guard of the compiled graph, so a length that is not a multiple takes the
    other branch (the kernels with bounds checks), never a wrong one."""

    raise_recompile_limit()
    if dynamic not in _flex:
        _flex[dynamic] = torch.compile(flex_attention, dynamic=None if dynamic else False)
    kernel = _flex[dynamic]
    options = dict(kernel_options) if kernel_options else None
    divisible = {**(options or {}), "IS_DIVISIBLE": True}

    def flex_kernel(query, key, value, **kwargs):
        whole = query.shape[-2] % FLEX_DIVISOR == 0 and key.shape[-2] % FLEX_DIVISOR == 0
        return kernel(query, key, value, kernel_options=divisible if whole else options, **kwargs)

    drafter.flex_kernel = flex_kernel


def fp8_linear_layers(drafter, recipe: str) -> list[str]:
    """train.fp8: swap the drafter's linear layers for torchao's Float8Linear (`recipe`: one of
    torchao's recipe names, "tensorwise", "rowwise" or "rowwise_with_gw_hp"),
    in place, before they are compiled. The parameters stay the same objects (the optimizer,
    checkpoints and exports see the same weights under the same names); a layer whose sizes
    are not multiples of 16 (float8 matrix products need them) keeps its bf16 product.
    Returns the names of the converted layers."""
    # torchao is the optional `fp8` extra (its warnings are silenced in dflash_train/__init__.py).
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted: list[str] = []

    def eligible(module: torch.nn.Module, name: str) -> bool:
        ok = (isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0
              and module.out_features % 16 == 0)
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(drafter, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=eligible)
    return converted


def compile_drafter_layers(drafter) -> None:
    """Each decoder layer of the drafter, and its two norms outside them (of the fc's output,
    and the final one before the lm_head): eager, an RMSNorm is about nine passes over a float32
    copy of its input each way, and the final one's input is every block row ([rows, H])."""
    raise_recompile_limit()
    for layer in drafter.layers:
        layer.compile()
    drafter.hidden_norm.compile()
    drafter.norm.compile()


def compile_target_layers(target) -> None:
    """`target` is a target.Target: its kept decoder layers, forward only (taps stay eager)."""
    raise_recompile_limit()
    for layer in target.decoder.layers:
        layer.forward = torch.compile(layer.forward)
