"""Riding out a server restart or a node loss: the one retry layer every JetStream call goes through.

What an outage looks like from a client. A restarted single server drops every connection; nats-py
reconnects within about half a second (:mod:`miles.bus.connect`), but a request in flight is lost and
times out, and until the server's JetStream is back every request gets "no responders". In a 3-node
cluster losing a node, clients connected to it move to another URL, and while the streams whose leader
it was elect a new one, requests time out or are answered 503 (service unavailable). None of these
is an error of the actor: the same request, sent again a little later, succeeds.

So every JetStream request of an actor is wrapped by :func:`retrying`: on a *transient* error
(:func:`is_transient`: timeouts, no responders, 503 and the other "try again" answers of JetStream, a
connection that is reconnecting) it backs off (50 ms doubling to 2 s) and retries, for at most
``bus.outage_budget_s`` seconds since the first failure. Past the budget it raises
:class:`~miles.bus.errors.BusUnavailable`, whose one-line message says what the actor waited for; the
actor exits with it (``miles-node: error: ...``) rather than hang. Once the actor is stopping
(:meth:`Outage.draining`), a bus that is away is waited for at most ``DRAIN_GRACE_S`` more. Anything else (a refused
permission, a stream that does not exist, a bad request) is raised at once.

Retrying a request is only safe when doing it twice is the same as doing it once:

* JetStream publishes carry a ``Nats-Msg-Id`` (the caller's, e.g. the group id of a prompt, or a fresh
  unique one per publish), so a publish whose ack was lost and that is sent again is stored once: the
  stream's duplicate window drops the second copy and acks it with the first one's sequence.
* JetStream API calls Miles makes are idempotent (info, direct gets, purges of a subject, creating a
  stream or a consumer with the config it already has: "already exists" is success to the caller).
* An ack that cannot be confirmed is left to redelivery (:func:`ack_or_redeliver`): every consumer of a
  work stream already recognises a redelivered message it handled (the trainer's resolved issue indexes,
  a rollout worker's publish keyed by group id).

:class:`ResilientJetStream` applies this to a whole ``JetStreamContext`` (publish, every API request,
direct gets, pull-consumer fetches, and so key-value reads and writes), so actors call nats-py as usual.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import (
    ConnectionReconnectingError,
    NoRespondersError,
    OutboundBufferLimitError,
    StaleConnectionError,
)
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from miles.bus.errors import BusUnavailable, TransientBusError

log = structlog.get_logger(__name__)

T = TypeVar("T")

DEFAULT_OUTAGE_BUDGET_S = 120.0
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0
MSG_ID_HEADER = "Nats-Msg-Id"
# A request attempt that has not ended this long after its own timeout is abandoned and counts as timed out.
# nats-py bounds only the wait for the reply: a publish of the request can block in its flusher across
# quick successive reconnects, and one such attempt must not stall its caller past every outage budget.
STUCK_ATTEMPT_MARGIN_S = 5.0
# How long a draining actor (SIGTERM, a stop command) still waits for a bus that is away, whatever the budget:
# a launcher SIGKILLed takes its nats-server with it and leaves no one to SIGKILL an actor that would wait out
# a long ``bus.outage_budget_s`` to publish its last version. Below the launcher's own stop grace (20 s).
DRAIN_GRACE_S = 15.0

# JetStream error codes that mean "not now" rather than "never" (nats-server's errors.json): the JetStream
# system or a stream's group has no leader yet, a stream or consumer is offline while its peers catch up.
_TRANSIENT_ERR_CODES = {
    10008,  # JetStream system temporarily unavailable
    10023,  # insufficient resources (a cluster short of a node: placement of a new R3 asset)
    10039,  # JetStream not enabled for account (the server is still starting JetStream)
    10074,  # cluster not assigned / peer not a member yet
    10118,  # stream offline
    10119,  # consumer offline
}
# Words of the descriptions nats-server gives for the same conditions (some come without an err_code).
_TRANSIENT_WORDS = ("leader", "temporarily unavailable", "not available", "no quorum", "offline", "timeout")


def is_transient(exc: BaseException) -> bool:
    """True for an error that a retry after a short wait can cure: the server or a stream leader is away."""
    if isinstance(exc, TransientBusError):
        return True
    if isinstance(
        exc,
        NatsTimeoutError
        | asyncio.TimeoutError
        | NoRespondersError
        | NoStreamResponseError
        | ConnectionReconnectingError
        | StaleConnectionError
        | OutboundBufferLimitError,
    ):
        return True
    if isinstance(exc, APIError):
        # nats-py raises a pull fetch's 503 (a consumer whose leader moved) as a bare ServiceUnavailableError,
        # with no code on it.
        if isinstance(exc, ServiceUnavailableError) or exc.code in (408, 503, 504) or (exc.code or 0) >= 500:
            return True
        if exc.err_code in _TRANSIENT_ERR_CODES:
            return True
        description = (exc.description or "").lower()
        return any(word in description for word in _TRANSIENT_WORDS)
    return False


def describe(exc: BaseException) -> str:
    """One line for a log or an error message."""
    if isinstance(exc, APIError):
        return f"{type(exc).__name__} {exc.code} {exc.description or ''}".strip()
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


@dataclass(slots=True)
class Outage:
    """How long an actor waits out the bus, and when its connection went down (None: up)."""

    budget_s: float = DEFAULT_OUTAGE_BUDGET_S
    down_since: float | None = None
    outages: int = 0  # disconnects seen
    retries: int = 0  # requests sent again
    unconfirmed_acks: int = 0  # acks left to redelivery
    stop_by: float | None = None  # monotonic time past which a draining actor stops waiting for the bus
    _logged: set[str] = field(default_factory=set)
    _back: asyncio.Event = field(default_factory=asyncio.Event)  # set by the next reconnect (then replaced)

    def disconnected(self) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.outages += 1

    def reconnected(self) -> None:
        self.down_since = None
        back, self._back = self._back, asyncio.Event()
        back.set()

    def next_reconnect(self) -> asyncio.Event:
        """An event the next reconnect sets (not one before this call)."""
        return self._back

    def draining(self, grace_s: float = DRAIN_GRACE_S) -> None:
        """The actor is stopping: from now on a bus that is away is waited for at most ``grace_s`` more."""
        deadline = time.monotonic() + grace_s
        if self.stop_by is None or deadline < self.stop_by:
            self.stop_by = deadline

    def left_s(self, failing_since: float, now: float) -> float:
        """Seconds still to wait for a bus failing since ``failing_since``: the budget's, or the drain's if less."""
        left = self.budget_s - (now - failing_since)
        return left if self.stop_by is None else min(left, self.stop_by - now)

    def down_for(self) -> float:
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    def stats(self) -> dict[str, float]:
        return {
            "bus_outages": float(self.outages),
            "bus_retries": float(self.retries),
            "bus_unconfirmed_acks": float(self.unconfirmed_acks),
        }


async def attempt(op: Callable[[], Awaitable[T]], limit_s: float, outage: Outage) -> T:
    """One try of ``op``: its result, or a transient error (tried again): ``asyncio.TimeoutError`` once ``limit_s``
    has passed, :class:`TransientBusError` as soon as the connection is back after a drop (for a try begun while
    connected). A request sent on the connection that dropped is lost with it, and so is its reply: sending it
    again on the new connection beats waiting out its own timeout (10 s) after an outage of a second. A try
    begun while disconnected is in nats-py's reconnect buffer, sent on reconnect, and keeps its chance.

    The abandoned try is cancelled but not waited for (``asyncio.wait_for`` would wait for the cancelled task
    to end): nats-py swallows a cancellation in its flush path (``Client._flush_pending``) and goes on, so
    the try can outlive its cancellation by its whole timeout."""
    back = outage.next_reconnect() if outage.down_since is None else None
    task = asyncio.ensure_future(op())
    waits: set[asyncio.Future[Any]] = {task}
    if back is not None:
        waits.add(asyncio.ensure_future(back.wait()))
    try:
        await asyncio.wait(waits, timeout=limit_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits - {task}:
            w.cancel()
        if not task.done():  # timed out, cut off by a reconnect, or the caller itself cancelled
            task.cancel()
            task.add_done_callback(_forget)
    if task.done() and not task.cancelled():
        return task.result()
    if back is not None and back.is_set():
        raise TransientBusError("the connection dropped and came back during the request")
    raise asyncio.TimeoutError


async def request_across_reconnects(nc: Client, subject: str, payload: bytes, timeout_s: float, outage: Outage) -> Msg:
    """``nc.request(subject, payload, timeout=timeout_s)`` of an idempotent service (a direct get, a teacher's
    scoring), sent again each time the connection comes back from under it (:func:`attempt`) instead of waiting
    out ``timeout_s``: a weight chunk's 60 s once stalled a remote worker's weights past the end of a run
    whose leaf server had restarted. Raises what ``nc.request`` raises, or ``asyncio.TimeoutError`` for a try
    stuck past its timeout (see ``STUCK_ATTEMPT_MARGIN_S``)."""
    while True:
        try:
            return await attempt(
                lambda: nc.request(subject, payload, timeout=timeout_s), timeout_s + STUCK_ATTEMPT_MARGIN_S, outage
            )
        except TransientBusError:
            continue  # the request or its reply went down with the old connection: ask on the new one


def _forget(task: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned try's outcome (it was tried again), so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def gave_up(what: str, outage: Outage, exc: BaseException | None, waited_s: float | None = None) -> BusUnavailable:
    detail = f" (last error: {describe(exc)})" if exc is not None else ""
    waited_s = outage.budget_s if waited_s is None else waited_s
    if waited_s < outage.budget_s:  # cut short by a stop request
        why = f"while stopping (a draining actor waits at most {DRAIN_GRACE_S:g} s for the bus)"
    else:
        why = "(bus.outage_budget_s)"
    return BusUnavailable(f"gave up after {waited_s:.3g} s {why} waiting for {what}{detail}")


async def retrying(op: Callable[[], Awaitable[T]], *, what: str, outage: Outage) -> T:
    """``await op()``, sent again on transient errors (backing off) for up to ``outage.budget_s`` seconds.

    Raises :class:`BusUnavailable` past the budget, and any other error of ``op`` at once."""
    first_failure: float | None = None
    delay = FIRST_BACKOFF_S
    last: BaseException | None = None
    while True:
        try:
            result = await op()
        except Exception as exc:
            if not is_transient(exc):
                raise
            now = time.monotonic()
            if first_failure is None:
                first_failure = now
                log.warning("bus_retrying", what=what, error=describe(exc), budget_s=outage.budget_s)
            last = exc
            left = outage.left_s(first_failure, now)
            if left <= 0:
                raise gave_up(what, outage, last, now - first_failure) from None
            outage.retries += 1
            await asyncio.sleep(min(delay, left) * random.uniform(0.8, 1.2))
            delay = min(delay * 2, MAX_BACKOFF_S)
            continue
        if first_failure is not None:
            log.info("bus_recovered", what=what, after_s=round(time.monotonic() - first_failure, 2))
        return result


async def ack_or_redeliver(msg: Msg, outage: Outage, *, timeout_s: float = 2.0) -> bool:
    """Ack ``msg`` and wait for the server's confirmation, sending it again while the connection drops and comes
    back (for a few seconds); if it cannot be confirmed, leave it to redelivery (logged, counted) instead of
    failing: whoever consumes the stream recognises a message it handled already. True when confirmed.

    An ack that times out on a connection that stayed up was heard and left unanswered (a restarted server
    does that for deliveries made before its restart, seen in the outage tests); sending it again changed
    nothing there, so it is left to redelivery at once rather than after the whole budget."""
    budget_s = min(outage.budget_s, 3 * timeout_s)
    started = time.monotonic()
    while True:
        drops, was_up = outage.outages, outage.down_since is None
        try:
            await attempt(lambda: msg.ack_sync(timeout=timeout_s), timeout_s + STUCK_ATTEMPT_MARGIN_S, outage)
            return True
        except Exception as exc:
            if not is_transient(exc):
                raise
            timed_out = isinstance(exc, asyncio.TimeoutError)  # nats-py's TimeoutError is one too
            heard = timed_out and was_up and outage.down_since is None and outage.outages == drops
            if heard or time.monotonic() - started + FIRST_BACKOFF_S > budget_s:
                outage.unconfirmed_acks += 1
                log.warning(
                    "ack_unconfirmed",
                    subject=msg.subject,
                    left_to="redelivery",
                    error=describe(exc),
                    why="not answered on a live connection" if heard else f"not confirmed within {budget_s:g} s",
                )
                return False
            outage.retries += 1
            await asyncio.sleep(FIRST_BACKOFF_S)


class ResilientPullSubscription:
    """A bound pull consumer whose ``fetch`` rides out an outage: a transient error (the consumer's leader
    moving, the server restarting) reads as "nothing yet" (``asyncio.TimeoutError``, what every fetch loop
    already handles) until the bus has been unusable for longer than the budget."""

    def __init__(self, inner: JetStreamContext.PullSubscription, outage: Outage, what: str) -> None:
        self._inner = inner
        self._outage = outage
        self._what = what
        self._failing_since: float | None = None
        self._last: BaseException | None = None

    async def fetch(self, batch: int = 1, timeout: float | None = 5) -> list[Msg]:
        try:
            # bounded like a request attempt (STUCK_ATTEMPT_MARGIN_S): a stuck fetch reads as "nothing yet"
            msgs = await attempt(
                lambda: self._inner.fetch(batch, timeout=timeout), (timeout or 5) + STUCK_ATTEMPT_MARGIN_S, self._outage
            )
        except asyncio.TimeoutError:
            # An idle consumer and a dead server look the same here: the connection's state tells them apart.
            outage = self._outage
            if outage.down_since is not None and outage.left_s(outage.down_since, time.monotonic()) <= 0:
                raise gave_up(f"{self._what} (the connection is down)", outage, None, outage.down_for()) from None
            raise
        except Exception as exc:
            if not is_transient(exc):
                raise
            now = time.monotonic()
            if self._failing_since is None:
                self._failing_since = now
                log.warning("bus_fetch_failing", what=self._what, error=describe(exc))
            self._last = exc
            if self._outage.left_s(self._failing_since, now) <= 0:
                raise gave_up(self._what, self._outage, exc, now - self._failing_since) from None
            self._outage.retries += 1
            await asyncio.sleep(min(timeout or 1.0, 0.5))
            raise asyncio.TimeoutError from None
        if self._failing_since is not None:
            log.info("bus_fetch_recovered", what=self._what, after_s=round(time.monotonic() - self._failing_since, 2))
            self._failing_since = None
        return msgs

    async def unsubscribe(self) -> None:
        await self._inner.unsubscribe()

    async def consumer_info(self) -> Any:
        return await retrying(self._inner.consumer_info, what=f"{self._what}: consumer info", outage=self._outage)


class ResilientJetStream(JetStreamContext):
    """A ``JetStreamContext`` whose publishes, API requests, direct gets and pull fetches are retried
    through an outage (see the module docstring). Made by :func:`resilient_jetstream`."""

    def __init__(self, nc: Client, *, outage: Outage, **opts: Any) -> None:
        super().__init__(nc, **opts)
        self.outage = outage

    def _bounded(self, op: Callable[[], Awaitable[T]], timeout: float | None) -> Callable[[], Awaitable[T]]:
        """``op`` as an :func:`attempt` that ends (``asyncio.TimeoutError``: retried) at most a margin after
        ``timeout``, or when the connection comes back from under it."""
        limit = (timeout or self._timeout) + STUCK_ATTEMPT_MARGIN_S
        return lambda: attempt(op, limit, self.outage)

    async def publish(  # type: ignore[override]
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[str, Any] | None = None,
        msg_ttl: float | None = None,
    ) -> PubAck:
        # A message id makes sending it again harmless: the stream stores it once (its duplicate window).
        hdrs = dict(headers or {})
        hdrs.setdefault(MSG_ID_HEADER, self._nc._nuid.next().decode())
        parent = super().publish
        return await retrying(
            self._bounded(
                lambda: parent(subject, payload, timeout=timeout, stream=stream, headers=dict(hdrs), msg_ttl=msg_ttl),
                timeout,
            ),
            what=f"a JetStream publish on {subject}",
            outage=self.outage,
        )

    async def _api_request(self, req_subject: str, req: bytes = b"", timeout: float = 5) -> dict[str, Any]:
        parent = super()._api_request
        return await retrying(
            self._bounded(lambda: parent(req_subject, req, timeout=timeout), timeout),
            what=f"JetStream ({req_subject})",
            outage=self.outage,
        )

    async def get_msg(self, stream_name: str, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        parent = super().get_msg
        return await retrying(
            self._bounded(lambda: parent(stream_name, *args, **kwargs), None),
            what=f"a read of stream {stream_name}",
            outage=self.outage,
        )

    async def pull_subscribe_bind(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        inner = await super().pull_subscribe_bind(*args, **kwargs)
        what = f"consumer {inner._consumer} of {inner._stream}"
        return ResilientPullSubscription(inner, self.outage, what)


def resilient_jetstream(
    nc: Client, outage: Outage, *, timeout: float = 10.0, domain: str | None = None
) -> ResilientJetStream:
    """The JetStream context every actor uses (``domain``: a JetStream domain, for the API prefix)."""
    opts: dict[str, Any] = {"timeout": timeout}
    if domain:
        opts["domain"] = domain
    return ResilientJetStream(nc, outage=outage, **opts)
