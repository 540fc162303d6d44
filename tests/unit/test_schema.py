import msgpack
import pytest

from miles.bus.schema import (
    SCHEMA_VERSION,
    Completion,
    PromptGroup,
    SchemaError,
    Trajectory,
    decode,
    decode_any,
    encode,
)


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
