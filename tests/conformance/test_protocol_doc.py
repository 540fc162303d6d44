"""docs/protocol.md against the code: every message field, signer, stream, consumer, bucket key and header.

A third party implements the protocol from the page alone, so a field the code adds without the page
saying so is a worker that breaks silently. These checks read the page's sections and the project's own
definitions (schema, run info, subjects, streams, signing) and name what is missing.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from miles.actors.controller import KEY_CONTROLLER_SEEN
from miles.bus import client
from miles.bus.runinfo import RunInfo
from miles.bus.schema import KINDS, SCHEMA_VERSION, Episode, GroupsDiscarded
from miles.bus.streams import consumer_configs, stream_configs
from miles.bus.subjects import Subjects
from miles.security.signing import SIGNED_BY, TAG

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
RUN = "<run>"


def sections() -> dict[str, str]:
    """Heading line -> the text up to the next heading of any level."""
    parts = re.split(r"(?m)^(#{2,4} .*)$", DOC.read_text())
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def section_of(kind: str) -> str:
    """The section whose heading names message kind ``kind`` (```<subject>` — `<kind>```)."""
    found = [text for heading, text in sections().items() if f"`{kind}`" in heading]
    assert found, f"docs/protocol.md has no section heading naming kind `{kind}`"
    return found[0]


def fields_of(model: type[BaseModel]) -> set[str]:
    return set(model.model_fields)


def missing(names: set[str], text: str) -> list[str]:
    return sorted(n for n in names if f"`{n}`" not in text)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_field_of_every_kind_is_documented_in_its_section(kind: str) -> None:
    assert missing(fields_of(KINDS[kind]), section_of(kind)) == [], f"kind {kind}: fields not in its section"


def test_episode_fields_are_documented_with_the_trajectory() -> None:
    assert missing(fields_of(Episode), section_of("trajectory")) == []


def test_run_info_fields_and_their_parts_are_documented() -> None:
    text = next(t for h, t in sections().items() if h.startswith("## Run info"))
    names = fields_of(RunInfo)
    for field in RunInfo.model_fields.values():
        part = field.annotation
        inner = getattr(part, "__args__", (part,))[0] if not isinstance(part, type) else part
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            names |= fields_of(inner)
    assert missing(names, text) == []


def test_discard_reasons_are_all_documented() -> None:
    reasons = set(GroupsDiscarded.model_fields["reason"].annotation.__args__)
    assert missing(reasons, section_of("groups_discarded")) == []


def test_the_signer_table_is_signed_by() -> None:
    text = DOC.read_text()
    table: dict[str, str] = {}
    for signer, kinds in re.findall(r"(?m)^\| (trainer|controller) \| ((?:`[a-z_]+`(?:, )?)+) \|$", text):
        for kind in re.findall(r"`([a-z_]+)`", kinds):
            table[kind] = signer
    assert table == SIGNED_BY
    assert TAG == b"miles.signed.v1\x00" and '"miles.signed.v1" 0x00' in text


def test_schema_version_streams_consumers_buckets_and_keys_are_named() -> None:
    text = DOC.read_text()
    assert f"currently `{SCHEMA_VERSION}`" in text
    s = Subjects(RUN)
    names = {c.name for c in stream_configs(s, 1)} | {f"{RUN}_WEIGHTS", f"{RUN}_WEIGHTS_DELTA"}
    names |= {c.durable_name for _, c in consumer_configs(s, 30.0)}
    names |= {s.state_bucket, s.runinfo_bucket}
    names |= {v for k, v in vars(client).items() if k.startswith("KEY_")} | {KEY_CONTROLLER_SEEN}
    subjects = [s.prompts, s.traj, s.evalq, s.eval_results, s.weights, s.weights_held, s.discarded, s.control]
    names |= {*subjects, s.step, s.eval, s.done, s.heartbeat("<role>", "<actor_id>"), s.issued}
    names.add(s.dead_letter("<role>", "<origin>"))
    assert [n for n in sorted(names) if n not in text] == []


def test_dead_letter_headers_are_named() -> None:
    source = (Path(client.__file__)).read_text()
    headers = set(re.findall(r'"(Miles-[A-Za-z]+)":', source))
    assert headers == {"Miles-Origin", "Miles-Reason", "Miles-Category", "Miles-Actor"}
    assert missing(headers, DOC.read_text()) == []


def test_the_consumer_table_is_consumer_configs() -> None:
    rows = {
        (stream, durable): (filt, pending)
        for stream, durable, filt, pending in re.findall(
            r"(?m)^\| `([^`]+)` \| `([a-z-]+)` \| (—|`[^`]+`) \| all \| (\d+) \|", DOC.read_text()
        )
    }
    expected = {
        (stream, c.durable_name): (f"`{c.filter_subject}`" if c.filter_subject else "—", str(c.max_ack_pending))
        for stream, c in consumer_configs(Subjects(RUN), 30.0)
    }
    assert rows == expected


def _reference_worker() -> object:
    import importlib.util

    path = DOC.parents[1] / "examples" / "reference_worker.py"
    spec = importlib.util.spec_from_file_location("reference_worker", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_reference_worker_verifies_the_documented_test_vector() -> None:
    """The page's signature test vector, checked by the worker written from the page (not by miles)."""
    text = DOC.read_text()
    public = re.search(r"public\n?`(A[A-Z2-7]{55})`", text)
    payload = re.search(r"payload \(hex\)\n?`([0-9a-f]+)`", text)
    signature = re.search(r"the signature\n?`([0-9a-f]{128})`", text)
    assert public and payload and signature, "the test vector is not on the page"
    ref = _reference_worker()
    verifier = ref.Verifier(
        run="demo", nonce="0123456789abcdef0123456789abcdef", keys={"controller": ref.account_key(public[1])}
    )
    headers = {"Miles-Signer": "controller", "Miles-Signature": signature[1]}
    data = bytes.fromhex(payload[1])
    verifier.check("demo.events.control", data, headers, "control")
    with pytest.raises(ref.Refused, match="no valid signature"):
        verifier.check("demo.events.control", data[:-1] + b"\x00", headers, "control")
    with pytest.raises(ref.Refused, match="no valid signature"):
        verifier.check("demo.prompts", data, headers, "control")  # bound to its subject


def test_the_stream_table_is_stream_configs() -> None:
    rows = {
        name: (subject, retention, limits, direct)
        for name, subject, retention, limits, direct in re.findall(
            r"(?m)^\| `(<run>_[A-Z_]+)` \| `([^`]+)` \| (work queue|limits) \| ([^|]+) \| (yes|no) \|", DOC.read_text()
        )
    }
    for c in stream_configs(Subjects(RUN), 1):
        retention = "work queue" if c.retention.value == "workqueue" else "limits"
        if c.max_age:
            limits = f"max age {int(c.max_age // 86400)} days"
        elif (c.max_msgs_per_subject or 0) > 0:
            limits = f"newest {c.max_msgs_per_subject} messages"
        else:
            limits = "—"  # then what bounds it, in words
        subject, doc_retention, doc_limits, direct = rows[c.name]
        assert (subject, doc_retention, direct) == (c.subjects[0], retention, "yes" if c.allow_direct else "no"), c.name
        assert doc_limits.strip().startswith(limits), (c.name, doc_limits)
