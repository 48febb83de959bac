"""Disaggregated and data-parallel runs under torchrun on CPU (gloo): the assignment of micro-
batches, the same losses as a single process over the same batches, SIGTERM to one rank then an
exact resume, a resume on another topology of the same global batch (and the refusal of another
batch), and a rank that dies (SIGKILL) or hangs making the others exit with a message."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, TINY, losses, subprocess_env
from dflash_train.app import cli
from dflash_train.core.config import ConfigError, load_config
from dflash_train.train.dist import Assignment, Dist

STEPS = 10  # room for the stops after step 7 below, and two log intervals of 5 (INTERVAL)


def torchrun(out: Path, nproc: int, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "dflash_train", "train", "--config", str(TINY), "--output-dir", str(out),
            f"train.max_steps={STEPS}", "train.num_threads=1", *overrides]


ENV = subprocess_env(OMP_NUM_THREADS="1")
DISAGG = ("topology.mode=disaggregated", "topology.num_target_ranks=1")


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, grad_accum 2: the batches and micro-batch indices that 2 drafter ranks with
    grad_accum 1, or 1 drafter rank with grad_accum 2, consume."""
    out = tmp_path_factory.mktemp("reference")
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(out), f"train.max_steps={STEPS}",
                     "train.grad_accum=2"]) == 0
    return losses(out)


# Logs every 5 steps and a stop after step 7: the checkpoint falls inside a log interval, so the
# resumed run's first record sums metrics of both topologies.
INTERVAL = ("log.every=5", "checkpoint.every=100")


@pytest.fixture(scope="module")
def interval_reference(tmp_path_factory):
    """The reference run, logged every 5 steps."""
    out = tmp_path_factory.mktemp("interval-reference")
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(out), f"train.max_steps={STEPS}",
                     "train.grad_accum=2", *INTERVAL]) == 0
    return losses(out)


def assert_close_losses(got: dict[int, float], want: dict[int, float]) -> None:
    """The same steps logged, each loss within 1e-5 (relative): summation order may differ."""
    assert sorted(got) == sorted(want)
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-5 * max(1.0, abs(loss)), (step, got[step], loss)


# --------------------------------------------------------------------------- pure parts


@settings(max_examples=60, deadline=None)
@given(targets=st.integers(1, 5), drafters=st.integers(1, 4), accum=st.integers(1, 3), colocated=st.booleans())
def test_assignment_covers_every_micro_batch_once(targets, drafters, accum, colocated):
    if colocated:
        targets = drafters
    a = Assignment(targets, drafters, accum, colocated)
    for step in range(4):
        consumed = sorted(g for d in range(drafters) for g in a.consumed(step, d))
        produced = sorted(g for t in range(targets) for g in a.produced(step, t))
        assert consumed == produced == list(range(step * a.micro_per_step, (step + 1) * a.micro_per_step))
        for d in range(drafters):
            assert [a.slot(g) for g in a.consumed(step, d)] == list(range(accum))
            assert all(a.consumer(g) == d for g in a.consumed(step, d))
        if colocated:
            assert all(a.producer(g) == a.consumer(g) for g in consumed)


def test_topology_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="topology.num_target_ranks must be >= 1"):
        load_config(TINY, ["topology.mode=disaggregated"])
    with pytest.raises(ConfigError, match="for topology.mode=disaggregated only"):
        load_config(TINY, ["topology.num_target_ranks=1"])
    with pytest.raises(ConfigError, match="topology.queue_depth must be > 0"):
        load_config(TINY, ["topology.queue_depth=0"])
    cfg = load_config(TINY, list(DISAGG))
    with pytest.raises(ConfigError, match="launch with torchrun"):
        Dist.from_env(cfg.topology, "cpu")  # world size 1
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    cfg = load_config(TINY, ["topology.mode=disaggregated", "topology.num_target_ranks=3"])
    with pytest.raises(ConfigError, match="leaves no drafter rank on a node of 3 ranks"):
        Dist.from_env(cfg.topology, "cpu")


# --------------------------------------------------------------------------- torchrun runs


@pytest.mark.slow
def test_one_target_two_drafters_equal_one_process(reference, tmp_path):
    done = run(torchrun(tmp_path, 3, *DISAGG))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert abs(got[step] - loss) <= 1e-5 * max(1.0, abs(loss)), (step, got[step], loss)
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(last["wait_s"]["drafter_recv"]) == 2 and len(last["wait_s"]["target_send"]) == 1
    ckpt = tmp_path / "checkpoints" / f"step-{STEPS}"
    assert {f"rank-{r}.json" for r in range(3)} <= {p.name for p in ckpt.iterdir()}
    assert (tmp_path / "drafter" / "model.safetensors").is_file()


@pytest.mark.slow
def test_colocated_two_ranks_are_data_parallel_over_the_same_batches(reference, tmp_path):
    """Colocated on 2 ranks: each a target + drafter replica on its own micro-batches, gradients
    summed over ranks: the losses of one process with grad_accum 2."""
    done = run(torchrun(tmp_path, 2))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert abs(got[step] - loss) <= 1e-5 * max(1.0, abs(loss)), (step, got[step], loss)
    assert {f"rank-{r}.json" for r in range(2)} <= {p.name for p in (tmp_path / "checkpoints" / f"step-{STEPS}").iterdir()}


@pytest.mark.slow
def test_two_targets_split_fc_sigterm_to_one_rank_then_exact_resume(reference, tmp_path):
    """2 targets + 1 drafter (grad_accum 2), the fc concat and noise on the drafter side; target
    rank 1 gets SIGTERM after producing step 7: every rank stops at one step, a checkpoint is
    written, and the rerun's losses equal the single-process run's."""
    setup = ("topology.mode=disaggregated", "topology.num_target_ranks=2", "topology.split_fc=true",
             "train.grad_accum=2", "checkpoint.every=100")
    first = run(torchrun(tmp_path, 3, *setup, "faults.sigterm_at_steps=[7]", "faults.on_ranks=[1]"))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "a signal to another rank received: the run stopped after step" in first.stdout
    assert "the same command resumes from it: the same torchrun launch of -m dflash_train train" in first.stdout
    saved = sorted(int(p.name[5:]) for p in (tmp_path / "checkpoints").glob("step-*"))
    assert len(saved) == 1 and 1 <= saved[0] <= 7, saved
    assert not (tmp_path / "drafter").exists()
    second = run(torchrun(tmp_path, 3, *setup))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"resuming from {tmp_path / 'checkpoints' / f'step-{saved[0]}'}" in second.stdout
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert abs(got[step] - loss) <= 1e-5 * max(1.0, abs(loss)), (step, got[step], loss)


def worker_pids(launcher: int) -> dict[int, int]:
    """RANK -> pid of torchrun's worker processes."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    ranks = {}
    for pid in map(int, children):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = [e for e in env if e.startswith(b"RANK=")]
        if rank:
            ranks[int(rank[0][5:])] = pid
    return ranks


@pytest.mark.slow
def test_sigkilled_rank_makes_the_others_exit_with_a_message(tmp_path):
    proc = subprocess.Popen(torchrun(tmp_path, 3, *DISAGG, "topology.timeout_s=30"), cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (tmp_path / "metrics.jsonl").exists() and len((tmp_path / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    os.kill(worker_pids(proc.pid)[2], signal.SIGKILL)  # drafter 1
    killed = time.time()
    output, _ = proc.communicate(timeout=120)
    elapsed = time.time() - killed
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    assert "gave up" in output and "another rank died or hung" in output, output[-3000:]
    assert any(f"rank {r} (" in line and "gave up" in line for r in (0, 1) for line in output.splitlines()), output[-3000:]


@pytest.mark.slow
def test_hanging_rank_makes_the_others_exit_with_a_message(tmp_path):
    """The target rank sleeps 15 s after producing step 4 (faults.delay_at_steps); with
    topology.timeout_s=4 both drafter ranks give up, name what they waited for, and exit."""
    started = time.time()
    done = run(torchrun(tmp_path, 3, *DISAGG, "topology.timeout_s=4", "faults.delay_at_steps=[4]",
                        "faults.delay_seconds=15", "faults.on_ranks=[0]"), timeout=120)
    elapsed = time.time() - started
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert elapsed < 60 + 30, elapsed  # start-up included; the waits themselves are 4 s
    for rank in (1, 2):
        line = next((l for l in output.splitlines() if f"rank {rank} (drafter {rank - 1}): gave up" in l), None)
        assert line is not None and "topology.timeout_s=4" in line, output[-3000:]


# --------------------------------------------------------------------------- another topology


def stopped_after_step_7(out: Path, nproc: int, *setup: str) -> None:
    """A torchrun run stopped by SIGTERM after step 7 (faults on the drafter ranks `on_ranks`),
    which writes the checkpoint of step 7."""
    *setup, on_ranks = setup
    done = run(torchrun(out, nproc, *setup, *INTERVAL, "faults.sigterm_at_steps=[7]", on_ranks))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == ["step-7"]


@pytest.mark.slow
def test_two_colocated_ranks_resume_on_one_process_with_grad_accum_2(interval_reference, tmp_path, capsys):
    """Saved by 2 colocated ranks (grad_accum 1), resumed by one process with grad_accum 2: the
    same 2 micro-batches per step, so the losses of an uninterrupted run."""
    stopped_after_step_7(tmp_path, 2, "faults.on_ranks=[0, 1]")
    capsys.readouterr()
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(tmp_path), f"train.max_steps={STEPS}",
                     "train.grad_accum=2", *INTERVAL]) == 0
    said = capsys.readouterr().out
    assert f"resuming from {tmp_path / 'checkpoints' / 'step-7'}" in said
    assert "resumed at step 7 (epoch 0, batch 14); it was saved by a run of" in said
    assert_close_losses(losses(tmp_path), interval_reference)


@pytest.mark.slow
def test_one_target_two_drafters_resume_on_one_drafter_with_grad_accum_2(interval_reference, tmp_path):
    """Saved by 1 target + 2 drafter ranks, resumed by 1 target + 1 drafter with grad_accum 2."""
    stopped_after_step_7(tmp_path, 3, *DISAGG, "faults.on_ranks=[1, 2]")
    second = run(torchrun(tmp_path, 2, *DISAGG, "train.grad_accum=2", *INTERVAL))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"resuming from {tmp_path / 'checkpoints' / 'step-7'}" in second.stdout
    assert_close_losses(losses(tmp_path), interval_reference)


def test_resume_with_another_global_batch_is_refused_naming_the_numbers_and_the_fix(tmp_path, capsys):
    from datasets import Dataset

    from dflash_train.data.batching import BatchPlan, BatchStream
    from dflash_train.train.checkpoint import CheckpointError, DataPosition

    args = ["train", "--config", str(TINY), "--output-dir", str(tmp_path), "train.max_steps=2", "train.grad_accum=2"]
    assert cli.main(args) == 0
    capsys.readouterr()
    assert cli.main([*args[:-1], "train.grad_accum=3"]) == 2  # bad input (errors.py)
    err = capsys.readouterr().err
    assert (f"{tmp_path / 'checkpoints' / 'step-2'}: saved by a run of 1 drafter rank(s) x train.grad_accum=2 = 2 "
            f"micro-batches per step, but this run takes 1 x 3 = 3") in err
    assert "set train.grad_accum=2 for 1 drafter rank;" in err and "another output_dir" in err
    # Three drafter ranks cannot make 2 micro-batches a step: the fix says what can.
    dataset = Dataset.from_dict({"input_ids": [[1] * 5], "loss_mask": [[1] * 5], "length": [5]})
    stream = BatchStream(dataset, BatchPlan([5], token_budget=8, boundaries=[8]))
    position = DataPosition(stream, Assignment(1, 3, 1, False))
    with pytest.raises(CheckpointError, match="launch a number of drafter ranks that divides 2 and set "
                                              "train.grad_accum to 2 divided by it"):
        position.check(tmp_path, {"micro_per_step": 2}, {"num_drafters": 2, "grad_accum": 1}, 0)


@pytest.mark.slow
def test_distillation_through_transport_equals_one_process(tmp_path):
    """objective.labels=distill, 1 target + 1 drafter, split fc layers: the target's final state
    travels with each shipment, and the losses are those of one process."""
    options = ("objective.labels=distill", "train.max_steps=4")
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(tmp_path / "one"), *options]) == 0
    done = run([*torchrun(tmp_path / "two", 2, *DISAGG, "topology.split_fc=true", *options)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_close_losses(losses(tmp_path / "two"), losses(tmp_path / "one"))
