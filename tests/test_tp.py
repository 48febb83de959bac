"""Tensor-parallel target groups (topology.target_tp) on CPU (gloo): a target sharded over 2
ranks by transformers' own plan gives the taps, final states, greedy labels and heads of the
whole target, for a tiny Llama (tied embedding and lm_head) and a tiny Qwen3-MoE (untied); a run
with target_tp=2, colocated (2 ranks, one group) and disaggregated (one group of 2 target ranks
+ 1 drafter rank), logs the losses of one process over the same batches; and the settings,
model types and sizes it cannot take are refused, each with its reason.

Run as a script under torchrun, this file is the worker of the target comparison."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

from conftest import ROOT, TINY, losses
from dflash_train.app import cli
from dflash_train.core.assets import cache_root, save_model_folder, smollm2_dir, tiny_random_target_dir
from dflash_train.core.config import ConfigError, load_config
from dflash_train.core.target import load_target, tensor_parallel_problems
from dflash_train.data.preparation import default_dataset
from dflash_train.train.dist import Assignment, Dist
from dflash_train.train.loop import target_files
from test_dist import ENV, STEPS, assert_close_losses, run, torchrun

TP2 = "topology.target_tp=2"
DISAGG_TP2 = ("topology.mode=disaggregated", "topology.num_target_ranks=2", TP2)


def tiny_moe_folder(out: Path) -> Path:
    """A tiny random Qwen3-MoE target (4 experts, 2 per token, untied lm_head) with SmolLM2's
    tokenizer: the bundled tiny target's tokens, another model type and plan."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    config = Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer),
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(config)
        with torch.no_grad():  # logits far from zero, as the bundled tiny target's
            model.get_input_embeddings().weight.normal_(0.0, 0.5)
    save_model_folder(model, tokenizer, out)
    return out


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return tiny_moe_folder(tmp_path_factory.mktemp("tiny-qwen3-moe"))


@pytest.fixture(scope="module")
def prepared_data() -> str:
    """The tiny target's prepared ShareGPT samples (SmolLM2's tokens, which the MoE target reads
    too), given as a prepared folder so that the MoE runs do not tokenize it again."""
    default_dataset(tiny_random_target_dir(), max_length=256)
    return str(cache_root() / "data" / f"sharegpt-{tiny_random_target_dir().name}-256")


# --------------------------------------------------------------------------- pure parts


@settings(max_examples=40, deadline=None)
@given(groups=st.integers(1, 3), size=st.integers(1, 4), accum=st.integers(1, 3))
def test_group_turns_are_the_same_slot_of_every_member_in_member_order(groups, size, accum):
    a = Assignment(groups * size, groups * size, accum, True)
    for step in range(2):
        for d in range(groups * size):
            for g in a.consumed(step, d):
                turns = a.group_turns(g, size)
                first = d - d % size
                assert [a.consumer(t) for t in turns] == list(range(first, first + size))
                assert {a.slot(t) for t in turns} == {a.slot(g)} and g in turns
                # every member of the group asks for the same forwards at this slot, in one order
                assert all(a.group_turns(t, size) == turns for t in turns)


def test_target_tp_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="topology.target_tp must be > 0"):
        load_config(TINY, ["topology.target_tp=0"])
    with pytest.raises(ConfigError, match=r"topology.num_target_ranks \(3\) must be a multiple of topology.target_tp "
                                          r"\(2\): a node's target ranks form groups of target_tp"):
        load_config(TINY, ["topology.mode=disaggregated", "topology.num_target_ranks=3", TP2])
    cfg = load_config(TINY, [TP2])
    with pytest.raises(ConfigError, match="topology.target_tp=2 does not divide the 1 rank"):
        Dist.from_env(cfg.topology, "cpu")  # world size 1
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"does not divide the 3 rank\(s\) of a node .* launch a multiple of 2 ranks"):
        Dist.from_env(cfg.topology, "cpu")


def test_a_model_type_without_a_plan_is_refused_before_anything_loads(tmp_path):
    """GPT-2 ships no tensor-parallel plan: the run's target check names its model type."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=len(tokenizer), n_positions=256)
    save_model_folder(GPT2LMHeadModel(config), tokenizer, tmp_path)
    cfg = load_config(TINY, [f"target.path={tmp_path}", TP2])
    with pytest.raises(ConfigError, match="topology.target_tp=2: the target's model type 'gpt2' has no "
                                          "tensor-parallel plan in transformers .*: set topology.target_tp=1"):
        target_files(cfg)
    assert target_files(load_config(TINY, [f"target.path={tmp_path}"]))[1].model_type == "gpt2"


def test_sizes_that_do_not_split_evenly_are_named():
    config = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=99,
                         vocab_size=1000)
    problems = tensor_parallel_problems(config, 4)
    assert problems == [f"topology.target_tp=4: the target's {name} ({value}) is not a multiple of 4, so its shards "
                        f"would be uneven: choose a topology.target_tp that divides it"
                        for name, value in (("num_attention_heads", 6), ("num_key_value_heads", 2),
                                            ("intermediate_size", 99))]
    assert tensor_parallel_problems(config, 2) == [
        "topology.target_tp=2: the target's intermediate_size (99) is not a multiple of 2, so its shards would be "
        "uneven: choose a topology.target_tp that divides it"]
    assert tensor_parallel_problems(config, 1) == []
    moe = Qwen3MoeConfig(num_attention_heads=8, num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=24,
                         vocab_size=1024)
    assert [p.split(": ")[1].split(" (")[0] for p in tensor_parallel_problems(moe, 16)] == \
        ["the target's num_attention_heads", "the target's num_key_value_heads", "the target's moe_intermediate_size"]


# --------------------------------------------------------------------------- the target itself


def test_sharded_targets_give_the_whole_targets_taps_states_labels_and_heads(moe_dir):
    """Under torchrun on 2 ranks (one group): each target, sharded and whole, on the same
    batch, with the final state (distill) and the greedy labels (target)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           str(tiny_random_target_dir()), str(moe_dir)]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("same as the whole target") == 2 * 2 * 2, done.stdout[-3000:]


def compare_sharded_with_whole(paths: list[str]) -> None:
    """The worker: on each rank, each target loaded whole and sharded over the group of both
    ranks; every output the trainer reads must match (fp32, 1e-5)."""
    dist = Dist.from_env(load_config(TINY, [TP2]).topology, "cpu")  # its groups: one of both ranks
    cpu = torch.device("cpu")
    ids = torch.randint(0, 2000, (3, 37), generator=torch.Generator().manual_seed(1))
    for path in paths:
        for labels in ("distill", "target"):
            whole, _ = load_target(path, cpu, "float32", [0, 2], labels)
            sharded, _ = load_target(path, cpu, "float32", [0, 2], labels, dist.tp_mesh)
            assert sharded.sharded and not whole.sharded
            assert not isinstance(sharded.embed_weight, DTensor) and not isinstance(sharded.lm_head_weight, DTensor)
            assert torch.equal(sharded.embed_weight, whole.embed_weight)
            assert torch.equal(sharded.lm_head_weight, whole.lm_head_weight)
            want, got = whole.capture(ids, concat=False), sharded.capture(ids, concat=False)
            for tap_want, tap_got in zip(want[0], got[0]):
                assert not isinstance(tap_got, DTensor)
                torch.testing.assert_close(tap_got, tap_want, rtol=1e-5, atol=1e-5)
            if labels == "distill":
                torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(got[1], want[1])
            print(f"rank {dist.rank}: {Path(path).name} labels={labels}: same as the whole target", flush=True)
    dist.close()


# --------------------------------------------------------------------------- runs


def reference_losses(out: Path, *overrides: str) -> dict[int, float]:
    """One process, grad_accum 2: the micro-batches both runs below train on."""
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(out), f"train.max_steps={STEPS}",
                     "train.grad_accum=2", *overrides]) == 0
    return losses(out)


def assert_run_matches(out: Path, nproc: int, reference: dict[int, float], *overrides: str) -> None:
    done = run(torchrun(out, nproc, *overrides))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_close_losses(losses(out), reference)


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory):
    return reference_losses(tmp_path_factory.mktemp("llama-reference"), "objective.labels=target")


@pytest.fixture(scope="module")
def moe_options(moe_dir, prepared_data) -> tuple[str, ...]:
    return f"target.path={moe_dir}", f"data.paths=[{prepared_data}]", "objective.labels=distill"


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory, moe_options):
    return reference_losses(tmp_path_factory.mktemp("moe-reference"), *moe_options)


@pytest.mark.slow
def test_llama_colocated_tp2_equals_one_process(llama_reference, tmp_path):
    """2 colocated ranks, one target group: each rank's micro-batch runs through the group's
    sharded target in turn; greedy labels from the gathered lm_head."""
    assert_run_matches(tmp_path, 2, llama_reference, TP2, "objective.labels=target")


@pytest.mark.slow
def test_llama_disaggregated_tp2_equals_one_process(llama_reference, tmp_path):
    """One target group of 2 ranks (rank 0 sends, rank 1 joins its forwards) + 1 drafter rank."""
    assert_run_matches(tmp_path, 3, llama_reference, *DISAGG_TP2, "train.grad_accum=2", "objective.labels=target")
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(last["wait_s"]["target_send"]) == 1  # one producer: the group


@pytest.mark.slow
def test_moe_colocated_tp2_equals_one_process(moe_reference, moe_options, tmp_path):
    assert_run_matches(tmp_path, 2, moe_reference, TP2, *moe_options)


@pytest.mark.slow
def test_moe_disaggregated_tp2_distillation_equals_one_process(moe_reference, moe_options, tmp_path):
    """The final state of the sharded MoE target travels to the drafter rank."""
    assert_run_matches(tmp_path, 3, moe_reference, *DISAGG_TP2, "train.grad_accum=2", *moe_options)


if __name__ == "__main__":  # the worker of test_sharded_targets_give_the_whole_targets_taps_states_labels_and_heads
    torch.set_num_threads(1)
    compare_sharded_with_whole(sys.argv[1:])
