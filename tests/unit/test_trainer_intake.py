"""The trainer's pull-ahead intake (miles/actors/trainer_intake.py) on a real nats-server: order, the bound on
what it holds, its thread, naks at the end, and its errors raised where the trainer takes."""

from __future__ import annotations

import asyncio
import threading

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from miles.actors.trainer_intake import Examined, TrajectoryIntake
from miles.bus.client import Refusal

STREAM, SUBJECT, DURABLE = "INTAKE", "intake.traj", "trainer"


async def _stream_with(nc: Client, n: int) -> object:
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT]))
    await js.add_consumer(STREAM, ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT, ack_wait=30))
    for i in range(n):
        await js.publish(SUBJECT, str(i).encode())
    return await js.pull_subscribe_bind(durable=DURABLE, stream=STREAM)


def _examined_on(threads: set[str]):  # noqa: ANN202 - the examine callable
    def examine(m: Msg) -> Examined:
        threads.add(threading.current_thread().name)
        return Examined(m, None, None, Refusal(m.data.decode(), "test"))

    return examine


async def _held(nc: Client) -> int:
    return (await nc.jetstream().consumer_info(STREAM, DURABLE)).num_ack_pending


async def _delivered_again(sub: object, n: int) -> list[tuple[str, int]]:
    """The next ``n`` deliveries (payload, times delivered): a nak'ed message comes back at once."""
    got: list[Msg] = []
    while len(got) < n:
        got += await sub.fetch(n - len(got), timeout=10)  # type: ignore[attr-defined]
    return [(m.data.decode(), m.metadata.num_delivered) for m in got]


async def test_it_hands_them_out_in_stream_order_examined_off_the_loop(nc: Client) -> None:
    sub = await _stream_with(nc, 10)
    threads: set[str] = set()
    async with TrajectoryIntake(sub, _examined_on(threads), ahead=4, ping_s=10, off_loop_bytes=1) as intake:
        first = await intake.take(3, timeout_s=10)
        taken = [e.refusal.reason for e in first]  # type: ignore[union-attr]
        while len(taken) < 10:
            batch = await intake.take(10, timeout_s=10)
            taken += [e.refusal.reason for e in batch]  # type: ignore[union-attr]
            for e in batch:
                await e.msg.ack()
        for e in first:
            await e.msg.ack()
    assert taken == [str(i) for i in range(10)]
    assert threading.main_thread().name not in threads  # these are "large": examined on a thread


async def test_small_ones_are_examined_on_the_event_loop(nc: Client) -> None:
    """A trip to a thread and back costs more than examining a few small trajectories (see OFF_LOOP_BYTES)."""
    sub = await _stream_with(nc, 3)
    threads: set[str] = set()
    async with TrajectoryIntake(sub, _examined_on(threads), ahead=3, ping_s=10) as intake:
        taken: list[Examined] = []
        while len(taken) < 3:
            taken += await intake.take(3, timeout_s=10)
        for e in taken:
            await e.msg.ack()
    assert threads == {threading.current_thread().name}


async def test_a_paused_intake_goes_on_when_resumed(nc: Client) -> None:
    sub = await _stream_with(nc, 6)
    async with TrajectoryIntake(sub, _examined_on(set()), ahead=2, ping_s=10) as intake:
        taken = []
        while len(taken) < 6:
            intake.pause()  # as the leader does while it builds a batch
            batch = await intake.take(2, timeout_s=0.05)  # what was examined before the pause, if anything
            intake.resume()
            batch += await intake.take(2 - len(batch), timeout_s=10) if len(batch) < 2 else []
            for e in batch:
                await e.msg.ack()
            taken += [e.refusal.reason for e in batch]  # type: ignore[union-attr]
    assert taken == [str(i) for i in range(6)]


async def test_what_nobody_took_is_naked_for_redelivery_at_the_end(nc: Client) -> None:
    sub = await _stream_with(nc, 6)
    async with TrajectoryIntake(sub, _examined_on(set()), ahead=4, ping_s=10) as intake:
        (e,) = await intake.take(1, timeout_s=10)
        await e.msg.ack()
        while await _held(nc) < 4:  # the intake pulled ahead: 4 held, unacked
            await asyncio.sleep(0.02)
        intake.pause()  # and a paused intake still ends, and gives back what it holds
    # The four it held were nak'ed: delivered again at once (not after ack_wait), beside the one never pulled.
    assert sorted(await _delivered_again(sub, 5)) == [("1", 2), ("2", 2), ("3", 2), ("4", 2), ("5", 1)]


async def test_an_error_while_examining_is_raised_where_the_trainer_takes(nc: Client) -> None:
    sub = await _stream_with(nc, 2)

    def broken(m: Msg) -> Examined:
        raise ValueError("a bug in examining")

    with pytest.raises(ValueError, match="a bug in examining"):
        async with TrajectoryIntake(sub, broken, ahead=2, ping_s=10) as intake:
            while True:
                await intake.take(2, timeout_s=10)
    assert sorted(data for data, _ in await _delivered_again(sub, 2)) == ["0", "1"]  # nothing was lost with it
