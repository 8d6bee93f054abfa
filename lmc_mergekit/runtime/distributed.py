"""Data-parallel runs under ``torchrun`` or ``accelerate launch`` (torch.distributed).

Both launchers set ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``; the process group is
created on first use with the backend of the device (gloo on the CPU, NCCL on GPUs), each process
on its own accelerator (``LOCAL_RANK``) selected before the group starts. Every process computes
the same thing on its share of each batch; gradients and losses are averaged; what only needs
computing once runs in the main process and reaches the others (:meth:`Processes.from_main`);
only rank 0 writes. Where the processes may part ways (each reads the inputs and the data), they
report to each other (:meth:`Processes.together`): a process that fails stops them all with its
one-line message instead of leaving the others waiting in the next collective.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from lmc_mergekit.errors import LmcError

T = TypeVar("T")

#: How long a process waits in a collective: the others may be waiting for work only the main
#: process does (weight matching of a large pair, another run's pass on the same cache entry),
#: which takes far longer than the launchers' defaults (10 minutes under NCCL).
COLLECTIVE_TIMEOUT = timedelta(hours=2)


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

    def check(self, error: Exception | None = None) -> None:
        """Every process says whether it got here (``error`` None) or failed with ``error`` (one
        collective); if any failed, every process stops: a failed one with its own error, the
        others with a one-line :class:`LmcError` naming the first process that failed and its
        message."""
        if self.world_size > 1:
            outcomes: list[str | None] = [None] * self.world_size
            dist.all_gather_object(outcomes, None if error is None else one_line(error))
            failed = [(rank, text) for rank, text in enumerate(outcomes) if text is not None]
            if failed and error is None:
                rank, text = failed[0]
                raise LmcError(f"process {rank} of {self.world_size} failed: {text}")
        if error is not None:
            raise error

    @contextmanager
    def together(self) -> Iterator[None]:
        """Run the block in every process, then :meth:`check`: wrap the work each process does
        on its own (reading inputs and data) before a collective, where one that failed would
        leave the others waiting."""
        try:
            yield
        except Exception as error:
            self.check(error)
        self.check()

    def from_main(self, compute: Callable[[], T]) -> T:
        """``compute()`` run once, in the main process, and its result sent to every process
        (tensors arrive on the CPU, bit for bit); a failure there stops every process
        (:meth:`check`)."""
        if self.world_size == 1:
            return compute()
        payload = [None]
        with self.together():
            if self.is_main:
                buffer = io.BytesIO()
                torch.save(compute(), buffer)
                payload[0] = buffer.getvalue()
        dist.broadcast_object_list(payload, src=0)
        # Every process, the main one too, uses the copy read back: one result everywhere.
        return torch.load(io.BytesIO(payload[0]), map_location="cpu", weights_only=False)


def one_line(error: Exception) -> str:
    """``error`` as one line: an :class:`LmcError`'s message, else its type and first line."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    if isinstance(error, LmcError):
        return first
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def process_device(device: torch.device, environ: Mapping[str, str] = os.environ) -> torch.device:
    """The device this process computes on: an accelerator named without an index is, under a
    launcher with one per process (``LOCAL_RANK`` set), this process's own (``cuda:LOCAL_RANK``);
    anything else as given."""
    if device.type != "cpu" and device.index is None and "LOCAL_RANK" in environ:
        return torch.device(device.type, int(environ["LOCAL_RANK"]))
    return device


def processes(device: torch.device | None = None) -> Processes:
    """The processes of this run, joining the launcher's process group if there is one: with
    the backend of ``device`` (gloo for the CPU, NCCL for CUDA), its accelerator selected first
    (NCCL binds each process to its current device: unselected, every process would share
    device 0)."""
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
        device = process_device(device or torch.device("cpu"))
        bound = None
        if device.type != "cpu" and device.index is not None:
            torch.get_device_module(device.type).set_device(device)
            bound = device
        backend = dist.Backend.default_device_backend_map.get(device.type, "gloo")
        dist.init_process_group(backend=backend, device_id=bound, timeout=COLLECTIVE_TIMEOUT)
    return Processes(rank=dist.get_rank(), world_size=dist.get_world_size())


def close_processes() -> None:
    """Leave the process group (if this run joined one)."""
    if dist.is_initialized():
        dist.destroy_process_group()
