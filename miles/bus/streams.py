"""Idempotent creation of a run's JetStream streams, durable consumers and buckets: the setup step.

:func:`ensure_run_streams` creates (or updates to the wanted config) everything a run's actors bind to:
the work, trajectory, event, metric and dead-letter streams, both weight data-plane streams, every
durable consumer (the rollout workers', the trainer's and the controller's), the state bucket and the
run-info bucket. With per-role credentials only the ``setup`` identity may do this (an identity that may
create a consumer could make the server publish for it, docs/security.md), so it runs once before the
actors start (``miles-node --role setup``, which ``miles run`` does); the actors then only bind. On an
open bus every actor runs it at start, so the order in which processes come up does not matter.
"""

from __future__ import annotations

from typing import Literal

import structlog
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError

from miles.bus.errors import BusError
from miles.bus.subjects import Subjects

log = structlog.get_logger(__name__)

WeightKind = Literal["full", "delta"]
WeightStorage = Literal["file", "memory"]

DAY_S = 24 * 3600.0
# How long a stream remembers message ids: a prompt (or an issue record) that a restarted controller sends
# again within this window is stored once. Beyond it a re-sent prompt is played again, and the trainer
# counts the second trajectory as a duplicate (docs/deploy.md, "Outages").
DEDUPE_WINDOW_S = 15 * 60.0


def stream_configs(subjects: Subjects, replicas: int) -> list[StreamConfig]:
    """The streams of a run. Trajectories and metrics are file-backed: they are the run's record."""
    return [
        # Work queue: a message is removed once a rollout worker acks it (after its trajectory is durable).
        StreamConfig(
            name=subjects.prompts_stream,
            subjects=[subjects.prompts],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            num_replicas=replicas,
            duplicate_window=DEDUPE_WINDOW_S,
        ),
        StreamConfig(
            name=subjects.evalq_stream,
            subjects=[subjects.evalq],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            num_replicas=replicas,
            duplicate_window=DEDUPE_WINDOW_S,
        ),
        StreamConfig(
            name=subjects.traj_stream,
            subjects=[subjects.traj],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_age=0,  # none: the trainer purges what no kept checkpoint needs (miles.actors.retention)
            allow_direct=True,  # a restarted trainer reads the batches of its lost steps by sequence
        ),
        # Announcements and metrics are read in order by direct gets (miles.bus.follow), no consumer needed.
        StreamConfig(
            name=subjects.events_stream,
            subjects=[f"{subjects.run}.events.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_age=0,  # none: the controller purges what no restart reads (miles.actors.retention)
            allow_direct=True,
        ),
        StreamConfig(
            name=subjects.metrics_stream,
            subjects=[subjects.metrics_all],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_age=0,  # none: as EVENTS
            allow_direct=True,
            duplicate_window=DEDUPE_WINDOW_S,
        ),
        # The controller's snapshots: the newest two (a restart reads the newest; the one before it is kept
        # while the newest is being written).
        StreamConfig(
            name=subjects.snapshot_stream,
            subjects=[subjects.snapshot],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_msgs_per_subject=2,
            allow_direct=True,
        ),
        StreamConfig(
            name=subjects.dlq_stream,
            subjects=[f"{subjects.run}.dlq.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_age=30 * DAY_S,
        ),
    ]


def consumer_configs(subjects: Subjects, ack_wait_s: float) -> list[tuple[str, ConsumerConfig]]:
    """Every durable pull consumer of a run, as ``(stream, config)``. Unacked work is redelivered after
    ``ack_wait_s``."""

    def durable(name: str, *, filter_subject: str | None = None, max_ack_pending: int = 100_000) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=name,
            filter_subject=filter_subject,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait_s,
            max_deliver=-1,
            max_ack_pending=max_ack_pending,
        )

    s = subjects
    return [
        (s.prompts_stream, durable(s.ROLLOUT_CONSUMER)),
        (s.evalq_stream, durable(s.ROLLOUT_EVAL_CONSUMER, max_ack_pending=10_000)),
        (s.traj_stream, durable(s.TRAINER_CONSUMER)),
        # The controller needs none: it reads EVENTS and METRICS in order by direct gets, from the start at
        # every start (its state is rebuilt from them, miles.actors.controller).
    ]


# "Already exists" answers of a creation that lost a race with another actor's identical one (nats-server
# errors.json: stream name in use, consumer name in use / already exists); the object is there, as wanted.
_ALREADY_EXISTS = {10058, 10013, 10105, 10148}
CREATE_ATTEMPTS = 5


def _already_exists(exc: APIError) -> bool:
    return exc.err_code in _ALREADY_EXISTS or "already" in (exc.description or "").lower()


def _differs(existing: StreamConfig, wanted: StreamConfig) -> bool:
    """Whether an update is needed: only the fields Miles sets are compared (the server fills in the rest)."""
    fields = (
        "subjects",
        "retention",
        "storage",
        "num_replicas",
        "max_age",
        "allow_direct",
        "duplicate_window",
        "max_msgs_per_subject",
    )
    return any(getattr(wanted, f) is not None and getattr(existing, f) != getattr(wanted, f) for f in fields)


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create ``config``'s stream, or update it if it exists with other settings. Safe when every actor of a
    fresh cluster does it at the same moment: a lost creation race is a success, and the JetStream
    context retries what a leader election answers (miles.bus.retry)."""
    for _ in range(CREATE_ATTEMPTS):
        try:
            existing = (await js.stream_info(config.name)).config
        except NotFoundError:
            try:
                await js.add_stream(config)
                return
            except APIError as exc:
                if not _already_exists(exc):
                    raise
                continue  # created by another actor between our two calls: look again
        if _differs(existing, config):
            await js.update_stream(config)
        return
    raise BusError(f"stream {config.name} neither exists nor can be created (tried {CREATE_ATTEMPTS} times)")


async def _ensure_consumer(js: JetStreamContext, stream: str, config: ConsumerConfig) -> None:
    try:
        await js.add_consumer(stream, config)  # idempotent for an identical config
    except APIError as exc:
        if not _already_exists(exc):
            raise
        await js.consumer_info(stream, config.durable_name or "")  # it is there


async def _ensure_bucket(js: JetStreamContext, bucket: str, replicas: int) -> None:
    try:
        await js.key_value(bucket)
        return
    except (BucketNotFoundError, NotFoundError):  # which one depends on the nats-py version
        pass
    try:
        # direct: reads are direct gets by key, which a bind-only identity may make
        await js.create_key_value(bucket=bucket, history=1, replicas=replicas, direct=True)
    except APIError as exc:
        if not _already_exists(exc):
            raise
        await js.key_value(bucket)


async def ensure_run_streams(js: JetStreamContext, subjects: Subjects, *, replicas: int, ack_wait_s: float) -> None:
    """Create (or update) the run's streams, weight streams, durable consumers and buckets (idempotent, and
    safe to run from every actor at once)."""
    for config in stream_configs(subjects, replicas):
        await _ensure_stream(js, config)
    for kind in ("full", "delta"):
        await ensure_weight_stream(js, subjects.run, kind, replicas)
    for stream, consumer in consumer_configs(subjects, ack_wait_s):
        await _ensure_consumer(js, stream, consumer)
    await _ensure_bucket(js, subjects.state_bucket, replicas)
    await _ensure_bucket(js, subjects.runinfo_bucket, replicas)


# --------------------------------------------------------------------------- weight data-plane streams
# The streams that carry weight payloads (miles.sync.transport.dataplane writes and reads them): defined here
# with the run's other streams, so the setup step creates everything an actor binds to.


def weight_stream_name(run: str, kind: WeightKind) -> str:
    return f"{run}_WEIGHTS" if kind == "full" else f"{run}_WEIGHTS_DELTA"


def weight_subject_prefix(run: str, kind: WeightKind) -> str:
    return f"{run}.weights" if kind == "full" else f"{run}.wdelta"


def weight_stream_config(run: str, kind: WeightKind, replicas: int, storage: WeightStorage = "file") -> StreamConfig:
    return StreamConfig(
        name=weight_stream_name(run, kind),
        subjects=[f"{weight_subject_prefix(run, kind)}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.MEMORY if storage == "memory" else StorageType.FILE,
        num_replicas=replicas,
        discard=DiscardPolicy.OLD,
        allow_direct=True,
    )


async def ensure_weight_stream(
    js: JetStreamContext, run: str, kind: WeightKind, replicas: int, storage: WeightStorage = "file"
) -> None:
    """Create a weight stream, or update it to the wanted subjects, replicas and direct gets (idempotent; every
    actor of a fresh cluster may race to create it). Its storage type cannot change: whoever created it decided."""
    config = weight_stream_config(run, kind, replicas, storage)
    try:
        existing = (await js.stream_info(config.name)).config
    except NotFoundError:
        existing = None
    if existing is not None and existing.storage != config.storage:
        log.info("weights_stream_storage_kept", stream=config.name, existing=str(existing.storage), wanted=storage)
        return
    await _ensure_stream(js, config)
