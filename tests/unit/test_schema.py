"""The bus schema (version 2): round trips, the wire form, and refusal of malformed or inconsistent messages."""

import math

import msgpack
import pytest

from miles.bus.schema import (
    SCHEMA_VERSION,
    Episode,
    GroupsDiscarded,
    PromptGroup,
    SchemaError,
    StepMetrics,
    Trajectory,
    WeightsAnnounced,
    WeightsHeld,
    decode,
    decode_any,
    encode,
)
from miles.bus.subjects import Subjects


def _episode(weight_version: int = 3, spans: list[tuple[int, int]] | None = None) -> Episode:
    """prompt [1, 4]; a model turn [5, 6], an env turn [9], a model turn [7, 2]."""
    return Episode(
        prompt_ids=[1, 4],
        token_ids=[5, 6, 9, 7, 2],
        loss_mask=[1, 1, 0, 1, 1],
        logprobs=[-0.1, -0.2, 0.0, -0.3, -0.4],
        turns=[(0, 2, "model"), (2, 3, "env"), (3, 5, "model")],
        weight_version=weight_version,
        version_spans=spans or [],
        reward=1.0,
        status="ok",
        end_reason="done",
        stats={"turns": 2.0},
    )


def _traj(*episodes: Episode) -> Trajectory:
    return Trajectory(
        group_id="g1",
        sample_id="s1",
        worker_id="w",
        episodes=list(episodes) or [_episode(), _episode()],
        issued_at_version=2,
        gen_s=0.5,
    )


def test_round_trip() -> None:
    traj = _traj()
    assert decode(encode(traj), Trajectory) == traj
    assert traj.oldest_version == 3 and traj.num_tokens == 10 and traj.issue_index == 1
    assert traj.episodes[0].num_model_tokens == 4


def test_wire_form_is_a_plain_msgpack_map() -> None:
    body = msgpack.unpackb(encode(_traj()))
    assert body["schema"] == SCHEMA_VERSION == 2 and body["kind"] == "trajectory"
    assert body["episodes"][0]["token_ids"] == [5, 6, 9, 7, 2]
    assert body["episodes"][0]["turns"][1] == [2, 3, "env"]


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"", "empty payload"),
        (None, "empty payload"),  # nats-py's stored-message reads hand an empty payload over as None
        (msgpack.packb({"schema": SCHEMA_VERSION, "kind": "trajectory"})[:-3], "not msgpack"),  # truncated
        (b"\xc1\xff garbage", "not msgpack"),
        (msgpack.packb([1, 2, 3]), "not a msgpack map"),
        (msgpack.packb({"schema": 99, "kind": "trajectory"}), "schema version 99"),
        (msgpack.packb({"schema": SCHEMA_VERSION, "kind": "nope"}), "unknown kind"),
        (msgpack.packb({"schema": SCHEMA_VERSION, "kind": "trajectory", "group_id": 1}), "trajectory:"),
    ],
)
def test_malformed_payloads_raise_schema_error(payload: bytes | None, needle: str) -> None:
    with pytest.raises(SchemaError, match=needle):
        decode_any(payload)


def test_a_schema_1_producer_is_refused_with_the_reason() -> None:
    old = {"schema": 1, "kind": "trajectory", "group_id": "g0", "completions": []}
    with pytest.raises(SchemaError, match="schema 1 is single-turn.*upgrade that producer"):
        decode_any(msgpack.packb(old))


def test_wrong_kind_is_rejected() -> None:
    group = PromptGroup(
        group_id="g0", sample_id="s", prompt="1+1=", answer="2", group_size=2, issue_index=0, issued_at_version=0
    )
    with pytest.raises(SchemaError, match="expected kind 'trajectory'"):
        decode(encode(group), Trajectory)


def test_prompt_groups_carry_the_samples_fields() -> None:
    group = PromptGroup(
        group_id="g7", sample_id="s", prompt="q", answer="a", meta={"difficulty": 3, "tags": ["x"]},
        group_size=4, issue_index=7, issued_at_version=0,
    )  # fmt: skip
    assert decode(encode(group), PromptGroup).meta == {"difficulty": 3, "tags": ["x"]}
    with pytest.raises(ValueError, match="g<issue_index>"):
        group.model_copy(update={"group_id": "g8"}).model_validate(group.model_dump() | {"group_id": "g8"})


def test_version_spans_round_trip_and_drive_the_oldest_version() -> None:
    switched = _episode(4, [(0, 4), (3, 6)])
    assert switched.spans == [(0, 4), (3, 6)] and switched.token_versions() == [4, 4, 4, 6, 6]
    plain = _episode(5)
    assert plain.spans == [(0, 5)] and plain.oldest_version == 5
    traj = _traj(plain, switched)
    assert decode(encode(traj), Trajectory) == traj
    assert traj.oldest_version == 4


def _broken(**change: object) -> bytes:
    body = msgpack.unpackb(encode(_traj()))
    body["episodes"][0].update(change)
    return msgpack.packb(body)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"loss_mask": [1, 1, 0, 1]}, "mask entries"),
        ({"logprobs": [-0.1]}, "logprobs"),
        ({"loss_mask": [1, 1, 1, 1, 1]}, "environment turns"),
        ({"loss_mask": [1, 2, 0, 1, 1]}, "0 or 1"),
        ({"turns": [[0, 2, "model"], [3, 5, "model"]]}, "contiguous"),
        ({"turns": [[0, 2, "model"]]}, "cover"),
        ({"logprobs": [-0.1, math.nan, 0.0, -0.3, -0.4]}, "finite log-probability"),
        ({"logprobs": [-0.1, 3.0, 0.0, -0.3, -0.4]}, "finite log-probability"),
        ({"reward": math.nan}, "finite number"),
        ({"reward": None}, "finite number"),
        ({"status": "reward_failed"}, "finite number"),
        ({"version_spans": [[1, 3]]}, "start with"),
        ({"version_spans": [[0, 3], [2, 2]]}, "non-decreasing"),
        ({"version_spans": [[0, 3], [9, 4]]}, "out of range"),
        ({"weight_version": 2**60}, "less than"),
    ],
)
def test_inconsistent_episodes_are_refused(change: dict[str, object], needle: str) -> None:
    with pytest.raises(SchemaError, match=needle):
        decode(_broken(**change), Trajectory)


def test_counts_must_match_and_ids_be_issued_ones() -> None:
    with pytest.raises(ValueError, match="sample_ids"):
        GroupsDiscarded(group_ids=["g1", "g2"], sample_ids=["s"], requeue=True, trainer_version=0)
    with pytest.raises(ValueError):
        GroupsDiscarded(group_ids=["x"], sample_ids=["s"], requeue=True, trainer_version=0)
    with pytest.raises(ValueError, match="staleness"):
        StepMetrics(step=0, policy_version=1, metrics={}, trained_group_ids=["g1"], staleness=[])
    with pytest.raises(ValueError):
        PromptGroup(
            group_id="g0", sample_id="s", prompt="", answer="", group_size=-1, issue_index=0, issued_at_version=0
        )


def test_weights_held_round_trip_and_subject() -> None:
    held = WeightsHeld(worker_id="rollout-0", version=4, state_digest="ab" * 16, mode="delta", fetch_bytes=123)
    assert decode(encode(held), WeightsHeld) == held
    body = msgpack.unpackb(encode(held))
    assert body["kind"] == "weights_held" and body["schema"] == SCHEMA_VERSION
    assert body["pause_s"] == 0.0
    del body["fetch_bytes"], body["pause_s"]  # optional on the wire
    assert decode(msgpack.packb(body), WeightsHeld) == held.model_copy(update={"fetch_bytes": 0})
    del body["state_digest"]
    with pytest.raises(SchemaError, match="weights_held: state_digest"):
        decode(msgpack.packb(body), WeightsHeld)
    subjects = Subjects("r1")
    assert subjects.weights_held == "r1.events.weights_held"
    # Inside the EVENTS stream, and not caught by the announcement subject.
    assert subjects.weights_held.startswith("r1.events.") and subjects.weights_held != subjects.weights


def test_weights_announced_carries_its_lineage() -> None:
    ann = WeightsAnnounced(
        version=9, step=7, consumed=[11, 12], replayed=True, digest="p", size=10, chunks=1,
        state_digest="s" * 32, precision="fp4_e2m1",
    )  # fmt: skip
    assert decode(encode(ann), WeightsAnnounced) == ann
    body = msgpack.unpackb(encode(ann))
    del body["state_digest"], body["precision"], body["consumed"], body["replayed"], body["step"]  # optional
    old = decode(msgpack.packb(body), WeightsAnnounced)
    assert old.state_digest == "" and old.precision == "bfloat16" and old.step == 0 and old.consumed == []
    with pytest.raises(ValueError):
        WeightsAnnounced(version=2**63 - 1, digest="p", size=1, chunks=1)
