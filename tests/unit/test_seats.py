"""A rollout worker's seats (``rollout.admit_by``): whole groups are taken, seats come back per group or per
episode, and a bookkeeping error is loud."""

from __future__ import annotations

import asyncio

import pytest

from miles.actors.seats import GroupSeats, Seats


async def test_take_groups_takes_every_whole_group_that_fits() -> None:
    seats = Seats(groups_in_flight=3, group_size=4)
    assert await seats.take_groups() == 3 and seats.free == 0
    await seats.give_back(7)  # a group's worth and 3 seats: one whole group fits
    assert await seats.take_groups() == 1 and seats.free == 3


async def test_take_groups_waits_for_a_whole_group() -> None:
    seats = Seats(groups_in_flight=1, group_size=4)
    await seats.take_groups()
    waiting = asyncio.ensure_future(seats.take_groups())
    await seats.give_back(3)
    await asyncio.sleep(0)  # let the waiter look: 3 seats are not a group
    assert not waiting.done()
    await seats.give_back(1)
    assert await asyncio.wait_for(waiting, 5) == 1


async def test_admit_by_groups_gives_the_seats_back_when_the_group_ends() -> None:
    seats = Seats(groups_in_flight=2, group_size=4)
    await seats.take_groups()
    group = GroupSeats(seats, "groups")
    for _ in range(4):
        await group.episode_done()
    assert seats.free == 0  # its finished episodes make no room
    await group.release()
    assert seats.free == 4
    await group.release()  # twice is once
    assert seats.free == 4


async def test_admit_by_episodes_gives_each_finished_episodes_seat_back_at_once() -> None:
    seats = Seats(groups_in_flight=2, group_size=4)
    assert await seats.take_groups() == 2
    long_group, other = GroupSeats(seats, "episodes"), GroupSeats(seats, "episodes")
    for _ in range(3):  # three of four episodes done, the longest still running
        await long_group.episode_done()
    await other.episode_done()
    assert seats.free == 4
    assert await seats.take_groups() == 1  # the next group starts before the long one is stored
    await long_group.release()  # its last seat
    await other.release()  # three seats
    assert seats.free == 4


async def test_seats_given_back_past_capacity_raise() -> None:
    seats = Seats(groups_in_flight=1, group_size=4)
    with pytest.raises(RuntimeError, match="past capacity"):
        await seats.give_back(1)
