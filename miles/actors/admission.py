"""The controller's admission state: what it issued, where it is in the data, what waits to be issued again.

The state is never stored on its own: it is a fold over the streams (docs/architecture.md, "Delivery and
restart contract"). Each batch the controller issues is first published as a
:class:`~miles.bus.schema.GroupsIssued` record carrying the state as it will be once the batch is out, and the
trainer's discards are on EVENTS; so a restarted controller takes the newest issue record and folds in the
discards stored after the last one that record had seen (:meth:`AdmissionState.restore`), and carries on
with exactly the state it had.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from miles.bus.schema import AdmissionPart, GroupsDiscarded, GroupsIssued
from miles.tasks.base import Sample
from miles.training.lineage import IndexSet


def admission_limit(step: int, max_staleness: int, groups_per_step: int, steps: int) -> int:
    """Groups that may be outstanding-or-trained with the trainer at ``step``: ``(eta + s + 1) * B``, capped."""
    return min((max_staleness + step + 1) * groups_per_step, steps * groups_per_step)


def issue_room(
    state: AdmissionState, *, step: int, max_staleness: int, groups_per_step: int, steps: int, over_issue: int = 0
) -> int:
    """Groups the controller may issue now: the staleness window (plus ``over_issue`` replacements for
    filtered groups) less what is outstanding or trained. Pure, so the fleet simulator drives the same rule."""
    limit = admission_limit(step, max_staleness, groups_per_step, steps) + over_issue
    return limit - (state.issued - state.discarded)


@dataclass(slots=True)
class AdmissionState:
    """Issued count, dataset cursor and the re-issue queue, plus what the trainer resolved."""

    issued: int = 0  # groups ever issued, re-issues included
    discarded: int = 0  # groups the trainer rejected (they free their credit)
    cursor: int = 0  # position in the endless shuffled stream of train samples
    reissue: list[str] = field(default_factory=list)  # sample ids waiting to be issued again
    attempts: dict[str, int] = field(default_factory=dict)  # sample id -> re-issues so far (bounded by reissue)
    resolved: IndexSet = field(default_factory=IndexSet)  # issue indices trained or discarded
    discards_seq: int = 0  # EVENTS sequence of the newest discard folded into cursor/reissue/attempts

    def part(self) -> AdmissionPart:
        """The state as a part of the controller's snapshot (copies: the state goes on changing)."""
        return AdmissionPart(
            issued=self.issued,
            discarded=self.discarded,
            cursor=self.cursor,
            reissue=list(self.reissue),
            reissue_attempts=dict(self.attempts),
            resolved_floor=self.resolved.floor,
            resolved_above=sorted(self.resolved.above),
            discards_seq=self.discards_seq,
        )

    @classmethod
    def from_part(cls, part: AdmissionPart) -> AdmissionState:
        return cls(
            issued=part.issued,
            discarded=part.discarded,
            cursor=part.cursor,
            reissue=list(part.reissue),
            attempts=dict(part.reissue_attempts),
            resolved=IndexSet.from_json({"floor": part.resolved_floor, "above": part.resolved_above}),
            discards_seq=part.discards_seq,
        )

    def restore(self, record: GroupsIssued) -> None:
        """Take the state an issue record says the controller had once its batch was out (a record the state
        includes already, read after a snapshot, changes nothing: the state has folded discards since)."""
        if record.end_index <= self.issued:
            return
        self.issued = max(self.issued, record.end_index)
        self.cursor = record.cursor
        self.reissue = list(record.reissue)
        self.attempts = dict(record.reissue_attempts)
        self.discards_seq = record.discards_seq

    def fold_discard(self, msg: GroupsDiscarded, seq: int, *, known: set[str] | dict[str, Sample]) -> None:
        """Count a discard; re-queue its samples unless the newest issue record already includes it."""
        self.discarded += len(msg.group_ids)
        for gid in msg.group_ids:
            self.resolved.add(int(gid[1:]))
        if seq <= self.discards_seq:
            return  # in the restored state already
        self.discards_seq = seq
        if msg.requeue:
            for sid in msg.sample_ids:
                if sid in known:
                    self.reissue.append(sid)
                    self.attempts[sid] = self.attempts.get(sid, 0) + 1


class SampleOrder:
    """The endless stream of train samples: one deterministic shuffle per pass (seeded by the run's seed)."""

    def __init__(self, samples: dict[str, Sample], seed: int) -> None:
        self.samples = samples
        self.order = list(samples)
        self.seed = seed
        self._epoch: tuple[int, list[str]] = (-1, [])

    def at(self, cursor: int) -> Sample:
        epoch, index = divmod(cursor, len(self.order))
        if self._epoch[0] != epoch:
            order = list(self.order)
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch = (epoch, order)
        return self.samples[self._epoch[1][index]]

    def next(self, state: AdmissionState) -> tuple[Sample, int]:
        """The next prompt (re-issues first) and its attempt number; advances ``state``."""
        if state.reissue:
            sample_id = state.reissue.pop(0)
            attempt = state.attempts.pop(sample_id, 1)
            return self.samples[sample_id], attempt
        sample = self.at(state.cursor)
        state.cursor += 1
        return sample, 0


def plan_batch(state: AdmissionState, order: SampleOrder, count: int, version: int) -> GroupsIssued:
    """The issue record of the next ``count`` groups at trainer ``version``; advances ``state`` to after it."""
    first = state.issued
    picked = [order.next(state) for _ in range(count)]
    state.issued = first + count
    return GroupsIssued(
        first_index=first,
        sample_ids=[s.id for s, _ in picked],
        attempts=[a for _, a in picked],
        issued_at_version=version,
        cursor=state.cursor,
        reissue=list(state.reissue),
        reissue_attempts=dict(state.attempts),
        discards_seq=state.discards_seq,
    )
