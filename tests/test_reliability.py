"""Reliability guarantees (README "Reliability guarantees"), each proved with injected faults on
the tiny CPU config: exact resume after 10 SIGTERMs, a save killed halfway, NaN steps, target
forward failures, a full disk, hostile checkpoint files, and 10,000 fuzzed data records."""

from __future__ import annotations

import ast
import errno
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT, TINY, losses
from dflash_train.app import cli
from dflash_train.core.config import ConfigError, load_config
from dflash_train.train import checkpoint as ckpt
from dflash_train.train.loop import build, train_drafter
from dflash_train.train.step import DrafterStep

STEPS = 20


def records(out: Path) -> list[dict]:
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def num_logged(out: Path) -> int:
    """Whole lines of metrics.jsonl (it may be mid-write or not yet exist)."""
    try:
        return (out / "metrics.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


def train_args(out: Path, *overrides: str) -> list[str]:
    return ["train", "--config", str(TINY), "--output-dir", str(out), *overrides]


def train_cmd(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "dflash_train", *train_args(out, *overrides)]


def newest_step(out: Path) -> int:
    return int(ckpt.list_checkpoints(out)[-1].name[5:])


def snapshot(step: DrafterStep) -> tuple[dict, dict]:
    """Copies of the drafter weights and the optimizer's per-parameter state."""
    weights = {k: v.clone() for k, v in step.drafter.state_dict().items()}
    state = {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in s.items()}
             for k, s in step.optimizer.state_dict()["state"].items()}
    return weights, state


def assert_same_state(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    assert a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys()
    for k, v in a[0].items():
        assert torch.equal(v, b[0][k]), k
    for k, s in a[1].items():
        for n, t in s.items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(b[1][k][n])), (k, n)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """STEPS uninterrupted steps of the tiny config (log every step)."""
    out = tmp_path_factory.mktemp("reference")
    assert cli.main(train_args(out, f"train.max_steps={STEPS}")) == 0
    return out


# --------------------------------------------------------------------------- the faults section


def test_faults_are_set_like_any_config_and_off_by_default():
    cfg = load_config(TINY, ["faults.nan_at_steps=[3]", "faults.target_error=oom", "faults.delay_seconds=0.5"])
    assert cfg.faults.nan_at_steps == [3] and cfg.faults.target_error == "oom"
    default = load_config(TINY).faults
    assert all(not v for k, v in vars(default).items() if k != "target_error")
    assert load_config(TINY).checkpoint.keep >= 2  # the tiny config keeps a fallback checkpoint
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["faults.nan_at_steps=[0]", "faults.delay_seconds=-1"])
    assert "faults.nan_at_steps" in str(err.value) and "faults.delay_seconds" in str(err.value)
    with pytest.raises(ConfigError, match="unknown setting 'faults.explode'"):
        load_config(TINY, ["faults.explode=1"])


def test_delay_fault_sleeps_after_the_step(tmp_path, monkeypatch):
    import dflash_train.train.faults as faults_module

    slept = []

    class FaultsClock:
        """faults.py's view of the time module: its sleeps recorded, not slept. Only that module's
        name is replaced: patching time.sleep itself also caught other code's polling (a file lock
        that another test process held retried thousands of times at once)."""

        def __getattr__(self, name):
            return getattr(time, name)

        def sleep(self, seconds):
            slept.append(seconds)

    monkeypatch.setattr(faults_module, "time", FaultsClock())
    assert cli.main(train_args(tmp_path, "train.max_steps=3", "faults.delay_at_steps=[2]",
                               "faults.delay_seconds=7.5")) == 0
    assert slept == [7.5]


# --------------------------------------------------------------------------- checkpoints


def test_a_resumed_run_warms_up_its_target_too(tmp_path, monkeypatch):
    """train_drafter warms the target up (on a GPU: compiled shapes and the target's CUDA graphs)
    whether it starts fresh or resumes from a checkpoint; a resumed run without it would train
    without its graphs."""
    from dflash_train.train import loop as train_module

    warmed = []
    real = train_module.warm_up
    monkeypatch.setattr(train_module, "warm_up", lambda run: (warmed.append(run.steps_done), real(run)))
    assert cli.main(train_args(tmp_path, "train.max_steps=4", "checkpoint.every=2")) == 0
    assert cli.main(train_args(tmp_path, "train.max_steps=6", "checkpoint.every=2")) == 0
    assert warmed == [0, 4]


def test_corrupted_checkpoint_fault_falls_back_and_says_which(reference_run, tmp_path, capsys):
    assert cli.main(train_args(tmp_path, f"train.max_steps={STEPS}",
                               f"faults.corrupt_checkpoint_at_steps=[{STEPS}]")) == 0
    capsys.readouterr()
    assert cli.main(train_args(tmp_path, f"train.max_steps={STEPS}")) == 0
    said = capsys.readouterr().out
    newest = tmp_path / "checkpoints" / f"step-{STEPS}"
    assert f"skipping checkpoint {newest}: drafter.safetensors does not match its checksum" in said
    assert f"resuming from {tmp_path / 'checkpoints' / f'step-{STEPS - 5}'}" in said
    assert losses(tmp_path) == losses(reference_run)


@pytest.mark.slow
def test_save_killed_halfway_keeps_the_last_good_checkpoint(reference_run, tmp_path):
    """kill -9 in the middle of writing step-10 (os._exit(137) after the first files)."""
    first = subprocess.run(train_cmd(tmp_path, f"train.max_steps={STEPS}", "faults.interrupt_save_at_steps=[10]"),
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 137, first.stdout + first.stderr
    root = tmp_path / "checkpoints"
    leftovers = list(root.glob(".tmp-step-10-*"))
    assert len(leftovers) == 1 and (leftovers[0] / "drafter.safetensors").is_file()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-5"]
    assert ckpt.verify_checkpoint(root / "step-5") is None
    rerun = subprocess.run(train_cmd(tmp_path, f"train.max_steps={STEPS}"), cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"resuming from {root / 'step-5'}" in rerun.stdout
    assert not list(root.glob(".tmp-*"))  # the later saves cleaned the leftover up
    assert losses(tmp_path) == losses(reference_run)


def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    real_save = torch.save

    def save_on_full_disk(obj, f, *args, **kwargs):
        if ".tmp-step-10-" in str(f) and Path(f).name == "rng.pt":
            Path(f).write_bytes(b"\0" * 100)  # a partial write, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_on_full_disk)
    assert cli.main(train_args(tmp_path, "train.max_steps=12")) == 1
    err = capsys.readouterr().err
    assert "saving checkpoint step-10" in err and "No space left on device" in err
    assert "the previous checkpoints are untouched" in err
    root = tmp_path / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-5"]
    assert ckpt.verify_checkpoint(root / "step-5") is None
    assert not list(root.glob(".tmp-*"))


# --------------------------------------------------------------------------- hostile files


def test_every_torch_load_is_weights_only_and_nothing_is_unpickled():
    package = ROOT / "dflash_train"
    calls = 0
    for source in sorted(package.rglob("*.py")):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            if (owner, node.func.attr) == ("torch", "load"):
                calls += 1
                flags = {k.arg: k.value for k in node.keywords}
                assert isinstance(flags.get("weights_only"), ast.Constant) and flags["weights_only"].value is True, \
                    f"{source.name}:{node.lineno}: torch.load without weights_only=True"
            assert (owner, node.func.attr) not in {("pickle", "load"), ("pickle", "loads")}, \
                f"{source.name}:{node.lineno}: unpickling"
            if node.func.attr == "load" and owner in ("np", "numpy"):
                assert not any(k.arg == "allow_pickle" for k in node.keywords), f"{source.name}:{node.lineno}"
    assert calls >= 1  # checkpoint._load_tensors: optimizer.pt and rng.pt


EXECUTED = []


def _record_execution(tag):
    EXECUTED.append(tag)
    return tag


class Payload:
    """An object whose unpickling runs code (what a hostile optimizer.pt would carry)."""

    def __reduce__(self):
        return (_record_execution, ("payload ran",))


def test_checkpoint_with_pickled_object_is_refused(tmp_path, capsys):
    assert cli.main(train_args(tmp_path, "train.max_steps=5")) == 0
    step = tmp_path / "checkpoints" / "step-5"
    hostile = step / "optimizer.pt"
    torch.save({"state": {}, "param_groups": [], "extra": Payload()}, hostile)
    meta = json.loads((step / "meta.json").read_text())
    meta["files"]["optimizer.pt"] = ckpt._sha256(hostile)  # the checksum does not stop an attacker
    (step / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="optimizer.pt: refused to load"):
        ckpt.load_checkpoint(step)
    capsys.readouterr()
    assert cli.main(train_args(tmp_path, "train.max_steps=8")) == 2  # a file's content: bad input (errors.py)
    err = capsys.readouterr().err
    assert f"{hostile}: refused to load" in err and "weights_only=True" in err
    assert EXECUTED == []


# --------------------------------------------------------------------------- non-finite steps


def test_injected_nan_is_skipped_bit_identically_then_stops_the_run(tmp_path, monkeypatch, capsys):
    """NaN at steps 4, 6, 7, 8 with a limit of 3: step 4 is skipped, weights and optimizer state
    untouched; 6-8 stop the run with a checkpoint of the state after step 5."""
    states = {}
    real_step = DrafterStep.__call__

    def watched_step(self, batches):
        states[len(states)] = snapshot(self)  # state before step len(states) + 1 (a run from scratch)
        return real_step(self, batches)

    monkeypatch.setattr(DrafterStep, "__call__", watched_step)
    assert cli.main(train_args(tmp_path, "train.max_steps=20", "train.max_consecutive_skips=3",
                               "faults.nan_at_steps=[4, 6, 7, 8]")) == 1
    said = capsys.readouterr()
    assert_same_state(states[3], states[4])  # step 4 changed nothing
    assert_same_state(states[5], states[6]) and assert_same_state(states[5], states[7])
    assert "step 4: non-finite loss or gradient; step skipped, weights untouched" in said.out
    assert "3 consecutive non-finite steps (limit train.max_consecutive_skips=3)" in said.err
    saved = tmp_path / "checkpoints" / "step-8"
    assert f"the last good state is saved in {saved}" in said.err
    assert_same_state(ckpt_state(saved), states[5])
    rows = records(tmp_path)
    assert [r["skipped_steps"] for r in rows] == [0, 0, 0, 1, 0, 1, 1, 1]
    assert [r["step"] for r in rows if r["loss"] != r["loss"]] == [4, 6, 7, 8]  # NaN logged as it was


def ckpt_state(path: Path) -> tuple[dict, dict]:
    saved = ckpt.load_checkpoint(path)
    return saved["drafter"], {k: v for k, v in saved["optimizer"]["state"].items()}


# --------------------------------------------------------------------------- target failures


@pytest.mark.parametrize("kind", ["runtime", "oom"])
def test_target_failure_skips_the_batch_and_training_continues(tmp_path, monkeypatch, capsys, kind):
    states = {}
    real_step = DrafterStep.__call__

    def watched_step(self, batches):
        states[len(states)] = snapshot(self)  # state before step len(states) + 1
        return real_step(self, batches)

    monkeypatch.setattr(DrafterStep, "__call__", watched_step)
    assert cli.main(train_args(tmp_path, "train.max_steps=8", "faults.target_error_at_steps=[3]",
                               f"faults.target_error={kind}")) == 0
    out = capsys.readouterr().out
    error = "OutOfMemoryError: injected out of memory" if kind == "oom" else "RuntimeError: injected target failure"
    line = next(l for l in out.splitlines() if l.startswith("step 3: target forward failed"))
    assert "on batch of shape (" in line and error in line and line.endswith("; batch skipped")
    assert_same_state(states[2], states[3])  # the step's only micro-batch failed: nothing applied
    assert any(not torch.equal(v, states[7][0][k]) for k, v in states[3][0].items())  # and training went on
    rows = records(tmp_path)
    assert [r["skipped_batches"] for r in rows] == [0, 0, 1, 0, 0, 0, 0, 0]
    assert rows[2]["skipped_steps"] == 1 and rows[2]["skipped_total"] == 0  # not a non-finite step
    assert len(rows) == 8 and (tmp_path / "drafter" / "model.safetensors").is_file()


def test_target_failure_of_one_micro_batch_keeps_the_others(tmp_path, monkeypatch):
    """grad_accum 2: the first micro-batch of step 2 fails, the second still trains."""
    cfg = load_config(TINY, [f"output_dir={tmp_path}", "train.max_steps=3", "train.grad_accum=2"])
    run = build(cfg, log=lambda *_: None)
    real_capture = run.producer.target.capture
    calls = []

    def capture(ids):
        calls.append(run.steps_done)
        if len(calls) == 3:  # step 2, micro-batch 0
            raise torch.OutOfMemoryError("out of memory on an unusual shape")
        return real_capture(ids)

    monkeypatch.setattr(run.producer.target, "capture", capture)
    train_drafter(run)
    rows = records(tmp_path)
    assert [r["skipped_batches"] for r in rows] == [0, 1, 0] and [r["skipped_steps"] for r in rows] == [0, 0, 0]
    assert run.control.failure_streak == 0


def test_repeated_target_failures_stop_the_run_cleanly(tmp_path, capsys):
    assert cli.main(train_args(tmp_path, "train.max_steps=20", "train.max_consecutive_batch_failures=3",
                               "faults.target_error_at_steps=[4, 5, 6]", "faults.target_error=oom")) == 1
    err = capsys.readouterr().err
    saved = tmp_path / "checkpoints" / "step-6"
    assert "the target forward failed on 3 consecutive micro-batches" in err
    assert "train.max_consecutive_batch_failures=3" in err and f"saved in {saved}" in err
    assert ckpt.verify_checkpoint(saved) is None
    assert [r["skipped_batches"] for r in records(tmp_path)] == [0, 0, 0, 1, 1, 1]


# --------------------------------------------------------------------------- 10 SIGTERMs


@pytest.mark.slow
def test_ten_sigterms_then_identical_losses(reference_run, tmp_path, capsys):
    """8 SIGTERMs delivered in-process at random steps (half of them in the middle of writing a
    checkpoint), then 2 real SIGTERMs to a training subprocess at random moments with a save
    every step; after each, the same command resumes from the checkpoint the stop wrote, and
    the final losses equal an uninterrupted run's (reference_run: STEPS steps) exactly."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    seed_note = f"random seed of this test: {rng.getstate()[1][0]}"
    out = tmp_path / "run"
    base = [f"train.max_steps={STEPS}"]
    # In-process stops up to step 11, leaving 9 steps for the 2 subprocess stops (each at most a
    # few steps past its resume), so that neither run reaches the last step.
    stops = sorted(rng.sample(range(1, 12), 8))
    previous = None
    for i, stop in enumerate(stops):
        fault = [f"faults.sigterm_at_steps=[{stop}]"] if i % 2 == 0 else \
                ["checkpoint.every=1", f"faults.sigterm_in_save_at_steps=[{stop}]"]
        capsys.readouterr()
        assert cli.main(train_args(out, *base, *fault)) == 0, seed_note
        said = capsys.readouterr().out
        assert "SIGTERM received" in said, (seed_note, stop)
        if previous is not None:
            assert f"resuming from {out / 'checkpoints' / f'step-{previous}'}" in said, (seed_note, stop)
        assert newest_step(out) == stop and ckpt.verify_checkpoint(out / "checkpoints" / f"step-{stop}") is None
        previous = stop
    for _ in range(2):
        seen = num_logged(out)
        proc = subprocess.Popen(train_cmd(out, *base, "checkpoint.every=1"), cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_lines = rng.randint(1, 2)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if num_logged(out) >= seen + wait_lines:  # resumed (truncated to `previous`) and stepped on
                time.sleep(rng.uniform(0, 0.1))  # a random point: a step, or a checkpoint write
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.01)
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, output
        assert "SIGTERM received" in output and f"resuming from {out / 'checkpoints' / f'step-{previous}'}" in output
        previous = newest_step(out)
        assert previous < STEPS and ckpt.verify_checkpoint(out / "checkpoints" / f"step-{previous}") is None
    capsys.readouterr()
    assert cli.main(train_args(out, *base)) == 0
    assert f"resuming from {out / 'checkpoints' / f'step-{previous}'}" in capsys.readouterr().out
    assert losses(out) == losses(reference_run), seed_note
    assert len(losses(out)) == STEPS


# --------------------------------------------------------------------------- hostile data

_TEXT = st.text(max_size=30)
_TRICKY = st.sampled_from(["<|im_end|>", "<|im_start|>assistant\n", "{{ raise_exception('x') }}", "{% endfor %}",
                           "\x00", "\ud800", " \n\t ", "", "\u202e" * 3, "😀" * 40])
_CONTENT = st.one_of(_TEXT, _TRICKY, st.none(), st.integers(), st.lists(_TEXT, max_size=2))
_ROLE = st.one_of(st.sampled_from(["user", "assistant", "human", "gpt", "system", "model", "USER", "tool", ""]), _TEXT)
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                     max_leaves=6)
_VALID = st.lists(st.tuples(_TEXT.map(lambda s: "q" + s), _TEXT.map(lambda s: "a" + s)), min_size=1, max_size=3).map(
    lambda pairs: {"conversations": [t for u, a in pairs
                                     for t in ({"from": "human", "value": u}, {"from": "gpt", "value": a})]})
_RECORD = st.one_of(
    _VALID,
    st.fixed_dictionaries({"conversations": st.lists(st.fixed_dictionaries({"from": _ROLE, "value": _CONTENT}), max_size=4)}),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({"role": _ROLE, "content": _CONTENT}), max_size=4)},
                          optional={"conversations": _JSON}),
    _JSON,
)
_LINE = st.one_of(
    _VALID.map(json.dumps),
    _RECORD.map(json.dumps),
    st.tuples(_RECORD.map(json.dumps), st.integers(0, 200)).map(lambda t: t[0][: t[1]]),  # cut short
    _TEXT,
).map(lambda s: s.encode("utf-8", "surrogatepass")) | st.binary(max_size=40)
FUZZ_RECORDS = 10_000


@pytest.mark.slow
def test_ten_thousand_fuzzed_records_prepare_and_train(tmp_path):
    from dflash_train.core.target import resolve_target_path
    from dflash_train.data import chat_files, preparation

    lines: list[bytes] = []

    @settings(max_examples=FUZZ_RECORDS // 20, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(_LINE, min_size=20, max_size=20))
    def parse_without_crashing(batch):
        batch = [line.replace(b"\n", b" ") for line in batch]
        for item, _ in chat_files._iter_json_lines("fuzz", io.BytesIO(b"\n".join(batch)),
                                                   chat_files.DEFAULT_MAX_RECORD_BYTES):
            if not isinstance(item, chat_files.Skip):
                chat_files.parse_record(item, "fuzz", 0)
        lines.extend(batch)

    parse_without_crashing()
    assert len(lines) >= FUZZ_RECORDS
    lines = lines[:FUZZ_RECORDS]
    source = tmp_path / "fuzz.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    prepared = preparation.prepare([source], resolve_target_path("bundled:tiny-random-llama"), tmp_path / "prepared",
                            max_length=256, log=lambda *_: None)
    report = prepared.report
    assert report["num_records"] == sum(1 for line in lines if line.strip())
    assert report["num_samples"] + report["num_skipped"] == report["num_records"]
    assert report["num_samples"] > 1000 and report["num_skipped"] > 1000, report["skipped_by_reason"]
    out = tmp_path / "run"
    assert cli.main(train_args(out, f"data.paths=[{tmp_path / 'prepared'}]", "data.limit=null",
                               "train.max_steps=3", "checkpoint.every=3")) == 0
    assert len(losses(out)) == 3 and all(v == v for v in losses(out).values())
