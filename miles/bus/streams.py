"""Idempotent creation of a run's JetStream streams, durable consumers and state bucket.

Every actor calls :func:`ensure_run_streams` on start, so the order in which processes come up
on different machines does not matter. An existing stream is updated to the wanted config.
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
        ),
        StreamConfig(
            name=subjects.events_stream,
            subjects=[f"{subjects.run}.events.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_age=7 * DAY_S,
        ),
        StreamConfig(
            name=subjects.metrics_stream,
            subjects=[subjects.metrics_all],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_age=30 * DAY_S,
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


def consumer_configs(subjects: Subjects, ack_wait_s: float) -> dict[str, ConsumerConfig]:
    """Durable pull consumers keyed by stream. Unacked work is redelivered after ``ack_wait_s``."""
    return {
        subjects.prompts_stream: ConsumerConfig(
            durable_name=subjects.ROLLOUT_CONSUMER,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_deliver=-1,
            max_ack_pending=100_000,
        ),
        subjects.evalq_stream: ConsumerConfig(
            durable_name=subjects.ROLLOUT_EVAL_CONSUMER,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_deliver=-1,
            max_ack_pending=10_000,
        ),
        subjects.traj_stream: ConsumerConfig(
            durable_name=subjects.TRAINER_CONSUMER,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait_s,
            max_deliver=-1,
            max_ack_pending=100_000,
        ),
    }


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


async def ensure_run_streams(js: JetStreamContext, subjects: Subjects, *, replicas: int, ack_wait_s: float) -> None:
    """Create (or update) the run's streams, its durable consumers and its state bucket."""
    for config in stream_configs(subjects, replicas):
        await _ensure_stream(js, config)
    for stream, consumer in consumer_configs(subjects, ack_wait_s).items():
        await js.add_consumer(stream, consumer)  # idempotent for an identical config
    try:
        await js.key_value(subjects.state_bucket)
    except (BucketNotFoundError, NotFoundError):  # which one depends on the nats-py version
        await js.create_key_value(bucket=subjects.state_bucket, history=1, replicas=replicas)
