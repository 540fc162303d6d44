"""The retry layer (miles/bus/retry.py): which errors are waited out, the budget, and a real server restart."""

import asyncio
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from miles.bus import retry
from miles.bus.connect import close_client, connect
from miles.bus.errors import BusUnavailable
from miles.bus.retry import Outage, is_transient, resilient_jetstream, retrying
from miles.bus.server import EmbeddedNats
from miles.ports import free_port


async def connected_server(tmp_path: Path, name: str, budget_s: float) -> tuple[EmbeddedNats, Outage, Client]:
    """A started server that can be killed and restarted, and a client riding out its outages."""
    server = EmbeddedNats(tmp_path / "bus", port=free_port())
    await server.start()
    outage = Outage(budget_s=budget_s)
    return server, outage, await connect(server.url, name=name, outage=outage)


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (ServiceUnavailableError(), True),  # how nats-py raises a pull fetch's 503: no code at all
        (APIError(code=503), True),
        (APIError(code=500, err_code=10008, description="JetStream system temporarily unavailable"), True),
        (APIError(code=503, err_code=10118, description="stream offline"), True),
        (NoRespondersError(), True),
        (asyncio.TimeoutError(), True),
        (NotFoundError(code=404, err_code=10059, description="stream not found"), False),
        (APIError(code=400, err_code=10058, description="stream name already in use"), False),
        (PermissionError("no"), False),
    ],
)
def test_what_is_waited_out(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


async def test_transient_failures_are_retried_until_the_call_succeeds() -> None:
    failures = [NoRespondersError(), ServiceUnavailableError()]

    async def op() -> str:
        if failures:
            raise failures.pop(0)
        return "ok"

    outage = Outage(budget_s=5.0)
    assert await retrying(op, what="a test call", outage=outage) == "ok"
    assert outage.retries == 2


async def test_any_other_error_is_raised_at_once() -> None:
    calls = 0

    async def op() -> None:
        nonlocal calls
        calls += 1
        raise NotFoundError(code=404, err_code=10059, description="stream not found")

    with pytest.raises(NotFoundError):
        await retrying(op, what="a test call", outage=Outage(budget_s=5.0))
    assert calls == 1


async def test_past_the_budget_one_line_says_what_was_waited_for() -> None:
    async def op() -> None:
        raise NoRespondersError()

    with pytest.raises(BusUnavailable) as info:
        await retrying(op, what="the prompt stream", outage=Outage(budget_s=0.3))
    message = str(info.value)
    assert "\n" not in message and "bus.outage_budget_s" in message and "the prompt stream" in message


async def test_a_publish_rides_out_a_server_restart_and_is_stored_once(tmp_path: Path) -> None:
    server, outage, nc = await connected_server(tmp_path, "restart", 30.0)
    try:
        js = resilient_jetstream(nc, outage, timeout=1.0)
        await js.add_stream(name="R", subjects=["r.>"])
        await js.publish("r.a", b"before", headers={"Nats-Msg-Id": "one"})
        server.kill()

        async def restart_later() -> None:
            await asyncio.sleep(1.0)
            await asyncio.to_thread(server.start_sync)

        restarting = asyncio.create_task(restart_later())
        ack = await js.publish("r.a", b"during", headers={"Nats-Msg-Id": "two"})  # sent while the server is down
        await restarting
        again = await js.publish("r.a", b"during", headers={"Nats-Msg-Id": "two"})  # a repeat: stored once
        assert again.duplicate and again.seq == ack.seq
        info = await js.stream_info("R")
        assert info.state.messages == 2 and outage.outages >= 1
    finally:
        await nc.close()
        server.stop_sync()


async def test_a_server_that_stays_away_ends_the_call_past_the_budget(tmp_path: Path) -> None:
    server, outage, nc = await connected_server(tmp_path, "gone", 1.0)
    try:
        js = resilient_jetstream(nc, outage, timeout=0.3)
        await js.add_stream(name="G", subjects=["g.>"])
        server.kill()
        with pytest.raises(BusUnavailable, match="a JetStream publish on g.a"):
            await js.publish("g.a", b"x")
        await close_client(nc)  # with the server still away: closes without raising over the actor's error
        assert nc.is_closed
    finally:
        await close_client(nc)
        server.stop_sync()


async def test_a_draining_actor_waits_for_a_server_that_went_away_only_its_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launcher SIGKILLed takes its nats-server with it, and its actors get SIGTERM: one whose last publish
    would wait out a 900 s budget for that server must give up within the drain's grace and say why."""
    monkeypatch.setattr(retry, "DRAIN_GRACE_S", 1.0)
    server, outage, nc = await connected_server(tmp_path, "drain", 900.0)
    try:
        js = resilient_jetstream(nc, outage, timeout=0.3)
        await js.add_stream(name="D", subjects=["d.>"])
        server.kill()
        outage.draining(retry.DRAIN_GRACE_S)
        with pytest.raises(BusUnavailable, match="while stopping") as info:
            await asyncio.wait_for(js.publish("d.a", b"last version"), timeout=60)
        assert "d.a" in str(info.value) and "bus.outage_budget_s" not in str(info.value)
    finally:
        await close_client(nc)
        server.stop_sync()


async def test_draining_does_not_cut_short_a_bus_that_is_up(nats_server: str) -> None:
    outage = Outage(budget_s=30.0)
    nc = await connect(nats_server, name="drain-up", outage=outage)
    try:
        outage.draining(0.0)  # the grace is long past; the bus is up, so nothing is waited for
        js = resilient_jetstream(nc, outage, timeout=2.0)
        await js.add_stream(name="DU", subjects=["du.>"])
        assert (await js.publish("du.a", b"x")).seq == 1
    finally:
        await close_client(nc)


async def test_an_attempt_stuck_past_its_timeout_is_abandoned_and_sent_again(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nats-py bounds only the wait for a reply; a request stuck before it (its publish blocked in the client's
    flusher across reconnects) must not hold its caller forever."""
    js = resilient_jetstream(nc, Outage(budget_s=10.0), timeout=0.2)
    await js.add_stream(name="S", subjects=["s.>"], allow_direct=True)
    await js.publish("s.a", b"x")
    real_get = JetStreamContext.get_msg
    stuck = asyncio.Event()

    async def first_call_hangs(self: JetStreamContext, *args: object, **kwargs: object) -> object:
        if not stuck.is_set():
            stuck.set()
            await asyncio.Event().wait()  # never answers, never times out
        return await real_get(self, *args, **kwargs)

    monkeypatch.setattr(retry, "STUCK_ATTEMPT_MARGIN_S", 0.2)
    monkeypatch.setattr(JetStreamContext, "get_msg", first_call_hangs)
    msg = await js.get_msg("S", seq=1, direct=True)
    assert stuck.is_set() and msg.data == b"x" and js.outage.retries == 1


async def test_a_request_cut_off_by_a_reconnect_is_sent_again_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose reply went down with the old connection is sent again when the connection is back, not
    after its own timeout (60 s here: the guard below would end the test long before)."""
    server, outage, nc = await connected_server(tmp_path, "cut", 30.0)
    try:
        js = resilient_jetstream(nc, outage, timeout=60.0)
        await js.add_stream(name="C", subjects=["c.>"], allow_direct=True)
        await js.publish("c.a", b"x")
        real_get = JetStreamContext.get_msg
        calls: list[str] = []

        async def first_call_lost(self: JetStreamContext, *args: object, **kwargs: object) -> object:
            if not calls:
                calls.append("lost")
                try:
                    await asyncio.Event().wait()  # its reply never comes
                except asyncio.CancelledError:
                    calls.append("abandoned")
                    raise
            calls.append("sent again")
            return await real_get(self, *args, **kwargs)

        monkeypatch.setattr(JetStreamContext, "get_msg", first_call_lost)
        reading = asyncio.create_task(js.get_msg("C", seq=1, direct=True))
        while not calls:
            await asyncio.sleep(0.01)
        server.kill()
        await asyncio.sleep(0.5)
        await asyncio.to_thread(server.start_sync)
        msg = await asyncio.wait_for(reading, 20.0)
        assert msg.data == b"x" and calls == ["lost", "abandoned", "sent again"] and outage.outages == 1
    finally:
        await nc.close()
        server.stop_sync()


class _Delivery:
    """A delivered message whose ack the server answers only from the ``answered_from``-th try on."""

    subject = "t.traj"

    def __init__(self, answered_from: int | None) -> None:
        self.answered_from = answered_from
        self.tries = 0

    async def ack_sync(self, timeout: float) -> None:
        self.tries += 1
        if self.answered_from is None or self.tries < self.answered_from:
            await asyncio.Event().wait()  # no answer (nats-py times the request out)


async def test_an_ack_not_answered_on_a_live_connection_is_left_to_redelivery_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server heard it (the connection stayed up) and does not answer: sending it again changes nothing."""
    monkeypatch.setattr(retry, "STUCK_ATTEMPT_MARGIN_S", 0.05)
    outage = Outage(budget_s=30.0)
    delivery = _Delivery(answered_from=None)
    assert await retry.ack_or_redeliver(delivery, outage, timeout_s=0.05) is False  # type: ignore[arg-type]
    assert delivery.tries == 1 and outage.unconfirmed_acks == 1


async def test_an_ack_cut_off_by_a_reconnect_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "STUCK_ATTEMPT_MARGIN_S", 30.0)
    outage = Outage(budget_s=30.0)
    delivery = _Delivery(answered_from=2)
    acking = asyncio.create_task(retry.ack_or_redeliver(delivery, outage, timeout_s=30.0))  # type: ignore[arg-type]
    while not delivery.tries:
        await asyncio.sleep(0.01)
    outage.disconnected()
    outage.reconnected()
    assert await asyncio.wait_for(acking, 5.0) is True
    assert delivery.tries == 2 and outage.unconfirmed_acks == 0


async def test_the_request_timeout_is_the_configured_one(nats_server: str) -> None:
    from miles.bus.client import Bus
    from miles.config import BusConfig

    bus = await Bus.open(BusConfig(request_timeout_s=2.5), nats_server, "timeouts", "probe")
    try:
        assert bus.js._timeout == 2.5
    finally:
        await bus.close()
