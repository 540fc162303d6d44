"""The in-order stream reader's ``idle`` signal, against a real nats-server: set only while it has read
everything there is, clear while it reads and while its caller handles a message (the controller counts
"not announced yet" only while it is set)."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.js.api import StreamConfig

from miles.bus.follow import follow


async def test_idle_is_set_only_while_the_reader_waits_for_news(nc: Client) -> None:
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="FOLLOW", subjects=["follow.>"], allow_direct=True))
    await js.publish("follow.a", b"0")
    idle, done = asyncio.Event(), asyncio.Event()
    seen: list[bytes] = []
    idle_while_handling: list[bool] = []

    async def read() -> None:
        async for msg in follow(nc, js, "FOLLOW", "follow.a", done, start="first", poll_s=0.2, idle=idle):
            idle_while_handling.append(idle.is_set())
            assert msg.data is not None
            seen.append(msg.data)
            await asyncio.sleep(0.3)  # handling takes a while: still not idle

    reader = asyncio.create_task(read())
    await asyncio.wait_for(idle.wait(), 5)  # read the stored one, now waiting
    assert seen == [b"0"]
    await js.publish("follow.a", b"1")
    await asyncio.sleep(0.1)
    assert not idle.is_set(), "idle while a message was being handled"
    await asyncio.wait_for(idle.wait(), 5)
    assert seen == [b"0", b"1"] and idle_while_handling == [False, False]
    done.set()
    await asyncio.wait_for(reader, 5)
    assert not idle.is_set()
