"""Checkpoints, resume, signals and export.

Owns the `OUTPUT/checkpoints/step-N/` folders: each is written into a temporary folder and
renamed into place (atomic), carries a JSON sidecar (`meta.json`) with the SHA-256 of every file,
and the newest K are kept. Resume takes the newest checkpoint whose files match their hashes and
says which it took and why it passed over others. Nothing is unpickled: weights are safetensors,
optimizer state and RNG states load with `torch.load(weights_only=True)`, the rest is JSON.

Also owns the stop flag set by SIGTERM/SIGINT. The served format of a drafter is export.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import time
from pathlib import Path
from typing import Callable

import torch

CHECKPOINTS = "checkpoints"
META = "meta.json"
DRAFTER_CONFIG = "drafter_config.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    drafter_state: dict[str, torch.Tensor],
    optimizer_state: dict,
    rng_state: dict[str, torch.Tensor],
    trainer_state: dict,
    texts: dict[str, str],
    keep: int,
    halfway: Callable[[Path], None] | None = None,
    tmp: Path | None = None,
) -> Path:
    """Write `step-N/` atomically, then drop all but the newest `keep` checkpoints.
    `texts` are small text files stored as they are (resolved config, drafter config).
    `halfway(tmp)` runs after the first files are written (fault injection). Temporary folders
    left by a killed save are removed here; resume never looks at them. `tmp` is a shared
    temporary folder (`begin_shared`) that already holds every rank's own state files."""
    from safetensors.torch import save_file

    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    if tmp is None:
        tmp = root / f".tmp-step-{step}-{os.getpid()}"
        for stale in root.glob(".tmp-step-*"):  # only one process writes checkpoints
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in drafter_state.items()}, str(tmp / "drafter.safetensors"))
        torch.save(optimizer_state, tmp / "optimizer.pt")
        if halfway is not None:
            halfway(tmp)
        if rng_state is not None:  # several ranks: each rank's rank-R.pt holds its own
            torch.save(rng_state, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        for name, text in texts.items():
            (tmp / name).write_text(text)
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
        meta = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files}
        (tmp / META).write_text(json.dumps(meta, indent=1))
        for p in tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            raise OSError(
                f"saving checkpoint step-{step} in {root} failed ({err}); the previous checkpoints "
                f"are untouched"
            ) from err
        raise
    for old in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def shared_tmp(output_dir: str | Path, step: int) -> Path:
    """The temporary folder all ranks of a multi-process run write step `step` into."""
    return checkpoint_root(output_dir) / f".tmp-step-{step}-shared"


def begin_shared(output_dir: str | Path, step: int) -> Path:
    """Called by the writing rank before the others write their own files into it."""
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = shared_tmp(output_dir, step)
    tmp.mkdir()
    return tmp


def write_rank_state(tmp: Path, rank: int, rng_state: dict[str, torch.Tensor], state: dict) -> None:
    """What one rank alone holds (RNG states, its cursor, its interval sums): rank-R.pt/.json."""
    torch.save(rng_state, tmp / f"rank-{rank}.pt")
    (tmp / f"rank-{rank}.json").write_text(json.dumps(state, indent=1))
    for name in (f"rank-{rank}.pt", f"rank-{rank}.json"):
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())


def load_rank_state(path: Path, rank: int) -> tuple[dict, dict]:
    """(rng, state) that rank `rank` saved in checkpoint `path`."""
    if not (path / f"rank-{rank}.json").is_file():
        raise CheckpointError(f"{path}: holds no state of rank {rank} (it was written by a run with other "
                              f"ranks); resume with the topology it was written with")
    return _load_tensors(path / f"rank-{rank}.pt", "cpu"), json.loads((path / f"rank-{rank}.json").read_text())


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete-looking `step-N` folders, oldest first (unverified)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit():
            found.append((int(p.name[5:]), p))
    return [p for _, p in sorted(found)]


def verify_checkpoint(path: Path) -> str | None:
    """None if every file matches the sidecar's hash, else what is wrong."""
    meta_file = path / META
    if not meta_file.is_file():
        return "no meta.json (an interrupted save)"
    try:
        meta = json.loads(meta_file.read_text())
        files = meta["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return f"meta.json unreadable ({err})"
    for name, digest in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if _sha256(f) != digest:
            return f"{name} does not match its checksum (truncated or corrupted)"
    return None


def find_resumable(output_dir: str | Path, log=print) -> Path | None:
    """The newest checkpoint that verifies; says which it took and which it passed over."""
    for path in reversed(list_checkpoints(output_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            log(f"resuming from {path}")
            return path
        log(f"skipping checkpoint {path}: {problem}")
    return None


class CheckpointError(ValueError):
    """A checkpoint file that must not be loaded."""


def _load_tensors(file: Path, device: torch.device | str):
    """torch.load restricted to tensors and plain containers: a file holding any other object
    (which unpickling would construct, running its code) is refused."""
    try:
        return torch.load(file, map_location=device, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{file}: refused to load: it holds objects other than tensors and plain containers "
            f"(loaded with torch.load(weights_only=True); this trainer never writes such files). "
            f"Detail: {str(err).splitlines()[0]}"
        ) from err


def load_checkpoint(path: Path, device: torch.device | str = "cpu") -> dict:
    from safetensors.torch import load_file

    return {
        "drafter": load_file(str(path / "drafter.safetensors"), device=str(device)),
        "optimizer": _load_tensors(path / "optimizer.pt", device),
        "rng": _load_tensors(path / "rng.pt", "cpu") if (path / "rng.pt").is_file() else None,
        "trainer": json.loads((path / "trainer_state.json").read_text()),
        "drafter_config": json.loads((path / DRAFTER_CONFIG).read_text()),
    }


def drafter_from_checkpoint(path: Path):
    """The drafter (fp32 training weights) stored in a checkpoint folder."""
    from safetensors.torch import load_file

    from dflash_train.drafter import DFlashDrafter, config_from_dict

    problem = verify_checkpoint(path)
    if problem is not None:
        raise ValueError(f"{path}: not a usable checkpoint: {problem}")
    model = DFlashDrafter(config_from_dict(json.loads((path / DRAFTER_CONFIG).read_text()), str(path / DRAFTER_CONFIG)))
    model.load_state_dict(load_file(str(path / "drafter.safetensors")))
    return model


class StopFlag:
    """Set by SIGTERM / SIGINT; the training loop finishes its step, saves and exits 0."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous = {}

    def install(self) -> "StopFlag":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
