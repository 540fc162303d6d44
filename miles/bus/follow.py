"""Reading a stream subject in order without creating a consumer (what a bind-only identity can do).

The announcement follower, the controller's version tracker, the monitor and a restarted trainer read
streams in order. A nats-py ordered consumer would do that, but creating one is a
``$JS.API.CONSUMER.CREATE`` call, and whoever may make it may also point the consumer's
``deliver_subject`` anywhere, so the server would publish on the creator's behalf past its permissions
(:mod:`miles.security.permissions`). This module gives the same stream of messages with two read-only
tools instead:

* ``$JS.API.DIRECT.GET.<stream>`` with ``next_by_subj``, asked from the last sequence seen, returns
  every stored message in order (and the last one by subject for a start at the newest); with ``batch``
  (nats-server 2.11 and later) up to that many in one request, then an end-of-batch status, so a replay
  costs a round trip per :data:`BATCH` messages, not per message;
* a core subscription to the subject only *wakes* the reader when something new was published, so
  a new announcement is seen within a round trip, not a poll period. A missed wake-up (a reconnect)
  costs at most ``poll_s``: the reader looks again on a timer. Nothing read from the core
  subscription is trusted or used, so it cannot inject anything the stream does not hold.

The stream must allow direct get (``allow_direct=True``). Every actor reads announcements, metrics and
its own history this way, with or without per-role credentials: one code path.

With replicas, a direct get may be answered by a follower that has not yet applied the newest messages
(NATS promises no read-your-writes for direct gets; measured here after a leader change: 1-7% of reads
right after a write were stale). A live reader only sees such a message a poll later. A *replay* must not
end early, though (a restarted trainer would miss the step it lost, a restarted controller a report), so
:func:`stored_messages` ends only when the stream's leader (``STREAM.MSG.GET``) confirms nothing follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Literal

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError, ServiceUnavailableError

from miles.bus.errors import BusError

Start = Literal["first", "last"]

BATCH = 256  # messages per batched direct get of a replay


async def last_message(js: JetStreamContext, stream: str, subject: str) -> RawStreamMsg | None:
    """The newest message stored on ``subject`` (no wildcards) in ``stream``, or ``None``."""
    try:
        return await js.get_msg(stream, subject=subject, direct=True)
    except NotFoundError:
        return None
    except (ServiceUnavailableError, NoRespondersError):
        raise BusError(f"stream {stream} does not answer direct gets (does it exist with allow_direct?)") from None


async def next_message(
    js: JetStreamContext, stream: str, subject: str, after_seq: int, *, leader: bool = False
) -> RawStreamMsg | None:
    """The first message on ``subject`` (wildcards allowed) with a sequence above ``after_seq``, or ``None``.

    ``leader=True`` asks the stream's leader (``STREAM.MSG.GET``), whose answer no acknowledged write is
    missing from; the default direct get may come from a replica that lags (see the module docstring)."""
    try:
        return await js.get_msg(stream, seq=after_seq + 1, subject=subject, direct=not leader, next=True)
    except NotFoundError:
        return None
    except (ServiceUnavailableError, NoRespondersError):
        raise BusError(f"stream {stream} does not answer direct gets (does it exist with allow_direct?)") from None


async def next_messages(
    js: JetStreamContext, stream: str, subject: str, after_seq: int, batch: int = BATCH
) -> list[RawStreamMsg]:
    """Up to ``batch`` messages on ``subject`` with sequences above ``after_seq``, in order, from one batched
    direct get (empty if there are none; a replica may lag, as for :func:`next_message`). A server that does
    not batch answers with one message, which is returned alone."""
    nc, prefix = js._nc, js._prefix  # nats-py has no batched direct get: the request is made here
    inbox = nc.new_inbox()
    replies = await nc.subscribe(inbox)
    try:
        body = json.dumps({"seq": after_seq + 1, "next_by_subj": subject, "batch": batch}).encode()
        await nc.publish(f"{prefix}.DIRECT.GET.{stream}", body, reply=inbox)
        out: list[RawStreamMsg] = []
        while True:
            try:
                reply = await replies.next_msg(timeout=js._timeout)
            except asyncio.TimeoutError:
                raise BusError(f"stream {stream}: a batched direct get after {after_seq} went unanswered") from None
            headers = reply.headers or {}
            status = headers.get("Status")
            if status in ("404", "204"):  # nothing (more) on the subject; 204: the end of the batch
                return out
            if status is not None:
                raise BusError(f"stream {stream}: direct get answered {status} {headers.get('Description', '')}")
            out.append(js._lift_msg_to_raw_msg(reply))  # as nats-py's own direct get returns it
            if "Nats-Num-Pending" not in headers:  # a server that does not batch: one message, no end marker
                return out
    finally:
        with contextlib.suppress(Exception):
            await replies.unsubscribe()


async def message_at(js: JetStreamContext, stream: str, seq: int) -> RawStreamMsg:
    """The message at sequence ``seq`` of ``stream``: a direct get, asked again of the leader if a replica
    does not have it yet. Raises ``NotFoundError`` if the leader does not have it either."""
    try:
        return await js.get_msg(stream, seq, direct=True)
    except NotFoundError:
        return await js.get_msg(stream, seq)


async def follow(
    nc: Client,
    js: JetStreamContext,
    stream: str,
    subject: str,
    done: asyncio.Event,
    *,
    start: Start = "last",
    poll_s: float = 1.0,
    after_seq: int | None = None,
    idle: asyncio.Event | None = None,
) -> AsyncIterator[RawStreamMsg]:
    """Every message stored on ``subject`` in ``stream``, in stream order, until ``done`` is set.

    ``start="last"`` begins with the newest message on ``subject`` (which must then be a literal
    subject, like the announcements); ``"first"`` with the oldest still stored; ``after_seq`` (which
    overrides ``start``) with the first one after that stream sequence (a reader that has read
    everything up to it, :func:`stored_messages`).

    ``idle``, if given, is set only while the reader has found nothing new and waits: clear while it
    reads (a request that retries through an outage included) and while the caller handles a message.
    "Not read yet" means "not there" only while it is set.
    """
    wake = asyncio.Event()

    async def on_publish(_: Msg) -> None:
        wake.set()

    sub = await nc.subscribe(subject, cb=on_publish)
    try:
        seq = 0
        if after_seq is not None:
            seq = after_seq
        elif start == "last":
            newest = await last_message(js, stream, subject)
            if newest is not None:
                seq = newest.seq or 0
                yield newest
        looked_again = False
        while not done.is_set():
            woken = wake.is_set()
            wake.clear()
            found = False
            while (msg := await next_message(js, stream, subject, seq)) is not None:
                found = True
                seq = msg.seq or seq + 1
                yield msg
                if done.is_set():
                    return
            if woken and not found and not looked_again:
                # The core copy can overtake the stored one (or never be stored: a duplicate): look
                # once more shortly, then wait.
                looked_again = True
                await asyncio.sleep(0.05)
                continue
            looked_again = False
            if idle is not None:
                idle.set()
            try:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(first_of(wake, done), timeout=poll_s)
            finally:
                if idle is not None:
                    idle.clear()
    finally:
        if idle is not None:
            idle.clear()
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def stored_messages(
    js: JetStreamContext, stream: str, subject: str, after_seq: int = 0
) -> AsyncIterator[RawStreamMsg]:
    """Every message on ``subject`` (wildcards allowed) stored in ``stream`` after ``after_seq``, in order, up to
    the newest one there when the iteration reaches it (a replay; :func:`follow` ``after_seq=`` goes on live).

    Batched direct gets, but the end is the leader's: a lagging replica's "nothing more" is checked with one leader
    read, and the replay goes on from what the leader returns."""
    seq = after_seq
    while True:
        batch = await next_messages(js, stream, subject, seq)
        if not batch:
            msg = await next_message(js, stream, subject, seq, leader=True)
            if msg is None:
                return
            batch = [msg]
        for msg in batch:
            seq = msg.seq or seq + 1
            yield msg


async def first_of(*events: asyncio.Event) -> None:
    """Return as soon as one of ``events`` is set."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
