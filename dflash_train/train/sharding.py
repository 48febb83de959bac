"""A sharded drafter (`train.fsdp`): the drafter, its gradients and its AdamW state split over
the drafter ranks with FSDP2.

Owns `Sharding`, one drafter rank's part: the device mesh over the drafter ranks (on one
process, a process group of its own), `fully_shard` per decoder layer and then the rest of the
drafter, gradient sums instead of FSDP's means (the step divides once by the total loss weight,
as without FSDP), the switches of gradient accumulation (no reduction and no resharding before
a rank's last micro-batch of a step), the zero micro-batch that stands in for a failed one so
that every rank runs the same collectives, and the whole weights gathered for evaluation and
export. Also owns the sharded checkpoint files (`ShardedState`, torch.distributed.checkpoint):
written by every drafter rank, read back on any number of ranks, and readable whole in one
process without FSDP (`read_sharded`); and the two layouts of an optimizer's state (by index,
as `torch.optim` keeps it, and by parameter name, as torch.distributed.checkpoint does).

Numerics are those of the replicated drafter: float32 weights are gathered as they are, the
step's autocast makes the same bfloat16 products on a GPU, and gradients are reduced in
float32 (`MixedPrecisionPolicy(reduce_dtype=float32)`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from dflash_train.core.devices import whole
from dflash_train.core.drafter import DFlashDrafter
from dflash_train.train.dist import Dist

ZERO_CONTEXT = 16
"""Context tokens of the zero micro-batch (a multiple of 16, as float8 products need)."""


class Sharding:
    """train.fsdp on one drafter rank. Build after the process groups (`Dist`); `shard` the
    drafter before its optimizer is made; `close` at the end of the run."""

    def __init__(self, dist: Dist) -> None:
        self.dist, self.device = dist, dist.device
        self.own_group = dist.world_size == 1 and not tdist.is_initialized()
        if self.own_group:  # one process: FSDP still needs a (one-rank) process group
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
            tdist.init_process_group(backend, store=tdist.HashStore(), rank=0, world_size=1, timeout=dist.timeout)
        self.group = tdist.group.WORLD if dist.world_size == 1 else dist.drafters
        self.mesh = DeviceMesh.from_group(self.group, self.device.type)

    def shard(self, drafter: DFlashDrafter) -> DFlashDrafter:
        """FSDP2 over the mesh, in place: each decoder layer one group (gathered for its forward
        and again for its backward), the rest (fc and the two norms) the root's. Gradients are
        summed over the ranks, not averaged. On one rank a layer stays gathered from its forward
        to its backward: a shard of one is the whole, and gathering it again is only a copy."""
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for layer in drafter.layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=policy, reshard_after_forward=self.mesh.size() > 1)
        fully_shard(drafter, mesh=self.mesh, mp_policy=policy)
        for module in drafter.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # a plain sum on every backend (gloo too)
        return drafter

    def micro_batch(self, drafter, last: bool) -> None:
        """Before a micro-batch's forward. Over several ranks the gradients are reduce-scattered
        and the weights resharded after every micro-batch's backward, so that a rank never holds
        more than its shard of them between micro-batches (FSDP is for a drafter too large to
        hold whole; grad_accum - 1 more reductions a step are its price). On one rank, where a
        shard is the whole, after the step's last micro-batch only."""
        reduce = last or self.mesh.size() > 1
        drafter.set_requires_gradient_sync(reduce)
        drafter.set_reshard_after_backward(reduce)

    def zero_micro_batch(self, drafter, autocast) -> None:
        """In place of a failed micro-batch: the drafter's forward on a small all-zero input and
        the backward of 0 x its sum. The other ranks' gathers and reductions of this micro-batch
        meet this rank's (every rank runs the same collectives in the same order), and the
        gradient it adds is zero."""
        c, n = drafter.config, len(drafter.target_layer_ids)
        queries = ZERO_CONTEXT * drafter.block_size
        features = torch.zeros(1, ZERO_CONTEXT, n * c.hidden_size, device=self.device)
        blocks = torch.zeros(1, queries, c.hidden_size, device=self.device)
        positions = torch.arange(ZERO_CONTEXT + queries, device=self.device)[None]
        with autocast:
            hidden = drafter(features, blocks, positions)
        (hidden.float().sum() * 0).backward()

    def gather(self, drafter, keep: bool) -> dict[str, torch.Tensor] | None:
        """Every weight whole, one tensor at a time, kept on this rank's CPU where `keep` (None
        elsewhere): a collective of every drafter rank. Any drafter rank may keep it, which
        get_model_state_dict's cpu_offload (global rank 0 only) does not allow."""
        gathered = {}
        for name, tensor in drafter.state_dict().items():
            full = whole(tensor).detach()
            if keep:
                gathered[name] = full.cpu()
        return gathered if keep else None

    def whole_drafter(self, drafter, keep: bool, on_device: bool = True) -> DFlashDrafter | None:
        """A plain drafter with the gathered weights (float32; on this rank's device for
        evaluation, on its CPU without `on_device`: an export, which writes from the CPU, holds no
        second whole drafter on a GPU still full of the run) where `keep`; None elsewhere. A
        collective of every drafter rank."""
        state = self.gather(drafter, keep)
        if state is None:
            return None
        with torch.device("meta"):
            copy = DFlashDrafter(drafter.config)
        copy.load_state_dict(state, assign=True)
        return copy.to(self.device if on_device else "cpu", torch.float32)

    def close(self) -> None:
        """Destroy the process group made for one process (other groups are Dist's)."""
        if self.own_group and tdist.is_initialized():
            tdist.destroy_process_group()
            self.own_group = False


class ShardedState:
    """The checkpoint part of a sharded drafter and its optimizer: saved by every drafter rank
    into one folder of torch.distributed.checkpoint files (each rank writes its shards), and
    loaded from such a folder on any number of ranks, or from an unsharded checkpoint's whole
    tensors."""

    def __init__(self, sharding: Sharding, drafter, optimizer) -> None:
        self.sharding, self.drafter, self.optimizer = sharding, drafter, optimizer

    def save(self, folder: Path) -> None:
        """Write this rank's shards (and, on the first drafter rank, the metadata) into
        `folder`; a collective of every drafter rank."""
        fresh = not self.optimizer.state  # no optimizer step taken yet
        model, optim = get_state_dict(self.drafter, self.optimizer)
        if fresh:  # get_state_dict made AdamW's state by a step of learning rate 0: undone
            self.optimizer.state.clear()
            optim = {"state": {}, "param_groups": optim["param_groups"]}
        dcp.save({"drafter": model, "optimizer": optim}, checkpoint_id=folder, process_group=self.sharding.group)

    def load(self, folder: Path) -> None:
        """Load sharded files written on any number of ranks: each rank reads its own shards."""
        model, optim = get_state_dict(self.drafter, self.optimizer)
        if not any(key.startswith("optimizer.state.") for key in _metadata(folder).state_dict_metadata):
            optim = {"state": {}, "param_groups": optim["param_groups"]}  # saved before the first step
        state = {"drafter": model, "optimizer": optim}
        dcp.load(state, checkpoint_id=folder, process_group=self.sharding.group)
        self._set(state["drafter"], state["optimizer"], StateDictOptions())

    def load_whole(self, model: dict, optim: dict) -> None:
        """Load an unsharded checkpoint: the whole weights and the optimizer's state by index
        (`torch.optim`'s layout, as optimizer.pt holds it), each rank keeping its shards."""
        names = [name for name, _ in self.drafter.named_parameters()]
        self._set(model, optimizer_by_name(optim, names), StateDictOptions(full_state_dict=True))

    def _set(self, model: dict, optim: dict, options: StateDictOptions) -> None:
        set_state_dict(self.drafter, self.optimizer, model_state_dict=model, optim_state_dict=optim, options=options)
        if not optim["state"]:  # saved before the first optimizer step: AdamW starts afresh, as it would have
            self.optimizer.state.clear()


# --------------------------------------------------------------------------- whole states


def read_sharded(folder: Path, part: str) -> dict:
    """One part ("drafter" or "optimizer") of a sharded checkpoint folder, whole, read in this
    process alone (no process group needed): the tensors and values as they were saved, the
    optimizer's state by parameter name."""
    metadata = _metadata(folder)
    state: dict = {}
    for key, item in metadata.state_dict_metadata.items():
        path = metadata.planner_data[key]
        if path[0] == part:
            empty = torch.empty(item.size, dtype=item.properties.dtype) \
                if isinstance(item, TensorStorageMetadata) else None
            _set_nested(state, path, empty)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=folder, no_dist=True)
    if part == "optimizer":
        state[part].setdefault("state", {})  # saved before the first optimizer step: none
    return state[part]


def _metadata(folder: Path):
    """What a sharded checkpoint folder holds: every saved key with its size, and its path in
    the saved state (`planner_data`)."""
    return dcp.FileSystemReader(str(folder)).read_metadata()


def _set_nested(tree: dict, path: tuple, value) -> None:
    """tree[path[0]][path[1]]... = value, making the dicts and lists (integer keys) on the way."""
    node = tree
    for key, following in zip(path[:-1], path[1:]):
        node = _child(node, key, [] if isinstance(following, int) else {})
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def _child(node, key, empty):
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
        if node[key] is None:
            node[key] = empty
        return node[key]
    return node.setdefault(key, empty)


def optimizer_by_name(state: dict, names: list[str]) -> dict:
    """An optimizer state by index (`optimizer.state_dict()`, parameters numbered in the order
    they were given, `names`) keyed by parameter name instead."""
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def optimizer_by_index(state: dict, names: list[str]) -> dict:
    """The inverse of `optimizer_by_name`: what `optimizer.load_state_dict` takes."""
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[n]: s for n, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}
