"""Joining and leaving the torch.distributed process group of the trainer ranks.

One place decides the collective backend (gloo on CPU, NCCL on CUDA), the rendezvous address and
the timeout, so that every caller (``miles run``, ``miles-node``, tests) joins the same way.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger(__name__)

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class DistInfo:
    """Where this process sits in the group it joined."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    master_addr: str
    master_port: int


def backend_for_device(device: str) -> str:
    """The collective backend for a device string: NCCL for CUDA, gloo for everything else."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    *,
    device: str = "cpu",
    backend: str | None = None,
    local_rank: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> DistInfo:
    """Join the process group; arguments left ``None`` come from the torchrun-style environment.

    Environment fallbacks: ``RANK`` (0), ``WORLD_SIZE`` (1), ``MASTER_ADDR`` (127.0.0.1),
    ``MASTER_PORT`` (29500), ``LOCAL_RANK`` (= rank). On CUDA the current device is set to the local
    rank first, because NCCL binds communicators to the current device. ``timeout_s`` bounds every
    collective, so a dead peer turns into an error instead of a hang.
    """
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    env = os.environ
    rank = int(env.get("RANK", "0")) if rank is None else rank
    world_size = int(env.get("WORLD_SIZE", "1")) if world_size is None else world_size
    master_addr = env.get("MASTER_ADDR", "127.0.0.1") if master_addr is None else master_addr
    master_port = int(env.get("MASTER_PORT", "29500")) if master_port is None else master_port
    local_rank = int(env.get("LOCAL_RANK", str(rank))) if local_rank is None else local_rank
    backend = backend or backend_for_device(device)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")

    if torch.device(device).type == "cuda":
        torch.cuda.set_device(local_rank % max(torch.cuda.device_count(), 1))
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    info = DistInfo(rank, world_size, local_rank, backend, master_addr, master_port)
    log.info("dist.joined", rank=rank, world_size=world_size, backend=backend, master=f"{master_addr}:{master_port}")
    return info


def destroy_distributed() -> None:
    """Leave the process group if one was joined (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
        log.info("dist.left")


@contextmanager
def distributed(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    *,
    device: str = "cpu",
    backend: str | None = None,
    local_rank: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Iterator[DistInfo]:
    """``with distributed(...) as info:`` joins on entry and always leaves on exit, even on error."""
    info = init_distributed(
        rank,
        world_size,
        master_addr,
        master_port,
        device=device,
        backend=backend,
        local_rank=local_rank,
        timeout_s=timeout_s,
    )
    try:
        yield info
    finally:
        destroy_distributed()


def is_distributed() -> bool:
    """Whether collectives are available (a process group was joined)."""
    return dist.is_available() and dist.is_initialized()


def exit_skipping_teardown(code: int) -> None:
    """Flush logs and stdio, then end the process without the interpreter's teardown.

    Under load, a C++ thread of torch's distributed runtime was seen to abort a process in a static
    destructor ("terminate called without an active exception") after every piece of work had completed
    and the process group had been left; a process's exit status must say how its work went, not that.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn_ranks(fn: Callable[..., None], nprocs: int, *args: Any) -> None:
    """``torch.multiprocessing.spawn`` of ``fn(rank, *args)``; each rank that returns leaves as above.

    A rank that raises still reports its traceback through spawn's error file.
    """
    import torch.multiprocessing as mp

    mp.spawn(_run_then_exit, args=(fn, args), nprocs=nprocs, join=True)


def _run_then_exit(rank: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    fn(rank, *args)
    exit_skipping_teardown(0)
