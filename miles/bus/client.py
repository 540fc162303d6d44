"""One actor's handle on the bus: connection, JetStream, run subjects, state bucket, dead letters."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from miles.bus.connect import connect
from miles.bus.schema import Message, SchemaError, decode, encode
from miles.bus.streams import ensure_run_streams
from miles.bus.subjects import Subjects
from miles.config import BusConfig

log = structlog.get_logger(__name__)


async def messages_until(sub: Any, done: asyncio.Event, poll_s: float = 0.5) -> AsyncIterator[Msg]:
    """Messages of a subscription until ``done`` is set; unsubscribes at the end.

    Polling with a short timeout (instead of one long wait) is what lets every loop notice a stop
    request within ``poll_s`` without cancelling a task in the middle of handling a message.
    """
    try:
        while not done.is_set():
            try:
                yield await sub.next_msg(timeout=poll_s)
            except asyncio.TimeoutError:
                continue
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


M = TypeVar("M", bound=Message)

# KV keys of the state bucket (docs/protocol.md).
KEY_TRAINER_VERSION = "trainer_version"
KEY_STATUS = "status"


@dataclass(slots=True)
class Bus:
    """Connected client plus everything an actor needs to speak the run's protocol."""

    nc: NATS
    js: JetStreamContext
    subjects: Subjects
    kv: KeyValue
    actor_id: str
    dead_lettered: int = field(default=0)

    @classmethod
    async def open(cls, cfg: BusConfig, url: str, run: str, actor_id: str) -> Bus:
        nc = await connect(
            url,
            name=f"{run}:{actor_id}",
            creds=cfg.creds,
            tls_ca=cfg.tls_ca,
            tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key,
        )
        js = nc.jetstream(timeout=10.0)
        subjects = Subjects(run)
        await ensure_run_streams(js, subjects, replicas=cfg.replicas, ack_wait_s=cfg.ack_wait_s)
        kv = await js.key_value(subjects.state_bucket)
        return cls(nc=nc, js=js, subjects=subjects, kv=kv, actor_id=actor_id)

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.drain()

    async def publish(self, subject: str, msg: Message) -> PubAck:
        """Durable publish: returns once JetStream has stored the message."""
        return await self.js.publish(subject, encode(msg))

    async def emit(self, subject: str, msg: Message) -> None:
        """Fire-and-forget core-NATS publish (heartbeats)."""
        await self.nc.publish(subject, encode(msg))

    async def dead_letter(self, origin: str, data: bytes, reason: str) -> None:
        """Park an undecodable payload, unchanged, on the run's dead-letter stream and count it."""
        self.dead_lettered += 1
        log.warning("dead_letter", origin=origin, reason=reason, size=len(data), actor=self.actor_id)
        headers = {"Miles-Origin": origin, "Miles-Reason": reason[:500], "Miles-Actor": self.actor_id}
        await self.js.publish(self.subjects.dead_letter(origin), data, headers=headers)

    async def decode_or_dead_letter(self, msg: Msg, cls: type[M]) -> M | None:
        """Decode a delivered message; a bad one is dead-lettered and acked (it is kept in the DLQ)."""
        try:
            return decode(msg.data, cls)
        except SchemaError as exc:
            await self.dead_letter(msg.subject, msg.data, str(exc))
            if msg.reply:  # JetStream delivery: remove it from the work stream, it lives on in the DLQ
                await msg.ack()
            return None

    async def get_bytes(self, key: str) -> bytes | None:
        """The value of ``key`` in the state bucket, None when it was never written (or was deleted).

        Only "absent" becomes None. A timeout, a lost connection or any other error is raised: read as
        absent it would make, e.g., a restarted controller reset its admission state and re-issue group ids
        the trainer already trained.
        """
        try:
            entry = await self.kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        return entry.value or None

    async def get_int(self, key: str, default: int) -> int:
        value = await self.get_bytes(key)
        return default if value is None else int(value.decode())

    async def put_int(self, key: str, value: int) -> None:
        await self.kv.put(key, str(value).encode())

    async def get_str(self, key: str, default: str = "") -> str:
        value = await self.get_bytes(key)
        return default if value is None else value.decode()

    async def put_str(self, key: str, value: str) -> None:
        await self.kv.put(key, value.encode())

    async def dead_letter_count(self) -> int:
        """Run-wide number of dead-lettered messages (the DLQ stream's size)."""
        info = await self.js.stream_info(self.subjects.dlq_stream)
        return int(info.state.messages)
