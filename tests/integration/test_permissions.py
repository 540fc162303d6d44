"""Generated identities against a real nats-server: each role can do what it must and nothing else.

Every test starts the embedded server with the bundle's ``server.conf`` (accounts, nkey users,
mutual TLS), prepares the run's streams with the ``setup`` identity, then connects as one role and
exercises that role's code paths (nats-py calls the actors make, the data plane's
:class:`WeightStore`, the consumer-free follower). Refusals are the server's: a publish counts as
refused only when the server answered ``Permissions Violation`` for exactly that subject.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from miles.bus.connect import processed
from miles.bus.follow import follow, last_message, next_message
from miles.bus.server import EmbeddedNats
from miles.bus.streams import ensure_run_streams
from miles.security.bundle import RoleCredentials, server_config, write_bundle
from miles.security.permissions import RunNames
from miles.sync.transport.dataplane import WeightStore

RUN = "sec"
NAMES = RunNames(RUN)
S = NAMES.subjects
CONTROLLER_READS = {  # what the controller reads in order, by direct get (its state is rebuilt from them)
    S.discarded: S.events_stream,
    S.weights_held: S.events_stream,
    NAMES.eval_results: S.events_stream,
    S.step: S.metrics_stream,
}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bundle(tmp_path_factory.mktemp("auth") / "auth", RUN, hostnames=["miles-test.invalid"])


@pytest.fixture
async def server(tmp_path: Path, bundle: Path) -> AsyncIterator[EmbeddedNats]:
    async with EmbeddedNats(tmp_path / "bus", extra_config=server_config(bundle)) as srv:
        yield srv


@dataclass
class Session:
    """A connection as one role, recording the server's permission errors."""

    nc: Client
    js: JetStreamContext
    errors: list[str] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def violation(self, needle: str, timeout: float = 5.0) -> bool:
        """Whether the server reported a permissions violation whose text contains ``needle``."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            if any("permissions violation" in e.lower() and needle.lower() in e.lower() for e in self.errors):
                return True
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), remaining)
            except asyncio.TimeoutError:
                return False

    async def refused_publish(self, subject: str, data: bytes = b"forged") -> bool:
        await self.nc.publish(subject, data)
        await processed(self.nc)
        return await self.violation(f'Publish to "{subject}"')

    async def refused_subscribe(self, subject: str) -> bool:
        sub = await self.nc.subscribe(subject)
        await processed(self.nc)
        refused = await self.violation(f'Subscription to "{subject}"')
        await sub.unsubscribe()
        return refused

    def clean(self) -> list[str]:
        return [e for e in self.errors if "permissions violation" in e.lower()]


async def connect_as(url: str, bundle: Path, role: str) -> Session:
    creds = RoleCredentials.load(bundle, role)  # type: ignore[arg-type]
    session: Session

    async def error_cb(exc: Exception) -> None:
        session.errors.append(str(exc))
        session.arrived.set()

    nc = Client()
    await nc.connect(
        servers=[url],
        name=f"test:{role}",
        allow_reconnect=False,
        connect_timeout=3,
        error_cb=error_cb,
        **creds.nats_options(),
    )
    session = Session(nc=nc, js=nc.jetstream(timeout=10.0))
    return session


@pytest.fixture
async def as_role(server: EmbeddedNats, bundle: Path) -> AsyncIterator[Callable[[str], Awaitable[Session]]]:
    sessions: list[Session] = []

    async def open_(role: str) -> Session:
        session = await connect_as(server.url, bundle, role)
        sessions.append(session)
        return session

    yield open_
    for session in sessions:
        if not session.nc.is_closed:
            await session.nc.close()


async def prepare_run(js: JetStreamContext) -> None:
    """The setup step itself: every stream, durable consumer and bucket of the run."""
    await ensure_run_streams(js, S, replicas=1, ack_wait_s=30.0)


@pytest.fixture
async def prepared(as_role: Callable[[str], Awaitable[Session]]) -> Callable[[str], Awaitable[Session]]:
    setup = await as_role("setup")
    await prepare_run(setup.js)
    assert setup.clean() == []
    return as_role


def pack(kind: str, **fields: object) -> bytes:
    return msgpack.packb({"schema": 1, "kind": kind, **fields})


# --------------------------------------------------------------------------- what each role must do


async def test_setup_prepares_the_run_but_sends_no_run_message(prepared: Callable[[str], Awaitable[Session]]) -> None:
    setup = await prepared("setup")
    names = {si.config.name for si in await setup.js.streams_info()}
    assert set(NAMES.streams) <= names
    for subject in (S.prompts, S.weights, S.control, S.traj, f"$KV.{S.state_bucket}.status"):
        assert await setup.refused_publish(subject), (subject, setup.errors)
    assert await setup.refused_publish(f"$JS.API.CONSUMER.MSG.NEXT.{S.prompts_stream}.{S.ROLLOUT_CONSUMER}")
    assert await setup.refused_subscribe(f"{RUN}.>")


async def publish_weights(trainer: Session, version: int = 0, payload: bytes = b"w" * 5000) -> bytes:
    """The trainer's publish path: chunks and manifest through the data plane, then the announcement."""
    store = WeightStore(trainer.js, RUN, chunk_bytes=1024, keep_versions=2)  # bind, never create
    info = await store.put(version, payload)
    announcement = pack(
        "weights_announced", version=version, digest=info.digest, size=info.size, chunks=info.chunks, published_at=1.0
    )
    await trainer.js.publish(S.weights, announcement)
    return announcement


async def trainer_duties(trainer: Session, rollout: Session, controller: Session) -> None:
    """Weights (full and delta), announcements, discards, step metrics, done, heartbeat, its dead letters,
    the stop command, its KV key, and the trajectories: pull from its durable, read back by sequence, ack."""
    await publish_weights(trainer, 0)
    await publish_weights(trainer, 1)
    await publish_weights(trainer, 2)  # keep_versions=2: purges version 0 by subject
    delta = WeightStore(trainer.js, RUN, chunk_bytes=1024, keep_versions=2, kind="delta")
    await delta.put(3, b"d" * 100)
    assert await WeightStore(trainer.js, RUN, chunk_bytes=1024, keep_versions=2).versions() == [1, 2]
    await trainer.js.publish(S.discarded, pack("groups_discarded", group_ids=[]))
    await trainer.js.publish(S.step, pack("step_metrics", step=0), headers={"Nats-Msg-Id": "step-0"})
    await trainer.js.publish(S.done, pack("trainer_done", policy_version=3, steps=3))
    await trainer.nc.publish(S.heartbeat("trainer", "t0"), pack("heartbeat", role="trainer", actor_id="t0"))
    await trainer.js.publish(f"{RUN}.dlq.trainer.{S.traj.replace('.', '_')}", b"junk")
    control = await trainer.nc.subscribe(S.control)
    await processed(trainer.nc)
    await controller.js.publish(S.control, pack("control", command="stop"))
    assert (await control.next_msg(timeout=5)).subject == S.control
    kv = await trainer.js.key_value(S.state_bucket)
    await kv.put("trainer_version", b"3")
    assert (await kv.get("trainer_version")).value == b"3"
    ack = await rollout.js.publish(S.traj, pack("trajectory", group_id="g0"))
    sub = await trainer.js.pull_subscribe_bind(durable=S.TRAINER_CONSUMER, stream=S.traj_stream)
    (msg,) = await sub.fetch(1, timeout=5)
    assert (await trainer.js.get_msg(S.traj_stream, seq=ack.seq, direct=True)).data == msg.data
    await msg.ack_sync()
    # bus.retention recovery: the ack floor a checkpoint records, the trajectories no kept checkpoint needs
    assert (await trainer.js.consumer_info(S.traj_stream, S.TRAINER_CONSUMER)).ack_floor.stream_seq == ack.seq
    await kv.put("trainer_floor", b'{"events": 0, "traj": 0}')
    await trainer.js.purge_stream(S.traj_stream, seq=ack.seq + 1)
    with pytest.raises(NotFoundError):  # purged
        await trainer.js.get_msg(S.traj_stream, seq=ack.seq, direct=True)
    for s in (sub, control):
        await s.unsubscribe()


async def controller_duties(controller: Session, trainer: Session, rollout: Session) -> None:
    """Prompts, evaluation work, stop, eval metrics, run state and run info, its durables on EVENTS and
    METRICS, every announcement in order (no consumer), heartbeats of all roles, queue sizes."""
    hb = await controller.nc.subscribe(S.heartbeat("*", "*"))
    control = await controller.nc.subscribe(S.control)
    await processed(controller.nc)
    await controller.js.publish(S.prompts, pack("prompt_group", group_id="g0"))
    await controller.js.publish(NAMES.evalq, pack("eval_item", item_id="e0"))
    await controller.js.publish(S.eval, pack("eval_result", accuracy=0.5))
    state = await controller.js.key_value(S.state_bucket)
    await state.put("controller_state", b"{}")
    await state.put("status", b"running")
    info = await controller.js.key_value(NAMES.runinfo_bucket)
    await info.put("sampling", b"{}")
    await processed(controller.nc)
    await controller.nc.publish(S.heartbeat("controller", "c0"), pack("heartbeat"))
    await controller.js.publish(f"{RUN}.dlq.controller.{S.weights.replace('.', '_')}", b"junk")
    await rollout.nc.publish(S.heartbeat("rollout", "r0"), pack("heartbeat"))
    await processed(rollout.nc)
    assert (await hb.next_msg(timeout=5)).subject == S.heartbeat("controller", "c0")
    assert (await hb.next_msg(timeout=5)).subject == S.heartbeat("rollout", "r0")
    await publish_weights(trainer, 0)
    await rollout.js.publish(S.weights_held, pack("weights_held", worker_id="r0", version=0))
    await rollout.js.publish(NAMES.eval_results, pack("eval_results", item_id="e0"))
    await rollout.js.publish(S.traj, pack("trajectory", group_id="g0"))
    await trainer.js.publish(S.discarded, pack("groups_discarded", group_ids=[]))
    await trainer.js.publish(S.step, pack("step_metrics", step=0))
    for subject, stream in CONTROLLER_READS.items():
        assert await next_message(controller.js, stream, subject, 0) is not None, subject
    done = asyncio.Event()
    seen = []
    async for msg in follow(controller.nc, controller.js, S.events_stream, S.weights, done):
        seen.append(msgpack.unpackb(msg.data)["version"])
        if len(seen) == 1:
            await publish_weights(trainer, 1)
        if len(seen) == 2:
            done.set()
    assert seen == [0, 1]
    await controller.js.publish(S.control, pack("control", command="stop"))
    assert (await control.next_msg(timeout=5)).subject == S.control
    assert (await controller.js.stream_info(S.dlq_stream)).state.messages == 1
    # its snapshots, written and read back; the events and metrics they hold, purged (bus.retention recovery)
    await controller.js.publish(S.snapshot, pack("controller_snapshot"))
    assert await next_message(controller.js, S.snapshot_stream, S.snapshot, 0, leader=True) is not None
    assert await next_message(controller.js, S.snapshot_stream, S.snapshot, 0) is not None
    last = (await controller.js.stream_info(S.events_stream)).state.last_seq
    await controller.js.purge_stream(S.events_stream, seq=last)
    await controller.js.purge_stream(S.metrics_stream, seq=2)
    assert (await controller.js.stream_info(S.events_stream)).state.first_seq == last
    for stream, durable in (
        (S.prompts_stream, S.ROLLOUT_CONSUMER),
        (NAMES.evalq_stream, NAMES.ROLLOUT_EVAL_CONSUMER),
        (S.traj_stream, S.TRAINER_CONSUMER),
    ):
        assert (await controller.js.stream_info(stream)).state.messages == 1
        assert (await controller.js.consumer_info(stream, durable)).num_pending == 1
    assert (await state.get("controller_state")).value == b"{}"
    assert (await info.get("sampling")).value == b"{}"
    for sub in (hb, control):
        await sub.unsubscribe()


async def rollout_duties(rollout: Session, trainer: Session, controller: Session) -> None:
    """Prompts and evaluation work from their durables (ack, in-progress, nak), trajectories, held-weight
    reports, eval results, its heartbeat and dead letters, the stop command, the newest announcement and
    any older one, the weight payload by direct get (full and delta), the run state and run info."""
    control = await rollout.nc.subscribe(S.control)
    await processed(rollout.nc)
    await controller.js.publish(S.prompts, pack("prompt_group", group_id="g0"))
    await controller.js.publish(S.prompts, pack("prompt_group", group_id="g1"))
    await controller.js.publish(NAMES.evalq, pack("eval_item", item_id="e0"))
    await (await controller.js.key_value(NAMES.runinfo_bucket)).put("tokenizer", b"{}")
    await (await trainer.js.key_value(S.state_bucket)).put("trainer_version", b"1")
    await publish_weights(trainer, 0, b"a" * 3000)
    newest = await publish_weights(trainer, 1, b"b" * 3000)
    await WeightStore(trainer.js, RUN, chunk_bytes=1024, keep_versions=2, kind="delta").put(1, b"c" * 2000)

    prompts = await rollout.js.pull_subscribe_bind(durable=S.ROLLOUT_CONSUMER, stream=S.prompts_stream)
    first, second = await prompts.fetch(2, timeout=5)
    await first.in_progress()
    await rollout.js.publish(S.traj, pack("trajectory", group_id="g0"))
    await first.ack_sync()
    await second.nak()
    evalq = await rollout.js.pull_subscribe_bind(durable=NAMES.ROLLOUT_EVAL_CONSUMER, stream=NAMES.evalq_stream)
    (item,) = await evalq.fetch(1, timeout=5)
    await rollout.js.publish(NAMES.eval_results, pack("eval_results", item_id="e0"))
    await item.ack_sync()
    await rollout.js.publish(S.weights_held, pack("weights_held", worker_id="r0", version=1))
    await rollout.nc.publish(S.heartbeat("rollout", "r0"), pack("heartbeat"))
    await rollout.js.publish(f"{RUN}.dlq.rollout.{S.prompts.replace('.', '_')}", b"junk")

    latest = await last_message(rollout.js, S.events_stream, S.weights)
    assert latest is not None and latest.data == newest
    done = asyncio.Event()
    followed = []
    async for msg in follow(rollout.nc, rollout.js, S.events_stream, S.weights, done, poll_s=30):
        followed.append(msg.data)
        if len(followed) == 1:
            newest = await publish_weights(trainer, 2, b"e" * 3000)  # seen through the core wake-up
        else:
            done.set()
    assert followed[1] == newest
    older = await rollout.js.get_msg(S.events_stream, seq=1, subject=S.weights, direct=True, next=True)
    assert msgpack.unpackb(older.data)["version"] == 0
    full = WeightStore(rollout.js, RUN, chunk_bytes=1024, keep_versions=2, fetch="client")
    assert await full.latest() == 2
    assert bytes(await full.get(1)) == b"b" * 3000
    delta = WeightStore(rollout.js, RUN, chunk_bytes=1024, keep_versions=2, fetch="client", kind="delta")
    assert await delta.versions() == [1]
    assert bytes(await delta.get(1)) == b"c" * 2000
    assert (await (await rollout.js.key_value(S.state_bucket)).get("trainer_version")).value == b"1"
    assert (await (await rollout.js.key_value(NAMES.runinfo_bucket)).get("tokenizer")).value == b"{}"
    await controller.js.publish(S.control, pack("control", command="stop"))
    assert (await control.next_msg(timeout=5)).subject == S.control
    for sub in (prompts, evalq, control):
        await sub.unsubscribe()


async def monitor_duties(monitor: Session, trainer: Session, rollout: Session) -> None:
    """Heartbeats, metrics history then live metrics (no consumer), queue sizes and consumer lag, run state."""
    hb = await monitor.nc.subscribe(S.heartbeat("*", "*"))
    await processed(monitor.nc)  # the subscription is registered before anything is published
    await rollout.nc.publish(S.heartbeat("rollout", "r0"), pack("heartbeat"))
    await processed(rollout.nc)
    assert (await hb.next_msg(timeout=5)).subject == S.heartbeat("rollout", "r0")
    await trainer.js.publish(S.step, pack("step_metrics", step=0))
    await trainer.js.publish(S.step, pack("step_metrics", step=1))
    done = asyncio.Event()
    steps = []
    async for msg in follow(monitor.nc, monitor.js, S.metrics_stream, S.metrics_all, done, start="first"):
        steps.append(msgpack.unpackb(msg.data).get("step"))
        if len(steps) == 2:
            await trainer.js.publish(S.done, pack("trainer_done", steps=2))
        if len(steps) == 3:
            done.set()
    assert steps == [0, 1, None]
    for stream in NAMES.streams:
        await monitor.js.stream_info(stream)
    await monitor.js.consumer_info(S.traj_stream, S.TRAINER_CONSUMER)
    await monitor.js.consumer_info(S.prompts_stream, S.ROLLOUT_CONSUMER)
    await monitor.js.consumer_info(NAMES.evalq_stream, NAMES.ROLLOUT_EVAL_CONSUMER)
    await (await trainer.js.key_value(S.state_bucket)).put("trainer_version", b"2")
    assert (await (await monitor.js.key_value(S.state_bucket)).get("trainer_version")).value == b"2"
    await hb.unsubscribe()


async def test_trainer_does_its_work(prepared: Callable[[str], Awaitable[Session]]) -> None:
    trainer, rollout, controller = await prepared("trainer"), await prepared("rollout"), await prepared("controller")
    await trainer_duties(trainer, rollout, controller)
    await processed(trainer.nc)
    assert trainer.clean() == [] and rollout.clean() == []


async def test_controller_does_its_work(prepared: Callable[[str], Awaitable[Session]]) -> None:
    controller, trainer, rollout = await prepared("controller"), await prepared("trainer"), await prepared("rollout")
    await controller_duties(controller, trainer, rollout)
    await processed(controller.nc)
    assert controller.clean() == [] and trainer.clean() == [] and rollout.clean() == []


async def test_rollout_does_its_work(prepared: Callable[[str], Awaitable[Session]]) -> None:
    rollout, trainer, controller = await prepared("rollout"), await prepared("trainer"), await prepared("controller")
    await rollout_duties(rollout, trainer, controller)
    await processed(rollout.nc)
    assert rollout.clean() == [] and trainer.clean() == [] and controller.clean() == []


async def test_monitor_reads_everything_it_shows(prepared: Callable[[str], Awaitable[Session]]) -> None:
    monitor, trainer, rollout = await prepared("monitor"), await prepared("trainer"), await prepared("rollout")
    await monitor_duties(monitor, trainer, rollout)
    await processed(monitor.nc)
    assert monitor.clean() == [] and trainer.clean() == [] and rollout.clean() == []


async def teacher_duties(teacher: Session, trainer: Session, controller: Session) -> None:
    """Answer the trainer's scoring requests (one reply each, into the trainer's inbox), heartbeat, park a
    refusal, read the run instance, obey a stop; and the trainer's side: the request and its reply."""
    requests = await teacher.nc.subscribe(S.teacher_score, queue="teachers")
    control = await teacher.nc.subscribe(S.control)
    await processed(teacher.nc)
    asking = asyncio.create_task(trainer.nc.request(S.teacher_score, pack("teacher_score_request"), timeout=5))
    request = await requests.next_msg(timeout=5)
    assert request.reply.startswith(f"_INBOX.{RUN}.trainer.")
    await request.respond(pack("teacher_score_reply", request_id="r"))
    assert (await asking).data == pack("teacher_score_reply", request_id="r")
    await teacher.nc.publish(S.heartbeat("teacher", "te0"), pack("heartbeat", role="teacher", actor_id="te0"))
    await teacher.js.publish(f"{RUN}.dlq.teacher.{S.teacher_score.replace('.', '_')}", b"junk")
    kv = await teacher.js.key_value(S.state_bucket)
    await (await trainer.js.key_value(S.state_bucket)).put("trainer_version", b"1")
    assert (await kv.get("trainer_version")).value == b"1"
    await controller.js.publish(S.control, pack("control", command="stop"))
    assert (await control.next_msg(timeout=5)).subject == S.control
    for sub in (requests, control):
        await sub.unsubscribe()


async def test_teacher_does_its_work(prepared: Callable[[str], Awaitable[Session]]) -> None:
    teacher, trainer, controller = await prepared("teacher"), await prepared("trainer"), await prepared("controller")
    await teacher_duties(teacher, trainer, controller)
    await processed(teacher.nc)
    assert teacher.clean() == [] and trainer.clean() == [] and controller.clean() == []


# --------------------------------------------------------------------------- what each role must not do

ADMIN_API = [
    f"$JS.API.STREAM.CREATE.{S.events_stream}",
    f"$JS.API.STREAM.UPDATE.{S.events_stream}",
    f"$JS.API.STREAM.DELETE.{S.traj_stream}",
    f"$JS.API.STREAM.PURGE.{S.prompts_stream}",
    f"$JS.API.STREAM.MSG.DELETE.{S.traj_stream}",
    f"$JS.API.CONSUMER.CREATE.{S.events_stream}",
    f"$JS.API.CONSUMER.CREATE.{S.events_stream}.spy.{S.weights_held}",
    f"$JS.API.CONSUMER.DURABLE.CREATE.{S.traj_stream}.spy",
    f"$JS.API.CONSUMER.DELETE.{S.prompts_stream}.{S.ROLLOUT_CONSUMER}",
]
STEAL_WORK = [
    f"$JS.API.CONSUMER.MSG.NEXT.{S.traj_stream}.{S.TRAINER_CONSUMER}",
    f"$JS.ACK.{S.traj_stream}.{S.TRAINER_CONSUMER}.1.1.1.1.0",
    f"$JS.API.CONSUMER.MSG.NEXT.{S.events_stream}.controller-weights",
]
TRAINER_ONLY = [
    S.weights,
    f"{RUN}.weights.7.chunk",
    f"{RUN}.weights.7.meta",
    f"{RUN}.wdelta.7.chunk",
    S.step,
    S.done,
    S.discarded,
    f"$KV.{S.state_bucket}.trainer_version",
    f"$KV.{S.state_bucket}.trainer_floor",
    f"$JS.API.STREAM.PURGE.{S.traj_stream}",
    S.heartbeat("trainer", "t0"),
    f"{RUN}.dlq.trainer.x",
    S.teacher_score,
]
CONTROLLER_ONLY = [
    S.prompts,
    NAMES.evalq,
    S.control,
    S.eval,
    f"$KV.{S.state_bucket}.status",
    f"$KV.{S.state_bucket}.controller_state",
    f"$KV.{NAMES.runinfo_bucket}.tokenizer",
    S.heartbeat("controller", "c0"),
    f"{RUN}.dlq.controller.x",
    S.snapshot,
    f"$JS.API.STREAM.PURGE.{S.events_stream}",
    f"$JS.API.STREAM.PURGE.{S.metrics_stream}",
]
ROLLOUT_ONLY = [S.traj, S.weights_held, NAMES.eval_results, S.heartbeat("rollout", "r0"), f"{RUN}.dlq.rollout.x"]
NOBODY = [
    f"{RUN}.dlq.{S.prompts.replace('.', '_')}",  # the pre-rework dead-letter subject, outside every role's prefix
    f"{RUN}.hb.monitor.m0",
    f"{RUN}.other",
    "_INBOX.sec.trainer.x",  # a forged reply into another role's inbox
    f"{RUN}_other.prompts",
]
EVERY_RUN_SUBJECT = TRAINER_ONLY + CONTROLLER_ONLY + ROLLOUT_ONLY + NOBODY + ADMIN_API + STEAL_WORK


async def assert_refused(session: Session, subjects: list[str]) -> None:
    allowed = [subject for subject in subjects if not await session.refused_publish(subject)]
    assert allowed == [], f"the server let {allowed} through"


async def stored_messages(setup: Session) -> dict[str, int]:
    return {stream: (await setup.js.stream_info(stream)).state.messages for stream in NAMES.streams}


async def test_rollout_cannot_announce_publish_weights_metrics_stop_or_foreign_dead_letters(
    prepared: Callable[[str], Awaitable[Session]],
) -> None:
    setup, rollout = await prepared("setup"), await prepared("rollout")
    before = await stored_messages(setup)
    await assert_refused(rollout, TRAINER_ONLY + CONTROLLER_ONLY + NOBODY + ADMIN_API + STEAL_WORK)
    for subject in ("_INBOX.>", "_INBOX.sec.trainer.>", f"{RUN}.>", S.traj, S.heartbeat("*", "*")):
        assert await rollout.refused_subscribe(subject), subject
    assert await stored_messages(setup) == before


async def test_trainer_cannot_issue_work_stop_or_write_trajectories(
    prepared: Callable[[str], Awaitable[Session]],
) -> None:
    setup, trainer = await prepared("setup"), await prepared("trainer")
    before = await stored_messages(setup)
    await assert_refused(trainer, CONTROLLER_ONLY + ROLLOUT_ONLY + NOBODY + ADMIN_API[:-1])
    await assert_refused(trainer, [f"$JS.API.CONSUMER.MSG.NEXT.{S.prompts_stream}.{S.ROLLOUT_CONSUMER}"])
    assert await stored_messages(setup) == before


async def test_controller_cannot_announce_weights_or_report_for_others(
    prepared: Callable[[str], Awaitable[Session]],
) -> None:
    setup, controller = await prepared("setup"), await prepared("controller")
    before = await stored_messages(setup)
    await assert_refused(controller, TRAINER_ONLY + ROLLOUT_ONLY + NOBODY + ADMIN_API)
    await assert_refused(controller, [f"$JS.API.CONSUMER.MSG.NEXT.{S.prompts_stream}.{S.ROLLOUT_CONSUMER}"])
    assert await stored_messages(setup) == before


async def test_monitor_cannot_publish_anything(prepared: Callable[[str], Awaitable[Session]]) -> None:
    setup, monitor = await prepared("setup"), await prepared("monitor")
    before = await stored_messages(setup)
    await assert_refused(monitor, EVERY_RUN_SUBJECT + [f"$JS.API.DIRECT.GET.{NAMES.weights_stream}", "anything"])
    for subject in ("_INBOX.>", f"{RUN}.>", S.traj, S.prompts):
        assert await monitor.refused_subscribe(subject), subject
    assert await stored_messages(setup) == before


async def test_teacher_replies_once_per_request_and_publishes_nothing_else(
    prepared: Callable[[str], Awaitable[Session]],
) -> None:
    setup, teacher, trainer = await prepared("setup"), await prepared("teacher"), await prepared("trainer")
    before = await stored_messages(setup)
    # Only into an inbox that asked it something, and once: a second reply, or a forged one into the trainer's
    # inbox (where its pulled trajectories arrive), is refused.
    requests = await teacher.nc.subscribe(S.teacher_score)
    await processed(teacher.nc)
    asking = asyncio.create_task(trainer.nc.request(S.teacher_score, b"score", timeout=5))
    try:
        request = await requests.next_msg(timeout=5)
    except NatsTimeoutError:  # seen twice under a full suite: say what the server told either side, and the ask
        outcome = repr(asking.exception()) if asking.done() else "still waiting"
        raise AssertionError(
            f"no request reached the teacher; trainer: {trainer.errors}, teacher: {teacher.errors}, request: {outcome}"
        )
    await request.respond(b"first")
    assert (await asking).data == b"first"
    assert await teacher.refused_publish(request.reply, b"second")
    await assert_refused(teacher, EVERY_RUN_SUBJECT)
    for subject in ("_INBOX.>", f"_INBOX.{RUN}.trainer.>", f"{RUN}.>", S.traj, S.heartbeat("*", "*")):
        assert await teacher.refused_subscribe(subject), subject
    await requests.unsubscribe()
    # Nobody else asks the teachers or listens to what the trainer asks them.
    rollout = await prepared("rollout")
    assert await rollout.refused_subscribe(S.teacher_score)
    assert await stored_messages(setup) == before


async def test_follow_reads_in_order_and_a_duplicate_publish_does_not_spin(
    prepared: Callable[[str], Awaitable[Session]],
) -> None:
    """The consumer-free reader: a deduplicated re-send wakes it (core subscribers see every publish) but
    is stored once; the reader yields it once and goes back to waiting instead of looking again forever."""
    monitor, trainer = await prepared("monitor"), await prepared("trainer")
    done = asyncio.Event()
    seen: list[int] = []
    lookups = 0
    original = monitor.js.get_msg

    async def counting_get_msg(*args: Any, **kwargs: Any) -> Any:
        nonlocal lookups
        lookups += 1
        return await original(*args, **kwargs)

    monitor.js.get_msg = counting_get_msg  # type: ignore[method-assign]

    async def read() -> None:
        async for msg in follow(
            monitor.nc, monitor.js, S.metrics_stream, S.metrics_all, done, start="first", poll_s=30
        ):
            seen.append(msgpack.unpackb(msg.data)["step"])
            if len(seen) == 2:
                done.set()

    reader = asyncio.create_task(read())
    await trainer.js.publish(S.step, pack("step_metrics", step=0), headers={"Nats-Msg-Id": "step-0"})
    while not seen:
        await asyncio.sleep(0.02)
    await trainer.js.publish(S.step, pack("step_metrics", step=0), headers={"Nats-Msg-Id": "step-0"})  # a duplicate
    await asyncio.sleep(0.3)
    idle = lookups
    await asyncio.sleep(0.7)
    assert lookups == idle, "the reader kept looking while nothing new was stored"
    await trainer.js.publish(S.step, pack("step_metrics", step=1), headers={"Nats-Msg-Id": "step-1"})
    await asyncio.wait_for(reader, 10)
    assert seen == [0, 1]
