"""Speculative decoding: losslessness against target-only decoding (tiny random models and real
SmolLM2 weights), the drafter cache against fresh forwards, test-double proposers (oracle ->
tau = B, always wrong -> tau = 1), sampling, stop tokens, cache cropping, statistics."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

from conftest import tiny_drafter, tiny_target_config
from dflash_train import specdec
from dflash_train.target import LayerTaps
from dflash_train.specdec import (DFlashProposer, acceptance_histogram, choose_tokens, crop_cache,
                                  mean_acceptance, speculative_generate, target_generate, turn_mean_tau)

VOCAB = 128  # tiny_target_config; the tiny drafter's mask token is 127


@pytest.fixture(scope="module")
def tiny_target():
    torch.manual_seed(1)
    return LlamaForCausalLM(tiny_target_config()).eval()


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class OracleProposer:
    """Proposes the reference continuation (prompt + target output); `wrong=True` proposes a
    different token at every position instead. Needs no target features."""

    target_layer_ids: list[int] = []

    def __init__(self, reference: list[int], block_size: int, wrong: bool = False) -> None:
        self.reference, self.block_size, self.wrong = list(reference), block_size, wrong

    def reset(self) -> None:
        pass

    def propose(self, sequence_ids_1S, context_1TF):
        s = sequence_ids_1S.shape[1] - 1
        ref = (self.reference[s + 1 : s + self.block_size] + [0] * self.block_size)[: self.block_size - 1]
        ids = torch.tensor(ref)
        return (ids + 1) % VOCAB if self.wrong else ids


class MixedProposer:
    """The real DFlash proposer (so its cache bookkeeping runs), with a random-length prefix of
    its proposals replaced by the reference: every acceptance length 1..B occurs. Records what
    the drafter itself proposed for each committed sequence."""

    def __init__(self, inner: DFlashProposer, reference: list[int], seed: int = 0) -> None:
        self.inner, self.reference = inner, list(reference)
        self.block_size, self.target_layer_ids = inner.block_size, inner.target_layer_ids
        self.gen = torch.Generator().manual_seed(seed)
        self.raw: list[tuple[torch.Tensor, torch.Tensor]] = []

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, sequence_ids_1S, context_1TF):
        raw = self.inner.propose(sequence_ids_1S, context_1TF)
        self.raw.append((sequence_ids_1S.clone(), raw.clone()))
        oracle = OracleProposer(self.reference, self.block_size).propose(sequence_ids_1S, None)
        k = int(torch.randint(0, self.block_size, (1,), generator=self.gen))
        return torch.cat([oracle[:k], raw[k:]])


# --------------------------------------------------------------------------- plumbing


def test_crop_cache_keeps_the_first_positions(tiny_target):
    cache = DynamicCache(config=tiny_target.config)
    ids = torch.tensor([random_prompt(10, 0)])
    with torch.no_grad():
        tiny_target(input_ids=ids, past_key_values=cache, use_cache=True)
    keys = cache.layers[0].keys.clone()
    crop_cache(cache, 6)
    assert cache.get_seq_length() == 6
    assert torch.equal(cache.layers[0].keys, keys[..., :6, :])
    crop_cache(cache, 6)  # no-op
    assert cache.get_seq_length() == 6
    with pytest.raises(ValueError):
        crop_cache(cache, 7)


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

    from dflash_train.drafter import DFlashDrafter, build_drafter_config
    from dflash_train.evaluate import prompt_ids

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
    ids = specdec.stop_token_ids(smollm2_tokenizer)
    assert smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    assert smollm2_tokenizer.eos_token_id in ids
