"""Checkpoints: the stateful parts of a run, saved and resumed, on any topology of the same batch.

Owns the `OUTPUT/checkpoints/step-N/` folders and `CheckpointManager`, which saves the parts a
run declares (drafter weights, optimizer, scheduler, data position, stop control, metric sums,
RNG) every `checkpoint.every` steps, and resumes from the newest good folder. Each folder is
written into a temporary folder and renamed into place (atomic), carries a JSON sidecar
(`meta.json`) with the SHA-256 of every file, and the newest K are kept. Resume takes the newest
checkpoint whose files match their hashes and says which it took and why it passed over others.
Nothing is unpickled: weights are safetensors, optimizer and RNG states load with
`torch.load(weights_only=True)`, the rest is JSON.

The state is global, not per rank: drafter replicas hold the same weights, optimizer and
scheduler; the data position is the next global micro-batch index; the metric sums are saved
summed over the drafter ranks. So a run saved with D drafter ranks and grad_accum A resumes
with D' ranks and A' whenever D x A = D' x A' (the same global micro-batches per step), in
either mode and with any number of target ranks; another global batch is refused. Each rank also
writes its own RNG states (`rank-R.pt`), restored when the topology is unchanged.

A sharded drafter (train.fsdp) saves its weights and optimizer as torch.distributed.checkpoint
files in `sharded/` (each drafter rank writes its shards; sharding.ShardedState) instead of
drafter.safetensors and optimizer.pt; the other parts are as above. Either kind resumes on any
number of drafter ranks, with or without FSDP: a sharded run loads an unsharded checkpoint's
whole tensors, and a run without FSDP reads a sharded one whole (sharding.read_sharded).

The served format of a drafter is export.py's.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import random
import shutil
import time
from pathlib import Path
from typing import Callable, Protocol

import torch
import yaml
from safetensors.torch import load_file, save_file

from dflash_train.core.config import Config, SettingsChange, settings_changes, to_dict
from dflash_train.core.drafter import DFlashDrafter, config_from_dict
from dflash_train.core.errors import InputError
from dflash_train.train.sharding import optimizer_by_index, read_sharded

CHECKPOINTS = "checkpoints"
META = "meta.json"
STATE = "trainer_state.json"
DRAFTER_CONFIG = "drafter_config.json"
# Parts stored in files of their own; every other part goes into trainer_state.json by name.
FILES = {"drafter": "drafter.safetensors", "optimizer": "optimizer.pt", "rng": "rng.pt"}
# The part of a sharded drafter and its optimizer (sharding.ShardedState), and the folder of its
# files in a checkpoint (in place of the drafter's and the optimizer's files).
SHARDED = "sharded"


class CheckpointError(InputError):
    """A checkpoint that must not be loaded, or not into this run."""


class Stateful(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# --------------------------------------------------------------------------- parts


class RngState:
    """This process's global random generators: torch's (CPU, and CUDA on a GPU) and Python's.
    No draw of a training step comes from them (each micro-batch has generators of its own,
    masks.step_generator); they are saved so that anything else continues as it would have."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> dict:
        state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict) -> None:
        version, _, gauss = random.getstate()
        random.setstate((version, tuple(state["python"]), gauss))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)


class GlobalSums:
    """The metric sums of the current log interval (metrics.Accumulator) as one state for all
    drafter ranks: saved summed over them (a collective: every drafter rank saves at the same
    step), resumed on drafter 0 with the other ranks' per-rank sums zero. The next log step sums
    the ranks' sums, so it logs the same interval means whatever the topology it resumed on."""

    def __init__(self, acc, dist) -> None:
        self.acc, self.dist = acc, dist

    def state_dict(self) -> dict:
        state = self.acc.state_dict()  # host copy: checkpoint steps only
        if len(self.dist.drafter_ranks) > 1:
            total = type(self.acc)(self.acc.block_size, self.acc.device)
            total.load_state_dict(state)
            what = "waiting for the metric sums of a checkpoint"
            total.all_reduce(lambda t: self.dist.all_reduce_drafters([t], what))
            state = total.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.dist.drafter_index > 0:  # drafter 0 carries the sums of all ranks
            per_step = type(self.acc).PER_STEP
            state = {"sums": {k: v if k in per_step else 0.0 for k, v in state["sums"].items()},
                     **{k: [0.0] * len(v) for k, v in state.items() if k != "sums"}}
        self.acc.load_state_dict(state)


class BestCheckpoint:
    """`checkpoint.keep_best`: the evaluation step with the best walked validation tau so far
    (a part of trainer_state.json, so a resumed run keeps comparing against it). Its checkpoint
    folder is never removed by keep-k, and the run exports it at the end."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.value: float | None = None

    def offer(self, step: int, value: float | None) -> bool:
        """Take `value` (the walked tau of `step`) if it beats the best so far; ties keep the
        earlier step. Whether it was taken."""
        if value is None or not math.isfinite(value) or (self.value is not None and value <= self.value):
            return False  # missing (no walk on this step), nan (no cycle walked), or not better
        self.step, self.value = int(step), float(value)
        return True

    def state_dict(self) -> dict:
        return {"step": self.step, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.value = state["step"], state["value"]


class DataPosition:
    """The data position after a step: the next global micro-batch index (batch g is batch
    g mod n of epoch g div n, batching.BatchStream), with what it takes to mean the same batches:
    the batch plan's identity and the micro-batches per step (D drafter ranks x grad_accum A)."""

    def __init__(self, stream, assign) -> None:
        self.stream, self.assign = stream, assign

    def state(self, step: int) -> dict:
        return {"next_index": step * self.assign.micro_per_step, "micro_per_step": self.assign.micro_per_step,
                **self.stream.identity()}

    def check(self, path: Path, saved: dict, topology: dict, step: int) -> None:
        """Refuse a checkpoint whose global batch or batch plan differs from this run's."""
        a = self.assign
        M, M_saved = a.micro_per_step, saved["micro_per_step"]
        if M_saved != M:
            D, A = a.num_drafters, a.grad_accum
            if M_saved % D == 0:
                fix = f"set train.grad_accum={M_saved // D} for {D} drafter rank{'s' * (D > 1)}"
            else:
                fix = (f"launch a number of drafter ranks that divides {M_saved} and set train.grad_accum to "
                       f"{M_saved} divided by it")
            raise CheckpointError(
                f"{path}: saved by a run of {topology['num_drafters']} drafter rank(s) x train.grad_accum="
                f"{topology['grad_accum']} = {M_saved} micro-batches per step, but this run takes {D} x "
                f"{A} = {M}: resuming would change the global batch. To continue the run, {fix}; or "
                f"start a new run in another output_dir")
        try:
            next_index = self.stream.check_state(saved)
        except ValueError as err:
            raise CheckpointError(f"{path}: {err}") from err
        assert next_index == step * M  # our own invariant

    def describe(self, step: int) -> str:
        epoch, position = divmod(step * self.assign.micro_per_step, self.stream.plan.num_batches)
        return f"epoch {epoch}, batch {position}"


# --------------------------------------------------------------------------- folders


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


def verify_checkpoint(path: Path, only: tuple[str, ...] | None = None) -> str | None:
    """None if every file (with `only`: those of these names, a name ending in / every file in
    that folder) matches the sidecar's hash, else what is wrong."""
    meta_file = path / META
    if not meta_file.is_file():
        return "no meta.json (an interrupted save)"
    try:
        meta = json.loads(meta_file.read_text())
        files = meta["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return f"meta.json unreadable ({err})"
    missing = [name for name in only or () if not any(_selected(f, (name,)) for f in files)]
    if missing:
        return f"meta.json lists no {', '.join(missing)}"
    for name, digest in files.items():
        if only is not None and not _selected(name, only):
            continue
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if _sha256(f) != digest:
            return f"{name} does not match its checksum (truncated or corrupted)"
    return None


def _selected(name: str, only: tuple[str, ...]) -> bool:
    return any(name == o or (o.endswith("/") and name.startswith(o)) for o in only)


def is_sharded(path: Path) -> bool:
    """Whether checkpoint `path` holds a sharded drafter (train.fsdp) rather than whole files."""
    return (path / SHARDED).is_dir()


def find_resumable(output_dir: str | Path, log=print) -> Path | None:
    """The newest checkpoint that verifies; says which it took and which it passed over."""
    for path in reversed(list_checkpoints(output_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            log(f"resuming from {path}")
            return path
        log(f"skipping checkpoint {path}: {problem}")
    return None


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
    """Every part of checkpoint `path`, whole; a sharded one's optimizer state is keyed by
    parameter name."""
    sharded = is_sharded(path)
    return {
        "drafter": read_sharded(path / SHARDED, "drafter") if sharded else load_file(str(path / FILES["drafter"]),
                                                                                     device=str(device)),
        "optimizer": read_sharded(path / SHARDED, "optimizer") if sharded else _load_tensors(
            path / FILES["optimizer"], device),
        "rng": _load_tensors(path / FILES["rng"], "cpu"),
        "trainer": json.loads((path / STATE).read_text()),
        "drafter_config": json.loads((path / DRAFTER_CONFIG).read_text()),
    }


def drafter_from_checkpoint(path: Path):
    """The drafter (fp32 training weights) stored in a checkpoint folder. Only the drafter's
    own files are read and verified (weights and config): exporting needs no optimizer state."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such folder; give a run's checkpoints/step-N folder")
    if (path / CHECKPOINTS).is_dir():
        found = list_checkpoints(path)
        raise CheckpointError(f"{path} is a run folder: give one of its checkpoints, e.g. "
                              f"{found[-1] if found else path / CHECKPOINTS / 'step-N'}")
    sharded = is_sharded(path)
    problem = verify_checkpoint(path, only=(f"{SHARDED}/" if sharded else FILES["drafter"], DRAFTER_CONFIG))
    if problem is not None:
        raise CheckpointError(f"{path}: not a usable checkpoint: {problem}")
    model = DFlashDrafter(config_from_dict(json.loads((path / DRAFTER_CONFIG).read_text()), str(path / DRAFTER_CONFIG)))
    model.load_state_dict(read_sharded(path / SHARDED, "drafter") if sharded else load_file(str(path / FILES["drafter"])))
    return model


def _write_folder(tmp: Path, states: dict, record: dict, texts: dict[str, str],
                  halfway: Callable[[Path], None] | None) -> None:
    """The files of one checkpoint, in `tmp` (which may hold the sharded files already): the
    parts of FILES, then trainer_state.json (the other parts, by name, and `record`), the texts,
    and meta.json with every file's hash."""
    if "drafter" in states:  # else sharded (train.fsdp): in tmp/sharded/
        save_file({k: v.detach().contiguous().cpu() for k, v in states["drafter"].items()}, str(tmp / FILES["drafter"]))
        torch.save(states["optimizer"], tmp / FILES["optimizer"])
    if halfway is not None:
        halfway(tmp)
    torch.save(states["rng"], tmp / FILES["rng"])
    state = {**record, **{k: v for k, v in states.items() if k not in FILES}}
    (tmp / STATE).write_text(json.dumps(state, indent=1))
    for name, text in texts.items():
        (tmp / name).write_text(text)
    written = [p for p in sorted(tmp.rglob("*")) if p.is_file()]
    files = {p.relative_to(tmp).as_posix(): _sha256(p) for p in written}
    meta = {"step": record["step"], "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files}
    (tmp / META).write_text(json.dumps(meta, indent=1))
    for p in [*written, tmp / META]:
        _fsync(p)


# --------------------------------------------------------------------------- the manager


class CheckpointManager:
    """Saves and resumes the declared stateful parts of one rank's run.

    `parts` maps a name to something with `state_dict()` / `load_state_dict()`, or to None on a
    rank that lacks it (a target rank has no drafter); a `best` part (BestCheckpoint) names a
    checkpoint that keep-k never removes; a `sharded` part (sharding.ShardedState, train.fsdp)
    stands for the drafter and the optimizer, and every drafter rank writes its shards. The
    leader (drafter rank 0) holds every other part and writes the folder; with several ranks it
    opens a shared temporary folder, every rank writes its own `rank-R` files (and shards) into
    it, then the leader adds the rest and renames it. Every rank calls `save` at the same steps
    (parts may run collectives there) and `resume` once.
    `enabled=False` (benchmarks): nothing is resumed or written, on every rank alike."""

    def __init__(self, output_dir: str | Path, section, dist, position: DataPosition,
                 parts: dict[str, Stateful | None], texts: Callable[[], dict[str, str]], faults,
                 enabled: bool = True, log=print) -> None:
        self.out, self.every, self.keep = Path(output_dir), section.every, section.keep
        self.dist, self.position, self.parts, self.texts = dist, position, parts, texts
        self.faults, self.enabled, self.log = faults, enabled, log
        self.saved_step: int | None = None
        # Called with the checkpoint resume takes, before anything is loaded from it: the
        # settings this run changes (a list, kept in `changes`), or a CheckpointError for a
        # change it cannot resume with (loop.py sets it: settings_check).
        self.settings_check: Callable[[Path], list] | None = None
        self.changes: list = []

    def due(self, step: int) -> bool:
        return self.enabled and step % self.every == 0

    def topology(self) -> dict:
        return {**self.dist.identity(), "grad_accum": self.position.assign.grad_accum}

    def save(self, step: int) -> Path:
        """The checkpoint of `step` (the number of steps taken); returns its folder."""
        root = checkpoint_root(self.out)
        final = root / f"step-{step}"
        if not self.enabled:
            return final
        sharded = self.parts.get(SHARDED)
        states = {name: part.state_dict() for name, part in self.parts.items() if part is not None and name != SHARDED}
        d = self.dist
        tmp = None
        if d.world_size > 1:
            tmp = root / f".tmp-step-{step}-shared"
            if d.is_leader:
                self._fresh_tmp(tmp)
            d.barrier(f"waiting for the other ranks to start the checkpoint of step {step}")
            torch.save(states["rng"], tmp / f"rank-{d.rank}.pt")
            (tmp / f"rank-{d.rank}.json").write_text(json.dumps({"rank": d.rank, "role": d.role}))
            for name in (f"rank-{d.rank}.pt", f"rank-{d.rank}.json"):
                _fsync(tmp / name)
        elif sharded is not None:  # one process: its sharded files go into the folder first
            tmp = self._fresh_tmp(root / f".tmp-step-{step}-{os.getpid()}")
        if sharded is not None:  # every drafter rank writes its shards (a collective of theirs)
            sharded.save(tmp / SHARDED)
        if d.world_size > 1:
            d.barrier(f"waiting for every rank's state of the checkpoint of step {step}")
        if d.is_leader:
            self._write(step, states, tmp)
            self.faults.after_save(step, final)
        self.saved_step = step
        return final

    def _write(self, step: int, states: dict, tmp: Path | None) -> None:
        """Write `step-N/` atomically, then drop all but the newest `keep` checkpoints.
        Temporary folders left by a killed save are removed here; resume never looks at them."""
        root = checkpoint_root(self.out)
        final = root / f"step-{step}"
        if tmp is None:
            tmp = self._fresh_tmp(root / f".tmp-step-{step}-{os.getpid()}")
        record = {"step": step, "topology": self.topology(), "data": self.position.state(step)}
        try:
            _write_folder(tmp, states, record, self.texts(), self.faults.save_hook(step))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(err, OSError):
                raise OSError(f"saving checkpoint step-{step} in {root} failed ({err}); the previous "
                              f"checkpoints are untouched") from err
            raise
        best = self.parts.get("best")
        kept = f"step-{best.step}" if best is not None and best.step is not None else None
        for old in list_checkpoints(self.out)[: -self.keep]:
            if old.name != kept:
                shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def _fresh_tmp(tmp: Path) -> Path:
        """The temporary folder `tmp` made empty, with the others a killed save left removed
        (only the leader calls this: one process writes the folder's own files)."""
        tmp.parent.mkdir(parents=True, exist_ok=True)
        for stale in tmp.parent.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def resume(self) -> int | None:
        """Restore the newest verified checkpoint into this rank's parts; returns its step (None:
        nothing to resume). Every rank must find the same one."""
        if not self.enabled:
            return None
        d = self.dist
        found = find_resumable(self.out, log=self.log) if self.out.is_dir() else None
        step = int(found.name[5:]) if found is not None else -1
        if d.world_size > 1:
            neg_min, most = d.agree([-step, step], "waiting for the other ranks to pick a checkpoint")
            if -neg_min != most:
                raise CheckpointError(f"{d.name()}: the ranks found different checkpoints to resume from (steps "
                                      f"{-neg_min} and {most}): is output_dir on a shared file system?")
        if found is None:
            return None
        state = json.loads((found / STATE).read_text())
        if "data" not in state:
            raise CheckpointError(f"{found}: written by an earlier version of dflash-train, which kept the state "
                                  f"per rank; continue it with that version, or use a new output_dir")
        if self.settings_check is not None:
            self.changes = self.settings_check(found)
        self.position.check(found, state["data"], state["topology"], step)
        same = state["topology"] == self.topology()
        for name, part in self.parts.items():
            if name == SHARDED and part is not None:
                self._load_sharded(found, part)
            elif part is not None:
                part.load_state_dict(self._part_state(found, name, state, same))
        self.saved_step = step
        moved = "" if same else (f"; it was saved by a run of {state['topology']}, continued as "
                                 f"{self.topology()}")
        self.log(f"resumed at step {step} ({self.position.describe(step)}){moved}")
        return step

    @staticmethod
    def _load_sharded(path: Path, part) -> None:
        """A sharded drafter and optimizer (sharding.ShardedState) from either kind of checkpoint:
        its sharded files, or the whole tensors of an unsharded one (read on the CPU)."""
        if is_sharded(path):
            part.load(path / SHARDED)
        else:
            part.load_whole(load_file(str(path / FILES["drafter"])), _load_tensors(path / FILES["optimizer"], "cpu"))

    def _part_state(self, path: Path, name: str, state: dict, same_topology: bool):
        device = self.dist.device
        if name in ("drafter", "optimizer") and is_sharded(path):  # saved sharded, resumed whole
            whole = read_sharded(path / SHARDED, name)
            if name == "drafter":
                return {k: v.to(device) for k, v in whole.items()}
            return optimizer_by_index(whole, [n for n, _ in self.parts["drafter"].named_parameters()])
        if name == "drafter":
            return load_file(str(path / FILES["drafter"]), device=str(device))
        if name == "optimizer":
            return _load_tensors(path / FILES["optimizer"], device)
        if name == "rng":
            own = path / f"rank-{self.dist.rank}.pt"
            return _load_tensors(own if same_topology and own.is_file() else path / FILES["rng"], "cpu")
        if name == "best" and name not in state:  # saved before checkpoint.keep_best was turned on
            return BestCheckpoint().state_dict()
        return state[name]


def settings_check(cfg: Config, found: Path) -> list[SettingsChange]:
    """The settings this run (`cfg`) changes from those checkpoint `found` was trained with (its
    config.yaml). A change a resumed run cannot make (config.RESUME_FIXED: the drafter's
    architecture, the target, the data and its batches, the seed) is a CheckpointError naming
    every such field and the two choices; the others are returned, to be applied and logged."""
    try:
        saved = yaml.safe_load((found / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return []  # nothing to compare with (written before checkpoints kept their config)
    if not isinstance(saved, dict):
        return []
    changes = settings_changes(saved, to_dict(cfg))
    fixed = [c for c in changes if c.fixed]
    if fixed:
        back = " ".join(f"{c.name}={json.dumps(c.saved)}" for c in fixed)
        raise CheckpointError(f"{found} was trained with other settings, which a resumed run cannot change: "
                              f"{', '.join(map(str, fixed))}; to continue that run, set them back ({back}), or to "
                              f"train with the new ones, choose another output_dir")
    return changes
