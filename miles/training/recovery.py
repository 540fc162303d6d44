"""What a restarted trainer must redo, read from the bus: exactly-once by stream positions.

A checkpoint records the EVENTS stream sequence of the last announcement it covers (``events_seq``). Every
announcement names the TRAJ stream sequences of the batch trained into it (``consumed``). After a crash
the trainer restores the newest complete checkpoint (step ``c``) and reads everything it published after
``events_seq``:

* announcements of versions newer than the checkpoint's are **lost**: their weights died with the process.
  Their batches are **replayed**, on the restored weights, in step order, as new versions (a version number
  always names exactly one set of weights; a lost one is superseded, never reused). When several
  restarts left several branches, the newest announcement of each step wins: a replay trains the same
  batch as the step it replays, so the per-step batches of all branches agree;
* discards are still resolved (the controller re-issued or dropped them): their groups are not trained.

Trajectories trained by a lost step were acked (the stream keeps them: limits retention) and are read back
by sequence; a redelivered one (the crash came between announcement and ack) is recognised by its group
and skipped. Nothing is lost, and nothing is applied twice to the weights that survive.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import structlog
from nats.js.api import RawStreamMsg

from miles.bus.client import Bus
from miles.bus.follow import message_at, stored_messages
from miles.bus.schema import GroupsDiscarded, Trajectory, WeightsAnnounced, decode

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class TrainerHistory:
    """What the trainer published after a stream position."""

    announcements: list[tuple[int, WeightsAnnounced]] = field(default_factory=list)  # (EVENTS seq, announcement)
    discarded: list[int] = field(default_factory=list)  # issue indexes
    last_seq: int = 0

    @property
    def max_version(self) -> int:
        return max((ann.version for _, ann in self.announcements), default=-1)


@dataclass(slots=True)
class RecoveryPlan:
    """Lost versions to supersede and the batches to replay, oldest step first."""

    lost: dict[int, int]  # version -> step
    replay: list[WeightsAnnounced]


async def _read_subject(bus: Bus, subject: str, after_seq: int) -> list[RawStreamMsg]:
    """Every message of ``subject`` in EVENTS with a stream sequence above ``after_seq`` (direct gets, the end
    confirmed by the leader: a lagging replica must not hide a lost step's announcement)."""
    return [msg async for msg in stored_messages(bus.js, bus.subjects.events_stream, subject, after_seq)]


async def read_history(bus: Bus, after_seq: int) -> TrainerHistory:
    """Announcements and discards published after ``after_seq``. Only what the trainer wrote counts: a
    malformed message, or one without the trainer's signature when the run signs, is refused (a forged
    announcement would otherwise make a restarted trainer replay batches of its choosing)."""
    history = TrainerHistory(last_seq=after_seq)
    announcements, discards = await asyncio.gather(
        _read_subject(bus, bus.subjects.weights, after_seq), _read_subject(bus, bus.subjects.discarded, after_seq)
    )
    for raw in announcements:
        ann = await bus.accept(raw, WeightsAnnounced)
        if ann is not None:
            history.announcements.append((int(raw.seq or 0), ann))
        history.last_seq = max(history.last_seq, int(raw.seq or 0))
    for raw in discards:
        event = await bus.accept(raw, GroupsDiscarded)
        if event is not None:
            history.discarded.extend(int(g[1:]) for g in event.group_ids)
            history.last_seq = max(history.last_seq, int(raw.seq or 0))
    return history


def plan_recovery(checkpoint_version: int, checkpoint_step: int, history: TrainerHistory) -> RecoveryPlan:
    """Which published versions are lost, and which batches to replay on the restored weights."""
    lost: dict[int, int] = {}
    by_step: dict[int, WeightsAnnounced] = {}
    for _, ann in history.announcements:
        if ann.version <= checkpoint_version:
            continue
        lost[ann.version] = ann.step
        if ann.step > checkpoint_step and ann.consumed:
            by_step[ann.step] = ann  # the newest announcement of a step wins (see the module docstring)
    steps = sorted(by_step)
    if steps and steps != list(range(checkpoint_step + 1, steps[-1] + 1)):
        raise RuntimeError(f"the lost steps after checkpoint step {checkpoint_step} are not contiguous: {steps}")
    return RecoveryPlan(lost=lost, replay=[by_step[s] for s in steps])


async def fetch_batch(bus: Bus, seqs: list[int]) -> list[Trajectory]:
    """The trajectories at these TRAJ stream sequences (a replayed step's batch)."""
    out = []
    for seq in seqs:
        raw = await message_at(bus.js, bus.subjects.traj_stream, seq)
        out.append(decode(raw.data, Trajectory))
    return out
