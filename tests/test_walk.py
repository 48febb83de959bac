"""The walked tau and what uses it: the walk itself, its equality with served tau on the target's
own greedy data (float32, cycle for cycle), the validation split, the in-training validation
with checkpoint.keep_best, and `dflash-train eval --walk`."""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from conftest import TINY, tiny_target_config
from dflash_train.app.cli import main
from dflash_train.core.config import ConfigError, DataSection, load_config
from dflash_train.core.target import Target
from dflash_train.data.batching import conversation_keys, one_version_each, validation_split
from dflash_train.data.chat_files import conversation_key
from dflash_train.engine.acceptance import turn_mean_tau
from dflash_train.engine.decoder import speculative_generate, target_generate
from dflash_train.engine.proposer import DFlashProposer
from dflash_train.eval import walk
from dflash_train.eval.during_training import DuringTraining
from dflash_train.train.loop import build, split_data, take_step, train_drafter

STOP, MASK, MAX_NEW = 5, 127, 40


# --------------------------------------------------------------------------- the walk


def test_walk_commits_the_run_plus_the_targets_token_and_ends_with_the_turn():
    assert walk.response_spans(np.array([0, 1, 1, 1, 0, 0, 1, 1, 0, 1])) == [(1, 3), (6, 7), (9, 9)]
    run = np.array([-1, 2, 0, 5, 1, 0, 3, -1, -1])
    # Anchors 1 (run 2: 3 tokens), 4 (run 1: 2 tokens), 6 (run 3, but 2 tokens are left: cut).
    assert walk.walk_turn(run, 1, 8) == [3, 2, 2]
    assert walk.walk_turn(run, 2, 3) == [1]
    assert walk.walk_turn(run, 8, 8) == []  # a one-token turn: the prefill alone, no cycle


def _generate(model, prompt, proposer=None):
    if proposer is None:
        return target_generate(model, prompt, MAX_NEW, stop_ids=[STOP])
    return speculative_generate(model, prompt, proposer, MAX_NEW, stop_ids=[STOP])


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    """A tiny random target (float32), its own greedy answers to 16 prompts (some ending on the
    stop token, some on the budget, one with the stop token alone) and a second turn for 4 of
    them, as training samples; and a drafter trained 25 steps on them by the trainer itself."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_target_config()).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(10, 120, (n,), generator=gen).tolist()  # noqa: E731
    prompts, samples = [], []
    for i in range(16):
        prompt = rand(int(torch.randint(6, 20, (1,), generator=gen)))
        out = _generate(model, prompt).output_ids
        turns, ids, mask = [prompt], prompt + out, [0] * len(prompt) + [1] * len(out)
        if i % 4 == 0:  # a second turn: the user speaks again after our answer
            user = rand(5)
            turns.append(ids + user)
            out2 = _generate(model, turns[-1]).output_ids
            ids, mask = ids + user + out2, mask + [0] * len(user) + [1] * len(out2)
        prompts.append(turns)
        samples.append((ids, mask))
    dataset = Dataset.from_dict({"input_ids": [s for s, _ in samples], "loss_mask": [m for _, m in samples],
                                 "length": [len(s) for s, _ in samples]})
    cfg = load_config(TINY, [f"output_dir={tmp_path_factory.mktemp('run')}", "objective.noise=none",
                             "train.device=cpu", f"drafter.mask_token_id={MASK}", "train.max_steps=25",
                             "data.max_batch_size=4", "objective.num_anchors=64"])
    run = build(cfg, log=lambda *a, **k: None, dataset=dataset, target_config=tiny_target_config(),
                build_target=lambda ids, logits: Target(copy.deepcopy(model), ids, logits), checkpointing=False)
    while run.steps_done < run.total_steps:
        take_step(run)
    return model, prompts, dataset, run


def test_walked_tau_equals_served_tau_on_the_targets_own_greedy_data(regenerated, monkeypatch):
    """Every turn's acceptance lengths from the walk (one teacher-forced forward per packed row
    of 4 samples) equal those of speculative decoding of that turn's prompt with the same
    drafter, cycle for cycle, so the taus are equal exactly; also with flex attention and the
    GPU's padding, and when the anchors of a row are spread over many drafter forwards."""
    model, prompts, dataset, run = regenerated
    drafter = run.step.drafter
    walker = walk.Walker(dataset, run.producer.target, run.step.heads, device=torch.device("cpu"),
                         forward=walk.ForwardSettings("sdpa"), data=DataSection(max_batch_size=4))
    walked = walker(drafter)
    proposer = DFlashProposer.for_target(drafter, model)
    served = [[_generate(model, p, proposer).acceptance_lengths for p in turns] for turns in prompts]
    assert [walked.turns[i] for i in range(len(prompts))] == served
    assert walked.tau == turn_mean_tau([t for s in served for t in s])
    assert len(set(walked.lengths())) >= 4 and 1.5 < walked.tau < 7, walked.record()  # not a trivial drafter
    # The GPU's settings, run here with eager flex attention: the BlockMask, packed rows padded
    # to the token budget, anchor counts padded to a multiple.
    four = dataset.select(range(4))
    flex = walk.Walker(four, run.producer.target, run.step.heads, device=torch.device("cpu"),
                       forward=walk.ForwardSettings("flex", anchor_multiple=8), data=DataSection(max_batch_size=4),
                       pad_to=1024)(drafter)
    assert [flex.turns[i] for i in range(4)] == served[:4]
    monkeypatch.setattr(walk, "DENSE_MASK_ENTRIES", 4000)  # a few blocks per forward
    assert walk.blocks_per_forward(200, drafter.block_size, "sdpa", 1) < 8
    again = walker(drafter)
    assert again.turns == walked.turns and again.loss == pytest.approx(walked.loss, rel=1e-6)
    record = walked.record()
    assert list(record)[0] == "walked_tau" and len(record["val_acc_per_position"]) == drafter.block_size - 1
    assert sum(record["walked_histogram"]) == len(walked.lengths()) and record["val_loss"] > 0


# --------------------------------------------------------------------------- the split


def test_validation_split_is_stable_disjoint_and_independent_of_order_and_settings():
    keys = [f"c{i // 2}" for i in range(400)]  # 200 conversations of 2 samples each
    train, held = validation_split(keys, 0.1, seed=3)
    assert set(train).isdisjoint(held) and sorted([*train, *held]) == list(range(400))
    held_keys = {keys[i] for i in held}
    assert 5 < len(held_keys) < 40
    assert all((i in set(held)) == (keys[i] in held_keys) for i in range(400))  # whole conversations
    shuffled = random.Random(0).sample(keys, len(keys))
    assert {shuffled[i] for i in validation_split(shuffled, 0.1, seed=3)[1]} == held_keys  # order: no effect
    assert {keys[i] for i in validation_split(keys, 0.1, seed=4)[1]} != held_keys  # the seed: another split
    counted = {keys[i] for i in validation_split(keys, 12, seed=3)[1]}
    assert len(counted) == 12 and counted == {shuffled[i] for i in validation_split(shuffled, 12, seed=3)[1]}
    assert counted <= held_keys or held_keys <= counted  # both take the smallest hashes
    with pytest.raises(ValueError, match="nothing is left to train on"):
        validation_split(keys, 200)
    assert len(validation_split(keys, 0)[1]) == 0

    # In a run: the same held-out samples whatever data.limit and train.seed, never trained on.
    rows = Dataset.from_dict({"input_ids": [[i, i + 1, i + 2] for i in range(400)],
                              "loss_mask": [[0, 1, 1]] * 400, "length": [3] * 400, "conversation": keys})
    found = []
    for extra in ([], ["data.limit=50"], ["train.seed=7"]):
        cfg = load_config(TINY, ["data.validation=0.1", "data.validation_seed=3", *extra])
        training, validation = split_data(cfg, rows, log=lambda *a: None)
        found.append(validation["input_ids"])
        assert not {tuple(r) for r in training["input_ids"]} & {tuple(r) for r in validation["input_ids"]}
    assert found[0] == found[1] == found[2] == [rows[int(i)]["input_ids"] for i in held]


def test_sampled_replies_of_held_out_conversations_are_neither_walked_nor_trained_on(tmp_path, smollm2_path):
    """A prompt answered greedily and again with sampled replies (`data regenerate --temperature`
    marks those records): prepare keeps the mark per sample, and when the prompt is held out its
    greedy samples are walked (what serving at T=0 sees) and its sampled ones are in neither
    split; sampled replies of prompts not held out are trained on; a held-out conversation with
    sampled replies only (data regenerated only at T > 0) is walked as it is."""
    from dflash_train.data import chat_files, preparation

    greedy, sampled = tmp_path / "greedy.jsonl", tmp_path / "sampled.jsonl"
    chats = [[{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
             for i in range(12)]
    greedy.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    mark = {chat_files.SAMPLED_REPLIES: {"temperature": 0.7, "top_p": 0.95, "seed": 1}}
    sampled.write_text("".join(json.dumps({"messages": [c[0], {"role": "assistant", "content": f"Reply {i}, sampled."}],
                                           **mark}) + "\n" for i, c in enumerate(chats)))
    dataset = preparation.prepare([greedy, sampled], smollm2_path, tmp_path / "prepared", log=lambda *a: None).dataset
    assert dataset["sampled"] == [False] * 12 + [True] * 12
    lines = []
    training, validation = split_data(load_config(TINY, ["data.validation=3"]), dataset, log=lines.append)
    held = {conversation_key(c) for c in chats} - set(training["conversation"])
    assert len(held) == 3 and set(validation["conversation"]) == held
    assert validation["sampled"] == [False] * 3 and all(s.endswith(f"{greedy}:{s.rsplit(':', 1)[1]}")
                                                          for s in validation["source"])
    assert len(training) == 18 and training["sampled"].count(True) == 9  # the other 9 prompts' sampled replies
    assert "3 conversations (3 samples) held out" in lines[0] and "3 samples of theirs from other versions" in lines[0]
    only_sampled = Dataset.from_dict({"sampled": [False, True, True, True], "conversation": ["a", "a", "b", "c"]})
    assert one_version_each(only_sampled, np.array([0, 1, 2]), only_sampled["conversation"])[0].tolist() == [0, 2]
    assert one_version_each(only_sampled, np.array([1, 2, 3]), only_sampled["conversation"])[1] == 0
    everything_sampled = dataset.select(range(12, 24))  # regenerated only with sampling: walked as it is
    _, walked = split_data(load_config(TINY, ["data.validation=3"]), everything_sampled, log=lambda *a: None)
    assert len(walked) == 3 and walked["sampled"] == [True] * 3


def test_the_held_out_conversations_are_written_for_both_evaluations(tmp_path, monkeypatch):
    """A run with data.validation writes validation.jsonl: exactly the held-out conversations
    (read back from their file:line), with their user turns for `eval --prompts` and their
    messages for `eval --walk`; a sample without a source is left out."""
    from dflash_train.core.target import resolve_target_path
    from dflash_train.data import chat_files, preparation
    from dflash_train.eval.prompts import load_prompts
    from dflash_train.train.loop import VALIDATION_FILE, write_validation_prompts

    chats = tmp_path / "chats.jsonl"
    convs = [([{"role": "system", "content": f"Be brief, {i}."}] if i % 2 else [])
             + [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
             + ([{"role": "user", "content": f"And {i} more?"}, {"role": "assistant", "content": "Yes."}] if i % 3 else [])
             for i in range(24)]
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    prepared = preparation.prepare([chats], resolve_target_path("bundled:tiny-random-llama"), tmp_path / "prepared",
                            log=lambda *a: None)
    cfg = load_config(TINY, ["data.validation=5"])
    training, validation = split_data(cfg, prepared.dataset, log=lambda *a: None)
    out = tmp_path / "run" / VALIDATION_FILE
    write_validation_prompts(out, validation, log=lambda *a: None)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(written) == 5 and [w["id"] for w in written] == list(validation["source"])
    held = {conversation_key(w["messages"]) for w in written}
    assert held == set(validation["conversation"]) and not held & set(training["conversation"])
    for w in written:
        line = int(w["id"].rpartition(":")[2])
        assert w["messages"] == convs[line - 1]
        assert w["turns"] == [m["content"] for m in convs[line - 1] if m["role"] == "user"]
        assert w.get("system") == (convs[line - 1][0]["content"] if line % 2 == 0 else None)  # line = i + 1
    assert {"system" in w for w in written} == {True, False}  # both kinds held out
    assert [(r.turns, r.system) for r in load_prompts(str(out))] == [(w["turns"], w.get("system")) for w in written]
    assert [r.messages for r in chat_files.iter_records([out])] == [w["messages"] for w in written]
    # Written once: a resumed run finds the same records there and reads no data file again.
    monkeypatch.setattr(preparation, "records_at", lambda sources: pytest.fail("read the data files again"))
    write_validation_prompts(out, validation, log=lambda *a: None)
    assert [json.loads(line) for line in out.read_text().splitlines()] == written
    sourceless = Dataset.from_dict({"input_ids": [[1, 2]], "loss_mask": [[0, 1]], "length": [2]})
    write_validation_prompts(tmp_path / "none.jsonl", sourceless, log=lambda *a: None)
    assert not (tmp_path / "none.jsonl").exists()


def test_a_resume_with_another_validation_split_is_refused():
    """Holding out other conversations (another data.validation_seed) can leave every length and
    count of the batch plan equal; the cursor's sample digest still tells the runs apart."""
    from dflash_train.data.batching import BatchStream
    from dflash_train.train.loop import batch_plan

    keys = [f"c{i}" for i in range(500)]
    rows = Dataset.from_dict({"input_ids": [[1, 2, 3]] * 500, "loss_mask": [[0, 1, 1]] * 500, "length": [3] * 500,
                              "conversation": keys})
    streams = []
    for seed in (0, 1):
        cfg = load_config(TINY, ["data.validation=8", f"data.validation_seed={seed}"])
        training, _ = split_data(cfg, rows, log=lambda *a: None)
        streams.append(BatchStream(training, batch_plan(cfg, training["length"])))
    saved = {**streams[0].identity(), "next_index": 3}
    assert {k: v for k, v in streams[1].identity().items() if k != "samples"} == \
        {k: v for k, v in saved.items() if k not in ("samples", "next_index")}
    assert streams[0].check_state(saved) == 3
    with pytest.raises(ValueError, match="samples: saved"):
        streams[1].check_state(saved)
    older = {k: v for k, v in saved.items() if k != "samples"}  # a cursor saved before the digest existed
    assert streams[1].check_state(older) == 3


def test_a_held_out_conversation_is_walked_once_whatever_its_versions():
    """Records that share an opening are one conversation: held out together, and of them one
    record is walked (its first greedy one; all of that record's samples), so that 70 chats
    opening with "continue" do not weigh one first reply 70 times; the others are neither
    walked nor trained on. A record's several samples (a template that rewrites earlier turns)
    stay together."""
    rows = Dataset.from_dict({
        "conversation": ["a", "a", "a", "a", "b", "c", "c"],
        "source": ["f:1", "f:1", "f:2", "g:1", "f:3", "g:2", "f:4"],
        "sampled": [False, False, False, False, False, True, False],
    })
    walked, left_out = one_version_each(rows, np.arange(7), rows["conversation"])
    assert walked.tolist() == [0, 1, 4, 6] and left_out == 3
    walked, left_out = one_version_each(rows, np.array([2, 3, 5]), rows["conversation"])
    assert walked.tolist() == [2, 5] and left_out == 1
    no_source = rows.remove_columns("source")  # data without the column: every greedy sample
    assert one_version_each(no_source, np.arange(7), no_source["conversation"])[0].tolist() == [0, 1, 2, 3, 4, 6]


def test_conversation_key_is_the_opening_so_regenerated_chats_stay_on_their_side():
    raw = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "A joke."},
           {"role": "assistant", "content": "No."}]
    regenerated = [dict(m, content="(the target's own answer)") if m["role"] == "assistant" else m for m in raw]
    assert conversation_key(raw) == conversation_key(regenerated)
    # A version cut short by a token budget (sampled replies run longer and keep fewer turns) is
    # the same conversation: keyed apart, its twin could train while it is walked.
    assert conversation_key(raw) == conversation_key(raw[:3]) == conversation_key(raw[:2])
    assert conversation_key(raw) != conversation_key(raw[1:])  # another system turn
    assert conversation_key(raw) != conversation_key([raw[0], dict(raw[1], content="Hey")])
    # Rows without the column (data prepared by an earlier version): the first prompt's tokens.
    rows = Dataset.from_dict({"input_ids": [[1, 2, 3, 4], [1, 2, 9, 9], [7, 2, 3, 4]],
                              "loss_mask": [[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1]], "length": [4, 4, 4]})
    a, b, c = conversation_keys(rows)
    assert a == b != c


def test_validation_settings_are_checked():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["data.validation=1.5", "checkpoint.keep_best=true", "eval.every=4",
                           "eval.prompts=null"])
    text = str(err.value)
    assert "data.validation must be 0 (off), a count" in text
    assert "checkpoint.keep_best needs the walked validation tau" not in text  # validation is set, if wrong
    with pytest.raises(ConfigError, match="nothing to evaluate"):
        load_config(TINY, ["eval.every=4", "eval.prompts=null"])
    with pytest.raises(ConfigError, match="checkpoint.keep_best needs the walked validation tau"):
        load_config(TINY, ["checkpoint.keep_best=true"])
    with pytest.raises(ConfigError, match=r"make eval.every \(6\) a multiple of checkpoint.every \(4\)"):
        load_config(TINY, ["checkpoint.keep_best=true", "data.validation=8", "eval.every=6", "checkpoint.every=4"])
    cfg = load_config(TINY, ["checkpoint.keep_best=true", "data.validation=0.05", "eval.every=4", "eval.prompts=null",
                             "checkpoint.every=4"])
    assert cfg.data.validation == 0.05 and cfg.eval.prompts is None


# --------------------------------------------------------------------------- during training


def _validated_run(tmp_path, regenerated, *extra, steps=8):
    model, _, dataset, _ = regenerated
    cfg = load_config(TINY, [f"output_dir={tmp_path}", "objective.noise=none", "train.device=cpu",
                             f"drafter.mask_token_id={MASK}", f"train.max_steps={steps}", "data.max_batch_size=4",
                             "data.validation=0.25", "eval.every=2", "eval.prompts=null", "log.every=2",
                             "checkpoint.every=2", "checkpoint.keep=1", "checkpoint.keep_best=true",
                             "checkpoint.export_dtype=float32", *extra])
    return build(cfg, log=lambda *a, **k: None, dataset=dataset, target_config=tiny_target_config(),
                 build_target=lambda ids, logits: Target(copy.deepcopy(model), ids, logits), evaluation=DuringTraining())


def test_training_logs_walked_tau_first_and_keeps_the_best_checkpoint(tmp_path, regenerated, capsys):
    run = _validated_run(tmp_path, regenerated)
    assert 0 < len(run.validation) < 16 and len(run.validation) + len(run.stream.dataset) == 16
    exported = train_drafter(run)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    for r in records:
        assert list(r)[:3] == ["step", "epoch", "walked_tau"] and r["walked_tau"] >= 1
        assert {"walked_tau_cycles", "walked_histogram", "walked_turns", "val_loss", "val_acc_per_position",
                "walk_s", "tau_estimate", "walked_loop_turns", "walked_loop_tau_cycles",
                "walked_other_tau_cycles"} <= set(r) and "eval_tau" not in r
    out = capsys.readouterr().out
    assert "| walked tau " in out and out.index("walked tau") < out.index("tau~")
    taus = [r["walked_tau"] for r in records]
    best = records[taus.index(max(taus))]["step"]
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == sorted({f"step-{best}", "step-8"})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["drafter_step"], summary["drafter_choice"]) == (best, "best walked tau")
    saved = load_file(str(tmp_path / "checkpoints" / f"step-{best}" / "drafter.safetensors"))
    served = load_file(str(exported / "model.safetensors"))
    assert all(torch.equal(served[k], saved[k]) for k in served)


def test_walked_tau_is_told_per_data_file():
    """Each data file's walked tau is the turn mean over that file's turns (a one-token turn has
    no cycle and is left out); one file alone, or samples naming none, tell nothing more."""
    assert walk.file_labels(["/d/chats.jsonl:3", "/d/code.jsonl:1", "/e/code.jsonl:9", "/d/chats.jsonl:7"]) == \
        ["chats.jsonl", "/d/code.jsonl", "/e/code.jsonl", "chats.jsonl"]
    result = walk.WalkResult(16, files=["chats.jsonl", "code.jsonl", "chats.jsonl", "code.jsonl"])
    result.turns = {0: [[3, 1]], 1: [[8, 8, 2]], 2: [[5], []], 3: [[16]]}
    by_file = result.by_file()
    assert list(by_file) == ["chats.jsonl", "code.jsonl"]
    assert by_file["chats.jsonl"] == {"tau": pytest.approx((2 + 5) / 2), "samples": 2, "turns": 2}
    assert by_file["code.jsonl"] == {"tau": pytest.approx((6 + 16) / 2), "samples": 2, "turns": 2}
    assert result.tau == pytest.approx((2 + 6 + 5 + 16) / 4)
    assert walk.WalkResult(16, files=["a.jsonl"] * 2, turns={0: [[2]], 1: [[3]]}).by_file() == {}
    assert walk.WalkResult(16, turns={0: [[2]]}).by_file() == {}


def test_training_walks_each_data_file_of_the_split(tmp_path, regenerated, capsys):
    """A split drawn from two files: every evaluation step records and says the walked tau of
    each, their samples are the walked ones, and their turn-weighted mean is the walked tau."""
    model, prompts, dataset, drafted = regenerated
    named = dataset.add_column("source", [f"{tmp_path}/{'chats' if i % 2 else 'code'}.jsonl:{i + 1}"
                                          for i in range(len(dataset))])
    run = _validated_run(tmp_path, (model, prompts, named, drafted), "data.validation=0.5", steps=4)
    train_drafter(run)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    out = capsys.readouterr().out
    for r in records:
        by_file = r["walked_by_file"]
        assert set(by_file) == {"chats.jsonl", "code.jsonl"}
        assert sum(w["samples"] for w in by_file.values()) == len(run.validation)
        weighted = sum(w["tau"] * w["turns"] for w in by_file.values()) / sum(w["turns"] for w in by_file.values())
        assert weighted == pytest.approx(r["walked_tau"])
        assert f"step {r['step']}: walked tau by data file: " in out


def _script_walks(monkeypatch, taus):
    """The run's validation walks return these walked taus, one per evaluation, in order."""
    from dflash_train.eval import during_training

    scripted = iter(taus)

    class Scripted:
        def __call__(self, drafter):
            return self

        def record(self):
            return {"walked_tau": next(scripted)}

    monkeypatch.setattr(during_training, "validation_walker", lambda run: Scripted())


def test_the_last_step_is_walked_and_can_be_the_best_one(tmp_path, regenerated, monkeypatch):
    """A run of 9 steps with eval.every=2 walks steps 2, 4, 6, 8 and its last step 9 (off the
    cadence); scripted so that step 9 is the best, it is the one exported. A time box that ends a
    run after its first step walks that step."""
    _script_walks(monkeypatch, [1.5, 2.0, 2.1, 2.2, 2.6])
    run = _validated_run(tmp_path / "a", regenerated, steps=9)
    exported = train_drafter(run)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("walked_tau")) for r in records] == [(2, 1.5), (4, 2.0), (6, 2.1), (8, 2.2), (9, 2.6)]
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert (summary["drafter_step"], summary["drafter_choice"]) == (9, "best walked tau")
    live = {k: v.detach().float() for k, v in run.step.drafter.state_dict().items()}
    served = load_file(str(exported / "model.safetensors"))
    assert all(torch.equal(served[k].float(), live[k]) for k in served)

    _script_walks(monkeypatch, [1.25])
    train_drafter(_validated_run(tmp_path / "b", regenerated, "train.max_time_s=1e-9"))
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("walked_tau")) for r in records] == [(1, 1.25)]


def test_keep_best_picks_the_best_step_and_a_resumed_run_remembers_it(tmp_path, regenerated, monkeypatch, capsys):
    """Scripted walked taus 1.5, 2.5, 2.0, 2.5 at steps 2, 4, 6, 8: step 4 is the best (a tie
    keeps the earlier step), its checkpoint outlives keep=1, and its weights are exported; a
    run resumed to step 10 (tau 2.4 there) still exports step 4."""
    _script_walks(monkeypatch, [1.5, 2.5, 2.0, 2.5, 2.4])
    train_drafter(_validated_run(tmp_path, regenerated))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-4", "step-8"]
    assert "step 4: best walked tau so far, 2.500; its checkpoint is kept" in capsys.readouterr().out
    exported = train_drafter(_validated_run(tmp_path, regenerated, steps=10))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-10", "step-4"]
    state = json.loads((tmp_path / "checkpoints" / "step-10" / "trainer_state.json").read_text())
    assert state["best"] == {"step": 4, "value": 2.5}
    saved = load_file(str(tmp_path / "checkpoints" / "step-4" / "drafter.safetensors"))
    served = load_file(str(exported / "model.safetensors"))
    assert all(torch.equal(served[k], saved[k]) for k in served)
    assert json.loads((tmp_path / "summary.json").read_text())["drafter_step"] == 4


# --------------------------------------------------------------------------- eval --walk


def test_eval_walk_writes_the_eval_layout_and_refuses_data_without_assistant_turns(tmp_path, capsys):
    from dflash_train.core.drafter import DFlashDrafter, build_drafter_config, resolve_mask_token_id
    from dflash_train.core.export import export_drafter
    from dflash_train.core.target import load_target_model

    model, tokenizer = load_target_model("bundled:tiny-random-llama", torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    drafter = DFlashDrafter(build_drafter_config(model.config, num_layers=1, block_size=4, num_taps=2,
                                                 mask_token_id=resolve_mask_token_id(tokenizer, model.config.vocab_size)))
    folder = export_drafter(drafter, tmp_path / "drafter", torch.float32)
    chats = tmp_path / "traffic.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in [
        {"conversations": [{"from": "human", "value": "Name three colours."},
                           {"from": "gpt", "value": "Red, green and blue."},
                           {"from": "human", "value": "And two more?"}, {"from": "gpt", "value": "Yellow, white."}]},
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}]},
    ]))
    common = ["eval", "--target", "bundled:tiny-random-llama", "--drafter", str(folder), "--device", "cpu"]
    assert main([*common, "--walk", str(chats), "--output", str(tmp_path / "walk.json")]) == 0
    doc = json.loads((tmp_path / "walk.json").read_text())
    assert {"tau", "per_set", "histogram", "block_size", "settings", "prompts"} <= set(doc)
    walked = doc["per_set"]["traffic"]
    assert walked["num_prompts"] == 2 and walked["num_turns"] == 3 and walked["tau"] == doc["tau"] >= 1
    assert sum(doc["histogram"]) == walked["num_cycles"] and {"loss", "acc_per_position"} <= set(walked)
    assert [p["id"] for p in doc["prompts"]] == [f"{chats}:1", f"{chats}:2"]
    assert [len(p["acceptance_lengths"]) for p in doc["prompts"]] == [2, 1]
    for p in doc["prompts"]:  # each turn's walked reply: its first token (the prefill's) + what the cycles committed
        assert [len(o) for o in p["output_ids"]] == [sum(t) + 1 for t in p["acceptance_lengths"]]
    assert walked["loop_turns"] == 0 and walked["other_tau_cycles"] == walked["tau_cycles"]
    assert (tmp_path / "walk.md").is_file() and (tmp_path / "walk.png").is_file()
    capsys.readouterr()

    silent = tmp_path / "questions.jsonl"
    silent.write_text(json.dumps({"conversations": [{"from": "human", "value": "Anyone there?"}]}) + "\n")
    assert main([*common, "--walk", str(silent), "--output", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err
    assert "no assistant turns to walk" in err and "no assistant turn: 1" in err and "Traceback" not in err
    assert main([*common, "--output", str(tmp_path / "neither.json")]) == 2
    assert "give --prompts" in capsys.readouterr().err
