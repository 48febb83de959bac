"""The served format of a drafter: what vLLM, SGLang and transformers read from a drafter folder.

Owns `export_drafter`: the published DFlash layout (config.json + model.safetensors) written
atomically (assets.atomic_folder), plus this project's modeling code so that
`AutoModel.from_pretrained(folder, trust_remote_code=True)` builds the very model that was trained;
and reading such a folder back for a command (`drafter_config`, `load_drafter`), where a folder
that is not a drafter, or is one for another target, is the user's mistake said in words
(errors.InputError; drafter.py raises plain ValueErrors, as it imports nothing of this package).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

import dflash_train.core.drafter as drafter_module
import dflash_train.core.modeling_dflash as modeling_module
from dflash_train.core.assets import atomic_folder
from dflash_train.core.drafter import CONFIG_NAME, DFlashDrafter, folder_config, target_problems, write_config_json
from dflash_train.core.errors import InputError, MissingPath, folder_problem


def drafter_config(folder: str | Path, name: str, target_config=None):
    """The config of drafter folder `folder` (option or field `name`), checked without loading
    weights: a folder that is not a DFlash drafter, and with `target_config`, one trained for
    another target (every mismatch at once), raise InputError."""
    try:
        config = folder_config(folder)
    except FileNotFoundError as err:
        raise MissingPath(f"{name}: {err}") from err
    except ValueError as err:
        raise InputError(f"{name}: {err}") from err
    problems = target_problems(config, target_config) if target_config is not None else []
    if problems:
        raise InputError(f"{name} {folder} is a drafter for another target: " + "; ".join(problems)
                         + "; give the drafter trained for this target")
    return config


def load_drafter(folder: str | Path, name: str, dtype: torch.dtype | None = None, device=None) -> DFlashDrafter:
    """DFlashDrafter.from_pretrained after `drafter_config`'s checks; weights that do not load
    (a damaged file, names that do not match the config) raise InputError."""
    drafter_config(folder, name)
    try:
        return DFlashDrafter.from_pretrained(folder, dtype=dtype, device=device)
    except (ValueError, SafetensorError) as err:
        raise InputError(f"{name}: {folder}: weights unusable ({err})") from err


def check_export_folder(out_dir: str | Path, name: str, force: bool = False) -> None:
    """Refuse, before anything is loaded, an export folder that cannot be written, one that
    holds anything but an earlier export (the export replaces the whole folder), and, unless
    `force`, an earlier export: a drafter is never replaced without being asked to."""
    out = Path(out_dir)
    problem = folder_problem(out)
    if problem is not None:
        raise InputError(f"{name} {out}: {problem}: choose a folder you can write in")
    if out.is_dir() and any(out.iterdir()):
        if not is_drafter_folder(out):
            raise InputError(f"{name} {out} holds files other than an exported drafter, and an export replaces "
                             f"the whole folder: choose a new or empty folder")
        if not force:
            raise InputError(f"{name} {out} already holds an exported drafter, which this export would replace: "
                             f"pass --force to replace it, or choose another folder")


def is_drafter_folder(folder: Path) -> bool:
    """Whether `folder`'s config.json is a DFlash drafter's (whatever else may be wrong with it)."""
    try:
        raw = json.loads((folder / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and ("dflash_config" in raw or "block_size" in raw)


def export_drafter(drafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the published drafter format plus our modeling code, so that vLLM / SGLang and
    `AutoModel.from_pretrained(out_dir, trust_remote_code=True)` both load it."""
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
