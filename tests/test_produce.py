"""The target side of a step: feature noise, packing against a naive loop, and split fc layers
giving the drafter the very features the target side would have."""

from __future__ import annotations

import pytest
import torch

from conftest import SimulatedGraphs
from dflash_train.core.masks import DOC_ALIGN, sample_anchors, step_generator
from dflash_train.data.batching import Batch
from dflash_train.train.produce import FeatureNoise, Packing, Producer, add_feature_noise, context_features, pack


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
    # bf16 features (a GPU run's) stay bf16: each sum of the feature and its float32 noise is
    # rounded once, so it is the nearest bf16 to the exact sum.
    b = torch.randn(2000, 8, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    noised = add_feature_noise(b, "uniform", 0.05, step_generator(0, 1))
    noise32 = torch.empty(b.shape).uniform_(-0.05, 0.05, generator=step_generator(0, 1))
    assert noised.dtype == torch.bfloat16 and torch.equal(noised, (b.float() + noise32).to(torch.bfloat16))
    assert 0.045 < (noised.float() - b.float()).abs().max() < 0.06


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
    assert not s.loss_mask_T[T:].any() and not s.input_ids_T[T:].any() and s.doc_align == 1
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


def test_pack_starts_every_row_at_a_tile_where_they_all_fit():
    """Where the packed row has room, row r starts at a multiple of masks.DOC_ALIGN (the gaps
    zero, unsupervised); one token short of room, they go back to back. Against a naive loop,
    labels and the target's final state included."""
    gen = torch.Generator().manual_seed(3)
    lengths, L = [5, 12, 1, 9], 12
    batch, taps, greedy = random_batch(gen, lengths, L, taps=2, H=4)
    final_bLH = torch.randn(len(lengths), L, 6, generator=gen)
    noise = FeatureNoise("none", 0.0, seed=7, device=torch.device("cpu"))
    room = 3 * DOC_ALIGN + lengths[-1]  # the last row starts at 3 tiles and ends here
    s = pack(batch, 4, torch.cat(taps, dim=-1), final_bLH, room, noise)
    assert s.doc_align == DOC_ALIGN and s.num_tokens == sum(lengths) and s.doc_lengths.tolist() == lengths
    ids, mask, feats, hidden = (torch.zeros(room, dtype=torch.long), torch.zeros(room, dtype=torch.bool),
                                torch.zeros(room, 8), torch.zeros(room, 6))
    labels = torch.zeros(room, dtype=torch.long)
    for r, n in enumerate(lengths):
        for p in range(n):
            q = r * DOC_ALIGN + p
            ids[q], mask[q] = batch.input_ids[r, p], batch.loss_mask[r, p]
            labels[q] = batch.input_ids[r, 0] if p == 0 else greedy[r, p - 1]
            feats[q] = torch.cat([t[r, p] for t in taps])
    greedy_labels = pack(batch, 4, torch.cat(taps, dim=-1), greedy, room, noise).labels_T
    for r, n in enumerate(lengths):
        for p in range(n):
            hidden[r * DOC_ALIGN + p] = final_bLH[r, max(p - 1, 0)]
    assert torch.equal(s.input_ids_T, ids) and torch.equal(s.loss_mask_T, mask)
    assert torch.equal(s.features, feats) and torch.equal(s.target_hidden_TH, hidden)
    assert torch.equal(greedy_labels, labels) and torch.equal(s.labels_T, ids)
    tight = pack(batch, 4, torch.cat(taps, dim=-1), greedy, room - 1, noise)
    assert tight.doc_align == 1 and torch.equal(tight.input_ids_T[:sum(lengths)], ids[ids != 0])


def test_a_row_aligned_or_back_to_back_gives_the_drafter_the_same_blocks():
    """The drafter trains on the same thing whichever way `pack` placed the documents: every
    anchor, block label, loss position and rope position, and the drafter's output at every
    block row (dense masks of the mask rule, every anchor the rule allows)."""
    from conftest import tiny_drafter
    from dflash_train.core.masks import build_attention_masks, build_layout

    gen = torch.Generator().manual_seed(5)
    lengths, L = [17, 9, 30, 4, 23], 30
    d = tiny_drafter(num_layers=2, block_size=4)
    F = d.fc.in_features
    ids = torch.randint(1, 127, (len(lengths), L), generator=gen)
    loss_mask = torch.rand(len(lengths), L, generator=gen) < 0.7
    for r, n in enumerate(lengths):
        ids[r, n:], loss_mask[r, n:] = 0, False
    batch = Batch(ids, loss_mask, torch.tensor(lengths), list(range(len(lengths))), 0, 0)
    features = torch.randn(len(lengths), L, F, generator=gen)
    embed = torch.randn(128, d.config.hidden_size, generator=gen)
    noise = FeatureNoise("none", 0.0, seed=0, device=torch.device("cpu"))
    outputs = []
    for pad_to in (sum(lengths), 5 * DOC_ALIGN):
        s = pack(batch, 0, features, None, pad_to, noise)
        assert s.doc_align == (1 if pad_to == sum(lengths) else DOC_ALIGN)
        anchors = sample_anchors(s.loss_mask_T, s.doc_lengths, 10**6, step_generator(0, 0), align=s.doc_align)
        layout = build_layout(anchors, s.loss_mask_T, s.doc_lengths, d.block_size, s.doc_align)
        masks = build_attention_masks(layout, d.layer_types, d.config.sliding_window, "sdpa")
        with torch.no_grad():
            hidden = d(s.features[None], embed[layout.block_input_ids(s.input_ids_T, d.mask_token_id)][None],
                       layout.position_ids(), attention_mask=masks)[0]
        outputs.append((anchors.numel(), layout.labels(s.labels_T), layout.valid_NB, layout.rope_block_NB, hidden))
    (n0, *rest0), (n1, *rest1) = outputs
    assert n0 == n1 > 20
    for a, b in zip(rest0[:-1], rest1[:-1]):
        assert torch.equal(a, b)
    torch.testing.assert_close(rest0[-1], rest1[-1], rtol=1e-5, atol=1e-5)


def test_pack_ships_the_targets_final_state_shifted_to_the_token_it_predicts():
    """labels=distill: position p carries the target's final state at p - 1 of the same row (a
    document's first position its own); the labels stay the data; nothing of it is noised."""
    gen = torch.Generator().manual_seed(1)
    lengths, L, pad_to = [5, 12, 1, 9], 12, 40
    batch, taps, _ = random_batch(gen, lengths, L, taps=2, H=4)
    final_bLH = torch.randn(len(lengths), L, 6, generator=gen)
    noise = FeatureNoise("uniform", 0.05, seed=7, device=torch.device("cpu"))
    s = pack(batch, 3, torch.cat(taps, dim=-1), final_bLH, pad_to, noise)
    want = [final_bLH[r, max(p - 1, 0)] for r, n in enumerate(lengths) for p in range(n)]
    T = sum(lengths)
    assert s.target_hidden_TH.shape == (pad_to, 6) and torch.equal(s.target_hidden_TH[:T], torch.stack(want))
    assert not s.target_hidden_TH[T:].any() and torch.equal(s.labels_T, s.input_ids_T)
    assert pack(batch, 3, taps, None, pad_to, noise).target_hidden_TH is None


class _FakeP2P:
    """torch.distributed's isend / irecv between two ends of one process: sends queue copies,
    receives pop them in order (what gloo does between two ranks)."""

    class Work:
        def wait(self, *args):
            return True

    def __init__(self):
        self.queue = []

    def isend(self, tensor, dst):
        self.queue.append(tensor.clone())
        return self.Work()

    def irecv(self, tensor, src):
        tensor.copy_(self.queue.pop(0))
        return self.Work()


class _FakeDist:
    device = torch.device("cpu")
    target_ranks = producers = [0]

    def wait(self, work, what):
        return work.wait()

    def name(self, rank=None):
        return f"rank {rank}"


@pytest.mark.parametrize("split", [False, True])
def test_transport_carries_the_targets_final_state(monkeypatch, split):
    """The wire format round trip of a distillation shipment (features, final state, ids, mask,
    labels, documents, statistics, anchor count), with and without split fc layers, and of a
    plain one after it on the same receiver (the final state's buffer is not sent, the anchor
    count is unknown)."""
    import torch.distributed

    from dflash_train.train.transport import Receiver, Sender

    p2p = _FakeP2P()
    monkeypatch.setattr(torch.distributed, "isend", p2p.isend)
    monkeypatch.setattr(torch.distributed, "irecv", p2p.irecv)
    gen = torch.Generator().manual_seed(2)
    lengths, L = [5, 12, 9], 12
    batch, taps, _ = random_batch(gen, lengths, L, taps=3, H=4)
    final_bLH = torch.randn(len(lengths), L, 4, generator=gen).to(torch.bfloat16)
    noise = FeatureNoise("uniform", 0.05, seed=7, device=torch.device("cpu"))
    sender, receiver = Sender(_FakeDist(), queue_depth=2), Receiver(_FakeDist())
    for index, final, count, pad_to in ((5, final_bLH, 7, 32), (6, None, None, 2 * DOC_ALIGN + 9)):
        sent = pack(batch, index, taps if split else torch.cat(taps, dim=-1), final, pad_to, None if split else noise)
        sent.anchor_count = count
        sender.send(1, sent)
        got = receiver.recv(0, index)
        assert not got.failed and got.index == index and got.num_tokens == sent.num_tokens
        assert got.anchor_count == count
        assert got.doc_align == sent.doc_align == (1 if pad_to == 32 else DOC_ALIGN)
        for name in ("input_ids_T", "loss_mask_T", "labels_T", "doc_lengths"):
            assert torch.equal(getattr(got, name), getattr(sent, name)), name
        assert torch.equal(context_features(got, noise), context_features(sent, noise))
        if final is None:
            assert got.target_hidden_TH is None
        else:
            assert got.target_hidden_TH.dtype == torch.bfloat16 and torch.equal(got.target_hidden_TH, sent.target_hidden_TH)
    assert not p2p.queue


def test_producer_ships_the_anchor_count_sample_anchors_draws():
    """With num_anchors the producer counts the anchors on the host (the drafter step then
    needs no host sync); a failed target forward ships no count, nor does a producer without it."""
    gen = torch.Generator().manual_seed(3)
    batch, taps, _ = random_batch(gen, [5, 12, 1, 9], 12, taps=1, H=4)

    class Target:
        fail = False

        def capture(self, ids, concat=True):
            if self.fail:
                raise RuntimeError("out of memory")
            return taps[0], None

    class Faults:
        def target_forward(self, step):
            pass

    class Timer:
        def mark(self, stage):
            pass

    target = Target()
    kw = dict(noise=None, faults=Faults(), timer=Timer(), log=lambda msg: None)
    cpu = torch.device("cpu")
    for k, pad_to in ((1, 40), (2, 40), (8, 40), (2, 4 * DOC_ALIGN), (8, 4 * DOC_ALIGN)):
        s = Producer(target, None, Packing(cpu, pad_to, num_anchors=k), **kw).produce(4, batch)
        assert s.doc_align == (1 if pad_to == 40 else DOC_ALIGN)
        _, n = sample_anchors(s.loss_mask_T, s.doc_lengths, k, step_generator(0, 4), return_count=True,
                              align=s.doc_align)
        assert s.anchor_count == n > 0
    assert Producer(target, None, Packing(cpu, 40), **kw).produce(4, batch).anchor_count is None
    target.fail = True
    assert Producer(target, None, Packing(cpu, 40, num_anchors=2), **kw).produce(4, batch).anchor_count is None


def test_capture_runs_causal_attention_without_the_packed_sequence_check(monkeypatch):
    """Target.capture runs the layers with the engine's causal attention: the features (and the
    greedy labels) of right-padded rows are those of the model's own SDPA path, and transformers'
    packed-sequence check (a host sync on a GPU, once per target forward) is never reached. A
    target with sliding-window layers keeps its own attention (its mask is more than causal)."""
    import transformers.masking_utils as masking_utils
    from transformers import AutoModelForCausalLM, MistralConfig

    from conftest import tiny_target_config
    from dflash_train.core.attention import CAUSAL_ATTENTION
    from dflash_train.core.target import Target

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_target_config(), attn_implementation="sdpa").eval()
    target = Target(model, [1, 3, 5], labels="target")
    assert target.attention == CAUSAL_ATTENTION
    ids = torch.randint(1, 128, (3, 20))
    ids[1, 12:] = 0  # right padding
    with torch.no_grad():
        reference = model(input_ids=ids, output_hidden_states=True)
    assert model.config._attn_implementation == "sdpa"

    def no_check(position_ids):
        raise AssertionError("the packed-sequence check ran")

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", no_check)
    features, greedy = target.capture(ids)
    assert model.config._attn_implementation == "sdpa"  # restored after the capture
    expected = torch.cat([reference.hidden_states[i + 1] for i in (1, 3, 5)], dim=-1)
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(greedy, reference.logits.argmax(-1))

    sliding = AutoModelForCausalLM.from_config(
        MistralConfig(**{**tiny_target_config().to_dict(), "sliding_window": 8}), attn_implementation="sdpa")
    assert Target(sliding.eval(), [1], labels="data").attention is None


class _OutsidePoolGraphs(SimulatedGraphs):
    """Simulated graphs whose outputs live outside the graphs' pool (GraphedTarget writes them
    into its own buffers): a replay rewrites them and nothing else."""

    scribble = False


def _graphed(monkeypatch, target, log=None):
    from dflash_train.train import graphed_target
    from dflash_train.train.graphed_target import GraphedTarget

    monkeypatch.setattr(graphed_target, "Graphs", _OutsidePoolGraphs)
    return GraphedTarget(target, torch.device("cpu"), (log if log is not None else []).append)


@pytest.mark.parametrize("labels", ["data", "target", "distill"])
def test_graphed_target_returns_the_eager_forward(monkeypatch, labels):
    """target.GraphedTarget through simulated graphs (a replay runs the captured step again on
    its static inputs): each prepared shape's replay gives the eager forward's outputs, with new
    ids on every call, a bucket's last batch (fewer rows) included; per-tap features (split fc)
    are graphs of their own; a shape not prepared runs eagerly and captures nothing; and what a
    call returned stays intact when later calls replay graphs that write the same buffers."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_target_config
    from dflash_train.core.target import Target

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_target_config(), attn_implementation="sdpa").eval()
    target = Target(model, [1, 3, 5], labels=labels)
    logged = []
    graphed = _graphed(monkeypatch, target, logged)
    graphed.prepare([(4, 16), (3, 16), (2, 32)], concat=True)
    graphed.prepare([(2, 32)], concat=False)
    assert sorted(graphed.steps) == [(2, 32, False), (2, 32, True), (3, 16, True), (4, 16, True)]
    assert graphed.graphs.num_captured == 4
    gen = torch.Generator().manual_seed(1)
    kept = []
    for shape, concat in (((4, 16), True), ((4, 16), True), ((3, 16), True), ((2, 32), False), ((1, 32), False),
                          ((2, 32), True), ((2, 24), True), ((4, 16), True)):
        ids = torch.randint(1, 128, shape, generator=gen)
        got = graphed.capture(ids, concat)
        want = target.capture(ids, concat)
        kept.append((shape, concat, want, got))
    assert graphed.graphs.num_captured == 4  # (1, 32) and (2, 24) ran eagerly
    for shape, concat, want, got in kept:  # read after every call: earlier results stay intact
        assert isinstance(want[0], list) == isinstance(got[0], list) == (not concat)
        for a, b in zip(want, got):
            assert (a is None) == (b is None)
            if a is None:
                continue
            for x, y in zip(*((t if isinstance(t, list) else [t]) for t in (a, b))):
                assert x.shape == y.shape and x.shape[:2] == shape, (shape, concat)
                assert torch.equal(x, y), (shape, concat)
    assert not logged and graphed.refused is None


def test_graphed_target_captures_nothing_when_its_forward_waits_on_the_gpu(monkeypatch):
    """A forward that makes the host wait for the GPU cannot be captured: the warm-up's check
    (CUDA's sync debug mode raises at the wait; here the forward raises as that check would)
    leaves the whole target to the eager forward, with the same results, and the log says so
    once; a later prepare captures nothing either."""

    class Waiting:
        calls = 0

        def capture(self, ids, concat=True):
            self.calls += 1
            if self.calls == 2:  # the check: the forward's second run, after the warm-up's
                raise RuntimeError("called a synchronizing CUDA operation\nmore detail")
            return ids[..., None].float() * 2, None

    logged = []
    target = Waiting()
    graphed = _graphed(monkeypatch, target, logged)
    graphed.prepare([(2, 8)])
    graphed.prepare([(1, 16)])
    assert graphed.refused == "called a synchronizing CUDA operation" and not graphed.steps
    assert len(logged) == 1 and "makes the host wait" in logged[0] and "without graphs" in logged[0]
    ids = torch.randint(0, 9, (2, 8))
    features, head = graphed.capture(ids)
    assert head is None and torch.equal(features, ids[..., None].float() * 2)
    assert graphed.graphs.num_captured == 0


def test_graphed_target_stops_the_warm_up_when_a_capture_fails(monkeypatch):
    """A capture that fails although the forward passed the check stops the warm-up with an
    error that names the shape and the switch (the process's CUDA state cannot be trusted after
    a failed capture, so there is no quiet fallback)."""
    from dflash_train.core.errors import InputError
    from dflash_train.train import graphed_target
    from dflash_train.train.graphed_target import GraphedTarget

    class Target:
        def capture(self, ids, concat=True):
            return ids[..., None].float() * 2, None

    class Failing(_OutsidePoolGraphs):
        def _record(self, fn, static):
            if static[0].shape[1] == 8:
                raise RuntimeError("operation not permitted when stream is capturing\nmore detail")
            return super()._record(fn, static)

    monkeypatch.setattr(graphed_target, "Graphs", Failing)
    graphed = GraphedTarget(Target(), torch.device("cpu"))
    with pytest.raises(InputError, match=r"shape \(2, 8\).*operation not permitted when stream is capturing\); "
                                         r"set target.cuda_graphs=false"):
        graphed.prepare([(1, 16), (2, 8)])


@pytest.mark.parametrize("split_fc", [False, True])
def test_producer_warm_up_prepares_a_graphed_target_for_its_capture(split_fc):
    """The producer's warm-up hands a graphed target its shapes with the concat flag its own
    captures will use (per-tap features with split fc layers); a plain target runs each shape
    once, with that flag too."""
    seen = []

    class Plain:
        def capture(self, ids, concat=True):
            seen.append(("capture", tuple(ids.shape), concat))
            return ids[..., None].float(), None

    class Graphed(Plain):
        def prepare(self, shapes, concat=True):
            seen.append(("prepare", list(shapes), concat))

    kw = dict(noise=None, faults=None, timer=None, log=print)
    packing = Packing(torch.device("cpu"), 8, split_fc=split_fc)
    Producer(Graphed(), None, packing, **kw).warm_up([(4, 16), (2, 32)])
    assert seen == [("prepare", [(4, 16), (2, 32)], not split_fc)]
    seen.clear()
    Producer(Plain(), None, packing, **kw).warm_up([(4, 16), (2, 32)])
    assert seen == [("capture", (4, 16), not split_fc), ("capture", (2, 32), not split_fc)]
