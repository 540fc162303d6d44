"""How the trainer leader drives the other ranks: broadcast a command, then all ranks run it.

Only rank 0 talks to the bus. Every backend method is collective (FSDP all-gathers and
reduce-scatters inside), so rank 0 first broadcasts ``(method, args)`` over torch.distributed and
then calls the method itself; ranks > 0 sit in :func:`follow_leader` doing the same calls.
``train_step`` is the one command whose argument differs per rank: the leader broadcasts all
shards and each rank takes its own.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import structlog

from miles.backends.base import StepResult, TrainBackend, TrainSample

log = structlog.get_logger(__name__)

T = TypeVar("T")

_STOP = "stop"


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class LeaderRanks:
    """Rank 0's handle on the whole data-parallel group.

    All torch work runs on one dedicated thread, so the leader's event loop keeps serving
    heartbeats and ack extensions while a step computes.
    """

    def __init__(self, backend: TrainBackend, world_size: int) -> None:
        self.backend = backend
        self.world_size = world_size
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-torch")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the torch thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _collective(self, method: str, *args: Any) -> Any:
        if self.world_size > 1:
            _broadcast((method, args))
        return getattr(self.backend, method)(*args)

    async def train_step(self, shards: list[list[TrainSample]]) -> StepResult:
        assert len(shards) == self.world_size, "one shard per rank"

        def step() -> StepResult:
            if self.world_size > 1:
                _broadcast(("train_step", (shards,)))
            return self.backend.train_step(shards[0])

        return await self.run(step)

    async def call(self, method: str, *args: Any) -> Any:
        """A collective backend call with the same arguments on every rank."""
        return await self.run(self._collective, method, *args)

    async def stop(self) -> None:
        """Release ranks > 0 from :func:`follow_leader`."""
        if self.world_size > 1:
            await self.run(_broadcast, (_STOP, ()))
        self._thread.shutdown(wait=True)


def follow_leader(backend: TrainBackend, rank: int) -> None:
    """Loop of ranks > 0: mirror every collective call of rank 0 until it says stop."""
    while True:
        method, args = _broadcast(None)
        if method == _STOP:
            log.info("rank_stop", rank=rank)
            return
        if method == "train_step":
            backend.train_step(args[0][rank])
        else:
            getattr(backend, method)(*args)
