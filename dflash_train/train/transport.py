"""Moving shipments (produce.py) from target ranks to drafter ranks (disaggregated mode).

Owns the wire format and the two ends. A batch travels as a small int64 header (global
micro-batch index, flags, shapes, dtype code, batch statistics, the sender's cumulative wait,
the anchor count counted on the host or -1 when unknown) followed by its payload tensors: the
features (one [T, F] tensor, or one [T, H] tensor per tapped layer with split fc layers), with
distillation the target's final hidden state [T, H], one int64 [3, T] tensor (input ids, loss
mask, labels) and the document lengths [num_docs]. A batch whose target forward failed is a
header alone.

`Sender` (target side) posts `isend`s and keeps every sent tensor referenced until its send has
completed; at most `topology.queue_depth` batches per drafter are in flight, beyond that it
waits for the oldest. `Receiver` (drafter side) receives in global-index order (which target
sent batch g is a pure function of g, so both ends agree without asking) into buffers that it
reuses once the consumer has finished the previous batch (the drafter step asks for batch g + 1
only after the backward of batch g; on GPU, NCCL orders the receive after the work already
queued on the current stream). Both ends time their waits: a starving drafter shows as
receive wait, a blocked target as send wait, in metrics.jsonl.

Shape legend: T packed tokens (data.token_budget), F feature width, H one tap's width.
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from dflash_train.train.dist import Dist
from dflash_train.train.produce import Shipment

HEADER_LEN = 18
FAILED, SPLIT, HIDDEN = 1, 2, 4
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _header(s: Shipment, device) -> torch.Tensor:
    split = isinstance(s.features, list)
    hidden = s.target_hidden_TH
    h = [0] * HEADER_LEN
    h[0] = s.index
    h[1] = (FAILED if s.failed else 0) | (SPLIT if split else 0) | (HIDDEN if hidden is not None else 0)
    if not s.failed:
        parts = s.features if split else [s.features]
        h[2], h[3], h[4] = len(parts), parts[0].shape[0], parts[0].shape[1]
        h[5], h[6] = DTYPES.index(parts[0].dtype), s.doc_lengths.numel()
        if hidden is not None:
            h[14], h[15] = hidden.shape[1], DTYPES.index(hidden.dtype)
    h[7:14] = [s.num_tokens, s.padded_tokens, s.rows, s.sum_seq_len, s.max_seq_len, s.epoch, s.sender_wait_us]
    h[16] = -1 if s.anchor_count is None else s.anchor_count
    h[17] = s.doc_align
    return torch.tensor(h, dtype=torch.int64, device=device)


class Sender:
    """Target side: bounded, asynchronous sends to drafter ranks."""

    def __init__(self, dist: Dist, queue_depth: int) -> None:
        self.dist, self.queue_depth = dist, queue_depth
        self.in_flight: dict[int, deque] = {}
        self.wait_s = 0.0  # time blocked on full queues, cumulative

    def send(self, dst: int, shipment: Shipment) -> None:
        queue = self.in_flight.setdefault(dst, deque())
        while len(queue) >= self.queue_depth:
            self._complete(dst, queue.popleft())
        shipment.sender_wait_us = int(self.wait_s * 1e6)
        tensors = [_header(shipment, self.dist.device)]
        if not shipment.failed:
            ints = torch.stack([shipment.input_ids_T, shipment.loss_mask_T.to(torch.int64), shipment.labels_T])
            feats = shipment.features if isinstance(shipment.features, list) else [shipment.features]
            if shipment.target_hidden_TH is not None:
                feats = [*feats, shipment.target_hidden_TH]
            tensors += [f.contiguous() for f in feats] + [ints, shipment.doc_lengths.to(torch.int64).contiguous()]
        # The tensors stay referenced in the queue entry until their sends have completed.
        works = [dist.isend(t, dst) for t in tensors]
        queue.append((shipment.index, works, tensors))

    def _complete(self, dst: int, entry) -> None:
        index, works, _tensors = entry
        started = time.perf_counter()
        for work in works:
            self.dist.wait(work, f"sending micro-batch {index} to {self.dist.name(dst)}")
        self.wait_s += time.perf_counter() - started

    def flush(self) -> None:
        for dst, queue in self.in_flight.items():
            while queue:
                self._complete(dst, queue.popleft())


class Receiver:
    """Drafter side: receives batch g from its producer, into reused buffers."""

    def __init__(self, dist: Dist) -> None:
        self.dist = dist
        self.header = torch.empty(HEADER_LEN, dtype=torch.int64, device=dist.device)
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.wait_s = 0.0  # time blocked waiting for batches, cumulative
        self.sender_wait_us: dict[int, int] = {}  # producer index -> its latest cumulative send wait

    def _buffer(self, key: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self.buffers[key] = torch.empty(shape, dtype=dtype, device=self.dist.device)
        return buf

    def recv(self, src: int, index: int) -> Shipment:
        what = f"waiting for micro-batch {index} from {self.dist.name(src)}"
        started = time.perf_counter()
        self.dist.wait(dist.irecv(self.header, src), what)
        h = self.header.tolist()  # host copy: the shapes decide the buffers
        self.wait_s += time.perf_counter() - started
        if h[0] != index:  # our own invariant: both ends follow the same assignment
            raise AssertionError(f"{self.dist.name()}: expected micro-batch {index} from rank {src}, got {h[0]}")
        self.sender_wait_us[self.dist.producers.index(src)] = h[13]
        stats = dict(num_tokens=h[7], padded_tokens=h[8], rows=h[9], sum_seq_len=h[10], max_seq_len=h[11],
                     epoch=h[12], sender_wait_us=h[13])
        if h[1] & FAILED:
            return Shipment(index, True, None, **stats)
        num_parts, T, F, dtype, num_docs = h[2], h[3], h[4], DTYPES[h[5]], h[6]
        parts = [self._buffer(("feat", i), (T, F), dtype) for i in range(num_parts)]
        hidden = [self._buffer(("hidden",), (T, h[14]), DTYPES[h[15]])] if h[1] & HIDDEN else []
        ints = self._buffer(("ints",), (3, T), torch.int64)
        docs = self._buffer(("docs", num_docs), (num_docs,), torch.int64)
        works = [dist.irecv(t, src) for t in (*parts, *hidden, ints, docs)]
        started = time.perf_counter()
        for work in works:
            self.dist.wait(work, what)
        self.wait_s += time.perf_counter() - started
        features = parts if h[1] & SPLIT else parts[0]
        return Shipment(index, False, features, ints[0], ints[1].to(torch.bool), ints[2], docs,
                        hidden[0] if hidden else None, **stats, anchor_count=None if h[16] < 0 else h[16],
                        doc_align=h[17])
