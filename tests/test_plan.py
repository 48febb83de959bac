"""The memory planner (`dflash-train plan`, bench/memory.py): parameter counts from config.json
against models built on the meta device, the drafter's against a built drafter, the planner's
peaks against the peaks the project measured on GPUs, the layouts of 70B targets, and the
command's table and refusals."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_target_config
from dflash_train.app import cli
from dflash_train.app.recipe import QUALITY_TRAIN_ARGS
from dflash_train.bench.memory import (
    GIB,
    DecoderShape,
    DrafterModel,
    Layout,
    MicroBatch,
    Planner,
    TargetModel,
    bench_micro_batch,
    check_fits,
    gib,
    meta_counted,
    plan_layouts,
    plan_memory,
    worst_case_micro_batch,
)
from dflash_train.bench.workloads import WORKLOADS, target_config, workload_config
from dflash_train.core.config import load_config
from dflash_train.core.drafter import DFlashDrafter, build_drafter_config, count_parameters
from dflash_train.core.errors import InputError
from dflash_train.core.target import target_config_of

# Published config.json values (the fields that set the parameter count).
LLAMA_3_1_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    rope_theta=500000.0, rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"})
LLAMA_3_3_70B = {**LLAMA_3_1_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                 "num_attention_heads": 64}
QWEN3_32B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=5120, intermediate_size=25600,
                 num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                 max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                     intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                     decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)
# Smaller relatives that exercise the other rules: biases on q/k/v (Qwen2), a shared expert and
# dense layers between sparse ones (Qwen2-MoE), Mixtral's experts, tied embeddings.
QWEN2_SMALL = dict(model_type="qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)
QWEN2_MOE_SMALL = dict(model_type="qwen2_moe", hidden_size=128, intermediate_size=384, moe_intermediate_size=64,
                       shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2,
                       mlp_only_layers=[3], num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=1000, tie_word_embeddings=False)
MIXTRAL_SMALL = dict(model_type="mixtral", hidden_size=128, intermediate_size=256, num_local_experts=4,
                     num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=1000)
SHAPES = {"llama-3.1-8b": LLAMA_3_1_8B, "qwen3-32b": QWEN3_32B, "llama-3.3-70b": LLAMA_3_3_70B,
          "qwen3-30b-a3b": QWEN3_30B_A3B, "qwen2": QWEN2_SMALL, "qwen2-moe": QWEN2_MOE_SMALL, "mixtral": MIXTRAL_SMALL}
# Settings of a 70B run sized for 8 GPUs: 4K-token micro-batches of at most 8 samples, 64 anchors each.
SMALL_BATCHES = ["data.token_budget=4096", "data.max_length=4096", "data.max_batch_size=8",
                 "objective.num_anchors=64", "train.compile=true"]


def target_folder(tmp_path, name: str):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SHAPES[name]))
    return folder


def meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", list(SHAPES))
def test_parameters_counted_from_config_equal_the_meta_models(tmp_path, name):
    config = target_config_of(str(target_folder(tmp_path, name)))
    target = TargetModel.of(config)
    model = meta_model(config)
    assert target.parameters() == sum(p.numel() for p in model.parameters())
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    assert list(target.layer_params) == per_layer  # the kept layers of a training target are counted right


def test_the_real_shapes_have_their_published_sizes(tmp_path):
    billions = {name: TargetModel.of(target_config_of(str(target_folder(tmp_path, name)))).parameters() / 1e9
                for name in ("llama-3.1-8b", "qwen3-32b", "llama-3.3-70b", "qwen3-30b-a3b")}
    assert billions == pytest.approx({"llama-3.1-8b": 8.03, "qwen3-32b": 32.76, "llama-3.3-70b": 70.55,
                                      "qwen3-30b-a3b": 30.53}, abs=0.01)


def test_a_family_not_counted_from_its_fields_is_counted_on_a_meta_model():
    config = tiny_target_config()
    config.model_type = "llama"  # counted from fields
    counted = TargetModel.of(config)
    shape = replace(DecoderShape.of(config), model_type="olmo2")  # the fallback itself, on the same shape
    assert meta_counted(config, shape).parameters() == counted.parameters()


@pytest.mark.parametrize("overrides", [[], ["drafter.num_layers=3", "drafter.num_taps=2", "drafter.intermediate_size=40"],
                                       ["drafter.target_layer_ids=[0,3,5]"]])
def test_the_drafters_count_equals_a_built_drafters(overrides):
    target = tiny_target_config()
    cfg = load_config(None, ["drafter.num_layers=2", *overrides], base={})
    d = cfg.drafter
    built = DFlashDrafter(build_drafter_config(target, num_layers=d.num_layers, mask_token_id=127,
                                               target_layer_ids=d.target_layer_ids, num_taps=d.num_taps,
                                               intermediate_size=d.intermediate_size))
    drafter = DrafterModel.of(DecoderShape.of(target), cfg)
    assert drafter.parameters() == count_parameters(built)
    assert list(drafter.taps) == built.target_layer_ids


# The peaks the project measured (torch's max_memory_allocated, the bench's `peak_memory_gib`), with
# the settings of the bench workloads (bench/workloads.py). smollm2 and w2 fixed ACTIVATION_SCALE; the
# others were not used to fit anything.
MEASURED = [
    # docs/results/2026-12-06-layers-before-after-h100.md, one H100
    ("smollm2", Layout(1), 13.33),
    ("w2", Layout(1), 53.56),
    # docs/results/2026-12-04-baseline-beside-code-paper-bf16.md, one H200
    ("paper", Layout(1), 60.08),
    # docs/results/2026-11-29-two-gpus-w2.md, two H200 (the code of that day: its 1-GPU w2 peaked at 55.3)
    ("w2", Layout(2), 55.3),
    ("w2", Layout(2, "disaggregated", 1), 43.1),
    # docs/results/2026-12-06-fsdp-one-rank-w2-h100.md, one H100: train.fsdp=true on one rank
    ("w2", Layout(1, fsdp=True), 57.47),
]
# ... and on random targets of other real shapes (`bench --workload w2 --target DIR`):
# docs/results/2026-12-06-planner-real-shapes-h100.md, one H100.
MEASURED_SHAPES = [
    ("llama-3.1-8b", ["drafter.mask_token_id=128255"], 56.50),
    ("qwen3-30b-a3b", ["data.token_budget=3072"], 66.80),
]


@pytest.mark.parametrize("workload, layout, measured", MEASURED)
def test_the_planner_is_within_15_percent_of_the_measured_peaks(workload, layout, measured):
    cfg = workload_config(workload, [])
    plan = Planner.of(target_config(WORKLOADS[workload]), cfg, bench_micro_batch(workload, cfg)).plan(layout)
    assert plan.peak / GIB == pytest.approx(measured, rel=0.15)


@pytest.mark.parametrize("shape, overrides, measured", MEASURED_SHAPES)
def test_the_planner_is_within_5_percent_of_the_peaks_measured_on_other_shapes(tmp_path, capsys, shape, overrides,
                                                                                measured):
    """What `plan --workload w2 --target DIR` prints against what `bench` measured on that shape
    (neither was used to fit anything)."""
    folder = target_folder(tmp_path, shape)
    assert cli.main(["plan", "--workload", "w2", "--target", str(folder), "--gpus", "1", *overrides]) == 0
    best = capsys.readouterr().out.splitlines()[-1]
    planned = float(best.split(", peak ")[1].split()[0])
    assert planned == pytest.approx(measured, rel=0.05)


def test_the_quality_recipes_measured_training_peak_is_under_the_worst_case():
    """The recipe's training on real chats peaked at 16.8 GiB (docs/results/2026-12-06-own-data-sources-
    and-schedule-h100.md, run B); its data's batches are not known here, so the planner's worst case of
    its batch plan must lie above that."""
    cfg = load_config(None, [*QUALITY_TRAIN_ARGS, "eval.every=400", "eval.prompts=null", "data.validation=128"],
                      base={})
    planner = Planner.of(target_config(WORKLOADS["smollm2"]), cfg)
    assert planner.micro_batch.blocks == cfg.data.token_budget  # every token of the budget an anchor, at worst
    assert 16.8 < planner.plan(Layout(1)).peak / GIB < 2 * 16.8


def test_the_worst_case_micro_batch_by_hand():
    cfg = load_config(None, ["data.token_budget=2048", "data.max_length=512", "data.max_batch_size=16",
                             "objective.num_anchors=16", "train.anchor_multiple=64"], base={})
    # 16 rows of 64 or 128 tokens, 16 anchors each (at 64: min(16, 2048 // 64) rows), padded to 64
    assert worst_case_micro_batch(cfg) == MicroBatch(2048, 2048, 256, 256, "the worst case of the batch plan")
    few = worst_case_micro_batch(replace(cfg, objective=replace(cfg.objective, num_anchors=1024)), 0.5)
    assert few.real_blocks == 2048 // 2 - 4  # 4 rows of 512, each 256 supervised: 255 candidates
    tiny = workload_config("tiny", [])
    assert bench_micro_batch("tiny", tiny).real_blocks <= worst_case_micro_batch(tiny).real_blocks


def test_a_70b_target_on_one_gpu_is_refused_in_one_line(tmp_path, capsys):
    folder = target_folder(tmp_path, "llama-3.3-70b")
    assert cli.main(["plan", "--target", str(folder), "--gpus", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflash-train plan: no layout of 1 GPU fits")
    assert "target weights 128.2" in err[0] and "use more GPUs" in err[0]
    with pytest.raises(InputError, match="does not fit"):
        check_fits(target_config_of(str(folder)), load_config(None, SMALL_BATCHES, base={}), Layout(1))


def test_a_70b_target_fits_8_gpus_with_tensor_parallelism(tmp_path):
    config = target_config_of(str(target_folder(tmp_path, "llama-3.3-70b")))
    planner = Planner.of(config, load_config(None, SMALL_BATCHES, base={}))
    plans = plan_layouts(planner, 8)
    fitting = [p for p in plans if p.fits]
    assert fitting and all(p.layout.target_tp > 1 and p.layout.fsdp for p in fitting)
    assert not planner.plan(Layout(8, target_tp=1, fsdp=True)).fits  # a whole 70B target per GPU never fits
    best = fitting[0]
    assert best.layout == Layout(8, "colocated", None, 8, True) and best.verdict == "fits"
    assert [p.peak for p in plans if not p.fits] == sorted(p.peak for p in plans if not p.fits)


def test_tensor_parallelism_and_fsdp_split_what_they_split(tmp_path):
    config = target_config_of(str(target_folder(tmp_path, "qwen3-32b")))
    cfg = load_config(None, SMALL_BATCHES, base={})
    one, four = (plan_memory(config, cfg, Layout(4, target_tp=tp)).ranks[0] for tp in (1, 4))
    heads = TargetModel.of(config).head_params * 2  # bf16
    assert four.target_weights < one.target_weights / 3 and four.target_weights > heads  # heads stay whole
    replicated, sharded = (plan_memory(config, cfg, Layout(4, fsdp=f)).ranks[0] for f in (False, True))
    assert sharded.states == pytest.approx(replicated.states / 4)
    bad = plan_memory(config, cfg, Layout(6, target_tp=3))  # 64 heads do not split over 3
    assert not bad.fits and "not a multiple of 3" in bad.problems[0]


def test_fsdp_over_several_ranks_holds_only_shards_between_micro_batches(tmp_path):
    """train/sharding.py reduces and reshards after every micro-batch over several ranks; on one
    rank it keeps the step's gradients and weights whole until its last micro-batch."""
    config = target_config_of(str(target_folder(tmp_path, "llama-3.3-70b")))
    cfg = load_config(None, [*SMALL_BATCHES, "train.grad_accum=4"], base={})
    P = plan_memory(config, cfg, Layout(1)).ranks[0].drafter_grads / 4  # float32 gradients: 4 bytes each
    one, eight = (plan_memory(config, cfg, Layout(gpus, fsdp=True)).ranks[0] for gpus in (1, 8))
    assert one.accumulated == pytest.approx(8 * P) and eight.accumulated == 0


def test_a_mixture_of_experts_target_counts_every_expert(tmp_path):
    config = target_config_of(str(target_folder(tmp_path, "qwen3-30b-a3b")))
    plan = plan_memory(config, load_config(None, SMALL_BATCHES, base={}), Layout(1))
    assert plan.ranks[0].target_weights > 2 * 28e9  # bf16 bytes of all 128 experts, not the 3B active


def test_plan_prints_the_table_and_the_best_layout(capsys):
    assert cli.main(["plan", "--workload", "w2", "--gpus", "2", "train.grad_accum=2"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.startswith("layout "))
    assert out[header].split() == ["layout", "GPUs", "target", "target", "fwd", "drafter", "states", "drafter",
                                   "step", "buffers", "peak", "verdict"]
    assert out[header + 1].startswith("colocated, target TP 1, drafter replicated") and "fits" in out[header + 1]
    assert out[-1].startswith("best: colocated, target TP 1, drafter replicated")
    assert "train.grad_accum=2" in "\n".join(out[:header])


def test_plan_of_a_named_layout_and_its_refusal(tmp_path, capsys):
    folder = str(target_folder(tmp_path, "llama-3.3-70b"))
    assert cli.main(["plan", "--target", folder, "--gpus", "8", "--target-tp", "8", "--fsdp", *SMALL_BATCHES]) == 0
    out = capsys.readouterr().out
    assert "colocated, target TP 8, drafter FSDP" in out and "does not fit" not in out
    assert cli.main(["plan", "--target", folder, "--gpus", "8", "--target-tp", "4", *SMALL_BATCHES]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert "colocated, target TP 4, drafter replicated on 8 GPUs does not fit" in captured.err
    assert "fits at" in captured.err and "(--target-tp 8 --fsdp)" in captured.err


def test_plan_of_a_workload_on_a_target_folders_shape(tmp_path, capsys):
    """`plan --workload NAME --target DIR`: the workload's settings and batches on DIR's shape, what
    `bench --workload NAME --target DIR` measures."""
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    tiny_target_config(hidden_size=48, num_hidden_layers=3, vocab_size=300).to_json_file(str(folder / "config.json"))
    assert cli.main(["plan", "--workload", "tiny", "--target", str(folder), "--gpus", "1",
                     "drafter.mask_token_id=299"]) == 0
    shaped = capsys.readouterr().out
    cfg = workload_config("tiny", ["drafter.mask_token_id=299"])
    planner = Planner.of(target_config_of(str(folder)), cfg, bench_micro_batch("tiny", cfg))
    assert f"peak {gib(planner.plan(Layout(1)).peak)} of" in shaped.splitlines()[-1]
    assert cli.main(["plan", "--workload", "tiny", "--gpus", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[0] != shaped.splitlines()[0]  # another target
    # The workload's mask token (511) is outside this vocabulary: the setting is named, with the fix.
    assert cli.main(["plan", "--workload", "tiny", "--target", str(folder), "--gpus", "1"]) == 2
    err = capsys.readouterr().err
    assert "drafter.mask_token_id=511" in err and "below the target's vocabulary of 300 (e.g. 299)" in err


def test_plan_refuses_bad_input_naming_it(tmp_path, capsys):
    assert cli.main(["plan", "--workload", "w2", "--gpus", "1", "data.token_budget=-1"]) == 2
    assert "data.token_budget must be > 0" in capsys.readouterr().err
    assert cli.main(["plan", "--target", str(tmp_path / "nothing"), "--gpus", "1"]) == 2
    assert "--target" in capsys.readouterr().err
    assert cli.main(["plan", "--workload", "w2", "--gpus", "0"]) == 2
    assert "--gpus must be >= 1" in capsys.readouterr().err
