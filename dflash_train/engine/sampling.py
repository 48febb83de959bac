"""How the target chooses its token at a position: greedy, or sampled reproducibly; and which
tokens end its response.

Owns `choose`, the one definition of the target's token choice that speculative decoding,
target-only decoding and regeneration share (`choose_tokens`: the same for one sequence), and
`stop_token_ids`, the ids that end a response for a tokenizer. Sampling (temperature, top-p)
is the Gumbel-max trick with noise hashed from (row seed, position, token) (`position_gumbel`):
the same position gets the same noise whichever forward scores it, at whatever batch size and
in whichever decoder, so speculative and target-only decoding commit the same tokens and a
seeded run is reproducible. The hash is integer arithmetic on tensors (no generator state, no
host work), so it runs inside a captured CUDA graph.

Shape legend: R rows, Q positions per row, V vocabulary.
"""

from __future__ import annotations

from typing import Sequence

import torch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32, in int64 without overflow (16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (xor-shift-multiply, two rounds)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_hash(seeds_R: torch.Tensor, positions_RQ: torch.Tensor) -> torch.Tensor:
    seeds = seeds_R.to(torch.int64)
    s = _mix32((seeds & _M32) ^ _mix32(((seeds >> 32) & _M32) ^ 0x68E31DA4))
    return _mix32(s[:, None] ^ _mix32(positions_RQ.to(torch.int64) & _M32))


def _to_uniform(x: torch.Tensor) -> torch.Tensor:
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # 24 bits: exact in float32, in (0, 1)


def position_uniform(seeds_R: torch.Tensor, positions_RQ: torch.Tensor) -> torch.Tensor:
    """[R, Q] float32 in (0, 1): a function of (seed of row r, position) alone."""
    return _to_uniform(_row_hash(seeds_R, positions_RQ))


GUMBEL_CHUNK = 1 << 24  # noise elements made at once (int64 temporaries of that many)


def position_gumbel(seeds_R: torch.Tensor, positions_RQ: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, Q, V] float32 Gumbel noise: element (r, q, v) a function of (seed of row r, position
    q, token v) alone, so a position gets the same noise whichever forward, decoder and batch
    scores it."""
    R, Q = positions_RQ.shape
    token_V = _mix32(torch.arange(vocab, device=positions_RQ.device, dtype=torch.int64) * 0x9E3779B1 & _M32)
    h_RQ = _row_hash(seeds_R, positions_RQ)
    rows = max(1, GUMBEL_CHUNK // max(1, Q * vocab))
    parts = []
    for a in range(0, R, rows):
        u = _to_uniform(_mix32(h_RQ[a : a + rows, :, None] ^ token_V))
        parts.append(-torch.log(-torch.log(u)))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def choose(logits_RQV: torch.Tensor, positions_RQ: torch.Tensor, seeds_R: torch.Tensor,
           temperature: float = 0.0, top_p: float = 1.0) -> torch.Tensor:
    """The target's token [R, Q] from its logits; `positions_RQ` are the absolute positions of
    the tokens being chosen (logits at position q choose the token at q + 1). T = 0: argmax.
    T > 0: a sample of softmax(logits / T), restricted when top_p < 1 to the smallest set of
    most likely tokens whose mass reaches top_p, by the Gumbel-max trick with
    `position_gumbel(seed, position)` noise. (The argmax of perturbed scores moves only when
    two of them nearly tie, so the rounding of differently batched forwards almost never
    changes a sample; inverting a float32 cumulative sum over a large vocabulary would.)"""
    if temperature <= 0:
        return logits_RQV.argmax(dim=-1)
    scores = logits_RQV.float() / temperature
    if top_p < 1.0:
        probs, order = torch.softmax(scores, dim=-1).sort(dim=-1, descending=True)
        outside = (probs.cumsum(dim=-1) - probs) >= top_p  # the most likely token always stays
        scores = scores.masked_fill(torch.zeros_like(outside).scatter_(-1, order, outside), float("-inf"))
    return (scores + position_gumbel(seeds_R, positions_RQ, scores.shape[-1])).argmax(dim=-1)


def choose_tokens(logits_QV: torch.Tensor, positions: Sequence[int], temperature: float, seed: int,
                  top_p: float = 1.0) -> torch.Tensor:
    """`choose` for the logits [Q, V] of one sequence whose tokens are chosen at
    `positions` (logits at position q choose the token at q + 1), with one seed."""
    pos = torch.as_tensor(list(positions), dtype=torch.long, device=logits_QV.device)[None]
    seeds = torch.tensor([int(seed)], device=logits_QV.device)
    return choose(logits_QV[None], pos, seeds, temperature, top_p)[0]


# --------------------------------------------------------------------------- stop tokens


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """Ids that end a response: the tokenizer's and the generation config's eos, and the
    special token the chat template writes right after an assistant turn (e.g. <|im_end|>)."""
    ids = set()
    for eos in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if getattr(tokenizer, "chat_template", None):
        probe = "dflash-probe-answer"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}], tokenize=False
        )
        after = text[text.rfind(probe) + len(probe):]
        follow = tokenizer(after, add_special_tokens=False)["input_ids"]
        specials = set(getattr(tokenizer, "all_special_ids", []) or [])
        specials |= {int(i) for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items() if t.special}
        if follow and follow[0] in specials:
            ids.add(int(follow[0]))
    return sorted(int(i) for i in ids)
