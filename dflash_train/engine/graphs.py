"""CUDA graphs of the decoding engine: capture once per shape, replay, and keep the collector out of captures."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

# --------------------------------------------------------------------------- the cache


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# --------------------------------------------------------------------------- graphs


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    fn: Callable  # kept: a tensor its closure holds is read by the graph at its address


@dataclass
class Graphs:
    """Step functions by shape key: `run(key, fn, *inputs)` calls fn(*inputs) eagerly, or (CUDA,
    enabled) replays the graph captured for `key` after copying `inputs` into its static inputs.
    fn must be a function of its tensor inputs (and of state it only writes idempotently, as the
    caches), returning a tuple of tensors; tensors it reads from elsewhere must outlive the graph
    (fn itself is kept with it, so its closure's are); the returned tensors are the graph's static outputs,
    valid until the next run of the same key. One memory pool is shared by every graph (they
    never run at the same time)."""

    device: torch.device
    enabled: bool = True
    capture_seconds: float = 0.0
    num_captured: int = 0
    entries: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.enabled = bool(self.enabled) and self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None

    def run(self, key, fn: Callable[..., tuple[torch.Tensor, ...]], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.enabled:
            return fn(*inputs)
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = self._capture(fn, inputs)
        for static, x in zip(entry.inputs, inputs):
            static.copy_(x, non_blocking=True)
        entry.graph.replay()
        return entry.outputs

    def _capture(self, fn, inputs) -> _Captured:
        """Capture with Python's cyclic garbage collector held off: a collection that ran
        inside the capture could destroy an unreachable graph (a replaced step set's graphs
        reach their owner through their closures, a cycle only the collector frees), and
        destroying a graph while another is captured invalidates that capture (CUDA refuses
        the call; the next kernel fails, cuBLAS's first). Collection resumes after it. The
        seconds counted start once the work already queued is done (that work is decoding's)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        static = tuple(x.clone() for x in inputs)
        collecting = gc.isenabled()
        gc.disable()
        try:
            graph, outputs = self._record(fn, static)
        finally:
            if collecting:
                gc.enable()
        self.capture_seconds += time.perf_counter() - started
        self.num_captured += 1
        return _Captured(graph, static, tuple(outputs), fn)

    def _record(self, fn, static):
        """The CUDA part of a capture: a warm-up run on a side stream (lazy inits, autotuning),
        then the capture into the shared pool. Returns (graph, outputs)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn(*static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = tuple(fn(*static))
        torch.cuda.synchronize(self.device)
        return graph, outputs

    def clear(self) -> None:
        """Destroy every captured graph now (not whenever the collector reaches them)."""
        self.entries.clear()

    @property
    def buckets_small_steps(self) -> bool:
        """Whether the steps that run at their own shapes on CPU (a small prefill, the prompt
        context write) run at bucket shapes instead: wherever a graph may replay them, and on
        CUDA eagerly too, so that eager and captured runs compute the same numbers."""
        return self.enabled or self.device.type == "cuda"
