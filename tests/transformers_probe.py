"""Run by tests/test_export.py in a child process whose PYTHONPATH puts another transformers
release first (4.57.1, the one the official DFlash backend pins): what that release builds
from an exported drafter folder, as JSON on stdout.

    python transformers_probe.py FOLDER[,FOLDER...] [INPUTS.safetensors OUTPUT.safetensors]

For each folder (one JSON list): the transformers version, the config fields it read (the
taps, the rotation style, every RoPE key) and the inverse frequencies and attention scaling of
the rotary embedding it builds. With INPUTS: each
folder's drafter, loaded through `AutoModel.from_pretrained(FOLDER, trust_remote_code=True)`,
runs the published calling convention on the inputs, and OUTPUT holds the output of the i-th
folder's as `hidden_i`.
"""

import json
import sys

import torch
import transformers
from transformers import AutoConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding


def read(folder: str) -> dict:
    config = AutoConfig.from_pretrained(folder)
    rope = Qwen3RotaryEmbedding(config)
    report = {
        "transformers": transformers.__version__,
        "config_class": type(config).__name__,
        "rope_theta": getattr(config, "rope_theta", None),
        "head_dim": config.head_dim,
        "layer_types": list(config.layer_types),
        "sliding_window": config.sliding_window,
        "inv_freq": rope.inv_freq.tolist(),
        "attention_scaling": float(rope.attention_scaling),
        "is_neox_style": getattr(config, "is_neox_style", None),
        "target_layer_ids": (getattr(config, "dflash_config", None) or {}).get("target_layer_ids"),
        "rope_keys": sorted({key for name in ("rope_parameters", "rope_scaling")
                             for key in (getattr(config, name, None) or {})}),
    }
    return report


def main() -> None:
    folders = sys.argv[1].split(",")
    reports = [read(folder) for folder in folders]
    if len(sys.argv) > 2:
        from safetensors.torch import load_file, save_file
        from transformers import AutoModel

        inputs = load_file(sys.argv[2])
        outputs = {}
        for i, (folder, report) in enumerate(zip(folders, reports)):
            model = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
            report["model_class"] = type(model).__name__
            with torch.no_grad():
                out = model(inputs["target_hidden"], inputs["noise_embedding"], inputs["position_ids"])
            outputs[f"hidden_{i}"] = out.contiguous()
        save_file(outputs, sys.argv[3])
    print(json.dumps(reports))


if __name__ == "__main__":
    main()
