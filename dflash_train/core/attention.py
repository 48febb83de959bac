"""The decoding engine's attention: the position rule and the attention functions the engine
registers with transformers and switches on inside its own forwards (decode.py's TargetSteps).

- Position masks (`causal_position_mask`, `target_masks`): a key at column k is visible to the
  query at position q when k <= q (and q - k < W in a sliding-window layer), as the engine's
  position-addressed caches lay keys out (column = position).
- `grouped_attention`: the masked steps, one SDPA call per layer over the width bucket with the
  query heads of a key/value head laid along the query axis (no K/V copies).
- `causal_attention`: a prefill of right-padded rows, SDPA's causal kernels with no mask tensor.
- `varlen_attention` (with the per-forward `KeyCounts`): decode and verify steps on a CUDA GPU in
  half precision, each row reading only its own keys through FlashAttention's variable-length
  kernel, on the cache as it lies; on CPU or in float32 its reference (the position mask over
  every column).

Shape legend: R rows, Q queries per row, C cache columns, W columns a forward reads, G query
heads per key/value head, D head size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from dflash_train.core.drafter import FULL_ATTENTION, SLIDING_ATTENTION

# --------------------------------------------------------------------------- masks


def attention_heads(config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head size) of a target config (its text config for a
    multimodal one), with transformers' defaults: key/value heads = query heads, head size =
    hidden size / query heads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    return heads, kv_heads, int(getattr(text, "head_dim", None) or text.hidden_size // heads)


def has_sliding_layers(config) -> bool:
    """Whether a target config slides a window in any layer (as `target_masks` reads it)."""
    types = set(getattr(config, "layer_types", None) or [])
    return SLIDING_ATTENTION in types or (not types and getattr(config, "sliding_window", None) is not None)


def causal_position_mask(query_pos_RQ: torch.Tensor, width: int, window: int | None = None) -> torch.Tensor:
    """[R, 1, Q, W] bool: the key at column (= position) k is visible to the query at position q
    when k <= q, and q - k < window for a sliding-window layer (transformers' convention)."""
    key_W = torch.arange(width, device=query_pos_RQ.device)
    q = query_pos_RQ[:, None, :, None]
    visible = key_W <= q
    return visible & (q - key_W < window) if window else visible


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the one attention adds to its scores: 0 where visible, -inf elsewhere, in
    the queries' dtype. What scaled_dot_product_attention makes of a bool mask itself, in about
    four kernels on every call: made once, a forward's layers share it."""
    return torch.where(visible, 0.0, float("-inf")).to(dtype)


def target_masks(config, query_pos_RQ: torch.Tensor, width: int):
    """The target's attention mask for a StaticCache forward, as transformers takes a prepared
    4-D mask (as given): one tensor, or a dict by layer type for models that mix full and
    sliding-window layers (Qwen2/3, ...); a config with a window and no layer types slides in
    every layer (Mistral)."""
    window = getattr(config, "sliding_window", None) if has_sliding_layers(config) else None
    if window is not None and getattr(config, "layer_types", None):
        return {FULL_ATTENTION: causal_position_mask(query_pos_RQ, width),
                SLIDING_ATTENTION: causal_position_mask(query_pos_RQ, width, window)}
    return causal_position_mask(query_pos_RQ, width, window)


# --------------------------------------------------------------------------- attention

GROUPED_ATTENTION = "dflash_grouped_sdpa"


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The target's attention on the engine's steps, registered with transformers as
    GROUPED_ATTENTION: one SDPA call per layer with the boolean position mask, the G query heads
    that share a key/value head laid along the query axis, so every cached key and value is read
    once. (transformers' own sdpa path copies K and V G times whenever a mask is given; on a
    batched decode step that copy is most of the step's memory traffic.) Query head h uses
    key/value head h // G, as transformers' `repeat_kv` pairs them. Softcapped or sink-biased
    attention is left to transformers' sdpa function."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    R, Hq, Q, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    q = query.reshape(R, Hkv, G * Q, D)
    mask = attention_mask
    if mask is not None and G > 1:
        M, W = mask.shape[1], mask.shape[-1]
        mask = mask[:, :, None].expand(R, M, G, Q, W).reshape(R, M, G * Q, W)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(R, Hq, Q, D).transpose(1, 2), None


CAUSAL_ATTENTION = "dflash_causal_sdpa"


def causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The prefill's attention, registered as CAUSAL_ATTENTION: queries and keys are the same
    right-padded positions 0..P-1 of each row, so plain causal attention is the position mask
    (a real token never reaches padding, which lies after it), computed by SDPA's causal kernels
    with grouped heads and no mask tensor ([R, 1, P, P] masks cost more than the attention)."""
    enable_gqa = key.shape[1] != query.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                           enable_gqa=enable_gqa)
    return out.transpose(1, 2), None


VARLEN_ATTENTION = "dflash_varlen"


@dataclass(frozen=True)
class KeyCounts:
    """What VARLEN_ATTENTION needs of one forward, computed once for all its layers: row r's Q
    queries sit at positions last_R[r] - Q + 1 .. last_R[r] and read the key columns
    0 .. last_R[r] of its slot (causally), whatever the cache holds past them. `flash`: the
    FlashAttention kernel reads them; otherwise the position mask over every column does (the
    reference, on CPU or in float32). The offsets lay each (row, key/value head) pair out as one
    sequence of the kernel's variable-length batch: keys [R * Hkv * C, 1, D] are the cache rows
    as they lie (C columns each, `used_N` of them read), queries are the G heads of a group
    (decode: G queries of one position; verify: Q positions of G heads each)."""

    last_R: torch.Tensor
    flash: bool
    used_N: torch.Tensor | None = None
    cu_q_N: torch.Tensor | None = None
    cu_k_N: torch.Tensor | None = None

    @classmethod
    def of(cls, pos_RQ: torch.Tensor, capacity: int, config, flash: bool) -> "KeyCounts":
        R, Q = pos_RQ.shape
        # Consecutive positions per row (a decode token, a verify block); a padding row (every
        # position 0) reads Q columns, so that each of its queries sees a key and stays finite.
        last_R = torch.clamp(pos_RQ[:, -1], min=Q - 1)
        if not flash:
            return cls(last_R, False)
        heads, hkv, _ = attention_heads(config)
        group = heads // hkv
        n, device = R * hkv, pos_RQ.device
        step = group if Q == 1 else Q
        return cls(last_R, True, (last_R + 1).to(torch.int32).repeat_interleave(hkv),
                   torch.arange(0, (n + 1) * step, step, device=device, dtype=torch.int32),
                   torch.arange(0, (n + 1) * capacity, capacity, device=device, dtype=torch.int32))


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, dflash_keys=None,
                     **kwargs):
    """The target's attention on the decode and verify steps of CUDA half-precision targets,
    registered as VARLEN_ATTENTION: each row reads only its own keys (columns up to its last
    query's position), not the step's width bucket. FlashAttention's variable-length kernel with
    per-sequence key counts (`seqused_k`) reads the cache in place: one sequence per (row,
    key/value head), whose G query heads are its queries (a decode step: G queries at one
    position, no mask; a verify step: Q positions per head, causal from the bottom right, so
    query i sees columns <= last - Q + 1 + i). At regeneration's shapes this reads about half
    the bytes of the width bucket and skips the mask the masked kernels are slow with
    (docs/PERFORMANCE.md). `key`/`value` are the cache's rows whole [R, Hkv, C, D]
    (StaticCache.bind(width=None))."""
    if dflash_keys is None:
        raise RuntimeError(f"{type(module).__name__} did not pass the engine's key counts to its attention function; "
                           f"decode.TargetSteps(attention='masked') runs this target")
    if (kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or kwargs.get("sliding_window")
            or getattr(module, "sinks", None) is not None):
        raise ValueError("varlen attention takes plain causal attention only (no softcap, sinks or window): "
                         "decode.TargetSteps(attention='masked')")
    R, Hq, Q, D = query.shape
    Hkv, C = key.shape[1], key.shape[2]
    if not dflash_keys.flash:
        query_pos_RQ = dflash_keys.last_R[:, None] - Q + 1 + torch.arange(Q, device=query.device)
        return grouped_attention(module, query, key, value, causal_position_mask(query_pos_RQ, C), scaling=scaling)
    G, n = Hq // Hkv, R * Hkv
    k, v = key.view(n * C, 1, D), value.view(n * C, 1, D)
    flash = torch.ops.aten._flash_attention_forward
    if Q == 1:  # the G heads of a group are G queries of the same position: no mask
        out = flash(query.reshape(n * G, 1, D), k, v, dflash_keys.cu_q_N, dflash_keys.cu_k_N, G, C, 0.0, False, False,
                    scale=scaling, seqused_k=dflash_keys.used_N)[0]
        return out.view(R, 1, Hq, D), None
    q = query.reshape(R, Hkv, G, Q, D).transpose(2, 3).reshape(n * Q, G, D)
    out = flash(q, k, v, dflash_keys.cu_q_N, dflash_keys.cu_k_N, Q, C, 0.0, True, False, scale=scaling,
                seqused_k=dflash_keys.used_N)[0]
    return out.view(R, Hkv, Q, G, D).permute(0, 2, 1, 3, 4).reshape(R, Q, Hq, D), None


def flash_varlen_supported(model) -> bool:
    """Whether VARLEN_ATTENTION's FlashAttention kernel runs `model`'s decode and verify steps:
    a CUDA GPU of compute capability 8.0 or newer, half-precision weights, plain causal attention
    in every layer (no sliding window, no logit softcap), a head size FlashAttention takes."""
    weight = model.get_input_embeddings().weight
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = attention_heads(config)[2]
    return (weight.device.type == "cuda" and weight.dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(weight.device)[0] >= 8
            and hasattr(torch.ops.aten, "_flash_attention_forward")
            and not has_sliding_layers(config) and getattr(config, "attn_logit_softcapping", None) is None
            and head_dim % 8 == 0 and head_dim <= 256)


def register_attention() -> None:
    AttentionInterface.register(GROUPED_ATTENTION, grouped_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_ATTENTION, sdpa_mask)  # never used: masks come prepared
    # CAUSAL_ATTENTION has no mask function: transformers then makes no mask and passes None.
    AttentionInterface.register(CAUSAL_ATTENTION, causal_attention)
    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)  # no mask function either


class UseAttention:
    """Within the block, the model's layers use `implementation` (restored after)."""

    def __init__(self, model, implementation: str = GROUPED_ATTENTION) -> None:
        self.config, self.implementation = model.config, implementation

    def __enter__(self) -> None:
        self.previous = self.config._attn_implementation
        self.config._attn_implementation = self.implementation

    def __exit__(self, *exc) -> None:
        self.config._attn_implementation = self.previous
