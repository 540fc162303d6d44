"""A rollout worker's room for prompt groups, counted in episode seats (``rollout.admit_by``).

A worker holds ``groups_in_flight x group_size`` seats and a group takes ``group_size`` of them. Why seats and
not a group count: on a long-tailed task a group whose other episodes have finished keeps the worker's whole
slot while its longest episode runs, and the engine's rows sit idle. With ``admit_by: episodes`` every
finished episode gives its seat back at once, so the next group starts as soon as a group's worth of
episodes has finished; with ``admit_by: groups`` (the default) the seats come back together when the group
is stored, and the worker plays at most ``groups_in_flight`` groups. The fleet simulation
(``miles/sim/fleet.py``, ``admit_by``) measures what that is worth.
"""

from __future__ import annotations

import asyncio

from miles.config import AdmitBy


class Seats:
    """Episode seats: :meth:`take_groups` waits for a group's worth and takes every whole group's worth free."""

    def __init__(self, groups_in_flight: int, group_size: int) -> None:
        self.group_size = group_size
        self.capacity = groups_in_flight * group_size
        self.free = self.capacity
        self._changed = asyncio.Condition()

    async def take_groups(self) -> int:
        """Wait until a whole group fits, then take the seats of as many whole groups as fit; how many."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.free >= self.group_size)
            groups = self.free // self.group_size
            self.free -= groups * self.group_size
            return groups

    async def give_back(self, seats: int) -> None:
        if seats <= 0:
            return
        async with self._changed:
            self.free += seats
            if self.free > self.capacity:  # a bookkeeping error, never a state to carry on from
                raise RuntimeError(f"seats given back past capacity: {self.free} > {self.capacity}")
            self._changed.notify_all()


class GroupSeats:
    """The seats one group holds: given back one per finished episode (``admit_by: episodes``), and the rest
    when the group ends (stored, refused, or abandoned)."""

    def __init__(self, seats: Seats, admit_by: AdmitBy) -> None:
        self.seats, self.admit_by = seats, admit_by
        self.held = seats.group_size

    async def episode_done(self) -> None:
        if self.admit_by == "episodes" and self.held > 0:
            self.held -= 1
            await self.seats.give_back(1)

    async def release(self) -> None:
        held, self.held = self.held, 0
        await self.seats.give_back(held)
