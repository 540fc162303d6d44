"""A request in flight when its server dies is sent again once the client reconnects
(``miles.bus.retry.request_across_reconnects``, what weight chunks and teacher requests go through).

Real nats-server: the responder holds the first request without answering, the server is SIGKILLed and
restarted on its port, both clients reconnect, and the request (with an hour's timeout) is answered by
its second send. nats-py alone would wait the hour.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from miles.bus.connect import close_client, connect, processed
from miles.bus.retry import Outage, request_across_reconnects
from miles.bus.server import EmbeddedNats
from miles.ports import free_port

HOUR_S = 3600.0


async def test_a_request_lost_with_its_server_is_sent_again_after_the_reconnect(tmp_path: Path) -> None:
    server = await EmbeddedNats(tmp_path / "bus", port=free_port()).start()
    outage = Outage()
    requester = await connect(server.url, name="requester", outage=outage)
    responder = await connect(server.url, name="responder")
    held = asyncio.Event()
    received: list[bytes] = []

    async def answer(msg: Msg) -> None:
        received.append(msg.data)
        if len(received) == 1:
            held.set()  # the first send is lost with the server: never answered
            return
        await msg.respond(b"chunk:" + msg.data)

    try:
        await responder.subscribe("svc.get", cb=answer)
        await processed(responder)

        async def ask() -> Msg:
            while True:
                try:
                    return await request_across_reconnects(requester, "svc.get", b"seq-5", HOUR_S, outage)
                except NoRespondersError:  # sent again before the responder subscribed again: ask again, as callers do
                    await asyncio.sleep(0.05)

        reply = asyncio.create_task(ask())
        await asyncio.wait_for(held.wait(), 30)
        server.kill()
        await server.start()  # same port: both clients reconnect, the responder re-subscribes
        msg = await asyncio.wait_for(reply, 60)  # a hang guard: only a second send can answer before the hour
        assert msg.data == b"chunk:seq-5"
        assert received == [b"seq-5", b"seq-5"]
        assert outage.outages == 1
    finally:
        await close_client(requester)
        await close_client(responder)
        await server.stop()


async def test_a_request_answered_on_its_connection_is_sent_once(nats_server: str) -> None:
    outage = Outage()
    requester = await connect(nats_server, name="requester", outage=outage)
    responder = await connect(nats_server, name="responder")
    received: list[bytes] = []

    async def answer(msg: Msg) -> None:
        received.append(msg.data)
        await asyncio.sleep(0.5)  # a slow answer on a live connection is waited for, not asked again
        await msg.respond(b"ok")

    try:
        await responder.subscribe("svc.slow", cb=answer)
        await processed(responder)
        msg = await request_across_reconnects(requester, "svc.slow", b"x", HOUR_S, outage)
        assert msg.data == b"ok" and received == [b"x"]
    finally:
        await close_client(requester)
        await close_client(responder)


async def test_a_subscription_is_registered_once_processed_returns(nats_server: str) -> None:
    """``processed`` promises what nats-py's ``flush`` does not (its PING overtakes a buffered SUB): with one
    ``flush`` instead, about 9 of these 2,000 requests from another connection found no responders."""
    requester = await connect(nats_server, name="requester")
    responder = await connect(nats_server, name="responder")

    async def answer(msg: Msg) -> None:
        await msg.respond(b"ok")

    try:
        for i in range(2000):
            sub = await responder.subscribe(f"svc.n{i}", cb=answer)
            await processed(responder)
            assert (await requester.request(f"svc.n{i}", b"x", timeout=30)).data == b"ok"
            await sub.unsubscribe()
    finally:
        await close_client(requester)
        await close_client(responder)
