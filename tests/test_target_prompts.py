"""The target-prompts source (data/target_prompts.py): conversations the target writes itself.

The tiny random target writes through a hook on its logits: sampled turns are varied tokens that
end after a few (some empty, some cut at the budget); greedy answers repeat one word and never stop
(cut at their budget, marked unfinished). The filters and the
deduplication are also checked on constructed cases, without a model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from conftest import load_tokenizer
from dflash_train.app.cli import main
from dflash_train.core.assets import tiny_random_target_dir
from dflash_train.core.errors import InputError
from dflash_train.core.target import load_target_model
from dflash_train.data.chat_files import DataError, Record, iter_records
from dflash_train.data.preparation import prepare
from dflash_train.data.regenerate import RegenerationOptions, regenerate
from dflash_train.data.target_prompts import (
    Conversation,
    Deduplicator,
    TargetPromptOptions,
    Template,
    Writer,
    turn_problem,
    write_target_prompts,
)
from dflash_train.engine.sampling import stop_token_ids

TINY = "bundled:tiny-random-llama"


def shaped_tiny_target():
    """(model, tokenizer) of the tiny target with its logits shaped for writing (module docstring)."""
    folder = tiny_random_target_dir()
    model, tokenizer = load_target_model(str(folder), torch.device("cpu"))
    stops = stop_token_ids(tokenizer, model.generation_config)
    word = tokenizer.convert_tokens_to_ids("\u0120word")

    def shape(module, inputs, logits):
        logits = logits / 8  # the random weights' logits, flattened: samples of varied tokens
        top = logits.max(dim=-1, keepdim=True).values
        logits[..., [word]] = top + 6  # the greedy choice, about a quarter of the samples
        logits[..., stops] = top + 5.5  # a stop about every seventh token
        return logits

    model.lm_head.register_forward_hook(shape)
    return model, tokenizer


@pytest.fixture(scope="module")
def writer_target():
    return shaped_tiny_target()


def options(**kw) -> TargetPromptOptions:
    base = dict(limit=6, seed=3, max_turns=3, system_share=0.5, max_prompt_tokens=24, max_new_tokens=8,
                max_length=256, batch_size=4, device="cpu", graphs=False, near_duplicate=0.9)
    return TargetPromptOptions(**{**base, **kw})


def run(path, writer_target, **kw) -> list[dict]:
    model, tokenizer = writer_target
    write_target_prompts(TINY, path, options(**kw), model=model, tokenizer=tokenizer, log=lambda *a: None)
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_same_seed_writes_the_same_records_whatever_the_batch(tmp_path, writer_target):
    a = run(tmp_path / "a.jsonl", writer_target)
    b = run(tmp_path / "b.jsonl", writer_target, batch_size=3)
    assert a == b and len(a) == 6
    c = run(tmp_path / "c.jsonl", writer_target, seed=4)
    assert [r["conversations"] for r in c] != [r["conversations"] for r in a]


def test_records_are_whole_conversations_in_order_that_the_reader_and_regeneration_take(tmp_path, writer_target):
    records = run(tmp_path / "tp.jsonl", writer_target, limit=8)
    indices = [int(r["id"].rsplit(":", 1)[1]) for r in records]
    assert indices == sorted(set(indices)) and all(r["source"] == "target-prompts" for r in records)
    turns = [[t["from"] for t in r["conversations"]] for r in records]
    for roles in turns:
        body = roles[1:] if roles[0] == "system" else roles
        assert body == ["human", "gpt"] * (len(body) // 2) and 1 <= len(body) // 2 <= 3
    assert any(len(t) > 2 + (t[0] == "system") for t in turns), "some conversations have several turns"
    assert any(t[0] == "system" for t in turns), "some open with a system message the target wrote"
    assert all(t["unfinished"] for r in records for t in r["conversations"] if t["from"] == "gpt")
    read = list(iter_records([tmp_path / "tp.jsonl"]))
    assert len(read) == 8 and all(isinstance(r, Record) for r in read)
    model, tokenizer = writer_target
    summary = regenerate([tmp_path / "tp.jsonl"], TINY, tmp_path / "again.jsonl",
                         RegenerationOptions(max_new_tokens=8, device="cpu", graphs=False, batch_size=4),
                         model=model, tokenizer=tokenizer, log=lambda *a: None)
    assert summary["num_written"] == 8
    again = [json.loads(line) for line in (tmp_path / "again.jsonl").read_text().splitlines()]
    assert [r["conversations"] for r in again] == [r["conversations"] for r in records]  # answered at T=0 already
    prepared = prepare([tmp_path / "tp.jsonl"], tiny_random_target_dir(), tmp_path / "prepared", log=lambda *a: None)
    assert prepared.report["num_samples"] == 8


def test_the_last_chunks_write_only_the_candidates_the_records_still_needed_take(tmp_path, writer_target,
                                                                                  monkeypatch):
    """After a first full chunk, a chunk is sized to the records still needed at the rate kept so
    far (with a margin): the records are those of full chunks, and fewer candidates are written."""
    from dflash_train.data import target_prompts

    assert target_prompts.chunk_size(2048, 5000, 0, 0) == 2048  # nothing known yet: a full chunk
    assert target_prompts.chunk_size(2048, 5000, 910, 1000) == 2048
    assert target_prompts.chunk_size(2048, 670, 9330, 10240) == 862  # 670 x 10,240 / 9,330 x 1.15 = 845.6, + 16
    assert target_prompts.chunk_size(2048, 1, 10, 10) == 18
    assert target_prompts.chunk_size(16, 1, 7, 16) == 3 + 4  # a CPU's 4 rows: a batch of margin, not 16
    tried = []
    monkeypatch.setattr(target_prompts, "MARGIN_CANDIDATES", 0)  # chunks of 16 candidates here
    real = target_prompts.Writer.candidates
    monkeypatch.setattr(target_prompts.Writer, "candidates",
                        lambda self, first, count: tried.append(count) or real(self, first, count))
    sized = run(tmp_path / "sized.jsonl", writer_target, limit=14)
    sized_tried, tried[:] = sum(tried), []
    monkeypatch.setattr(target_prompts, "chunk_size", lambda full, *a: full)
    whole = run(tmp_path / "whole.jsonl", writer_target, limit=14)
    assert sized == whole and len(sized) == 14
    assert sized_tried < sum(tried), (sized_tried, tried)


def test_a_stopped_run_resumes_to_the_records_of_an_uninterrupted_one(tmp_path, writer_target):
    whole = run(tmp_path / "whole.jsonl", writer_target, limit=7)
    part = tmp_path / "part.jsonl"
    run(part, writer_target, limit=3)
    with open(part, "a", encoding="utf-8") as handle:  # a run killed while it wrote a line
        handle.write('{"id": "target-prompts:3:9", "source": "target-pro')
    assert run(part, writer_target, limit=7) == whole


# The child of the kill test: the shaped tiny target writes `limit` records into `out` in
# chunks of 8 candidates (2 rows), printing nothing.
KILLED_WRITER = """import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_target_prompts import TINY, options, shaped_tiny_target
from dflash_train.data.target_prompts import write_target_prompts
model, tokenizer = shaped_tiny_target()
write_target_prompts(TINY, Path(sys.argv[2]), options(limit=int(sys.argv[3]), batch_size=2), model=model,
                     tokenizer=tokenizer, log=lambda *a: None)
"""


def test_a_process_killed_while_it_writes_resumes_to_the_records_of_an_uninterrupted_one(tmp_path, writer_target):
    """SIGKILL of a real writing process once its first records are on disk (no handler runs):
    the rerun keeps them, goes on from there, and ends with the records of one whole run."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from conftest import subprocess_env

    limit, out = 30, tmp_path / "killed.jsonl"
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(Path(__file__).parent), str(out), str(limit)],
                             env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (out.is_file() and out.read_bytes().count(b"\n") >= 2):
        assert child.poll() is None, child.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the writer wrote nothing in 300 s"
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    assert child.wait(60) == -signal.SIGKILL  # killed, not finished
    written = out.read_bytes().count(b"\n")
    assert 2 <= written < limit
    assert run(out, writer_target, limit=limit) == run(tmp_path / "whole.jsonl", writer_target, limit=limit)


def test_a_deadline_stops_between_chunks_and_the_rerun_goes_on(tmp_path, writer_target):
    import time

    model, tokenizer = writer_target
    out = tmp_path / "boxed.jsonl"
    counts = write_target_prompts(TINY, out, options(deadline=time.time() - 1), model=model, tokenizer=tokenizer,
                                  log=lambda *a: None)
    assert counts["out_of_time"] and counts["kept"] == 0 and not out.exists()
    assert run(out, writer_target) == run(tmp_path / "whole.jsonl", writer_target)


def test_an_output_of_something_else_is_refused_and_left_as_it_was(tmp_path, writer_target):
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}')
    with pytest.raises(InputError, match=r"mine.jsonl:1: not a target-prompts record"):
        run(mine, writer_target)
    assert mine.read_text().endswith('"yo"}]}')
    seeded = tmp_path / "seeded.jsonl"
    run(seeded, writer_target, limit=1)
    before = seeded.read_bytes()
    with pytest.raises(InputError, match="of --seed 4"):
        run(seeded, writer_target, seed=4)
    assert seeded.read_bytes() == before


def test_a_resume_with_other_options_that_shape_the_records_is_refused_and_left_as_it_was(tmp_path, writer_target):
    """Each record keeps the options that shape it (by flag); a rerun into the same --out with
    another of them is refused in one line naming the flag, the file untouched; the options that
    do not shape the records (the batch) resume it, and so does a file written before records
    kept them."""
    out = tmp_path / "own.jsonl"
    first = run(out, writer_target, limit=2)
    assert first[0]["written_with"] == {"turns": 3, "system-share": 0.5, "temperature": 1.0, "top-p": 0.95,
                                        "max-prompt-tokens": 24, "max-new-tokens": 8, "max-length": 256,
                                        "near-duplicate": 0.9}
    before = out.read_bytes()
    for changed, said in (({"temperature": 0.7}, "--temperature 1.0, where this command has 0.7"),
                          ({"max_turns": 2}, "--turns 3, where this command has 2"),
                          ({"max_length": 300}, "--max-length 256, where this command has 300")):
        with pytest.raises(InputError, match=f"own.jsonl:1: written with {said}; the same command resumes only"):
            run(out, writer_target, limit=4, **changed)
        assert out.read_bytes() == before
    whole = run(tmp_path / "whole.jsonl", writer_target, limit=4)
    assert run(out, writer_target, limit=4, batch_size=3) == whole
    older = tmp_path / "older.jsonl"
    older.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "written_with"}) + "\n" for r in first))
    assert [r["conversations"] for r in run(older, writer_target, limit=4)] == [r["conversations"] for r in whole]
    fewer = tmp_path / "fewer.jsonl"  # records that kept fewer options: those they name are checked
    fewer.write_text("".join(json.dumps({**r, "written_with": {"turns": 3, "temperature": 1.0}}) + "\n"
                             for r in first))
    assert [r["conversations"] for r in run(fewer, writer_target, limit=4)] == [r["conversations"] for r in whole]
    with pytest.raises(InputError, match="fewer.jsonl:1: written with --temperature 1.0, where this command has 0.5"):
        run(fewer, writer_target, limit=5, temperature=0.5)


def test_turn_filters():
    assert turn_problem("What is the capital of France?", stopped=True) is None
    assert turn_problem("What is the capital of", stopped=False) == "truncated"
    assert turn_problem(" ", stopped=True) == "empty"
    for refusal in ("I'm sorry, but I can't help with that.", "As an AI language model, I", "Sure! Here is a poem",
                    "Certainly, here's the code", "I cannot do that."):
        assert turn_problem(refusal, stopped=True) == "refusal", refusal
    assert turn_problem("Can you help me sort a list in Python?", stopped=True) is None
    assert turn_problem("Surely the sun is a star?", stopped=True) is None


def test_deduplication_of_first_user_turns():
    dedup = Deduplicator(0.8)
    first = "How do I reverse a linked list in Python without recursion and in place?"
    assert dedup.check_and_add("0", first) is None
    assert dedup.check_and_add("1", "how do I reverse a linked list in python, without recursion and in place") \
        == "exact duplicate"  # the same words, case and punctuation aside
    assert dedup.check_and_add("2", "How do I reverse a linked list in Python without recursion and in place? "
                                    "Thanks") == "near duplicate"
    assert dedup.check_and_add("3", "Write a haiku about the first snow of the winter in the mountains.") is None
    assert dedup.check("Write a haiku about the first snow of the winter in the mountains") == "exact duplicate"
    assert dedup.check("What are three good books about the history of mathematics for a beginner?") is None


class Scripted:
    """A responder that answers from a script: key -> (text, stopped) by call order per key."""

    def __init__(self, script):
        self.script, self.queue, self.capacity = script, [], 8

    def submit(self, key, text, ids, seed):
        self.queue.append(key)

    @property
    def load(self):
        return len(self.queue)

    def poll(self, wait=True):
        out = [(key, *self.script[key].pop(0), []) for key in self.queue]
        self.queue = []
        return out


def test_the_writer_drops_and_cuts_by_the_filters_and_keeps_the_first_copy(smollm2_tokenizer):
    user = {0: [("Explain recursion to a child.", True), ("And iteration?", True)],
            1: [("Explain recursion to a child!", True)],  # a copy of 0: dropped
            2: [("I'm sorry, I can't help.", True)],  # the target answered instead of asking
            3: [("A question that runs on and", False)],  # truncated
            4: [("Name three rivers of Europe.", True), ("", True)],  # its second turn is empty: cut before it
            5: [("What is a monad?", True)]}
    answers = {0: [("A function that calls itself.", True), ("Doing it again and again.", True)],
               1: [("A function that calls itself!", True)],
               4: [("The Danube, the Rhine and the Loire.", True)],
               5: [("", True)]}  # an empty answer: the conversation has nothing, dropped
    counts = {}
    writer = Writer(Template(smollm2_tokenizer, "smollm2"), Scripted(user), Scripted(answers),
                    options(max_turns=2, system_share=0.0), counts)
    conversations = [Conversation(i, 2 if i in (0, 4) else 1, False) for i in range(6)]
    kept = writer.write(conversations, Deduplicator(0.8))
    assert [c.index for c in kept] == [0, 4]
    assert [m["role"] for m in kept[0].messages] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in kept[1].messages] == ["Name three rivers of Europe.",
                                                        "The Danube, the Rhine and the Loire."]
    assert counts == {"exact duplicate": 1, "refusal": 1, "truncated": 1, "user turns dropped: empty": 1,
                      "empty answer": 1}


def test_a_system_turn_that_leaves_no_room_for_the_user_turn_is_dropped(smollm2_tokenizer):
    """A written system message after which the user turn's budget would pass max_length is
    dropped as over-long, and the user turn is written without it. Here the system message (within
    its own budget, max_prompt_tokens) is longer than max_length: asking the user turn after it
    handed the sampling engine a prompt longer than its caches, which failed the whole run."""
    long_system = "You are a careful assistant who " + "always explains every step in detail and " * 7
    settings = options(max_turns=1, system_share=1.0, max_prompt_tokens=64, max_new_tokens=8, max_length=40)
    assert settings.max_length < len(smollm2_tokenizer(long_system)["input_ids"]) <= settings.max_prompt_tokens

    class Bounded(Scripted):  # the engine's own bound: a prompt and its new tokens within a row's positions
        def submit(self, key, text, ids, seed):
            assert len(ids) <= settings.max_length + 2, len(ids)
            super().submit(key, text, ids, seed)

    counts = {}
    writer = Writer(Template(smollm2_tokenizer, "smollm2"), Bounded({0: [(long_system, True), ("Why?", True)]}),
                    Scripted({0: [("Because.", True)]}), settings, counts)
    kept = writer.write([Conversation(0, 1, True)], Deduplicator(0.8))
    assert [c.index for c in kept] == [0]
    assert kept[0].messages == [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."}]
    assert counts == {"system turns dropped: over-long": 1}


class OneAtATime(Scripted):
    """A Scripted responder that finishes one turn per poll and notes, at each submit, how many
    turns the other engine still holds."""

    def __init__(self, script, other=None):
        super().__init__(script)
        self.other, self.seen = other, []

    def submit(self, key, text, ids, seed):
        self.seen.append(self.other.load if self.other else None)
        super().submit(key, text, ids, seed)

    def poll(self, wait=True):
        key, self.queue = self.queue[0], self.queue[1:]
        return [(key, *self.script[key].pop(0), [])]


def test_a_conversation_is_answered_while_the_others_are_still_written(smollm2_tokenizer):
    """No phase waits for the chunk's slowest turn: the first user turn back is answered at once,
    while the sampling engine still writes the other conversations' turns."""
    user = {i: [(f"Question number {i} about rivers and seas?", True)] for i in range(4)}
    sampler = OneAtATime(user)
    answerer = OneAtATime({i: [(f"Answer {i}.", True)] for i in range(4)}, other=sampler)
    writer = Writer(Template(smollm2_tokenizer, "smollm2"), sampler, answerer, options(system_share=0.0), {})
    kept = writer.write([Conversation(i, 1, False) for i in range(4)], Deduplicator(0.8))
    assert [c.index for c in kept] == [0, 1, 2, 3]
    assert answerer.seen[0] == 3  # conversation 0's answer asked with three user turns still in the sampler


@pytest.mark.parametrize("template", ["smollm2", "llama3", "qwen3"])
def test_every_chat_template_opens_a_user_turn_after_its_own_start(smollm2_path, template):
    tokenizer = load_tokenizer(smollm2_path, template)
    opening = Template(tokenizer, template).opening([], "user")
    default_system = {"smollm2": "You are a helpful AI assistant named SmolLM", "llama3": "Cutting Knowledge Date",
                      "qwen3": None}[template]
    if default_system:
        assert default_system in opening  # a template's own system prompt is kept
    assert opening.rstrip().endswith(("user", "user<|end_header_id|>"))
    after = Template(tokenizer, template).opening([{"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": "Hello!"}], "user")
    assert after.startswith(opening.split("Hi")[0][:20]) and "Hello!" in after


def test_a_tokenizer_without_a_chat_template_is_refused_in_words(smollm2_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.chat_template = None
    with pytest.raises(DataError, match="its tokenizer has no chat template"):
        Template(tokenizer, "plain")


def test_the_command_checks_its_options_before_anything_loads(tmp_path, capsys):
    out = tmp_path / "tp.jsonl"
    assert main(["data", "source", "--source", "target-prompts", "--out", str(out), "--limit", "3"]) == 2
    assert "--target: give the target model folder" in capsys.readouterr().err
    assert main(["data", "source", "--source", "target-prompts", "--target", TINY, "--out", str(out)]) == 2
    assert "give --limit N" in capsys.readouterr().err
    assert main(["data", "source", "--source", "target-prompts", "--target", TINY, "--out", str(out), "--limit", "3",
                 "--temperature", "0"]) == 2
    assert "--temperature must be > 0" in capsys.readouterr().err
    assert main(["data", "source", "--source", "target-prompts", "--target", TINY, "--out", str(out), "--limit", "3",
                 "--turns", "0"]) == 2
    assert "--turns must be >= 1, got 0" in capsys.readouterr().err  # the flag's name, not the option's
    # a written turn and its answer that cannot fit a conversation (every record would be one turn, or none)
    assert main(["data", "source", "--source", "target-prompts", "--target", TINY, "--out", str(out), "--limit", "3",
                 "--max-prompt-tokens", "512", "--max-new-tokens", "32", "--max-length", "288"]) == 2
    assert "--max-prompt-tokens 512 and --max-new-tokens 32 pass --max-length 288: a written turn and its answer " \
           "must fit a conversation" in capsys.readouterr().err
    assert main(["data", "source", "--source", "word-problems", "--limit", "3", "--out", str(out),
                 "--turns", "2"]) == 2
    assert "--turns: options of --source target-prompts, not of word-problems" in capsys.readouterr().err
    assert not out.exists()


def test_the_two_engines_caches_are_checked_together_before_anything_is_written(tmp_path, writer_target,
                                                                                monkeypatch):
    """The sampling and the answering engine hold their key/value caches at once: rows that fit
    one engine's caches but not both are refused with the largest batch that fits both, and
    nothing is written."""
    from dflash_train.data import responders
    from dflash_train.engine import decode

    model, _ = writer_target
    per_row = decode.kv_bytes_per_row(model.config, 24 + 256 + 2, torch.float32) + decode.kv_bytes_per_row(
        model.config, 8 + 256 + 2, torch.float32)
    monkeypatch.setattr(responders, "free_memory_bytes", lambda device: int(5.5 * per_row / 0.9))
    out = tmp_path / "tp.jsonl"
    with pytest.raises(DataError) as err:
        run(out, writer_target, batch_size=8)
    assert str(err.value).startswith("--batch-size 8: the decoding engine's key/value caches for 8 rows of 282 + 266 "
                                     "positions take ") and "lower --batch-size to at most 5" in str(err.value)
    assert not out.exists()
    assert len(run(out, writer_target, batch_size=5)) == 6
