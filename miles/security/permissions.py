"""Who may send what: the NATS publish/subscribe allow lists of each role of a run.

This table is the threat model of docs/security.md in executable form. Every entry of the actor
roles was found necessary by removing it and watching the role's work fail against a real
nats-server (the tests in ``tests/integration/test_permissions*.py`` check the work and the
refusals again on every change); nothing is granted "just in case". Three decisions shape it:

* **Nobody but ``setup`` creates or changes streams and consumers.** A client allowed to create a
  JetStream consumer can give it any ``deliver_subject``, and the server then publishes the stream's
  messages there on its own authority, past the creator's publish permissions: a rollout worker can
  publish bytes of its choosing on ``<run>.events.weights_held`` and have them delivered to anyone
  subscribed by name to, say, a heartbeat subject of another role (the server only refuses a deliver
  subject that feeds the consumer's own stream). So a preparation step with the ``setup`` identity
  creates every stream, durable consumer and bucket once (:mod:`miles.bus.setup`); long-running actors
  only *bind* (pull from a named durable, ack) and read in order by direct get (:mod:`miles.bus.follow`).
  ``ephemeral_consumers=True`` restores the ordered-consumer grants for code that has not moved yet,
  with that risk (docs/security.md).
* **Inboxes are per role** (``_INBOX.<run>.<role>``): replies to a trainer's request are not
  readable by a rollout worker subscribed to ``_INBOX.>``, because nobody may subscribe to that.
* **A teacher answers only what it was asked**: it may subscribe to ``<run>.teacher.score`` and
  publish nothing into another role's inbox but the one reply to each request it received (the
  server's ``allow_responses``). A grant on ``_INBOX.<run>.trainer.>`` would let a teacher forge
  replies to the trainer's other requests, pulled trajectories included.
* **Key-value writes are per key where the owner is known**: only the trainer writes
  ``trainer_version`` and ``trainer_floor``; the controller writes every other key of the state bucket.

Each run lives in its own NATS account (``MILES_<run>``, see :mod:`miles.security.identities`), so
JetStream API subjects, which carry no run name for account-wide calls, cannot reach another run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from miles.bus.subjects import Subjects, kv_stream, kv_subject

Role = Literal["setup", "controller", "trainer", "rollout", "monitor", "teacher"]
ROLES: tuple[Role, ...] = get_args(Role)
# The roles that run as long-lived actors and exchange run messages (setup only prepares JetStream).
ACTOR_ROLES: tuple[Role, ...] = ("controller", "trainer", "rollout", "monitor", "teacher")

RUN_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
API = "$JS.API"


def check_run_name(run: str) -> str:
    """The run name as used in subjects, stream names and the account name; ``ValueError`` otherwise."""
    if not RUN_NAME.match(run):
        raise ValueError(f"run name {run!r} must match [A-Za-z0-9_-]+")
    return run


@dataclass(frozen=True, slots=True)
class RunNames:
    """Every name of a run the permission table refers to (docs/protocol.md, after the evaluation rework).

    Names that :class:`miles.bus.subjects.Subjects` already has are taken from it; the others are
    the ones the rework introduces (evaluation queue and results, per-role dead letters, run info).
    """

    run: str
    subjects: Subjects = field(init=False)

    def __post_init__(self) -> None:
        check_run_name(self.run)
        object.__setattr__(self, "subjects", Subjects(self.run))

    # subjects the rework adds
    @property
    def evalq(self) -> str:
        return f"{self.run}.evalq"

    @property
    def eval_results(self) -> str:
        return f"{self.run}.events.eval_results"

    def dead_letters(self, role: str) -> str:
        """Wildcard of the dead letters ``role`` parks (``<run>.dlq.<role>.<origin>``)."""
        return f"{self.run}.dlq.{role}.>"

    @property
    def weight_chunks(self) -> str:
        return f"{self.run}.weights.>"

    @property
    def delta_chunks(self) -> str:
        return f"{self.run}.wdelta.>"

    # streams
    @property
    def evalq_stream(self) -> str:
        return f"{self.run}_EVALQ"

    @property
    def weights_stream(self) -> str:
        return f"{self.run}_WEIGHTS"

    @property
    def delta_stream(self) -> str:
        return f"{self.run}_WEIGHTS_DELTA"

    @property
    def runinfo_bucket(self) -> str:
        """Key-value bucket the controller writes once (tokenizer, sampling parameters, task identity)."""
        return f"{self.run}_RUNINFO"

    @property
    def streams(self) -> tuple[str, ...]:
        """Every stream of the run, the key-value buckets' streams included."""
        s = self.subjects
        return (
            s.prompts_stream,
            self.evalq_stream,
            s.traj_stream,
            s.events_stream,
            s.metrics_stream,
            s.snapshot_stream,
            s.dlq_stream,
            self.weights_stream,
            self.delta_stream,
            kv_stream(s.state_bucket),
            kv_stream(self.runinfo_bucket),
        )

    # durable consumers the rework adds
    ROLLOUT_EVAL_CONSUMER = "rollout-eval"


def inbox_prefix(run: str, role: str) -> str:
    """The reply-subject prefix a role's connection must use (nats-py ``inbox_prefix``)."""
    return f"_INBOX.{check_run_name(run)}.{role}"


@dataclass(frozen=True, slots=True)
class Permissions:
    """NATS user permissions: subjects a client may publish to and subscribe to (allow, then deny)."""

    publish_allow: tuple[str, ...]
    subscribe_allow: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    # May publish one reply to the reply subject of each message delivered to it (nats-server
    # ``allow_responses``), whatever its publish allow list says.
    allow_responses: bool = False

    def as_config(self) -> dict[str, Any]:
        """The ``permissions`` map of a nats-server user entry."""
        out: dict[str, Any] = {
            "publish": {"allow": list(self.publish_allow)},
            "subscribe": {"allow": list(self.subscribe_allow)},
        }
        if self.publish_deny:
            out["publish"]["deny"] = list(self.publish_deny)
        if self.subscribe_deny:
            out["subscribe"]["deny"] = list(self.subscribe_deny)
        if self.allow_responses:
            out["allow_responses"] = True
        return out


# --------------------------------------------------------------------------- JetStream API grants


def _pull(stream: str, durable: str) -> list[str]:
    """Bind to an existing durable pull consumer: request batches, ack/nak/in-progress them."""
    return [f"{API}.CONSUMER.MSG.NEXT.{stream}.{durable}", f"$JS.ACK.{stream}.{durable}.>"]


def _info(*streams: str) -> list[str]:
    return [f"{API}.STREAM.INFO.{s}" for s in streams]


def _direct(*streams: str) -> list[str]:
    """Direct get by sequence, or first-after-sequence by subject (``DIRECT.GET.<stream>`` with a body)."""
    return [f"{API}.DIRECT.GET.{s}" for s in streams]


def _direct_last(*streams: str) -> list[str]:
    """Direct get of the last message on a subject, the subject in the request's (``DIRECT.GET.<stream>.<subject>``)."""
    return [f"{API}.DIRECT.GET.{s}.>" for s in streams]


def _msg_get(*streams: str) -> list[str]:
    """Leader read of one message (the data plane reads manifests this way, for consistency with replicas)."""
    return [f"{API}.STREAM.MSG.GET.{s}" for s in streams]


def _kv_read(*buckets: str) -> list[str]:
    """``js.key_value(bucket)`` (stream info), ``kv.get`` (a direct get by key: buckets are made with
    ``direct=True``) and the leader read by key that ``Bus.get_bytes`` makes (consistent with the last put)."""
    streams = [kv_stream(b) for b in buckets]
    return [*_info(*streams), *_direct_last(*streams), *_msg_get(*streams)]


def _ordered_consumer(*streams: str) -> list[str]:
    """What nats-py's ordered consumer needs: the stream lookup by subject, an ephemeral push consumer
    (created, and re-created after a gap, on the unnamed subject) and the replies to the server's
    flow-control messages (sent under load). Only with ``ephemeral_consumers``."""
    out = [f"{API}.STREAM.NAMES"]
    for s in streams:
        out += [f"{API}.CONSUMER.CREATE.{s}", f"$JS.FC.{s}.>"]
    return out


# --------------------------------------------------------------------------- the table


def _unique(subjects: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(subjects))


def _setup(n: RunNames, inbox: str, compat: bool) -> Permissions:
    # The run's administrator, used by the preparation step only: any JetStream API call in the run's
    # account (create, update, delete streams, consumers, buckets), but no run message, and no pulling
    # work or reading payloads through the API either.
    return Permissions(
        publish_allow=(f"{API}.>",),
        publish_deny=(f"{API}.CONSUMER.MSG.NEXT.>", f"{API}.DIRECT.GET.>", f"{API}.STREAM.MSG.GET.>"),
        subscribe_allow=(inbox,),
    )


def _rollout(n: RunNames, inbox: str, compat: bool) -> Permissions:
    s = n.subjects
    publish = [
        s.traj,
        s.weights_held,
        n.eval_results,
        s.heartbeat("rollout", "*"),
        n.dead_letters("rollout"),
        *_pull(s.prompts_stream, s.ROLLOUT_CONSUMER),
        *_pull(n.evalq_stream, n.ROLLOUT_EVAL_CONSUMER),
        # announcements (the newest, and any older one, to verify every payload it applies), the data plane
        *_direct(s.events_stream, n.weights_stream, n.delta_stream),
        *_direct_last(s.events_stream),
        *_info(n.weights_stream, n.delta_stream),
        *_msg_get(n.weights_stream, n.delta_stream),
        *_kv_read(s.state_bucket, n.runinfo_bucket),
    ]
    if compat:
        publish += _ordered_consumer(s.events_stream)
    return Permissions(publish_allow=_unique(publish), subscribe_allow=(s.control, s.weights, inbox))


def _trainer(n: RunNames, inbox: str, compat: bool) -> Permissions:
    s = n.subjects
    publish = [
        s.weights,
        s.discarded,
        s.step,
        s.done,
        n.weight_chunks,
        n.delta_chunks,
        kv_subject(s.state_bucket, "trainer_version"),
        kv_subject(s.state_bucket, "trainer_floor"),
        s.heartbeat("trainer", "*"),
        n.dead_letters("trainer"),
        s.teacher_score,  # on-policy distillation: requests to the teacher actors (core request/reply)
        *_pull(s.traj_stream, s.TRAINER_CONSUMER),
        # a restarted trainer reads its own announcements and discards, and the batches of lost steps (direct
        # gets; the leader confirms the end, and has what a lagging replica does not yet)
        *_direct(s.traj_stream, s.events_stream),
        *_msg_get(s.traj_stream, s.events_stream),
        # the data plane's writer: stream info lists stored versions, purge drops old ones
        *_info(n.weights_stream, n.delta_stream),
        *[f"{API}.STREAM.PURGE.{st}" for st in (n.weights_stream, n.delta_stream)],
        # bus.retention recovery: the ack floor a checkpoint records, and the trajectories no kept one needs
        f"{API}.CONSUMER.INFO.{s.traj_stream}.{s.TRAINER_CONSUMER}",
        f"{API}.STREAM.PURGE.{s.traj_stream}",
        *_kv_read(s.state_bucket),
    ]
    return Permissions(publish_allow=_unique(publish), subscribe_allow=(s.control, inbox))


def _controller(n: RunNames, inbox: str, compat: bool) -> Permissions:
    s = n.subjects
    queues = (s.prompts_stream, n.evalq_stream, s.traj_stream)
    publish = [
        s.prompts,
        n.evalq,
        s.control,
        s.eval,
        s.issued,
        kv_subject(s.state_bucket, ">"),
        kv_subject(n.runinfo_bucket, ">"),
        s.heartbeat("controller", "*"),
        n.dead_letters("controller"),
        # its own state, rebuilt at every start by reading EVENTS and METRICS in order (direct gets, the end
        # confirmed by a leader read)
        *_direct(s.events_stream, s.metrics_stream),
        *_direct_last(s.events_stream),
        *_msg_get(s.events_stream, s.metrics_stream),
        # an announced version is believed only if the data plane holds it: its manifest, by leader read
        *_msg_get(n.weights_stream, n.delta_stream),
        # its snapshots: written every few steps, the newest read at a start (in order, the end by leader read);
        # at a cut, the last sequence of EVENTS (a subject with nothing after its position moves up to it);
        # bus.retention recovery: what its snapshots and the trainer's checkpoints no longer need is purged
        s.snapshot,
        *_direct(s.snapshot_stream),
        *_msg_get(s.snapshot_stream),
        *_info(s.events_stream),
        *[f"{API}.STREAM.PURGE.{st}" for st in (s.events_stream, s.metrics_stream)],
        # queue depths (admission) and the run's dead-letter count
        *_info(*queues, s.dlq_stream),
        *[f"{API}.CONSUMER.INFO.{st}.*" for st in queues],
        *_kv_read(s.state_bucket, n.runinfo_bucket),
    ]
    if compat:
        publish += _ordered_consumer(s.events_stream)
        # a controller of before the rebuild-from-the-streams change reads EVENTS and METRICS through durables
        # of its own, which pull_subscribe(durable=..., config=...) looks up, then creates by name and filter
        publish += [*_pull(s.events_stream, "*"), *_pull(s.metrics_stream, "*")]
        for st in (s.events_stream, s.metrics_stream):
            publish += [
                f"{API}.CONSUMER.INFO.{st}.*",
                f"{API}.CONSUMER.CREATE.{st}.*",
                f"{API}.CONSUMER.CREATE.{st}.*.>",
            ]
    return Permissions(
        publish_allow=_unique(publish),
        publish_deny=(kv_subject(s.state_bucket, "trainer_version"), kv_subject(s.state_bucket, "trainer_floor")),
        # core subscriptions that wake its in-order readers of EVENTS and METRICS (what it reads is the
        # direct get; a message is believed only from the stream)
        subscribe_allow=(
            s.control,
            s.heartbeat("*", "*"),
            s.weights,
            s.metrics_all,
            s.discarded,
            s.weights_held,
            s.eval_results,
            inbox,
        ),
    )


def _monitor(n: RunNames, inbox: str, compat: bool) -> Permissions:
    # Read-only: JetStream read requests, and core subscriptions to what the run publishes anyway.
    s = n.subjects
    publish = [
        *_info(*n.streams),
        # work waiting and in flight: the queues' and the trainer's consumers
        *[f"{API}.CONSUMER.INFO.{st}.*" for st in (s.prompts_stream, n.evalq_stream, s.traj_stream)],
        # metrics and announcements, in order, by direct get (woken by core subscriptions)
        *_direct(s.metrics_stream, s.events_stream),
        *_direct_last(s.events_stream),
        # the controller's newest snapshot, the run so far (the end of the stream by leader read)
        *_direct(s.snapshot_stream),
        *_msg_get(s.snapshot_stream),
        *_kv_read(s.state_bucket),
    ]
    if compat:
        publish += _ordered_consumer(s.metrics_stream)
    subscribe = (s.heartbeat("*", "*"), s.metrics_all, s.weights, s.control, inbox)
    return Permissions(publish_allow=_unique(publish), subscribe_allow=subscribe)


def _teacher(n: RunNames, inbox: str, compat: bool) -> Permissions:
    # Answers the trainer's scoring requests: one reply per request received (allow_responses), its heartbeat
    # and its refusals; reads the state bucket for the run instance of control commands.
    s = n.subjects
    publish = [s.heartbeat("teacher", "*"), n.dead_letters("teacher"), *_kv_read(s.state_bucket)]
    return Permissions(
        publish_allow=_unique(publish),
        subscribe_allow=(s.teacher_score, s.control, inbox),
        allow_responses=True,
    )


_TABLE = {
    "setup": _setup,
    "rollout": _rollout,
    "trainer": _trainer,
    "controller": _controller,
    "monitor": _monitor,
    "teacher": _teacher,
}


def role_permissions(run: str, role: Role, *, ephemeral_consumers: bool = False) -> Permissions:
    """The permissions of ``role`` in run ``run`` (see the module docstring for the rules)."""
    names = RunNames(run)
    try:
        make = _TABLE[role]
    except KeyError:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}") from None
    return make(names, f"{inbox_prefix(run, role)}.>", ephemeral_consumers)


def with_js_domain(perms: Permissions, domain: str) -> Permissions:
    """``perms`` for a client in another JetStream domain (a fleet behind a leaf node): its JetStream API
    requests cross the leaf as ``$JS.<domain>.API...`` and the hub maps them to ``$JS.API...``. The hub
    checks a leaf connection's publish permissions on the prefixed subjects (and only propagates
    interest in the API subjects they allow); acks, inboxes and run subjects are unchanged."""
    if not RUN_NAME.match(domain):
        raise ValueError(f"JetStream domain {domain!r} must match [A-Za-z0-9_-]+")
    prefixed = f"$JS.{domain}.API."

    def rewrite(subjects: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(prefixed + s[len(API) + 1 :] if s.startswith(API + ".") else s for s in subjects)

    return Permissions(
        publish_allow=rewrite(perms.publish_allow),
        subscribe_allow=perms.subscribe_allow,
        publish_deny=rewrite(perms.publish_deny),
        subscribe_deny=perms.subscribe_deny,
        allow_responses=perms.allow_responses,
    )


def all_permissions(run: str, roles: Iterable[Role] = ROLES, **kwargs: bool) -> dict[Role, Permissions]:
    """:func:`role_permissions` of several roles, keyed by role."""
    return {role: role_permissions(run, role, **kwargs) for role in roles}


def markdown_table(*, ephemeral_consumers: bool = False) -> str:
    """The table of docs/security.md (run name shown as ``<run>``); a unit test keeps the two equal."""
    placeholder = "RUNNAME"
    lines = ["| role | may publish | may subscribe |", "|---|---|---|"]
    for role in ROLES:
        perms = role_permissions(placeholder, role, ephemeral_consumers=ephemeral_consumers)
        publish = [f"`{s}`" for s in perms.publish_allow] + [f"not `{s}`" for s in perms.publish_deny]
        if perms.allow_responses:
            publish.append("one reply to each request it receives (`allow_responses`)")
        subscribe = [f"`{s}`" for s in perms.subscribe_allow]
        row = f"| {role} | {'<br>'.join(publish)} | {'<br>'.join(subscribe)} |"
        lines.append(row.replace(placeholder, "<run>"))
    return "\n".join(lines) + "\n"
