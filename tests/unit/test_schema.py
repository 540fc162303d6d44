import msgpack
import pytest

from miles.bus.schema import (
    SCHEMA_VERSION,
    Completion,
    PromptGroup,
    SchemaError,
    Trajectory,
    WeightsAnnounced,
    WeightsHeld,
    decode,
    decode_any,
    encode,
)
from miles.bus.subjects import Subjects


def _traj() -> Trajectory:
    comp = Completion(
        output_ids=[5, 6, 2], logprobs=[-0.1, -0.2, -0.3], reward=1.0, finish_reason="stop", weight_version=3
    )
    return Trajectory(
        group_id="g1",
        sample_id="s1",
        worker_id="w",
        prompt_ids=[1, 4],
        completions=[comp, comp],
        issued_at_version=2,
        gen_s=0.5,
    )


def test_round_trip() -> None:
    traj = _traj()
    assert decode(encode(traj), Trajectory) == traj
    assert traj.oldest_version == 3 and traj.num_tokens == 6


def test_wire_form_is_a_plain_msgpack_map() -> None:
    body = msgpack.unpackb(encode(_traj()))
    assert body["schema"] == SCHEMA_VERSION and body["kind"] == "trajectory"
    assert body["completions"][0]["output_ids"] == [5, 6, 2]


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"\xc1\xff garbage", "not msgpack"),
        (msgpack.packb([1, 2, 3]), "not a msgpack map"),
        (msgpack.packb({"schema": 99, "kind": "trajectory"}), "schema version 99"),
        (msgpack.packb({"schema": SCHEMA_VERSION, "kind": "nope"}), "unknown kind"),
        (msgpack.packb({"schema": SCHEMA_VERSION, "kind": "trajectory", "group_id": 1}), "trajectory:"),
    ],
)
def test_malformed_payloads_raise_schema_error(payload: bytes, needle: str) -> None:
    with pytest.raises(SchemaError, match=needle):
        decode_any(payload)


def test_wrong_kind_is_rejected() -> None:
    group = PromptGroup(
        group_id="g", sample_id="s", prompt="1+1=", answer="2", group_size=2, issue_index=0, issued_at_version=0
    )
    with pytest.raises(SchemaError, match="expected kind 'trajectory'"):
        decode(encode(group), Trajectory)


def _comp(weight_version: int, spans: list[list[int]] | None = None, n: int = 5) -> Completion:
    return Completion(
        output_ids=list(range(n)),
        logprobs=[-0.5] * n,
        reward=0.0,
        finish_reason="length",
        weight_version=weight_version,
        version_spans=spans or [],
    )


def test_version_spans_round_trip_and_drive_the_oldest_version() -> None:
    switched = _comp(4, [[0, 4], [2, 6], [4, 7]])
    assert switched.spans == [(0, 4), (2, 6), (4, 7)] and switched.token_versions() == [4, 4, 6, 6, 7]
    plain = _comp(5)
    assert plain.spans == [(0, 5)] and plain.oldest_version == 5 and plain.token_versions() == [5] * 5
    traj = _traj().model_copy(update={"completions": [plain, switched]})
    assert decode(encode(traj), Trajectory) == traj
    assert traj.oldest_version == 4


def test_completion_without_version_spans_still_decodes() -> None:
    """SCHEMA_VERSION 1 producers that predate version_spans: one span at weight_version."""
    body = msgpack.unpackb(encode(_traj()))
    for comp in body["completions"]:
        del comp["version_spans"]
    traj = decode(msgpack.packb(body), Trajectory)
    assert traj.completions[0].version_spans == [] and traj.completions[0].spans == [(0, 3)]
    assert traj.oldest_version == 3


@pytest.mark.parametrize(
    "spans",
    [[[1, 3]], [[0, 2]], [[0, 3], [0, 4]], [[0, 3], [2, 2]], [[0, 3], [5, 4]], [[0, 3, 1]]],
    ids=["not-at-0", "not-weight-version", "starts-not-increasing", "versions-backwards", "past-end", "not-a-pair"],
)
def test_malformed_version_spans_are_rejected(spans: list[list[int]]) -> None:
    body = msgpack.unpackb(encode(_traj()))
    body["completions"][0]["version_spans"] = spans
    with pytest.raises(SchemaError, match="version_spans"):
        decode(msgpack.packb(body), Trajectory)


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


def test_weights_announced_digest_and_precision_are_additive() -> None:
    ann = WeightsAnnounced(version=2, digest="p", size=10, chunks=1, state_digest="s" * 32, precision="fp4_e2m1")
    assert decode(encode(ann), WeightsAnnounced) == ann
    body = msgpack.unpackb(encode(ann))
    del body["state_digest"], body["precision"]  # a producer from before these fields
    old = decode(msgpack.packb(body), WeightsAnnounced)
    assert old.state_digest == "" and old.precision == "bfloat16" and old.version == 2
