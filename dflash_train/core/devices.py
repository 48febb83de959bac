"""Devices and dtypes: the device a setting names, the dtype used on it, waiting for its queued work, and
a tensor split over devices (a DTensor) made whole."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from dflash_train.core.errors import InputError


def resolve_device(name: str, setting: str = "train.device") -> torch.device:
    """auto -> cuda when one is visible, else cpu; `setting` names the option in errors."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError(f"{setting}=cuda but no CUDA device is visible: use {setting}=auto or cpu")
    return torch.device(name)


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA (the target's and the published drafters' dtype), float32 on CPU."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)



def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a no-op off CUDA): before reading a host clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def whole(t: torch.Tensor) -> torch.Tensor:
    """`t` as one plain tensor on this rank: a DTensor (a weight or an output of a tensor-parallel
    target, a sharded drafter's gradient norm) gathered over its mesh (a collective: every rank of
    the mesh calls it alike); anything else as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t
