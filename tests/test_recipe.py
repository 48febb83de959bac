"""The quality recipe (recipe.py) and the embedded default on a GPU: the CLI's choice between the
smoke-sized run and the recipe, and the recipe's three stages end to end on CPU with the tiny
random target (regenerated data cached and reused, the drafter trained with a validation split,
served tau printed last)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from dflash_train.app import cli, commands, recipe
from dflash_train.app.recipe import Recipe
from dflash_train.core.assets import sharegpt_json
from dflash_train.core.config import load_config
from dflash_train.data import sources

TINY = "bundled:tiny-random-llama"


def test_the_embedded_default_runs_the_recipe_where_a_gpu_is_visible(monkeypatch, capsys, tmp_path):
    plans, configs = [], []
    monkeypatch.setattr(commands, "gpu_default_applies", lambda: True)
    monkeypatch.setattr(recipe, "run_recipe", lambda plan: plans.append(plan) or 0)
    monkeypatch.setattr(commands, "train", lambda cfg, **kwargs: configs.append(cfg))
    assert cli.main(["train"]) == 0
    # The bundled target given alone: the plan of `train target.path=bundled:smollm2-135m-instruct`,
    # fitted to 15 minutes (fewer conversations of its own, a smaller budget), the rest the same.
    alone = Recipe.own_data("bundled:smollm2-135m-instruct", "cuda", "runs/default-gpu")
    assert plans == [replace(alone, target_prompts=5_000, budget_s=recipe.GPU_DEFAULT_BUDGET_S)] and configs == []
    assert plans[0].budget_s < alone.budget_s and plans[0].steps == recipe.OWN_DATA_STEPS
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("dflash-train train: the embedded default on a GPU: bundled:smollm2-135m-instruct "
                            "given alone")
    assert "5,000 conversations of its own" in first and "6,000 bundled ShareGPT conversations" in first
    assert f"up to 4,300 training steps within {recipe.GPU_DEFAULT_BUDGET_S:g} s for data and training" in first
    assert "runs/default-gpu/target-data" in first and "train.device=cpu" in first
    assert cli.main(["train", "--output-dir", str(tmp_path / "mine")]) == 0
    assert plans[-1].output_dir == str(tmp_path / "mine")
    (tmp_path / "a-file").write_text("")  # a folder it cannot make: said before anything, as for any target
    assert cli.main(["train", "--output-dir", str(tmp_path / "a-file" / "run")]) == 2 and len(plans) == 2
    assert capsys.readouterr().err.startswith(f"dflash-train train: output_dir {tmp_path / 'a-file' / 'run'}: ")
    # Any override or config is a run of the user's own: the recipe does not replace it.
    assert cli.main(["train", "train.device=cpu", "train.max_steps=3"]) == 0
    assert len(plans) == 2 and configs[-1].train.max_steps == 3 and configs[-1].drafter.num_layers == 1
    monkeypatch.setattr(commands, "gpu_default_applies", lambda: False)
    assert cli.main(["train"]) == 0
    assert len(plans) == 2 and len(configs) == 2
    assert "a smoke-sized run" in capsys.readouterr().out.splitlines()[-1]


def test_a_target_given_alone_runs_the_recipe_on_its_own_data(monkeypatch, capsys, tmp_path):
    """`train target.path=DIR` with no data and no config: the recipe on data the target makes
    itself, sized for the device, `train.max_time_s` its budget; a data path, another setting or
    a config file keep the run the user described."""
    plans, configs = [], []
    monkeypatch.setattr(commands, "gpu_default_applies", lambda: False)
    monkeypatch.setattr(recipe, "run_recipe", lambda plan: plans.append(plan) or 0)
    monkeypatch.setattr(commands, "train", lambda cfg, **kwargs: configs.append(cfg))
    assert cli.main(["train", f"target.path={TINY}", "train.device=cpu", "train.max_time_s=900",
                     "--output-dir", str(tmp_path / "own")]) == 0
    assert plans == [Recipe.own_data(TINY, "cpu", str(tmp_path / "own"), 900.0)] and configs == []
    assert plans[0].target_prompts > 0 and plans[0].records > 0 and plans[0].device == "cpu"
    # The output folder as an override, as any run is given one, is the same run's.
    assert cli.main(["train", f"target.path={TINY}", "train.device=cpu", f"output_dir={tmp_path / 'o'}"]) == 0
    assert plans[-1] == Recipe.own_data(TINY, "cpu", str(tmp_path / "o")) and configs == []
    plans.pop()
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"dflash-train train: no data given: {TINY} writes ")
    for described in ([f"target.path={TINY}", "data.paths=[bundled:sharegpt]"],
                      [f"target.path={TINY}", "optim.lr=1e-3"]):
        assert cli.main(["train", *described]) == 0
    assert len(plans) == 1 and len(configs) == 2
    assert cli.main(["train", "--config", "configs/tiny.yaml", f"target.path={TINY}"]) == 0
    assert len(plans) == 1 and len(configs) == 3
    capsys.readouterr()
    assert cli.main(["train", f"target.path={TINY}", "train.max_time_s=soon"]) == 2  # said as any other
    assert "command line override train.max_time_s" in capsys.readouterr().err and len(plans) == 1


def test_a_target_given_alone_is_checked_before_anything_is_said_or_made(monkeypatch, capsys, tmp_path):
    """A folder that is not there, a bundled name that is not one, a folder that is no model and
    a model whose tokenizer has no chat template: one line naming target.path, exit 2, no notice
    and nothing written (the run's folder and its target-data are not made); an output folder
    that cannot be made is said in the same line as a wrong target."""
    import shutil

    from dflash_train.core.target import resolve_target_path

    monkeypatch.setattr(commands, "gpu_default_applies", lambda: False)
    monkeypatch.setattr(recipe, "run_recipe", lambda plan: pytest.fail("the recipe ran"))
    plain = tmp_path / "plain"
    shutil.copytree(resolve_target_path(TINY), plain)
    for name in ("chat_template.jinja", "chat_template.json"):
        (plain / name).unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    for target, said in ((tmp_path / "absent", "no such folder"),
                         ("bundled:nonesuch", "no such bundled target; the bundled ones are "
                                              "bundled:smollm2-135m-instruct, "),
                         (tmp_path, "not a Hugging Face model folder (no config.json)"),
                         (plain, "its tokenizer has no chat template, so it has no user turn to write")):
        assert cli.main(["train", f"target.path={target}", "--output-dir", str(out)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith(f"dflash-train train: target.path {target}: {said}")
        assert len(captured.err.strip().splitlines()) == 1 and not out.exists()
    (tmp_path / "a-file").write_text("mine")  # an output folder that cannot be made, with a wrong target too
    assert cli.main(["train", f"target.path={tmp_path / 'absent'}", "--output-dir", str(tmp_path / "a-file")]) == 2
    err = capsys.readouterr().err
    file, absent = tmp_path / "a-file", tmp_path / "absent"
    assert err.startswith(f"dflash-train train: output_dir {file}: {file} is a file, not a folder: choose a folder you "
                          f"can write in; target.path {absent}: no such folder")
    assert (tmp_path / "a-file").read_text() == "mine"
    project = tmp_path / "project"  # a folder of the user's whose config.yaml a run would replace
    project.mkdir()
    (project / "config.yaml").write_text("# mine\n")
    assert cli.main(["train", f"target.path={TINY}", "--output-dir", str(project)]) == 2
    assert f"output_dir {project} holds config.yaml, which a run writes, and no run has used it" in \
        capsys.readouterr().err
    assert sorted(p.name for p in project.iterdir()) == ["config.yaml"]


@pytest.mark.slow
def test_a_target_alone_makes_its_data_trains_and_serves_on_cpu(tmp_path, monkeypatch):
    """The own-data plan of a CPU end to end on the tiny target: it cannot write a usable
    conversation of its own (said, and the run goes on), the bundled chats and word problems
    answered by it (sampled: at T=0 the random weights answer blank lines), a drafter trained
    and served; the rerun finds the data made."""
    import dataclasses

    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    plan = dataclasses.replace(Recipe.own_data(TINY, "cpu", str(tmp_path / "run")), records=6, steps=4,
                               regen_temperature=5.0, eval_every=2, validation=2, target_prompts=4,
                               prompt_max_candidates=8, prompt_max_tokens=16, max_new_tokens=8)
    said: list[str] = []
    assert recipe.run_recipe(plan, log=said.append) == 0
    assert any("conversations kept; the target writes too few usable turns" in line and "going on without them"
               in line for line in said)
    assert any(line.startswith("dflash-train train: regenerated 6 conversations") for line in said)
    run = tmp_path / "run"
    config = (run / "config.yaml").read_text()
    assert str(run / "target-data") in config and "word-problems" in config
    assert (run / "drafter" / "config.json").is_file() and (run / "eval.json").is_file()
    assert said[-1].startswith("dflash-train train: served tau mt-bench ")
    said.clear()
    assert recipe.run_recipe(plan, log=said.append) == 0
    assert any("already holds 6 regenerated conversations" in line for line in said)


def test_data_stages_past_the_budget_are_not_started(tmp_path, monkeypatch):
    """Once the data's share of the budget is spent, the stages after the one running are not
    started (no prompts written, no target loaded), each said in a line; what was made is kept."""
    import time

    plan = Recipe.own_data(TINY, "cpu", str(tmp_path / "run"))
    started: list[str] = []

    def regenerate_up_to(plan, data, out, *args):
        started.append(out.name)
        out.write_text("{}\n")
        return False

    monkeypatch.setattr(recipe, "_regenerate_up_to", regenerate_up_to)
    monkeypatch.setattr(recipe.target_prompts, "write_target_prompts", lambda *a, **k: started.append("own"))
    monkeypatch.setattr(recipe.sources, "write_source", lambda *a, **k: started.append("source"))
    said: list[str] = []
    assert recipe.make_data(plan, 8, time.time() - 1, said.append) == [plan.regenerated_path()]
    assert started == [plan.regenerated_path().name]
    assert said == ["dflash-train train: the data's share of the budget is spent; the target's own conversations "
                    "are not made",
                    "dflash-train train: the data's share of the budget is spent; the word-problems prompts are not "
                    "made"]


def test_sampled_replies_follow_the_greedy_data_seed_by_seed_within_the_budget(tmp_path, monkeypatch):
    """With reply_samples the greedy files are answered again, sampled with seeds 1..N (every file
    once before any twice), as many records as each greedy file, and trained on after them; a
    rerun finds them made; past the data's share of the budget no further one is started (said
    once) and what was made is kept."""
    plan = replace(Recipe.own_data(TINY, "cpu", str(tmp_path / "run")), target_prompts=0, records=4,
                   sources=(("word-problems", 3),), reply_samples=2, sample_temperature=0.8, sample_top_p=0.9)
    calls: list[tuple[str, str, dict | None]] = []

    def fake_regenerate(paths, target, out, options, **kwargs):
        calls.append((Path(paths[0]).name, Path(out).name, options.sampled_replies()))
        with open(out, "a") as f:
            f.writelines(json.dumps({"line": i}) + "\n" for i in range(options.limit if options.limit < 99 else 4))
        return {"num_written": options.limit}

    monkeypatch.setattr(recipe.regenerate, "regenerate", fake_regenerate)
    monkeypatch.setattr(recipe.sources, "write_source",
                        lambda name, path, limit, replace: Path(path).write_text("{}\n" * limit) and limit)
    said: list[str] = []
    files = recipe.make_data(plan, 8, None, said.append)
    chats, problems = plan.regenerated_path(), plan.source_answers("word-problems", 3,
                                                                   plan.source_prompts("word-problems", 3))
    sampled = [plan.sampled_path(path, seed) for seed in (1, 2) for path in (chats, problems)]
    assert files == [chats, problems, *sampled]
    assert sampled[0].name == chats.stem + "-sampled-t0.8-p0.9-s1.jsonl"
    assert calls[:2] == [(sharegpt_json().name, chats.name, None), ("word-problems-3.jsonl", problems.name, None)]
    assert calls[2:] == [(path.name, plan.sampled_path(path, seed).name, {"temperature": 0.8, "top_p": 0.9, "seed": seed})
                         for seed in (1, 2) for path in (chats, problems)]
    assert [sum(1 for _ in open(path)) for path in files] == [4, 3, 4, 3, 4, 3]
    assert "then 2 sampled replies more to each prompt (T=0.8, top-p 0.9)" in recipe.own_data_notice(plan)
    calls.clear()
    assert recipe.make_data(plan, 8, None, said.append) == files and calls == []  # a rerun: all made
    assert f"dflash-train train: {sampled[-1]} already holds 3 regenerated sampled replies (seed 2) of " \
           f"{problems.name}" in said

    class Clock:  # the budget passes while the first sampled file is made
        now = 0.0

        def time(self):
            return self.now

    clock = Clock()
    monkeypatch.setattr(recipe, "time", clock)
    for path in sampled:
        path.unlink()

    def regenerate_then_late(*args, **kwargs):
        clock.now = 100.0
        return fake_regenerate(*args, **kwargs)

    monkeypatch.setattr(recipe.regenerate, "regenerate", regenerate_then_late)
    said.clear()
    assert recipe.make_data(plan, 8, 50.0, said.append) == [chats, problems, sampled[0]]
    assert said[-1] == (f"dflash-train train: the data's share of the budget is spent; the sampled replies from "
                        f"{problems.name} (seed 1) on are not made")


def test_the_sources_prompts_are_written_aside_as_the_stage_writes_them(tmp_path, monkeypatch):
    """With prompts_aside (a GPU plan's default) each source's prompts come from a process of its
    own, byte for byte what the stage writes itself; the run's process writes none of them."""
    plan = replace(Recipe.own_data(TINY, "cpu", str(tmp_path / "run")), records=0, target_prompts=0,
                   sources=(("word-problems", 8),), prompts_aside=True)
    expected = {}
    for name, count in plan.sources:
        expected[name] = tmp_path / f"{name}.jsonl"
        sources.write_source(name, expected[name], limit=count)
    asked = []

    def regenerate_up_to(plan, data, out, want, *args):
        asked.append((data.name, want))
        out.write_text("{}\n")
        return False

    monkeypatch.setattr(recipe, "_regenerate_up_to", regenerate_up_to)
    monkeypatch.setattr(recipe.sources, "write_source", lambda *a, **k: pytest.fail("written in the run's process"))
    assert len(recipe.make_data(plan, 8, None, print)) == 1
    assert asked == [("word-problems-8.jsonl", 8)]
    for name, count in plan.sources:
        assert plan.source_prompts(name, count).read_bytes() == expected[name].read_bytes()


def test_a_stage_gets_all_the_rows_once_the_own_conversations_process_has_ended(tmp_path, monkeypatch):
    """Beside the own conversations' process a stage decodes half the rows (its two engines hold
    the rest); a stage that starts after it ended gets all of them, and says so."""
    plan = replace(Recipe.own_data(TINY, "cpu", str(tmp_path / "run")), records=4,
                   sources=(("word-problems", 8), ("python-functions", 8)))
    asked = []

    class Own:  # alive through the chats and the first source, ended before the second
        exitcode = 0
        checks = iter([True, True])

        def is_alive(self):
            return next(self.checks, False)

    def regenerate_up_to(plan, data, out, want, rows, what, *args):
        asked.append((what, rows))
        out.write_text("{}\n")
        return False

    monkeypatch.setattr(recipe, "_regenerate_up_to", regenerate_up_to)
    monkeypatch.setattr(recipe.sources, "write_source", lambda name, path, limit, replace: path.write_text("{}\n") or 1)
    said = []
    recipe._make_data(plan, 512, None, said.append, {}, Own())
    assert asked == [("conversations", 256), ("word-problems records", 256), ("python-functions records", 512)]
    assert said == ["dflash-train train: the own conversations' process has ended; the python-functions prompts are "
                    "answered on all 512 rows"]
    assert recipe.stage_rows(512, None, "the chats", said.append) == 512 and len(said) == 1  # no process beside


def test_a_failed_or_stopped_prompt_writer_costs_nothing(tmp_path, monkeypatch):
    """A writer that failed: its stage writes the prompts itself. A writer stopped before its stage
    (a budget, a signal) leaves no file behind, not even part of one."""
    plan = replace(Recipe.own_data(TINY, "cpu", str(tmp_path / "run")), sources=(("python-packages", 50),),
                   prompts_aside=True)
    writers = recipe.start_prompt_writers(plan)
    recipe.stop_prompt_writers(writers)
    assert not writers["python-packages"].is_alive()
    assert not plan.source_prompts("python-packages", 50).exists()

    class Failed:
        exitcode = 1

        def join(self):
            pass

    asked = []
    monkeypatch.setattr(recipe, "_regenerate_up_to", lambda plan, data, out, want, *a: asked.append(want) or False)
    plan = replace(plan, sources=(("word-problems", 6),))
    recipe._regenerate_source(plan, "word-problems", 6, 8, None, print, Failed())
    assert asked == [6] and len(plan.source_prompts("word-problems", 6).read_text().splitlines()) == 6


def own_conversations(plan, rows, deadline, log):
    """recipe._target_prompts as the tests see it: the file it writes names the rows it had."""
    path = plan.target_prompt_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{{"own": {rows}}}\n')
    return path


def own_aside(plan, rows, deadline):
    """recipe.write_own_aside with own_conversations in its place (spawned: imported from here)."""
    own_conversations(plan, max(1, rows // 2), deadline, print)


def own_aside_failing(plan, rows, deadline):
    raise SystemExit(1)


def test_the_targets_own_conversations_written_aside_are_those_written_in_turn(tmp_path, monkeypatch):
    """With own_aside (a GPU plan's default for a small target) the target's own conversations come
    from a process of their own while the run's process answers the chats and the sources at half
    its rows: the same file, in the same place of the training files; a process that failed
    leaves the run's process to write them."""
    def regenerate_up_to(plan, data, out, want, rows, *args):
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f'{{"rows": {rows}}}\n')
        return False

    monkeypatch.setattr(recipe, "_regenerate_up_to", regenerate_up_to)
    monkeypatch.setattr(recipe, "_target_prompts", own_conversations)
    made = {}
    for how, work in (("in-turn", None), ("aside", own_aside), ("failed", own_aside_failing)):
        plan = replace(Recipe.own_data(TINY, "cpu", str(tmp_path / how)), own_aside=work is not None)
        if work is not None:
            monkeypatch.setattr(recipe, "write_own_aside", work)
        said: list[str] = []
        files = recipe.make_data(plan, 8, None, said.append)
        made[how] = ([path.relative_to(tmp_path / how) for path in files], plan.target_prompt_path().read_text(),
                     plan.regenerated_path().read_text(), said)
    assert made["aside"][:2] == made["failed"][:2] == made["in-turn"][:2]
    assert made["in-turn"][0][1] == Path("target-data") / plan.target_prompt_path().name  # after the chats
    assert made["in-turn"][1] == '{"own": 4}\n'  # two engines of half the rows, however they were written
    assert made["in-turn"][2] == '{"rows": 8}\n' and made["aside"][2] == made["failed"][2] == '{"rows": 4}\n'
    assert any("the process writing the target's own conversations failed (exit status 1)" in line
               for line in made["failed"][3])


def start(context, target, *args):
    process = context.Process(target=target, args=args)
    process.start()
    return process


def test_a_signal_while_the_own_conversations_are_waited_for_stops_them(tmp_path):
    """SIGTERM while the run's process waits for the own conversations' process: the wait ends
    (the run stops, 130) and that process is stopped with the other writers."""
    import multiprocessing
    import os
    import signal
    import threading
    import time

    own = start(multiprocessing.get_context("spawn"), time.sleep, 60)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    began = time.monotonic()
    assert recipe._waited_for(own) is False and time.monotonic() - began < 30
    recipe.stop_prompt_writers({"own": own})
    assert not own.is_alive()


def orphan(pid_file: str) -> None:
    """A writer's process whose parent is killed: it ends with it (recipe._end_with_parent)."""
    import time

    recipe._end_with_parent()
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(120)


ORPHANED = """import multiprocessing, os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_recipe import orphan
if __name__ == "__main__":
    multiprocessing.get_context("spawn").Process(target=orphan, args=(sys.argv[2],)).start()
    while not Path(sys.argv[2]).is_file() or not Path(sys.argv[2]).read_text():
        time.sleep(0.05)
    os._exit(0)  # killed: no cleanup runs, the writer is not stopped
"""


def test_a_writer_ends_when_the_run_is_killed_before_it_could_stop_it(tmp_path):
    import subprocess
    import sys
    import time

    from conftest import subprocess_env

    script, pid_file = tmp_path / "orphaned.py", tmp_path / "pid"
    script.write_text(ORPHANED)
    subprocess.run([sys.executable, str(script), str(Path(__file__).parent), str(pid_file)], env=subprocess_env(),
                   check=True, timeout=120)
    pid, deadline = int(pid_file.read_text()), time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and b"Z" not in Path(f"/proc/{pid}/stat").read_bytes().split(b")")[-1][:3]:
        assert time.monotonic() < deadline, "the writer outlived its killed parent"
        time.sleep(0.2)


def test_a_rerun_of_a_run_in_progress_trains_on_the_data_it_started_with(tmp_path, monkeypatch):
    """A run folder with checkpoints: the rerun makes no data (a stage stopped at the budget
    would go on and change the data) and resumes on the files its config.yaml names."""
    import yaml

    plan = Recipe.own_data(TINY, "cpu", str(tmp_path / "run"))
    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for path in files:
        path.write_text("{}\n")
    (tmp_path / "run" / "checkpoints" / "step-4").mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump({"data": {"paths": [str(p) for p in files]}}))
    monkeypatch.setattr(recipe, "make_data", lambda *a: pytest.fail("data made again"))
    trained = []
    monkeypatch.setattr(recipe, "train", lambda cfg, log, evaluation: trained.append(cfg) or None)
    said: list[str] = []
    assert recipe.run_recipe(plan, log=said.append) == recipe.INTERRUPTED
    assert trained[0].data.paths == [str(p) for p in files]
    assert f"{tmp_path / 'run'} holds a run in progress; it resumes on the data it started with" in said[0]


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
    path = Recipe().regenerated_path()
    assert path == tmp_path / "regenerated" / "smollm2-135m-instruct-sharegpt-new320-prompt1024-t0.jsonl"
    assert Recipe(max_new_tokens=512).regenerated_path() != path
    assert Recipe(target="/models/Qwen3 8B", data="/d/chats.jsonl").regenerated_path().name == \
        "models-Qwen3-8B-chats-new320-prompt1024-t0.jsonl"
    overrides = Recipe().train_overrides()
    assert overrides[: len(recipe.QUALITY_TRAIN_ARGS)] == list(recipe.QUALITY_TRAIN_ARGS)
    assert "checkpoint.keep_best=true" in overrides
    # the recipe's prompt sources: prompts and answers beside the chats, named by what makes them
    prompts = Recipe().source_prompts("word-problems", 4_000)
    assert prompts == tmp_path / "regenerated" / "sources" / "word-problems-4000.jsonl"
    prompts.parent.mkdir(parents=True)
    prompts.write_text('{"id": "a"}\n')
    answered = Recipe().source_answers("word-problems", 4_000, prompts)
    assert answered.parent == path.parent and answered.name.startswith("smollm2-135m-instruct-word-problems-4000-")
    assert answered.name.endswith("-new320-prompt1024-t0.jsonl")
    assert Recipe(regen_temperature=0.7).source_answers("word-problems", 4_000, prompts) != answered
    prompts.write_text('{"id": "b"}\n')  # other prompts (another Python, other packages): another file
    assert Recipe().source_answers("word-problems", 4_000, prompts) != answered
    with_sources = Recipe().train_overrides([path, answered, tmp_path / "b.jsonl"], max_time_s=77)
    assert f"data.paths=[{path},{answered},{tmp_path / 'b.jsonl'}]" in with_sources
    assert "train.max_time_s=77" in with_sources and "train.max_time_s=600" in overrides
    assert f"data.paths=[{path}]" in overrides  # none given: the chats alone
    own = Recipe.own_data("/models/Qwen3 8B", "cuda")  # a target alone: its data in its run folder
    assert own.output_dir == "runs/models-Qwen3-8B" and own.data_root() == Path("runs/models-Qwen3-8B/target-data")
    assert own.target_prompts > 0 and own.budget_s == recipe.OWN_DATA_BUDGET_S
    # a budget above the recipe's buys its own conversations, chats and steps in proportion; one below
    # keeps the sizes (the data stops at its share, the schedule is fitted to the time left)
    twice = Recipe.own_data("/models/Qwen3 8B", "cuda", budget_s=2 * recipe.OWN_DATA_BUDGET_S)
    assert (twice.target_prompts, twice.records, twice.steps) == (2 * own.target_prompts, 2 * own.records,
                                                                  2 * own.steps)
    assert twice.budget_s == 3600 and replace(twice, target_prompts=own.target_prompts, records=own.records,
                                              steps=own.steps, budget_s=own.budget_s) == own
    half = Recipe.own_data("/models/Qwen3 8B", "cuda", budget_s=900)
    assert (half.target_prompts, half.records, half.steps, half.budget_s) == (own.target_prompts, own.records,
                                                                              own.steps, 900)
    assert own.target_prompt_path().parent == own.data_root() == own.regenerated_path().parent
    # the cut of a written turn names the file only where it is not target_prompts' own default
    assert "-cut" not in own.target_prompt_path().name and own.prompt_max_tokens == 512
    assert replace(own, prompt_max_tokens=128).target_prompt_path().name == \
        own.target_prompt_path().name.replace("-new", "-cut128-new")
    # ... and so does the prompt limit (their conversations' length), so that no resume is refused for it
    assert "-prompt1024" not in own.target_prompt_path().name and own.max_prompt_length == recipe.MAX_PROMPT_LENGTH
    assert replace(own, max_prompt_length=1728).target_prompt_path().name == \
        own.target_prompt_path().name.replace("-new", "-prompt1728-new")
    # on a CPU a written turn is cut so that, with its answer, it leaves room for another written turn
    cpu = Recipe.own_data("/models/Qwen3 8B", "cpu")
    assert 2 * cpu.prompt_max_tokens + cpu.max_new_tokens <= cpu.max_prompt_length + cpu.max_new_tokens
    # its drafter is deeper than the quality recipe's, every other training setting the same
    cfg = load_config(None, own.train_overrides([path]))
    assert cfg.drafter.num_layers == recipe.OWN_DATA_DRAFTER_LAYERS == 8
    assert load_config(None, Recipe().train_overrides([path])).drafter.num_layers == 5
    assert [a for a in own.train_args if not a.startswith("drafter.num_layers=")] == \
        [a for a in recipe.QUALITY_TRAIN_ARGS if not a.startswith("drafter.num_layers=")]
    with pytest.raises(ValueError):
        recipe.replaced(recipe.QUALITY_TRAIN_ARGS, "drafter.no_such_key=1")


def test_a_gpu_too_small_for_the_recipe_is_refused_and_regeneration_fits_its_memory():
    from transformers import AutoConfig

    from dflash_train.core.errors import InputError
    from dflash_train.core.target import resolve_target_path

    recipe.check_gpu_memory(141 * 2**30)  # an H200
    with pytest.raises(InputError) as err:
        recipe.check_gpu_memory(24 * 2**30)
    assert "this GPU has 24.0 GiB" in str(err.value) and "dflash-train train train.device=cuda" in str(err.value)
    config = AutoConfig.from_pretrained(resolve_target_path(TINY))  # 4 layers, 2 key/value heads of 16
    plan = Recipe(max_prompt_length=1022, max_new_tokens=0)  # 1,024 columns a row
    per_row = 2 * 4 * 2 * 16 * 1024 * 2  # keys and values, layers, heads, head size, columns, bf16 bytes
    assert recipe.regen_rows(plan, 10_000 * per_row, config) == 1024  # room to spare: the plan's rows
    assert recipe.regen_rows(plan, 2 * 700 * per_row, config) == 640  # half the free memory, a multiple of 64
    assert recipe.regen_rows(plan, 2 * 40 * per_row, config) == 40


def test_the_recipes_served_evaluation_times_the_speedup_with_graphs_only(monkeypatch, tmp_path):
    """serve() asks the evaluation for the plan's timed turns and no timing without CUDA graphs
    (a diagnostic of the engine, about 30 s of a GPU run), writes eval.json and ends with the
    served line."""
    asked = {}
    result = {"tau": 3.0, "speedup": 2.0, "per_set": {"mt-bench": {"tau": 3.0}}}

    def evaluated(target, drafter, sets, **kwargs):
        asked.update(kwargs, target=target, sets=sets)
        return result

    monkeypatch.setattr(recipe.evaluate, "evaluate", evaluated)
    monkeypatch.setattr(recipe.results, "write_outputs", lambda result, path: [path])
    monkeypatch.setattr(recipe.results, "markdown_summary", lambda result: "summary")
    said: list[str] = []
    plan = Recipe.own_data("bundled:smollm2-135m-instruct", "cuda")
    recipe.serve(plan, tmp_path / "drafter", tmp_path, said.append)
    assert asked["timing"].eager_turns == 0 and asked["timing"].speedup_turns == plan.speedup_turns > 0
    assert asked["timing"].speedup and asked["sets"] == list(recipe.EVAL_SETS)
    assert said == ["summary", f"wrote {tmp_path / 'eval.json'}", recipe.served_line(result, tmp_path / "drafter")]


def shape_folder(tmp_path, name: str, config: dict) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_the_recipe_fits_its_batches_to_the_gpu_before_any_data_is_made(monkeypatch, tmp_path):
    """The recipe's batches were chosen for SmolLM2: for a target given alone whose worst-case
    step (the memory planner's) does not fit the GPU, the token budget is lowered to at most the
    largest that fits, samples with it where they must, and grad_accum raised to keep a step's
    tokens, split evenly over its micro-batches, said in a line;
    SmolLM2's plan is unchanged on an 80 GB GPU; a target no batch fits is refused before
    anything is made or written."""
    from transformers import AutoConfig

    from dflash_train.bench.memory import Layout, Planner
    from dflash_train.core.errors import InputError
    from dflash_train.core.target import resolve_target_path, target_config_of
    from dflash_train.data.batching import PAD_MULTIPLE
    from test_plan import LLAMA_3_1_8B, LLAMA_3_3_70B

    said: list[str] = []
    smol = Recipe.own_data("bundled:smollm2-135m-instruct", "cuda")
    smol_config = AutoConfig.from_pretrained(resolve_target_path(smol.target))
    assert recipe.fitted_to_gpu(smol, smol_config, 80.0, said.append) is smol and said == []
    on_40 = load_config(None, list(recipe.fitted_to_gpu(smol, smol_config, 40.0, said.append).train_args))
    # two micro-batches of half the recipe's tokens, not two of the largest that fits (a step 1.5
    # times the recipe's)
    assert on_40.data.token_budget == 8192 and on_40.train.grad_accum == 2 and len(said) == 1
    assert on_40.data.max_length == 2048

    folder = shape_folder(tmp_path, "llama-8b", LLAMA_3_1_8B)
    config, big = target_config_of(folder), Recipe.own_data(folder, "cuda")
    fitted = recipe.fitted_to_gpu(big, config, 80.0, said.append)
    cfg = load_config(None, list(fitted.train_args))
    budget = cfg.data.token_budget
    assert budget == cfg.data.max_length < 2048 and budget % PAD_MULTIPLE == 0
    assert cfg.train.grad_accum * budget >= 16384 > (cfg.train.grad_accum - 1) * budget
    assert cfg.drafter.num_layers == 8 and cfg.objective.num_anchors == 512  # nothing else changed
    planner = Planner.of(config, cfg, gpu_memory_gib=80.0)
    assert planner.plan(Layout(gpus=1)).fits  # the largest that fits: one step more would not
    larger = load_config(None, [*fitted.train_args, f"data.token_budget={budget + PAD_MULTIPLE}",
                                f"data.max_length={budget + PAD_MULTIPLE}"])
    assert not Planner.of(config, larger, gpu_memory_gib=80.0).plan(Layout(gpus=1)).fits
    assert f"micro-batches of {budget:,} tokens" in said[-1] and f"{cfg.train.grad_accum} to a step" in said[-1]

    # run_recipe fits them before the data stage (which gets the fitted plan), and refuses a 70B
    # target with nothing written
    monkeypatch.setattr(recipe.torch.cuda, "mem_get_info", lambda: (79 * 2**30, 80 * 2**30))
    monkeypatch.setattr(recipe, "resolve_target_path", lambda path, *a, **k: Path(path))  # config.json alone
    seen = []
    monkeypatch.setattr(recipe, "make_data", lambda plan, *a: seen.append(plan) or None)
    assert recipe.run_recipe(replace(big, output_dir=str(tmp_path / "run8")), log=said.append) == recipe.INTERRUPTED
    assert load_config(None, list(seen[0].train_args)).data.token_budget == budget
    assert seen[0].own_aside  # no weights in this folder: its own conversations are written aside
    with open(Path(folder) / "model.safetensors", "wb") as weights:
        weights.truncate(3 * 2**30)  # sparse: two copies would take 6 of the GPU's 80 GiB
    assert recipe.run_recipe(replace(big, output_dir=str(tmp_path / "run8b")), log=said.append) == recipe.INTERRUPTED
    assert not seen[1].own_aside
    huge = Recipe.own_data(shape_folder(tmp_path, "llama-70b", LLAMA_3_3_70B), "cuda", str(tmp_path / "run70"))
    with pytest.raises(InputError) as err:
        recipe.run_recipe(huge, log=said.append)
    assert "does not fit this GPU" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "run70").exists() and len(seen) == 2


@pytest.mark.slow
def test_the_recipe_end_to_end_on_cpu_and_its_rerun(tmp_path):
    """Regenerate 6 conversations and 3 word problems, and each once more with another seed
    (reply_samples), train 4 steps on all of them (validation walked every 2), serve 2 records of
    each set; the rerun reuses the regenerated files and the finished training."""
    plan = Recipe(target=TINY, records=6, max_new_tokens=8, regen_temperature=5.0, regen_batch_size=8,
                      regenerated=str(tmp_path / "regen.jsonl"), sources=(("word-problems", 3),),
                      reply_samples=1, sample_temperature=5.0, output_dir=str(tmp_path / "run"), steps=4,
                      validation=2, eval_every=2, train_args=(), eval_limit=2, eval_max_new_tokens=16,
                      speedup_turns=1, workers=1, eval_batch_size=2, device="cpu")
    said: list[str] = []
    assert recipe.run_recipe(plan, log=said.append) == 0
    assert sum(1 for _ in open(tmp_path / "regen.jsonl")) == 6
    assert any(line.startswith("dflash-train train: regenerated 6 conversations") for line in said)
    prompts = plan.source_prompts("word-problems", 3)
    answered = plan.source_answers("word-problems", 3, prompts)
    assert sum(1 for _ in open(prompts)) == sum(1 for _ in open(answered)) == 3
    assert any(line.startswith("dflash-train train: regenerated 3 word-problems records") for line in said)
    run = tmp_path / "run"
    assert str(answered) in (run / "config.yaml").read_text()  # trained on beside the chats
    for greedy in (tmp_path / "regen.jsonl", answered):  # the sampled replies, marked, trained on too
        again = plan.sampled_path(greedy, 1)
        records, others = ([json.loads(line) for line in open(path)] for path in (again, greedy))
        assert len(records) == len(others) and str(again) in (run / "config.yaml").read_text()
        assert all(r["sampled_replies"] == {"temperature": 5.0, "top_p": 0.95, "seed": 1} for r in records)
        assert records != [{**r, "sampled_replies": records[0]["sampled_replies"]} for r in others]
    assert (run / "drafter" / "config.json").is_file()
    walked = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "walked_tau" in r]
    assert walked == [2, 4]
    result = json.loads((run / "eval.json").read_text())
    assert set(result["per_set"]) == {"mt-bench", "humaneval", "gsm8k"}
    assert all(v["num_prompts"] == 2 and v["mismatched_turns"] == 0 for v in result["per_set"].values())
    assert said[-1] == recipe.served_line(result, run / "drafter")
    assert said[-1].startswith("dflash-train train: served tau mt-bench ")
    said.clear()
    assert recipe.run_recipe(plan, log=said.append) == 0
    assert f"dflash-train train: {tmp_path / 'regen.jsonl'} already holds 6 regenerated conversations" in said
    assert f"dflash-train train: {answered} already holds 3 regenerated word-problems records" in said
    assert f"dflash-train train: {plan.sampled_path(answered, 1)} already holds 3 regenerated sampled replies " \
           f"(seed 1) of {answered.name}" in said
    assert said[-1].startswith("dflash-train train: served tau mt-bench ")
