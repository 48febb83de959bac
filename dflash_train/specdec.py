"""Speculative decoding against the target, and the statistics of what was accepted.

Owns one generation by DFlash speculative decoding exactly as REFERENCE.md section 2 describes:
the target and the drafter each keep a KV cache; every cycle the drafter runs once on
[last committed token, MASK x (B-1)] with the context features it has not seen yet and proposes
B-1 tokens (argmax); the target verifies the whole block in one forward and chooses its own
token at every position; the longest prefix of proposals equal to the target's tokens is
accepted, plus the target's own next token; both caches are cropped to the committed length;
the verify pass's tapped features of the committed positions become the next context.

Also owns the target-only decoding it is checked and timed against (KV cache, one token per
forward), how the target chooses tokens (greedy, or sampling with per-position seeded noise,
shared by both decoders), the stop tokens of a tokenizer, and the acceptance statistics: tau
(mean of acceptance lengths over cycles), the paper's per-set tau (mean over turns of each
turn's mean) and the histogram of acceptance lengths 1..B. The acceptance count itself is
`loss.accepted_run_length`, the one function training metrics also use.

Sampling (T > 0) is lossless in distribution: the token committed at position p is always the
target's own sample at p, argmax(logits_p / T + G_p) with Gumbel noise G_p drawn from a
generator seeded by (seed, p), conditioned on the committed prefix; proposals only decide how
many of those samples one verify forward yields. Target-only sampling with the same seed draws
the same G_p, so both decoders produce the same tokens, not only the same distribution.

Batch size 1. Shape legend: S committed tokens, T new context tokens, F = n*H tapped features,
B block size, V vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

import torch
import torch.nn.functional as F

from dflash_train.loss import accepted_run_length
from dflash_train.target import LayerTaps

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio multiplier: (seed, position) -> distinct seeds


# --------------------------------------------------------------------------- token choice


def position_gumbel(seed: int, positions: Iterable[int], vocab: int, device) -> torch.Tensor:
    """Gumbel noise [len(positions), V]: each row from a generator seeded by (seed, position),
    so a position gets the same noise whichever forward (and whichever decoder) scores it."""
    gen = torch.Generator(device=device)
    rows = []
    for p in positions:
        gen.manual_seed((int(seed) * _SEED_MIX + int(p)) % (2**63))
        u = torch.rand(vocab, generator=gen, device=device, dtype=torch.float32)
        rows.append(-torch.log(-torch.log(u.clamp(min=1e-20, max=1.0 - 1e-7))))
    return torch.stack(rows)


def choose_tokens(logits_QV: torch.Tensor, positions: Sequence[int], temperature: float, seed: int) -> torch.Tensor:
    """The target's token for each row of logits; `positions` are the absolute positions of the
    tokens being chosen (logits at position q choose the token at q + 1). T = 0: argmax;
    T > 0: a sample of softmax(logits / T) by the Gumbel-max trick with per-position noise."""
    if temperature <= 0:
        return logits_QV.argmax(dim=-1)
    noise = position_gumbel(seed, positions, logits_QV.shape[-1], logits_QV.device)
    return (logits_QV.float() / temperature + noise).argmax(dim=-1)


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


# --------------------------------------------------------------------------- target plumbing


def new_cache(model):
    """An empty transformers DynamicCache for `model` that can be cropped back (sliding-window
    layers record their past so that a rejected block can be removed)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers cache. transformers 5 reads a
    positive argument of `crop` as the length to keep (deprecated) and a negative one as the
    number of positions to remove; we always pass the negative form."""
    remove = cache.get_seq_length() - int(length)
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if remove:
        cache.crop(-remove)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompt_tensor(prompt_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"one non-empty prompt at a time (batch size 1), got shape {tuple(ids.shape)}")
    return ids


# --------------------------------------------------------------------------- proposers


class Proposer(Protocol):
    """What speculative_generate asks for B-1 proposals. `reset` starts a new sequence;
    `propose` gets the committed ids [1, S] (the last one is the anchor at position S - 1) and
    the tapped target features of the committed positions it has not seen yet [1, T, F]
    (None when `target_layer_ids` is empty) and returns B-1 token ids."""

    block_size: int
    target_layer_ids: list[int]

    def reset(self) -> None: ...

    def propose(self, sequence_ids_1S: torch.Tensor, context_1TF: torch.Tensor | None) -> torch.Tensor: ...


class DFlashProposer:
    """The DFlash drafter as a proposer: one forward on [anchor, MASK...] with a DrafterCache
    holding the keys/values of all earlier context; the block's keys/values never stay."""

    def __init__(self, drafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        from dflash_train.drafter import DrafterCache

        self.drafter = drafter
        self.block_size = int(drafter.block_size)
        self.target_layer_ids = list(drafter.target_layer_ids)
        self.mask_token_id = int(drafter.mask_token_id)
        self.embed_weight, self.lm_head_weight = embed_weight, lm_head_weight
        self._new_cache = DrafterCache
        self.cache = DrafterCache()

    @classmethod
    def for_target(cls, drafter, model) -> "DFlashProposer":
        """Uses the target's frozen embedding and lm_head (tied or not)."""
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        return cls(drafter, embed, head.weight if head is not None else embed)

    def reset(self) -> None:
        self.cache = self._new_cache()

    def propose(self, sequence_ids_1S: torch.Tensor, context_1TF: torch.Tensor | None) -> torch.Tensor:
        anchor_pos = sequence_ids_1S.shape[1] - 1
        start = self.cache.get_seq_length()
        assert context_1TF is not None and start + context_1TF.shape[1] == anchor_pos, "context must reach the anchor"
        B = self.block_size
        dtype = next(self.drafter.parameters()).dtype
        block_1B = torch.full((1, B), self.mask_token_id, dtype=torch.long, device=sequence_ids_1S.device)
        block_1B[:, 0] = sequence_ids_1S[:, -1]
        noise_emb = F.embedding(block_1B, self.embed_weight).to(dtype)
        position_ids = torch.arange(start, anchor_pos + B, device=sequence_ids_1S.device)[None]
        hidden_1BH = self.drafter(context_1TF.to(dtype), noise_emb, position_ids,
                                  past_key_values=self.cache, use_cache=True)
        self.cache.crop(anchor_pos)  # keep the context; the block's keys/values must not stay
        logits = hidden_1BH[0, 1:].to(self.lm_head_weight.dtype) @ self.lm_head_weight.t()
        return logits.argmax(dim=-1)


# --------------------------------------------------------------------------- generation


@dataclass
class Generation:
    output_ids: list[int]
    """New tokens, ending with the stop token when one ended the response."""
    acceptance_lengths: list[int] = field(default_factory=list)
    """Per verify cycle, the tokens it committed: acc + 1, cut at a stop token or the budget.
    The first new token comes from the prefill, so len(output_ids) = 1 + sum(these)."""
    stopped: bool = False
    """Ended on a stop token (else on max_new_tokens)."""
    seconds: float = 0.0
    """Wall-clock time of the whole call, prefill included (CUDA synchronized)."""


@torch.inference_mode()
def target_generate(model, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
                    stop_ids: Iterable[int] = (), seed: int = 0) -> Generation:
    """Target-only decoding, one token per forward with a KV cache: the reference that
    speculative decoding must reproduce, and the baseline of the speedup."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = model.get_input_embeddings().weight.device
    ids_1P = _prompt_tensor(prompt_ids, device)
    stop, P = set(stop_ids), ids_1P.shape[1]
    _sync(device)
    started = time.perf_counter()
    cache = new_cache(model)
    logits = model(input_ids=ids_1P, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    out: list[int] = []
    while True:
        token_1 = choose_tokens(logits[0, -1:], [P + len(out)], temperature, seed)
        out.append(int(token_1[0]))  # host sync: the stop check, the one of each token
        if out[-1] in stop or len(out) >= max_new_tokens:
            break
        # The chosen token stays on the device as the next input: no host-to-device copy.
        logits = model(input_ids=token_1[None], past_key_values=cache, use_cache=True).logits
    _sync(device)
    return Generation(out, [], out[-1] in stop, time.perf_counter() - started)


@torch.inference_mode()
def speculative_generate(model, prompt_ids, proposer: Proposer, max_new_tokens: int, *,
                         temperature: float = 0.0, stop_ids: Iterable[int] = (), seed: int = 0) -> Generation:
    """Speculative decoding of one prompt (REFERENCE.md section 2) with `proposer` (usually a
    DFlashProposer) against the HF causal LM `model`. At T = 0 the output is token for token
    the target-only greedy output; at T > 0 it is target_generate's sample with the same seed."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = model.get_input_embeddings().weight.device
    prompt_1P = _prompt_tensor(prompt_ids, device)
    stop, P, B = set(stop_ids), prompt_1P.shape[1], int(proposer.block_size)
    out: list[int] = []
    lengths: list[int] = []
    _sync(device)
    started = time.perf_counter()
    # Committed ids, written on the device as cycles commit them (the proposer sees a view).
    seq_1S = torch.empty(1, P + max_new_tokens + B, dtype=torch.long, device=device)
    seq_1S[:, :P] = prompt_1P
    with LayerTaps(model, proposer.target_layer_ids) as taps:
        cache = new_cache(model)
        logits = model(input_ids=prompt_1P, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        context_1TF = taps.features()  # every prompt position: the first cycle's context
        token_1 = choose_tokens(logits[0, -1:], [P], temperature, seed)
        seq_1S[0, P:P + 1] = token_1
        out.append(int(token_1[0]))  # host sync: the first token's stop check
        proposer.reset()
        while out[-1] not in stop and len(out) < max_new_tokens:
            s = P + len(out) - 1  # position of the anchor (the last committed token)
            proposals = proposer.propose(seq_1S[:, : s + 1], context_1TF).to(device=device, dtype=torch.long)
            block_1B = torch.cat([seq_1S[:, s : s + 1], proposals[None]], dim=1)
            logits = model(input_ids=block_1B, past_key_values=cache, use_cache=True).logits
            chosen_B = choose_tokens(logits[0], range(s + 1, s + B + 1), temperature, seed)
            acc_1 = accepted_run_length(proposals == chosen_B[:-1]).reshape(1)
            # The cycle's one host sync: its acceptance count and the target's tokens together.
            acc, *chosen = torch.cat([acc_1, chosen_B.to(torch.long)]).tolist()
            committed = chosen[: acc + 1]  # accepted proposals == target tokens, + bonus
            keep = next((i + 1 for i, t in enumerate(committed) if t in stop), len(committed))
            keep = min(keep, max_new_tokens - len(out))
            out.extend(committed[:keep])
            lengths.append(keep)
            # Positions s .. s+acc hold committed tokens; the bonus token is the next anchor.
            crop_cache(cache, s + acc + 1)
            features = taps.features()
            context_1TF = None if features is None else features[:, : acc + 1]
            seq_1S[0, s + 1 : s + acc + 2] = chosen_B[: acc + 1]
    _sync(device)
    return Generation(out, lengths, out[-1] in stop, time.perf_counter() - started)


# --------------------------------------------------------------------------- statistics


def mean_acceptance(lengths: Iterable[int]) -> float:
    """tau over cycles: the mean acceptance length (nan when there was no cycle)."""
    lengths = list(lengths)
    return sum(lengths) / len(lengths) if lengths else float("nan")


def turn_mean_tau(turns: Iterable[Sequence[int]]) -> float:
    """tau of a prompt set as the paper reports it: the mean over turns of each turn's mean
    acceptance length (turns without a cycle, answered by the prefill alone, are left out)."""
    means = [mean_acceptance(t) for t in turns if len(t)]
    return sum(means) / len(means) if means else float("nan")


def acceptance_histogram(lengths: Iterable[int], block_size: int) -> list[int]:
    """Counts of acceptance lengths 1..block_size (index 0 counts length 1)."""
    hist = [0] * block_size
    for n in lengths:
        if not 1 <= n <= block_size:
            raise ValueError(f"acceptance length {n} outside [1, {block_size}]")
        hist[n - 1] += 1
    return hist
