"""What the bus keeps (``bus.retention: recovery``): each owner purges what no restart can need any more.

TRAJ, EVENTS and METRICS have no age limit. They are bounded instead by what recovery reads:

* **The trainer** restarts from its newest complete checkpoint and, failing that, from an older kept one. It
  reads EVENTS after the checkpoint's ``events_seq`` (its announcements and discards) and the trajectories
  the lost steps consumed, all above the TRAJ ack floor the checkpoint records (``traj_floor``: every
  trajectory at or below it was trained into that step or an earlier one, or discarded). Once a checkpoint
  completes, :class:`TrainerRetention` purges TRAJ below the *oldest kept* checkpoint's floor and writes that
  checkpoint's positions to the state key ``trainer_floor``.
* **The controller** restarts from its newest snapshot, or the one before it (the snapshot stream keeps two).
  After writing a snapshot it purges METRICS up to the older snapshot's position and EVENTS up to the lower of
  that snapshot's positions and the trainer's floor (:func:`release_events_and_metrics`).

Rollout workers read announcements from the newest on, and a monitor starts from the controller's newest
snapshot and reads what METRICS still holds after it: the run directory's record (metrics.jsonl, groups.jsonl,
evals.jsonl) is the history, line by line.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog

from miles.actors.snapshots import EVENT_KEYS
from miles.bus.client import KEY_TRAINER_FLOOR, Bus

log = structlog.get_logger(__name__)


async def traj_ack_floor(bus: Bus) -> int:
    """The TRAJ sequence at and below which the trainer's consumer has acked everything."""
    s = bus.subjects
    info = await bus.js.consumer_info(s.traj_stream, s.TRAINER_CONSUMER)
    return int(info.ack_floor.stream_seq) if info.ack_floor is not None else 0


class TrainerRetention:
    """Purges TRAJ below the oldest kept checkpoint's ack floor and publishes that checkpoint's positions."""

    def __init__(self, bus: Bus, oldest_checkpoint: Callable[[], Awaitable[tuple[int, dict[str, Any]] | None]]) -> None:
        self.bus = bus
        self.oldest_checkpoint = oldest_checkpoint  # (step, extra) of the oldest complete checkpoint kept, or None
        self.released_step = -1

    async def release(self) -> None:
        """Purge what the oldest kept checkpoint no longer needs (a no-op until it changes)."""
        oldest = await self.oldest_checkpoint()
        if oldest is None or oldest[0] == self.released_step or "traj_floor" not in oldest[1]:
            return  # nothing kept yet, the same one as before, or a checkpoint of before this field
        step, extra = oldest
        floor = {"events": int(extra["events_seq"]), "traj": int(extra["traj_floor"])}
        await self.bus.js.purge_stream(self.bus.subjects.traj_stream, seq=floor["traj"] + 1)
        await self.bus.put_str(KEY_TRAINER_FLOOR, json.dumps(floor))
        self.released_step = step
        log.info("trajectories_released", checkpoint_step=step, **floor)


async def release_events_and_metrics(bus: Bus, kept: Mapping[str, int]) -> dict[str, int]:
    """Purge METRICS and EVENTS below what a restart from the snapshot with positions ``kept`` (the older of the two
    kept) reads, and below the trainer's floor for EVENTS; returns the first sequence each stream keeps (0: not
    purged, the trainer has no checkpoint yet)."""
    s = bus.subjects
    first = {"metrics": kept["metrics"] + 1, "events": 0}
    await bus.js.purge_stream(s.metrics_stream, seq=first["metrics"])
    trainer = await bus.get_str(KEY_TRAINER_FLOOR)
    if trainer:
        floor = json.loads(trainer)
        first["events"] = min(min(kept[key] for key in EVENT_KEYS), int(floor["events"])) + 1
        await bus.js.purge_stream(s.events_stream, seq=first["events"])
    return first
