"""Actor lifecycle: start, run, drain, stop, with supervised tasks and heartbeats.

An actor's coroutines run in one ``asyncio.TaskGroup``: if any of them raises, the others are
cancelled and the error propagates out of :meth:`Actor.run`, so a broken actor fails loudly
instead of limping on. ``request_stop`` (SIGTERM/SIGINT, or a ``stop`` command on the bus) only
sets an event; each main loop finishes the unit of work in hand, makes it durable, then returns.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import ClassVar

import structlog
from nats.aio.msg import Msg

from miles.bus.client import Bus, messages_until
from miles.bus.follow import first_of
from miles.bus.schema import Control, Heartbeat
from miles.config import RunConfig

log = structlog.get_logger(__name__)


class Actor(ABC):
    """Base of controller, rollout, trainer and monitor."""

    role: ClassVar[str]
    heartbeats: ClassVar[bool] = True  # False: an observer that publishes nothing (the monitor)

    def __init__(self, cfg: RunConfig, bus: Bus, run_dir: Path) -> None:
        self.cfg = cfg
        self.bus = bus
        self.run_dir = run_dir
        self.actor_id = bus.actor_id
        self.stopping = asyncio.Event()
        self._finished = asyncio.Event()
        # A refusal's counts go out with a heartbeat at once, not up to heartbeat_s later: a short run can
        # end within one period of refusing something, and the summary adds up the heartbeats' counts.
        self._beat_now = asyncio.Event()
        bus.on_refusal = self._beat_now.set
        self.log = log.bind(role=self.role, actor=self.actor_id)

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self, reason: str = "") -> None:
        """Ask the actor to drain: finish and persist the work in hand, then return from run()."""
        if not self.stopping.is_set():
            self.log.info("stop_requested", reason=reason)
            self.stopping.set()
            # Draining may still publish (a last version, acks); a bus that went down with the launcher is
            # waited for briefly, not for the whole outage budget (miles.bus.retry.DRAIN_GRACE_S).
            self.bus.outage.draining()

    async def run(self) -> None:
        """Run until the main loop returns; any failing task fails the whole actor."""
        self.log.info("actor_start")
        try:
            async with asyncio.TaskGroup() as tg:
                if self.heartbeats:
                    tg.create_task(self._heartbeat_loop(), name=f"{self.role}.heartbeat")
                tg.create_task(self._control_loop(), name=f"{self.role}.control")
                tg.create_task(self._run_main(), name=f"{self.role}.main")
        finally:
            self.log.info("actor_stop")

    async def _run_main(self) -> None:
        try:
            await self.main()
        finally:
            self._finished.set()

    @abstractmethod
    async def main(self) -> None:
        """The actor's work; returns when done or when ``stopping`` is set."""

    # ------------------------------------------------------------------ heartbeats and control

    def heartbeat(self) -> Heartbeat:
        """Current state for the heartbeat; subclasses add version and stats."""
        return Heartbeat(role=self.role, actor_id=self.actor_id)

    async def beat(self) -> None:
        """Send a heartbeat now (its counts are what the run summary reports for this actor)."""
        with contextlib.suppress(Exception):  # a missed heartbeat is not worth dying for
            await self.bus.emit(self.bus.subjects.heartbeat(self.role, self.actor_id), self.heartbeat())

    async def _heartbeat_loop(self) -> None:
        while not self._finished.is_set():
            self._beat_now.clear()
            await self.beat()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(first_of(self._finished, self._beat_now), timeout=self.cfg.bus.heartbeat_s)

    async def _control_loop(self) -> None:
        """Obey run-wide ``stop`` commands of this run instance (core subscription: only live actors need
        them). A command without the instance, or for another (an earlier run under the same name), is
        refused; with the run's keys it must also carry the controller's signature (:meth:`Bus.accept`)."""
        sub = await self.bus.nc.subscribe(self.bus.subjects.control)
        async for msg in messages_until(sub, self._finished):
            control = await self.bus.accept(msg, Control)
            if control is None:
                continue
            instance = await self.bus.run_instance()
            if instance is None or control.run_instance != instance:
                reason = f"control: for run instance {control.run_instance[:8] or '(none)'}, not this one"
                await self.bus.refuse(msg, reason, category="untrusted")
            elif control.command == "stop":
                self.request_stop(control.reason or "control: stop")

    # ------------------------------------------------------------------ helpers for subclasses

    async def sleep_unless_stopping(self, seconds: float) -> bool:
        """Sleep; return True early if a stop was requested meanwhile."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), timeout=seconds)
        return self.stopping.is_set()


@contextlib.asynccontextmanager
async def keep_in_progress(msgs: Sequence[Msg], period_s: float) -> AsyncIterator[None]:
    """Tell JetStream we are still working on ``msgs`` so they are not redelivered meanwhile."""

    async def ping() -> None:
        while True:
            await asyncio.sleep(period_s)
            for m in msgs:
                with contextlib.suppress(Exception):
                    await m.in_progress()

    task = asyncio.create_task(ping(), name="in_progress")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
