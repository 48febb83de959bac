"""The frozen target with its forwards captured as CUDA graphs: one graph per batch shape of the plan."""

from __future__ import annotations

import warnings

import torch

from dflash_train.core.errors import InputError
from dflash_train.engine.graphs import Graphs


class GraphedTarget:
    """`Target.capture` replayed from CUDA graphs, one per batch shape of the batch plan
    (`target.cuda_graphs`). For a small target the forward costs the host as much as the GPU: a
    launch per kernel of every layer, the hooks, the compiled layers' guards (for SmolLM2 about as
    much host time as kernel time per batch); a replay
    is one launch, and the host's time goes to the drafter's step instead.

    `prepare(shapes, concat)` (the producer's warm-up, with every (rows, L) the plan's batches
    have) runs each shape once eagerly (layers compiled, kernels chosen, output sizes known),
    checks once that the forward never makes the host wait for the GPU (a forward that does
    cannot be captured: then nothing is, the target runs eagerly and the log says why), and
    captures each shape through `decode.Graphs` (the engine's graph keeper: a warm-up run on a
    side stream, one memory pool shared by all graphs, the garbage collector held off during a
    capture). A replay runs the same kernels on the same shapes as the eager forward: the same
    numbers. Shapes not prepared run eagerly. A capture that fails all the same stops the
    warm-up with an error that names the switch: after a failed capture the process's CUDA
    state (its random generators' capture bookkeeping, say) cannot be trusted.

    The graphs write their outputs into one set of buffers of the largest shape's size, and
    `capture` returns copies of them: what it returns may be kept across later calls, as the
    eager forward's outputs, and the graphs' own memory stays one shape's intermediates plus
    one output set. `target` is a `Target` (or anything with its capture).
    """

    def __init__(self, target, device: torch.device, log=print) -> None:
        self.target, self.log, self.device = target, log, torch.device(device)
        self.graphs = Graphs(self.device)
        self.steps: dict[tuple[int, int, bool], tuple] = {}  # (rows, L, concat) -> fn, layout
        self.refused: str | None = None  # why the forward cannot be captured (it waits on the GPU)

    def __getattr__(self, name):  # embed, lm_head_weight, layer_ids, ... of the wrapped target
        return getattr(self.target, name)

    @torch.no_grad()
    def prepare(self, shapes: list[tuple[int, int]], concat: bool = True) -> None:
        """Warm up and capture every (rows, L) of `shapes`."""
        keys = [k for k in dict.fromkeys((int(r), int(L), bool(concat)) for r, L in shapes) if k not in self.steps]
        sizes: list[tuple[int, torch.dtype]] = []  # per output tensor: most elements, dtype
        layouts = {}
        for rows, L, concat_ in keys:
            features, head_out = self.target.capture(self._zeros(rows, L), concat_)
            split = isinstance(features, (list, tuple))
            layouts[(rows, L, concat_)] = (len(features) if split else None, head_out is not None)
            for i, t in enumerate(_flat((features, head_out))):
                if i == len(sizes):
                    sizes.append((0, t.dtype))
                sizes[i] = (max(sizes[i][0], t.numel()), t.dtype)
            del features, head_out
        if not keys or self.refused is not None:
            return
        self.refused = self._host_wait(*keys[0])
        if self.refused is not None:
            self.log(f"target.cuda_graphs: the target's forward makes the host wait for the GPU ({self.refused}), "
                     "so it cannot be captured as a CUDA graph; the target runs without graphs")
            return
        buffers = [torch.empty(n, dtype=dtype, device=self.device) for n, dtype in sizes]
        for key in keys:
            fn = self._writer(key[2], buffers)
            try:
                self.graphs.run(key, fn, self._zeros(*key[:2]))
            except RuntimeError as err:
                first = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise InputError(
                    f"target.cuda_graphs: capturing the target's forward for batches of shape {key[:2]} as a CUDA "
                    f"graph failed ({first}); set target.cuda_graphs=false to train without graphs") from err
            self.steps[key] = (fn, layouts[key])

    @torch.no_grad()
    def capture(self, input_ids_bL: torch.Tensor, concat: bool = True):
        key = (*map(int, input_ids_bL.shape), bool(concat))
        entry = self.steps.get(key)
        if entry is None:
            return self.target.capture(input_ids_bL, concat)
        fn, (num_split, has_head) = entry
        copies = [out.clone() for out in self.graphs.run(key, fn, input_ids_bL)]
        head_out = copies.pop() if has_head else None
        return (copies if num_split is not None else copies[0]), head_out

    def _host_wait(self, rows: int, L: int, concat: bool) -> str | None:
        """The first line of what CUDA's sync debug mode raises when the forward makes the host
        wait for the GPU (an item(), a nonzero, a copy to the host), or None. On CPU there is no
        such mode: the forward just runs (tests make it raise)."""
        cuda = self.device.type == "cuda"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the debug mode's own notice that it is a prototype
            if cuda:
                torch.cuda.set_sync_debug_mode("error")
            try:
                self.target.capture(self._zeros(rows, L), concat)
            except RuntimeError as err:
                return str(err).splitlines()[0] if str(err) else type(err).__name__
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        return None

    def _zeros(self, rows: int, L: int) -> torch.Tensor:
        return torch.zeros(rows, L, dtype=torch.long, device=self.device)

    def _writer(self, concat: bool, buffers: list[torch.Tensor]):
        """The captured step: the target's forward, its outputs written into the shared buffers."""
        def step(ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
            outs = _flat(self.target.capture(ids, concat))
            return tuple(buf[: t.numel()].view(t.shape).copy_(t) for t, buf in zip(outs, buffers))

        return step


def _flat(outputs) -> list[torch.Tensor]:
    """(features, head_out) of Target.capture as a flat list of tensors (features may be a list
    of per-tap tensors; head_out may be None)."""
    features, head_out = outputs
    flat = list(features) if isinstance(features, (list, tuple)) else [features]
    return flat + ([] if head_out is None else [head_out])
