"""Names of every subject, stream, consumer and bucket of one run (all prefixed by the run name)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class Subjects:
    """The naming scheme of docs/protocol.md, in one place."""

    run: str

    # subjects
    @property
    def prompts(self) -> str:
        return f"{self.run}.prompts"

    @property
    def traj(self) -> str:
        return f"{self.run}.traj"

    @property
    def evalq(self) -> str:
        """Evaluation work (controller -> rollout workers), a work queue like prompts."""
        return f"{self.run}.evalq"

    @property
    def eval_results(self) -> str:
        """Rollout workers' results of evaluation shards (-> controller)."""
        return f"{self.run}.events.eval_results"

    @property
    def weights(self) -> str:
        return f"{self.run}.events.weights"

    @property
    def weights_held(self) -> str:
        """Rollout workers' reports of the version (and its state digest) their engine adopted."""
        return f"{self.run}.events.weights_held"

    @property
    def discarded(self) -> str:
        return f"{self.run}.events.discarded"

    @property
    def control(self) -> str:
        return f"{self.run}.events.control"

    def heartbeat(self, role: str = "*", actor_id: str = "*") -> str:
        """Core-NATS (not persisted) liveness subject; the defaults give the wildcard."""
        return f"{self.run}.hb.{role}.{actor_id}"

    def heartbeats(self, roles: Iterable[str]) -> list[str]:
        """One wildcard per role (``<run>.hb.<role>.*``) for a reader of every actor's heartbeat. Not the
        single ``<run>.hb.*.*``: a hub sends a leaf node interest only in subjects the leaf's link may
        publish, and a fleet's link may publish ``<run>.hb.rollout.*`` only, so a ``*.*`` subscription on
        the hub never hears a remote worker (tests/integration/test_bus_leaf.py)."""
        return [self.heartbeat(role, "*") for role in roles]

    @property
    def step(self) -> str:
        return f"{self.run}.metrics.step"

    @property
    def eval(self) -> str:
        return f"{self.run}.metrics.eval"

    @property
    def issued(self) -> str:
        """The controller's issue records (GroupsIssued), published before the prompts they list."""
        return f"{self.run}.metrics.issued"

    @property
    def done(self) -> str:
        return f"{self.run}.metrics.done"

    @property
    def snapshot(self) -> str:
        """The controller's snapshots of its state (ControllerSnapshot): a restart reads the newest."""
        return f"{self.run}.snapshot.controller"

    @property
    def metrics_all(self) -> str:
        return f"{self.run}.metrics.>"

    @property
    def teacher_score(self) -> str:
        """Core-NATS request/reply: the trainer leader asks teacher actors (queue group ``teachers``) for the
        log-probs of a batch's tokens (on-policy distillation)."""
        return f"{self.run}.teacher.score"

    def dead_letter(self, role: str, origin: str) -> str:
        """Where an actor of ``role`` parks a message it refused on subject ``origin`` (dots become '_'); the
        role token is the refusing actor's own, which is all its permissions let it publish under."""
        return f"{self.run}.dlq.{role}.{origin.replace('.', '_')}"

    # streams
    @property
    def prompts_stream(self) -> str:
        return f"{self.run}_PROMPTS"

    @property
    def traj_stream(self) -> str:
        return f"{self.run}_TRAJ"

    @property
    def evalq_stream(self) -> str:
        return f"{self.run}_EVALQ"

    @property
    def events_stream(self) -> str:
        return f"{self.run}_EVENTS"

    @property
    def metrics_stream(self) -> str:
        return f"{self.run}_METRICS"

    @property
    def snapshot_stream(self) -> str:
        return f"{self.run}_SNAPSHOT"

    @property
    def dlq_stream(self) -> str:
        return f"{self.run}_DLQ"

    # durable consumers
    ROLLOUT_CONSUMER: ClassVar[str] = "rollout"
    ROLLOUT_EVAL_CONSUMER: ClassVar[str] = "rollout-eval"
    TRAINER_CONSUMER: ClassVar[str] = "trainer"

    # key-value buckets
    @property
    def state_bucket(self) -> str:
        """Run state: the controller's admission state, the trainer's version, the run instance, the status."""
        return f"{self.run}_STATE"

    @property
    def runinfo_bucket(self) -> str:
        """What a worker needs to join the run with nothing but a URL and credentials (docs/protocol.md)."""
        return f"{self.run}_RUNINFO"


def kv_stream(bucket: str) -> str:
    """The stream behind a key-value bucket (NATS convention)."""
    return f"KV_{bucket}"


def kv_subject(bucket: str, key: str) -> str:
    """The subject a key-value bucket stores ``key`` on (NATS convention)."""
    return f"$KV.{bucket}.{key}"
