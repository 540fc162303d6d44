"""The trainer's intake: trajectories pulled one batch ahead and examined on a thread while a batch trains.

Decoding a trajectory, checking its signatures and its token ids costs CPU in proportion to its tokens
(~16 ms for a group of 16 x 5k-token episodes: 8 s before each 512-group update when done between steps).
None of it depends on the run's state, so :class:`TrajectoryIntake` does it while the current batch trains:
a supervised task pulls up to one batch ahead from the trainer's TRAJ consumer (held unacked, kept in
progress), examines each on a thread (:meth:`miles.bus.client.Bus.examine`, the ticket, and
:func:`miles.actors.trust.content_refusal`) and queues the verdicts in stream order. What depends on the
run's state (the issue window, the newest version, staleness, duplicates) is judged by the leader when it
takes them, after the step (:meth:`miles.actors.trainer.TrainerLeader._collect`).

Nothing is lost: whatever is still queued or in flight when the intake closes is nak'ed for redelivery.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from miles.actors.base import keep_in_progress
from miles.bus.client import Refusal
from miles.bus.schema import PromptGroup, Trajectory

FETCH_S = 0.5  # one pull's longest wait: how soon a close is noticed while nothing arrives
CHUNK = 16  # trajectories pulled and examined at a time: the leader takes them as each chunk is done
OFF_LOOP_BYTES = 256 * 1024  # a chunk this large takes ~7 ms to examine: done on a thread

T = TypeVar("T")


async def on_thread_if(large: bool, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a thread if ``large`` (the event loop stays free meanwhile), else here: a trip to a thread
    and back can wait out the interpreter's 5 ms switch interval, which cost a 0.1 s quickstart step 5-7%."""
    return await asyncio.to_thread(fn, *args) if large else fn(*args)


@dataclass(slots=True)
class Examined:
    """A pulled trajectory and what the thread found: ``refusal`` set if it must be refused whatever the run's
    state (``trajectory`` None if it did not even decode; ``ticket`` None if there is none, or it is bad)."""

    msg: Msg
    trajectory: Trajectory | None
    ticket: PromptGroup | None
    refusal: Refusal | None


class TrajectoryIntake:
    """Pull-ahead of the trainer's TRAJ consumer, as an ``async with`` block: inside it a task keeps up to
    ``ahead`` examined trajectories queued, and :meth:`take` hands them out in stream order. Leaving the block
    stops the task and naks what nobody took; an error of the task is raised by :meth:`take`."""

    def __init__(
        self,
        sub: Any,
        examine: Callable[[Msg], Examined],
        *,
        ahead: int,
        ping_s: float,
        off_loop_bytes: int = OFF_LOOP_BYTES,
    ) -> None:
        self._sub = sub
        self._off_loop_bytes = off_loop_bytes
        self._examine = examine
        self.ahead = ahead
        self._ping_s = ping_s
        self._ready: deque[Examined] = deque()
        self._held: list[Msg] = []  # the queued ones' messages, kept in progress until taken
        self._changed = asyncio.Condition()
        self._closed = False
        self._go = asyncio.Event()  # cleared while the leader does Python work of its own (see pause())
        self._go.set()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> TrajectoryIntake:
        self._task = asyncio.create_task(self._run(), name="trainer.intake")
        return self

    def pause(self) -> None:
        """Stop pulling and examining after the chunk in hand, until :meth:`resume`. Threads of one Python
        process share one interpreter lock: while the leader builds a batch (Python work on the critical path)
        the intake would only slow it down; while the ranks train (torch, GIL-free) it runs unhindered."""
        self._go.clear()

    def resume(self) -> None:
        self._go.set()

    async def __aexit__(self, *exc_info: object) -> None:
        async with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._go.set()
        assert self._task is not None
        await asyncio.wait([self._task])  # its own error was raised by take() already, or is moot now
        if exc_info[0] is None and not self._task.cancelled() and self._task.exception() is not None:
            raise self._task.exception()  # type: ignore[misc]

    async def _run(self) -> None:
        """Pull and examine until closed; then nak what nobody took (it is redelivered)."""
        try:
            async with keep_in_progress(self._held, period_s=self._ping_s):
                while await self._room():
                    await self._go.wait()
                    if self._closed:
                        break
                    try:  # a few at a time: the first are ready for the leader while the rest are still pulled
                        pulled = await self._sub.fetch(min(CHUNK, self.ahead - len(self._ready)), timeout=FETCH_S)
                    except asyncio.TimeoutError:
                        continue
                    self._held.extend(pulled)  # in progress from now on, while they are examined
                    large = sum(len(m.data or b"") for m in pulled) >= self._off_loop_bytes
                    examined = await on_thread_if(large, self._examine_all, pulled)
                    async with self._changed:
                        self._ready.extend(examined)
                        self._changed.notify_all()
        finally:
            async with self._changed:
                self._closed = True
                self._changed.notify_all()  # a take() waiting for more learns there is none
            held, self._held[:] = list(self._held), []
            self._ready.clear()
            for m in held:
                with contextlib.suppress(NatsError, asyncio.TimeoutError):  # if not, it comes back after ack_wait
                    await m.nak()

    def _examine_all(self, msgs: list[Msg]) -> list[Examined]:
        return [self._examine(m) for m in msgs]

    async def _room(self) -> bool:
        """Wait until fewer than ``ahead`` are queued; False once closed."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._closed or len(self._ready) < self.ahead)
            return not self._closed

    async def take(self, n: int, timeout_s: float) -> list[Examined]:
        """Up to ``n`` examined trajectories in stream order, waiting up to ``timeout_s`` for the first; the
        caller owns their messages (acks, naks) from here on."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(lambda: self._closed or bool(self._ready)), timeout_s)
            taken = [self._ready.popleft() for _ in range(min(n, len(self._ready)))]
            gone = {id(e.msg) for e in taken}
            self._held[:] = [m for m in self._held if id(m) not in gone]  # in place: the pings read this list
            self._changed.notify_all()
        task = self._task
        error = task.exception() if not taken and task is not None and task.done() and not task.cancelled() else None
        if error is not None:
            raise error  # the intake's own error (a lost bus, a bug in examining), as it was raised there
        return taken
