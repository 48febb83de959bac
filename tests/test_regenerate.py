"""Regeneration on CPU with a tiny random Llama and the real SmolLM2 tokenizer: turn-by-turn
context, formats kept, exact resume after an interruption."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_train.app import cli
from dflash_train.data import chat_files, regenerate

SHAREGPT = [
    {"id": f"r{i}", "conversations": [
        {"from": "human", "value": "hello " * (i % 4 + 1)}, {"from": "gpt", "value": "old answer"},
        {"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "old again"}]}
    for i in range(9)
]
OPENAI = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Count to {i}"},
                        {"role": "assistant", "content": "old"}], "source": "test"} for i in range(3)]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, smollm2_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    folder = tmp_path_factory.mktemp("tiny-target")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # A 64-wide model gains nothing from intra-op threads, and on a busy 2-core machine their
    # spin-waiting made these tests 3x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield folder
    torch.set_num_threads(threads)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run(paths, target, out, log=lambda *_: None, tokenizer=None, **options):
    settings = {"max_new_tokens": 6, "batch_size": 3, "device": "cpu"}
    return regenerate.regenerate(paths, target, out, regenerate.RegenerationOptions(**{**settings, **options}),
                                 log=log, tokenizer=tokenizer)


def greedy_turn(model, tokenizer, messages, max_new_tokens=6):
    """One conversation, batch of one, no padding: the slow reference. (reply, whether it ended
    on the stop token)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=2, eos_token_id=2)[0, ids.shape[1]:].tolist()
    stopped = 2 in out
    out = out[: out.index(2)] if stopped else out
    return tokenizer.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False), stopped


def greedy_reply(model, tokenizer, messages, max_new_tokens=6):
    return greedy_turn(model, tokenizer, messages, max_new_tokens)[0]


def test_turn_by_turn_matches_unbatched_reference(tmp_path, tiny_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = write_jsonl(tmp_path / "in.jsonl", SHAREGPT)
    summary = run([src], tiny_target, tmp_path / "out.jsonl")
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines] == [r["id"] for r in SHAREGPT]
    for record, line in zip(SHAREGPT[:4], lines):
        turns = line["conversations"]
        assert [t["from"] for t in turns] == ["human", "gpt", "human", "gpt"]
        assert [turns[0]["value"], turns[2]["value"]] == [record["conversations"][0]["value"],
                                                          record["conversations"][2]["value"]]
        context = [{"role": "user", "content": turns[0]["value"]}]
        first, first_stopped = greedy_turn(model, tokenizer, context)
        # The second reply sees the regenerated first reply, not the original one.
        second, second_stopped = greedy_turn(model, tokenizer, context + [{"role": "assistant", "content": first},
                                                                          {"role": "user", "content": turns[2]["value"]}])
        assert [turns[1]["value"], turns[3]["value"]] == [first, second]
        assert first != "old answer"
        # A reply cut at the budget is marked so; one that ended on the stop token is not.
        assert [turns[1].get("unfinished", False), turns[3].get("unfinished", False)] == \
            [not first_stopped, not second_stopped]
    marked = sum(t.get("unfinished", False) for line in lines for t in line["conversations"])
    assert marked == summary["num_unfinished"] > 0


def test_openai_format_kept(tmp_path, tiny_target):
    src = write_jsonl(tmp_path / "in.jsonl", OPENAI)
    summary = run([src], tiny_target, tmp_path / "out.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [[m["role"] for m in line["messages"]] for line in lines] == [["system", "user", "assistant"]] * 3
    assert all(line["source"] == "test" and line["messages"][2]["content"] != "old" for line in lines)
    assert summary["num_turns"] == 3 and summary["num_written"] == 3


def test_resume_after_interruption_equals_one_run(tmp_path, tiny_target):
    src = write_jsonl(tmp_path / "in.jsonl", SHAREGPT + [{"conversations": [{"from": "alien", "value": "x"}]}])
    whole = tmp_path / "whole.jsonl"
    summary = run([src], tiny_target, whole, batch_size=2)
    assert summary["num_skipped"] == 1 and summary["num_written"] == 9
    parts = tmp_path / "parts.jsonl"
    run([src], tiny_target, parts, batch_size=2, limit=3)  # stops mid-chunk (chunks are 8)
    assert len(parts.read_text().splitlines()) == 3
    with open(parts, "a") as handle:  # a run killed while writing its next line
        handle.write('{"id": "r3", "conversations": [{"from": "hu')
    resumed = run([src], tiny_target, parts, batch_size=2)
    assert resumed["num_resumed"] == 3 and resumed["num_written"] == 6
    assert parts.read_text() == whole.read_text()
    assert run([src], tiny_target, parts, batch_size=2)["num_written"] == 0  # already complete


def test_a_deadline_ends_the_run_with_what_it_wrote_and_a_rerun_completes_it(tmp_path, tiny_target):
    """RegenerationOptions.deadline (the recipe's data budget): past it no more turns are taken,
    the records finished are written, `out_of_time` says why, and the rerun resumes to the file
    of a run without a deadline."""
    import time

    src = write_jsonl(tmp_path / "in.jsonl", SHAREGPT)
    whole = tmp_path / "whole.jsonl"
    run([src], tiny_target, whole, batch_size=2)
    boxed = tmp_path / "boxed.jsonl"
    summary = run([src], tiny_target, boxed, batch_size=2, deadline=time.time() - 1)
    assert summary["out_of_time"] and not summary.get("stopped")
    assert summary["num_written"] < 9 and len(boxed.read_text().splitlines()) == summary["num_written"]
    run([src], tiny_target, boxed, batch_size=2)
    assert boxed.read_text() == whole.read_text()


def test_output_from_other_input_is_refused(tmp_path, tiny_target):
    out = write_jsonl(tmp_path / "out.jsonl", [SHAREGPT[5]])
    src = write_jsonl(tmp_path / "in.jsonl", SHAREGPT)
    with pytest.raises(chat_files.DataError, match="does not match input record"):
        run([src], tiny_target, out)


def test_long_prompts_cut_the_conversation(tmp_path, tiny_target):
    src = write_jsonl(tmp_path / "in.jsonl", SHAREGPT[:2])
    summary = run([src], tiny_target, tmp_path / "out.jsonl", max_prompt_length=45)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    # SmolLM2's default system prompt alone is ~20 tokens; the second turn's prompt is longer than 45.
    assert summary["num_cut"] == 2 and [len(line["conversations"]) for line in lines] == [3, 3]


def test_sampling_is_seeded(tmp_path, tiny_target):
    src = write_jsonl(tmp_path / "in.jsonl", SHAREGPT[:3])
    outs = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        run([src], tiny_target, tmp_path / f"{name}.jsonl", temperature=1.0, top_p=0.9, seed=seed)
        outs.append((tmp_path / f"{name}.jsonl").read_text())
    assert outs[0] == outs[1] != outs[2]
    # Each sampled record says how it was sampled; a greedy regeneration of it says nothing.
    marks = [json.loads(line)[chat_files.SAMPLED_REPLIES] for line in outs[2].splitlines()]
    assert marks == [{"temperature": 1.0, "top_p": 0.9, "seed": 2}] * 3
    run([tmp_path / "c.jsonl"], tiny_target, tmp_path / "greedy.jsonl")
    greedy = [json.loads(line) for line in (tmp_path / "greedy.jsonl").read_text().splitlines()]
    assert len(greedy) == 3 and not any(chat_files.SAMPLED_REPLIES in record for record in greedy)
    assert not any(r.sampled for r in chat_files.iter_records([tmp_path / "greedy.jsonl"]))
    assert all(r.sampled for r in chat_files.iter_records([tmp_path / "c.jsonl"]))


def test_cli_regenerate(tmp_path, tiny_target, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", OPENAI[:2])
    out = tmp_path / "out.jsonl"
    argv = ["data", "regenerate", "--data", str(src), "--target", str(tiny_target), "--out", str(out),
            "--max-new-tokens", "4", "--device", "cpu", "--batch-size", "2"]
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["num_written"] == 2
    assert len(out.read_text().splitlines()) == 2
    assert cli.main(argv[:-2] + ["--batch-size", "0"]) == 2  # bad input (errors.py)
    assert "batch_size=0" in capsys.readouterr().err


def test_template_refusal_cuts_instead_of_crashing(tmp_path, tiny_target):
    """A template that raises on some conversations (as Llama 2's does on non-alternating
    roles) cuts those conversations; the others are regenerated."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    tokenizer.chat_template = (
        "{%- for m in messages %}{%- if 'forbidden' in m['content'] %}"
        "{{ raise_exception('no forbidden words') }}{%- endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    records = [SHAREGPT[0], {"conversations": [{"from": "human", "value": "a forbidden word"},
                                               {"from": "gpt", "value": "x"}]}]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    summary = run([src], tiny_target, tmp_path / "out.jsonl", tokenizer=tokenizer)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert summary["num_template_errors"] == 1 and summary["num_turns"] == 2
    assert [len(line["conversations"]) for line in lines] == [4, 1]


def test_workers_write_the_output_of_one_process(tmp_path, tiny_target):
    """Chunks of 4 records regenerated by 2 processes and appended in order: the same file as
    one process writes, also when resuming mid-chunk. (A failing worker: tests/test_workers.py
    and test_evaluate.py's test_a_failing_worker_fails_the_command, through the same pool.)"""
    src = write_jsonl(tmp_path / "in.jsonl", SHAREGPT)
    one = run([src], tiny_target, tmp_path / "one.jsonl", batch_size=2)
    two = run([src], tiny_target, tmp_path / "two.jsonl", batch_size=2, workers=2)
    assert {k: two[k] for k in regenerate.CHUNK_STATS} == {k: one[k] for k in regenerate.CHUNK_STATS}
    assert two["num_turns"] == 18
    assert (tmp_path / "two.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    run([src], tiny_target, tmp_path / "resumed.jsonl", batch_size=2, limit=2)
    lines = (tmp_path / "one.jsonl").read_text().splitlines(keepends=True)
    regenerate.ahead_path(tmp_path / "resumed.jsonl").write_text(  # kept by a stopped run: not regenerated
        "".join(json.dumps({"position": p, "line": lines[p]}) + "\n" for p in (3, 6)))
    resumed = run([src], tiny_target, tmp_path / "resumed.jsonl", batch_size=2, workers=2)
    assert resumed["num_resumed"] == 2 and resumed["num_written"] == 7 and resumed["num_ahead_resumed"] == 2
    assert resumed["num_turns"] == 2 * 5 and not regenerate.ahead_path(tmp_path / "resumed.jsonl").exists()
    assert (tmp_path / "resumed.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()


def test_output_does_not_depend_on_rows_or_refill_order(tmp_path, tiny_target):
    """Continuous batching refills rows at moments that depend on the row count; at T = 0 in
    float32 (and at T > 0, position-hashed sampling) every conversation's turns come out the
    same, in order, whatever the row count."""
    src = write_jsonl(tmp_path / "in.jsonl", SHAREGPT + OPENAI)
    for temperature in (0.0, 1.0):
        texts = []
        for rows in (1, 3, 12):
            out = tmp_path / f"t{temperature}-r{rows}.jsonl"
            summary = run([src], tiny_target, out, batch_size=rows, temperature=temperature, top_p=0.9)
            texts.append(out.read_text())
            assert summary["num_turns"] == 21 and summary["num_new_tokens"] > 0
        assert texts[0] == texts[1] == texts[2]


def test_next_turns_continue_in_their_rows_and_write_what_whole_prefills_write(tmp_path, tiny_target):
    """With --continue-turns a conversation's next turn is prefilled from where its last one ended
    (the keys of the prompt and answer kept in its row); the records are those of prefilling every
    prompt whole (the default), greedy and sampled, and the summary counts the kept tokens."""
    src = write_jsonl(tmp_path / "in.jsonl", SHAREGPT + OPENAI)
    for temperature in (0.0, 1.0):
        texts, kept = [], []
        for keep in (False, True):
            out = tmp_path / f"t{temperature}-{keep}.jsonl"
            summary = run([src], tiny_target, out, batch_size=4, temperature=temperature, top_p=0.9,
                          continue_turns=keep)
            texts.append(out.read_text())
            kept.append(summary["num_prompt_tokens_kept"])
        assert texts[0] == texts[1]
        assert kept[0] == 0 < kept[1]


def test_resume_after_a_kill_mid_file(tmp_path, tiny_target):
    """A real regeneration process SIGKILLed while it writes: the rerun of the same command
    resumes after the last whole line and the file equals an uninterrupted run's."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT, subprocess_env

    records = [{"id": f"k{i}", "conversations": [{"from": "human", "value": f"tell me about {i}"},
                                                 {"from": "gpt", "value": "x"}] * 2} for i in range(80)]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    whole = tmp_path / "whole.jsonl"
    run([src], tiny_target, whole, batch_size=2)
    out = tmp_path / "killed.jsonl"
    argv = [sys.executable, "-m", "dflash_train", "data", "regenerate", "--data", str(src), "--target",
            str(tiny_target), "--out", str(out), "--max-new-tokens", "6", "--batch-size", "2", "--device", "cpu"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while proc.poll() is None and (not out.exists() or out.stat().st_size == 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = out.read_bytes()
    assert 0 < len(written.splitlines()) < len(records), "the kill must land mid-file"
    resumed = run([src], tiny_target, out, batch_size=2)
    assert resumed["num_resumed"] == written.count(b"\n")
    assert out.read_text() == whole.read_text()


def test_progress_is_reported_while_an_early_conversation_still_runs(tmp_path, tiny_target):
    """Progress lines come every `progress_every_s` from the scheduler, not only when a line is
    written: a long first conversation holds back the writing, not the report."""
    long_first = {"id": "long", "conversations": [{"from": "human", "value": "go"}, {"from": "gpt", "value": "x"}] * 6}
    src = write_jsonl(tmp_path / "in.jsonl", [long_first] + SHAREGPT[:6])
    lines: list[str] = []
    summary = run([src], tiny_target, tmp_path / "out.jsonl", batch_size=3, log=lines.append, progress_every_s=0)
    progress = [line for line in lines if line.startswith("data regenerate: ") and "tokens/s" in line]
    assert any("(0 written)" in line and not line.startswith("data regenerate: 0/") for line in progress), progress
    assert progress[-1].startswith("data regenerate: 7/7 records (7 written)") and summary["num_turns"] == 18
    # The scheduler's host work outside the engine's steps, timed and shown as a share of the time.
    assert 0 < summary["prompt_s"] < summary["seconds"] and 0 < summary["text_s"] < summary["seconds"]
    assert "host: prompts " in progress[-1] and "% of the time" in progress[-1]
    # The engine's: refills, queueing decode steps, waiting for their tokens, booking them.
    assert all(0 < summary[k] < summary["seconds"] for k in ("prefill_s", "launch_s", "wait_s", "book_s"))
    assert "; engine: refills " in progress[-1] and "waiting on decode steps" in progress[-1]
    assert "queueing steps " in progress[-1] and "booking " in progress[-1]


def _stop_after(polls: int, signum):
    """A progress log that sends `signum` to this process after `polls` progress lines."""
    import os

    seen = []

    def log(line: str) -> None:
        if "tokens/s" in line:
            seen.append(line)
            if len(seen) == polls:
                os.kill(os.getpid(), signum)
    return log


def test_a_stopped_run_keeps_what_finished_ahead_and_the_rerun_writes_it_without_regenerating(tmp_path, tiny_target):
    """SIGTERM while a long first conversation holds back the writing: the run stops after the
    step in progress, exits with the records finished behind it kept in OUT.ahead; a rerun with
    --limit writes only what its limit allows and keeps the rest; the last rerun regenerates only
    the conversations neither written nor kept, removes the file, and the output equals an
    uninterrupted run's."""
    import signal

    long_first = {"id": "long", "conversations": [{"from": "human", "value": "go"}, {"from": "gpt", "value": "x"}] * 6}
    records = [long_first] + SHAREGPT[:8]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    whole = tmp_path / "whole.jsonl"
    full = run([src], tiny_target, whole, batch_size=3)
    assert full["num_turns"] == 6 + 8 * 2

    out = tmp_path / "out.jsonl"
    stopped = run([src], tiny_target, out, batch_size=3, progress_every_s=0, log=_stop_after(3, signal.SIGTERM))
    ahead = regenerate.ahead_path(out)
    assert stopped["stopped"] == "SIGTERM" and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert stopped["num_written"] == 0 and out.read_text() == ""  # the long first one was still running
    kept = [json.loads(line) for line in ahead.read_text().splitlines()]
    positions = [k["position"] for k in kept]
    assert stopped["num_ahead_kept"] == len(kept) >= 2 and positions == sorted(positions) and 0 not in positions
    lines = whole.read_text().splitlines(keepends=True)
    assert all(k["line"] == lines[k["position"]] for k in kept)  # what the whole run wrote there

    limited = run([src], tiny_target, out, batch_size=3, limit=2)
    assert limited["num_written"] == 2 and limited["num_ahead_resumed"] == (1 in positions)
    assert [json.loads(line)["position"] for line in ahead.read_text().splitlines()] == [p for p in positions if p >= 2]

    rest = run([src], tiny_target, out, batch_size=3)
    assert rest["num_ahead_resumed"] == len([p for p in positions if p >= 2]) and not ahead.exists()
    assert rest["num_turns"] == 2 * (len(records) - 2 - rest["num_ahead_resumed"])  # kept ones are not redone
    assert out.read_text() == whole.read_text()


def test_an_ahead_file_from_other_input_or_damaged_is_refused(tmp_path, tiny_target):
    src = write_jsonl(tmp_path / "in.jsonl", SHAREGPT[:3])
    out = tmp_path / "out.jsonl"
    ahead = regenerate.ahead_path(out)
    assert ahead.name == "out.jsonl.ahead"
    other = {"id": "z", "conversations": [{"from": "human", "value": "something else"}, {"from": "gpt", "value": "y"}]}
    ahead.write_text(json.dumps({"position": 1, "line": json.dumps(other)}) + "\n")
    with pytest.raises(chat_files.DataError, match=r"out\.jsonl\.ahead:1 \(record 2\) does not match input record .*in\.jsonl:2"):
        run([src], tiny_target, out)
    ahead.write_text('{"position": 1, "li\n')
    with pytest.raises(chat_files.DataError, match=r"out\.jsonl\.ahead:1: not a kept record .* delete"):
        run([src], tiny_target, out)
    assert not out.exists() or out.read_text() == ""


def test_turns_that_end_in_a_loop_are_counted(smollm2_tokenizer):
    """`num_looping`: answers cut at the budget whose ids end in a loop (evaluate.loop_period),
    counted from the ids the responder returns; a looping answer that still ended on its stop
    token is not one."""

    class Scripted:
        capacity = 4

        def __init__(self):
            self.asked = []

        def submit(self, key, text, ids, seed):
            self.asked.append(key)

        def poll(self):
            out = []
            for key in self.asked:
                looping = [5, 6, 7] * 20
                answer = {0: (looping, False), 1: (looping, True), 2: (list(range(100, 160)), False)}[key]
                out.append((key, "a reply", answer[1], answer[0]))
            self.asked = []
            return out

    records = [chat_files.parse_record({"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "x"}]},
                                 "in.jsonl", i + 1) for i in range(3)]
    stats = {**dict.fromkeys(regenerate.CHUNK_STATS, 0), **dict.fromkeys(regenerate.HOST_STATS, 0.0)}
    lines = list(regenerate.regenerate_stream(Scripted(), smollm2_tokenizer, records, 0,
                                              regenerate.RegenerationOptions(max_prompt_length=100, seed=0), stats))
    assert len(lines) == 3 and stats["num_turns"] == 3
    assert (stats["num_unfinished"], stats["num_looping"]) == (2, 1)
    assert [json.loads(line)["conversations"][1].get("unfinished", False) for line in lines] == [True, False, True]


def test_rows_are_capped_by_the_turns_and_caches_that_do_not_fit_are_refused(tmp_path, tiny_target, monkeypatch):
    """A small job decodes no more rows than it has turns (no caches it cannot fill); where the
    caches of --batch-size rows would not fit the free memory, a DataError names what they take
    and the largest batch size that fits, before anything is written."""
    from transformers import AutoConfig

    from dflash_train.data import responders
    from dflash_train.engine import decode

    src = write_jsonl(tmp_path / "in.jsonl", SHAREGPT[:2])  # 4 assistant turns
    summary = run([src], tiny_target, tmp_path / "small.jsonl", batch_size=1024)
    assert summary["rows"] == 4 and summary["num_turns"] == 4
    assert run([src], tiny_target, tmp_path / "two.jsonl", batch_size=2)["rows"] == 2
    assert (tmp_path / "small.jsonl").read_text() == (tmp_path / "two.jsonl").read_text()  # fp32: rows change nothing

    config = AutoConfig.from_pretrained(tiny_target)  # 2 layers, 2 key/value heads of 16
    per_row = 2 * 2 * 2 * 16 * (1024 + 6 + 2) * 4  # keys and values, layers, heads, head size, positions, fp32
    assert decode.kv_bytes_per_row(config, 1024 + 6 + 2, torch.float32) == per_row
    assert decode.free_memory_bytes(torch.device("cpu")) > 0
    monkeypatch.setattr(responders, "free_memory_bytes", lambda device: int(300.5 * per_row / 0.9))
    many = write_jsonl(tmp_path / "many.jsonl", SHAREGPT * 40)  # 720 turns
    out = tmp_path / "refused.jsonl"
    with pytest.raises(chat_files.DataError) as err:
        run([many], tiny_target, out, batch_size=512, max_prompt_length=1024)
    message = str(err.value)
    assert message.startswith("--batch-size 512: the decoding engine's key/value caches for 512 rows of 1,032 "
                              "positions take ") and "lower --batch-size to at most 256" in message
    assert not out.exists()
    fits = run([many], tiny_target, tmp_path / "fits.jsonl", batch_size=300, max_prompt_length=1024, limit=150)
    assert fits["rows"] == 300 and fits["num_written"] == 150  # 300 rows take just under 90% of the free memory


def test_prompt_ids_take_over_the_last_prompts_ids_and_equal_whole_tokenization(any_tokenizer, monkeypatch):
    """Each turn's prompt ids, built from the last prompt's ids up to a special token plus the
    new text's, equal tokenizing the whole rendered prompt, on real multi-turn ShareGPT chats
    answered with their own replies, for the ChatML, Llama 3 and Qwen3 templates (Qwen3
    rewrites earlier turns); the guard is off here so that a difference would show."""
    from dflash_train.core.assets import sharegpt_json

    name, tokenizer = any_tokenizer
    made = []

    class Unguarded(regenerate.PromptIds):
        def __init__(self, tok):
            super().__init__(tok, check=0)
            made.append(self)
    monkeypatch.setattr(regenerate, "PromptIds", Unguarded)

    records = []
    for record in chat_files.iter_records([sharegpt_json()]):
        if not isinstance(record, chat_files.Skip) and sum(m["role"] == "assistant" for m in record.messages) >= 3:
            records.append(record)
        if len(records) == 40:
            break

    class Replay:  # answers each turn with the record's own reply
        capacity = 8

        def __init__(self):
            self.asked, self.turns, self.prompts = [], {}, []

        def submit(self, key, text, ids, seed):
            self.asked.append(key)
            self.prompts.append((text, ids))

        def poll(self):
            out = []
            for key in self.asked:
                turn = self.turns.get(key, 0)
                self.turns[key] = turn + 1
                replies = [m["content"] for m in records[key].messages if m["role"] == "assistant"]
                out.append((key, replies[turn], True, [1, 2, 3]))
            self.asked = []
            return out

    responder = Replay()
    stats = {**dict.fromkeys(regenerate.CHUNK_STATS, 0), **dict.fromkeys(regenerate.HOST_STATS, 0.0)}
    lines = list(regenerate.regenerate_stream(responder, tokenizer, records, 0,
                                              regenerate.RegenerationOptions(max_prompt_length=100_000, seed=0), stats))
    assert len(lines) == len(records) and len(responder.prompts) > 2 * len(records)
    whole = tokenizer([text for text, _ in responder.prompts], add_special_tokens=False)["input_ids"]
    assert [ids for _, ids in responder.prompts] == whole
    assert made[0].enabled and made[0].mismatch is None and stats["num_prompt_id_mismatches"] == 0
    assert made[0].reused_tokens > sum(len(ids) for ids in whole) // 3  # most of the later turns' ids taken over
    assert stats["num_prompt_tokens_reused"] == made[0].reused_tokens


def test_prompt_ids_guard_turns_reuse_off_at_a_difference(smollm2_tokenizer):
    """The first prompts that reuse ids are checked against whole tokenization: a difference
    (here a last prompt whose ids were wrong) gives the whole ids and turns reuse off."""
    class Conv:
        prompt_ids = None

    tok = smollm2_tokenizer
    ids = regenerate.PromptIds(tok)
    conv = Conv()
    first = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    second = first + "hi there<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert ids.encode([(conv, first)]) == [tok(first, add_special_tokens=False)["input_ids"]]
    text, good, cuts = conv.prompt_ids
    conv.prompt_ids = (text, [7] * len(good), cuts)  # the last prompt's ids, corrupted
    assert ids.encode([(conv, second)]) == [tok(second, add_special_tokens=False)["input_ids"]]
    assert not ids.enabled and "differs from tokenizing it whole" in ids.mismatch
