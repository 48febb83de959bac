"""The benchmark: `dflash-train bench --workload tiny` end to end on CPU, the useful-FLOP formula
on hand-computed numbers, the visible-pair count against a brute-force count of the mask rule,
the work counted from a real training step, and the GPU-idle interval union."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import ROOT, random_packed_row, subprocess_env, tiny_target_config
from dflash_train.app import cli
from dflash_train.bench import decoding, flops, harness, profile, workloads
from dflash_train.core.config import load_config
from dflash_train.core.masks import build_layout, dense_mask, packed_anchor_count, sample_anchors, step_generator


def real_anchor_count(loss_mask_bL: torch.Tensor, lengths_b: torch.Tensor, num_anchors: int) -> int:
    """Reference: the anchors `masks.sample_anchors` draws for a padded batch, per sample
    min(num_anchors, positions p with p and p + 1 supervised)."""
    total = 0
    for row, n in zip(loss_mask_bL.numpy(), lengths_b.tolist()):
        m = row[:n].astype(bool)
        total += min(num_anchors, int((m[:-1] & m[1:]).sum()))
    return total

REPORT_KEYS = {"workload", "samples_per_s", "target_tokens_per_s", "stage_s", "stage_share", "mfu",
               "flops_per_sample", "peak_memory_gib", "gpu_idle_share", "step_s", "steps", "device",
               "torch_version", "date", "overrides"}
STAGES = {"data", "target", "pack", "mask", "drafter_forward", "backward", "optimizer"}


def test_bench_tiny_prints_one_json_line_last(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--workload", "tiny", "--steps", "2", "--warmup", "1", "--output", str(out),
                     "objective.noise=none"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert json.loads(out.read_text()) == report
    assert REPORT_KEYS <= set(report)
    assert report["workload"] == "tiny" and report["steps"] == 2 and report["warmup_steps"] == 1
    assert report["overrides"] == ["objective.noise=none"]
    assert report["samples_per_s"] > 0 and report["target_tokens_per_s"] > 0
    assert report["target_padded_tokens_per_s"] >= report["target_tokens_per_s"]
    assert set(report["stage_s"]) == STAGES
    assert all(v >= 0 for v in report["stage_s"].values())
    assert sum(report["stage_share"].values()) == pytest.approx(1.0, abs=1e-6)
    # The stages tile the step: their sum is the measured step time (up to clock overhead).
    assert sum(report["stage_s"].values()) == pytest.approx(report["step_s"], rel=0.05)
    per_sample = report["flops_per_sample"]
    assert {"target_forward", "drafter_forward", "drafter_backward", "lm_head", "total"} <= set(per_sample)
    assert all(per_sample[k] > 0 for k in per_sample)
    assert per_sample["total"] == pytest.approx(sum(v for k, v in per_sample.items() if k != "total"))
    assert report["mfu"] is None and report["gpu_idle_share"] is None  # CPU: no peak, no profiler window
    assert report["skipped_steps"] == 0 and report["compiles_during_timing"] == 0
    assert report["peak_memory_gib"] > 0 and report["device"] == "cpu"
    assert any(line.startswith("samples/s") for line in lines[:-1])


def test_bench_with_skipped_steps_fails_and_says_so(tmp_path, capsys):
    """A timed step skipped as non-finite (here an injected NaN loss) makes the bench exit 1 with
    the reason on stderr; its report is still written, with the count."""
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--workload", "tiny", "--steps", "1", "--warmup", "0", "--output", str(out),
                     "faults.nan_at_steps=[1]"]) == 1
    err = capsys.readouterr().err
    assert "bench: 1 of 1 timed steps were skipped as non-finite" in err
    assert "faults.nan_at_steps=[1]" in err
    assert json.loads(out.read_text())["skipped_steps"] == 1


def test_bench_of_a_training_workload_on_a_target_folders_shape(tmp_path, capsys):
    """`bench --workload NAME --target DIR`: the random target (and the drafter built on it) take
    DIR's shape from its config.json; the report names the folder among its overrides."""
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    tiny_target_config(hidden_size=48, num_hidden_layers=3, vocab_size=300).to_json_file(str(folder / "config.json"))
    run, config = harness.build_run("tiny", [f"target.path={folder}", "drafter.mask_token_id=299"])
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (48, 3, 300)
    assert run.step.drafter.config.hidden_size == 48
    assert cli.main(["bench", "--workload", "tiny", "--target", str(folder), "--steps", "1", "--warmup", "0",
                     "drafter.mask_token_id=299"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["overrides"] == ["drafter.mask_token_id=299", f"target.path={folder}"]
    assert cli.main(["bench", "--workload", "tiny", "--target", str(tmp_path / "nothing")]) == 2
    assert "target.path" in capsys.readouterr().err


def test_bench_refuses_bad_input_naming_the_field(capsys):
    assert cli.main(["bench", "--workload", "tiny", "drafter.mask_token_id=null"]) == 2
    assert "drafter.mask_token_id" in capsys.readouterr().err
    assert cli.main(["bench", "--workload", "tiny", "objective.num_anchors=0"]) == 2
    assert "objective.num_anchors must be > 0" in capsys.readouterr().err
    assert cli.main(["bench", "--workload", "tiny", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    assert cli.main(["bench", "--workload", "tiny", "--drafter-only", "objective.labels=target"]) == 2
    assert "--drafter-only" in capsys.readouterr().err


def test_useful_flops_on_hand_computed_numbers():
    shape = flops.Shape(hidden=4, intermediate=6, heads=2, kv_heads=1, head_dim=2, vocab=10)
    # q,o: 2 * 4*2*2 = 32; gate, up, down: 3 * 4*6 = 72; k,v: 2 * 4*1*2 = 16; per pair 4*2*2 = 16.
    assert (shape.qo_mlp_params, shape.kv_params, shape.pair_flops) == (104, 16, 16)
    work = flops.WorkCount(samples=2, sample_lengths=[2, 3], context_tokens=5, block_rows=8,
                           attention_pairs=20, loss_rows=6)
    counted = flops.useful_flops(work, shape, target_layers=3, target_lm_head=False, drafter=shape,
                                 drafter_layers=2, num_taps=3)
    # target, per layer: linears 2*(104+16)*5 = 1200, causal pairs 16*(3+6) = 144; 3 layers.
    assert counted["target_forward"] == 3 * (1200 + 144)
    # drafter: fc 2*(3*4)*4*5 = 480; per layer 2*104*8 + 2*16*(5+8) = 2080, 2 layers; pairs 16*20.
    assert counted["drafter_forward"] == 480 + 2 * 2080 + 320
    # backward: twice the layers and attention, fc's weight gradient once.
    assert counted["drafter_backward"] == 2 * (4160 + 320) + 480
    assert counted["lm_head"] == 4 * 4 * 10 * 6  # forward + input gradient on 6 loss rows
    with_head = flops.useful_flops(work, shape, 3, True, shape, 2, 3)
    assert with_head["target_forward"] == 3 * 1344 + 2 * 4 * 10 * 5
    assert flops.useful_flops(work, shape, 3, False, shape, 2, 3, target_ran=False)["target_forward"] == 0


@pytest.mark.parametrize("window", [None, 5, 12])
def test_visible_pairs_equal_a_brute_force_count_of_the_mask(window):
    B = 4
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        lengths, loss_mask = random_packed_row(gen, 4, max_len=20, pad=3)
        anchors = sample_anchors(loss_mask, lengths, 5, step_generator(seed, 0), pad_to_multiple=8)
        layout = build_layout(anchors, loss_mask, lengths, B)
        Q = layout.num_blocks * B
        mask = dense_mask(layout.mask_mod(window), Q, layout.num_ctx + Q, "cpu")
        real = int((anchors >= 0).sum())
        brute = sum(int(mask[q].sum()) for q in range(real * B))  # rows of real blocks only
        assert int(layout.visible_pairs(window)) == brute, (seed, window)


@pytest.mark.parametrize("shipped_count", [True, False], ids=["shipped-count", "counted-from-mask"])
def test_work_counted_from_a_real_step_matches_the_step_itself(shipped_count):
    """The counter sees only the drafter's inputs and the shipments; compare it with what
    the step really built: the dense mask (CPU) and the anchors sample_anchors drew. The anchor
    count is the one the shipment carries, or counted from its loss mask where it has none."""
    from dflash_train.train.loop import take_step

    def without_count(shipments):
        for s in shipments:
            s.anchor_count = None
            yield s

    run, _ = harness.build_run("tiny", ["objective.noise=none"], log=lambda *a: None)
    drafter = run.step.drafter
    counter = flops.WorkCounter(drafter)
    seen = []
    drafter.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((args[1].shape[1], kwargs["attention_mask"])), with_kwargs=True)
    take_step(run, counter.watch if shipped_count else lambda ships: counter.watch(without_count(ships)))
    loss_rows = int(run.step.acc.count_K.sum())
    work = counter.count(run.cfg.objective.num_anchors, loss_rows)
    (index,) = run.assign.consumed(0, 0)
    batch = run.stream[index]  # the host batch the step trained on
    B = drafter.block_size
    real = real_anchor_count(batch.loss_mask, batch.lengths, run.cfg.objective.num_anchors)
    (q_len, masks), = seen
    dense = masks["full_attention"]
    assert dense.shape[0] == q_len and q_len >= real * B
    layers = drafter.config.num_hidden_layers
    assert work.attention_pairs == layers * int(dense[: real * B].sum())
    assert int(dense[real * B:].sum()) == (q_len - real * B) * B  # padding blocks see only themselves
    assert work.block_rows == real * B and work.samples == batch.batch_size
    assert work.context_tokens == int(batch.lengths.sum()) and 0 < loss_rows <= real * (B - 1)


def test_real_anchor_count_matches_sample_anchors():
    gen = torch.Generator().manual_seed(3)
    rows, L = 5, 30
    lengths = torch.randint(2, L + 1, (rows,), generator=gen)
    loss_mask = torch.rand(rows, L, generator=gen) < 0.6
    loss_mask &= torch.arange(L)[None, :] < lengths[:, None]
    packed = torch.cat([loss_mask[r, : int(n)] for r, n in enumerate(lengths)])
    for k in (1, 3, 50):
        drawn = sample_anchors(packed, lengths, k, step_generator(0, k), pad_to_multiple=4)
        assert real_anchor_count(loss_mask, lengths, k) == int((drawn >= 0).sum())


def test_busy_time_is_the_union_of_intervals_inside_the_window():
    assert profile.busy_time([(0, 4), (2, 6), (8, 9), (8.5, 8.7)], (0, 10)) == 7
    assert profile.busy_time([(-5, 1), (9, 20)], (0, 10)) == 2  # clipped to the window
    assert profile.busy_time([], (0, 10)) == 0
    assert profile.busy_time([(3, 4), (1, 2), (1.5, 3.5)], (0, 10)) == 3  # unsorted input


def test_packed_anchor_count_equals_the_padded_batch_count():
    gen = torch.Generator().manual_seed(5)
    rows, L = 6, 25
    lengths = torch.randint(2, L + 1, (rows,), generator=gen)
    loss_mask = (torch.rand(rows, L, generator=gen) < 0.7) & (torch.arange(L)[None, :] < lengths[:, None])
    packed = torch.cat([loss_mask[r, : int(n)] for r, n in enumerate(lengths)] + [torch.ones(7, dtype=torch.bool)])
    for k in (1, 4, 40):  # the trailing padding (set here on purpose) belongs to no document
        assert packed_anchor_count(packed, lengths, k) == real_anchor_count(loss_mask, lengths, k)


DIST_KEYS = REPORT_KEYS | {"world_size", "mode", "num_target_ranks", "num_drafter_ranks", "samples_per_s_per_gpu",
                           "target_stage_s", "wait_s_per_step", "transfer_bytes_per_step", "transfer_gbytes_per_s"}


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_bench_under_torchrun_on_two_ranks(mode, tmp_path):
    """torchrun, 2 CPU ranks (gloo): one JSON line from rank 0 alone, throughput over both
    ranks, and in the 1 + 1 split the target's stages, both queue waits and the bytes that
    crossed, equal to transport.py's wire format of what was trained on."""
    import subprocess
    import sys

    from dflash_train.train.transport import HEADER_LEN

    steps = 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "dflash_train", "bench", "--workload", "tiny", "--steps", str(steps), "--warmup", "1",
           "--peak-tflops", "1", "--output", str(tmp_path / "bench.json"), "train.num_threads=1",
           f"topology.mode={mode}"] + (["topology.num_target_ranks=1"] if mode == "disaggregated" else [])
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env=subprocess_env(OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert sum(line.startswith("{") for line in lines) == 1  # rank 0 alone reports
    report = json.loads(lines[-1])
    assert json.loads((tmp_path / "bench.json").read_text()) == report
    assert DIST_KEYS <= set(report)
    assert report["world_size"] == 2 and report["mode"] == mode and report["steps"] == steps
    assert report["samples_per_s"] > 0
    assert report["samples_per_s_per_gpu"] == pytest.approx(report["samples_per_s"] / 2)
    assert report["mfu"] == pytest.approx(report["useful_tflops_per_s"] / (1.0 * 2))
    assert all(v > 0 for v in report["flops_per_sample"].values())
    assert report["samples"] == steps * report["samples_per_step"] and report["skipped_steps"] == 0
    if mode == "colocated":
        assert (report["num_target_ranks"], report["num_drafter_ranks"]) == (2, 2)
        assert {"data", "target", "pack", "backward"} <= set(report["stage_s"])
        assert report["target_stage_s"] is None and report["wait_s_per_step"] is None
        assert report["transfer_bytes_per_step"] is None
        return
    assert (report["num_target_ranks"], report["num_drafter_ranks"]) == (1, 1)
    assert "receive" in report["stage_s"] and "target" not in report["stage_s"]
    assert set(report["target_stage_s"]) == {"data", "target", "pack", "send"}
    waits = report["wait_s_per_step"]
    assert len(waits["drafter_recv"]) == 1 and len(waits["target_send"]) == 1
    assert all(v >= 0 for v in waits["drafter_recv"] + waits["target_send"])
    # One micro-batch per step: header, fp32 features [T, taps*H] padded to the token budget,
    # int64 [3, T] ids / mask / labels, int64 document lengths (one per sample).
    T, F = 512, 2 * 64
    per_step = 8 * HEADER_LEN + 4 * T * F + 8 * 3 * T + 8 * report["samples_per_step"]
    assert report["transfer_bytes_per_step"] == pytest.approx(per_step)
    assert report["transfer_gbytes_per_s"] == pytest.approx(per_step * steps / (report["step_s"] * steps) / 1e9)


@pytest.mark.parametrize("name", sorted(workloads.WORKLOADS))
def test_every_workload_has_a_valid_config_and_target_shape(name):
    """Each workload's settings load strictly, and its target config has the shape it names
    (smollm2: a Llama with tied embeddings, as the bundled SmolLM2-135M-Instruct)."""
    wl = workloads.WORKLOADS[name]
    cfg = load_config(None, [], base=wl.settings)
    config = workloads.target_config(wl)
    assert config.model_type == wl.target.get("model_type", "qwen3")
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert getattr(config, key) == wl.target[key], key
    assert cfg.drafter.mask_token_id < config.vocab_size


def test_decode_bench_reports_rates_and_cycle_cost_in_one_json_line(tmp_path, capsys):
    """`bench --workload decode` on CPU with the tiny target: one regeneration entry per row
    count (eager only: no graphs on a CPU), the batch-1 figures, the JSON object last and in
    --output."""
    out = tmp_path / "decode.json"
    argv = ["bench", "--workload", "decode", "--target", "bundled:tiny-random-llama", "--rows", "1,3",
            "--new-tokens", "6", "--device", "cpu", "--output", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report == json.loads(out.read_text())
    assert report["workload"] == "decode" and report["device"] == "cpu" and report["drafter_layers"] == 5
    assert [(e["rows"], e["graphs"]) for e in report["regeneration"]] == [(1, False), (3, False)]
    for entry in report["regeneration"]:
        assert entry["tokens"] == 6 * max(2, 2 * entry["rows"]) and entry["tokens_per_s"] > 0
    (one,) = report["batch_one"]
    assert one["target_ms_per_token"] > 0 and one["cycle_in_target_steps"] > 0 and one["graphs_captured"] == 0
    assert {e["attention"] for e in report["regeneration"] + report["batch_one"]} == {"masked"}  # auto on CPU
    # The next step queued before reading the last, by default; the refill and wait seconds counted.
    assert all(e["overlap"] is True and all(0 < e[k] < e["seconds"] for k in ("prefill_s", "launch_s", "wait_s",
                                                                               "book_s"))
               for e in report["regeneration"])


def test_decode_bench_prompt_lengths_and_profile(tmp_path, capsys, monkeypatch):
    """--prompt-lengths sets the requests' prompts (the report says so); --drafter-layers the
    timed drafter's depth; --profile writes the operator table of profiled regeneration steps at
    the largest row count next to --output; bad lengths and depths are refused with the fix."""

    out = tmp_path / "decode.json"
    argv = ["bench", "--workload", "decode", "--target", "bundled:tiny-random-llama", "--rows", "1,2",
            "--new-tokens", "4", "--prompt-lengths", "3,9", "--device", "cpu", "--profile", "--output", str(out),
            "--attention", "varlen", "--no-overlap", "--drafter-layers", "2"]
    built = []
    real_build = decoding.build_models
    monkeypatch.setattr(decoding, "build_models", lambda *a, **k: built.append(real_build(*a, **k)) or built[-1])
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["drafter_layers"] == 2 and built[0][1].config.num_hidden_layers == 2
    assert {e["overlap"] for e in report["regeneration"]} == {False}
    assert report["prompt_lengths"] == [3, 9]
    assert {e["attention"] for e in report["regeneration"] + report["batch_one"]} == {"varlen-reference"}
    assert [e["rows"] for e in report["regeneration"]] == [1, 2]  # CPU: eager rows 1 and 2 (no graph pass)
    profiled = report["regeneration"][-1]["profile"]
    assert "profile" not in report["regeneration"][0]
    assert profiled["rows"] == 2 and profiled["steps"] == 10 and profiled["sorted_by"] == "self_cpu_time_total"
    table = (tmp_path / "bench-decode-kernels.txt").read_text()
    assert table.startswith("10 regeneration steps at 2 rows, every row live (graphs: False), prompts of 3..9 tokens")
    assert "aten::" in table and profiled["path"] == str(tmp_path / "bench-decode-kernels.txt")
    capsys.readouterr()
    for bad in ("9,3", "0,5", "64", "a,b"):
        assert cli.main(["bench", "--workload", "decode", "--prompt-lengths", bad, "--device", "cpu"]) == 2
        assert f"--prompt-lengths {bad}: give the shortest and longest prompt" in capsys.readouterr().err
    assert cli.main(["bench", "--workload", "decode", "--drafter-layers", "0", "--device", "cpu"]) == 2
    assert "--drafter-layers must be >= 1, got 0" in capsys.readouterr().err


def test_decode_profile_window_has_every_row_live_and_no_prefill(tmp_path):
    """The profiled steps decode every row and prefill nothing: the requests are stepped in
    first (one refill, in as many prefill forwards as the prompt-token cap asks for), and their
    budget outlasts the fill and the window."""
    from dflash_train.bench import decoding
    from dflash_train.core.target import load_target_model
    from dflash_train.engine.slots import SlotDecoder

    model, _ = load_target_model("bundled:tiny-random-llama", torch.device("cpu"), torch.float32)
    rows, lengths = 4, (5, 9)
    budget = decoding.profile_budget(rows, lengths[1], prefill_tokens=9, steps=3)
    assert budget == 4 + 3 + 2  # at most four fill steps of one 9-token prompt, then the window
    slots = SlotDecoder.for_model(model, rows, lengths[1] + budget + 2, graphs=False, prefill_tokens=9)
    prefills, prefill = [], slots.steps.prefill
    slots.steps.prefill = lambda *a, **k: prefills.append(len(a[1])) or prefill(*a, **k)
    path = tmp_path / "kernels.txt"
    out = decoding.profile_regeneration(slots, rows, 1, lengths, int(model.config.vocab_size), 0, path, steps=3)
    assert out["live_rows"] == rows and out["fill_steps"] == 1 and prefills == [1, 1, 1, 1]  # one forward each
    assert slots.num_live == rows and not slots.pending  # nothing prefilled or finished in the window
    assert path.read_text().startswith("3 regeneration steps at 4 rows, every row live")


def test_sync_sites_count_synchronising_warnings_by_call_site():
    """profile.SyncSites (the profile summary's host-sync list): warnings about synchronising are
    counted by the line that caused them, other warnings pass through untouched."""
    import warnings

    def wait():
        warnings.warn("called a synchronizing CUDA operation")

    def wait_elsewhere():
        warnings.warn("called a synchronizing CUDA operation")

    with pytest.warns(UserWarning, match="unrelated"):
        with profile.SyncSites(torch.device("cpu")) as syncs:
            for _ in range(3):
                wait()
            wait_elsewhere()
            warnings.warn("unrelated")
    assert sorted(syncs.sites.values()) == [1, 3]
    assert all(site.startswith(__file__) or "test_bench.py" in site for site, _ in syncs.sites)
    lines = syncs.lines(2)
    assert "2.0 per step" in lines[1] and lines[2].strip().startswith("1.5")


def test_host_lead_probes_every_stage_layer_and_the_loss_then_restores_the_run(tmp_path, monkeypatch):
    """scripts/host_lead.py on the tiny workload (CPU, where every lead is 0): a row per stage
    mark, per drafter layer's forward and backward and the loss's ends, a line per probed step;
    afterwards the run's layers, the stage timer and the step's loss are the originals again."""
    import gc
    import importlib.util

    from dflash_train.train import step as step_module
    from dflash_train.train.metrics import StageTimer

    spec = importlib.util.spec_from_file_location("host_lead", ROOT / "scripts" / "host_lead.py")
    host_lead = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_lead)
    mark, block_loss, callbacks = StageTimer.mark, step_module.block_loss, list(gc.callbacks)
    built = []
    real_build = harness.build_run

    def build(*args, **kwargs):
        built.append(real_build(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(harness, "build_run", build)
    lines = host_lead.main(["--workload", "tiny", "--steps", "4", "--warmup", "1", "--out", str(tmp_path / "r.txt")])
    names = [line.split()[0] for line in lines[2:lines.index(next(x for x in lines if x.startswith("per step")))]]
    layers = built[0][0].step.drafter.layers
    expected = ["stage:data", "stage:target", "stage:pack", "stage:mask", "stage:drafter_forward"] \
        + [f"L{i}:fwd" for i in range(len(layers))] + ["loss:start", "loss:end", "stage:backward"] \
        + [f"L{i}:bwd" for i in reversed(range(len(layers)))] + ["stage:optimizer", "stage:end"]
    assert names == expected
    assert sum(line.startswith("  step ") for line in lines) == 4
    assert lines[0].startswith("4 probed steps")
    assert (tmp_path / "r.txt").read_text().splitlines() == lines
    assert all(type(layer).__name__ == "DFlashLayer" for layer in layers)
    assert StageTimer.mark is mark and step_module.block_loss is block_loss and gc.callbacks == callbacks
