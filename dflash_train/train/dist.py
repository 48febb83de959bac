"""Ranks, roles and process groups of a run: one process per device, started by torchrun.

Owns `Dist`, the one object that knows this process's rank, the world size, its device, its
role (target, drafter, or both when colocated) and the process groups, and `Assignment`, the one
pure function from a global micro-batch index to (producer target, consumer drafter, slot) that
target ranks, drafter ranks and colocated data parallelism all use. Also owns the waits on other
ranks: each has a timeout (`topology.timeout_s`), and a peer that died or hung turns into
`PeerFailure`, naming this rank, the peer and what was awaited.

World size 1 (no torchrun) runs the same code: no process group, every collective a no-op.

Groups: `control` (gloo, every rank, CPU tensors: stop agreement, barriers), `drafters` (the
drafter ranks' gradient and metric all-reduce; NCCL on GPU, gloo on CPU), and with
topology.target_tp > 1 one per target group (its target's tensor-parallel collectives, through
the group's `tp_mesh`); batches travel by point-to-point ops on the default group (NCCL on GPU,
gloo on CPU).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh

from dflash_train.core.config import ConfigError, TopologySection
from dflash_train.core.devices import resolve_device
from dflash_train.core.errors import PEER_LOST, UserError

TARGET, DRAFTER, BOTH = "target", "drafter", "both"


class PeerFailure(UserError, RuntimeError):
    """Another rank died or stopped answering within topology.timeout_s."""

    exit_code = PEER_LOST


@dataclass(frozen=True)
class Assignment:
    """Where global micro-batch g goes. An optimizer step s consumes g in [s*M, (s+1)*M), with
    M = grad_accum * num_drafters; drafter d takes the grad_accum consecutive indices starting
    at s*M + d*grad_accum (its slots 0..grad_accum-1). Target g % num_targets produces g
    (colocated: the consuming rank itself). Batch g of the data is batch g % n of epoch g // n."""

    num_targets: int
    num_drafters: int
    grad_accum: int
    colocated: bool

    @property
    def micro_per_step(self) -> int:
        return self.grad_accum * self.num_drafters

    def consumer(self, g: int) -> int:
        return (g % self.micro_per_step) // self.grad_accum

    def slot(self, g: int) -> int:
        return g % self.grad_accum

    def producer(self, g: int) -> int:
        return self.consumer(g) if self.colocated else g % self.num_targets

    def consumed(self, step: int, drafter: int) -> list[int]:
        """The micro-batches drafter `drafter` trains on in 0-based step `step`, in slot order."""
        first = step * self.micro_per_step + drafter * self.grad_accum
        return list(range(first, first + self.grad_accum))

    def produced(self, step: int, target: int) -> list[int]:
        """The micro-batches target `target` makes for 0-based step `step`, in index order."""
        M = self.micro_per_step
        return [g for g in range(step * M, (step + 1) * M) if self.producer(g) == target]

    def group_turns(self, g: int, size: int) -> list[int]:
        """Colocated, with target groups of `size` consecutive drafters (topology.target_tp): the
        micro-batches whose target forwards the group of g's consumer runs together when g is due,
        in member order: the same slot of each member's share of g's step (g among them)."""
        drafter = self.consumer(g)
        first = g - (drafter % size) * self.grad_accum
        return [first + m * self.grad_accum for m in range(size)]

    def max_pair_per_step(self) -> int:
        """Most micro-batches one target sends one drafter in a step (the pattern repeats
        every num_targets steps)."""
        most = 1
        for step in range(self.num_targets):
            counts: dict[tuple[int, int], int] = {}
            for g in range(step * self.micro_per_step, (step + 1) * self.micro_per_step):
                key = (self.producer(g), self.consumer(g))
                counts[key] = counts.get(key, 0) + 1
            most = max(most, *counts.values())
        return most


class Dist:
    """This process's place in the run. Build with `Dist.from_env`."""

    def __init__(self, topology: TopologySection, rank: int, world_size: int, local_rank: int,
                 local_world_size: int, device: torch.device) -> None:
        self.topology = topology
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_world_size = local_rank, local_world_size
        self.device = device
        self.timeout = timedelta(seconds=topology.timeout_s)
        self.disaggregated = topology.mode == "disaggregated"
        if self.disaggregated:
            per_node = topology.num_target_ranks
            self.target_ranks = [r for r in range(world_size) if r % local_world_size < per_node]
            self.drafter_ranks = [r for r in range(world_size) if r % local_world_size >= per_node]
            self.role = TARGET if rank in self.target_ranks else DRAFTER
        else:
            self.target_ranks = self.drafter_ranks = list(range(world_size))
            self.role = BOTH
        # Target groups: target_tp consecutive target ranks (of one node) hold one target replica
        # tensor parallel. A producer of the Assignment is, disaggregated, a group, whose first
        # rank sends (its others only join its forwards); colocated, every rank.
        self.target_tp = tp = topology.target_tp
        self.target_groups = [self.target_ranks[i:i + tp] for i in range(0, len(self.target_ranks), tp)]
        self.producers = [group[0] for group in self.target_groups] if self.disaggregated else self.target_ranks
        self.tp_mesh: DeviceMesh | None = None  # this rank's group's mesh, with target_tp > 1
        self.control = self.drafters = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_env(cls, topology: TopologySection, device_setting: str) -> "Dist":
        """From torchrun's RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE (absent: world size
        1); initialises the process groups. Invalid splits are configuration errors."""
        env = os.environ
        world = int(env.get("WORLD_SIZE", "1"))
        rank, local_rank = int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        kind = resolve_device(device_setting)
        device = torch.device("cuda", local_rank) if kind.type == "cuda" else kind
        if device.type == "cuda":
            torch.cuda.set_device(device)
        problems = []
        if topology.mode == "disaggregated":
            n = topology.num_target_ranks
            if world < 2:
                problems.append("topology.mode=disaggregated needs target and drafter ranks: launch with "
                                "torchrun --nproc_per_node N (N >= 2), or use topology.mode=colocated")
            elif n >= local_world:
                problems.append(f"topology.num_target_ranks={n} leaves no drafter rank on a node of "
                                f"{local_world} ranks: set it to at most {local_world - 1}")
        elif local_world % topology.target_tp:
            problems.append(f"topology.target_tp={topology.target_tp} does not divide the {local_world} rank(s) of a "
                            f"node (a target group spans target_tp ranks of one node): launch a multiple of "
                            f"{topology.target_tp} ranks per node (torchrun --nproc_per_node), or lower target_tp")
        if problems:
            raise ConfigError(problems)
        self = cls(topology, rank, world, local_rank, local_world, device)
        if world > 1:
            self._init_groups()
        return self

    def _init_groups(self) -> None:
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        kw = {"device_id": self.device} if self.device.type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=self.timeout, **kw)
        # Every rank creates every group, in the same order (torch.distributed's rule).
        self.control = dist.new_group(backend="gloo", timeout=self.timeout)
        self.drafters = dist.new_group(self.drafter_ranks, timeout=self.timeout)
        for group in self.target_groups if self.target_tp > 1 else []:
            made = dist.new_group(group, timeout=self.timeout)
            if self.rank in group:
                self.tp_mesh = DeviceMesh.from_group(made, self.device.type, mesh_dim_names=("tp",))

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ who is who

    @property
    def is_target(self) -> bool:
        return self.role in (TARGET, BOTH)

    @property
    def is_drafter(self) -> bool:
        return self.role in (DRAFTER, BOTH)

    @property
    def target_index(self) -> int:
        """Disaggregated: the producer this target rank belongs to (its target group)."""
        return self.target_ranks.index(self.rank) // self.target_tp

    @property
    def is_producer(self) -> bool:
        """Makes shipments (disaggregated: packs and sends them); the other ranks of a target
        group only join its forwards."""
        return self.rank in self.producers

    @property
    def drafter_index(self) -> int:
        return self.drafter_ranks.index(self.rank)

    @property
    def is_leader(self) -> bool:
        """The drafter rank that logs, writes checkpoints and exports."""
        return self.rank == self.drafter_ranks[0]

    def name(self, rank: int | None = None) -> str:
        rank = self.rank if rank is None else rank
        if self.world_size == 1:
            return "rank 0"
        if not self.disaggregated:
            return f"rank {rank}"
        if rank in self.target_ranks:
            return f"rank {rank} (target {self.target_ranks.index(rank) // self.target_tp})"
        return f"rank {rank} (drafter {self.drafter_ranks.index(rank)})"

    def assignment(self, grad_accum: int) -> Assignment:
        return Assignment(len(self.producers), len(self.drafter_ranks), grad_accum, not self.disaggregated)

    def target_turns(self, assign: Assignment):
        """The producer's turns (produce.Producer): colocated with target_tp > 1, micro-batch g ->
        the micro-batches whose forwards this rank's group runs together when g is due
        (Assignment.group_turns); else None (each micro-batch alone)."""
        if self.disaggregated or self.target_tp == 1:
            return None
        return functools.partial(assign.group_turns, size=self.target_tp)

    def lag(self, assignment: Assignment) -> int:
        """Steps a target rank may run ahead of the drafters. Its sends to one drafter for the
        steps after the drafters' current one must fit in topology.queue_depth, or a target
        blocked on a full queue and a drafter waiting for that target at the stop agreement
        would wait on each other."""
        return self.topology.queue_depth // assignment.max_pair_per_step()

    def identity(self) -> dict:
        """What a checkpoint records of the topology; resume refuses another. topology.target_tp
        is not in it: the frozen target is not saved, and its groups change neither the batches,
        nor the numbers, nor which rank holds which drafter state and random stream."""
        return {"mode": self.topology.mode, "world_size": self.world_size,
                "num_targets": len(self.target_ranks), "num_drafters": len(self.drafter_ranks)}

    def log_fn(self, log=print):
        """`log` on the leader, nothing elsewhere (one rank prints)."""
        return log if self.is_leader else (lambda *a, **k: None)

    # ------------------------------------------------------------------ waiting on others

    def wait(self, work, what: str) -> None:
        """Wait for an async op; a dead peer (connection lost) or topology.timeout_s without an
        answer raises PeerFailure naming this rank and `what`."""
        started = time.monotonic()
        try:
            if self.device.type == "cuda":
                # NCCL work is stream-ordered: poll for completion so a hang still times out here.
                while not work.is_completed():
                    if time.monotonic() - started > self.topology.timeout_s:
                        raise TimeoutError(f"no answer in {self.topology.timeout_s:g} s")
                    time.sleep(0.0005)
                work.wait()
            else:
                work.wait(self.timeout)
        except (RuntimeError, TimeoutError) as err:
            detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise PeerFailure(
                f"{self.name()}: gave up {what} after {time.monotonic() - started:.1f} s (another rank "
                f"died or hung; topology.timeout_s={self.topology.timeout_s:g}): {detail}"
            ) from err

    def agree(self, flags: list[int], what: str) -> list[int]:
        """Element-wise max of `flags` over every rank (the stop agreement); alone: `flags`."""
        if self.world_size == 1:
            return list(flags)

        t = torch.tensor(flags, dtype=torch.int64)
        self.wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control, async_op=True), what)
        return [int(v) for v in t.tolist()]

    def barrier(self, what: str) -> None:
        self.agree([0], what)

    def all_reduce_drafters(self, tensors: list[torch.Tensor], what: str, op: str = "sum") -> None:
        """In-place all-reduce over the drafter ranks as one flat buffer (one collective)."""
        if len(self.drafter_ranks) == 1:
            return

        flat = _flatten_dense_tensors(tensors)
        reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        self.wait(dist.all_reduce(flat, op=reduce_op, group=self.drafters, async_op=True), what)
        for t, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            t.copy_(reduced)
