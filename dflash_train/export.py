"""The served format of a drafter: what vLLM, SGLang and transformers read from a drafter folder.

Owns `export_drafter`: the published DFlash layout (config.json + model.safetensors) written
atomically (assets.atomic_folder), plus this project's modeling code so that
`AutoModel.from_pretrained(folder, trust_remote_code=True)` builds the very model that was trained.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch

from dflash_train.assets import atomic_folder
from dflash_train.drafter import CONFIG_NAME, write_config_json


def export_drafter(drafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the published drafter format plus our modeling code, so that vLLM / SGLang and
    `AutoModel.from_pretrained(out_dir, trust_remote_code=True)` both load it."""
    import dflash_train.drafter as drafter_module
    import dflash_train.modeling_dflash as modeling_module

    out = Path(out_dir)
    with atomic_folder(out) as tmp:
        exported = copy.deepcopy(drafter).to("cpu", dtype)
        exported.save_pretrained(tmp)
        cfg = json.loads((tmp / CONFIG_NAME).read_text())
        cfg["auto_map"] = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
        write_config_json(cfg, tmp / CONFIG_NAME)
        shutil.copyfile(drafter_module.__file__, tmp / "drafter.py")
        shutil.copyfile(modeling_module.__file__, tmp / "modeling_dflash.py")
    return out
