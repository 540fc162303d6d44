"""The controller's evaluation coordinator: which shard results count (requested, claimed, once, in range)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles.actors.evaluations import MAX_REISSUES, EvalCoordinator
from miles.bus.client import bound_msg_id
from miles.bus.schema import EvalShardResult, EvalTask
from miles.bus.subjects import Subjects
from miles.tasks.base import Sample


@dataclass
class _Publisher:
    """Records what the coordinator publishes (the bus itself is tested in tests/integration)."""

    subjects: Subjects = field(default_factory=lambda: Subjects("r"))
    sent: list[tuple[str, Any, str | None]] = field(default_factory=list)

    async def publish(self, subject: str, msg: Any, *, msg_id: str | None = None, by_content: bool = True) -> None:
        self.sent.append((subject, msg, msg_id))


def _coordinator(key: bytes = b"k", steps: dict[int, int] | None = None) -> tuple[EvalCoordinator, _Publisher]:
    bus = _Publisher()
    samples = [Sample(id=f"s{i}", prompt=f"{i}+0=", answer=str(i)) for i in range(10)]
    known = steps if steps is not None else {}
    coordinator = EvalCoordinator(
        bus,  # type: ignore[arg-type]
        samples,
        every=5,
        shard_size=4,
        max_new_tokens=8,
        claim_key=key,
        last_step=20,
        reward_range=(0.0, 1.0),
        step_of=known.get,
    )
    return coordinator, bus


def _result(ev: EvalCoordinator, eval_id: str, shard: int, **change: Any) -> EvalShardResult:
    sizes = [4, 4, 2]
    fields: dict[str, Any] = dict(
        eval_id=eval_id,
        shard=shard,
        worker_id="rollout-0",
        version=int(eval_id[1:]),
        samples=sizes[shard],
        reward_sum=1.0,
        claim=ev.claim(eval_id, shard),
    )
    return EvalShardResult(**(fields | change))


async def test_a_result_counts_only_for_a_requested_shard_with_its_claim_once_and_in_range() -> None:
    ev, bus = _coordinator()
    assert "never requested" in ev.refusal(_result(ev, "v0", 0))  # type: ignore[operator]
    await ev.request(0)
    tasks = [msg for _, msg, _ in bus.sent]
    assert [t.shard for t in tasks] == [0, 1, 2] and all(isinstance(t, EvalTask) for t in tasks)
    assert len({t.claim for t in tasks}) == 3  # one claim per shard
    assert ev.refusal(_result(ev, "v0", 0)) is None
    assert "not the shard's claim" in ev.refusal(_result(ev, "v0", 0, claim=ev.claim("v0", 1)))  # type: ignore[operator]
    assert "not the shard's claim" in ev.refusal(_result(ev, "v0", 0, claim=""))  # type: ignore[operator]
    # 4 samples of a 0/1 task add up to at most 4; 2 of them failed (scored 0): at most 2.
    assert "outside what task.reward_range" in ev.refusal(_result(ev, "v0", 0, reward_sum=1000.0))  # type: ignore[operator]
    assert "outside" in ev.refusal(_result(ev, "v0", 0, reward_sum=3.0, failed=2))  # type: ignore[operator]
    assert "outside" in ev.refusal(_result(ev, "v0", 0, reward_sum=-0.5))  # type: ignore[operator]
    assert ev.refusal(_result(ev, "v0", 0, reward_sum=4.0)) is None
    first = _result(ev, "v0", 0)
    await ev.on_result(first)
    assert "counted already" in ev.refusal(first)  # type: ignore[operator]


async def test_another_controller_key_makes_other_claims() -> None:
    """An earlier run (another key) cannot have answered this run's shards."""
    ours, _ = _coordinator(b"this run")
    theirs, _ = _coordinator(b"an earlier run")
    assert ours.claim("v0", 0) != theirs.claim("v0", 0)
    assert ours.claim("v0", 0) == _coordinator(b"this run")[0].claim("v0", 0)  # a restart derives the same


def test_an_earlier_life_requested_only_evaluations_that_were_due() -> None:
    """After a restart a result is taken for an evaluation this life did not request only if its version was
    announced at a step whose evaluation was due (every 5, the first and the last here)."""
    ev, _ = _coordinator(steps={0: 0, 3: 3, 5: 5, 20: 20})
    assert ev.refusal(_result(ev, "v5", 0)) is None
    assert ev.refusal(_result(ev, "v20", 2)) is None
    assert "never requested" in ev.refusal(_result(ev, "v3", 0))  # type: ignore[operator]  # step 3: not due
    assert "never requested" in ev.refusal(_result(ev, "v7", 0))  # type: ignore[operator]  # never announced


async def test_a_refused_result_with_the_claim_has_its_shard_issued_again_a_bounded_number_of_times() -> None:
    ev, bus = _coordinator()
    await ev.request(0)
    bus.sent.clear()
    stolen = _result(ev, "v0", 1, reward_sum=1000.0)  # whoever took shard 1 answered with nonsense
    assert ev.refusal(stolen) is not None
    assert not await ev.reissue(_result(ev, "v0", 1, reward_sum=1000.0, claim="forged"))  # did not take it
    for attempt in range(1, MAX_REISSUES + 1):
        assert await ev.reissue(stolen)
        subject, task, msg_id = bus.sent[-1]
        assert subject == bus.subjects.evalq and task.shard == 1 and task.claim == ev.claim("v0", 1)
        assert msg_id == f"v0-1-r{attempt}"
    assert not await ev.reissue(stolen)  # bounded
    assert len(bus.sent) == MAX_REISSUES


def test_message_ids_are_bound_to_the_run_instance_the_bytes_and_the_signature() -> None:
    base = bound_msg_id("step-v9", "instance-a", b"payload", "sig")
    assert base.startswith("step-v9.") and base == bound_msg_id("step-v9", "instance-a", b"payload", "sig")
    others = {
        bound_msg_id("step-v9", "instance-b", b"payload", "sig"),  # an earlier run under the same name
        bound_msg_id("step-v9", "instance-a", b"payloaD", "sig"),  # other bytes
        bound_msg_id("step-v9", "instance-a", b"payload", ""),  # unsigned (a forgery of a signed message)
        bound_msg_id("step-v9", "instance-a", b"payloadsig", ""),  # field boundaries are length-prefixed
    }
    assert base not in others and len(others) == 4
