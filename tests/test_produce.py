"""The target side of a step: feature noise, packing against a naive loop, and split fc layers
giving the drafter the very features the target side would have."""

from __future__ import annotations

import pytest
import torch

from dflash_train.batching import Batch
from dflash_train.masks import step_generator
from dflash_train.produce import FeatureNoise, add_feature_noise, context_features, pack


def test_feature_noise():
    x = torch.zeros(2000, 8)
    u = add_feature_noise(x, "uniform", 0.05, step_generator(0, 1))
    assert u.abs().max() <= 0.05 and u.abs().max() > 0.045 and abs(u.mean()) < 0.005
    g = add_feature_noise(x, "gaussian", 0.05, step_generator(0, 1))
    assert abs(g.std() - 0.05) < 0.003
    assert add_feature_noise(x, "none", 0.05) is x
    assert torch.equal(add_feature_noise(x, "uniform", 0.05, step_generator(0, 1)), u)
    with pytest.raises(ValueError, match="noise kind"):
        add_feature_noise(x, "pink", 0.05)


def random_batch(gen: torch.Generator, lengths: list[int], L: int, taps: int, H: int):
    """A right-padded batch, per-tap features [b, L, H] and greedy predictions [b, L]."""
    b = len(lengths)
    ids = torch.randint(1, 500, (b, L), generator=gen)
    mask = torch.rand(b, L, generator=gen) < 0.6
    for r, n in enumerate(lengths):
        ids[r, n:], mask[r, n:] = 0, False
    batch = Batch(ids, mask, torch.tensor(lengths), list(range(b)), 0, 0)
    taps_bLH = [torch.randn(b, L, H, generator=gen) for _ in range(taps)]
    return batch, taps_bLH, torch.randint(1, 500, (b, L), generator=gen)


def test_pack_against_a_naive_loop_and_split_fc_features():
    gen = torch.Generator().manual_seed(0)
    lengths, L, pad_to = [5, 12, 1, 9], 12, 40
    batch, taps, greedy = random_batch(gen, lengths, L, taps=3, H=4)
    noise = FeatureNoise("uniform", 0.05, seed=7, device=torch.device("cpu"))
    s = pack(batch, 11, torch.cat(taps, dim=-1), greedy, pad_to, noise)
    ids, mask, labels, feats = [], [], [], []
    for r, n in enumerate(lengths):
        for p in range(n):
            ids.append(int(batch.input_ids[r, p]))
            mask.append(bool(batch.loss_mask[r, p]))
            labels.append(int(batch.input_ids[r, 0]) if p == 0 else int(greedy[r, p - 1]))
            feats.append(torch.cat([t[r, p] for t in taps]))
    T = sum(lengths)
    assert s.num_tokens == T and s.input_ids_T.shape == (pad_to,) and not s.failed and s.index == 11
    assert s.input_ids_T[:T].tolist() == ids and s.loss_mask_T[:T].tolist() == mask
    assert s.labels_T[:T].tolist() == labels and s.doc_lengths.tolist() == lengths
    assert not s.loss_mask_T[T:].any() and not s.input_ids_T[T:].any()
    clean = torch.zeros(pad_to, 12)
    clean[:T] = torch.stack(feats)
    assert torch.equal(s.features, noise(clean, 11)) and not torch.equal(s.features, clean)
    assert (s.padded_tokens, s.rows, s.sum_seq_len, s.max_seq_len) == (4 * L, 4, T, 12)
    # Split fc layers: the taps travel apart, and the drafter side concatenates and noises them
    # into exactly the target side's features.
    split = pack(batch, 11, taps, greedy, pad_to, noise)
    assert isinstance(split.features, list) and len(split.features) == 3
    assert torch.equal(context_features(split, noise), s.features)
    assert context_features(s, noise) is s.features
