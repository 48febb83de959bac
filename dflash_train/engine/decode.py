"""The decoding engine: static key/value buffers, shape buckets and CUDA graphs.

Owns how the target and the drafter run at inference, for speculative decoding (decoder.py),
target-only decoding and regeneration (regenerate.py) and evaluation (evaluate.py) alike:

- `StaticCache`: one preallocated key/value buffer per layer, [rows, Hkv, C, Dh], where column c
  of row r holds position c of the sequence in slot r (rows at different lengths need no padding
  between their tokens; a rejected draft position is overwritten before anything sees it).
  Column C - 1 is the trash column: padding writes go there and no mask ever shows it.
- Attention (core/attention.py): a key at column k is visible to the query at position q when
  k <= q (and q - k < W in a sliding-window layer), so masks need no bookkeeping of holes; on a
  CUDA GPU in half precision the target's decode and verify steps read each row's columns up to
  its last query's position through FlashAttention's variable-length kernel, not the width.
- `Graphs`: each step function (the target's one-token decode step and B-token verify step, its
  prefill of up to PREFILL_GRAPH_ROWS rows, the drafter's block step and prompt context write)
  runs eagerly on CPU, and on CUDA is captured once per shape bucket (rows, and columns read
  where a step's attention reads a width) as a CUDA graph and replayed with fresh inputs
  copied into its static ones: a small model's step
  costs kernel launches and host work, not GPU time, and a replay removes both. Eager and
  captured runs launch the same kernels, so they give the same numbers.
  Capture time is counted (`Graphs.capture_seconds`) and reported by the callers.
- Token choice is sampling.py's `choose` (greedy, or position-hashed sampling), captured with
  the step: no generator state, no host work.
- Continuous batching over these steps (target-only decoding with rows refilled as they finish,
  the engine of `data regenerate`) is slots.py's `SlotDecoder`.

Shape legend: R rows, Q tokens per row in one forward, C cache columns, W columns a forward
reads (its width bucket), V vocabulary, F tapped features, B block size.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from dflash_train.core.attention import (
    CAUSAL_ATTENTION,
    GROUPED_ATTENTION,
    VARLEN_ATTENTION,
    KeyCounts,
    UseAttention,
    attention_heads,
    flash_varlen_supported,
    has_sliding_layers,
    register_attention,
    target_masks,
)
from dflash_train.core.loss import accepted_run_length
from dflash_train.engine.graphs import Graphs, _capturing
from dflash_train.engine.fusion import fuse_kernels
from dflash_train.engine.sampling import choose

# --------------------------------------------------------------------------- buckets

MIN_WIDTH = 64
PREFILL_GRAPH_ROWS = 8  # prefills of up to this many rows (a row bucket) replay a graph
PREFILL_TOKENS = 32768  # a refill's prefill forward holds at most this many prompt tokens (padded)


def row_buckets(max_rows: int) -> list[int]:
    """Row counts a step is captured for: powers of two up to max_rows, and max_rows."""
    out, r = [], 1
    while r < max_rows:
        out.append(r)
        r *= 2
    return out + [int(max_rows)]


def width_buckets(capacity: int) -> list[int]:
    """Key-column counts a step is captured for: 64, 128, then steps of x1.5 / x1.33 (64 * 2^k
    and 96 * 2^k), and the largest width the cache allows (capacity - 1; the last column is the
    trash column). Attention reads this many columns, so a row set pays for about its longest
    row, never for the whole cache."""
    last = int(capacity) - 1
    out, w = [], MIN_WIDTH
    while w < last:
        out.append(w)
        w = w * 3 // 2 if (w & (w - 1)) == 0 else w * 4 // 3
    return out + [last]


def pick(value: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= value."""
    for b in buckets:
        if b >= value:
            return b
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")


def kv_bytes_per_row(config, capacity: int, dtype: torch.dtype) -> int:
    """Bytes of the keys and values one StaticCache row of `capacity` columns holds for the
    model of `config` in `dtype`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    _, kv_heads, head_dim = attention_heads(text)
    return 2 * int(text.num_hidden_layers) * kv_heads * head_dim * int(capacity) * dtype.itemsize


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on `device`: the GPU's free memory, or on a CPU the
    system's available memory (Linux's MemAvailable); None where it cannot be told."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            with open("/proc/meminfo", encoding="ascii") as handle:
                for line in handle:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    return None


class StaticCache:
    """Keys/values of up to `rows` sequences, [rows, Hkv, capacity, Dh] per layer, column c of row
    r holding position c of slot r (see the module docstring). Same `update(k, v, layer_idx)` /
    `get_seq_length` surface as transformers' caches, so the HF target and the drafter both take
    it as `past_key_values`.

    Before each forward, `bind(columns_RQ, width, row_index)` names the column each input token
    is written to (a padding token's column is `trash`) and how many columns the forward reads
    (None: every column, for attention that reads each row's own count of them);
    the forward's rows are slots 0..R-1, or the slots in `row_index` (prefill into chosen slots).
    Buffers are allocated at the first (eager) write, never inside a graph capture."""

    def __init__(self, rows: int, capacity: int) -> None:
        self.rows, self.capacity = int(rows), int(capacity)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.columns_RQ: torch.Tensor | None = None
        self.row_index: torch.Tensor | None = None
        self.width = 0

    @property
    def trash(self) -> int:
        return self.capacity - 1

    def bind(self, columns_RQ: torch.Tensor, width: int | None, row_index: torch.Tensor | None = None) -> None:
        if width is None:
            width = self.capacity
        elif width > self.trash:
            raise ValueError(f"a forward reading {width} columns needs capacity > {width}, have {self.capacity}")
        self.columns_RQ, self.width, self.row_index = columns_RQ, int(width), row_index

    def _buffers(self, layer_idx: int, like: torch.Tensor):
        if layer_idx == len(self.keys):
            assert not _capturing(), "cache buffers must exist before a CUDA graph is captured"
            _, H, _, D = like.shape
            self.keys.append(like.new_zeros(self.rows, H, self.capacity, D))
            self.values.append(like.new_zeros(self.rows, H, self.capacity, D))
        return self.keys[layer_idx], self.values[layer_idx]

    def update(self, k_RHQD: torch.Tensor, v_RHQD: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self._buffers(layer_idx, k_RHQD)
        R, H, Q, D = k_RHQD.shape
        W = self.width
        if self.row_index is None:
            index = self.columns_RQ[:, None, :, None].expand(R, H, Q, D)
            keys[:R].scatter_(2, index, k_RHQD)
            values[:R].scatter_(2, index, v_RHQD)
            return keys[:R, :, :W], values[:R, :, :W]
        rows = self.row_index[:, None, None]
        heads = torch.arange(H, device=k_RHQD.device)[None, :, None]
        cols = self.columns_RQ[:, None, :]
        keys.index_put_((rows, heads, cols), k_RHQD)
        values.index_put_((rows, heads, cols), v_RHQD)
        return keys[self.row_index, :, :W], values[self.row_index, :, :W]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    def move_rows(self, src_R: torch.Tensor, dst_R: torch.Tensor) -> None:
        """Slot dst_R[i] takes over the contents of slot src_R[i] (compaction)."""
        for buf in (*self.keys, *self.values):
            buf.index_copy_(0, dst_R, buf.index_select(0, src_R))

    def keep_rows(self, index_R: torch.Tensor) -> None:
        """Slots index_R[i] (ascending) move to slots i: live rows stay in slots 0..n-1. The moves
        are worked out on the host (`index_R` is a host tensor: no device sync)."""
        index = index_R.cpu()
        dst = torch.arange(index.numel())
        moved = index != dst
        if self.keys and bool(moved.any()):
            device = self.keys[0].device
            self.move_rows(index[moved].to(device), dst[moved].to(device))


# --------------------------------------------------------------------------- the target


class TargetSteps:
    """The target's forwards on one StaticCache: prefill (a Graphs key per row and width bucket
    up to PREFILL_GRAPH_ROWS rows, eager at any shape above), the one-token decode step and the
    B-token verify step (one Graphs key per row bucket with varlen attention, per row and width
    bucket with masked attention). With `taps`, the verify step (and prefill) also returns the
    tapped layers' features.

    `attention` of the decode and verify steps: "varlen" (each row reads its own keys:
    VARLEN_ATTENTION, FlashAttention where `flash_varlen_supported`, else its reference), "masked"
    (the position mask over the width bucket: GROUPED_ATTENTION), or "auto" (varlen where
    FlashAttention runs it, else masked: CPU and float32 keep the masked path)."""

    ATTENTION = ("auto", "varlen", "masked")

    def __init__(self, model, rows: int, capacity: int, *, temperature: float = 0.0, top_p: float = 1.0,
                 taps=None, graphs: bool = True, attention: str = "auto") -> None:
        if attention not in self.ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(self.ATTENTION)}, got {attention!r}")
        register_attention()
        fuse_kernels(model)
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.cache = StaticCache(rows, capacity)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.taps = taps
        self.graphs = Graphs(self.device, graphs)
        self.rows = row_buckets(rows)
        self.widths = width_buckets(capacity)
        self.flash = flash_varlen_supported(model)
        self.varlen = attention == "varlen" or (attention == "auto" and self.flash)

    @property
    def attention(self) -> str:
        """The decode and verify steps' attention as it runs: varlen-flash, varlen-reference or masked."""
        return ("varlen-flash" if self.flash else "varlen-reference") if self.varlen else "masked"

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def _forward(self, ids_RQ, pos_RQ, width: int | None, row_index=None, logits_to_keep=0, causal: bool = False):
        """Padding tokens (position -1) write to the trash column and query as position 0, so
        that they see one key and stay finite; nothing reads what they produce. `causal`: the
        queries are positions 0..width-1 of every row (a prefill), attended causally with no
        mask tensor (not for sliding-window targets). With varlen attention a decode or verify
        step reads each row's own keys and `width` is not used (None)."""
        varlen = self.varlen and not causal and row_index is None
        self.cache.bind(torch.where(pos_RQ < 0, self.cache.trash, pos_RQ), None if varlen else width, row_index)
        pos_RQ = pos_RQ.clamp(min=0)
        mask, extra, implementation = None, {}, CAUSAL_ATTENTION if causal else GROUPED_ATTENTION
        if varlen:
            extra["dflash_keys"] = KeyCounts.of(pos_RQ, self.capacity, self.model.config, self.flash)
            implementation = VARLEN_ATTENTION
        elif not causal:
            mask = target_masks(self.model.config, pos_RQ, width)
        with UseAttention(self.model, implementation):
            return self.model(input_ids=ids_RQ, position_ids=pos_RQ, attention_mask=mask, past_key_values=self.cache,
                              use_cache=True, logits_to_keep=logits_to_keep, **extra).logits

    def prefill(self, slots: torch.Tensor, prompts: list[torch.Tensor], seeds_R: torch.Tensor, features: bool = True):
        """Prompts (1-D id tensors) into slots `slots`, in one forward (right-padded; a padding
        token writes to the trash column and no real query sees it). Returns the first new token
        of each row [R] (chosen at position len(prompt)), and with taps the features [R, P', F]
        of every prompt position (right-padded to P' >= the longest prompt).

        On CUDA, a prefill of at most PREFILL_GRAPH_ROWS rows (a row bucket) is padded to its row
        and width buckets and runs as one step function, replayed from a graph per bucket once
        the cache's buffers exist (the first prefill allocates them): at batch 1 an eager forward
        of a small target costs its launches, many times a replay. Eager or captured, the same
        padded shapes, so the same numbers (Graphs.buckets_small_steps). Larger prefills
        (regeneration's refills), and every prefill on CPU, run eagerly at their own length."""
        R, P = len(prompts), max(len(p) for p in prompts)
        Rb = pick(R, self.rows)
        if self.graphs.buckets_small_steps and Rb <= PREFILL_GRAPH_ROWS and P <= self.widths[-1]:
            # Host values go to the device without a blocking copy (one would wait for every step
            # queued before this prefill: slots.SlotDecoder keeps a decode step in flight).
            lengths = to_device([len(p) for p in prompts], self.device)
            Pb = pick(P, self.widths)
            ids_RP = _padded_ids(prompts, Rb, Pb, self.device)
            last_R = torch.cat([lengths - 1, lengths.new_full((Rb - R,), -1)])
            pos_RP = torch.arange(Pb, device=self.device).expand(Rb, Pb)
            pos_RP = torch.where(pos_RP <= last_R[:, None], pos_RP, -1)  # padding: written to the trash column
            # Padding rows (no token: every position in the trash column) reuse the first slot.
            inputs = (ids_RP, pos_RP, torch.cat([slots, slots[:1].expand(Rb - R)]), last_R.clamp(min=0),
                      torch.cat([seeds_R, seeds_R.new_zeros(Rb - R)]))
            fn = self._prefill_fn(Pb)
            first, *feats = self.graphs.run(("prefill", Rb, Pb), fn, *inputs) if self.cache.keys else fn(*inputs)
            # Copied out: a graph's outputs are rewritten by its next replay, and by the replay of
            # a graph captured before it into the same pool.
            return first[:R].clone(), (feats[0][:R].clone() if feats and features else None)
        causal = not has_sliding_layers(self.model.config)
        first_R = self._eager_rows(slots, prompts, [0] * R, seeds_R, P, causal=causal)
        feats = self.taps.features() if self.taps is not None else None
        return first_R, (feats if features else None)

    def extend(self, slots: torch.Tensor, tails: list[torch.Tensor], starts: list[int], seeds_R: torch.Tensor):
        """Each row's `tails[i]` written after the `starts[i]` positions its slot already holds
        (a conversation's next turn, the keys of everything before it kept from its last turn), in
        one eager forward over the position mask of the columns up to the longest row's end.
        Returns the first new token of each row [R], chosen at its last position as a prefill of
        the whole prompt chooses it (same position, same seed)."""
        width = pick(max(a + len(t) for a, t in zip(starts, tails)), self.widths)
        first_R = self._eager_rows(slots, tails, starts, seeds_R, width, causal=False)
        if self.taps is not None:
            self.taps.outputs.clear()  # nothing reads a continuation's features
        return first_R

    def _eager_rows(self, slots, tails: list[torch.Tensor], starts: list[int], seeds_R, width: int, causal: bool):
        """One eager forward of rows into slots `slots`: each row's `tails[i]` at positions
        starts[i]..starts[i] + len - 1 (right-padded: a padding token writes to the trash column
        and no real query sees it), reading `width` columns (`causal`: a prefill from position 0,
        attended with no mask tensor). Returns each row's next token [R], chosen at the position
        after its last."""
        R, P = len(tails), max(len(t) for t in tails)
        # Host values go to the device without a blocking copy (one would wait for every step
        # queued before this forward: slots.SlotDecoder keeps a decode step in flight).
        sizes = [len(t) for t in tails]
        starts_R, lengths = to_device(starts, self.device), to_device(sizes, self.device)
        ids_RP = _padded_ids(tails, R, P, self.device)
        offset_RP = torch.arange(P, device=self.device).expand(R, P)
        pos_RP = torch.where(offset_RP < lengths[:, None], starts_R[:, None] + offset_RP, -1)
        # The lm_head only at the distinct last offsets: never [R, P, V] logits at once.
        keep = sorted(set(n - 1 for n in sizes))
        logits = self._forward(ids_RP, pos_RP, width, row_index=slots, logits_to_keep=to_device(keep, self.device),
                               causal=causal)
        at = {last: i for i, last in enumerate(keep)}
        pick_R = to_device([at[n - 1] for n in sizes], self.device)
        logits_RV = logits[torch.arange(R, device=self.device), pick_R][:, None]
        return choose(logits_RV, (starts_R + lengths)[:, None], seeds_R, self.temperature, self.top_p)[:, 0]

    def capture_prefill(self, rows: int, width: int) -> None:
        """Capture the prefill graph of `rows` rows (a row bucket) padded to `width` (a width
        bucket), ahead of its first use: a dummy one-token prompt in slots 0..rows-1, whose
        only writes are column 0 and the trash column (every prefill rewrites its own columns)."""
        zeros = torch.zeros(rows, dtype=torch.long, device=self.device)
        pos_RP = torch.full((rows, width), -1, dtype=torch.long, device=self.device)
        pos_RP[:, 0] = 0
        self.graphs.run(("prefill", rows, width), self._prefill_fn(width), torch.zeros_like(pos_RP), pos_RP,
                        torch.arange(rows, device=self.device), zeros, zeros)

    def _prefill_fn(self, width: int):
        """The captured prefill of `width` padded positions per row: each row's logits at its
        own last position only (logits_to_keep = the rows' last positions, [R, R, V] kept, the
        diagonal read: R <= PREFILL_GRAPH_ROWS)."""
        causal = not has_sliding_layers(self.model.config)

        def fn(ids_RP, pos_RP, slots_R, last_R, seeds_R):
            logits = self._forward(ids_RP, pos_RP, width, row_index=slots_R, logits_to_keep=last_R, causal=causal)
            rows = torch.arange(ids_RP.shape[0], device=ids_RP.device)
            first_R = choose(logits[rows, rows][:, None], (last_R + 1)[:, None], seeds_R, self.temperature,
                             self.top_p)[:, 0]
            feats = self.taps.features() if self.taps is not None else None
            return (first_R,) if feats is None else (first_R, feats)
        return fn

    def _width(self, max_pos: int) -> int | None:
        """A decode or verify step's width bucket, part of its graph key: None with varlen
        attention (each row reads its own keys, so one graph per row bucket serves every width)."""
        return None if self.varlen else pick(max_pos + 1, self.widths)

    def _decode_fn(self, width: int | None):
        def fn(token_R, pos_R, seeds_R):
            logits = self._forward(token_R[:, None], pos_R[:, None], width)
            if self.taps is not None:
                self.taps.outputs.clear()  # nothing reads a decode step's features
            return (choose(logits, pos_R[:, None] + 1, seeds_R, self.temperature, self.top_p)[:, 0],)
        return fn

    def decode(self, token_R, pos_R, seeds_R, max_pos: int) -> torch.Tensor:
        """One token per row: rows 0..R-1 of the cache (R padded up to its bucket with trash
        rows), each writing its token at column pos and choosing the token at pos + 1; `max_pos`
        (a host int) is the largest live position. Returns [R] tokens."""
        R = token_R.shape[0]
        Rb, W = pick(R, self.rows), self._width(max_pos)
        token_R, pos_R, seeds_R = _pad_rows(Rb, token_R, pos_R, seeds_R, pad_pos=-1)
        (out,) = self.graphs.run(("decode", Rb, W), self._decode_fn(W), token_R, pos_R, seeds_R)
        return out[:R]

    def verify_body(self, block_RB, pos_RB, seeds_R, width: int | None):
        """The verify step itself (no buckets, no graph): (chosen [R, B], acc [R], features
        [R, B, F] or None)."""
        logits = self._forward(block_RB, pos_RB, width)
        chosen_RB = choose(logits, pos_RB + 1, seeds_R, self.temperature, self.top_p)
        acc_R = accepted_run_length(block_RB[:, 1:] == chosen_RB[:, :-1])
        feats = self.taps.features() if self.taps is not None else None
        return chosen_RB, acc_R, feats

    def _verify_fn(self, width: int | None):
        def fn(block_RB, pos_RB, seeds_R):
            chosen_RB, acc_R, feats = self.verify_body(block_RB, pos_RB, seeds_R, width)
            return (chosen_RB, acc_R) + (() if feats is None else (feats,))
        return fn

    def verify(self, block_RB, pos_RB, seeds_R, max_pos: int):
        """The block [anchor, proposals...] of every row at its positions, in one forward:
        the target's token at every position [R, B], the accepted run of proposals [R]
        (loss.accepted_run_length's count) and the tapped features of the block [R, B, F]."""
        R = block_RB.shape[0]
        Rb, W = pick(R, self.rows), self._width(max_pos)
        block_RB, pos_RB, seeds_R = _pad_rows(Rb, block_RB, pos_RB, seeds_R, pad_pos=-1)
        chosen, acc, *feats = self.graphs.run(("verify", Rb, W), self._verify_fn(W), block_RB, pos_RB, seeds_R)
        return chosen[:R], acc[:R], (feats[0][:R] if feats else None)


def to_device(values, device) -> torch.Tensor:
    """Host ints (a list or a numpy array) as a long tensor on `device`, queued without waiting:
    a blocking copy to a CUDA device waits for everything queued before it (ATen copies, then
    synchronizes the stream), a decode step in flight included (slots.SlotDecoder keeps one)."""
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(device, non_blocking=True)


def _padded_ids(prompts: list[torch.Tensor], rows: int, width: int, device) -> torch.Tensor:
    """[rows, width] ids: the prompts right-padded with 0 (rows past the prompts all 0), put
    together where they are and moved to `device` in one copy."""
    home = prompts[0].device
    ids = torch.nn.utils.rnn.pad_sequence([p.reshape(-1).to(home) for p in prompts], batch_first=True)
    ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1], 0, rows - ids.shape[0]))
    return ids.to(dtype=torch.long).to(device=device, non_blocking=True)


def _pad_rows(rows: int, *tensors, pad_pos: int):
    """Pad per-row tensors up to `rows` rows: token ids 0, positions `pad_pos` (the trash
    column; -1 is mapped there), seeds 0. The second tensor is the positions."""
    R = tensors[0].shape[0]
    if R == rows:
        return tensors
    out = []
    for i, t in enumerate(tensors):
        pad = t.new_full((rows - R, *t.shape[1:]), pad_pos if i == 1 else 0)
        out.append(torch.cat([t, pad]))
    return out
