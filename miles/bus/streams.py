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

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError

from miles.bus.dataplane import WeightStore
from miles.bus.subjects import Subjects

DAY_S = 24 * 3600.0


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
        ),
        StreamConfig(
            name=subjects.evalq_stream,
            subjects=[subjects.evalq],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            num_replicas=replicas,
        ),
        StreamConfig(
            name=subjects.traj_stream,
            subjects=[subjects.traj],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_age=7 * DAY_S,
            allow_direct=True,  # a restarted trainer reads the batches of its lost steps by sequence
        ),
        # Announcements and metrics are read in order by direct gets (miles.bus.follow), no consumer needed.
        StreamConfig(
            name=subjects.events_stream,
            subjects=[f"{subjects.run}.events.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_age=7 * DAY_S,
            allow_direct=True,
        ),
        StreamConfig(
            name=subjects.metrics_stream,
            subjects=[subjects.metrics_all],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_age=30 * DAY_S,
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
        # The controller's inputs: durable, so a restarted controller resumes where it stopped.
        (s.events_stream, durable(s.CONTROLLER_EVENTS_CONSUMER, filter_subject=s.discarded)),
        (s.events_stream, durable(s.CONTROLLER_WEIGHTS_CONSUMER, filter_subject=s.weights_held)),
        (s.events_stream, durable(s.CONTROLLER_EVAL_CONSUMER, filter_subject=s.eval_results)),
        (s.metrics_stream, durable(s.CONTROLLER_METRICS_CONSUMER, filter_subject=s.metrics_all)),
    ]


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.stream_info(config.name)
    except NotFoundError:
        try:
            await js.add_stream(config)
            return
        except BadRequestError:
            pass  # another actor created it between our two calls
    await js.update_stream(config)


async def _ensure_bucket(js: JetStreamContext, bucket: str, replicas: int) -> None:
    try:
        await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):  # which one depends on the nats-py version
        # direct: reads are direct gets by key, which a bind-only identity may make
        await js.create_key_value(bucket=bucket, history=1, replicas=replicas, direct=True)


async def ensure_run_streams(js: JetStreamContext, subjects: Subjects, *, replicas: int, ack_wait_s: float) -> None:
    """Create (or update) the run's streams, weight streams, durable consumers and buckets (idempotent)."""
    for config in stream_configs(subjects, replicas):
        await _ensure_stream(js, config)
    for kind in ("full", "delta"):
        await WeightStore.create(js, subjects.run, replicas=replicas, kind=kind)
    for stream, consumer in consumer_configs(subjects, ack_wait_s):
        await js.add_consumer(stream, consumer)  # idempotent for an identical config
    await _ensure_bucket(js, subjects.state_bucket, replicas)
    await _ensure_bucket(js, subjects.runinfo_bucket, replicas)
