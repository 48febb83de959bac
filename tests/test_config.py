"""Strict config loading: all problems at once with file and line, overrides, shipped YAMLs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_train.core.config import EMBEDDED_DEFAULT, Config, ConfigError, dump_yaml, load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_three_mistakes_are_reported_together(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "drafter:\n"
        "  num_layers: two\n"        # wrong type (line 2)
        "  blok_size: 16\n"          # unknown key (line 3)
        "optim:\n"
        "  lr: -1.0\n"               # invalid value (line 5)
    )
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    problems = err.value.problems
    assert len(problems) == 3
    assert f"{bad}:2: drafter.num_layers" in problems[0] and "integer" in problems[0]
    assert f"{bad}:3: drafter.blok_size" in problems[1] and "block_size" in problems[1]
    assert f"{bad}:5: optim.lr" in problems[2] and "> 0" in problems[2]


def test_overrides_are_typed_and_checked():
    cfg = load_config(None, ["optim.lr=3e-4", "drafter.target_layer_ids=[1, 2]", "train.compile=true"])
    assert cfg.optim.lr == 3e-4 and cfg.drafter.target_layer_ids == [1, 2] and cfg.train.compile is True
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.seed=abc", "log.nope=1", "data.token_budget=10", "oops"])
    text = str(err.value)
    assert "command line override train.seed" in text and "unknown setting 'log.nope'" in text
    assert "token_budget" in text and "section.key=value" in text


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="objective.gamma has no default"):
        load_config(None, ["drafter.block_size=12"])
    assert load_config(None, ["drafter.block_size=12", "objective.gamma=6"]).objective.gamma == 6.0


def test_every_shipped_yaml_loads():
    files = sorted(CONFIGS.glob("*.yaml"))
    assert {f.name for f in files} >= {"default.yaml", "tiny.yaml", "qwen3-8b.yaml"}
    for f in files:
        assert isinstance(load_config(f), Config)


def test_shipped_default_is_the_embedded_default():
    assert load_config(CONFIGS / "default.yaml") == load_config(None)
    assert EMBEDDED_DEFAULT["train"]["max_steps"] == load_config(None).train.max_steps


def test_paper_recipe_defaults_under_a_file(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("target:\n  path: /models/x\n")
    cfg = load_config(f)
    assert (cfg.optim.lr, cfg.optim.warmup_ratio, cfg.optim.grad_clip, cfg.train.epochs) == (6e-4, 0.04, 1.0, 6)
    assert (cfg.objective.num_anchors, cfg.data.max_length, cfg.drafter.block_size) == (512, 3072, 16)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(CONFIGS / "qwen3-8b.yaml", ["optim.lr=1e-4"])
    dump_yaml(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


def test_unknown_key_does_not_hide_other_mistakes_of_its_section(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lrr: 1.0\n  lr: -2.0\n  warmup_ratio: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    problems = err.value.problems
    assert len(problems) == 3
    assert "optim.lrr" in problems[0] and "optim.lr must be > 0" in problems[1] and "warmup_ratio" in problems[2]


def test_cli_takes_overrides_on_both_sides_of_an_option(monkeypatch):
    from dflash_train.app import cli, commands

    seen = []
    monkeypatch.setattr(commands, "run_train", lambda args: seen.append((args.output_dir, args.overrides)) or 0)
    assert cli.main(["train", "optim.lr=1e-3", "--output-dir", "x", "train.grad_accum=2", "log.every=5"]) == 0
    assert seen == [("x", ["optim.lr=1e-3", "train.grad_accum=2", "log.every=5"])]
    with pytest.raises(SystemExit) as stop:  # anything else left over is still an error
        cli.main(["train", "optim.lr=1e-3", "--output-dir", "x", "--no-such-flag"])
    assert stop.value.code == 2


def test_objective_levers_are_checked():
    cfg = load_config(None, ["objective.labels=distill", "objective.weighting=dpace", "drafter.block_size=12"])
    assert cfg.objective.labels == "distill" and cfg.objective.dpace_alpha == 0.5  # D-PACE needs no gamma
    with pytest.raises(ConfigError) as err:
        load_config(None, ["objective.weighting=dpace", "objective.gamma=7", "objective.dpace_alpha=1.5",
                           "objective.labels=soft"])
    text = str(err.value)
    assert "objective.gamma is the decay of objective.weighting=decay" in text
    assert "objective.dpace_alpha must be in [0, 1]" in text and "'distill'" in text


def test_distillation_refuses_targets_whose_logits_are_not_the_lm_head_product():
    from transformers import AutoConfig

    from dflash_train.train.loop import distill_problem

    assert distill_problem(AutoConfig.for_model("llama")) is None
    assert distill_problem(AutoConfig.for_model("gemma2")) is not None  # final_logit_softcapping=30
    assert "logits_scaling=4.0" in distill_problem(AutoConfig.for_model("granite", logits_scaling=4.0))


def test_the_embedded_default_says_what_it_is_in_its_first_line(monkeypatch, capsys):
    """`dflash-train train` with no arguments first says it is a smoke-sized run (from the config
    it runs, so the line cannot drift from it); a --config or an override says nothing."""
    from dflash_train.app import cli, commands

    ran = []
    monkeypatch.setattr(commands, "train", lambda cfg, **kwargs: ran.append(cfg))
    assert cli.main(["train"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    cfg = load_config(None)
    assert ran == [cfg] and "smoke-sized" in first and "does not make a drafter that accelerates" in first
    assert f"{cfg.drafter.num_layers}-layer drafter" in first and f"{cfg.train.max_steps} steps" in first
    assert cli.main(["train", "train.max_steps=5"]) == 0
    assert cli.main(["train", "--config", str(CONFIGS / "default.yaml")]) == 0
    assert "smoke-sized" not in capsys.readouterr().out and len(ran) == 3


def test_performance_settings_are_checked_and_resolved():
    """train.flex_kernel_options, train.fp8 and train.anchor_buckets_per_doubling: bad values
    are named with the fix; flex options resolve to the small-head tiles only by default."""
    import torch

    from dflash_train.train.compilation import SMALL_HEAD_FLEX_OPTIONS, Compilation

    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.flex_kernel_options={BLOCK_X: 64, BLOCK_N1: 48, bwd_num_warps: 0, "
                           "fwd_USE_TMA: 1, side_USE_TMA: true, ROWS_GUARANTEED_SAFE: true}", "train.fp8=fast",
                           "train.anchor_buckets_per_doubling=3"])
    text = str(err.value)
    assert "train.flex_kernel_options.BLOCK_X: unknown option (known: BLOCK_M" in text
    assert "train.flex_kernel_options.side_USE_TMA: unknown option" in text
    assert "train.flex_kernel_options.ROWS_GUARANTEED_SAFE: unknown option" in text  # NaN under the mask rule
    assert "train.flex_kernel_options.BLOCK_N1 must divide the BlockMask's 128-token tiles" in text
    assert "train.flex_kernel_options.bwd_num_warps must be a positive integer, got 0" in text
    assert "train.flex_kernel_options.fwd_USE_TMA must be true or false, got 1" in text
    assert "train.fp8: expected 'tensorwise' | 'rowwise' | 'rowwise_with_gw_hp' | null, got 'fast'" in text
    assert "train.anchor_buckets_per_doubling must be 0 (exact counts) or a power of two" in text
    assert load_config(None, ["train.fp8=tensorwise"]).train.fp8 == "tensorwise"
    assert load_config(None, []).train.fp8 is None
    cuda = torch.device("cuda")
    for overrides, head_dim, expected in (([], 64, SMALL_HEAD_FLEX_OPTIONS), ([], 128, {}),
                                          (["train.flex_kernel_options={}"], 64, {}),
                                          (["train.flex_kernel_options={num_warps: 4}"], 128, {"num_warps": 4}),
                                          (["train.flex_kernel_options={BLOCK_M1: 64, bwd_num_stages: 2, bwd_USE_TMA: true}"],
                                           64, {"BLOCK_M1": 64, "bwd_num_stages": 2, "bwd_USE_TMA": True})):
        plan = Compilation.decide(load_config(None, overrides), cuda, "flex", head_dim=head_dim)
        assert dict(plan.flex_options) == expected, (overrides, head_dim)
    # Exact anchor counts (the default) compile flex with the query count dynamic; buckets do not.
    assert Compilation.decide(load_config(None, []), cuda, "flex", head_dim=64).flex_dynamic
    buckets = load_config(None, ["train.anchor_buckets_per_doubling=4"])
    assert not Compilation.decide(buckets, cuda, "flex", head_dim=64).flex_dynamic


def test_intra_op_threads_default_to_one_on_a_gpu():
    """train.num_threads: a setting wins; unset, a GPU run's host uses one intra-op thread and a
    CPU run keeps torch's choice."""
    import torch

    from dflash_train.train.loop import intra_op_threads

    assert intra_op_threads(None, torch.device("cuda")) == 1
    assert intra_op_threads(None, torch.device("cpu")) is None
    assert intra_op_threads(4, torch.device("cuda")) == 4
    assert intra_op_threads(3, torch.device("cpu")) == 3


@pytest.mark.parametrize("options", [None, {"BLOCK_M": 64}])
def test_flex_kernel_passes_is_divisible_where_both_lengths_are_multiples_of_128(monkeypatch, options):
    """compile_flex_attention hands the drafter a kernel that adds IS_DIVISIBLE=True to the
    configured options exactly where the query and key lengths are both multiples of 128 (what
    inductor decides from static lengths but cannot from the symbolic ones of a dynamic compile),
    and otherwise passes the configured options alone."""
    import torch

    from dflash_train.core import drafter
    from dflash_train.train import compilation

    calls = []

    def recording_kernel(q, k, v, **kwargs):
        calls.append(kwargs.get("kernel_options"))
        return q

    monkeypatch.setattr(drafter, "flex_kernel", None)
    monkeypatch.setitem(compilation._flex, True, recording_kernel)
    compilation.compile_flex_attention(options, dynamic=True)
    for q_len, kv_len in ((256, 16640), (256, 16600), (200, 16640), (128, 128)):
        q, kv = torch.zeros(1, 2, q_len, 4), torch.zeros(1, 1, kv_len, 4)
        assert drafter.flex_kernel(q, kv, kv, block_mask=None, scale=0.5, enable_gqa=True) is q
    given = options or None
    assert calls == [{**(options or {}), "IS_DIVISIBLE": True}, given, given, {**(options or {}), "IS_DIVISIBLE": True}]


def test_train_compile_covers_the_drafters_layers_and_its_two_norms_outside_them():
    """compile_drafter_layers (train.compile) compiles each decoder layer and the two norms the
    drafter runs outside them (the fc output's and the final one): eager, each norm makes about
    nine passes over a float32 copy of its input, forward and backward. Module.compile keeps the
    parameters' names (checkpoints and exports unchanged)."""
    from conftest import tiny_drafter
    from dflash_train.train.compilation import compile_drafter_layers

    drafter = tiny_drafter()
    names = [n for n, _ in drafter.named_parameters()]
    compile_drafter_layers(drafter)
    compiled = [m for m in (*drafter.layers, drafter.hidden_norm, drafter.norm)
                if getattr(m, "_compiled_call_impl", None) is not None]
    assert len(compiled) == len(drafter.layers) + 2
    assert [n for n, _ in drafter.named_parameters()] == names
