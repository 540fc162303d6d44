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


async def test_a_replay_reads_in_batches_and_returns_what_single_reads_return(nc: Client) -> None:
    """stored_messages reads ``BATCH`` messages per request (one request per batch, not per message) and yields
    exactly what one direct get per message yields: every message on the filtered subject, in order, after
    ``after_seq``, with its subject, sequence, time and headers."""
    from miles.bus.follow import BATCH, next_message, next_messages, stored_messages

    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="REPLAY", subjects=["replay.>"], allow_direct=True))
    for i in range(2 * BATCH + 7):
        await js.publish(f"replay.{'a' if i % 3 else 'b'}", str(i).encode(), headers={"n": str(i)})

    async def one_by_one(subject: str, after: int) -> list[tuple[str, int, bytes | None, str]]:
        out, seq = [], after
        while (msg := await next_message(js, "REPLAY", subject, seq)) is not None:
            out.append((msg.subject, msg.seq, msg.data, (msg.headers or {})["n"]))
            seq = msg.seq or seq + 1
        return out

    for subject, after in (("replay.>", 0), ("replay.a", 0), ("replay.b", 100), ("replay.a", 10_000)):
        batched = [
            (m.subject, m.seq, m.data, (m.headers or {})["n"])
            async for m in stored_messages(js, "REPLAY", subject, after)
        ]
        assert batched == await one_by_one(subject, after), (subject, after)
    first = await next_messages(js, "REPLAY", "replay.>", 0)
    assert [m.seq for m in first] == list(range(1, BATCH + 1)) and first[0].time is not None
    assert await next_messages(js, "REPLAY", "replay.>", 2 * BATCH + 7) == []
