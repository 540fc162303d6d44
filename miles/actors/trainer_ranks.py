"""How the trainer leader drives the other ranks: broadcast a command, then all ranks run it.

Only rank 0 talks to the bus. Every :class:`~miles.training.rank_worker.RankWorker` method is collective,
so rank 0 first broadcasts ``(method, args)`` over torch.distributed and then calls the method itself;
ranks > 0 sit in :func:`follow_leader` doing the same calls. The broadcast uses the trainer's own process
group (gloo or NCCL), so nothing but rank 0 needs the bus.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import structlog

from miles.failpoints import failpoint
from miles.sync.owned_delta import OwnedTensor
from miles.training.rank_worker import RankWorker

log = structlog.get_logger(__name__)

T = TypeVar("T")

_STOP = "stop"


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class LeaderRanks:
    """Rank 0's handle on the whole trainer group.

    All torch work runs on one dedicated thread, so the leader's event loop keeps serving heartbeats,
    in-progress acks and bus I/O while a step computes.
    """

    def __init__(self, worker: RankWorker) -> None:
        self.worker = worker
        self.world_size = worker.world_size
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-torch")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the torch thread (rank 0 only: not collective)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _collective(self, method: str, *args: Any) -> Any:
        if self.world_size > 1:
            _broadcast((method, args))
        return getattr(self.worker, method)(*args)

    def export_stream(self, adapter_only: bool) -> Iterator[tuple[str, Any]]:
        """On the torch thread: start a streamed export (the other ranks drain theirs) and return rank 0's
        ``(name, tensor)`` iterator, consumed one parameter at a time by the payload encoder."""
        if self.world_size > 1:
            _broadcast(("drain_export", (adapter_only,)))
        for i, item in enumerate(self.worker.backend.export_params(adapter_only=adapter_only)):
            if i == 1:
                failpoint("export")  # part of the payload is in the data plane, no manifest yet
            yield item

    def owned_export_stream(self, anchor: bool) -> Iterator[OwnedTensor]:
        """On the torch thread: start a delta-mode export on every rank and return rank 0's tensors (with their
        records), consumed one at a time by the payload writer."""
        if self.world_size > 1:
            _broadcast(("drain_owned_export", (anchor,)))
        for i, item in enumerate(self.worker.owned_export(anchor)):
            if i == 1:
                failpoint("export")
            yield item

    async def call(self, method: str, *args: Any) -> Any:
        """A collective :class:`RankWorker` call with the same arguments on every rank."""
        return await self.run(self._collective, method, *args)

    async def stop(self) -> None:
        """Release ranks > 0 from :func:`follow_leader`."""
        if self.world_size > 1:
            await self.run(_broadcast, (_STOP, ()))
        self._thread.shutdown(wait=True)


def follow_leader(worker: RankWorker) -> None:
    """Loop of ranks > 0: mirror every collective call of rank 0 until it says stop."""
    while True:
        method, args = _broadcast(None)
        if method == _STOP:
            log.info("rank_stop", rank=worker.rank)
            return
        getattr(worker, method)(*args)
