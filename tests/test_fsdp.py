"""A sharded drafter (train.fsdp, FSDP2) on CPU with gloo: 2 sharded ranks give the losses of one
process with grad_accum 2; one process under FSDP trains the very weights of one without it and
resumes an unsharded checkpoint; a SIGTERM under FSDP resumes on one process without it; a
failed micro-batch on one rank keeps the ranks' collectives in step; the export of a sharded run
is the export of its weights read whole; the bench runs with it; and the settings it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY, losses
from dflash_train.app import cli
from dflash_train.core.config import ConfigError, load_config
from dflash_train.core.export import export_drafter
from dflash_train.train.checkpoint import drafter_from_checkpoint
from test_dist import STEPS, assert_close_losses, run, torchrun

FSDP = "train.fsdp=true"


def train_here(out: Path, *overrides: str) -> None:
    """One process (this one) on the tiny config for STEPS steps."""
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(out), f"train.max_steps={STEPS}",
                     *overrides]) == 0


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    """One process without FSDP, grad_accum 2: the micro-batches 2 ranks take together."""
    out = tmp_path_factory.mktemp("reference")
    train_here(out, "train.grad_accum=2")
    return out


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    """2 colocated ranks under FSDP (torchrun, gloo), grad_accum 1."""
    out = tmp_path_factory.mktemp("sharded")
    done = run(torchrun(out, 2, FSDP))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def tensors_equal(folder_a: Path, folder_b: Path) -> bool:
    """The same tensor names, dtypes, shapes and bytes in two drafter folders' model.safetensors."""
    a, b = (load_file(str(f / "model.safetensors")) for f in (folder_a, folder_b))
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- settings


def test_settings_fsdp_cannot_run_with_are_refused_naming_the_fix(monkeypatch):
    assert load_config(TINY).train.fsdp is False  # the replicated drafter stays the default
    assert load_config(TINY, [FSDP]).train.fsdp is True
    with pytest.raises(ConfigError, match="train.fsdp: expected true or false"):
        load_config(TINY, ["train.fsdp=sharded"])
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="train.fsdp=true needs torch.distributed, which this torch build "
                                          "lacks: .* or set train.fsdp=false"):
        load_config(TINY, [FSDP])


# --------------------------------------------------------------------------- torchrun runs


@pytest.mark.slow
def test_two_sharded_ranks_equal_one_process_with_grad_accum_2(reference_run, sharded_run):
    assert_close_losses(losses(sharded_run), losses(reference_run))
    saved = sharded_run / "checkpoints" / f"step-{STEPS}"
    names = {p.name for p in saved.iterdir()}
    assert "sharded" in names and not names & {"drafter.safetensors", "optimizer.pt"}
    listed = json.loads((saved / "meta.json").read_text())["files"]  # every shard has its checksum
    assert {"sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= set(listed)


@pytest.mark.slow
def test_sharded_export_equals_the_export_of_its_weights_read_whole(sharded_run, tmp_path):
    """The leader's export (weights gathered from both ranks) is, byte for byte, the export of
    the last checkpoint's weights read whole in this process (no FSDP, no process group)."""
    whole = drafter_from_checkpoint(sharded_run / "checkpoints" / f"step-{STEPS}")
    export_drafter(whole, tmp_path / "whole")
    assert tensors_equal(sharded_run / "drafter", tmp_path / "whole")
    assert (sharded_run / "drafter" / "config.json").read_text() == (tmp_path / "whole" / "config.json").read_text()


@pytest.mark.slow
def test_sigterm_under_fsdp_then_resume_on_one_process_without_it(reference_run, tmp_path, capsys):
    """SIGTERM to both sharded ranks after step 7: a sharded checkpoint of step 7; one process
    without FSDP (grad_accum 2: the same global batch) continues with the uninterrupted losses."""
    done = run(torchrun(tmp_path, 2, FSDP, "checkpoint.every=100", "faults.sigterm_at_steps=[7]"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    saved = tmp_path / "checkpoints" / "step-7"
    assert [p.name for p in (tmp_path / "checkpoints").glob("step-*")] == ["step-7"]
    assert (saved / "sharded").is_dir() and not (tmp_path / "drafter").exists()
    capsys.readouterr()
    train_here(tmp_path, "train.grad_accum=2", "checkpoint.every=100")
    said = capsys.readouterr().out
    assert f"resuming from {saved}" in said and "train.fsdp True -> False" in said
    assert_close_losses(losses(tmp_path), losses(reference_run))


@pytest.mark.slow
def test_failed_micro_batch_on_one_sharded_rank_keeps_the_ranks_in_step(tmp_path):
    """The target fails on rank 1's micro-batches of step 3 (grad_accum 2): that rank runs the
    zero micro-batch in their place, so both ranks' gathers and reductions still meet; the
    losses are those of the replicated drafter with the same failure."""
    faults = ("train.grad_accum=2", "train.max_steps=4", "faults.target_error_at_steps=[3]", "faults.on_ranks=[1]")
    for name, extra in (("sharded", (FSDP,)), ("replicated", ())):
        done = run(torchrun(tmp_path / name, 2, *faults, *extra))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step 3: target forward failed" in done.stdout
    assert_close_losses(losses(tmp_path / "sharded"), losses(tmp_path / "replicated"))


# --------------------------------------------------------------------------- one process


@pytest.mark.slow
def test_one_process_resumes_an_unsharded_checkpoint_under_fsdp_to_the_same_weights(reference_run, tmp_path,
                                                                                     capsys):
    """Stopped without FSDP after step 4, resumed under FSDP in one process (a process group of
    its own): the same losses and, byte for byte, the same exported weights as the run never
    sharded (one rank: nothing is summed in another order)."""
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(tmp_path), f"train.max_steps={STEPS}",
                     "train.grad_accum=2", "faults.sigterm_at_steps=[4]"]) == 0
    assert not (tmp_path / "checkpoints" / "step-4" / "sharded").exists()
    capsys.readouterr()
    train_here(tmp_path, "train.grad_accum=2", FSDP)
    said = capsys.readouterr().out
    assert "train.fsdp: the drafter, its gradients and its optimizer state sharded over 1 drafter rank" in said
    assert losses(tmp_path) == losses(reference_run)
    assert tensors_equal(tmp_path / "drafter", reference_run / "drafter")
    assert (tmp_path / "checkpoints" / f"step-{STEPS}" / "sharded").is_dir()
    assert not torch.distributed.is_initialized()  # its process group is gone with the run


def test_checkpoint_before_the_first_optimizer_step_resumes_as_without_fsdp(tmp_path):
    """Steps 1 and 2 skipped as non-finite, the run stopped with a sharded checkpoint holding no
    AdamW state yet: resumed without FSDP, the first real step is AdamW's first, as in a run
    never stopped."""
    nan = ("train.max_steps=5", "faults.nan_at_steps=[1, 2]")
    train_here(tmp_path / "whole", *nan)
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(tmp_path / "stopped"), *nan,
                     "train.max_consecutive_skips=2", FSDP]) == 1  # the skip limit stops it after step 2
    assert (tmp_path / "stopped" / "checkpoints" / "step-2" / "sharded").is_dir()
    train_here(tmp_path / "stopped", "train.max_steps=5")
    resumed, whole = losses(tmp_path / "stopped"), losses(tmp_path / "whole")
    assert [resumed[s] for s in (3, 4, 5)] == [whole[s] for s in (3, 4, 5)]


def test_bench_runs_with_a_sharded_drafter(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--workload", "tiny", "--steps", "2", "--warmup", "1", "--output", str(out),
                     FSDP]) == 0
    report = json.loads(out.read_text())
    assert report["overrides"] == [FSDP] and report["skipped_steps"] == 0 and report["samples"] > 0
    assert not torch.distributed.is_initialized()
