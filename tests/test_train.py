"""The trainer end to end on CPU with the tiny config: learning, exact resume after SIGTERM,
corrupted checkpoints, non-finite steps, export, and the embedded default."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, TINY, losses
from dflash_train.app import cli
from dflash_train.core import assets
from dflash_train.core.config import load_config
from dflash_train.core.drafter import DFlashDrafter
from dflash_train.train import control
from dflash_train.train.control import TrainingStopped
from dflash_train.train.loop import build, train_drafter
from dflash_train.train.step import LrSchedule


def train_cmd(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "dflash_train", "train", "--config", str(TINY),
            "--output-dir", str(out), *overrides]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """20 uninterrupted steps of the tiny config (log every step)."""
    out = tmp_path_factory.mktemp("reference")
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(out), "train.max_steps=20"]) == 0
    return out


def test_fifty_steps_lower_the_loss(tmp_path):
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(tmp_path)]) == 0
    curve = losses(tmp_path)
    assert len(curve) == 50
    first = sum(curve[s] for s in range(1, 6)) / 5
    last = sum(curve[s] for s in range(46, 51)) / 5
    assert last < 0.8 * first, (first, last)
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("step", "epoch", "loss", "lr", "grad_norm", "acc", "acc_per_position", "tau_estimate",
                "tokens_per_s", "samples_per_s", "avg_seq_len", "avg_max_seq_len", "avg_batch_size",
                "padding_efficiency", "skipped_steps", "peak_memory_gib", "stage_s"):
        assert key in record, key
    assert len(record["acc_per_position"]) == 7  # block 8 -> positions 1..7
    assert set(record["stage_s"]) >= {"target", "pack", "mask", "drafter_forward", "backward", "optimizer"}
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "drafter" / "model.safetensors").is_file()


@pytest.mark.slow
def test_sigterm_then_rerun_gives_identical_losses(reference_run, tmp_path):
    proc = subprocess.Popen(train_cmd(tmp_path, "train.max_steps=20"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    stop_after = 7 + int.from_bytes(os.urandom(1), "little") % 8  # a random step in 7..14
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= stop_after:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    assert "SIGTERM received" in output
    saved = sorted(int(p.name[5:]) for p in (tmp_path / "checkpoints").glob("step-*"))
    assert saved and saved[-1] >= stop_after and saved[-1] < 20, (saved, output)
    rerun = subprocess.run(train_cmd(tmp_path, "train.max_steps=20"), cwd=ROOT, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"resuming from {tmp_path / 'checkpoints' / f'step-{saved[-1]}'}" in rerun.stdout
    assert losses(tmp_path) == losses(reference_run)


def test_corrupted_newest_checkpoint_falls_back(tmp_path, capsys):
    out = tmp_path / "run"
    command = ["train", "--config", str(TINY), "--output-dir", str(out), "train.max_steps=10"]
    assert cli.main(command) == 0
    first = losses(out)
    newest = out / "checkpoints" / "step-10"
    weights = newest / "drafter.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    capsys.readouterr()
    assert cli.main(command) == 0  # the same command again: resumes from step 5, redoes 6..10
    said = capsys.readouterr().out
    assert f"skipping checkpoint {newest}: drafter.safetensors does not match its checksum" in said
    assert f"resuming from {out / 'checkpoints' / 'step-5'}" in said
    assert losses(out) == first and len(first) == 10


def poison_steps(run, monkeypatch, poisoned: set[int], watched: int = 4, on_result=None) -> dict:
    """Turn the loss of the 1-based optimizer steps in `poisoned` NaN; returns a dict that gets
    the drafter and optimizer state before and after step `watched` ("before", "after").
    `on_result(n, result)` sees every step's StepResult."""
    import dflash_train.train.step as step_module

    real_loss, real_step = step_module.block_loss, step_module.DrafterStep.__call__
    snapshots = {}

    def loss_with_nan(*args, **kwargs):
        out = real_loss(*args, **kwargs)
        if run.steps_done + 1 in poisoned:
            out.loss_sum = out.loss_sum * float("nan")
        return out

    def copy_state():
        return ({k: v.clone() for k, v in run.step.drafter.state_dict().items()},
                {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in s.items()}
                 for k, s in run.step.optimizer.state_dict()["state"].items()})

    def watched_step(self, batches):
        n = run.steps_done + 1
        if n == watched:
            snapshots["before"] = copy_state()
        result = real_step(self, batches)
        if n == watched:
            snapshots["after"] = copy_state()
        if on_result is not None:
            on_result(n, result)
        return result

    monkeypatch.setattr(step_module, "block_loss", loss_with_nan)
    monkeypatch.setattr(step_module.DrafterStep, "__call__", watched_step)
    return snapshots


def assert_unchanged(snapshots: dict) -> None:
    before, after = snapshots["before"], snapshots["after"]
    for k, v in before[0].items():
        assert torch.equal(v, after[0][k]), k
    for k, s in before[1].items():
        for n, t in s.items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(after[1][k][n])), (k, n)


def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path, monkeypatch):
    cfg = load_config(TINY, [f"output_dir={tmp_path}", "train.max_steps=20", "train.max_consecutive_skips=3"])
    run = build(cfg)
    snapshots = poison_steps(run, monkeypatch, {4, 6, 7, 8})  # optimizer steps (1-based) whose loss turns NaN
    with pytest.raises(TrainingStopped, match="3 consecutive non-finite steps"):
        train_drafter(run)
    assert_unchanged(snapshots)
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows[:8]] == [0, 0, 0, 1, 0, 1, 1, 1]
    assert (tmp_path / "checkpoints" / "step-8").is_dir()  # the last good state, saved on stop


def test_skip_decided_on_the_device_is_read_a_step_late(tmp_path, monkeypatch):
    """The fused AdamW's skip on the device (as one drafter rank on a GPU runs it; here the CPU's
    fused kernel): a non-finite step changes neither weights nor optimizer state, its flag is read
    at the next step (log, checkpoint and last steps at once), and the metrics and the stop count
    every skipped step; the non-finite stop comes at most one step late, with the streak that
    caused it."""
    cfg = load_config(TINY, [f"output_dir={tmp_path}", "train.max_steps=20", "train.max_consecutive_skips=3",
                             "log.every=5", "checkpoint.every=10"])
    run = build(cfg)
    step = run.step
    old = step.optimizer
    step.optimizer = torch.optim.AdamW(step.drafter.parameters(), lr=old.defaults["lr"], betas=old.defaults["betas"],
                                       eps=old.defaults["eps"], weight_decay=old.defaults["weight_decay"], fused=True)
    step.scheduler = torch.optim.lr_scheduler.LambdaLR(step.optimizer, step.scheduler.lr_lambdas[0])
    step.skip_on_device = True
    seen = []  # (step, flag ready when made, total_skipped as the step began)
    snapshots = poison_steps(run, monkeypatch, {4, 6, 7, 8}, on_result=lambda n, result: seen.append(
        (n, result.ready, run.control.total_skipped)))
    with pytest.raises(TrainingStopped, match="3 consecutive non-finite steps"):
        train_drafter(run)
    assert_unchanged(snapshots)
    assert all(not ready for _, ready, _ in seen)  # every flag stayed on the "device" when made
    # total_skipped as each step began: step 4's skip was counted at step 5 (a log step)
    assert [(n, total) for n, _, total in seen] == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 1), (7, 1),
                                                     (8, 2), (9, 3)]
    assert run.control.total_skipped == 4  # step 8's skip, read at step 9, where the run stopped
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped_steps"], r["skipped_total"]) for r in rows] == [(5, 1, 1), (9, 3, 4)]
    assert all(r["grad_norm"] == r["grad_norm"] for r in rows)  # skipped steps' NaN norms left out
    assert (tmp_path / "checkpoints" / "step-9").is_dir()


def test_export_loads_back_everywhere(reference_run, tmp_path):
    from transformers import AutoModel

    from dflash_train.train.checkpoint import drafter_from_checkpoint

    exported = reference_run / "drafter"
    drafter = DFlashDrafter.from_pretrained(exported)
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == drafter.target_layer_ids
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 4
    trained = drafter_from_checkpoint(reference_run / "checkpoints" / "step-20")
    for k, v in trained.state_dict().items():
        assert torch.equal(v.to(torch.bfloat16), drafter.state_dict()[k]), k
    hf = AutoModel.from_pretrained(exported, trust_remote_code=True)
    x = torch.randn(1, 6, len(drafter.target_layer_ids) * 64, dtype=torch.bfloat16)
    e = torch.randn(1, 8, 64, dtype=torch.bfloat16)
    pos = torch.arange(14)[None]
    with torch.no_grad():
        assert torch.equal(hf.to(torch.bfloat16)(x, e, pos), drafter(x, e, pos))
    assert cli.main(["export", "--checkpoint", str(reference_run / "checkpoints" / "step-20"),
                     "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (exported / "model.safetensors").read_bytes()


def test_config_errors_stop_before_heavy_work(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("drafter:\n  num_layer: 2\noptim:\n  lr: 0\ntrain:\n  epochs: many\n")
    assert cli.main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "num_layer" in err and "optim.lr" in err and "train.epochs" in err


@pytest.mark.slow
def test_embedded_default_short_run(tmp_path, smollm2_path, monkeypatch):
    """`dflash-train train` with no config (SmolLM2-135M on bundled ShareGPT), cut to 2 steps.
    The bundled file is cut to its first 400 KB (preparing all 17,671 chats costs a minute or
    more that the rest of the run does not need; test_data prepares such a cut through the same
    default path), and the asset cache is the test's own, holding the converted SmolLM2."""
    small = tmp_path / "sharegpt.json"
    small.write_bytes(assets.sharegpt_json().read_bytes()[:400_000])
    monkeypatch.setattr(assets, "sharegpt_json", lambda: small)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / smollm2_path.name).symlink_to(smollm2_path)
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(cache))
    run = tmp_path / "run"
    assert cli.main(["train", "--output-dir", str(run), "train.max_steps=2", "log.progress=false"]) == 0
    drafter = DFlashDrafter.from_pretrained(run / "drafter")
    assert drafter.config.hidden_size == 576 and drafter.target_layer_ids == [15]
    assert len(losses(run)) == 1 or 2 in losses(run)
    (prepared,) = (cache / "data").glob("sharegpt-*")  # the default data, prepared from the cut file
    assert json.loads((prepared / "report.json").read_text())["files"] == [str(small)]


@pytest.mark.slow
def test_compiled_drafter_layers_match_eager(reference_run, tmp_path):
    """train.compile=true (torch.compile of each drafter layer) trains the same run."""
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(tmp_path), "train.max_steps=20",
                     "train.compile=true"]) == 0
    compiled, eager = losses(tmp_path), losses(reference_run)
    assert compiled.keys() == eager.keys()
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-3), step


def test_finer_anchor_buckets_train_the_same_run(reference_run, tmp_path):
    """train.anchor_buckets_per_doubling=4 pads each row's blocks to other counts than powers
    of two; padding blocks see only themselves and carry no loss (and the loss reads only the
    real blocks' rows, here in lm_head chunks of 100 rows, not a whole number of 8-row blocks),
    so the run's losses are the reference's up to float rounding."""
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(tmp_path), "train.max_steps=20",
                     "train.anchor_multiple=1", "train.anchor_buckets_per_doubling=4",
                     "objective.lm_head_chunk_rows=100"]) == 0
    finer, pow2 = losses(tmp_path), losses(reference_run)
    assert finer.keys() == pow2.keys()
    for step in pow2:
        assert finer[step] == pytest.approx(pow2[step], rel=1e-4), step


def test_fp8_drafter_trains_close_to_full_precision_and_exports_the_same_weights(reference_run, tmp_path, capsys):
    """train.fp8=rowwise: every linear layer of the drafter runs its products in float8 (torchao,
    rowwise scales). 20 steps stay within a few percent of the reference's losses, and the
    export holds the same tensors under the same names, which transformers loads."""
    from safetensors import safe_open

    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(tmp_path), "train.max_steps=20",
                     "train.fp8=rowwise"]) == 0
    assert "train.fp8=rowwise: float8 matrix products in 8 linear layers of the drafter" in capsys.readouterr().out
    fp8, full = losses(tmp_path), losses(reference_run)
    assert fp8.keys() == full.keys()
    for step in full:
        assert fp8[step] == pytest.approx(full[step], rel=0.05), step
    assert fp8 != full  # the products did change
    with safe_open(tmp_path / "drafter" / "model.safetensors", "pt") as a, \
            safe_open(reference_run / "drafter" / "model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(a.get_tensor(k).dtype == b.get_tensor(k).dtype for k in a.keys())


def test_max_time_ends_the_run_at_a_step_boundary_with_a_checkpoint_and_export(tmp_path, capsys):
    """A 3 s pause after step 3 puts the run past train.max_time_s=1: it ends after step 4 at
    the latest (earlier on a slow machine), saves, exports and says why; the LR schedule is
    still the one of max_steps=20, so the LR has not decayed to zero."""
    rc = cli.main(["train", "--config", str(TINY), "--output-dir", str(tmp_path), "train.max_steps=20",
                   "train.max_time_s=1.0", "faults.delay_at_steps=[3]", "faults.delay_seconds=3.0",
                   "checkpoint.every=100"])
    assert rc == 0
    curve = losses(tmp_path)
    last = max(curve)
    assert 1 <= last <= 4
    assert (tmp_path / "checkpoints" / f"step-{last}").is_dir()
    assert (tmp_path / "drafter" / "model.safetensors").is_file()
    assert f"train.max_time_s=1 reached: the run ends at step {last} of 20" in capsys.readouterr().out
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == last and record["lr"] > 0.5 * load_config(str(TINY)).optim.lr
    from dflash_train.core.config import ConfigError
    with pytest.raises(ConfigError, match="train.max_time_s must be > 0"):
        load_config(str(TINY), ["train.max_time_s=0"])


def one_second_a_step(monkeypatch) -> list[float]:
    """Control's clock made to move one second a step (read by the returned list; set [0] to
    restart it), the schedule's pace measured from step 2 and first fitted 10 steps in."""
    clock = [0.0]
    monkeypatch.setattr(control, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(control, "FIT_FROM_STEPS", 2)
    monkeypatch.setattr(control, "FIT_AFTER_STEPS", 10)
    agree = control.Control.agree

    def step_and_tick(self, step, result=None):
        clock[0] += 1.0
        return agree(self, step, result)

    monkeypatch.setattr(control.Control, "agree", step_and_tick)
    return clock


def test_a_time_boxed_run_ends_its_schedule_where_its_time_runs_out(tmp_path, monkeypatch, capsys):
    """train.max_time_s with 400 steps that cannot fit (the fit's steps scaled down 5 times): 10
    steps into the run, the pace from step 2 on (1 s a step on a clock that moves one second a
    step) says that 9 more steps fit 95% of the 10 s left, so the cosine ends at step 19, and the
    run with it: its rate decayed, saved, exported, said. A run stopped by a signal at step 15 and
    resumed keeps that end and the same rates."""
    clock = one_second_a_step(monkeypatch)
    overrides = ["train.max_steps=400", "train.max_time_s=20", "optim.warmup_ratio=0.01", "checkpoint.every=100"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train_drafter(build(load_config(TINY, [f"output_dir={whole}", *overrides])))
    said = capsys.readouterr().out
    assert "the learning rate's schedule and the run now end at step 19 of 400" in said
    assert "step 19: the end of the learning rate's schedule fitted to train.max_time_s=20" in said
    records = {r["step"]: r for r in map(json.loads, (whole / "metrics.jsonl").read_text().splitlines())}
    assert max(records) == 19 and (whole / "drafter" / "model.safetensors").is_file()
    lr, fitted, planned = load_config(TINY).optim.lr, LrSchedule(400, 0.01, 0.0), LrSchedule(400, 0.01, 0.0)
    fitted.end = 19
    assert records[9]["lr"] == pytest.approx(lr * planned(9))  # the 400 steps' cosine until the fit
    for n in (10, 14, 18):  # the rate of step n + 1, set after step 10 from the fitted end
        assert records[n]["lr"] == pytest.approx(lr * fitted(n)) and records[n]["lr"] < 0.9 * lr * planned(n)
    assert records[19]["lr"] == 0.0

    first = build(load_config(TINY, [f"output_dir={resumed}", *overrides, "faults.sigterm_at_steps=[15]"]))
    train_drafter(first)
    assert first.steps_done == 15 and first.control.end == 19
    clock[0] = 0.0
    train_drafter(build(load_config(TINY, [f"output_dir={resumed}", *overrides])))
    again = {r["step"]: r for r in map(json.loads, (resumed / "metrics.jsonl").read_text().splitlines())}
    assert max(again) == 19 and [again[n]["lr"] for n in range(9, 20)] == [records[n]["lr"] for n in range(9, 20)]


def test_a_fitted_warmup_only_shortens_a_warmup_under_way_and_never_ends_before_the_next_step():
    schedule = LrSchedule(4300, 0.04, 0.0)  # 172 steps of warm-up
    assert schedule.fitted_warmup(3748, 50) == 150  # make train's fit: 4% of 3,748
    assert schedule.fitted_warmup(1000, 50) == 51 and schedule.fitted_warmup(1000, 10) == 40
    assert schedule.fitted_warmup(9000, 50) == 172  # a longer schedule never lengthens it
    assert schedule.fitted_warmup(100, 172) == 172 and schedule.fitted_warmup(100, 500) == 172  # warmed up


def test_a_schedule_fitted_while_it_warms_up_warms_up_over_its_share_of_the_fitted_steps(tmp_path, monkeypatch,
                                                                                          capsys):
    """A warm-up of half the schedule (200 of 400 steps) when the time box holds 57 steps: the fit
    after step 10 makes the cosine end at step 57 and the warm-up half of that (29 steps), so the
    rate peaks at step 29, not never; a run stopped at step 47 and resumed (its own time box then
    ends it before it fits again) keeps that warm-up and gives the same rates."""
    clock = one_second_a_step(monkeypatch)
    overrides = ["train.max_steps=400", "train.max_time_s=60", "optim.warmup_ratio=0.5", "checkpoint.every=100"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train_drafter(build(load_config(TINY, [f"output_dir={whole}", *overrides])))
    assert "the learning rate's schedule and the run now end at step 57 of 400, its warm-up at step 29" in \
        capsys.readouterr().out
    records = {r["step"]: r for r in map(json.loads, (whole / "metrics.jsonl").read_text().splitlines())}
    lr, planned, fitted = load_config(TINY).optim.lr, LrSchedule(400, 0.5, 0.0), LrSchedule(400, 0.5, 0.0)
    fitted.end, fitted.warmup = 57, 29
    assert max(records) == 57 and records[9]["lr"] == pytest.approx(lr * planned(9))
    assert all(records[n]["lr"] == pytest.approx(lr * fitted(n)) for n in range(10, 58))
    assert records[28]["lr"] == pytest.approx(lr) and records[57]["lr"] == 0.0
    assert max(r["lr"] for r in records.values()) > 0.99 * lr > 0.5 * lr > lr * planned(56)

    first = build(load_config(TINY, [f"output_dir={resumed}", *overrides, "faults.sigterm_at_steps=[47]"]))
    train_drafter(first)
    assert first.steps_done == 47 and (first.control.end, first.control.warmup) == (57, 29)
    clock[0] = 0.0
    train_drafter(build(load_config(TINY, [f"output_dir={resumed}", *overrides])))
    again = {r["step"]: r for r in map(json.loads, (resumed / "metrics.jsonl").read_text().splitlines())}
    assert max(again) == 57 and [again[n]["lr"] for n in range(9, 58)] == [records[n]["lr"] for n in range(9, 58)]


def test_the_fit_to_time_takes_the_slowest_drafter_ranks_pace_and_gives_the_schedule_back(monkeypatch):
    """Control.fit_to_time alone: the pace agreed over the drafter ranks is the slowest (max); a
    later fit, at a faster pace, gives the schedule its own end back when its steps fit again;
    without a time box or with train.fit_schedule_to_time=false nothing is fitted."""
    from dflash_train.core.config import TrainSection

    clock = [0.0]
    monkeypatch.setattr(control, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def slower_rank(tensors, what, op):  # another drafter rank at twice this one's pace
        assert op == "max" and "pace" in what
        tensors[0].mul_(2.0)

    dist = SimpleNamespace(device=torch.device("cpu"), all_reduce_drafters=slower_rank)
    fitted = control.Control(TrainSection(max_time_s=1000.0), dist, micro_per_step=1)
    fitted.deadline = 1000.0
    ends = {}
    for step in range(1, 552):
        clock[0] = step * (1.0 if step <= 50 else 0.25)  # 1 s a step, then 0.25 s (then 2 and 0.5 agreed)
        ends[step] = fitted.fit_to_time(step, total_steps=700)
    assert {s: e for s, e in ends.items() if e is not None} == {50: 50 + int(0.95 * 950 / 2.0), 550: 700}
    assert fitted.end is None  # the schedule's own end again
    for section in (TrainSection(), TrainSection(max_time_s=1000.0, fit_schedule_to_time=False),
                    TrainSection(max_time_s=1000.0)):  # the last: its clock not started (no `with`)
        plain = control.Control(section, dist, micro_per_step=1)
        assert all(plain.fit_to_time(step, 700) is None for step in range(1, 60)) and plain.end is None


@pytest.mark.parametrize("options", [("objective.labels=distill", "topology.split_fc=true"),
                                     ("objective.weighting=dpace", "objective.dpace_alpha=0.3")])
def test_objective_options_train_finite_and_resume_exactly(options, tmp_path, capsys):
    """A few steps with each objective lever (distillation from the target's distribution, with
    the fc concat on the drafter side; D-PACE weights) stay finite, and resumed from the
    checkpoint of step 2 the run logs the uninterrupted run's losses again, bit for bit."""
    import shutil

    args = ["train", "--config", str(TINY), "--output-dir", str(tmp_path), "train.max_steps=4",
            "checkpoint.every=2", *options]
    assert cli.main(args) == 0
    uninterrupted = losses(tmp_path)
    assert len(uninterrupted) == 4 and all(torch.isfinite(torch.tensor(v)) for v in uninterrupted.values())
    shutil.rmtree(tmp_path / "checkpoints" / "step-4")
    capsys.readouterr()
    assert cli.main(args) == 0
    assert f"resuming from {tmp_path / 'checkpoints' / 'step-2'}" in capsys.readouterr().out
    assert losses(tmp_path) == uninterrupted


def test_loop_tails_skip_unsupervises_training_loops_past_three_periods_and_keeps_validation(tmp_path):
    """objective.loop_tails=skip: a training reply that ends in a loop (or in a loop and one
    closing token) keeps its text and the loop's first 3 periods supervised (and the closing
    token), the rest of the loop stays as context but unsupervised; a reply without a loop and
    the validation split are untouched."""
    import numpy as np
    from datasets import Dataset

    from dflash_train.data import preparation
    from dflash_train.train.loop import split_data

    prose = list(range(100, 140))
    looping = [1, 9, 9] + prose + [5, 6, 7] * 20  # prompt (3) + reply: 40 prose + a loop of period 3
    closed = looping + [2]  # the same reply closed by an end token
    plain = [1, 9, 9] + list(range(200, 290))
    rows = [looping, closed, plain] * 4
    masks = [[0] * 3 + [1] * (len(r) - 3) for r in rows]
    dataset = Dataset.from_dict({"input_ids": rows, "loss_mask": masks, "length": [len(r) for r in rows],
                                 "conversation": [f"c{i}" for i in range(len(rows))],
                                 "source": [f"f:{i}" for i in range(len(rows))]})
    expected = {len(looping): list(range(3, 52)), len(closed): list(range(3, 52)) + [len(closed) - 1],
                len(plain): list(range(3, len(plain)))}
    lines = []
    cfg = load_config(TINY, [f"output_dir={tmp_path}", "objective.loop_tails=skip", "data.validation=2"])
    train, validation = split_data(cfg, dataset, log=lines.append)
    for row in train:
        assert np.flatnonzero(row["loss_mask"]).tolist() == expected[len(row["input_ids"])]
    assert all(sum(row["loss_mask"]) == len(row["input_ids"]) - 3 for row in validation)
    looped = sum(len(row["input_ids"]) != len(plain) for row in train)
    assert any(f"objective.loop_tails=skip: {51 * looped} of " in line for line in lines), lines
    assert train.features == dataset.features
    assert preparation.skip_loop_tails(looping, masks[0])[1] == 51
    kept, _ = split_data(load_config(TINY, [f"output_dir={tmp_path}", "data.validation=2"]), dataset, log=lambda *_: None)
    assert all(sum(row["loss_mask"]) == len(row["input_ids"]) - 3 for row in kept)
