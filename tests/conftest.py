"""Shared fixtures: tiny random configs and packed layouts, and the real SmolLM2 folder."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from dflash_train.drafter import DFlashDrafter, build_drafter_config

# The tests' tensors are tiny: one intra-op thread avoids OpenMP hand-off costs that dominate
# (and explode when the 2-core CI machine is busy with anything else).
torch.set_num_threads(1)


def tiny_target_config(**overrides) -> LlamaConfig:
    cfg = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def tiny_drafter(num_layers=2, block_size=4, seed=0, **kw) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = build_drafter_config(
        tiny_target_config(), num_layers=num_layers, block_size=block_size, mask_token_id=127, **kw
    )
    return DFlashDrafter(cfg).eval()


def random_packed_row(gen: torch.Generator, num_docs: int, max_len: int = 24, pad: int = 0):
    """Random documents with random supervised spans (some documents fully unsupervised),
    plus `pad` padding positions at the end of the row."""
    lengths = torch.randint(2, max_len + 1, (num_docs,), generator=gen)
    T = int(lengths.sum()) + pad
    loss_mask = torch.zeros(T, dtype=torch.bool)
    start = 0
    for n in lengths.tolist():
        kind = int(torch.randint(0, 4, (1,), generator=gen))
        if kind == 0:  # no supervision at all: a document with no anchors
            pass
        elif kind == 1:  # everything after a prompt
            cut = int(torch.randint(0, n, (1,), generator=gen))
            loss_mask[start + cut : start + n] = True
        else:  # scattered supervised positions
            loss_mask[start : start + n] = torch.rand(n, generator=gen) < 0.6
        start += n
    return lengths, loss_mask


@pytest.fixture(scope="session")
def smollm2_path():
    from dflash_train.assets import smollm2_dir

    return smollm2_dir()
