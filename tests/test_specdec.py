"""Speculative decoding: losslessness against target-only decoding (tiny random models and real
SmolLM2 weights), the drafter cache against fresh forwards, test-double proposers (oracle ->
tau = B, always wrong -> tau = 1), sampling, stop tokens, cache cropping, statistics; batched
decoding against batch-1 decoding row by row (tokens, acceptance lengths, stops, samples)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from conftest import tiny_drafter, tiny_target_config
from dflash_train.core.target import LayerTaps
from dflash_train.engine.acceptance import acceptance_histogram, mean_acceptance, turn_mean_tau
from dflash_train.engine.decoder import (
    Decoder,
    speculative_generate,
    speculative_generate_batch,
    target_generate,
    target_generate_batch,
)
from dflash_train.engine.proposer import DFlashProposer
from dflash_train.engine.sampling import choose_tokens, stop_token_ids

VOCAB = 128  # tiny_target_config; the tiny drafter's mask token is 127


@pytest.fixture(scope="module")
def tiny_target():
    torch.manual_seed(1)
    return LlamaForCausalLM(tiny_target_config()).eval()


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _per_row(reference) -> list[list[int]]:
    """One reference (batch 1) or one per row (batched)."""
    return [list(reference)] if isinstance(reference[0], int) else [list(r) for r in reference]


class OracleProposer:
    """Proposes the reference continuation (prompt + target output) of each row; `wrong=True`
    proposes a different token at every position instead. Needs no target features. Batched,
    it follows `keep_rows` to know which prompt each row is, and checks that every row's
    committed ids are its reference (so a row mix-up fails loudly)."""

    target_layer_ids: list[int] = []

    def __init__(self, reference, block_size: int, wrong: bool = False) -> None:
        self.references, self.block_size, self.wrong = _per_row(reference), block_size, wrong
        self.reset()

    def reset(self, *engine_sizes) -> None:
        self.rows = list(range(len(self.references)))

    def keep_rows(self, index_R) -> None:
        self.rows = [self.rows[i] for i in index_R.tolist()]

    def _propose(self, reference: list[int], s: int) -> torch.Tensor:
        ids = torch.tensor((reference[s + 1 : s + self.block_size] + [0] * self.block_size)[: self.block_size - 1])
        return (ids + 1) % VOCAB if self.wrong else ids

    def propose(self, sequence_ids_1S, context_1TF):
        return self._propose(self.references[0], sequence_ids_1S.shape[1] - 1)

    def propose_batch(self, sequence_ids_RS, anchor_R, context_RTF, context_len_R, max_anchor):
        anchors = anchor_R.tolist()
        assert max_anchor == max(anchors) and len(anchors) == len(self.rows)
        for seq, s, row in zip(sequence_ids_RS, anchors, self.rows):
            assert seq[: s + 1].tolist() == self.references[row][: s + 1], "committed ids of another row"
        return torch.stack([self._propose(self.references[row], s) for row, s in zip(self.rows, anchors)])


class MixedProposer:
    """The real DFlash proposer (so its cache bookkeeping runs), with a random-length prefix of
    its proposals replaced by the reference: every acceptance length 1..B occurs. The prefix
    length depends only on (row seed, anchor position), so batch-1 and batched runs of a row
    mix alike. Records what the drafter itself proposed for each committed sequence."""

    def __init__(self, inner: DFlashProposer, reference, seed=0) -> None:
        self.inner, self.oracle = inner, OracleProposer(reference, inner.block_size)
        self.seeds = [seed] * len(self.oracle.references) if isinstance(seed, int) else list(seed)
        self.block_size, self.target_layer_ids = inner.block_size, inner.target_layer_ids
        self.raw: list[tuple[torch.Tensor, torch.Tensor]] = []

    def reset(self, *engine_sizes) -> None:
        self.inner.reset(*engine_sizes)
        self.oracle.reset()

    def keep_rows(self, index_R) -> None:
        self.inner.keep_rows(index_R)
        self.oracle.keep_rows(index_R)

    def _mix(self, row: int, s: int, oracle: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seeds[row] * 7919 + s)
        k = int(torch.randint(0, self.block_size, (1,), generator=gen))
        return torch.cat([oracle[:k], raw[k:]])

    def propose(self, sequence_ids_1S, context_1TF):
        raw = self.inner.propose(sequence_ids_1S, context_1TF)
        self.raw.append((sequence_ids_1S.clone(), raw.clone()))
        return self._mix(0, sequence_ids_1S.shape[1] - 1, self.oracle.propose(sequence_ids_1S, None), raw)

    def propose_batch(self, sequence_ids_RS, anchor_R, context_RTF, context_len_R, max_anchor):
        raw_RK = self.inner.propose_batch(sequence_ids_RS, anchor_R, context_RTF, context_len_R, max_anchor)
        oracle_RK = self.oracle.propose_batch(sequence_ids_RS, anchor_R, None, context_len_R, max_anchor)
        out = []
        for i, (row, s) in enumerate(zip(self.oracle.rows, anchor_R.tolist())):
            self.raw.append((sequence_ids_RS[i : i + 1, : s + 1].clone(), raw_RK[i].clone()))
            out.append(self._mix(row, s, oracle_RK[i], raw_RK[i]))
        return torch.stack(out)


# --------------------------------------------------------------------------- plumbing


def test_layer_taps_are_hf_hidden_states(tiny_target):
    ids = torch.tensor([random_prompt(9, 1)])
    before = len(tiny_target.model.layers[1]._forward_hooks)
    with torch.no_grad(), LayerTaps(tiny_target, [5, 1, 3]) as taps:
        assert len(tiny_target.model.layers[1]._forward_hooks) == before + 1
        feats = (tiny_target(input_ids=ids), taps.features())[1]
    assert len(tiny_target.model.layers[1]._forward_hooks) == before  # ours removed on exit
    with torch.no_grad():
        hs = tiny_target(input_ids=ids, output_hidden_states=True).hidden_states
    assert torch.equal(feats, torch.cat([hs[6], hs[2], hs[4]], dim=-1))


@pytest.mark.parametrize("plen", [1, 7, 30])
def test_target_generate_matches_transformers_generate(tiny_target, plen):
    prompt = random_prompt(plen, plen)
    ours = target_generate(tiny_target, prompt, 20)
    ref = tiny_target.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
    assert ours.output_ids == ref[0, plen:].tolist()
    assert not ours.stopped and ours.acceptance_lengths == []


# --------------------------------------------------------------------------- losslessness


@pytest.mark.parametrize("block_size", [2, 4, 8])
@pytest.mark.parametrize("sliding_window", [None, 8])
@pytest.mark.parametrize("plen", [1, 6, 29])
def test_greedy_is_lossless_and_cache_matches_fresh_forward(tiny_target, block_size, sliding_window, plen):
    if sliding_window is not None and sliding_window < block_size:
        pytest.skip("window must hold a block")
    prompt = random_prompt(plen, 100 + plen)
    new = 25
    reference = target_generate(tiny_target, prompt, new + block_size)
    drafter = tiny_drafter(num_layers=2, block_size=block_size, sliding_window=sliding_window, num_taps=3)
    inner = DFlashProposer.for_target(drafter, tiny_target)
    for proposer in (inner, MixedProposer(inner, prompt + reference.output_ids, seed=plen)):
        spec = speculative_generate(tiny_target, prompt, proposer, new)
        assert spec.output_ids == reference.output_ids[:new]
        assert 1 + sum(spec.acceptance_lengths) == len(spec.output_ids)
        assert all(1 <= n <= block_size for n in spec.acceptance_lengths)
    assert len(set(spec.acceptance_lengths)) > 1, "the mixed proposer must exercise several acceptance lengths"
    # Incremental drafter (cache + only new context each cycle) == a fresh forward on all context.
    fresh = DFlashProposer.for_target(drafter, tiny_target)
    for seq_1S, raw in proposer.raw:
        with torch.no_grad(), LayerTaps(tiny_target, drafter.target_layer_ids) as taps:
            tiny_target(input_ids=seq_1S[:, :-1])
            context = taps.features()
            fresh.reset()
            assert torch.equal(fresh.propose(seq_1S, context), raw)


def test_mask_token_ids_in_the_output_are_kept(tiny_target):
    import copy

    model = copy.deepcopy(tiny_target)
    prompt = random_prompt(5, 3)
    frequent = max(set(ids := target_generate(model, prompt, 24).output_ids), key=ids.count)
    with torch.no_grad():  # the drafter's mask token id (127) becomes a frequent real token
        model.lm_head.weight[127] = model.lm_head.weight[frequent] * 1.5
    reference = target_generate(model, prompt, 24)
    assert 127 in reference.output_ids
    proposer = DFlashProposer.for_target(tiny_drafter(block_size=4), model)
    assert speculative_generate(model, prompt, proposer, 24).output_ids == reference.output_ids


def test_real_smollm2_greedy_is_lossless(smollm2_path, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    from dflash_train.core.drafter import DFlashDrafter, build_drafter_config
    from dflash_train.eval.prompts import prompt_ids

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    drafter = DFlashDrafter(build_drafter_config(model.config, num_layers=1, block_size=8,
                                                 mask_token_id=len(smollm2_tokenizer) - 1)).eval()
    prompt = prompt_ids(smollm2_tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    new = 24
    reference = target_generate(model, prompt, new + 8)
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
    assert reference.output_ids[:new] == hf[0, len(prompt):].tolist()
    inner = DFlashProposer.for_target(drafter, model)
    untrained = speculative_generate(model, prompt, inner, new)
    mixed = speculative_generate(model, prompt, MixedProposer(inner, prompt + reference.output_ids), new)
    assert untrained.output_ids == reference.output_ids[:new]
    assert mixed.output_ids == reference.output_ids[:new]
    assert mean_acceptance(mixed.acceptance_lengths) > mean_acceptance(untrained.acceptance_lengths)


# --------------------------------------------------------------------------- test doubles


@pytest.mark.parametrize("block_size", [4, 8])
def test_oracle_gives_tau_block_size_and_wrong_gives_one(tiny_target, block_size):
    prompt = random_prompt(11, block_size)
    new = 1 + 5 * block_size  # the prefill's token, then five whole blocks
    reference = target_generate(tiny_target, prompt, new)
    oracle = speculative_generate(tiny_target, prompt, OracleProposer(prompt + reference.output_ids, block_size), new)
    assert oracle.output_ids == reference.output_ids
    assert oracle.acceptance_lengths == [block_size] * 5 and mean_acceptance(oracle.acceptance_lengths) == block_size
    wrong = speculative_generate(tiny_target, prompt,
                                 OracleProposer(prompt + reference.output_ids, block_size, wrong=True), new)
    assert wrong.output_ids == reference.output_ids
    assert wrong.acceptance_lengths == [1] * (new - 1) and mean_acceptance(wrong.acceptance_lengths) == 1


def test_max_new_tokens_cuts_the_last_cycle(tiny_target):
    prompt = random_prompt(4, 9)
    reference = target_generate(tiny_target, prompt, 40)
    spec = speculative_generate(tiny_target, prompt, OracleProposer(prompt + reference.output_ids, 4), 11)
    assert spec.output_ids == reference.output_ids[:11]
    assert spec.acceptance_lengths == [4, 4, 2] and not spec.stopped


def test_stop_tokens_end_generation_inside_a_cycle(tiny_target):
    prompt = random_prompt(8, 21)
    reference = target_generate(tiny_target, prompt, 40).output_ids
    # A stop token that first appears in the middle of an oracle cycle.
    j = next(i for i, t in enumerate(reference) if i >= 2 and (i - 1) % 4 != 3 and t not in reference[:i])
    stop = reference[j]
    base = target_generate(tiny_target, prompt, 40, stop_ids=[stop])
    spec = speculative_generate(tiny_target, prompt, OracleProposer(prompt + reference, 4), 40, stop_ids=[stop])
    assert base.output_ids == spec.output_ids == reference[: j + 1]
    assert base.stopped and spec.stopped
    assert 1 + sum(spec.acceptance_lengths) == j + 1
    assert spec.acceptance_lengths[-1] == (j - 1) % 4 + 1 < 4  # counted only up to the stop
    first = speculative_generate(tiny_target, prompt, OracleProposer(prompt + reference, 4), 40,
                                 stop_ids=[reference[0]])
    assert first.output_ids == reference[:1] and first.acceptance_lengths == []


# --------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("temperature,seed", [(0.7, 0), (1.5, 3)])
def test_sampling_commits_exactly_the_targets_samples(tiny_target, temperature, seed):
    prompt = random_prompt(6, 40 + seed)
    new = 30
    sampled = target_generate(tiny_target, prompt, new + 8, temperature=temperature, seed=seed)
    assert sampled.output_ids != target_generate(tiny_target, prompt, new + 8).output_ids
    assert sampled.output_ids != target_generate(tiny_target, prompt, new + 8, temperature=temperature,
                                                 seed=seed + 1).output_ids
    inner = DFlashProposer.for_target(tiny_drafter(block_size=4), tiny_target)
    for proposer in (inner, MixedProposer(inner, prompt + sampled.output_ids, seed=seed),
                     OracleProposer(prompt + sampled.output_ids, 4)):
        spec = speculative_generate(tiny_target, prompt, proposer, new, temperature=temperature, seed=seed)
        assert spec.output_ids == sampled.output_ids[:new]
    assert spec.acceptance_lengths[:-1] == [4] * (len(spec.acceptance_lengths) - 1)


def test_choose_tokens_samples_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    T = 1.3
    picks = choose_tokens(logits, range(4000), T, seed=5)
    freq = torch.bincount(picks, minlength=4).float() / 4000
    expected = torch.softmax(logits[0] / T, dim=-1)
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)
    assert torch.equal(choose_tokens(logits[:3], [7, 8, 9], 0.0, 0), torch.zeros(3, dtype=torch.long))


# --------------------------------------------------------------------------- statistics


def test_acceptance_statistics():
    assert mean_acceptance([1, 2, 3, 6]) == 3.0
    assert turn_mean_tau([[1, 1], [4], []]) == 2.5  # mean of turn means; empty turns left out
    assert acceptance_histogram([1, 1, 4, 2], 4) == [2, 1, 0, 1]
    with pytest.raises(ValueError):
        acceptance_histogram([5], 4)
    assert mean_acceptance([]) != mean_acceptance([])  # nan


def test_stop_token_ids_include_end_of_turn(smollm2_tokenizer):
    ids = stop_token_ids(smollm2_tokenizer)
    assert smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    assert smollm2_tokenizer.eos_token_id in ids


# --------------------------------------------------------------------------- batched decoding


def row_prompts(seed: int, lengths=(1, 6, 29, 13)) -> list[list[int]]:
    """Prompts of different lengths, one per row."""
    return [random_prompt(n, seed + n) for n in lengths]


def fresh_proposals_match(model, drafter, raw: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """What the drafter proposed for each committed sequence == one fresh batch-1 forward on all
    of that sequence's context."""
    fresh = DFlashProposer.for_target(drafter, model)
    for seq_1S, proposals in raw:
        with torch.no_grad(), LayerTaps(model, drafter.target_layer_ids) as taps:
            model(input_ids=seq_1S[:, :-1])
            context = taps.features()
        fresh.reset()
        assert torch.equal(fresh.propose(seq_1S, context), proposals)


@pytest.mark.parametrize("sliding_window", [None, 8])
def test_batched_greedy_is_lossless_and_matches_batch_one(tiny_target, sliding_window):
    """Rows of different prompt lengths that end at different points (a stop token, the
    budget): each row's output is batch-1 target-only greedy output, its acceptance lengths
    are batch-1 speculative decoding's, and the batched drafter proposes what a fresh batch-1
    forward on the row's context proposes."""
    prompts, new, B, seeds = row_prompts(200), 25, 4, [1, 2, 3, 4]
    full = [p + target_generate(tiny_target, p, new + B).output_ids for p in prompts]
    stop = [full[2][len(prompts[2]) + 9]]  # ends row 2 early (and any other row that meets it)
    refs = [target_generate(tiny_target, p, new, stop_ids=stop) for p in prompts]
    assert {r.stopped for r in refs} == {True, False} and len({len(r.output_ids) for r in refs}) > 1
    batched_target = target_generate_batch(tiny_target, prompts, new, stop_ids=stop)
    assert [(g.output_ids, g.stopped) for g in batched_target] == [(r.output_ids, r.stopped) for r in refs]
    drafter = tiny_drafter(num_layers=2, block_size=B, sliding_window=sliding_window, num_taps=3)
    inner = DFlashProposer.for_target(drafter, tiny_target)
    mixed = MixedProposer(inner, full, seed=seeds)
    for proposer, single in ((inner, lambda i: inner), (mixed, lambda i: MixedProposer(inner, full[i], seeds[i]))):
        batched = speculative_generate_batch(tiny_target, prompts, proposer, new, stop_ids=stop)
        for i, (prompt, ref, gen) in enumerate(zip(prompts, refs, batched)):
            one = speculative_generate(tiny_target, prompt, single(i), new, stop_ids=stop)
            assert gen.output_ids == ref.output_ids and gen.stopped == ref.stopped
            assert gen.acceptance_lengths == one.acceptance_lengths
            assert 1 + sum(gen.acceptance_lengths) == len(gen.output_ids)
    assert len({n for g in batched for n in g.acceptance_lengths}) > 2, "several acceptance lengths must occur"
    fresh_proposals_match(tiny_target, drafter, mixed.raw)


class Unfused:
    """A DFlash proposer through the generic Proposer path: propose_batch every cycle, the
    first one on the whole prompt's context (not the engine's fused cycle)."""

    def __init__(self, inner: DFlashProposer) -> None:
        self.inner, self.block_size, self.target_layer_ids = inner, inner.block_size, inner.target_layer_ids

    def reset(self, rows: int, capacity: int) -> None:
        self.inner.reset(rows, capacity)

    def propose_batch(self, *args):
        return self.inner.propose_batch(*args)

    def keep_rows(self, index_R) -> None:
        self.inner.keep_rows(index_R)


@pytest.mark.parametrize("B", [4, 8])
def test_the_fused_cycle_writes_the_prompt_context_ahead_and_proposes_the_same(tiny_target, B):
    """The fused cycle's first step takes only the prompt's last min(L, B) positions as context
    (the rest written into the drafter's cache before it), so that it replays the captured
    cycle; it proposes what the generic path proposes from the whole prompt, batched and alone,
    for prompts shorter than, as long as and longer than a block."""
    prompts, new = row_prompts(500, lengths=(1, B - 1, B, B + 1, 29)), 20
    drafter = tiny_drafter(num_layers=2, block_size=B, num_taps=3)
    fused = DFlashProposer.for_target(drafter, tiny_target)
    generic = Unfused(DFlashProposer.for_target(drafter, tiny_target))
    got = speculative_generate_batch(tiny_target, prompts, fused, new)
    want = speculative_generate_batch(tiny_target, prompts, generic, new)
    assert [(g.output_ids, g.acceptance_lengths) for g in got] == [(w.output_ids, w.acceptance_lengths) for w in want]
    for prompt, g in zip(prompts, got):
        one = speculative_generate(tiny_target, prompt, fused, new)
        assert (one.output_ids, one.acceptance_lengths) == (g.output_ids, g.acceptance_lengths)
    # A random drafter is (almost) never accepted: compare the first block's proposals and the
    # drafter's cache themselves, from the same prefill, against one step on the whole prompt.
    engine = Decoder(tiny_target, fused, rows=len(prompts), capacity=64)
    rows = [torch.tensor(p) for p in prompts]
    anchor_R = torch.tensor([len(p) for p in prompts])
    token_R, context_RTF = engine.target.prefill(torch.arange(len(rows)), rows, torch.zeros(len(rows), dtype=torch.long))
    width = int(anchor_R.max()) + B
    fused.reset(len(rows), engine.target.capacity)
    whole = fused.block_body(token_R, anchor_R, context_RTF, anchor_R, width)
    keys = [k.clone() for k in fused.row_cache.keys]
    fused.reset(len(rows), engine.target.capacity)
    for k in (*fused.row_cache.keys, *fused.row_cache.values):
        k.fill_(1e4)  # a column the new path forgot to write would show (finite: masked columns are read too)
    context_RBF, length_R = engine._prompt_context(token_R, anchor_R, context_RTF, int(anchor_R.max()))
    assert context_RBF.shape[1] == B and length_R.tolist() == [min(len(p), B) for p in prompts]
    assert torch.equal(fused.block_body(token_R, anchor_R, context_RBF, length_R, width), whole)
    for a, b in zip(keys, fused.row_cache.keys):
        for r, n in enumerate(anchor_R.tolist()):
            torch.testing.assert_close(b[r, :, : n + B], a[r, :, : n + B])  # the prompt and the block


def test_batched_oracle_gives_tau_block_size_and_wrong_gives_one(tiny_target):
    B, prompts = 4, row_prompts(300)
    new = 1 + 5 * B
    full = [p + target_generate(tiny_target, p, new).output_ids for p in prompts]
    refs = [f[len(p):] for p, f in zip(prompts, full)]
    oracle = speculative_generate_batch(tiny_target, prompts, OracleProposer(full, B), new)
    assert [g.output_ids for g in oracle] == refs
    assert all(g.acceptance_lengths == [B] * 5 for g in oracle)
    wrong = speculative_generate_batch(tiny_target, prompts, OracleProposer(full, B, wrong=True), new)
    assert [g.output_ids for g in wrong] == refs and all(g.acceptance_lengths == [1] * (new - 1) for g in wrong)
    cut = speculative_generate_batch(tiny_target, prompts, OracleProposer(full, B), 11)
    assert all(g.acceptance_lengths == [4, 4, 2] and not g.stopped for g in cut)
    # A stop token inside an oracle cycle of row 1: that row leaves the batch early, mid-cycle.
    j = next(i for i, t in enumerate(refs[1]) if i >= 2 and (i - 1) % B != B - 1 and t not in refs[1][:i])
    stopped = speculative_generate_batch(tiny_target, prompts, OracleProposer(full, B), new, stop_ids=[refs[1][j]])
    for prompt, f, gen in zip(prompts, full, stopped):
        one = speculative_generate(tiny_target, prompt, OracleProposer(f, B), new, stop_ids=[refs[1][j]])
        assert (gen.output_ids, gen.acceptance_lengths, gen.stopped) == (one.output_ids, one.acceptance_lengths,
                                                                         one.stopped)
    assert stopped[1].output_ids == refs[1][: j + 1] and stopped[1].acceptance_lengths[-1] < B


def test_batched_sampling_gives_the_samples_of_batch_one(tiny_target):
    """T > 0: each row draws exactly its batch-1 noise (its own seed, its own positions)."""
    prompts = row_prompts(400)
    prompts.append(prompts[1])  # the same prompt with another seed samples another answer
    seeds, T, new = [5, 6, 7, 8, 9], 0.8, 20
    samples = [target_generate(tiny_target, p, new + 4, temperature=T, seed=s).output_ids
               for p, s in zip(prompts, seeds)]
    assert samples[1] != samples[4]
    batched_target = target_generate_batch(tiny_target, prompts, new, temperature=T, seed=seeds)
    assert [g.output_ids for g in batched_target] == [s[:new] for s in samples]
    inner = DFlashProposer.for_target(tiny_drafter(block_size=4), tiny_target)
    full = [p + s for p, s in zip(prompts, samples)]
    batched = speculative_generate_batch(tiny_target, prompts, MixedProposer(inner, full, seed=seeds), new,
                                         temperature=T, seed=seeds)
    for i, (prompt, sample, gen) in enumerate(zip(prompts, samples, batched)):
        one = speculative_generate(tiny_target, prompt, MixedProposer(inner, full[i], seeds[i]), new,
                                   temperature=T, seed=seeds[i])
        assert gen.output_ids == one.output_ids == sample[:new]
        assert gen.acceptance_lengths == one.acceptance_lengths
    assert max(n for g in batched for n in g.acceptance_lengths) > 1


def greedy_without_cache(model, prompt, new: int) -> list[int]:
    """Greedy continuation by a full forward of the whole sequence per token: the reference
    that no cache bookkeeping can get wrong (transformers 5.17's `generate` does, on some
    prompts longer than a sliding window)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_batched_sliding_window_target_is_lossless():
    """A target mixing sliding-window and full layers (Qwen3 layout), prompts longer than the
    window: batched decoding gives the cache-free greedy output row by row."""
    from dflash_train.core.drafter import DFlashDrafter, build_drafter_config

    torch.manual_seed(2)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, sliding_window=5, use_sliding_window=True,
                      layer_types=["sliding_attention", "full_attention"] * 2, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg).eval()
    prompts, new = row_prompts(500, (3, 17, 9)) + row_prompts(501, (9,)), 16
    refs = [greedy_without_cache(model, p, new) for p in prompts]
    assert [g.output_ids for g in target_generate_batch(model, prompts, new)] == refs
    drafter = DFlashDrafter(build_drafter_config(cfg, num_layers=1, block_size=4, num_taps=2, mask_token_id=127))
    mixed = MixedProposer(DFlashProposer.for_target(drafter, model), [p + r for p, r in zip(prompts, refs)], [0, 1, 2, 3])
    batched = speculative_generate_batch(model, prompts, mixed, new)
    assert [g.output_ids for g in batched] == refs
    assert max(n for g in batched for n in g.acceptance_lengths) > 1


def test_real_smollm2_batched_greedy_is_lossless(smollm2_path, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    from dflash_train.core.drafter import DFlashDrafter, build_drafter_config
    from dflash_train.eval.prompts import prompt_ids

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    drafter = DFlashDrafter(build_drafter_config(model.config, num_layers=1, block_size=8,
                                                 mask_token_id=len(smollm2_tokenizer) - 1)).eval()
    prompts = [prompt_ids(smollm2_tokenizer, [{"role": "user", "content": text}])
               for text in ("What is the capital of France?", "Hi", "Name three prime numbers and explain why.")]
    new, stop = 12, stop_token_ids(smollm2_tokenizer)
    refs = [target_generate(model, p, new, stop_ids=stop).output_ids for p in prompts]
    mixed = MixedProposer(DFlashProposer.for_target(drafter, model), [p + r for p, r in zip(prompts, refs)], [0, 1, 2, 3])
    batched = speculative_generate_batch(model, prompts, mixed, new, stop_ids=stop)
    assert [g.output_ids for g in batched] == refs
    assert max(n for g in batched for n in g.acceptance_lengths) > 1


def test_batch_one_decoding_of_a_sliding_window_target_is_lossless():
    """Batch-1 target-only and speculative decoding of a target mixing sliding-window and full
    layers (prompts longer than the window) give the cache-free greedy output (both used to fail
    on the sliding layers' DynamicCache; the 9-token prompt is one where transformers' own
    `generate` goes wrong)."""
    from dflash_train.core.drafter import DFlashDrafter, build_drafter_config

    torch.manual_seed(2)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, sliding_window=5, use_sliding_window=True,
                      layer_types=["sliding_attention", "full_attention"] * 2, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg).eval()
    drafter = DFlashDrafter(build_drafter_config(cfg, num_layers=1, block_size=4, num_taps=2, mask_token_id=127))
    for prompt in row_prompts(501, (17, 9)):
        ref = greedy_without_cache(model, prompt, 16)
        assert target_generate(model, prompt, 16).output_ids == ref
        mixed = MixedProposer(DFlashProposer.for_target(drafter, model), [prompt + ref], [0])
        spec = speculative_generate(model, prompt, mixed, 16)
        assert spec.output_ids == ref and max(spec.acceptance_lengths) > 1
