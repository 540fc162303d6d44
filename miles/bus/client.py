"""One actor's handle on the bus: connection, JetStream, run subjects, state bucket, signatures, refusals.

Trust. What an actor reads off the bus is accepted only through :meth:`Bus.accept` (or
:meth:`Bus.accept_any`): the bytes must decode to a valid message of the expected kind and schema, and a
kind that the trainer or the controller signs (:data:`miles.security.signing.SIGNED_BY`) must carry that
role's valid signature whenever the actor has the run's keys (``bus.credentials_dir``). Anything else is
*refused*: parked unchanged on the dead-letter stream under this actor's role with the reason, counted in
:attr:`Bus.refused` by category, logged, acked if it was work, and never acted on. An actor's own trust
rules (a version the data plane does not hold, a group that was never issued, ...) refuse through
:meth:`Bus.refuse` the same way. ``dead_lettered`` (what actors refused, reported in their heartbeats) is
thus a different number from the size of the dead-letter stream, which anyone allowed to publish there
could inflate.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import BucketNotFoundError, KeyWrongLastSequenceError
from nats.js.errors import NotFoundError as JsNotFoundError
from nats.js.kv import KeyValue

from miles.bus.connect import close_client, connect
from miles.bus.errors import BusError
from miles.bus.retry import MSG_ID_HEADER, Outage, ack_or_redeliver, resilient_jetstream
from miles.bus.schema import Message, SchemaError, decode, decode_any, encode
from miles.bus.streams import ensure_run_streams
from miles.bus.subjects import Subjects, kv_stream, kv_subject
from miles.config import BusConfig
from miles.security.signing import (
    SIGNATURE_HEADER,
    SIGNED_BY,
    SIGNERS,
    MessageSigner,
    MessageVerifier,
    SignatureError,
)

log = structlog.get_logger(__name__)


def bound_msg_id(base: str, run_instance: str, data: bytes, signature: str = "") -> str:
    """``base`` plus a digest of the run instance, the payload and its signature, as the ``Nats-Msg-Id``.

    The server drops a message whose id it stored within the duplicate window. A predictable id alone
    (``step-v9``, ``g1856``) let anyone who may publish there (or a replay of an earlier run under the same
    name) store a copy first and so suppress the genuine message. Bound to what only the genuine publisher
    produces, a copy of another instance, other bytes or no valid signature gets another id; the same
    message sent again (a retry, a restarted controller's re-issue) keeps its id and is stored once.
    """
    digest = hashlib.blake2b(digest_size=10)
    for part in (run_instance.encode(), signature.encode(), data):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return f"{base}.{digest.hexdigest()}"


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


class Received(Protocol):
    """A message as read off the bus: a core or JetStream delivery (``Msg``) or a direct get."""

    subject: str
    data: bytes | None  # None for an empty payload (nats-py's stored-message reads)
    headers: dict[str, str] | None


M = TypeVar("M", bound=Message)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a received message must be refused: the reason dead-lettered with it, and its count's category."""

    reason: str
    category: str


# KV keys of the state bucket (docs/protocol.md).
KEY_TRAINER_VERSION = "trainer_version"
KEY_STATUS = "status"
KEY_RUN_INSTANCE = "run_instance"
KEY_GROUPS_ISSUED = "groups_issued"  # the controller's count of issued groups: the trainer's issue window
KEY_TRAINER_FLOOR = "trainer_floor"  # JSON {"events": seq, "traj": seq}: where a restart from a checkpoint reads


@dataclass(slots=True)
class Bus:
    """Connected client plus everything an actor needs to speak the run's protocol."""

    nc: NATS
    js: JetStreamContext
    subjects: Subjects
    kv: KeyValue
    actor_id: str
    role: str = "peer"
    signer: MessageSigner | None = None  # the trainer's or the controller's key, with credentials
    verifier: MessageVerifier | None = None  # the signing roles' public keys, with credentials
    require_signatures: bool = False
    creates_streams: bool = True  # False with credentials: the setup step created them, actors only bind
    run_nonce: str | None = None  # the credentials bundle's run instance
    outage: Outage = field(default_factory=Outage)  # the retry layer's budget and clock (miles.bus.retry)
    dead_lettered: int = 0  # messages this actor refused
    refused: Counter[str] = field(default_factory=Counter)  # ... by category
    _run_instance: str | None = None
    # Called after each refusal (the actor sends its heartbeat, whose counts the run summary adds up, at once)
    on_refusal: Callable[[], None] | None = None

    @classmethod
    async def open(cls, cfg: BusConfig, url: str, run: str, actor_id: str, *, role: str = "peer") -> Bus:
        """Connect as ``actor_id`` of ``role`` (with that role's credentials when ``cfg.credentials_dir`` is
        set), make sure the run's streams exist (open bus) or are there to bind to (credentials)."""
        creds = None
        if cfg.credentials_dir is not None:
            from miles.security.bundle import CredentialsError
            from miles.security.config import resolve_credentials

            try:
                creds = resolve_credentials(cfg, role)
            except (CredentialsError, ValueError) as exc:  # one line: the actor cannot start
                raise BusError(f"bus.credentials_dir: {exc}") from None
        outage = Outage(budget_s=cfg.outage_budget_s)
        nc = await connect(
            url,
            name=f"{run}:{actor_id}",
            creds=cfg.creds,
            tls_ca=cfg.tls_ca,
            tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key,
            extra_options=creds.nats_options() if creds is not None else None,
            outage=outage,
        )
        # Every JetStream call of the actor rides out a server restart or a leader election (miles.bus.retry).
        js = resilient_jetstream(nc, outage, timeout=cfg.request_timeout_s, domain=cfg.js_domain)
        subjects = Subjects(run)
        if creds is None:
            await ensure_run_streams(js, subjects, replicas=cfg.replicas, ack_wait_s=cfg.ack_wait_s)
        elif creds.role == "setup":
            await nc.close()
            raise BusError(
                "the setup identity prepares streams (miles.bus.streams.ensure_run_streams), it runs no actor"
            )
        try:
            kv = await js.key_value(subjects.state_bucket)
        except (BucketNotFoundError, JsNotFoundError):
            await nc.close()
            raise BusError(
                f"run {run!r} is not set up on {url}: its streams and buckets do not exist (run the setup step "
                "first: `miles-node --role setup`, which `miles run` does)"
            ) from None
        if creds is not None and creds.run != run:
            await nc.close()
            raise BusError(f"bus.credentials_dir holds the credentials of run {creds.run!r}, not {run!r}")
        return cls(
            nc=nc,
            js=js,
            subjects=subjects,
            kv=kv,
            actor_id=actor_id,
            role=role,
            signer=creds.signer() if creds is not None and creds.role in SIGNERS else None,
            verifier=creds.verifier() if creds is not None else None,
            require_signatures=creds is not None and cfg.require_signatures,
            creates_streams=creds is None,
            run_nonce=creds.run_nonce if creds is not None else None,
            outage=outage,
        )

    async def close(self) -> None:
        await close_client(self.nc)

    # ------------------------------------------------------------------ publishing

    def sign(self, subject: str, msg: Message, data: bytes) -> dict[str, str]:
        """Signature headers for ``msg`` if this actor is the role that signs its kind, else none."""
        if self.signer is not None and SIGNED_BY.get(msg.KIND) == self.signer.signer:
            return self.signer.headers(subject, data)
        return {}

    async def publish(
        self, subject: str, msg: Message, *, msg_id: str | None = None, by_content: bool = True
    ) -> PubAck:
        """Durable publish: returns once JetStream has stored the message. ``msg_id`` lets the server drop
        a re-sent copy (its duplicate window).

        The id sent is ``msg_id`` bound to the run instance and, with ``by_content``, to the bytes and their
        signature (:func:`bound_msg_id`): a re-sent copy has the same id, while a replayed message of an
        earlier run or a forgery cannot occupy the id of a genuine message still to come. Without
        ``by_content`` the caller's id must already hold what a forger cannot know (an evaluation's claim)."""
        data = encode(msg)
        headers = self.sign(subject, msg, data)
        if msg_id is not None:
            signature = headers.get(SIGNATURE_HEADER, "") if by_content else ""
            headers[MSG_ID_HEADER] = bound_msg_id(
                msg_id, await self.run_instance() or "", data if by_content else b"", signature
            )
        return await self.js.publish(subject, data, headers=headers or None)

    async def ack(self, msg: Msg) -> bool:
        """Ack ``msg`` with the server's confirmation; one that cannot be confirmed through an outage is left
        to redelivery (the consumer recognises what it handled) instead of failing the actor."""
        return await ack_or_redeliver(msg, self.outage)

    async def emit(self, subject: str, msg: Message) -> None:
        """Fire-and-forget core-NATS publish (heartbeats, wake-ups)."""
        data = encode(msg)
        await self.nc.publish(subject, data, headers=self.sign(subject, msg, data) or None)

    # ------------------------------------------------------------------ receiving

    def check_signature(self, received: Received, kind: str) -> None:
        """Raise :class:`SignatureError` if ``kind`` is signed and ``received`` lacks its signer's valid
        signature (only when this actor holds the keys and requires signatures)."""
        signer = SIGNED_BY.get(kind)
        if signer is None or not self.require_signatures or self.verifier is None:
            return
        self.verifier.verify(received.subject, received.data, received.headers, signer)

    def examine(self, received: Received, cls: type[M]) -> M | Refusal:
        """The message of kind ``cls`` in ``received``, decoded and verified, or why it must be refused. No side
        effects and no event loop: a reader may examine a batch on a thread (the trainer does, while it trains)."""
        try:
            message = decode(received.data, cls)
        except SchemaError as exc:
            return Refusal(str(exc), "malformed")
        return self._signed(received, message)

    def _signed(self, received: Received, message: M) -> M | Refusal:
        try:
            self.check_signature(received, message.KIND)
        except SignatureError as exc:
            return Refusal(f"{message.KIND}: {exc}", "unsigned")
        return message

    async def accept(self, received: Received, cls: type[M]) -> M | None:
        """The message of kind ``cls`` in ``received``, decoded and verified; None if refused (dead-lettered,
        counted and, for JetStream work, acked: it lives on in the DLQ)."""
        return await self._refused_or(received, self.examine(received, cls))

    async def accept_any(self, received: Received) -> Message | None:
        """Like :meth:`accept` for a subject that carries several kinds."""
        try:
            message = decode_any(received.data)
        except SchemaError as exc:
            return await self._refused_or(received, Refusal(str(exc), "malformed"))
        return await self._refused_or(received, self._signed(received, message))

    async def _refused_or(self, received: Received, verdict: M | Refusal) -> M | None:
        if isinstance(verdict, Refusal):
            await self.refuse(received, verdict.reason, category=verdict.category)
            return None
        return verdict

    async def refuse(self, received: Received, reason: str, *, category: str) -> None:
        """Refuse ``received``: park it unchanged on the dead-letter stream with ``reason``, count it under
        ``category``, and ack it if it was JetStream work (so it is not redelivered)."""
        data = received.data or b""  # an empty payload arrives as None from a stored-message read
        self.dead_lettered += 1
        self.refused[category] += 1
        if self.on_refusal is not None:
            self.on_refusal()
        if self.role == "monitor":  # publishes nothing, not even dead letters: counted and logged only
            log.warning("refused", category=category, origin=received.subject, reason=reason, actor=self.actor_id)
            return
        log.warning(
            "refused",
            category=category,
            origin=received.subject,
            reason=reason,
            size=len(data),
            actor=self.actor_id,
        )
        headers = {
            "Miles-Origin": received.subject,
            "Miles-Reason": reason[:500],
            "Miles-Category": category,
            "Miles-Actor": self.actor_id,
        }
        await self.js.publish(self.subjects.dead_letter(self.role, received.subject), data, headers=headers)
        if isinstance(received, Msg) and received.reply.startswith("$JS.ACK."):
            # JetStream delivery: remove it from the work stream. A core request's reply subject is the asker's
            # inbox, where an "ack" would arrive as an empty answer (and spend a teacher's one reply).
            await received.ack()

    def refusal_stats(self) -> dict[str, float]:
        """``dead_lettered`` and ``refused_<category>`` for the heartbeat (and the retry layer's counts)."""
        return (
            {"dead_lettered": float(self.dead_lettered)}
            | {f"refused_{category}": float(n) for category, n in sorted(self.refused.items())}
            | self.outage.stats()
        )

    # ------------------------------------------------------------------ run instance

    async def run_instance(self) -> str | None:
        """The id of this run's instance (the bundle's nonce with credentials; else what the controller wrote
        into the state bucket at its first start), or None while unknown. A control command of another
        instance, e.g. an earlier run under the same name whose events are still stored, is never obeyed."""
        if self._run_instance is None:
            self._run_instance = self.run_nonce or (await self.get_str(KEY_RUN_INSTANCE)) or None
        return self._run_instance

    async def claim_run_instance(self) -> str:
        """Controller: record the run instance in the state bucket (once; a restart finds its own). Raises
        :class:`BusError` if the bucket names another instance (the streams of an earlier run of this name)."""
        wanted = self.run_nonce
        existing = await self.get_str(KEY_RUN_INSTANCE)
        if not existing:
            try:
                await self.kv.create(KEY_RUN_INSTANCE, (wanted or secrets.token_hex(16)).encode())
            except KeyWrongLastSequenceError:  # written concurrently (a second controller): read it back
                pass
            existing = await self.get_str(KEY_RUN_INSTANCE)
        if wanted is not None and existing != wanted:
            raise BusError(
                f"run {self.subjects.run!r} on this server belongs to run instance {existing[:8]}..., not this "
                f"bundle's {wanted[:8]}...: its streams hold an earlier run under the same name. Use another run "
                "name, or delete that run's streams"
            )
        self._run_instance = existing
        return existing

    # ------------------------------------------------------------------ state bucket

    async def get_bytes(self, key: str) -> bytes | None:
        """The value of ``key`` in the state bucket, None when it was never written (or was deleted).

        Only "absent" becomes None. A timeout, a lost connection or any other error is raised: read as
        absent it would make, e.g., a restarted controller reset its admission state and re-issue group ids
        the trainer already trained.

        A leader read (``STREAM.MSG.GET``), not nats-py's direct get: with replicas a direct get may be
        answered by a follower that has not applied the newest put yet (after a leader change, 1-7% of
        reads right after a put, measured), and a stale issue window made the trainer refuse trajectories
        of groups the controller had issued, whose admission credit was then lost: the run stalled.
        """
        bucket = self.subjects.state_bucket
        try:
            msg = await self.js.get_msg(kv_stream(bucket), subject=kv_subject(bucket, key))
        except JsNotFoundError:
            return None
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
            return None
        return msg.data or None

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

    async def dead_letter_stream_size(self) -> int:
        """Messages on the run's dead-letter stream (what actors refused, plus whatever else was put there)."""
        info = await self.js.stream_info(self.subjects.dlq_stream)
        return int(info.state.messages)
