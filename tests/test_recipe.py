"""The quality recipe (recipe.py) and the embedded default on a GPU: the CLI's choice between the
smoke-sized run and the recipe, and the recipe's three stages end to end on CPU with the tiny
random target (regenerated data cached and reused, the drafter trained with a validation split,
served tau printed last)."""

from __future__ import annotations

import json

import pytest

from dflash_train.app import cli, commands, recipe
from dflash_train.app.recipe import GpuDefault

TINY = "bundled:tiny-random-llama"


def test_the_embedded_default_runs_the_recipe_where_a_gpu_is_visible(monkeypatch, capsys, tmp_path):
    plans, configs = [], []
    monkeypatch.setattr(commands, "gpu_default_applies", lambda: True)
    monkeypatch.setattr(recipe, "run_gpu_default", lambda plan: plans.append(plan) or 0)
    monkeypatch.setattr(commands, "train", lambda cfg, **kwargs: configs.append(cfg))
    assert cli.main(["train"]) == 0
    assert plans == [GpuDefault()] and configs == []
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("dflash-train train: the embedded default on a GPU: the quality recipe")
    assert "6,000 bundled ShareGPT conversations" in first and "train.device=cpu" in first
    assert cli.main(["train", "--output-dir", str(tmp_path / "mine")]) == 0
    assert plans[-1].output_dir == str(tmp_path / "mine")
    # Any override or config is a run of the user's own: the recipe does not replace it.
    assert cli.main(["train", "train.device=cpu", "train.max_steps=3"]) == 0
    assert len(plans) == 2 and configs[-1].train.max_steps == 3 and configs[-1].drafter.num_layers == 1
    monkeypatch.setattr(commands, "gpu_default_applies", lambda: False)
    assert cli.main(["train"]) == 0
    assert len(plans) == 2 and len(configs) == 2
    assert "a smoke-sized run" in capsys.readouterr().out.splitlines()[-1]


def test_gpu_default_applies_only_to_one_process_with_a_gpu(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert commands.gpu_default_applies()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not commands.gpu_default_applies()
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE")
    assert not commands.gpu_default_applies()


def test_the_cache_file_is_named_by_target_data_and_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path))
    path = GpuDefault().regenerated_path()
    assert path == tmp_path / "regenerated" / "smollm2-135m-instruct-sharegpt-new320-prompt1024-t0.jsonl"
    assert GpuDefault(max_new_tokens=512).regenerated_path() != path
    assert GpuDefault(target="/models/Qwen3 8B", data="/d/chats.jsonl").regenerated_path().name == \
        "models-Qwen3-8B-chats-new320-prompt1024-t0.jsonl"
    overrides = GpuDefault().train_overrides()
    assert overrides[: len(recipe.QUALITY_TRAIN_ARGS)] == list(recipe.QUALITY_TRAIN_ARGS)
    assert "checkpoint.keep_best=true" in overrides
    # the recipe's prompt sources: prompts and answers beside the chats, named by what makes them
    prompts = GpuDefault().source_prompts("word-problems", 4_000)
    assert prompts == tmp_path / "regenerated" / "sources" / "word-problems-4000.jsonl"
    prompts.parent.mkdir(parents=True)
    prompts.write_text('{"id": "a"}\n')
    answered = GpuDefault().source_answers("word-problems", 4_000, prompts)
    assert answered.parent == path.parent and answered.name.startswith("smollm2-135m-instruct-word-problems-4000-")
    assert answered.name.endswith("-new320-prompt1024-t0.jsonl")
    assert GpuDefault(regen_temperature=0.7).source_answers("word-problems", 4_000, prompts) != answered
    prompts.write_text('{"id": "b"}\n')  # other prompts (another Python, other packages): another file
    assert GpuDefault().source_answers("word-problems", 4_000, prompts) != answered
    with_sources = GpuDefault().train_overrides([answered, tmp_path / "b.jsonl"])
    assert f"data.paths=[{path},{answered},{tmp_path / 'b.jsonl'}]" in with_sources
    assert f"data.paths=[{path}]" in overrides  # none given: the chats alone


def test_a_gpu_too_small_for_the_recipe_is_refused_and_regeneration_fits_its_memory():
    from transformers import AutoConfig

    from dflash_train.core.errors import InputError
    from dflash_train.core.target import resolve_target_path

    recipe.check_gpu_memory(141 * 2**30)  # an H200
    with pytest.raises(InputError) as err:
        recipe.check_gpu_memory(24 * 2**30)
    assert "this GPU has 24.0 GiB" in str(err.value) and "dflash-train train train.device=cuda" in str(err.value)
    config = AutoConfig.from_pretrained(resolve_target_path(TINY))  # 4 layers, 2 key/value heads of 16
    plan = GpuDefault(max_prompt_length=1022, max_new_tokens=0)  # 1,024 columns a row
    per_row = 2 * 4 * 2 * 16 * 1024 * 2  # keys and values, layers, heads, head size, columns, bf16 bytes
    assert recipe.regen_rows(plan, 10_000 * per_row, config) == 1024  # room to spare: the plan's rows
    assert recipe.regen_rows(plan, 2 * 700 * per_row, config) == 640  # half the free memory, a multiple of 64
    assert recipe.regen_rows(plan, 2 * 40 * per_row, config) == 40


@pytest.mark.slow
def test_the_recipe_end_to_end_on_cpu_and_its_rerun(tmp_path):
    """Regenerate 6 conversations, train 4 steps (validation walked every 2), serve 2 records of
    each set; the rerun reuses the regenerated file and the finished training."""
    plan = GpuDefault(target=TINY, records=6, max_new_tokens=8, regen_temperature=5.0, regen_batch_size=8,
                      regenerated=str(tmp_path / "regen.jsonl"), sources=(("word-problems", 3),),
                      output_dir=str(tmp_path / "run"), steps=4,
                      validation=2, eval_every=2, train_args=(), eval_limit=2, eval_max_new_tokens=16,
                      speedup_turns=1, workers=1, eval_batch_size=2, device="cpu")
    said: list[str] = []
    assert recipe.run_gpu_default(plan, log=said.append) == 0
    assert sum(1 for _ in open(tmp_path / "regen.jsonl")) == 6
    assert any(line.startswith("dflash-train train: regenerated 6 conversations") for line in said)
    prompts = plan.source_prompts("word-problems", 3)
    answered = plan.source_answers("word-problems", 3, prompts)
    assert sum(1 for _ in open(prompts)) == sum(1 for _ in open(answered)) == 3
    assert any(line.startswith("dflash-train train: regenerated 3 word-problems records") for line in said)
    run = tmp_path / "run"
    assert str(answered) in (run / "config.yaml").read_text()  # trained on beside the chats
    assert (run / "drafter" / "config.json").is_file()
    walked = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "walked_tau" in r]
    assert walked == [2, 4]
    result = json.loads((run / "eval.json").read_text())
    assert set(result["per_set"]) == {"mt-bench", "humaneval", "gsm8k"}
    assert all(v["num_prompts"] == 2 and v["mismatched_turns"] == 0 for v in result["per_set"].values())
    assert said[-1] == recipe.served_line(result, run / "drafter")
    assert said[-1].startswith("dflash-train train: served tau mt-bench ")
    said.clear()
    assert recipe.run_gpu_default(plan, log=said.append) == 0
    assert f"dflash-train train: {tmp_path / 'regen.jsonl'} already holds 6 regenerated conversations" in said
    assert f"dflash-train train: {answered} already holds 3 regenerated word-problems records" in said
    assert said[-1].startswith("dflash-train train: served tau mt-bench ")
