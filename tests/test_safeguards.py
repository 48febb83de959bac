"""What a user's mistake or a second process can no longer do to their data, on CPU with the tiny
target: a refused regeneration leaves the user's file as it was; one process owns a run folder,
a regeneration output or a cache folder at a time; reading data takes memory by the record
(a 150 MB line, and a fuzz of hostile files); a resumed run refuses the settings it cannot
continue with and applies the others; export never replaces a drafter unasked and needs only
the drafter's files; no carriage return reaches a log and a stopped run says how to resume it;
the prepared-data cache follows the content, not the path."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT, TINY, hold_lock_in_child, subprocess_env
from dflash_train.app import cli
from dflash_train.core import locks
from dflash_train.core.assets import tiny_random_target_dir
from dflash_train.core.errors import BAD_INPUT
from dflash_train.data import chat_files, preparation
from dflash_train.train.step import LrSchedule

TARGET = "bundled:tiny-random-llama"
CHATS = [{"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "an answer"}]}
         for i in range(3)]


def write_jsonl(path: Path, records, newline: bool = True) -> Path:
    text = "\n".join(json.dumps(r) for r in records)
    path.write_text(text + ("\n" if newline else ""))
    return path


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# The child writes its own peak resident memory (VmHWM of its process image) as it exits: the
# rusage of a forked child also counts the pages of the parent it was forked from, which in a
# test worker that ran other tests is gigabytes.
MEASURED_MAIN = """import atexit, os, runpy, sys
def write_peak():
    with open("/proc/self/status") as status, open(os.environ["DFLASH_TEST_PEAK_FILE"], "w") as out:
        out.write(next(line.split()[1] for line in status if line.startswith("VmHWM:")))
atexit.register(write_peak)
runpy.run_module("dflash_train", run_name="__main__")
"""


def run_measured(argv: list[str], cwd: Path, timeout: float = 300) -> tuple[int, str, str, int]:
    """(exit status, stdout, stderr, peak resident memory in bytes) of a `dflash-train` child."""
    peak_file = cwd / "peak-kib.txt"
    env = {**subprocess_env(), "DFLASH_TEST_PEAK_FILE": str(peak_file)}
    with open(cwd / "out.log", "w+b") as out, open(cwd / "err.log", "w+b") as err:
        proc = subprocess.Popen([sys.executable, "-c", MEASURED_MAIN, *argv], cwd=cwd, env=env, stdout=out,
                                stderr=err)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"{argv} ran past {timeout} s") from None
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read().decode(), err.read().decode(), int(peak_file.read_text()) * 1024


# --------------------------------------------------------------------------- a refusal touches nothing


def test_a_refused_regeneration_leaves_the_users_file_as_it_was(tmp_path, capsys):
    """The user's own 2-record file as --out, its last line without a newline: the command
    refuses (its lines are not this input's) and the file keeps every byte; nothing is left
    beside it."""
    chats = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    mine = write_jsonl(tmp_path / "mine.jsonl", [{"messages": [{"role": "user", "content": "my notes"},
                                                               {"role": "assistant", "content": "keep"}]}] * 2,
                       newline=False)
    before = files_of(tmp_path)
    assert cli.main(["data", "regenerate", "--data", str(chats), "--target", TARGET, "--out", str(mine)]) == BAD_INPUT
    err = capsys.readouterr().err
    assert "does not match input record" in err and "choose another --out" in err and err.count("\n") == 1
    assert files_of(tmp_path) == before


def test_a_cut_line_is_repaired_only_in_an_output_this_project_writes(tmp_path, capsys):
    """A file whose whole lines are this input's records but whose last line is cut is cut off
    only when a regeneration of its own left it (its .partial mark): a copy of the input is
    refused untouched; a stopped regeneration's output is repaired and completed, and loses
    its mark once whole."""
    chats = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(chats.read_bytes()[:-5])  # the input itself, its last line cut
    before = copy.read_bytes()
    argv = ["data", "regenerate", "--data", str(chats), "--target", TARGET, "--max-new-tokens", "4", "--device", "cpu"]
    assert cli.main([*argv, "--out", str(copy)]) == BAD_INPUT
    assert "its last line is cut off" in capsys.readouterr().err and copy.read_bytes() == before
    out = tmp_path / "regen.jsonl"
    assert cli.main([*argv, "--out", str(out), "--limit", "1"]) == 0
    assert (tmp_path / "regen.jsonl.partial").is_file()  # unfinished: 1 of 3 records
    with open(out, "a") as handle:
        handle.write('{"conversations": [{"from": "hu')  # a run killed mid-line
    assert cli.main([*argv, "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line)["conversations"][0]["value"].startswith("question")
                                   for line in lines)
    assert not (tmp_path / "regen.jsonl.partial").exists()


# --------------------------------------------------------------------------- one owner at a time


def test_a_second_training_on_the_same_folder_is_refused_naming_the_holder(tmp_path, capsys):
    """Two `train` runs on one output folder: while the first runs, the second exits 2 with one
    line naming the first's pid and host and changes nothing; once the first is killed (its
    lock left behind), the next run takes the folder over and trains."""
    out = tmp_path / "same"
    first = subprocess.Popen([sys.executable, "-m", "dflash_train", "train", "--config", str(TINY), "--output-dir",
                              str(out), "data.limit=16", "train.max_steps=100000", "checkpoint.every=100000"], cwd=ROOT,
                             env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lock = out / ".dflash-train.lock"
    try:
        deadline = time.monotonic() + 120
        while not (lock.is_file() and lock.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        before = files_of(out)
        argv = ["train", "--config", str(TINY), "--output-dir", str(out), "data.limit=16", "train.max_steps=2",
                "checkpoint.every=2"]
        assert cli.main(argv) == BAD_INPUT
        err = capsys.readouterr().err
        assert f"is in use by pid {first.pid} on host {socket.gethostname()}" in err, err
        assert "choose another output_dir" in err and err.count("\n") == 1
        assert files_of(out) == before
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert cli.main(argv) == 0  # the killed run's lock is taken over
    assert (out / "drafter" / "config.json").is_file()


def test_a_folder_no_run_used_keeps_the_users_files_that_share_a_runs_names(tmp_path, capsys):
    """`output_dir` a folder of the user's holding a config.yaml and a validation.jsonl of their
    own (`output_dir=.` in a project folder): refused in one line naming them, nothing written;
    a new or empty folder, and a run's own folder (trained further), are taken."""
    out = tmp_path / "project"
    out.mkdir()
    (out / "config.yaml").write_text("# my settings\n")
    (out / "validation.jsonl").write_text(json.dumps(CHATS[0]) + "\n")
    (out / "notes.txt").write_text("kept\n")
    before = files_of(out)
    argv = ["train", "--config", str(TINY), "--output-dir", str(out), "data.limit=16", "train.max_steps=2",
            "checkpoint.every=2"]
    assert cli.main(argv) == BAD_INPUT
    err = capsys.readouterr().err
    assert f"output_dir {out} holds config.yaml, validation.jsonl, which a run writes, and no run has used it" in err
    assert files_of(out) == before
    (out / "config.yaml").unlink()
    (out / "validation.jsonl").unlink()
    assert cli.main(argv) == 0  # only files a run does not write: taken
    argv[argv.index("train.max_steps=2")] = "train.max_steps=4"
    assert cli.main(argv) == 0 and (out / "notes.txt").read_text() == "kept\n"  # its own run folder: trained further
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


def test_a_run_folder_inside_its_data_folder_is_refused(tmp_path, capsys):
    """data.paths a folder and output_dir inside it: the run's JSONL files (its held-out
    conversations) would be read as data by the next run; refused in one line, nothing made."""
    data = tmp_path / "chats"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(data / "run"), f"data.paths=[{data}]",
                     "train.max_steps=2"]) == BAD_INPUT
    assert f"output_dir {data / 'run'} is inside data.paths folder {data}" in capsys.readouterr().err
    assert sorted(p.name for p in data.iterdir()) == ["a.jsonl"]


def test_a_regeneration_output_and_a_cache_folder_have_one_owner(tmp_path, capsys):
    """A regeneration whose output another process is writing is refused naming it; a cache
    folder being built by another process is waited for (said once, with who builds it), and
    taken over when that process is killed."""
    chats = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    out = tmp_path / "regen.jsonl"
    holder = hold_lock_in_child(tmp_path / ".regen.jsonl.lock")
    try:
        assert cli.main(["data", "regenerate", "--data", str(chats), "--target", TARGET, "--out", str(out)]) == BAD_INPUT
        assert f"--out {out} is in use by pid {holder.pid}" in capsys.readouterr().err
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    cache_lock = tmp_path / ".cache-folder.lock"
    holder = hold_lock_in_child(cache_lock)
    said, done = [], threading.Event()

    def wait_then_build():
        with locks.wait_for(cache_lock, "cache-folder", said.append):
            done.set()

    thread = threading.Thread(target=wait_then_build)
    thread.start()
    time.sleep(1.0)
    assert not done.is_set() and said and f"being built by pid {holder.pid}" in said[0]
    holder.send_signal(signal.SIGKILL)  # dies holding it: the kernel frees the lock
    holder.wait()
    thread.join(60)
    assert done.is_set() and len(said) == 1


def test_a_regeneration_into_its_own_input_is_refused(tmp_path, capsys):
    """`data regenerate` whose --out is its input file (resuming would take the input for its
    finished regeneration: nothing regenerated, rc 0) or a data file inside an input folder (a
    rerun would read the answers as input) is refused in one line, and nothing is written."""
    chats = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    before = chats.read_bytes()
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", CHATS)
    for data, out, said in ((chats, tmp_path / "." / "chats.jsonl", "is the input file itself"),
                            (folder, folder / "sub" / "regen.jsonl", f"lies in the input folder {folder}")):
        argv = ["data", "regenerate", "--data", str(data), "--target", TARGET, "--out", str(out)]
        assert cli.main(argv) == BAD_INPUT
        assert said in capsys.readouterr().err
    assert chats.read_bytes() == before and sorted(p.name for p in folder.iterdir()) == ["a.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl", "folder"]


def test_a_target_prompts_output_has_one_owner(tmp_path, capsys):
    """`data source --source target-prompts` into an output another process is writing is
    refused before anything loads, naming that process, and writes nothing."""
    out = tmp_path / "own.jsonl"
    holder = hold_lock_in_child(tmp_path / ".own.jsonl.lock")
    try:
        argv = ["data", "source", "--source", "target-prompts", "--target", TARGET, "--out", str(out), "--limit", "2"]
        assert cli.main(argv) == BAD_INPUT
        err = capsys.readouterr().err
        assert f"--out {out} is in use by pid {holder.pid} on host {socket.gethostname()}" in err
        assert "choose another --out" in err and err.count("\n") == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == [".own.jsonl.lock"]
    finally:
        holder.kill()
        holder.wait()


# --------------------------------------------------------------------------- memory by the record


def test_a_150_mb_line_is_skipped_unread_and_memory_stays_bounded(tmp_path):
    """A JSONL of one 150 MB line and a real chat: `data prepare` skips the huge record, reported
    with its line, before decoding it, keeps the chat, and peaks well under 2 GB."""
    data = tmp_path / "huge.jsonl"
    with open(data, "wb") as handle:
        handle.write(b'{"conversations": [{"from": "human", "value": "')
        handle.write(b"word " * (150 * 1024 * 1024 // 5))
        handle.write(b'"}, {"from": "gpt", "value": "ok"}]}\n')
        handle.write((json.dumps(CHATS[0]) + "\n").encode())
    code, _, err, peak = run_measured(["data", "prepare", "--data", str(data), "--target", TARGET, "--out",
                                       str(tmp_path / "prepared")], tmp_path)
    assert code == 0, err
    report = json.loads((tmp_path / "prepared" / "report.json").read_text())
    assert report["num_samples"] == 1 and report["skipped"][0]["line"] == 1
    assert report["skipped"][0]["reason"].startswith("over-long record: 157,286,")
    assert peak < 2 * 1024**3, f"peak {peak / 1024**3:.2f} GiB"


def test_over_long_records_are_skipped_in_every_format_and_the_rest_is_read(tmp_path):
    """With a small limit: an over-long JSONL line, JSON array element (holding brackets, quotes
    and escapes in its strings) and Parquet row are each one skip with their line; the records
    around them are read."""
    small = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    big = {"conversations": [{"from": "human", "value": 'x]}{"\\' * 400}, {"from": "gpt", "value": "z"}]}
    lines = write_jsonl(tmp_path / "a.jsonl", [small, big, small])
    array = tmp_path / "b.json"
    array.write_text("[\n" + ",\n".join(json.dumps(r, indent=1) for r in (small, big, small)) + "\n]\n")
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist([small, big, small]), parquet)
    for path in (lines, array, parquet):
        items = list(chat_files.iter_records([path], max_record_bytes=1000))
        kinds = ["skip" if isinstance(i, chat_files.Skip) else "record" for i in items]
        assert kinds == ["record", "skip", "record"], (path, items)
        assert items[1].reason.startswith("over-long record") and items[1].line == items[0].line + (
            1 if path != array else len(json.dumps(small, indent=1).splitlines())), (path, items[1])


FUZZ_CASES = {
    "random-bytes": lambda rng: rng.randbytes(3 * 1024 * 1024),
    "a-huge-line": lambda rng: b'{"messages": [{"role": "user", "content": "' + b"word " * (4 * 1024 * 1024)
    + b'"}, {"role": "assistant", "content": "ok"}]}\n',
    "deep-nesting": lambda rng: b"[" * 200_000 + b"\n" + b'{"conversations": ' + b"[" * 50_000 + b"\n",
    "utf-16": lambda rng: json.dumps(CHATS[0]).encode("utf-16") + b"\n",
    "latin-1": lambda rng: json.dumps(CHATS[0], ensure_ascii=False).replace("question", "qu\u00e9stion").encode(
        "latin-1") + b"\n",
    "huge-array-element": lambda rng: b'[{"conversations": [' + b'{"from": "human", "value": "x"},' * 600_000
    + b'{"from": "gpt", "value": "y"}]}]',
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(FUZZ_CASES))
def test_fuzzed_data_files_exit_2_in_one_line_in_bounded_memory_and_stay_untouched(case, tmp_path):
    """Hostile data files (random bytes, a line over the record limit, JSON nested past what
    can be decoded, UTF-16 and Latin-1 text, an over-long array element): `data prepare` exits 2
    with one line naming the file, never a traceback, peaks under 2 GB, and leaves the file
    byte for byte as it was."""
    rng = random.Random(case)
    data = tmp_path / ("fuzz.json" if case == "huge-array-element" else "fuzz.jsonl")
    data.write_bytes(FUZZ_CASES[case](rng))
    before = (data.read_bytes(), data.stat().st_mtime_ns)
    code, _, err, peak = run_measured(["data", "prepare", "--data", str(data), "--target", TARGET, "--out",
                                       str(tmp_path / "prepared")], tmp_path)
    assert code == BAD_INPUT and "Traceback" not in err, err
    assert err.count("\n") == 1 and err.startswith("dflash-train data prepare: no usable records in") and \
        str(data) in err, err
    assert peak < 2 * 1024**3, f"peak {peak / 1024**3:.2f} GiB"
    assert (data.read_bytes(), data.stat().st_mtime_ns) == before


# --------------------------------------------------------------------------- resume


def test_resume_refuses_a_change_it_cannot_continue_and_applies_the_others(tmp_path, capsys):
    """A run resumed with another architecture is refused in one line naming the field and both
    choices, before anything is loaded, and its folder is left as it was; one resumed with
    another learning rate and max_steps logs them as changes, trains at the new rate from the
    resumed step, and keeps the history in config.yaml (which still loads as a --config)."""
    out = tmp_path / "run"
    base = ["train", "--config", str(TINY), "--output-dir", str(out), "data.limit=16", "checkpoint.every=2"]
    assert cli.main([*base, "train.max_steps=2"]) == 0
    before = files_of(out)
    capsys.readouterr()
    assert cli.main([*base, "train.max_steps=2", "drafter.num_layers=2"]) == BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "drafter.num_layers 1 -> 2" in err and "drafter.num_layers=1" in err
    assert "choose another output_dir" in err and files_of(out) == before
    assert cli.main([*base, "train.max_steps=4", "optim.lr=0.005"]) == 0
    said = capsys.readouterr().out
    assert "resumed with changed settings, applied from step 2: optim.lr 0.01 -> 0.005, train.max_steps 2 -> 4" \
        in said, said
    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert records[3]["lr"] == pytest.approx(0.005 * LrSchedule(4, 0.1, 0.0)(3), rel=1e-9)
    text = (out / "config.yaml").read_text()
    assert text.startswith("# resumed at step 2: ") and "optim.lr 0.01 -> 0.005" in text.splitlines()[0]
    assert yaml.safe_load(text)["optim"]["lr"] == 0.005


# --------------------------------------------------------------------------- export


def test_export_keeps_an_existing_drafter_without_force_and_needs_no_optimizer_state(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(out), "data.limit=16", "train.max_steps=4",
                     "checkpoint.every=2"]) == 0
    drafter = out / "drafter"
    before = files_of(drafter)
    step2 = out / "checkpoints" / "step-2"
    assert cli.main(["export", "--checkpoint", str(step2), "--out", str(drafter)]) == BAD_INPUT
    assert "pass --force" in capsys.readouterr().err and files_of(drafter) == before
    (step2 / "optimizer.pt").unlink()  # export reads the drafter's files only
    assert cli.main(["export", "--checkpoint", str(step2), "--out", str(drafter), "--force"]) == 0
    assert files_of(drafter) != before and (drafter / "model.safetensors").is_file()


# --------------------------------------------------------------------------- logs


def test_no_stage_draws_a_carriage_return_into_a_log(tmp_path):
    """`data prepare` (datasets' "Saving the dataset") and `eval` (transformers' "Loading
    weights") written to files hold no carriage return, nor does the one-time GGUF conversion
    of a bundled target."""
    chats = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    code, out, err, _ = run_measured(["data", "prepare", "--data", str(chats), "--target", TARGET, "--out",
                                      str(tmp_path / "prepared")], tmp_path)
    assert code == 0 and "\r" not in out + err, err
    run = tmp_path / "run"
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(run), "data.limit=16",
                     "train.max_steps=1"]) == 0
    code, out, err, _ = run_measured(["eval", "--target", TARGET, "--drafter", str(run / "drafter"), "--prompts",
                                      "mt-bench", "--limit", "1", "--max-new-tokens", "4", "--no-speedup",
                                      "--device", "cpu", "--output", str(tmp_path / "eval.json")], tmp_path)
    assert code == 0 and "\r" not in out + err, err


@pytest.mark.slow
def test_the_gguf_conversion_draws_no_carriage_return_into_a_log(tmp_path):
    script = "from dflash_train.app import cli; from dflash_train.core import assets; assets.smollm2_dir()"
    env = subprocess_env(DFLASH_TRAIN_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert b"\r" not in done.stdout + done.stderr


def test_a_signal_says_what_was_saved_and_the_command_that_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--config", str(TINY), "--output-dir", str(out), "data.limit=16", "train.max_steps=6",
            "faults.sigterm_at_steps=[3]"]
    assert cli.main(argv) == 0
    said = capsys.readouterr()
    text = said.out + said.err
    saved = out / "checkpoints" / "step-3"
    assert f"SIGTERM received: the run stopped after step 3 of 6 and saved its checkpoint {saved}" in text, text
    assert "the same command resumes from it: dflash-train train --config" in text and saved.is_dir()


# --------------------------------------------------------------------------- the prepared-data cache


def test_the_prepared_data_cache_follows_the_content_not_the_path(tmp_path):
    """The same file at two paths (two installs of a bundled package) prepares once: the second
    finds the cache up to date and its samples name its own path; changed content prepares again."""
    for install in ("install-a", "install-b"):
        (tmp_path / install).mkdir()
    first = write_jsonl(tmp_path / "install-a" / "chats.jsonl", CHATS)
    second = tmp_path / "install-b" / "chats.jsonl"
    shutil.copy(first, second)
    os.utime(second, ns=(1, 1))  # another stamp too
    target, out = tiny_random_target_dir(), tmp_path / "cache"
    one = preparation.prepare([first], target, out, max_length=256, log=lambda *_: None)
    two = preparation.prepare([second], target, out, max_length=256, log=lambda *_: None)
    assert not one.cached and two.cached
    assert {s.rpartition(":")[0] for s in two.dataset["source"]} == {str(second.resolve())}
    assert two.report["files"] == [str(second)]
    write_jsonl(second, CHATS[:2])
    assert not preparation.prepare([second], target, out, max_length=256, log=lambda *_: None).cached
