"""Evaluation: prompt sets and prompt forming, multi-turn runs, the JSON / markdown / PNG
outputs, the `eval` command, the `eval` config section, and train/serve parity (a drafter
trained a few steps with in-training evaluation, exported, loaded back and evaluated)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, subprocess_env
from dflash_train.app.cli import main
from dflash_train.core.config import ConfigError, load_config
from dflash_train.core.target import load_target_model
from dflash_train.engine.decoder import Decoder, Generation, speculative_generate
from dflash_train.engine.proposer import DFlashProposer
from dflash_train.engine.sampling import stop_token_ids
from dflash_train.eval import evaluate, prompts, results
from dflash_train.eval.during_training import DuringTraining

TINY = "bundled:tiny-random-llama"


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """The bundled tiny target (model, tokenizer) and an untrained drafter exported for it."""
    from dflash_train.core.drafter import DFlashDrafter, build_drafter_config, resolve_mask_token_id
    from dflash_train.core.export import export_drafter

    model, tokenizer = load_target_model(TINY, torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    mask = resolve_mask_token_id(tokenizer, model.config.vocab_size)
    drafter = DFlashDrafter(build_drafter_config(model.config, num_layers=1, block_size=4, num_taps=2,
                                                 mask_token_id=mask)).eval()
    folder = export_drafter(drafter, tmp_path_factory.mktemp("drafter") / "drafter", torch.float32)
    return model, tokenizer, drafter, folder


def write_prompts(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# --------------------------------------------------------------------------- prompt sets


def test_prompt_sets_are_formed_as_the_paper_forms_them():
    from dflash_train.core import assets

    mt = prompts.load_prompts("mt-bench")
    assert len(mt) == 80 and all(len(r.turns) == 2 for r in mt)
    first = json.loads(assets.mtbench_jsonl().read_text().splitlines()[0])
    assert mt[0].id == "81" and mt[0].turns == first["turns"]  # no wrapper, no system prompt

    he = prompts.load_prompts("humaneval")
    assert len(he) == 164 and he[0].id == "HumanEval/0"
    prompt0 = he[0].turns[0].split("```python\n", 1)[1].removesuffix("\n```")
    assert he[0].turns == [
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        f"```python\n{prompt0}\n```"
    ]
    assert prompt0.startswith("from typing import List\n\n\ndef has_close_elements(")

    gsm = prompts.load_prompts("gsm8k")
    assert len(gsm) == 1319
    assert gsm[0].turns == [
        "Janet’s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins "
        "for her friends every day with four. She sells the remainder at the farmers' market daily for $2 "
        "per fresh duck egg. How much in dollars does she make every day at the farmers' market?"
        "\nPlease reason step by step, and put your final answer within \\boxed{}."
    ]
    assert len(prompts.load_prompts("gsm8k", limit=3)) == 3


def test_prompt_files_and_their_errors(tmp_path):
    f = write_prompts(tmp_path / "p.jsonl", [{"turns": ["a", "b"]}, {"id": "x", "turns": ["c"]}])
    records = prompts.load_prompts(str(f))
    assert [(r.id, r.turns) for r in records] == [("0", ["a", "b"]), ("x", ["c"])]
    assert prompts.set_label(str(f)) == "p"
    with pytest.raises(ValueError, match="record 1"):
        prompts.load_prompts(str(write_prompts(tmp_path / "bad.jsonl", [{"turns": []}])))
    with pytest.raises(ValueError, match="not one of"):
        prompts.load_prompts("no-such-set")


def test_a_records_system_message_opens_every_turns_prompt(tmp_path, smollm2_tokenizer):
    """A prompts file's "system" (what a run's validation.jsonl carries for a conversation that
    opens with one) comes before the first turn in every turn's prompt; without it the template
    adds its default. A bad "system" is refused with the record's number."""
    from dflash_train.engine.decoder import Generation

    f = write_prompts(tmp_path / "s.jsonl", [{"turns": ["Hi", "More"], "system": "Be terse."}, {"turns": ["Hi"]}])
    records = prompts.load_prompts(str(f))
    assert [r.system for r in records] == ["Be terse.", None]
    seen = []

    class Engine:  # records the prompts it is asked to decode, answers "ok"
        def speculate(self, prompts, new, stop_ids, seed):
            seen.extend(prompts)
            ok = smollm2_tokenizer("ok", add_special_tokens=False)["input_ids"]
            return [Generation(ok, [1] * len(ok), False, 0.0) for _ in prompts]

    evaluate.decode_records(Engine(), smollm2_tokenizer, list(enumerate(records)), name="s", max_new_tokens=4,
                            seed=0, stop_ids=[], baseline=False)
    expected = [[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
                [{"role": "user", "content": "Hi"}],
                [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": "ok"}, {"role": "user", "content": "More"}]]
    assert seen == [prompts.prompt_ids(smollm2_tokenizer, m) for m in expected]
    assert "Be terse." in smollm2_tokenizer.decode(seen[2]) and "Be terse." not in smollm2_tokenizer.decode(seen[1])
    with pytest.raises(ValueError, match="record 1: \"system\" must be a string"):
        prompts.load_prompts(str(write_prompts(tmp_path / "b.jsonl", [{"turns": ["a"], "system": 3}])))


def test_prompt_ids_are_the_chat_template_with_generation_prompt(smollm2_tokenizer):
    messages = [{"role": "user", "content": "Hi there"}]
    ids = prompts.prompt_ids(smollm2_tokenizer, messages)
    text = smollm2_tokenizer.decode(ids)
    assert text == smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------- running sets


def test_second_turn_sees_our_first_answer(tiny_setup):
    model, tokenizer, drafter, _ = tiny_setup
    proposer = DFlashProposer.for_target(drafter, model)
    records = [prompts.PromptRecord("q", ["Name a colour.", "And another one?"])]
    result = evaluate.run_prompt_set(Decoder(model, proposer), tokenizer, records, max_new_tokens=12,
                                     measure_speedup=True)
    entry = result.prompts[0]
    assert len(entry["acceptance_lengths"]) == len(entry["output_ids"]) == 2
    assert result.mismatched_turns == 0 and result.baseline_tokens == result.spec_tokens
    first = entry["output_ids"][0]
    stop = stop_token_ids(tokenizer, model.generation_config)
    answer = tokenizer.decode(first[:-1] if first[-1] in stop else first, skip_special_tokens=True)
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": answer},
                {"role": "user", "content": "And another one?"}]
    again = speculative_generate(model, prompts.prompt_ids(tokenizer, messages), proposer, 12,
                                         stop_ids=stop, seed=1)
    assert again.output_ids == entry["output_ids"][1]


def test_combine_reports_the_papers_tau():
    a = results.SetResult("a", 4, prompts=[{"acceptance_lengths": [[1, 1], [4]]}], spec_seconds=1.0, spec_tokens=10,
                           spec_cycles=4, baseline_seconds=3.0, baseline_tokens=10)
    b = results.SetResult("b", 4, prompts=[{"acceptance_lengths": [[2, 2, 2]]}], spec_seconds=1.0, spec_tokens=10,
                           spec_cycles=3, baseline_seconds=1.0, baseline_tokens=10)
    doc = results.combine([a, b], {"temperature": 0.0})
    assert doc["per_set"]["a"]["tau"] == 2.5  # mean of turn means (1 and 4), not of cycles (2)
    assert doc["per_set"]["a"]["tau_cycles"] == 2.0
    assert doc["per_set"]["a"]["speedup"] == pytest.approx(3.0) and doc["speedup"] == pytest.approx(2.0)
    # A cycle of `a` took 1.0 / 4 s, a target-only step 3.0 / 10 s: 0.83 steps.
    assert doc["per_set"]["a"]["spec_s_per_cycle"] == 0.25
    assert doc["per_set"]["a"]["cycle_target_steps"] == pytest.approx(0.25 / 0.3)
    assert doc["cycle_target_steps"] == pytest.approx((2.0 / 7) / (4.0 / 20))  # over both sets' timed turns
    assert results.speedup_fields(1.0, 10, 1.0, 10)["cycle_target_steps"] is None  # no cycles counted
    assert doc["tau"] == 2.25
    assert doc["histogram"] == [2, 3, 0, 1]


def test_mismatched_turns_say_where_the_two_outputs_first_differ():
    """A turn whose speculative and target-only outputs differ is listed with the token where they
    first differ (a prefix: the shorter one's length); the summary gives the median and range."""
    assert evaluate.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert evaluate.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert evaluate.first_difference([1, 2], [1, 2, 3]) == 2 and evaluate.first_difference([4], []) == 0

    class Text:
        def decode(self, ids, **kw):
            return " ".join(map(str, ids))

    result, entry = results.SetResult("s", 4), {"id": "r", "acceptance_lengths": [], "output_ids": []}
    stats, messages = [], []
    for spec, base in (([1, 2, 3, 4], [1, 2, 3, 4]), ([1, 2, 3, 4], [1, 2, 9, 4]), ([1, 2, 3, 4, 5], [7, 2])):
        evaluate._add_turn(entry, stats, messages, Text(), Generation(spec, [1] * (len(spec) - 1)),
                           Generation(base))
    result.add_record(entry, stats)
    summary = result.summary()
    assert summary["mismatched_turns"] == 2
    assert summary["mismatches"] == [{"id": "r", "turn": 1, "first_difference": 2, "new_tokens": 4},
                                     {"id": "r", "turn": 2, "first_difference": 0, "new_tokens": 5}]
    text = results.markdown_summary(results.combine([result], {"temperature": 0.0}))
    assert "s 2 (first differing token: median 1, 0-2)" in text
    unchecked = results.SetResult("t", 4, prompts=[{"acceptance_lengths": [[1]]}]).summary()
    assert unchecked["mismatches"] is None and unchecked["mismatched_turns"] is None


def test_loop_period_finds_the_loop_a_turn_ends_in():
    prose = list(range(100, 140))  # 40 distinct ids
    assert results.loop_period(prose + [7] * 32) == 1
    assert results.loop_period(prose + [1, 2, 3, 4, 5] * 7) == 5  # 35 ids: 3 periods and >= 32 tokens
    assert results.loop_period(prose + [1, 2, 3, 4, 5] * 6) is None  # 30 ids: under 32
    assert results.loop_period(prose + list(range(40)) * 3) == 40  # a sentence said three times
    assert results.loop_period(prose + list(range(40)) * 2) is None  # twice is not a loop
    assert results.loop_period(prose + [7] * 32 + [2]) is None  # it ended on a stop token
    assert results.loop_period([7] * 31) is None and results.loop_period([]) is None
    assert results.loop_period(prose) is None

    def plain(ids):  # the definition, period by period
        for p in range(1, len(ids) // 3 + 1):
            span = max(3 * p, 32)
            if span <= len(ids) and ids[-span:][p:] == ids[-span:][:-p]:
                return p
        return None

    rng = random.Random(0)
    for _ in range(500):
        pattern = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
        ids = [rng.randrange(5) for _ in range(rng.randrange(60))] + pattern * rng.randrange(8) \
            + [rng.randrange(3) for _ in range(rng.randrange(3))]
        assert results.loop_period(ids) == plain(ids), ids


def test_sets_report_tau_on_looping_turns_apart():
    looping, plain = list(range(50)) + [9] * 40, list(range(60))
    result = results.SetResult("s", 16, prompts=[
        {"acceptance_lengths": [[16, 16, 16, 16, 16, 10], [2, 1, 3]], "output_ids": [looping, plain]},
        {"acceptance_lengths": [[1, 1]], "output_ids": [plain[:3]]}])
    summary = result.summary()
    assert summary["loop_turns"] == 1
    assert summary["loop_tau_cycles"] == 90 / 6 and summary["other_tau_cycles"] == 8 / 5
    text = results.markdown_summary(results.combine([result], {"temperature": 0.0, "max_new_tokens": 90}))
    assert "Turns ending in a loop" in text and "s 1 of 3 (tau over cycles 15.000 there, 1.600 elsewhere)" in text
    assert "loop_turns" not in results.SetResult("t", 4, prompts=[{"acceptance_lengths": [[1]]}]).summary()


def test_eval_command_writes_json_markdown_and_png(tiny_setup, tmp_path, capsys):
    _, _, _, folder = tiny_setup
    prompts = write_prompts(tmp_path / "mine.jsonl", [{"turns": ["Hello!", "Tell me more."]}, {"turns": ["2+2?"]}])
    out = tmp_path / "res" / "eval.json"
    rc = main(["eval", "--target", TINY, "--drafter", str(folder), "--prompts", f"{prompts},gsm8k",
               "--limit", "1", "--max-new-tokens", "10", "--output", str(out), "--device", "cpu"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc) >= {"tau", "per_set", "histogram", "speedup", "prompts"}
    assert set(doc["per_set"]) == {"mine", "gsm8k"}
    assert doc["per_set"]["mine"]["num_prompts"] == 1 and doc["per_set"]["mine"]["num_turns"] == 2
    assert all(s["mismatched_turns"] == 0 for s in doc["per_set"].values())
    assert doc["speedup"] > 0 and len(doc["histogram"]) == 4
    timed = doc["per_set"]["mine"]  # its two turns timed both ways: the cycle's cost in target-only steps
    assert timed["cycle_target_steps"] == pytest.approx(timed["spec_s_per_cycle"] / timed["baseline_s_per_token"])
    assert timed["spec_s_per_cycle"] > 0 and doc["cycle_target_steps"] > 0
    for p in doc["prompts"]:
        assert set(p) >= {"id", "acceptance_lengths", "output_ids"}
        for lengths, ids in zip(p["acceptance_lengths"], p["output_ids"]):
            assert 1 + sum(lengths) == len(ids)
    assert "| mine | 1 | 2 |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tau" in capsys.readouterr().out
    assert main(["eval", "--target", TINY, "--drafter", str(folder), "--prompts", "nope",
                 "--output", str(tmp_path / "x.json")]) == 2


def test_eval_config_section_is_validated(tmp_path):
    assert load_config(None).eval.every == 0
    with pytest.raises(ConfigError) as err:
        load_config(None, ["eval.every=15", "eval.prompts=missing.jsonl", "eval.max_new_tokens=0"])
    text = str(err.value)
    assert "multiple of log.every" in text and "eval.prompts" in text and "eval.max_new_tokens" in text
    cfg = load_config(None, ["eval.every=20", "eval.prompts=gsm8k"])
    assert cfg.eval.every == 20


# --------------------------------------------------------------------------- parity


@pytest.mark.slow
def test_exported_drafter_reproduces_in_training_evaluation(tmp_path):
    """Train a few steps with evaluation every 2 steps, export in float32, evaluate the export
    with `dflash-train eval` in float32: the acceptance lengths per prompt and turn are those
    of the last in-training evaluation. (With the random tiny target a few steps do not lift
    acceptance above 1, so this checks the pipeline end to end; that acceptance depends on the
    drafter's weights exactly as served is checked in test_specdec.py, incremental vs fresh.)"""
    from dflash_train.train.loop import train

    prompts = write_prompts(tmp_path / "held_out.jsonl",
                            [{"turns": ["What is a drafter?", "Why?"]}, {"turns": ["Count to ten."]},
                             {"turns": ["Write a haiku about rain."]}])
    out = tmp_path / "run"
    cfg = load_config("configs/tiny.yaml", [
        f"output_dir={out}", "train.max_steps=6", "log.every=2", "checkpoint.every=6",
        "eval.every=2", f"eval.prompts={prompts}", "eval.limit=null", "eval.max_new_tokens=24",
        "checkpoint.export_dtype=float32",
    ])
    exported = train(cfg, log=lambda *a: None, evaluation=DuringTraining())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "eval_tau" in r]
    assert [r["step"] for r in evaluated] == [2, 4, 6]
    last = evaluated[-1]
    result = tmp_path / "eval.json"
    assert main(["eval", "--target", TINY, "--drafter", str(exported), "--prompts", str(prompts),
                 "--max-new-tokens", "24", "--dtype", "float32", "--device", "cpu", "--no-speedup",
                 "--output", str(result)]) == 0
    doc = json.loads(result.read_text())
    assert [p["acceptance_lengths"] for p in doc["prompts"]] == last["eval_acceptance_lengths"]
    assert doc["per_set"]["held_out"]["tau"] == pytest.approx(last["eval_tau"])


# --------------------------------------------------------------------------- worker processes


def _without_timings(doc: dict) -> dict:
    timing = {"speedup", "baseline_s_per_token", "spec_s_per_token", "spec_s_per_cycle", "cycle_target_steps", "timed",
              "turn_costs"}
    doc = {k: v for k, v in doc.items() if k not in timing | {"wall_s", "settings"}}
    doc["per_set"] = {name: {k: v for k, v in s.items() if k not in timing} for name, s in doc["per_set"].items()}
    return doc


def test_the_warm_capacity_holds_every_timed_turn(tiny_setup):
    """The timing pass warms the engine up to warm_capacity; a record's later turns (longer
    prompts: the earlier turns and answers) must fit in it, since growing the caches drops
    every captured graph inside a timed turn."""
    model, tokenizer, drafter, _ = tiny_setup
    records = [prompts.PromptRecord("a", ["Tell me a long story about a cat.", "And another one, longer.",
                                           "One more."]),
               prompts.PromptRecord("b", ["Hi"], system="Be brief.")]
    new = 24
    capacity = evaluate.warm_capacity(tokenizer, [("mine", records)], new, drafter.block_size)
    proposer = DFlashProposer.for_target(drafter, model)
    engine = Decoder(model, proposer, capacity=capacity)
    steps = engine.target
    stop_ids = stop_token_ids(tokenizer, model.generation_config)
    for i, record in enumerate(records):
        entry, turns = evaluate.decode_record(engine, tokenizer, record, i, name="mine", max_new_tokens=new, seed=0,
                                              stop_ids=stop_ids, baseline=True)
        assert len(entry["output_ids"]) == len(record.turns)
    assert engine.target is steps, "a timed turn grew the caches"
    assert turns[-1].prompt_tokens + new <= capacity


def test_workers_give_the_results_of_one_process(tiny_setup, tmp_path):
    """Records split over 2 processes (one at a time, or in batches of 2), merged in prompt
    order: everything but the timings equals the one-process run; the speedup is measured in
    the parent on the first turns."""
    _, _, _, folder = tiny_setup
    prompts = write_prompts(tmp_path / "mine.jsonl", [{"turns": ["Hello!", "Tell me more."]}, {"turns": ["2+2?"]},
                                                      {"turns": ["Name a fruit.", "Another?"]}, {"turns": ["Hi"]}])
    run = lambda workers, batch_size=1: evaluate.evaluate(
        TINY, str(folder), [str(prompts), "gsm8k"], limit=3, decoding=evaluate.Decoding(max_new_tokens=12),
        timing=evaluate.Timing(speedup_turns=3),
        placement=evaluate.Placement(device="cpu", workers=workers, batch_size=batch_size), log=lambda *_: None)
    one, two, batched = run(1), run(2), run(2, batch_size=2)  # the last: each worker decodes batches of 2
    assert _without_timings(two) == _without_timings(one) == _without_timings(batched)
    assert [len(p["output_ids"]) for p in two["prompts"]] == [2, 1, 2, 1, 1, 1]
    for doc in (one, two, batched):
        assert doc["per_set"]["mine"]["speedup_turns"] == 3 and doc["speedup_turns"] == 6
        assert doc["speedup"] > 0 and doc["settings"]["speedup_turns"] == 3
        # The timed turns one by one: the set's figures are their sums.
        mine = doc["per_set"]["mine"]
        timed = mine["timed"]
        assert [(t["id"], t["turn"]) for t in timed] == [("0", 0), ("0", 1), ("1", 0)]
        assert timed[1]["prompt_tokens"] > timed[0]["prompt_tokens"] > 0  # the second turn sees the first
        spec_s = sum(t["spec_s"] for t in timed)
        assert sum(t["new_tokens"] for t in timed) * mine["spec_s_per_token"] == pytest.approx(spec_s)
        assert sum(t["baseline_tokens"] for t in timed) * mine["baseline_s_per_token"] == \
            pytest.approx(sum(t["baseline_s"] for t in timed))
        assert sum(t["cycles"] for t in timed) * mine["spec_s_per_cycle"] == pytest.approx(spec_s)
        for t in timed:
            assert 0 < t["spec_first_token_s"] <= (t["spec_first_cycle_s"] or t["spec_s"]) <= t["spec_s"]
        # Where the timed turns' seconds go, over both sets: first token, first cycle, later cycles.
        costs = doc["turn_costs"]
        every = [t for s in doc["per_set"].values() for t in s["timed"] if t["spec_first_cycle_s"] is not None]
        assert costs["turns"] == len(every) > 0
        spent = costs["turns"] * (costs["spec_first_token_s"] + costs["spec_first_cycle_s"]) + \
            costs["spec_s_per_later_cycle"] * sum(t["cycles"] - 1 for t in every)
        assert spent == pytest.approx(sum(t["spec_s"] for t in every))
        assert "ms to its first token (prefill)" in results.markdown_summary(doc)
    assert two["settings"]["workers"] == 2 and two["settings"]["stop_ids"] == one["settings"]["stop_ids"]


@pytest.mark.parametrize("temperature", [0.0, 5.0])  # this tiny target samples varied text only when hot
def test_batch_size_gives_the_results_of_batch_one(tiny_setup, tmp_path, temperature):
    """--batch-size 2 (records decoded two at a time, turn by turn; the target-only check
    batched too) writes what --batch-size 1 writes, timings aside; an odd record count leaves
    a batch of one, and the speedup is still timed at batch size 1."""
    _, _, _, folder = tiny_setup
    prompts = write_prompts(tmp_path / "mine.jsonl", [{"turns": ["Hello!", "Tell me more."]}, {"turns": ["2+2?"]},
                                                      {"turns": ["Name a fruit.", "Another?"]}])
    docs = {}
    for batch_size in (1, 2):
        out = tmp_path / f"batch-{batch_size}.json"
        assert main(["eval", "--target", TINY, "--drafter", str(folder), "--prompts", f"{prompts},gsm8k",
                     "--limit", "3", "--max-new-tokens", "12", "--speedup-turns", "2", "--temperature",
                     str(temperature), "--device", "cpu", "--batch-size", str(batch_size), "--output", str(out)]) == 0
        docs[batch_size] = json.loads(out.read_text())
    assert _without_timings(docs[2]) == _without_timings(docs[1])
    assert [len(p["output_ids"]) for p in docs[2]["prompts"]] == [2, 1, 2, 1, 1, 1]
    assert all(s["mismatched_turns"] == 0 for s in docs[2]["per_set"].values())
    assert docs[2]["settings"]["batch_size"] == 2 and docs[2]["speedup_turns"] == 4 and docs[2]["speedup"] > 0


def test_a_failing_worker_fails_the_command(tiny_setup, tmp_path, capsys):
    """Damaged weights pass the checks made before loading (config.json is fine) and fail in the
    workers, which load them: the command fails with the worker's words and exit status."""
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_setup[3], damaged)
    (damaged / "model.safetensors").write_bytes(b"\x07" * 64)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"turns": ["a"]}, {"turns": ["b"]}])
    rc = main(["eval", "--target", TINY, "--drafter", str(damaged), "--prompts", str(prompts),
               "--workers", "2", "--device", "cpu", "--output", str(tmp_path / "e.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "worker" in err and f"--drafter: {damaged}: weights unusable" in err and "Traceback" not in err
    assert main(["eval", "--target", TINY, "--drafter", "x", "--prompts", str(prompts), "--workers", "0",
                 "--speedup-turns", "-1", "--batch-size", "0", "--output", str(tmp_path / "e.json")]) == 2
    err = capsys.readouterr().err
    assert "--workers must be >= 1" in err and "--speedup-turns must be >= 0" in err
    assert "--batch-size must be >= 1" in err


def test_quality_run_recipe_is_a_valid_configuration():
    """The training settings scripts/quality_run.sh passes by default (its TRAIN_ARGS, as bash
    expands them) are recipe.QUALITY_TRAIN_ARGS, and they load as a configuration with the
    measured recipe's levers set; its default SOURCES are recipe.QUALITY_SOURCES, each a source
    `data source` knows, and SOURCES= turns them off."""
    from dflash_train.app.recipe import QUALITY_SOURCES, QUALITY_TRAIN_ARGS
    from dflash_train.data import sources

    script = (ROOT / "scripts" / "quality_run.sh").read_text()
    start = script.index('SOURCES="${SOURCES-')
    assignment = script[start:script.index("\n", start)]
    for given, expected in ((None, [f"{name}:{count}" for name, count in QUALITY_SOURCES]), ("", [])):
        setup = "unset SOURCES" if given is None else f"SOURCES={given}"
        out = subprocess.run(["bash", "-c", f'{setup}; PYTHON={sys.executable}; {assignment}\nprintf "%s" "$SOURCES"'],
                             capture_output=True, text=True, check=True, env=subprocess_env()).stdout
        assert out.split() == expected
    assert QUALITY_SOURCES and all(name in sources.SOURCES and count > 0 for name, count in QUALITY_SOURCES)

    script = (ROOT / "scripts" / "quality_run.sh").read_text()
    start = script.index('TRAIN_ARGS="${TRAIN_ARGS-')
    assignment = script[start:script.index("\n", start)]
    out = subprocess.run(["bash", "-c", f'unset TRAIN_ARGS; PYTHON={sys.executable}; {assignment}\nprintf "%s" "$TRAIN_ARGS"'],
                         capture_output=True, text=True, check=True, env=subprocess_env()).stdout
    assert out.split() == list(QUALITY_TRAIN_ARGS)
    cfg = load_config(None, out.split())
    assert cfg.drafter.num_layers == 5 and cfg.objective.num_anchors == 512
    assert cfg.objective.weighting == "dpace" and cfg.objective.loop_tails == "skip"


def test_quality_run_script_smoke_test_runs_end_to_end(tmp_path):
    """The CPU smoke test in scripts/quality_run.sh's header (the same settings): regenerate,
    train and evaluate with the tiny random target; every stage's output and the timings exist.
    Keeps the script's defaults and knobs working with the CLI they call."""
    header = (ROOT / "scripts" / "quality_run.sh").read_text()
    settings = {"TARGET": TINY, "NUM_RECORDS": "6", "SOURCES": "word-problems:3", "MAX_NEW_TOKENS": "8",
                "TRAIN_STEPS": "4", "TRAIN_ARGS": "", "REGEN_ARGS": "--temperature 5", "VALIDATION": "2",
                "EVAL_EVERY": "2", "EVAL_LIMIT": "2", "EVAL_MAX_NEW_TOKENS": "16", "EVAL_BATCH_SIZE": "2",
                "DEVICE": "cpu", "WORKERS": "1"}
    for key, value in settings.items():  # the header documents this very command
        assert (f"{key}={value} " if " " not in value else f'{key}="{value}"') in header, key
    out = tmp_path / "qr"
    extra = tmp_path / "mine.jsonl"  # EXTRA_DATA: trained on as it is
    extra.write_text(json.dumps({"conversations": [{"from": "human", "value": "Name a colour."},
                                                   {"from": "gpt", "value": "Blue, like the sky at noon."}]}) + "\n")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "quality_run.sh")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600,
                          env=subprocess_env(**settings, OUT=str(out), PYTHON=sys.executable, OMP_NUM_THREADS="1",
                                             EXTRA_DATA=str(extra), SOURCE_SAMPLES="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sum(1 for _ in open(out / "regenerated.jsonl")) == 6
    assert sum(1 for _ in open(out / "regenerated-word-problems.jsonl")) == 3  # SOURCES, trained on too
    config = (out / "train" / "config.yaml").read_text()
    assert "regenerated-word-problems.jsonl" in config and str(extra) in config
    sampled = out / "regenerated-word-problems-t1.0-p0.95-s1.jsonl"  # SOURCE_SAMPLES=1: one sampled answer more
    assert str(sampled) in config and sum(1 for _ in open(sampled)) == 3
    greedy = [json.loads(line) for line in open(out / "regenerated-word-problems.jsonl")]
    again = [json.loads(line) for line in open(sampled)]
    assert [r["id"] for r in again] == [r["id"] for r in greedy] and again != greedy  # same prompts, other answers
    assert (out / "train" / "drafter" / "config.json").is_file()
    records = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "walked_tau" in r] == [2, 4]  # the validation walked every 2 steps
    summary = json.loads((out / "train" / "summary.json").read_text())
    assert summary["drafter_choice"] == "best walked tau"
    held = (out / "train" / "validation.jsonl").read_text().splitlines()
    assert len(held) >= 2  # 2 conversations (a conversation may have several records)
    check = json.loads((out / "validation-tau.json").read_text())
    walked, served = (json.loads((out / f"validation-{k}.json").read_text()) for k in ("walked", "served"))
    assert check["walked_tau"] == walked["tau"] >= 1 and check["served_tau"] == served["tau"] >= 1
    assert walked["per_set"]["validation"]["num_prompts"] == served["per_set"]["validation"]["num_prompts"] == len(held)
    result = json.loads((out / "eval.json").read_text())
    assert set(result["per_set"]) == {"mt-bench", "humaneval", "gsm8k"} and result["tau"] >= 1.0
    assert all(v["mismatched_turns"] == 0 for v in result["per_set"].values())  # float32 on CPU: lossless
    timings = json.loads((out / "timings.json").read_text())
    assert timings["train_steps"] == 4 and timings["train_gpus"] == 1 and timings["train_s"] > 0
    assert timings["sources"] == "word-problems:3" and timings["regenerate_sources_s"] > 0
    assert timings["walk_validation_s"] > 0 and timings["serve_validation_s"] > 0
    assert (out / "eval.md").is_file() and (out / "eval.png").is_file()


def test_a_turns_answer_reaches_the_next_turn_as_generated(smollm2_path):
    """The next turn sees our answer decoded without the tokenizer's clean-up of spaces before
    punctuation (which transformers 4.x applies where a tokenizer asks for it), so its context is
    the same under every transformers version: the decoded text re-encodes to the same ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    calls = []

    class Recording:
        def decode(self, ids, **kwargs):
            calls.append(kwargs)
            return tokenizer.decode(ids, **kwargs)

    answer = tokenizer.encode("Yes , it is . Done !", add_special_tokens=False)
    gen = Generation(output_ids=answer + [tokenizer.eos_token_id], acceptance_lengths=[len(answer)],
                             stopped=True)
    entry, messages = {"id": "r", "acceptance_lengths": [], "output_ids": []}, []
    evaluate._add_turn(entry, [], messages, Recording(), gen, None)
    assert calls == [{"skip_special_tokens": True, "clean_up_tokenization_spaces": False}]
    assert messages == [{"role": "assistant", "content": "Yes , it is . Done !"}]


def test_check_lossless_script_compares_three_decoders_and_exports_its_drafter(tmp_path):
    """scripts/check_lossless.py (the float32 check run on GPU targets, docs/EVALUATION.md) on the
    tiny target: every turn's target-only, speculative and `generate` outputs agree, its JSON says
    so per turn, and the random drafter it exports loads as a drafter folder."""
    import importlib.util

    from dflash_train.core.export import load_drafter

    spec = importlib.util.spec_from_file_location("check_lossless", ROOT / "scripts" / "check_lossless.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "lossless"
    assert script.main(["--target", "bundled:tiny-random-llama", "--device", "cpu", "--prompts", "1",
                        "--new-tokens", "8", "--rows", "2", "--out", str(out)]) == 0
    result = json.loads((out / "lossless.json").read_text())
    assert result["num_turns"] == 3 and result["num_differ"] == 0
    assert {t["set"] for t in result["turns"]} == {"mt-bench", "humaneval", "gsm8k"}
    assert all(t["speculative_vs_target_only"] is None and t["tokens"] >= 1 for t in result["turns"])
    assert load_drafter(out / "random-drafter", "random-drafter").config.dflash_config["block_size"] == 16


def test_an_eval_writes_over_its_own_results_only(tmp_path):
    """An earlier result and its .md and .png are replaced; a file that is not a result (prompts,
    data, a JSON of something else), or a .md or .png beside an --output that no eval wrote, is
    named and kept."""
    out = tmp_path / "eval.json"
    assert results.outputs_problem(out) is None
    out.write_text(json.dumps({"tau": 3.2, "per_set": {}, "histogram": [1]}) + "\n")
    out.with_suffix(".md").write_text("| set | tau |\n")
    assert results.outputs_problem(out) is None
    out.write_text(json.dumps({"turns": ["a prompt"]}) + "\n")
    assert results.outputs_problem(out) == f"{out} exists and is not an eval result; writing would replace it"
    notes = tmp_path / "run.json"
    notes.with_suffix(".md").write_text("my notes\n")
    assert results.outputs_problem(notes) == (f"{notes.with_suffix('.md')} exists beside it and no eval wrote it "
                                              f"(there is no run.json); writing would replace it")
