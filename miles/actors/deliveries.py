"""A rollout worker's prompt groups in play and recently stored: a redelivered group is not played twice.

A nats-server that comes back from an outage longer than ``bus.ack_wait_s`` redelivers at once every prompt that
was delivered and not acked before it went away, while the worker that has it may still be playing it (its
in-progress pings could not reach the server) or has just stored its trajectory (the ack went out during the
reconnect). Measured on ``tests/integration/test_bus_outages.py``: 4 of 56 groups generated twice. A delivery of a
group this worker plays is held and settled with the first (acked once the trajectory is stored, nak'ed if the
worker stops first); one of a group it stored is acked at once. A redelivery that reaches *another* worker is
played there; the trainer recognises the second trajectory by its issue index and skips it (``duplicates``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from nats.aio.msg import Msg

Claim = Literal["play", "playing", "stored"]


@dataclass(slots=True)
class GroupDeliveries:
    """Group id -> deliveries held while its first delivery plays; the newest ``keep`` group ids stored."""

    keep: int = 4096
    playing: dict[str, list[Msg]] = field(default_factory=dict)
    stored: OrderedDict[str, None] = field(default_factory=OrderedDict)
    skipped: int = 0  # redeliveries not played again

    def claim(self, group_id: str, msg: Msg) -> Claim:
        """``play`` a first delivery; hold a delivery of a group in play; ``stored``: ack it, nothing to play."""
        if group_id in self.stored:
            self.skipped += 1
            return "stored"
        if group_id in self.playing:
            self.playing[group_id].append(msg)
            self.skipped += 1
            return "playing"
        self.playing[group_id] = []
        return "play"

    def finish(self, group_id: str, *, stored: bool) -> list[Msg]:
        """The group's play ended (its trajectory stored, or given back): the deliveries held meanwhile, to settle
        the same way."""
        held = self.playing.pop(group_id, [])
        if stored:
            self.stored[group_id] = None
            while len(self.stored) > self.keep:
                self.stored.popitem(last=False)
        return held
