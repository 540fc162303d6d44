"""WeightAudit: announced digests against workers' held-weight reports (pure, no NATS)."""

from __future__ import annotations

import structlog
from structlog.testing import capture_logs

from miles.actors.weight_audit import WeightAudit
from miles.bus.schema import WeightsAnnounced, WeightsHeld


def _ann(version: int, digest: str | None = None) -> WeightsAnnounced:
    return WeightsAnnounced(
        version=version,
        digest="payload",
        size=1,
        chunks=1,
        state_digest=f"d{version}" if digest is None else digest,
    )


def _held(worker: str, version: int, digest: str | None = None) -> WeightsHeld:
    return WeightsHeld(
        worker_id=worker, version=version, state_digest=f"d{version}" if digest is None else digest, mode="full"
    )


def _audit(**kwargs: int) -> WeightAudit:
    return WeightAudit(logger=structlog.get_logger("test"), **kwargs)


def test_match_and_mismatch() -> None:
    audit = _audit()
    audit.announce(_ann(1))
    assert audit.report(_held("w0", 1)) == "verified"
    with capture_logs() as logs:
        assert audit.report(_held("w1", 1, "bad")) == "mismatch"
    assert audit.verified == 1 and audit.mismatches == 1 and audit.unverifiable == 0
    assert audit.last_verified == {"w0": 1}
    [event] = [e for e in logs if e["event"] == "weights_mismatch"]
    assert event["log_level"] == "error"
    assert (event["worker"], event["version"], event["expected"], event["got"]) == ("w1", 1, "d1", "bad")
    [m] = audit.recent_mismatches
    assert (m.worker_id, m.version, m.got) == ("w1", 1, "bad")
    assert audit.stats() == {
        "weights_verified": 1.0,
        "weights_mismatches": 1.0,
        "weights_unverifiable": 0.0,
        "weights_pending": 0.0,
    }
    summary = audit.summary()
    assert summary["weights_recent_mismatches"] == [{"worker": "w1", "version": 1, "expected": ["d1"], "got": "bad"}]
    assert summary["weights_last_verified"] == {"w0": 1}


def test_last_verified_only_moves_forward() -> None:
    audit = _audit()
    for v in (1, 2):
        audit.announce(_ann(v))
    audit.report(_held("w0", 2))
    audit.report(_held("w0", 1))  # a late report of an older version
    assert audit.last_verified == {"w0": 2} and audit.verified == 2


def test_report_before_its_announcement_is_held_then_checked() -> None:
    audit = _audit()
    assert audit.report(_held("w0", 3)) == "held"
    assert audit.report(_held("w1", 3, "wrong")) == "held"
    assert audit.report(_held("w2", 4)) == "held"
    assert audit.stats()["weights_pending"] == 3 and audit.verified == audit.mismatches == 0
    audit.announce(_ann(3))
    assert audit.verified == 1 and audit.mismatches == 1
    assert [r.version for r in audit.held.values()] == [4]
    audit.announce(_ann(4))
    assert audit.verified == 2 and not audit.held


def test_reports_older_than_everything_known_are_unverifiable() -> None:
    audit = _audit()
    assert audit.report(_held("w0", 2)) == "held"  # nothing announced yet: wait
    audit.announce(_ann(5))  # e.g. a restarted controller that starts at the newest announcement
    assert audit.unverifiable == 1 and not audit.held
    assert audit.report(_held("w0", 4)) == "unverifiable"
    assert audit.report(_held("w0", 5)) == "verified"
    assert audit.report(_held("w0", 6)) == "held"


def test_missing_digests_are_unverifiable() -> None:
    audit = _audit()
    audit.announce(_ann(1, digest=""))  # a trainer that predates state digests
    assert audit.report(_held("w0", 1, digest="")) == "unverifiable"
    assert audit.report(_held("w0", 1)) == "held"  # never announced with a digest
    assert audit.verified == audit.mismatches == 0


def test_a_re_announced_version_accepts_both_digests() -> None:
    """A restarted trainer may publish a version again; a worker holding either publication is fine."""
    audit = _audit()
    audit.announce(_ann(2, "first"))
    audit.announce(_ann(2, "second"))
    assert audit.report(_held("w0", 2, "first")) == "verified"
    assert audit.report(_held("w1", 2, "second")) == "verified"
    assert audit.report(_held("w2", 2, "third")) == "mismatch"
    assert audit.recent_mismatches[-1].expected == ("first", "second")


def test_memory_is_bounded() -> None:
    audit = _audit(keep_versions=8, max_held=5, max_recent=3)
    for v in range(100):
        audit.announce(_ann(v))
        audit.report(_held("w0", v, "bad"))
    assert sorted(audit.announced) == list(range(92, 100))
    assert audit.mismatches == 100 and len(audit.recent_mismatches) == 3
    assert [m.version for m in audit.recent_mismatches] == [97, 98, 99]
    assert audit.report(_held("w0", 91)) == "unverifiable"  # trimmed away
    for v in range(200, 210):  # ten reports far ahead of any announcement: only the newest 5 wait
        assert audit.report(_held("w0", v)) == "held"
    assert len(audit.held) == 5 and audit.unverifiable == 1 + 5
    assert [r.version for r in audit.held.values()] == list(range(205, 210))
