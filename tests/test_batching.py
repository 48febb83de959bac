"""Bucketed batches: budgets, coverage, determinism, the endless stream and exact mid-epoch
resume from its position."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_train.data.batching import BatchPlan, BatchStream, collate, quantile_boundaries

lengths_st = st.lists(st.integers(1, 600), min_size=1, max_size=300)
budget_st = st.integers(640, 5000)  # lengths up to 600 round up to a 640 bucket
rows_st = st.integers(1, 40)


def fake_dataset(lengths, seed=0):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(3, 1000, n).tolist() for n in lengths]
    masks = [rng.integers(0, 2, n).tolist() for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "length": list(lengths)})


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, budget=budget_st, max_rows=rows_st, buckets=st.integers(1, 10),
       epoch=st.integers(0, 5))
def test_batches_respect_budget_and_cover_the_epoch(lengths, budget, max_rows, buckets, epoch):
    plan = BatchPlan(lengths, token_budget=budget, max_batch_size=max_rows, num_buckets=buckets, seed=3)
    batches = plan.epoch(epoch)
    assert len(batches) == plan.num_batches
    for batch in batches:
        length = plan.length_of(batch)
        assert length in plan.boundaries
        assert 1 <= len(batch) <= max_rows
        assert len(batch) * length <= budget
        assert all(lengths[i] <= length for i in batch)
        # The batch is in its tightest bucket: no smaller boundary would hold its longest row.
        smaller = [b for b in plan.boundaries if b < length]
        assert all(lengths[i] > smaller[-1] for i in batch) if smaller else True
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    assert set(plan.shapes) == {(len(b), plan.length_of(b)) for b in batches}  # every batch's, no other


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=80), epoch=st.integers(0, 3))
def test_an_epoch_of_the_stream_partitions_the_samples(lengths, epoch):
    plan = BatchPlan(lengths, token_budget=1024, max_batch_size=4, seed=1)
    stream = BatchStream(fake_dataset(lengths), plan)
    n = plan.num_batches
    batches = [stream[g] for g in range(epoch * n, (epoch + 1) * n)]
    assert all(b.epoch == epoch for b in batches) and [b.index for b in batches] == list(range(n))
    assert sorted(i for b in batches for i in b.indices) == list(range(len(lengths)))


def test_shuffle_is_a_function_of_seed_and_epoch():
    lengths = list(range(1, 400))
    def order(seed, epoch):
        return [b.tolist() for b in BatchPlan(lengths, 4096, 16, seed=seed).epoch(epoch)]
    assert order(0, 1) == order(0, 1)
    assert order(0, 1) != order(0, 2)
    assert order(0, 1) != order(1, 1)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=60), stop=st.integers(0, 40),
       seed=st.integers(0, 100))
def test_resume_yields_the_same_remaining_batches(lengths, stop, seed):
    """A run's data position is the next global index: a stream built anew (as a resumed run
    builds it) checks the saved position and continues with the same batches."""
    dataset = fake_dataset(lengths)
    plan = BatchPlan(lengths, token_budget=512, max_batch_size=4, seed=seed)
    straight = BatchStream(dataset, plan)
    expected = [straight[g] for g in range(stop + 15)]
    state = {"next_index": stop, **straight.identity()}
    resumed = BatchStream(dataset, BatchPlan(lengths, token_budget=512, max_batch_size=4, seed=seed))
    start = resumed.check_state(state)
    for want, got in zip(expected[stop:], (resumed[g] for g in range(start, start + 15))):
        assert (want.epoch, want.index, want.indices) == (got.epoch, got.index, got.indices)
        assert torch.equal(want.input_ids, got.input_ids) and torch.equal(want.loss_mask, got.loss_mask)


def test_stream_walks_epochs_in_order():
    lengths = [5, 60, 60, 130, 7, 300, 20, 20, 90, 250] * 3
    plan = BatchPlan(lengths, token_budget=600, max_batch_size=3, seed=0)
    stream = BatchStream(fake_dataset(lengths), plan)
    n = plan.num_batches
    seen = [(stream[g].epoch, stream[g].index) for g in range(2 * n)]
    assert seen == [(0, i) for i in range(n)] + [(1, i) for i in range(n)]
    assert [stream.epoch_of(g) for g in (0, n - 1, n, 2 * n)] == [0, 0, 1, 2]


def test_collate_and_stats_against_naive_padding():
    lengths = [3, 9, 4]
    dataset = fake_dataset(lengths, seed=5)
    input_ids, loss_mask, lengths_B = collate(dataset, np.array([2, 0, 1]), 12, pad_id=7)
    for row, i in enumerate([2, 0, 1]):
        ids, mask = dataset[i]["input_ids"], dataset[i]["loss_mask"]
        assert input_ids[row].tolist() == ids + [7] * (12 - len(ids))
        assert loss_mask[row].tolist() == [bool(m) for m in mask] + [False] * (12 - len(mask))
    assert lengths_B.tolist() == [4, 3, 9] and input_ids.dtype == torch.long and loss_mask.dtype == torch.bool
    plan = BatchPlan(lengths, token_budget=64, max_batch_size=8, boundaries=[16])
    batch = BatchStream(dataset, plan, pad_id=7)[0]
    assert batch.stats() == {"avg_seq_len": 16 / 3, "max_seq_len": 9, "batch_size": 3,
                             "padding_efficiency": 16 / 48}
    assert plan.padding_efficiency() == 16 / 48


def test_quantile_boundaries_and_shapes():
    lengths = list(range(1, 1001))
    assert quantile_boundaries(lengths, 4, 64) == [256, 512, 768, 1024]
    assert quantile_boundaries([5] * 10, 8, 64) == [64]
    plan = BatchPlan(lengths, token_budget=4096, max_batch_size=10, boundaries=[256, 512, 1024, 2048])
    # 256 samples in the first bucket (25 batches of 10, one of 6), 256 in the second (32 of 8),
    # 488 in the third (122 of 4); the empty 2048 bucket needs no warm-up.
    assert plan.shapes == [(10, 256), (6, 256), (8, 512), (4, 1024)]
    small = BatchPlan([3, 3, 3], token_budget=4096, max_batch_size=10, boundaries=[256])
    assert small.shapes == [(3, 256)]  # fewer samples than rows: only the last batch's shape


def test_plan_errors_name_the_fix():
    with pytest.raises(ValueError, match="raise token_budget to >= 1024"):
        BatchPlan([1000], token_budget=512, boundaries=[1024])
    with pytest.raises(ValueError, match="add a boundary >= 900"):
        BatchPlan([900], token_budget=4096, boundaries=[512])
    with pytest.raises(ValueError, match="strictly increasing"):
        BatchPlan([10], boundaries=[64, 32])
    plan = BatchPlan([10, 20], token_budget=64, boundaries=[32])
    stream = BatchStream(fake_dataset([10, 20]), plan)
    other = BatchStream(fake_dataset([10, 20]), BatchPlan([10, 20], token_budget=64, boundaries=[32], seed=9))
    with pytest.raises(ValueError, match="seed: saved 0, now 9"):
        other.check_state({"next_index": 0, **stream.identity()})
    with pytest.raises(ValueError, match="the plan covers 2 samples but the dataset has 3"):
        BatchStream(fake_dataset([10, 20, 30]), plan)
