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

Batched decoding (`speculative_generate_batch`, `target_generate_batch`) runs R prompts per
forward with the same per-row semantics, acceptance counts and tokens as the batch-1 functions
(evaluation's `--batch-size`, where one forward's fixed host cost then serves R rows). Both
models keep a `RowCache`: one key/value buffer whose column c holds position c of every row, so
rows advance by their own acceptance each cycle with no padding between their tokens; a rejected
block's keys lie past the row's committed length, hidden by the mask, until the row's next block
overwrites them. Masks are built from positions (a key at position k is visible to a query at q
when k <= q, and q - k < W in a sliding-window layer), so they need no bookkeeping of holes.

Shape legend: R rows, S committed tokens, T new context tokens, F = n*H tapped features,
B block size, V vocabulary, W key columns read by a forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

import torch
import torch.nn.functional as F

from dflash_train.drafter import FULL_ATTENTION, SLIDING_ATTENTION
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


def choose_row_tokens(logits_RQV: torch.Tensor, first_positions: Sequence[int], temperature: float,
                      seeds: Sequence[int]) -> torch.Tensor:
    """choose_tokens for R rows at once [R, Q]: row i's logits choose the tokens at positions
    first_positions[i] .. + Q - 1 with row i's seed, so each row gets exactly the tokens that
    batch-1 decoding of that row would get from the same logits."""
    if temperature <= 0:
        return logits_RQV.argmax(dim=-1)
    Q = logits_RQV.shape[1]
    return torch.stack([choose_tokens(logits_RQV[i], range(p, p + Q), temperature, seeds[i])
                        for i, p in enumerate(first_positions)])


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
    """An empty transformers DynamicCache for `model` (cropped back after a rejected block)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def has_sliding_layers(config) -> bool:
    """Whether a target config slides a window in any layer (as `target_masks` reads it).
    With such layers, transformers 5.17's DynamicCache neither crops back reliably nor gives
    our batch-1 loops greedy output equal to `generate`'s, so both batch-1 decoders run them
    through the RowCache path as one row."""
    types = set(getattr(config, "layer_types", None) or [])
    return SLIDING_ATTENTION in types or (not types and getattr(config, "sliding_window", None) is not None)


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers cache. transformers 5 reads a
    positive argument of `crop` as the length to keep (deprecated) and a negative one as the
    number of positions to remove; we always pass the negative form."""
    remove = cache.get_seq_length() - int(length)
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if remove:
        cache.crop(-remove)


def _grow_columns(t_RHCD: torch.Tensor, capacity: int) -> torch.Tensor:
    R, H, C, D = t_RHCD.shape
    return torch.cat([t_RHCD, t_RHCD.new_zeros(R, H, capacity - C, D)], dim=2)


class RowCache:
    """Keys/values of R sequences in one buffer per layer, [R, Hkv, C, Dh], where column c holds
    position c of every row (rows of different lengths need no padding between their tokens).

    Before each forward, `prepare(columns_RQ, width)` names the column that each input token is
    written to (its position; a padding token's column is `width`, which no forward of this
    call reads) and how many columns the forward reads; `update` writes the new keys/values
    there and returns the first `width` columns. The caller's position masks say which of them
    a query sees. Rejected draft positions need no crop: they lie past the row's committed
    length, masked, until the row's next block overwrites them. Same `update(k, v, layer_idx)`
    surface as transformers' caches: the HF target and the drafter both take it as
    `past_key_values`."""

    def __init__(self, capacity: int = 0) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = int(capacity)
        self.columns_RQ: torch.Tensor | None = None
        self.width = 0

    def prepare(self, columns_RQ: torch.Tensor, width: int) -> None:
        self.columns_RQ, self.width = columns_RQ, int(width)
        if self.width + 1 > self.capacity:  # column `width` takes the padding writes
            self.capacity = max(self.width + 1, 2 * self.capacity)
            self.keys = [_grow_columns(k, self.capacity) for k in self.keys]
            self.values = [_grow_columns(v, self.capacity) for v in self.values]

    def update(self, k_RHQD: torch.Tensor, v_RHQD: torch.Tensor, layer_idx: int, *args, **kwargs):
        R, H, Q, D = k_RHQD.shape
        if layer_idx == len(self.keys):
            self.keys.append(k_RHQD.new_zeros(R, H, self.capacity, D))
            self.values.append(v_RHQD.new_zeros(R, H, self.capacity, D))
        index = self.columns_RQ[:, None, :, None].expand(R, H, Q, D)
        self.keys[layer_idx].scatter_(2, index, k_RHQD)
        self.values[layer_idx].scatter_(2, index, v_RHQD)
        return self.keys[layer_idx][:, :, : self.width], self.values[layer_idx][:, :, : self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    def keep_rows(self, index_R: torch.Tensor) -> None:
        """Keep these rows, in this order (finished rows leave the batch)."""
        self.keys = [k.index_select(0, index_R) for k in self.keys]
        self.values = [v.index_select(0, index_R) for v in self.values]


def causal_position_mask(query_pos_RQ: torch.Tensor, width: int, window: int | None = None) -> torch.Tensor:
    """[R, 1, Q, W] bool: the key at column (= position) k is visible to the query at position q
    when k <= q, and q - k < window for a sliding-window layer (transformers' convention)."""
    key_W = torch.arange(width, device=query_pos_RQ.device)
    q = query_pos_RQ[:, None, :, None]
    visible = key_W <= q
    return visible & (q - key_W < window) if window else visible


def target_masks(config, query_pos_RQ: torch.Tensor, width: int):
    """The target's attention mask for a RowCache forward, as transformers takes a prepared
    4-D mask (as given): one tensor, or a dict by layer type for models that mix full and
    sliding-window layers (Qwen2/3, ...); a config with a window and no layer types slides in
    every layer (Mistral)."""
    window = getattr(config, "sliding_window", None) if has_sliding_layers(config) else None
    if window is not None and getattr(config, "layer_types", None):
        return {FULL_ATTENTION: causal_position_mask(query_pos_RQ, width),
                SLIDING_ATTENTION: causal_position_mask(query_pos_RQ, width, window)}
    return causal_position_mask(query_pos_RQ, width, window)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_prompt(model, prompt_ids) -> torch.Tensor:
    """A batch-1 prompt, checked as batch-1 decoding checks it, as one row for the batched path."""
    return _prompt_tensor(prompt_ids, model.get_input_embeddings().weight.device)[0]


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


class BatchProposer(Proposer, Protocol):
    """What speculative_generate_batch asks for proposals of R rows. `reset` starts R new
    sequences; `propose_batch` gets the committed ids [R, S] (row i's ids up to its anchor at
    position anchor_R[i]; what lies past it is undefined), the tapped features of each row's
    committed positions not seen yet [R, T, F], right-padded: row i's first context_len_R[i]
    entries are positions anchor_R[i] - context_len_R[i] .. anchor_R[i] - 1 (None when
    `target_layer_ids` is empty), and max(anchor_R) as a host int; it returns [R, B-1] ids.
    `keep_rows(index_R)`: later calls see only these rows of the earlier ones, in this order."""

    def propose_batch(self, sequence_ids_RS: torch.Tensor, anchor_R: torch.Tensor, context_RTF: torch.Tensor | None,
                      context_len_R: torch.Tensor, max_anchor: int) -> torch.Tensor: ...

    def keep_rows(self, index_R: torch.Tensor) -> None: ...


class DFlashProposer:
    """The DFlash drafter as a proposer: one forward on [anchor, MASK...] with a DrafterCache
    holding the keys/values of all earlier context; the block's keys/values never stay.
    `propose_batch` does the same for R rows in one forward, on a RowCache whose column p holds
    each row's context position p; a row's block attends to columns < anchor + B (sliding
    layers: causal and within the window), so the block's keys, written at its own positions,
    are overwritten by the next cycle's context before anything can see them again."""

    def __init__(self, drafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        from dflash_train.drafter import DrafterCache

        self.drafter = drafter
        self.block_size = int(drafter.block_size)
        self.target_layer_ids = list(drafter.target_layer_ids)
        self.mask_token_id = int(drafter.mask_token_id)
        self.embed_weight, self.lm_head_weight = embed_weight, lm_head_weight
        self._new_cache = DrafterCache
        self.cache = DrafterCache()
        self.row_cache: RowCache | None = None

    @classmethod
    def for_target(cls, drafter, model) -> "DFlashProposer":
        """Uses the target's frozen embedding and lm_head (tied or not)."""
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        return cls(drafter, embed, head.weight if head is not None else embed)

    def reset(self) -> None:
        self.cache = self._new_cache()
        self.row_cache = None

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

    def propose_batch(self, sequence_ids_RS: torch.Tensor, anchor_R: torch.Tensor, context_RTF: torch.Tensor | None,
                      context_len_R: torch.Tensor, max_anchor: int) -> torch.Tensor:
        assert context_RTF is not None, "the DFlash drafter needs the target's features"
        B, device = self.block_size, sequence_ids_RS.device
        R, T = context_RTF.shape[:2]
        width = int(max_anchor) + B  # every row's context and block lie in these columns
        if self.row_cache is None:
            self.row_cache = RowCache()
        j_T, k_B = torch.arange(T, device=device), torch.arange(B, device=device)
        ctx_pos_RT = anchor_R[:, None] - context_len_R[:, None] + j_T
        ctx_pos_RT = torch.where(j_T < context_len_R[:, None], ctx_pos_RT, width)  # padding -> unread column
        position_ids = torch.cat([ctx_pos_RT, anchor_R[:, None] + k_B], dim=1)  # also the columns written
        self.row_cache.prepare(position_ids, width)
        block_RB = torch.full((R, B), self.mask_token_id, dtype=torch.long, device=device)
        block_RB[:, 0] = sequence_ids_RS.gather(1, anchor_R[:, None])[:, 0]
        dtype = next(self.drafter.parameters()).dtype
        noise_emb = F.embedding(block_RB, self.embed_weight).to(dtype)
        key_W = torch.arange(width, device=device)
        masks = {FULL_ATTENTION: (key_W < (anchor_R + B)[:, None])[:, None, None, :]}  # context + whole block
        window = getattr(self.drafter.config, "sliding_window", None)
        if window:
            masks[SLIDING_ATTENTION] = causal_position_mask(anchor_R[:, None] + k_B, width, window)
        hidden_RBH = self.drafter(context_RTF.to(dtype), noise_emb, position_ids, attention_mask=masks,
                                  past_key_values=self.row_cache, use_cache=True)
        logits = hidden_RBH[:, 1:].to(self.lm_head_weight.dtype) @ self.lm_head_weight.t()
        return logits.argmax(dim=-1)

    def keep_rows(self, index_R: torch.Tensor) -> None:
        if self.row_cache is not None:
            self.row_cache.keep_rows(index_R)


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
    """Wall-clock time of the whole call, prefill included (CUDA synchronized); from a batched
    call, the whole batch's time (the same for every row)."""


@torch.inference_mode()
def target_generate(model, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
                    stop_ids: Iterable[int] = (), seed: int = 0) -> Generation:
    """Target-only decoding, one token per forward with a KV cache: the reference that
    speculative decoding must reproduce, and the baseline of the speedup. A target with
    sliding-window layers is decoded by `target_generate_batch` as one row."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if has_sliding_layers(model.config):
        return target_generate_batch(model, [_one_prompt(model, prompt_ids)], max_new_tokens,
                                     temperature=temperature, stop_ids=stop_ids, seed=seed)[0]
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
    the target-only greedy output; at T > 0 it is target_generate's sample with the same seed.
    A target with sliding-window layers is decoded by `speculative_generate_batch` as one row."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if has_sliding_layers(model.config):
        return speculative_generate_batch(model, [_one_prompt(model, prompt_ids)], proposer, max_new_tokens,
                                          temperature=temperature, stop_ids=stop_ids, seed=seed)[0]
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


# --------------------------------------------------------------------------- batched generation


def _prompt_rows(prompts, device) -> tuple[torch.Tensor, list[int]]:
    """Prompts right-padded into [R, P] (column = position) and their lengths."""
    rows = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
    lengths = [len(r) for r in rows]
    if min(lengths) == 0:
        raise ValueError(f"prompt {lengths.index(0)} is empty")
    ids_RP = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    for i, r in enumerate(rows):
        ids_RP[i, : len(r)] = r
    return ids_RP.to(device), lengths


def _row_seeds(seed: int | Sequence[int], num_rows: int) -> list[int]:
    seeds = [int(seed)] * num_rows if isinstance(seed, int) else [int(x) for x in seed]
    if len(seeds) != num_rows:
        raise ValueError(f"{len(seeds)} seeds for {num_rows} prompts")
    return seeds


def _check_budget(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def _start_rows(model, prompts, max_new_tokens: int, seed: int | Sequence[int]):
    """What both batched decoders start from: the target's device, the right-padded prompts
    [R, P] and their lengths, and one seed per row (arguments checked first)."""
    _check_budget(max_new_tokens)
    device = model.get_input_embeddings().weight.device
    ids_RP, lengths = _prompt_rows(prompts, device)
    return device, ids_RP, lengths, _row_seeds(seed, len(lengths))


def _prefill_rows(model, ids_RP: torch.Tensor, lengths: list[int], cache: RowCache) -> torch.Tensor:
    """All prompts in one forward; the logits [R, V] at each row's last prompt position.
    Right padding with a causal mask: no real token sees padding, and a padding key at
    column c is overwritten by the row's own token of position c before any query of the row
    can see column c."""
    R, P = ids_RP.shape
    pos_RP = torch.arange(P, device=ids_RP.device).expand(R, P)
    cache.prepare(pos_RP, P)
    last = sorted({n - 1 for n in lengths})
    logits_RKV = model(input_ids=ids_RP, position_ids=pos_RP, attention_mask=target_masks(model.config, pos_RP[:1], P),
                       past_key_values=cache, use_cache=True,
                       logits_to_keep=torch.tensor(last, device=ids_RP.device)).logits
    pick_R = torch.tensor([last.index(n - 1) for n in lengths], device=ids_RP.device)
    return logits_RKV[torch.arange(R, device=ids_RP.device), pick_R]


def _live_rows(rows: list[int], outs: list[list[int]], stop: set[int], max_new_tokens: int) -> list[int]:
    return [i for i, r in enumerate(rows) if outs[r][-1] not in stop and len(outs[r]) < max_new_tokens]


def _keep_live(live: list[int], rows: list[int], caches, *tensors_R):
    """Drop the finished rows: keep the batch indices `live` in every cache (`keep_rows`) and
    every per-row tensor (None stays None); returns the live rows' prompt indices and tensors."""
    index = torch.tensor(live, device=next(t for t in tensors_R if t is not None).device)
    for cache in caches:
        cache.keep_rows(index)
    return [rows[i] for i in live], *(None if t is None else t.index_select(0, index) for t in tensors_R)


@torch.inference_mode()
def target_generate_batch(model, prompts, max_new_tokens: int, *, temperature: float = 0.0,
                          stop_ids: Iterable[int] = (), seed: int | Sequence[int] = 0) -> list[Generation]:
    """target_generate for R prompts at once (one token per row per forward, on a RowCache):
    each row's output is the one target_generate gives it (up to the rounding of batched
    forwards); `seed` is one seed for all rows or one per row. A finished row leaves the
    batch; `seconds` is the whole batch's."""
    if not len(prompts):
        _check_budget(max_new_tokens)
        return []
    device, ids_RP, lengths, seeds = _start_rows(model, prompts, max_new_tokens, seed)
    stop = set(stop_ids)
    outs: list[list[int]] = [[] for _ in lengths]
    _sync(device)
    started = time.perf_counter()
    cache = RowCache(ids_RP.shape[1] + max_new_tokens + 1)
    logits_RV = _prefill_rows(model, ids_RP, lengths, cache)
    pos_R = torch.tensor(lengths, device=device)  # position of each row's next token
    rows = list(range(len(lengths)))  # the prompt of each live row
    while True:
        token_R = choose_row_tokens(logits_RV[:, None], [lengths[r] + len(outs[r]) for r in rows], temperature,
                                    [seeds[r] for r in rows])[:, 0]
        for r, t in zip(rows, token_R.tolist()):  # host sync: the stop checks, the one of each step
            outs[r].append(t)
        live = _live_rows(rows, outs, stop, max_new_tokens)
        if not live:
            break
        if len(live) < len(rows):
            rows, token_R, pos_R = _keep_live(live, rows, [cache], token_R, pos_R)
        width = max(lengths[r] + len(outs[r]) for r in rows)
        cache.prepare(pos_R[:, None], width)
        logits_RV = model(input_ids=token_R[:, None], position_ids=pos_R[:, None],
                          attention_mask=target_masks(model.config, pos_R[:, None], width),
                          past_key_values=cache, use_cache=True).logits[:, -1]
        pos_R = pos_R + 1
    _sync(device)
    seconds = time.perf_counter() - started
    return [Generation(out, [], out[-1] in stop, seconds) for out in outs]


@torch.inference_mode()
def speculative_generate_batch(model, prompts, proposer: BatchProposer, max_new_tokens: int, *,
                               temperature: float = 0.0, stop_ids: Iterable[int] = (),
                               seed: int | Sequence[int] = 0) -> list[Generation]:
    """speculative_generate for R prompts at once: one drafter forward and one verify forward
    per cycle for every live row, each row with its own anchor, acceptance and positions (see
    RowCache). Row by row the same tokens, acceptance lengths and stops as batch-1 decoding
    (up to the rounding of batched forwards: exact in float32 on CPU in the tests); `seed` is
    one seed for all rows or one per row. A finished row leaves the batch (both caches drop
    it); `seconds` is the whole batch's."""
    if not len(prompts):
        _check_budget(max_new_tokens)
        return []
    device, ids_RP, lengths, seeds = _start_rows(model, prompts, max_new_tokens, seed)
    R, P, B = len(lengths), ids_RP.shape[1], int(proposer.block_size)
    stop = set(stop_ids)
    outs: list[list[int]] = [[] for _ in range(R)]
    accepted: list[list[int]] = [[] for _ in range(R)]
    _sync(device)
    started = time.perf_counter()
    # Committed ids by position, written on the device as cycles commit them.
    seq_RS = torch.zeros(R, P + max_new_tokens + B, dtype=torch.long, device=device)
    seq_RS[:, :P] = ids_RP
    k_B = torch.arange(B, device=device)
    with LayerTaps(model, proposer.target_layer_ids) as taps:
        cache = RowCache(P + max_new_tokens + B + 1)
        logits_RV = _prefill_rows(model, ids_RP, lengths, cache)
        context_RTF = taps.features()  # every prompt position (right-padded): the first context
        anchor_R = torch.tensor(lengths, device=device)
        context_len_R = anchor_R.clone()
        token_R = choose_row_tokens(logits_RV[:, None], lengths, temperature, seeds)
        seq_RS.scatter_(1, anchor_R[:, None], token_R)
        for r, t in enumerate(token_R[:, 0].tolist()):  # host sync: the first tokens' stop checks
            outs[r].append(t)
        rows = list(range(R))  # the prompt of each live row
        proposer.reset()
        while True:
            live = _live_rows(rows, outs, stop, max_new_tokens)
            if not live:
                break
            if len(live) < len(rows):
                rows, seq_RS, anchor_R, context_len_R, context_RTF = _keep_live(
                    live, rows, [cache, proposer], seq_RS, anchor_R, context_len_R, context_RTF)
            anchors = [lengths[r] + len(outs[r]) - 1 for r in rows]  # each row's last committed token
            proposals_RK = proposer.propose_batch(seq_RS, anchor_R, context_RTF, context_len_R, max(anchors))
            proposals_RK = proposals_RK.to(device=device, dtype=torch.long)
            pos_RB = anchor_R[:, None] + k_B
            block_RB = torch.cat([seq_RS.gather(1, anchor_R[:, None]), proposals_RK], dim=1)
            width = max(anchors) + B
            cache.prepare(pos_RB, width)
            mask = target_masks(model.config, pos_RB, width)
            logits = model(input_ids=block_RB, position_ids=pos_RB, attention_mask=mask, past_key_values=cache,
                           use_cache=True).logits
            chosen_RB = choose_row_tokens(logits, [a + 1 for a in anchors], temperature, [seeds[r] for r in rows])
            acc_R = accepted_run_length(proposals_RK == chosen_RB[:, :-1])
            # The cycle's one host sync: every row's acceptance count and the target's tokens.
            host = torch.cat([acc_R[:, None], chosen_RB], dim=1).tolist()
            for r, (acc, *chosen) in zip(rows, host):
                committed = chosen[: acc + 1]  # accepted proposals == target tokens, + bonus
                keep = next((i + 1 for i, t in enumerate(committed) if t in stop), len(committed))
                keep = min(keep, max_new_tokens - len(outs[r]))
                outs[r].extend(committed[:keep])
                accepted[r].append(keep)
            # Positions anchor .. anchor+acc of each row are committed; their features are the
            # next context. Tokens written past that are overwritten before they are read.
            features = taps.features()
            context_RTF = None if features is None else features[:, : max(h[0] for h in host) + 1]
            context_len_R = acc_R + 1
            seq_RS.scatter_(1, pos_RB + 1, chosen_RB)
            anchor_R = anchor_R + context_len_R
    _sync(device)
    seconds = time.perf_counter() - started
    return [Generation(outs[r], accepted[r], outs[r][-1] in stop, seconds) for r in range(R)]


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
