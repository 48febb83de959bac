"""The mask rule, anchors and block layout against slow, literal references."""

from __future__ import annotations

import pytest
import torch

from conftest import random_packed_row
from dflash_train.core.masks import (
    anchor_candidates,
    anchor_count,
    build_attention_masks,
    build_layout,
    dense_mask,
    document_ids,
    document_starts,
    flex_block_mask,
    layout_block_mask,
    padded_anchor_count,
    sample_anchors,
    step_generator,
)


def brute_force_rule(doc_lengths, T, anchors, B, window=None):
    """The rule in words, as a Python loop: same document, context strictly before the anchor,
    own block only (bidirectional, or causal under a window), context within the window."""
    doc = []
    for d, n in enumerate(doc_lengths):
        doc += [d] * n
    doc += [len(doc_lengths)] * (T - len(doc))
    N = len(anchors)
    out = torch.zeros(N * B, T + N * B, dtype=torch.bool)
    for n, a in enumerate(anchors):
        for qo in range(B):
            q = n * B + qo
            for p in range(T):
                ok = a >= 0 and doc[p] == doc[a] and p < a
                if window is not None:
                    ok = ok and (a + qo) - p < window
                out[q, p] = ok
            for ko in range(B):
                out[q, T + n * B + ko] = ko <= qo if window is not None else True
    return out


def layouts(num_cases=12, B=4):
    gen = torch.Generator().manual_seed(1234)
    for case in range(num_cases):
        num_docs = 1 + case % 4
        pad = (case % 3) * 3
        lengths, loss_mask = random_packed_row(gen, num_docs, pad=pad)
        # Many anchors per document: overlapping blocks and blocks running past document ends.
        anchors = sample_anchors(loss_mask, lengths, num_anchors=6, generator=gen, pad_to_multiple=1 + case % 3)
        yield lengths, loss_mask, anchors, B


@pytest.mark.parametrize("window", [None, 5, 9])
def test_dense_mask_equals_brute_force(window):
    seen_overlap = seen_cut = seen_empty_doc = seen_pad = False
    for lengths, loss_mask, anchors, B in layouts():
        layout = build_layout(anchors, loss_mask, lengths, B)
        T = loss_mask.numel()
        N = anchors.numel()
        got = dense_mask(layout.mask_mod(window), N * B, T + N * B, "cpu")
        want = brute_force_rule(lengths.tolist(), T, anchors.tolist(), B, window)
        assert torch.equal(got, want)
        a = anchors[anchors >= 0]
        seen_overlap |= bool(((a[1:] - a[:-1]) < B).any())
        seen_cut |= bool((~layout.valid_NB[:, 1:] & (anchors >= 0)[:, None]).any())
        seen_pad |= bool((anchors < 0).any())
        docs_with_anchor = set(document_ids(lengths, T)[a].tolist())
        seen_empty_doc |= len(docs_with_anchor) < len(lengths)
    assert seen_overlap and seen_cut and seen_empty_doc and seen_pad, "cases must cover the corners"


def _tiles(bm, kind):
    """Set of (q_tile, kv_tile) pairs a BlockMask lists as partial ('kv') or full ('full_kv')."""
    num = getattr(bm, f"{kind}_num_blocks")[0, 0]
    idx = getattr(bm, f"{kind}_indices")[0, 0]
    return {(i, int(j)) for i in range(num.numel()) for j in idx[i, : int(num[i])]}


@pytest.mark.parametrize("window", [None, 6])
def test_flex_block_mask_equals_brute_force(window):
    tile = 8
    for lengths, loss_mask, anchors, B in layouts(num_cases=6):
        layout = build_layout(anchors, loss_mask, lengths, B)
        T, N = loss_mask.numel(), anchors.numel()
        Q, KV = N * B, T + N * B
        bm = flex_block_mask(layout.mask_mod(window), Q, KV, "cpu", block=tile)
        want = brute_force_rule(lengths.tolist(), T, anchors.tolist(), B, window)
        # Pad to whole tiles (flex treats out-of-range rows/columns as masked).
        qt, kt = -(-Q // tile), -(-KV // tile)
        padded = torch.zeros(qt * tile, kt * tile, dtype=torch.bool)
        padded[:Q, :KV] = want
        inside = torch.zeros_like(padded)
        inside[:Q, :KV] = True
        tiles = padded.view(qt, tile, kt, tile)
        any_t = tiles.any(dim=(1, 3))
        all_t = (tiles | ~inside.view(qt, tile, kt, tile)).all(dim=(1, 3)) & inside.view(qt, tile, kt, tile).all(dim=(1, 3))
        partial, full = _tiles(bm, "kv"), _tiles(bm, "full_kv")
        assert partial.isdisjoint(full)
        assert partial | full == {(i, j) for i in range(qt) for j in range(kt) if any_t[i, j]}
        assert full == {(i, j) for i in range(qt) for j in range(kt) if all_t[i, j]}
        # Inside partial tiles, flex evaluates the same mask_mod the dense mask comes from.
        assert torch.equal(dense_mask(bm.mask_mod, Q, KV, "cpu"), want)


def _varied_layouts(num_cases):
    """Several documents, padding past them, block sizes that do and do not divide the tile,
    anchor lists padded with -1 to a multiple or to a multiple x 2^k."""
    gen = torch.Generator().manual_seed(99)
    for case in range(num_cases):
        lengths, loss_mask = random_packed_row(gen, 1 + case % 5, max_len=40, pad=case % 7)
        B = (4, 3, 5, 16)[case % 4]
        anchors = sample_anchors(loss_mask, lengths, num_anchors=5, generator=gen,
                                 pad_to_multiple=1 + case % 3, buckets_per_doubling=(0, 1, 4)[case % 3])
        yield build_layout(anchors, loss_mask, lengths, B)


def test_padded_anchor_counts_by_buckets_per_doubling():
    """Padded counts are >= n and a multiple of `multiple`; s = 1 gives multiple x a power of
    two (the old rule); s per doubling gives at most s sizes in each (2^k, 2^(k+1)] multiples
    and wastes less than 1/s of the padded count beyond the multiple's own rounding."""
    for multiple in (1, 8, 64):
        for s in (0, 1, 2, 4, 8):
            sizes_by_octave: dict[int, set[int]] = {}
            for n in range(0, 5000, 7):
                got = padded_anchor_count(n, multiple, s)
                m = max(1, -(-n // multiple))
                assert got % multiple == 0 and got >= max(n, multiple)
                if s == 0:
                    assert got == multiple * m
                elif s == 1:
                    assert got == multiple * (1 << (m - 1).bit_length())
                if s >= 1 and m > s:
                    assert (got - multiple * m) < got / s, (n, multiple, s, got)
                    sizes_by_octave.setdefault((m - 1).bit_length(), set()).add(got)
            assert all(len(v) <= max(1, s) for v in sizes_by_octave.values()), (multiple, s)
    assert padded_anchor_count(5780, 64, 1) == 8192 and padded_anchor_count(5780, 64, 4) == 6144


def _expand(tiles_QK, tile, Q, KV):
    return tiles_QK.repeat_interleave(tile, 0).repeat_interleave(tile, 1)[:Q, :KV]


@pytest.mark.parametrize("window", [None, 3, 11])
def test_layout_block_mask_is_an_exact_index_of_the_rule(window):
    """The BlockMask read off the layout lists exactly the tiles create_block_mask finds by
    evaluating the rule everywhere (partial and full, both directions), and what flex would
    attend with it (the rule inside partial tiles, everything inside full ones) is the dense
    mask."""
    tile = 8
    seen_full = seen_pad = False
    for layout in _varied_layouts(24):
        Q = layout.num_blocks * layout.block_size
        KV = layout.num_ctx + Q
        got = layout_block_mask(layout, window, block=tile)
        ref = flex_block_mask(layout.mask_mod(window), Q, KV, "cpu", block=tile)
        assert got.seq_lengths == ref.seq_lengths == (Q, KV)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), name
        partial, full = (torch.zeros(got.kv_indices.shape[-2:], dtype=torch.bool) for _ in range(2))
        for tiles, kind in ((partial, "kv"), (full, "full_kv")):
            for i, j in _tiles(got, kind):
                tiles[i, j] = True
        assert not (partial & full).any()
        assert torch.equal(got.to_dense()[0, 0].bool(), partial | full)
        dense = dense_mask(layout.mask_mod(window), Q, KV, "cpu")
        attended = (_expand(partial, tile, Q, KV) & dense_mask(got.mask_mod, Q, KV, "cpu")) | _expand(full, tile, Q, KV)
        assert torch.equal(attended, dense)
        seen_full |= bool(full.any())
        seen_pad |= bool((layout.anchors_N < 0).any())
    assert seen_full and seen_pad, "cases must cover full tiles and padding blocks"


def test_layout_block_mask_tiles_at_training_size():
    """At 128-row tiles on a row of realistic size: kept tiles are the ones holding a visible
    pair of the dense mask, full tiles the ones all of whose pairs are visible."""
    gen = torch.Generator().manual_seed(5)
    lengths = torch.tensor([700, 37, 1200, 300])
    T = int(lengths.sum()) + 51
    loss_mask = torch.rand(T, generator=gen) < 0.7
    anchors = sample_anchors(loss_mask, lengths, 40, generator=gen, pad_to_multiple=16, buckets_per_doubling=1)
    layout = build_layout(anchors, loss_mask, lengths, 16)
    Q = layout.num_blocks * 16
    KV = T + Q
    for window in (None, 300):
        bm = layout_block_mask(layout, window)
        dense = dense_mask(layout.mask_mod(window), Q, KV, "cpu")
        nq, nkv = -(-Q // 128), -(-KV // 128)
        padded = torch.zeros(nq * 128, nkv * 128, dtype=torch.bool)
        padded[:Q, :KV] = dense
        sums = padded.view(nq, 128, nkv, 128).sum(dim=(1, 3))
        assert _tiles(bm, "kv") | _tiles(bm, "full_kv") == {tuple(ij) for ij in (sums > 0).nonzero().tolist()}
        assert _tiles(bm, "full_kv") == {tuple(ij) for ij in (sums == 128 * 128).nonzero().tolist()}
        assert _tiles(bm, "full_kv"), "a row this long must have full tiles"


def test_build_attention_masks_one_per_layer_kind():
    gen = torch.Generator().manual_seed(0)
    lengths, loss_mask = random_packed_row(gen, 3)
    anchors = sample_anchors(loss_mask, lengths, 4, gen)
    layout = build_layout(anchors, loss_mask, lengths, 4)
    kinds = ["full_attention", "sliding_attention", "full_attention"]
    masks = build_attention_masks(layout, kinds, sliding_window=7, backend="sdpa")
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert not torch.equal(masks["full_attention"], masks["sliding_attention"])
    with pytest.raises(ValueError, match="backend"):
        build_attention_masks(layout, kinds, 7, backend="eager")


def _valid_anchor_positions(loss_mask, lengths):
    doc = document_ids(lengths, loss_mask.numel())
    ok = torch.zeros_like(loss_mask)
    ok[:-1] = loss_mask[:-1] & loss_mask[1:] & (doc[:-1] == doc[1:])
    return ok, doc


def test_anchors_are_valid_sorted_per_document_and_reproducible():
    gen = torch.Generator().manual_seed(7)
    for case in range(40):
        lengths, loss_mask = random_packed_row(gen, 1 + case % 5, max_len=40, pad=case % 4)
        k = 1 + case % 6
        anchors = sample_anchors(loss_mask, lengths, k, step_generator(3, case))
        again = sample_anchors(loss_mask, lengths, k, step_generator(3, case))
        assert torch.equal(anchors, again)
        ok, doc = _valid_anchor_positions(loss_mask, lengths)
        if not ok.any():  # nothing to anchor on: exactly one padding block
            assert anchors.tolist() == [-1]
            continue
        assert bool(ok[anchors].all())
        assert torch.equal(anchors, anchors.sort().values) and anchors.unique().numel() == anchors.numel()
        per_doc = torch.bincount(doc[anchors], minlength=len(lengths) + 1)
        avail = torch.bincount(doc[ok], minlength=len(lengths) + 1)
        assert torch.equal(per_doc, torch.minimum(avail, torch.full_like(avail, k)))


def test_short_document_keeps_its_anchors_next_to_a_long_one():
    lengths = torch.tensor([2000, 12])
    loss_mask = torch.ones(2012, dtype=torch.bool)
    anchors = sample_anchors(loss_mask, lengths, num_anchors=8, generator=step_generator(0, 0))
    assert int((anchors >= 2000).sum()) == 8
    assert int((anchors < 2000).sum()) == 8


def test_anchors_cover_positions_uniformly():
    lengths = torch.tensor([20])
    loss_mask = torch.ones(20, dtype=torch.bool)
    counts = torch.zeros(20)
    for step in range(2000):
        counts[sample_anchors(loss_mask, lengths, 3, step_generator(1, step))] += 1
    # 19 valid positions (the last has no successor), each drawn with probability 3/19.
    assert counts[19] == 0
    expected = 2000 * 3 / 19
    assert ((counts[:19] - expected).abs() < 0.25 * expected).all()
    assert not torch.equal(
        sample_anchors(loss_mask, lengths, 3, step_generator(1, 0)),
        sample_anchors(loss_mask, lengths, 3, step_generator(1, 1)),
    ) or not torch.equal(
        sample_anchors(loss_mask, lengths, 3, step_generator(1, 0)),
        sample_anchors(loss_mask, lengths, 3, step_generator(1, 2)),
    )


def test_layout_labels_positions_and_cuts():
    lengths = torch.tensor([6, 5])
    input_ids = torch.arange(100, 111)
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    anchors = torch.tensor([3, 4, 7, -1])
    layout = build_layout(anchors, loss_mask, lengths, block_size=4)
    assert layout.block_input_ids(input_ids, 99).view(4, 4).tolist() == [
        [103, 99, 99, 99], [104, 99, 99, 99], [107, 99, 99, 99], [100, 99, 99, 99]
    ]
    # Block at 3 in doc 0 (positions 0..5): predicts 4, 5; 6 is past the document end.
    assert layout.valid_NB.tolist() == [
        [False, True, True, False],
        [False, True, False, False],
        [False, True, False, True],  # doc 1 = positions 6..10; position 9 unsupervised
        [False, False, False, False],  # padding block
    ]
    labels = layout.labels(input_ids).view(4, 4)
    assert labels[0, 1:3].tolist() == [104, 105] and labels[2, 1].tolist() == 108 and labels[2, 3] == 110
    assert layout.rope_block_NB[2].tolist() == [1, 2, 3, 4]
    assert layout.position_ids()[0, :11].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]


def test_anchor_counts_fall_in_power_of_two_buckets():
    gen = torch.Generator().manual_seed(3)
    seen = set()
    for case in range(30):
        lengths, loss_mask = random_packed_row(gen, 1 + case % 6, max_len=60)
        anchors = sample_anchors(loss_mask, lengths, 20, step_generator(0, case), pad_to_multiple=4, buckets_per_doubling=1)
        n = anchors.numel()
        real = int((anchors >= 0).sum())
        assert n in (4, 8, 16, 32, 64, 128) and (n == 4 or real > n // 2), (n, real)
        seen.add(n)
    assert len(seen) >= 3


def test_document_ids_with_total_len_equal_repeat_interleave():
    """The sync-free form (searchsorted) gives the repeat_interleave ids, zero-length documents
    skipped and padding past the documents given the id len(doc_lengths)."""
    gen = torch.Generator().manual_seed(11)
    for case in range(50):
        lengths = torch.randint(0, 6, (case % 7,), generator=gen)
        lengths[torch.rand(lengths.shape, generator=gen) < 0.3] = 0
        total = int(lengths.sum()) + case % 4
        ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        want = torch.cat([ids, torch.full((total - ids.numel(),), len(lengths))])
        got = document_ids(lengths, total)
        assert got.dtype == torch.long and torch.equal(got, want), (lengths.tolist(), total)
        assert torch.equal(document_ids(lengths), ids)
    with pytest.raises(ValueError, match="total_len"):
        document_ids(torch.tensor([3, 4]), 6)


def test_aligned_documents_start_at_multiples_with_their_gaps_counted_before():
    """align > 1 (produce.pack's placement where the row has room): each document starts at a
    multiple of it, the gap after a document has its id, positions past the last document's
    end the padding id; zero-length documents hold no position. Against a naive loop."""
    gen = torch.Generator().manual_seed(12)
    for case in range(40):
        align = (2, 4, 8, 128)[case % 4]
        lengths = torch.randint(0, 20, (1 + case % 6,), generator=gen)
        lengths[torch.rand(lengths.shape, generator=gen) < 0.2] = 0
        starts, ids, pos = [], [], 0
        for r, n in enumerate(lengths.tolist()):
            starts.append(pos)
            stride = -(-n // align) * align
            ids += [r] * (stride if r < len(lengths) - 1 else n)
            pos += stride
        end = starts[-1] + int(lengths[-1])
        total = end + case % 5
        assert document_starts(lengths, align).tolist() == starts + [end]
        want = torch.tensor(ids + [len(lengths)] * (total - end))
        assert torch.equal(document_ids(lengths, total, align), want), (lengths.tolist(), align)
        assert document_starts(lengths, 1).tolist() == [0] + torch.cumsum(lengths, 0).tolist()
    assert document_ids(torch.tensor([3, 4]), 12, align=8).tolist() == [0] * 8 + [1] * 4  # ends at 12: fits
    with pytest.raises(ValueError, match="total_len"):
        document_ids(torch.tensor([3, 5]), 12, align=8)
    with pytest.raises(ValueError, match="needs total_len"):
        document_ids(torch.tensor([3, 4]), align=8)


def _padded_batch(lengths, loss_mask_T):
    """The [b, L] loss mask a packed row came from (its padding True: anchor_count must read
    only each row's first lengths[r] positions)."""
    L = int(lengths.max())
    mask_bL = torch.ones(len(lengths), L, dtype=torch.bool)
    for r, (start, n) in enumerate(zip((torch.cumsum(lengths, 0) - lengths).tolist(), lengths.tolist())):
        mask_bL[r, :n] = loss_mask_T[start:start + n]
    return mask_bL


def _packed_batches(num_cases, seed):
    gen = torch.Generator().manual_seed(seed)
    for case in range(num_cases):
        lengths, loss_mask = random_packed_row(gen, 1 + case % 6, max_len=30, pad=case % 5)
        yield case, lengths, loss_mask, _padded_batch(lengths, loss_mask)


def test_anchor_count_is_the_number_of_real_anchors_sample_anchors_draws():
    seen_empty = seen_capped = seen_uncapped = False
    for seed in (0, 1, 2):
        for case, lengths, loss_mask, mask_bL in _packed_batches(40, seed):
            k = (1, 2, 5, 50)[case % 4]
            _, n = sample_anchors(loss_mask, lengths, k, step_generator(seed, case), return_count=True)
            assert anchor_count(mask_bL, lengths, k) == n, (seed, case)
            doc = document_ids(lengths, loss_mask.numel())
            ok = anchor_candidates(loss_mask, doc)
            per_doc = torch.bincount(doc[ok], minlength=len(lengths))[: len(lengths)]
            seen_empty |= bool((per_doc == 0).any())
            seen_capped |= bool((per_doc > k).any())
            seen_uncapped |= bool(((per_doc > 0) & (per_doc < k)).any())
    assert seen_empty and seen_capped and seen_uncapped, "cases must cover the corners"


@pytest.mark.parametrize("multiple", [1, 8])
@pytest.mark.parametrize("buckets", [0, 1, 4])
def test_sample_anchors_with_a_host_count_equal_the_synced_ones(multiple, buckets):
    """With the count known on the host (nonzero_static, no host sync) the very same tensor."""
    for case, lengths, loss_mask, mask_bL in _packed_batches(30, 5):
        k = (1, 3, 40)[case % 3]
        count = anchor_count(mask_bL, lengths, k)
        kw = dict(pad_to_multiple=multiple, buckets_per_doubling=buckets, return_count=True)
        want, n = sample_anchors(loss_mask, lengths, k, step_generator(9, case), **kw)
        got, m = sample_anchors(loss_mask, lengths, k, step_generator(9, case), count=count, **kw)
        assert got.dtype == want.dtype and torch.equal(got, want) and m == n == count, case


@pytest.mark.parametrize("align", [0, 128])
def test_flex_timing_counts_the_block_masks_tiles_by_kind(align):
    """scripts/flex_timing.py --tiles (the tile counts docs/PERFORMANCE.md quotes) against the
    dense rule read tile by tile: kept and full tiles, split into context keys and the blocks'
    own keys; with the documents back to back and on tile boundaries (--align 128)."""
    import argparse
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "flex_timing.py"
    spec = importlib.util.spec_from_file_location("flex_timing", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = argparse.Namespace(tokens=1024, min_length=96, max_length=400, anchors=24, block_size=16, seed=1,
                              align=align)
    layout, _ = script.packed_row(args, torch.device("cpu"))
    counts = script.tile_counts(layout_block_mask(layout), layout.num_ctx)

    T, Q = layout.num_ctx, layout.num_blocks * layout.block_size
    assert T % 128 == 0 and Q % 128 == 0  # whole tiles: a tile is full iff all its pairs are visible
    nq, nkv = Q // 128, (T + Q) // 128
    tiles = dense_mask(layout.mask_mod(), Q, T + Q, "cpu").view(nq, 128, nkv, 128)
    kept = tiles.any(dim=3).any(dim=1)
    full = tiles.all(dim=3).all(dim=1)
    j = torch.arange(nkv)
    context, own = (j + 1) * 128 <= T, j * 128 >= T
    expected = {}
    for kind, mask in (("partial", kept & ~full), ("full", full)):
        expected[f"context_{kind}"] = int(mask[:, context].sum())
        expected[f"block_own_{kind}"] = int(mask[:, own].sum())
        expected[f"straddling_{kind}"] = int(mask[:, ~context & ~own].sum())
    assert counts == expected
    assert counts["block_own_partial"] > 0 and counts["context_full"] > 0
