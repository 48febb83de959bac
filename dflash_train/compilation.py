"""What a training run compiles with torch.compile, with which settings, and the recompile limit.

Owns every torch.compile of training and benchmarks, decided from the config and the device in
`Compilation.decide` and applied by `apply`:
- flex attention (the drafter's attention under a BlockMask): always on CUDA, the eager
  fallback materialises the whole score matrix; one kernel per (queries, keys) shape.
- the drafter's layers (`train.compile`), each as a module, with torch's default shape
  handling (a second shape recompiles once, dynamic in the dimensions that changed).
- the loss's per-chunk math (`train.compile`, CUDA only: there it is memory-bound passes over
  [chunk, vocab] logits that inductor fuses; CPU runs are tests and tiny benches); one graph per
  chunk shape (loss.block_loss pads the last chunk) and kind (hard labels, distillation), full
  graph.
- the target's kept decoder layers (`target.compile`): each layer's forward only, so the
  hooks that tap its output run around it, eagerly; default shape handling, every bucket's
  shape seen during warm-up.
Bucketed batches, packed rows of one length and power-of-two anchor counts keep the shapes to a
handful, and the recompile limit is raised so that a long run never falls back to eager code
late (eager flex attention would materialise the score matrix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RECOMPILE_LIMIT = 64  # graphs per compiled function; a run sees a handful of shapes
_flex = None
_loss_chunks: dict[bool, object] = {}  # hard labels / distillation -> compiled chunk


@dataclass(frozen=True)
class Compilation:
    flex_attention: bool
    drafter_layers: bool
    loss_chunks: bool
    target_layers: bool

    @classmethod
    def decide(cls, cfg, device: torch.device, attention: str) -> "Compilation":
        """From the config; `attention` is the drafter's resolved backend (flex | sdpa)."""
        cuda = device.type == "cuda"
        return cls(flex_attention=cuda and attention == "flex", drafter_layers=cfg.train.compile,
                   loss_chunks=cuda and cfg.train.compile, target_layers=cfg.target.compile)

    def apply(self, *, drafter=None, target=None) -> None:
        """Compile what this plan says of the parts a rank holds (None: a part it lacks). The
        loss's chunks are compiled where block_loss runs them (`loss_chunk`)."""
        from dflash_train.target import Target

        if self.flex_attention and drafter is not None:
            compile_flex_attention()
        if self.drafter_layers and drafter is not None:
            compile_drafter_layers(drafter)
        if self.target_layers and isinstance(target, Target):  # stand-ins without layers: nothing to compile
            compile_target_layers(target)


def _raise_recompile_limit() -> None:
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


def compile_flex_attention() -> None:
    """Route the drafter's flex attention through one compiled kernel (drafter.py imports
    nothing from this package: it is copied into every export, so it is handed the kernel)."""
    global _flex
    from torch.nn.attention.flex_attention import flex_attention

    from dflash_train import drafter

    _raise_recompile_limit()
    if _flex is None:
        _flex = torch.compile(flex_attention, dynamic=False)
    drafter.flex_kernel = _flex


def compile_drafter_layers(drafter) -> None:
    _raise_recompile_limit()
    for layer in drafter.layers:
        layer.compile()


def compile_target_layers(target) -> None:
    """`target` is a target.Target: its kept decoder layers, forward only (taps stay eager)."""
    _raise_recompile_limit()
    for layer in target.decoder.layers:
        layer.forward = torch.compile(layer.forward)


def loss_chunk(soft: bool = False):
    """The compiled per-chunk loss (`loss.hard_chunk_loss`, or `loss._soft_chunk_loss` for
    distillation); block_loss(compile=True) calls it."""
    if soft not in _loss_chunks:
        from dflash_train.loss import _soft_chunk_loss, hard_chunk_loss

        _raise_recompile_limit()
        _loss_chunks[soft] = torch.compile(_soft_chunk_loss if soft else hard_chunk_loss, dynamic=False, fullgraph=True)
    return _loss_chunks[soft]
