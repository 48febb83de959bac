"""The DFlash drafter: model, configuration, layer taps, mask token, HF format.

Owns the drafter exactly as served (vLLM, SGLang, transformers with the published modeling
code): a stack of Qwen3-style pre-norm layers whose keys/values are [context ; block], a fused
context projection (fc + hidden_norm) of the tapped target layers, and a final norm. The
target's embedding and lm_head are not part of it: callers embed block tokens with the target's
embedding and apply the target's lm_head to the returned hidden states.

One forward serves training and inference: training passes the whole packed row as context and
all blocks as queries with the mask of masks.py; inference passes the new context features and
one block, with a KV cache. The calling convention is the published one:
`forward(target_hidden [B, T_ctx, n*H], noise_embedding [B, Q, H], position_ids [B, T_ctx + Q])`
-> final-normed hidden states [B, Q, H].

Shape legend: B batch, T context tokens, Q block (query) tokens, H hidden size,
Hq query heads, Hkv key/value heads, Dh head dim, n tapped target layers.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

# This file imports nothing from dflash_train: the export copies it next to the weights as the
# modeling code of `AutoModel.from_pretrained(..., trust_remote_code=True)`.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

ARCHITECTURE = "DFlashDraftModel"
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
DEFAULT_BLOCK_SIZE = 16


# --------------------------------------------------------------------------- configuration


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """0-based target layers to tap, strictly increasing and distinct (serving engines capture
    taps in layer order, one feature each): the published rule where it gives distinct layers,
    the middle layer for one tap, else evenly spread from layer 1 to layer L-3 (Qwen3-8B, L=36,
    5 taps -> [1, 9, 17, 25, 33]); on a target too shallow for that (more taps than L-3), evenly
    spread over every layer that can be tapped, 0 to L-2 (L=4, 2 taps -> [0, 2]). A target has
    L-1 layers that can be tapped (never the last): more taps than that raise ValueError."""
    L, n = int(num_target_layers), int(num_taps)
    if L < 2 or n < 1:
        raise ValueError(f"need a target of at least 2 layers and at least 1 tap, got {L} layers and {n} taps "
                         f"(the target's last layer cannot be tapped)")
    if n > L - 1:
        raise ValueError(f"{n} taps of a target of {L} layers: only its first {L - 1} layers can be tapped (the "
                         f"last cannot); set drafter.num_taps (or drafter.num_layers) to at most {L - 1}, or "
                         f"drafter.target_layer_ids")
    if n == 1:
        return [min(L // 2, L - 2)]
    first, last = (1, L - 3) if n <= L - 3 else (0, L - 2)
    ids = [int(round(first + i * (last - first) / (n - 1))) for i in range(n)]
    assert ids == sorted(set(ids)), ids  # spacing >= 1: rounding keeps them distinct
    return ids


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for idx, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(idx))
    return ids


def resolve_mask_token_id(tokenizer, embedding_rows: int, configured: int | None = None) -> int:
    """The mask token id: the configured one after checks, else a reserved id with an embedding
    row in the target that real text never produces.

    Preference when choosing: (1) embedding rows past the tokenizer's vocabulary (Qwen3:
    151669), (2) special tokens named "reserved" (Llama-3.1: 128002), (3) other special tokens
    that are not bos/eos/pad/unk and that the chat template does not emit. A configured id
    must have an embedding row and must not be a token that ordinary text tokenizes to.
    """
    vocab = len(tokenizer) if tokenizer is not None else None
    if configured is not None:
        if not 0 <= configured < embedding_rows:
            raise ValueError(
                f"mask_token_id={configured} has no embedding row in the target "
                f"(embedding has {embedding_rows} rows); choose an id in [0, {embedding_rows})"
            )
        if tokenizer is not None and configured < vocab and configured not in _special_ids(tokenizer):
            token = tokenizer.convert_ids_to_tokens(configured)
            raise ValueError(
                f"mask_token_id={configured} ({token!r}) is an ordinary vocabulary token that real "
                f"text produces; use a reserved/special token or an unused embedding row "
                f"(leave drafter.mask_token_id unset to pick one automatically)"
            )
        return configured
    if tokenizer is None:
        raise ValueError("no tokenizer to choose a mask token from: set drafter.mask_token_id explicitly")
    if embedding_rows > vocab:
        return vocab
    specials = sorted(i for i in _special_ids(tokenizer) if i < embedding_rows)
    names = {i: tokenizer.convert_ids_to_tokens(i) for i in specials}
    reserved = [i for i in specials if "reserved" in str(names[i]).lower()]
    if reserved:
        return reserved[0]
    busy = {
        getattr(tokenizer, attr, None)
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    }
    template_text = ""
    if getattr(tokenizer, "chat_template", None):
        try:
            template_text = tokenizer.apply_chat_template(
                [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                 {"role": "assistant", "content": "a"}],
                tokenize=False,
                add_generation_prompt=False,
            )
        except Exception:  # a template that rejects this probe still leaves the other checks
            template_text = ""
    free = [i for i in specials if i not in busy and str(names[i]) not in template_text]
    if not free:
        raise ValueError(
            "the target has no unused embedding row and no free special token to serve as the "
            "mask token; set drafter.mask_token_id to a reserved id explicitly"
        )
    return free[-1]


def mask_token_string(tokenizer, mask_token_id: int) -> str | None:
    """The token string of the mask id, or None when the id is past the tokenizer (an unused
    embedding row, as Qwen3's 151669) or there is no tokenizer."""
    if tokenizer is None or not 0 <= mask_token_id < len(tokenizer):
        return None
    token = tokenizer.convert_ids_to_tokens(int(mask_token_id))
    return token if isinstance(token, str) else None


def build_drafter_config(
    target_config,
    *,
    num_layers: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    num_taps: int | None = None,
    sliding_window: int | None = None,
    layer_types: list[str] | None = None,
    intermediate_size: int | None = None,
) -> Qwen3Config:
    """A Qwen3 config for a drafter of `target_config` (any HF decoder config).

    Hidden size, heads, head_dim, norm eps, rope settings, vocabulary and context length come
    from the target. `sliding_window=W` alone makes every layer sliding-window; `layer_types`
    picks per layer. Taps default to `default_target_layer_ids(L, num_taps or num_layers)`;
    the target's last layer cannot be tapped (`tap_problem`). Every problem is raised at once
    as a ValueError.
    """
    text_cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    L = int(text_cfg.num_hidden_layers)
    heads = int(text_cfg.num_attention_heads)
    hidden = int(text_cfg.hidden_size)
    problems = []
    if target_layer_ids is None:
        try:
            target_layer_ids = default_target_layer_ids(L, num_taps or num_layers)
        except ValueError as err:
            problems.append(f"drafter.num_taps: {err}")
    if layer_types is None:
        layer_types = [SLIDING_ATTENTION if sliding_window else FULL_ATTENTION] * num_layers
    rope = target_rope(text_cfg)
    problems += setting_problems(num_layers, block_size, target_layer_ids, L, layer_types, sliding_window)
    if "rope_type" not in rope and any(isinstance(v, dict) for v in rope.values()):
        problems.append(
            f"the target's RoPE differs per layer type ({sorted(rope)}); a DFlash drafter has one RoPE "
            f"and no serving engine reads per-layer-type RoPE for it: this target is not supported"
        )
    if problems:
        raise ValueError("invalid drafter settings:\n  - " + "\n  - ".join(problems))
    sliding = SLIDING_ATTENTION in layer_types
    return Qwen3Config(
        architectures=[ARCHITECTURE],
        hidden_size=hidden,
        intermediate_size=int(intermediate_size or text_cfg.intermediate_size),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(text_cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text_cfg, "head_dim", None) or hidden // heads),
        hidden_act="silu",
        rms_norm_eps=float(text_cfg.rms_norm_eps),
        vocab_size=int(text_cfg.vocab_size),
        max_position_embeddings=int(getattr(text_cfg, "max_position_embeddings", 32768)),
        rope_parameters=drafter_rope(rope),
        is_neox_style=True,
        attention_bias=False,
        tie_word_embeddings=False,
        use_sliding_window=sliding,
        sliding_window=sliding_window if sliding else None,
        layer_types=list(layer_types),
        max_window_layers=_max_window_layers(layer_types),
        block_size=block_size,
        num_target_layers=L,
        dflash_config={"target_layer_ids": [int(i) for i in target_layer_ids], "mask_token_id": int(mask_token_id),
                       "block_size": int(block_size)},
    )


# RoPE keys a drafter never takes from its target. Its layers rotate whole heads: transformers
# 5's Qwen3 RoPE ignores a partial_rotary_factor and 4.x honours it, so inheriting the target's
# would make the two read one folder differently. Its rotation is 1-D over token positions:
# M-RoPE's sections (Qwen3.5-style targets) would make vLLM refuse the drafter ("does not support
# M-RoPE"). The drafter's RoPE is its own (its q/k are its own).
NOT_INHERITED_ROPE = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def drafter_rope(target_rope_settings: dict) -> dict:
    """The drafter's rope_parameters from its target's: the same type, base and scaling, without
    NOT_INHERITED_ROPE (an "mrope" type becomes the 1-D "default" it is built on)."""
    rope = {k: v for k, v in target_rope_settings.items() if k not in NOT_INHERITED_ROPE}
    if rope.get("rope_type") == "mrope":
        rope["rope_type"] = "default"
    return rope


def rope_problem(raw: dict) -> str | None:
    """Why a drafter config's rotation is not what this model computes (1-D, neox-style rotate
    half), or None: M-RoPE keys in its RoPE settings, or `is_neox_style: false`."""
    found = [f"{where}.{key}" for where in ("rope_parameters", "rope_scaling")
             for key in MROPE_KEYS if isinstance(raw.get(where), dict) and key in raw[where]]
    if found:
        return (f"its RoPE settings carry M-RoPE keys ({', '.join(found)}), but a DFlash drafter rotates in one "
                f"dimension (vLLM refuses such a drafter): remove them from config.json")
    if raw.get("is_neox_style") is False:
        return ("is_neox_style is false, but this drafter rotates neox-style (rotate half), as it was trained: "
                "set it to true")
    return None


def target_rope(text_cfg) -> dict:
    """The target's RoPE settings (`rope_parameters`, or a legacy `rope_theta`)."""
    rope = getattr(text_cfg, "rope_parameters", None)
    if rope is None:
        rope = {"rope_type": "default", "rope_theta": float(getattr(text_cfg, "rope_theta", 10000.0))}
    return dict(rope)


def setting_problems(num_layers: int, block_size: int, target_layer_ids, num_target_layers: int,
                     layer_types: list[str], sliding_window: int | None) -> list[str]:
    """What is wrong with a drafter's layer, tap and attention settings for a target of
    `num_target_layers` layers, all at once."""
    problems = []
    if num_layers < 1:
        problems.append(f"drafter.num_layers must be >= 1, got {num_layers}")
    if block_size < 2:
        problems.append(f"drafter.block_size must be >= 2, got {block_size}")
    problem = tap_problem(target_layer_ids, num_target_layers) if target_layer_ids is not None else None
    if problem:
        problems.append(f"drafter.target_layer_ids: {problem}")
    if len(layer_types) != num_layers or any(t not in (FULL_ATTENTION, SLIDING_ATTENTION) for t in layer_types):
        problems.append(
            f"drafter.layer_types must list {num_layers} entries of "
            f"'{FULL_ATTENTION}'/'{SLIDING_ATTENTION}', got {layer_types}"
        )
    if SLIDING_ATTENTION in layer_types and not (sliding_window and sliding_window >= block_size):
        problems.append(
            f"sliding-window layers need drafter.sliding_window >= block_size ({block_size}), got {sliding_window}"
        )
    return problems


def set_mask_token(config: Qwen3Config, token: str | None) -> None:
    """Record the mask id's token string beside the id, when it has one (some SGLang versions
    read it)."""
    if token is not None:
        config.dflash_config["mask_token"] = str(token)


def tap_problem(target_layer_ids, num_target_layers: int | None) -> str | None:
    """What is wrong with these taps of a target of `num_target_layers` layers (None: not
    known, the order alone is checked), or None. Serving engines capture `hidden_states[id + 1]`
    of layers before the last one only, in layer order, one feature per layer: a drafter tapping
    the last layer (or beyond) could be trained but never served, and one whose taps are not
    strictly increasing would get its fc inputs permuted (or a width it does not have)."""
    ids = list(target_layer_ids or [])
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return f"{ids!r} must be a non-empty list of layer ids"
    problem = tap_order_problem(ids)
    if problem or num_target_layers is None:
        return problem
    L = int(num_target_layers)
    last = [i for i in ids if i == L - 1]
    if last:
        return (f"{ids} taps the target's last layer ({L - 1}): no serving engine can capture it (vLLM, "
                f"SGLang and the transformers backend read hidden_states[id + 1] of the layers before the "
                f"last), so such a drafter could never be served; tap layers in [0, {L - 2}]")
    bad = [i for i in ids if not 0 <= i < L - 1]
    if bad:
        return f"{ids}: ids {bad} are outside [0, {L - 2}] (the target has {L} layers; the last cannot be tapped)"
    return None


def tap_order_problem(ids: list[int]) -> str | None:
    """Taps must be strictly increasing (so distinct): vLLM and SGLang capture the tapped layers
    in layer order and concatenate one feature per layer, so taps in another order reach fc
    permuted (acceptance collapses, no error) and a repeated tap leaves fc a width the engine
    never gives it (an error at serve time)."""
    if all(a < b for a, b in zip(ids, ids[1:])):
        return None
    ordered = sorted(set(ids))
    repeated = f"repeats {sorted({i for i in ids if ids.count(i) > 1})}" if len(ordered) < len(ids) else \
        "is not in increasing order"
    return (f"{ids} {repeated}: serving engines capture the taps in layer order, one feature per layer, so this "
            f"drafter would be served differently from how it is trained; give strictly increasing, distinct ids, "
            f"e.g. {ordered}")


def target_problems(config, target_config) -> list[str]:
    """Why a drafter config (`config`, as config_from_dict reads it) does not fit this target,
    one line per mismatch: hidden size, vocabulary, number of layers, taps, mask token row. A
    drafter trained for another target fails several of these."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    problems = []
    if config.hidden_size != text.hidden_size:
        problems.append(f"hidden size {config.hidden_size} != the target's {text.hidden_size}")
    if config.vocab_size != text.vocab_size:
        problems.append(f"vocabulary of {config.vocab_size} tokens != the target's {text.vocab_size}")
    trained_on = _dflash_field(config, "num_target_layers")
    if trained_on is not None and trained_on != text.num_hidden_layers:
        problems.append(f"trained on a target of {trained_on} layers, this one has {text.num_hidden_layers}")
    problem = tap_problem(_dflash_field(config, "target_layer_ids"), text.num_hidden_layers)
    if problem:
        problems.append(f"taps {problem}")
    mask_id = _dflash_field(config, "mask_token_id")
    if mask_id is not None and mask_id >= text.vocab_size:
        problems.append(f"mask token {mask_id} has no embedding row (the target has {text.vocab_size})")
    return problems


def _max_window_layers(layer_types: list[str]) -> int:
    """The legacy Qwen2 reading of layer types: the first `max_window_layers` layers use full
    attention, the rest slide. Agrees with `layer_types` whenever the full layers come first;
    readers of this field alone cannot express any other order (README, serving)."""
    full = 0
    while full < len(layer_types) and layer_types[full] == FULL_ATTENTION:
        full += 1
    return full


LEGACY_KEYS = ("rope_theta", "rope_scaling", "partial_rotary_factor", "torch_dtype")
# Keys that change every layer's attention in some consumers (vLLM reads dflash_config.causal);
# this model ignores them (full layers are bidirectional inside the block, sliding ones causal,
# exactly as training masks them), so a saved drafter never carries them.
OVERRIDE_KEYS = ("is_causal", "causal", "use_swa")


def with_legacy_fields(config_dict: dict) -> dict:
    """A config dict as every consumer must read it. transformers 5 writes only
    `rope_parameters`; transformers 4.5x (the official DFlash backend pins 4.57.1; vLLM builds on
    transformers < 5) reads only the legacy top-level `rope_theta`, `rope_scaling` (no `type`
    key) and `partial_rotary_factor`, and without them builds the default base (10000). Both
    conventions are written so that both build the same inverse frequencies; `torch_dtype`
    mirrors `dtype` for readers older than it. A dict from transformers 4.x is completed the
    other way (its legacy fields become `rope_parameters`)."""
    out = {k: v for k, v in config_dict.items() if k not in LEGACY_KEYS}
    rope = config_dict.get("rope_parameters")
    if rope is None and config_dict.get("rope_theta") is not None:
        rope = {**(config_dict.get("rope_scaling") or {}), "rope_theta": config_dict["rope_theta"]}
        if config_dict.get("partial_rotary_factor") is not None:
            rope["partial_rotary_factor"] = config_dict["partial_rotary_factor"]
    if isinstance(rope, dict) and "rope_theta" in rope:
        rope = dict(rope)
        kind = rope.pop("type", None)
        rope.setdefault("rope_type", kind or "default")
        out["rope_parameters"] = rope
        out["rope_theta"] = rope["rope_theta"]
        if rope.get("partial_rotary_factor") is not None:
            out["partial_rotary_factor"] = rope["partial_rotary_factor"]
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
        out["rope_scaling"] = None if scaling["rope_type"] == "default" else scaling
    elif "rope_parameters" in config_dict:
        out["rope_parameters"] = rope
    dtype = config_dict.get("dtype") or config_dict.get("torch_dtype")
    if dtype is not None:
        out["dtype"] = out["torch_dtype"] = dtype
    return out


def write_config_json(config_dict: dict, path: Path) -> None:
    """config.json as every consumer reads it (`with_legacy_fields`), keys sorted."""
    Path(path).write_text(json.dumps(with_legacy_fields(config_dict), indent=2, sort_keys=True) + "\n")


def _dflash_field(config, name: str, default: Any = None) -> Any:
    """A DFlash field from `dflash_config`, else top level (both layouts exist in the wild)."""
    extra = getattr(config, "dflash_config", None) or {}
    if name in extra and extra[name] is not None:
        return extra[name]
    value = getattr(config, name, None)
    return default if value is None else value


# --------------------------------------------------------------------------- KV cache


class DrafterCache:
    """Per-layer keys/values of the drafter (already roped), growable and croppable.

    Same `update(k, v, layer_idx)` / `crop` / `get_seq_length` surface as transformers'
    caches, so either can be passed as `past_key_values`.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], k], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], v], dim=-2)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys[layer_idx].shape[-2] if len(self.keys) > layer_idx else 0

    def crop(self, length: int) -> None:
        """Keep the first `length` positions."""
        self.keys = [k[..., :length, :] for k in self.keys]
        self.values = [v[..., :length, :] for v in self.values]


# --------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_rule(x, self.weight, self.eps)


def rms_norm_rule(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The drafter's RMSNorm (that of transformers' Llama and Qwen norms; the decoding engine
    runs it as one kernel on a GPU, dflash_train/engine/fusion.py): normalise in fp32
    (bf16 activations of Qwen3 have outliers), round to the input's dtype, scale by the weight.
    The result keeps the input's dtype also where the weight is float32 (training's master
    weights under autocast), as it does in serving's bf16: no float32 activations."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(x.dtype)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class QKRotation(nn.Module):
    """RoPE of a layer's queries (the block's Q positions, the last of cos/sin) and keys (all S
    positions): x * cos + rotate_half(x) * sin, each product and the sum in x's dtype. No
    parameters: a module so that the decoding engine can run it as two kernels on a GPU
    (dflash_train/engine/fusion.py) where eager PyTorch launches ten."""

    def forward(self, q_BHQD: torch.Tensor, k_BHSD: torch.Tensor, cos_B1SD: torch.Tensor,
                sin_B1SD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        Q = q_BHQD.shape[-2]
        return _apply_rope(q_BHQD, cos_B1SD[:, :, -Q:], sin_B1SD[:, :, -Q:]), _apply_rope(k_BHSD, cos_B1SD, sin_B1SD)


# The flex-attention function that layers call under a BlockMask (training). On CUDA the run
# hands in a compiled one (dflash_train/compilation.py): this file imports nothing from its
# package, since every export carries a copy of it. Eager flex materialises the score matrix.
flex_kernel = None


def _flex_attention(q, k, v, block_mask, scale):
    # Imported here: exports carry this file to consumers whose torch may lack flex attention,
    # which only training uses.
    from torch.nn.attention.flex_attention import flex_attention

    if flex_kernel is not None and q.device.type == "cuda":
        return flex_kernel(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)

    # Eager flex (on CPU the forward alone exists; tests compare the paths with it).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def _serving_window_mask(q_len: int, kv_len: int, window: int, device) -> torch.Tensor:
    """Inference mask of a sliding-window layer: the cache holds positions 0..kv_len-q_len-1
    of this sequence, the block follows; causal and within `window`."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    return (k_pos <= q_pos) & (q_pos - k_pos < window)


class DFlashAttention(nn.Module):
    """Queries from block tokens only; keys/values from [context ; block] through the same
    k/v projections, k_norm on both; context never passes q/o projections."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scale = self.head_dim**-0.5
        self.layer_type = config.layer_types[layer_idx]
        self.window = config.sliding_window if self.layer_type == SLIDING_ATTENTION else None
        H, Dh = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(H, self.num_heads * Dh, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * Dh, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * Dh, bias=False)
        self.o_proj = nn.Linear(self.num_heads * Dh, H, bias=False)
        self.q_norm = RMSNorm(Dh, config.rms_norm_eps)
        self.k_norm = RMSNorm(Dh, config.rms_norm_eps)
        self.rotation = QKRotation()

    def forward(self, x_BQH, ctx_BTH, cos_BSD, sin_BSD, mask=None, cache=None) -> torch.Tensor:
        B, Q, _ = x_BQH.shape
        Dh = self.head_dim
        q_BHqQD = self.q_norm(self.q_proj(x_BQH).view(B, Q, self.num_heads, Dh)).transpose(1, 2)
        kv_in_BSH = torch.cat([ctx_BTH, x_BQH], dim=1)
        S = kv_in_BSH.shape[1]
        k_BHkvSD = self.k_norm(self.k_proj(kv_in_BSH).view(B, S, self.num_kv_heads, Dh)).transpose(1, 2)
        v_BHkvSD = self.v_proj(kv_in_BSH).view(B, S, self.num_kv_heads, Dh).transpose(1, 2)
        q_BHqQD, k_BHkvSD = self.rotation(q_BHqQD, k_BHkvSD, cos_BSD[:, None], sin_BSD[:, None])
        if cache is not None:
            k_BHkvSD, v_BHkvSD = cache.update(k_BHkvSD, v_BHkvSD, self.layer_idx)
        if isinstance(mask, dict):
            mask = mask[self.layer_type]
        if mask is None and self.window is not None:
            mask = _serving_window_mask(Q, k_BHkvSD.shape[-2], self.window, x_BQH.device)
        if mask is not None and not isinstance(mask, torch.Tensor):
            out = _flex_attention(q_BHqQD, k_BHkvSD, v_BHkvSD, mask, self.scale)
        else:
            out = F.scaled_dot_product_attention(
                q_BHqQD, k_BHkvSD, v_BHkvSD, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.num_heads * Dh))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x_BQH, ctx_BTH, cos, sin, mask=None, cache=None) -> torch.Tensor:
        x_BQH = x_BQH + self.self_attn(self.input_layernorm(x_BQH), ctx_BTH, cos, sin, mask, cache)
        return x_BQH + self.mlp(self.post_attention_layernorm(x_BQH))


def build_modules(model: nn.Module, config: Qwen3Config) -> None:
    """Give `model` the drafter's submodules and fields (shared with the exported HF class)."""
    model.config = config
    model.target_layer_ids = [int(i) for i in _dflash_field(config, "target_layer_ids")]
    model.block_size = int(_dflash_field(config, "block_size", DEFAULT_BLOCK_SIZE))
    model.mask_token_id = int(_dflash_field(config, "mask_token_id"))
    H = config.hidden_size
    model.layers = nn.ModuleList(DFlashLayer(config, i) for i in range(config.num_hidden_layers))
    model.norm = RMSNorm(H, config.rms_norm_eps)
    model.fc = nn.Linear(len(model.target_layer_ids) * H, H, bias=False)
    model.hidden_norm = RMSNorm(H, config.rms_norm_eps)
    # Not a submodule: `.to(bfloat16)` must never round the rope frequencies, which stay fp32
    # (cos/sin are cast to the activation dtype per call, as HF and vLLM do).
    object.__setattr__(model, "rotary_emb", Qwen3RotaryEmbedding(config))


class DFlashDrafter(nn.Module):
    """The DFlash draft model. Parameter names are those of the published checkpoints."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        build_modules(self, config)
        self.reset_parameters()

    @property
    def layer_types(self) -> list[str]:
        return list(self.config.layer_types)

    def reset_parameters(self) -> None:
        std = float(getattr(self.config, "initializer_range", 0.02))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(
        self,
        target_hidden: torch.Tensor,
        noise_embedding: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask=None,
        past_key_values=None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        """target_hidden [B, T, n*H] (tapped target layers, concatenated, before fc),
        noise_embedding [B, Q, H] (target-embedded block tokens), position_ids [B, T + Q].

        attention_mask: None (inference: everything in the cache plus the block is visible,
        windowed for sliding layers), a dense bool [Q, KV] (or [B, 1, Q, KV], one per row, as
        batched inference passes) or flex BlockMask, or a dict of those keyed by layer type.
        past_key_values: any cache with `update(k, v, layer_idx) -> (keys, values)`
        (DrafterCache, a transformers cache). Returns final-normed hidden states [B, Q, H].
        """
        ctx_BTH = self.hidden_norm(self.fc(target_hidden))
        x_BQH = noise_embedding
        rope = self.rotary_emb
        if rope.inv_freq.device != x_BQH.device:
            if rope.inv_freq.is_meta:  # built under a meta-device context (lazy loading)
                rope = Qwen3RotaryEmbedding(self.config)
                object.__setattr__(self, "rotary_emb", rope)
            rope.to(x_BQH.device)
        cos, sin = rope(x_BQH, position_ids)
        cache = past_key_values if (use_cache or past_key_values is not None) else None
        for layer in self.layers:
            x_BQH = layer(x_BQH, ctx_BTH, cos, sin, attention_mask, cache)
        return self.norm(x_BQH)

    # ----------------------------------------------------------------------- HF format

    def save_pretrained(self, path: str | Path) -> None:
        """Write config.json + model.safetensors in the published DFlash format."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = self.config
        config.architectures = [ARCHITECTURE]
        config.block_size = self.block_size
        config.dflash_config = {
            **(getattr(config, "dflash_config", None) or {}),
            "target_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id,
            "block_size": self.block_size,
        }
        config.dtype = str(next(self.parameters()).dtype).removeprefix("torch.")
        config.is_neox_style = True  # how its RoPE rotates (rotate half); some engines read it
        # Written from the whole dict (every field explicit) after transformers serialises it,
        # which drops the legacy fields 4.x readers need (with_legacy_fields).
        raw = config.to_dict()
        for key in OVERRIDE_KEYS:
            raw.pop(key, None)
        raw["dflash_config"] = {k: v for k, v in raw["dflash_config"].items() if k not in OVERRIDE_KEYS}
        write_config_json(raw, path / CONFIG_NAME)
        tensors = {name: t.detach().contiguous() for name, t in self.state_dict().items()}
        save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> "DFlashDrafter":
        """Load a drafter folder in the published format (ours or anyone's)."""
        path = Path(path)
        config = folder_config(path)
        state = {}
        for f in sorted(path.glob("*.safetensors")):
            state.update(load_file(str(f)))
        # Some exporters prefix names with "model."; the published names have no prefix.
        state = {k.removeprefix("model."): v for k, v in state.items()}
        with torch.device("meta"):
            model = cls(config)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(
                f"{path}: weights do not match the drafter config (missing: {sorted(missing)}, "
                f"unexpected: {sorted(unexpected)})"
            )
        return model.to(device=device or "cpu", dtype=dtype)


def folder_config(path: str | Path) -> Qwen3Config:
    """The checked config of a drafter folder in the published format, without loading its
    weights (it checks they are there): FileNotFoundError or ValueError saying what is wrong."""
    path = Path(path)
    cfg_file = path / CONFIG_NAME
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such folder; give a drafter folder (config.json and {WEIGHTS_NAME})")
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: a drafter folder holds config.json and {WEIGHTS_NAME}")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{cfg_file}: not valid JSON ({err})") from err
    if not (isinstance(raw, dict) and ("block_size" in raw or "dflash_config" in raw)):
        kind = f" (a {raw['model_type']} model's folder?)" if isinstance(raw, dict) and raw.get("model_type") else ""
        raise ValueError(f"{path}: not a DFlash drafter folder{kind}: its {CONFIG_NAME} has neither block_size nor "
                         f"dflash_config; give a folder written by `dflash-train train` or `export`, or a published "
                         f"DFlash drafter")
    config = config_from_dict(raw, source=str(cfg_file))
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return config


def config_from_dict(raw: dict, source: str = "config") -> Qwen3Config:
    """A drafter config from a published-format dict, with the DFlash fields checked."""
    raw = dict(raw)
    problems = []
    dcfg = raw.get("dflash_config") or {}
    if not isinstance(dcfg, dict):
        problems.append("dflash_config must be an object")
        dcfg = {}
    for name in ("target_layer_ids", "mask_token_id"):
        if dcfg.get(name) is None and raw.get(name) is None:
            problems.append(f"dflash_config.{name} is missing")
    ids = dcfg.get("target_layer_ids", raw.get("target_layer_ids"))
    if ids is not None and not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
        problems.append(f"dflash_config.target_layer_ids must be a non-empty list of ints, got {ids!r}")
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(raw.get(name), int):
            problems.append(f"{name} must be an integer, got {raw.get(name)!r}")
    num_target_layers = raw.get("num_target_layers")
    if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
        problem = tap_problem(ids, num_target_layers if isinstance(num_target_layers, int) else None)
        if problem:
            problems.append(f"dflash_config.target_layer_ids: {problem}")
    problem = rope_problem(raw)
    if problem:
        problems.append(problem)
    if problems:
        raise ValueError(f"{source}: not a DFlash drafter config:\n  - " + "\n  - ".join(problems))
    raw.pop("model_type", None)
    raw.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    layer_types = raw.get("layer_types")
    if layer_types is None:
        raw["layer_types"] = [FULL_ATTENTION] * raw["num_hidden_layers"]
    return Qwen3Config(**raw)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
