"""Data-parallel runs under ``torchrun`` or ``accelerate launch`` (torch.distributed).

Both launchers set ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``; the process group is created on first
use (gloo on the CPU, NCCL on GPUs). Every process computes the same thing on its share of each
batch; gradients and losses are averaged; only rank 0 writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lmc_mergekit.errors import LmcError


@dataclass(frozen=True)
class Processes:
    """This process's place among the processes of one run."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: torch.Tensor) -> torch.Tensor:
        """This process's share of a batch (every ``world_size``-th row from ``rank``)."""
        return items[self.rank :: self.world_size]

    def mean(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` in place over all processes."""
        if self.world_size == 1:
            return
        for tensor in tensors:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor.div_(self.world_size)

    def mesh(self, device: torch.device):
        """The device mesh FSDP shards over (None for one process)."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device.type, (self.world_size,))

    def barrier(self) -> None:
        """Wait for every process."""
        if self.world_size > 1:
            dist.barrier()


def processes(device: torch.device | None = None) -> Processes:
    """The processes of this run, joining the launcher's process group if there is one."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Processes()
    if not dist.is_initialized():
        missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
        if missing:
            raise LmcError(
                f"WORLD_SIZE is {world_size} but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set; start "
                "several processes with torchrun or accelerate launch, or unset WORLD_SIZE"
            )
        cuda = device is not None and device.type == "cuda"
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return Processes(rank=dist.get_rank(), world_size=dist.get_world_size())


def close_processes() -> None:
    """Leave the process group (if this run joined one)."""
    if dist.is_initialized():
        dist.destroy_process_group()
