"""Reading records (every format, every kind of damage), prepare's report and cache, the CLI,
and the embedded default data."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_train.app import cli
from dflash_train.core import assets
from dflash_train.data import chat_files, preparation

# ---------------------------------------------------------------------------------------------
# A generator of valid and damaged records with the expected verdict for each.

ASSISTANT_NAMES = ["gpt", "assistant", "chatgpt", "bard", "bing", "model", "GPT"]
USER_NAMES = ["human", "user", "Human"]
TRICKY = ["<|im_end|>", "\\n", "\"quoted\"", "tab\there", "🙂", "中文", "Ω≈ç√", "\u200b", "a\nb", "{}", "[1]"]


def random_text(rng: random.Random) -> str:
    pieces = [rng.choice(["word", "Hello", "x", "42"])]
    for _ in range(rng.randrange(4)):
        pick = rng.random()
        if pick < 0.3:
            pieces.append(rng.choice(TRICKY))
        elif pick < 0.6:
            pieces.append("".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0xA0, 0xD7FF),
                                                  rng.randrange(0xE000, 0x10FFFF)])) for _ in range(3)))
        else:
            pieces.append(rng.choice(["the", "cat", "sat", "on", " ", "mat."]))
    return " ".join(pieces)


def valid_record(rng: random.Random) -> tuple[dict, list[dict]]:
    """A valid record and the messages the reader must return for it."""
    fmt = rng.choice(["sharegpt", "openai"])
    messages = []
    if rng.random() < 0.3:
        messages.append(("system", "system", random_text(rng)))
    for _ in range(rng.randrange(1, 4)):
        user = rng.choice(USER_NAMES) if fmt == "sharegpt" else "user"
        helper = rng.choice(ASSISTANT_NAMES) if fmt == "sharegpt" else "assistant"
        messages.append((user, "user", random_text(rng)))
        messages.append((helper, "assistant", random_text(rng)))
    list_key, role_key, content_key = chat_files.FORMATS[fmt]
    record = {list_key: [{role_key: raw, content_key: text} for raw, _, text in messages]}
    if rng.random() < 0.5:
        record["id"] = f"id-{rng.randrange(10**6)}"
    return record, [{"role": role, "content": text} for _, role, text in messages]


def damage(rng: random.Random, record: dict) -> tuple[object, str]:
    """Break a valid record in one way; returns (object or raw bytes, expected reason category)."""
    list_key = "conversations" if "conversations" in record else "messages"
    role_key, content_key = ("from", "value") if list_key == "conversations" else ("role", "content")
    turns = record[list_key]
    turn = rng.choice(turns)
    kind = rng.randrange(14)
    if kind == 0:
        text = json.dumps(record)
        return text[: rng.randrange(1, len(text) - 1)].encode(), "malformed JSON"
    if kind == 13:  # decoder limits: very deep nesting, an integer too long to convert
        depth = rng.choice([10_000, 200_000])
        return rng.choice([b"[" * depth + b"]" * depth, b'{"messages": ' + b"9" * 5000 + b"}"]), "malformed JSON"
    if kind == 1:
        turn[content_key] = "@@BAD@@"
        return json.dumps(record).replace("@@BAD@@", "ok \\u00e9").encode().replace(b"ok", b"\xff\xfe", 1), \
            "invalid UTF-8"
    if kind == 2:
        turn[role_key] = rng.choice(["robot", "tool", "", "function", "humans"])
        return record, "unknown role"
    if kind == 3:
        turn[content_key] = rng.choice(["", "   ", "\n\t "])
        return record, "empty content"
    if kind == 4:
        turn[content_key] = rng.choice([5, 1.5, True, ["text"], {"text": "x"}])
        return record, "non-string content"
    if kind == 5:
        del turn[rng.choice([role_key, content_key])]
        return record, "missing field"
    if kind == 6:
        turn[content_key] = None
        return record, "missing field"
    if kind == 7:
        del record[list_key]
        record["text"] = "no turns here"
        return record, "missing field"
    if kind == 8:
        record[list_key] = rng.choice(["a string", {"from": "human"}, 7])
        return record, "wrong type"
    if kind == 9:
        turns[turns.index(turn)] = rng.choice(["just text", ["human", "hi"], 3])
        return record, "wrong type"
    if kind == 10:
        return rng.choice([[record], "a string", 12, None, True]), "wrong type"
    if kind == 11:
        user_name = "human" if list_key == "conversations" else "user"
        record[list_key] = [t for t in turns if t.get(role_key) in ("system", user_name, "human", "user", "Human")]
        return record, "no assistant turn"
    turn[content_key] = "text \udcff"  # an unpaired surrogate, written as a JSON escape
    return record, "invalid UTF-8"


def make_case(rng: random.Random) -> tuple[bytes, list[dict] | None, str | None]:
    """One JSONL line: (bytes, expected messages or None, expected skip category or None)."""
    record, messages = valid_record(rng)
    if rng.random() < 0.5:
        return json.dumps(record, ensure_ascii=rng.random() < 0.5).encode(), messages, None
    broken, category = damage(rng, record)
    if isinstance(broken, bytes):
        return broken, None, category
    return json.dumps(broken).encode(), None, category


def check_cases(path, cases):
    items = list(chat_files.iter_records([path]))
    assert len(items) == len(cases)
    for number, (item, (_, messages, category)) in enumerate(zip(items, cases), start=1):
        assert item.line == number and item.file == str(path)
        if category is None:
            assert isinstance(item, chat_files.Record), item
            assert item.messages == messages
        else:
            assert isinstance(item, chat_files.Skip), (number, category)
            assert item.category == category, (item.reason, category)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rng=st.randoms(use_true_random=False), count=st.integers(1, 30))
def test_fuzz_reader_reports_every_bad_record(tmp_path, rng, count):
    cases = [make_case(rng) for _ in range(count)]
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(line for line, _, _ in cases) + b"\n")
    check_cases(path, cases)


def test_fuzz_prepare_thousands(tmp_path, smollm2_path):
    """3000 generated records through prepare: zero crashes, every bad one listed with its
    line and reason category, every good one kept as a sample."""
    rng = random.Random(1234)
    cases = [make_case(rng) for _ in range(3000)]
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"\n".join(line for line, _, _ in cases) + b"\n")
    check_cases(path, cases)
    report = preparation.prepare([path], smollm2_path, tmp_path / "out", log=lambda *_: None).report
    good = sum(category is None for _, _, category in cases)
    bad = {(number, category) for number, (_, _, category) in enumerate(cases, start=1) if category}
    assert report["num_records"] == 3000
    assert report["num_samples"] == good
    assert {(s["line"], s["reason"].split(":")[0]) for s in report["skipped"]} == bad
    assert report["num_skipped"] == len(bad) > 1000


# ---------------------------------------------------------------------------------------------
# File formats


SHAREGPT = {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}
OPENAI = {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
                       {"role": "assistant", "content": "4"}]}
EXPECTED = {
    "a": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    "b": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4"}],
}


def test_json_array_lines_and_damage(tmp_path):
    path = tmp_path / "array.json"
    path.write_text(json.dumps([SHAREGPT, 5, OPENAI, {"conversations": "x"}], indent=2))
    items = list(chat_files.iter_records([path]))
    assert [type(i).__name__ for i in items] == ["Record", "Skip", "Record", "Skip"]
    assert items[0].messages == EXPECTED["a"] and items[2].messages == EXPECTED["b"]
    # Each record is reported at the line where its element of the array starts.
    starts = [n for n, line in enumerate(path.read_text().splitlines(), 1) if line[:3] in ("  {", "  5")]
    assert [i.line for i in items] == starts and len(starts) == 4


def test_truncated_json_array_keeps_whole_records(tmp_path):
    text = json.dumps([SHAREGPT] * 5, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: int(len(text) * 0.7)])
    items = list(chat_files.iter_records([path]))
    assert all(isinstance(i, chat_files.Record) for i in items[:-1]) and len(items) == 4
    assert items[-1].category == "truncated file"


def test_json_array_with_broken_middle_and_bad_bytes(tmp_path):
    good = json.dumps(SHAREGPT).encode()
    bad_bytes = good.replace(b"Hello!", b"Hel\xfflo!")
    path = tmp_path / "broken.json"
    path.write_bytes(b"[\n" + good + b",\n" + bad_bytes + b",\n" + good + b",\n{\"conversations\": [,]},\n" + good + b"\n]")
    items = list(chat_files.iter_records([path]))
    assert [(type(i).__name__, i.line) for i in items] == [("Record", 2), ("Skip", 3), ("Record", 4), ("Skip", 5)]
    assert items[1].category == "invalid UTF-8" and items[3].category == "malformed JSON"


def test_jsonl_parquet_folder(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "mixed"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.jsonl").write_text(json.dumps(SHAREGPT) + "\n\n" + json.dumps(OPENAI) + "\n")
    (folder / "b.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(OPENAI).encode() + b"\r\n")  # BOM, CRLF, JSON Lines
    pq.write_table(pa.Table.from_pylist([SHAREGPT, SHAREGPT]), folder / "sub" / "c.parquet")
    (folder / "sub" / "d.parquet").write_bytes(b"not a parquet file")
    (folder / "sub" / "e.json").write_text(json.dumps(SHAREGPT, indent=2))  # one pretty-printed record
    (folder / "notes.txt").write_text("ignored")
    items = list(chat_files.iter_records([folder]))
    where = [(os.path.relpath(i.file, folder), i.line, type(i).__name__) for i in items]
    assert where == [("a.jsonl", 1, "Record"), ("a.jsonl", 3, "Record"), ("b.json", 1, "Record"),
                     ("sub/c.parquet", 1, "Record"), ("sub/c.parquet", 2, "Record"),
                     ("sub/d.parquet", 0, "Skip"), ("sub/e.json", 1, "Record")]
    assert items[3].messages == EXPECTED["a"] and items[1].messages == EXPECTED["b"]
    assert items[-2].category == "unreadable file" and items[-1].messages == EXPECTED["a"]


def test_missing_paths_are_clear_errors(tmp_path):
    with pytest.raises(chat_files.DataError, match="no such file"):
        chat_files.data_files([tmp_path / "nope.jsonl"])
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(chat_files.DataError, match="unsupported file type '.csv'"):
        chat_files.data_files([tmp_path / "x.csv"])


def test_trim_conversation():
    m = [{"role": "assistant", "content": "orphan"}, {"role": "system", "content": "s"},
         {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "tail"}]
    assert chat_files.trim_conversation(m) == m[1:4]


def test_an_unfinished_turn_is_supervised_up_to_its_end_token_not_through_it(tmp_path, smollm2_path, smollm2_tokenizer):
    """A response cut at its budget (`"unfinished": true`, as regeneration marks it): its text is
    supervised, the <|im_end|> the template closes it with is not; a finished turn keeps it."""
    tok = smollm2_tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    record = {"conversations": [{"from": "human", "value": "Count."}, {"from": "gpt", "value": "1 2 3 4", "unfinished": True},
                                {"from": "human", "value": "Again."}, {"from": "gpt", "value": "1 2 3"}]}
    parsed = chat_files.parse_record(record, "in.jsonl", 1)
    assert parsed.messages[1] == {"role": "assistant", "content": "1 2 3 4", "unfinished": True}
    assert "unfinished" not in parsed.messages[3]
    [(ids, mask)] = preparation.tokenize_samples(tok, preparation.supervised_spans(tok, parsed.messages))
    ends = [i for i, t in enumerate(ids) if t == end]  # system, user, assistant, user, assistant
    assert len(ends) == 5
    assert mask[ends[2]] == 0 and mask[ends[2] - 1] == 1  # the cut turn: its text, not its end
    assert mask[ends[4]] == 1  # the finished one: through its end token
    plain = chat_files.parse_record({"conversations": [{k: v for k, v in t.items() if k != "unfinished"}
                                                 for t in record["conversations"]]}, "in.jsonl", 2)
    [(_, plain_mask)] = preparation.tokenize_samples(tok, preparation.supervised_spans(tok, plain.messages))
    assert plain_mask.sum() == mask.sum() + 1

    for turn, reason in [({"from": "gpt", "value": "x", "unfinished": "yes"},
                          "wrong type: conversations[1].unfinished must be true or false, got 'yes'"),
                         ({"from": "human", "value": "x", "unfinished": True},
                          "wrong field: conversations[1].unfinished marks a response cut at its budget")]:
        skipped = chat_files.parse_record({"conversations": [{"from": "human", "value": "q"}, turn,
                                                       {"from": "gpt", "value": "a"}]}, "in.jsonl", 3)
        assert isinstance(skipped, chat_files.Skip) and skipped.reason.startswith(reason), skipped


# ---------------------------------------------------------------------------------------------
# prepare


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_prepare_report_columns_and_masks(tmp_path, smollm2_path, smollm2_tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", [SHAREGPT, OPENAI, {"messages": [{"role": "bot", "content": "x"}]}])
    result = preparation.prepare([src], smollm2_path, tmp_path / "out", log=lambda *_: None)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report == result.report
    assert {k: report[k] for k in ("num_records", "num_samples", "num_skipped")} == \
        {"num_records": 3, "num_samples": 2, "num_skipped": 1}
    assert report["skipped"] == [{"file": str(src), "line": 3, "reason": report["skipped"][0]["reason"]}]
    assert report["skipped"][0]["reason"].startswith("unknown role: messages[0].role is 'bot'")
    ds = result.dataset
    assert ds.column_names == ["input_ids", "loss_mask", "length", "conversation", "source", "sampled"]
    assert ds["sampled"] == [False, False]  # greedy, or written by hand: no sampled_replies mark
    for line, (row, messages) in enumerate(zip(ds, EXPECTED.values()), 1):
        [(ids, mask)] = preparation.tokenize_samples(smollm2_tokenizer, preparation.supervised_spans(smollm2_tokenizer, messages))
        assert row["input_ids"] == ids.tolist() and row["loss_mask"] == mask.tolist()
        assert row["length"] == len(ids)
        assert row["conversation"] == chat_files.conversation_key(messages) and row["source"] == f"{src}:{line}"
    assert report["num_tokens"] == sum(ds["length"])
    assert report["num_supervised_tokens"] == sum(sum(m) for m in ds["loss_mask"])


def test_prepared_dataset_is_fingerprinted_from_its_columns_not_by_pickling(monkeypatch):
    """_to_dataset gives the table from_dict would (rows and features) with a fingerprint of its
    own: the same for the same samples, another when a token, a mask bit, a source or the sampled
    mark differs, and datasets' dill hashing (which fails for pyarrow installed outside
    site-packages) unused."""
    import datasets
    import datasets.fingerprint

    def samples(token=7, bit=1, source="a.jsonl:1", sampled=False):
        return [(np.array([1, 2, token], np.int32), np.array([0, 1, bit], np.uint8), "k1", source, sampled),
                (np.array([4, 5], np.int32), np.array([1, 1], np.uint8), "k2", "a.jsonl:2", False)]

    want = datasets.Dataset.from_dict({"input_ids": [[1, 2, 7], [4, 5]], "loss_mask": [[0, 1, 1], [1, 1]],
                                       "length": [3, 2], "conversation": ["k1", "k2"],
                                       "source": ["a.jsonl:1", "a.jsonl:2"], "sampled": [False, False]})

    def no_dill(*args, **kwargs):
        raise AssertionError("datasets hashed the table")

    monkeypatch.setattr(datasets.fingerprint.Hasher, "hash", classmethod(no_dill))
    ds = preparation._to_dataset(samples())
    assert ds.to_list() == want.to_list()
    assert ds.column_names == want.column_names
    assert [ds.features[k].feature.dtype for k in ("input_ids", "loss_mask")] == ["int32", "uint8"]
    assert [ds.features[k].dtype for k in ("length", "conversation", "source", "sampled")] == \
        ["int32", "string", "string", "bool"]
    assert ds._fingerprint == preparation._to_dataset(samples())._fingerprint
    others = {preparation._to_dataset(s)._fingerprint
              for s in (samples(token=8), samples(bit=0), samples(source="b:1"), samples(sampled=True))}
    assert len(others) == 4 and ds._fingerprint not in others


def test_prepare_cache_reuse_and_invalidation(tmp_path, smollm2_path, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", [SHAREGPT, OPENAI])
    first = preparation.prepare([src], smollm2_path, tmp_path / "out", log=lambda *_: None)
    assert not first.cached

    def no_tokenizing(*_args, **_kwargs):
        raise AssertionError("a cached prepare must not tokenize")

    with monkeypatch.context() as patch:
        patch.setattr(preparation, "tokenize_samples", no_tokenizing)
        again = preparation.prepare([src], smollm2_path, tmp_path / "out", log=lambda *_: None)
        assert again.cached and again.report == first.report and len(again.dataset) == 2
        with pytest.raises(AssertionError, match="must not tokenize"):  # a setting changed
            preparation.prepare([src], smollm2_path, tmp_path / "out", max_length=64, log=lambda *_: None)
        # The reader changed (how records are read, their conversation keys): prepared again.
        reader = tmp_path / "chat_files.py"
        reader.write_bytes(Path(chat_files.__file__).read_bytes() + b"\n# changed\n")
        patch.setattr(preparation, "PREPARED_BY", (preparation.PREPARED_BY[0], reader))
        with pytest.raises(AssertionError, match="must not tokenize"):
            preparation.prepare([src], smollm2_path, tmp_path / "out", log=lambda *_: None)
    write_jsonl(src, [SHAREGPT])  # the input changed
    third = preparation.prepare([src], smollm2_path, tmp_path / "out", log=lambda *_: None)
    assert not third.cached and third.report["num_samples"] == 1


def test_prepare_says_when_a_file_is_an_unfinished_regeneration(tmp_path, smollm2_path):
    """A data file with the mark `data regenerate` keeps beside an output it has not finished
    (a regeneration still running, or stopped) is prepared as it is, and a line says so, on a
    cached prepare too; a finished one (no mark) gets no line."""
    src = write_jsonl(tmp_path / "regen.jsonl", [SHAREGPT, OPENAI])
    said: list[str] = []
    preparation.prepare([src], smollm2_path, tmp_path / "out", log=said.append)
    assert not any("unfinished" in line for line in said)
    chat_files.partial_path(src).write_text("")
    for _ in range(2):  # prepared, then cached
        said.clear()
        prepared = preparation.prepare([src], smollm2_path, tmp_path / "out", log=said.append)
        assert len(prepared.dataset) == 2
        assert [line for line in said if "unfinished" in line] == [
            f"data prepare: {src} is an unfinished regeneration (regen.jsonl.partial beside it: a `data "
            f"regenerate` still writing it, or stopped before its end); the records it holds are used, and "
            f"rerunning that regeneration finishes it"]


def test_prepare_overlong_truncate_and_drop(tmp_path, smollm2_path):
    long = {"messages": [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": "word " * 200}]}
    src = write_jsonl(tmp_path / "in.jsonl", [long, SHAREGPT])
    cut = preparation.prepare([src], smollm2_path, tmp_path / "t", max_length=64, log=lambda *_: None)
    assert cut.report["num_samples"] == 2 and cut.report["num_truncated"] == 1
    assert max(cut.dataset["length"]) == 64
    dropped = preparation.prepare([src], smollm2_path, tmp_path / "d", max_length=64, overlong="drop", log=lambda *_: None)
    assert dropped.report["num_samples"] == 1
    assert dropped.report["skipped_by_reason"] == {"over-long": 1}
    # A truncation that leaves no supervised pair drops the sample and says why.
    tiny = preparation.prepare([src], smollm2_path, tmp_path / "s", max_length=30, log=lambda *_: None)
    assert tiny.report["skipped_by_reason"] == {"too few supervised tokens": 2}


def test_prepare_strict_lists_every_bad_record(tmp_path, smollm2_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(SHAREGPT) + "\n{broken\n" + json.dumps({"messages": 3}) + "\n")
    with pytest.raises(chat_files.DataError) as err:
        preparation.prepare([src], smollm2_path, tmp_path / "out", strict=True, log=lambda *_: None)
    message = str(err.value)
    assert "2 bad record(s)" in message and f"{src}:2: malformed JSON" in message and f"{src}:3: wrong type" in message
    assert not (tmp_path / "out").exists()
    preparation.prepare([src], smollm2_path, tmp_path / "out", log=lambda *_: None)
    with pytest.raises(chat_files.DataError, match="2 bad record"):  # also from the cache
        preparation.prepare([src], smollm2_path, tmp_path / "out", strict=True, log=lambda *_: None)


def test_prepare_refuses_foreign_out_folder(tmp_path, smollm2_path):
    src = write_jsonl(tmp_path / "in.jsonl", [SHAREGPT])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "precious.txt").write_text("keep me")
    with pytest.raises(chat_files.DataError, match="not a prepared dataset"):
        preparation.prepare([src], smollm2_path, tmp_path / "mine", log=lambda *_: None)
    assert (tmp_path / "mine" / "precious.txt").exists()


def test_prepare_rewriting_template(tmp_path, template_dirs):
    two_turns = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                              {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    src = write_jsonl(tmp_path / "in.jsonl", [two_turns])
    assert preparation.prepare([src], template_dirs["llama3"], tmp_path / "l", log=lambda *_: None).report["num_samples"] == 1
    assert preparation.prepare([src], template_dirs["qwen3"], tmp_path / "q", log=lambda *_: None).report["num_samples"] == 2


def test_cli_data_prepare(tmp_path, smollm2_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [SHAREGPT, {"conversations": [{"from": "alien", "value": "x"}]}])
    out = tmp_path / "out"
    argv = ["data", "prepare", "--data", str(src), "--target", str(smollm2_path), "--out", str(out),
            "--max-length", "128"]
    assert cli.main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["num_samples"] == 1 and report["max_length"] == 128
    assert cli.main(argv) == 0 and "cached" in capsys.readouterr().out
    assert cli.main(argv + ["--strict"]) == 2  # bad input (errors.py)
    assert f"{src}:2: unknown role" in capsys.readouterr().err
    # --target takes a bundled name as the other commands do (the same tokenizer: same samples)
    bundled = ["data", "prepare", "--data", str(src), "--target", "bundled:smollm2-135m-instruct",
               "--out", str(tmp_path / "bundled"), "--max-length", "128"]
    assert cli.main(bundled) == 0
    assert preparation.load_prepared(tmp_path / "bundled")["input_ids"] == preparation.load_prepared(out)["input_ids"]


def test_default_dataset_uses_bundled_sharegpt(tmp_path, smollm2_path, monkeypatch):
    """The embedded default goes through prepare on the bundled file (here a cut-down copy
    of it, truncated mid-record like the real one) into the cache folder."""
    head = assets.sharegpt_json().read_bytes()[:200_000]
    small = tmp_path / "sharegpt.json"
    small.write_bytes(head)
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(assets, "sharegpt_json", lambda: small)
    result = preparation.default_dataset(smollm2_path, log=lambda *_: None)
    assert result.path.parent == tmp_path / "cache" / "data"
    report = result.report
    assert report["skipped_by_reason"].get("truncated file") == 1
    # ChatML never rewrites turns: every record is one sample or one skip.
    assert report["num_samples"] > 20 and report["num_records"] == report["num_samples"] + report["num_skipped"]
    assert preparation.default_dataset(smollm2_path, log=lambda *_: None).cached
    assert np.all(np.asarray(result.dataset["length"]) <= preparation.DEFAULT_MAX_LENGTH)


def test_cache_folders_wanted_at_once_are_built_once(tmp_path, smollm2_path, monkeypatch):
    """Two runs (or test workers) that need the same cache folder at the same moment: the
    embedded default's prepared data and a converted target are each built by one of them; the
    other waits for the folder's lock and then reads what the first built."""
    import threading

    import transformers

    head = assets.sharegpt_json().read_bytes()[:100_000]
    small = tmp_path / "sharegpt.json"
    small.write_bytes(head)
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(cache))
    monkeypatch.setattr(assets, "sharegpt_json", lambda: small)
    (cache / f"smollm2-135m-instruct-v2-tf{transformers.__version__}").symlink_to(smollm2_path)

    def both(fn):
        results, errors = [], []

        def one():
            try:
                results.append(fn())
            except Exception as err:  # noqa: BLE001 - reported by the assertion below
                errors.append(err)
        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        return results

    lines: list[str] = []
    prepared = both(lambda: preparation.default_dataset(smollm2_path, max_length=128, log=lines.append))
    assert sorted(p.cached for p in prepared) == [False, True], lines
    assert len(prepared[0].dataset) == len(prepared[1].dataset) > 0

    built = []
    save = assets.save_model_folder

    def slow_save(model, tokenizer, folder):  # long enough for the other thread to find no folder
        built.append(folder)
        time.sleep(0.5)
        save(model, tokenizer, folder)
    monkeypatch.setattr(assets, "save_model_folder", slow_save)
    folders = both(assets.tiny_random_target_dir)
    assert len(built) == 1 and folders[0] == folders[1] and assets.is_model_folder(folders[0])


def test_an_up_to_date_prepared_folder_is_read_where_nothing_can_be_written(tmp_path, smollm2_path, monkeypatch):
    """A cached prepared folder on a read-only place (a shared cache) is read as it is; only a
    folder that must be written is checked for writing."""
    src = write_jsonl(tmp_path / "in.jsonl", [SHAREGPT])
    first = preparation.prepare([src], smollm2_path, tmp_path / "out", log=lambda *_: None)
    monkeypatch.setattr(preparation, "folder_problem", lambda path: "read-only file system")
    again = preparation.prepare([src], smollm2_path, tmp_path / "out", log=lambda *_: None)
    assert again.cached and again.report["num_samples"] == first.report["num_samples"] == 1
    with pytest.raises(chat_files.DataError, match="read-only file system"):
        preparation.prepare([src], smollm2_path, tmp_path / "elsewhere", log=lambda *_: None)
