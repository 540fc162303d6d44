"""Audit of the weights rollout workers hold against what the trainer announced.

The trainer announces, per version, the digest of the rollout-precision state it published
(``WeightsAnnounced.state_digest``); every worker reports the digest of the state its engine
adopted (``WeightsHeld``). :class:`WeightAudit` pairs the two. It is pure (no I/O but a log line) and
bounded in memory, so the controller can feed it for a run of any length.

Outcomes of a report:

* **verified**: its digest is one announced for its version;
* **mismatch**: it is not; logged as the error event ``weights_mismatch`` and kept in ``recent_mismatches``;
* **held**: its version has not been announced yet (two independent consumers feed the audit, so a
  report can overtake its announcement); resolved when the announcement arrives;
* **unverifiable**: nothing can decide it: its version is older than every announcement still
  known (announcements seen before a controller restart, or trimmed), the announcement or report
  carries no digest, or the held buffer overflowed.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import structlog

from miles.bus.schema import AuditPart, WeightsAnnounced, WeightsHeld
from miles.training.lineage import MIN_VERSIONS_KEPT

log = structlog.get_logger(__name__)

MAX_HELD = 256  # reports waiting for their announcement
MAX_RECENT_MISMATCHES = 16


@dataclass(frozen=True, slots=True)
class Mismatch:
    worker_id: str
    version: int
    expected: tuple[str, ...]
    got: str


class WeightAudit:
    """Pairs ``WeightsAnnounced`` digests with ``WeightsHeld`` reports; counts and logs the outcomes."""

    def __init__(
        self,
        keep_versions: int = MIN_VERSIONS_KEPT,  # announced versions remembered (the controller's versions_kept)
        max_held: int = MAX_HELD,
        max_recent: int = MAX_RECENT_MISMATCHES,
        logger: Any = None,
    ) -> None:
        self.keep_versions = keep_versions
        self.max_held = max_held
        # version -> digests announced for it (a trainer restart may re-announce a version; any
        # announced digest is a legitimate state for that version)
        self.announced: dict[int, set[str]] = {}
        self.held: OrderedDict[int, WeightsHeld] = OrderedDict()  # arrival id -> report, oldest first
        self._held_seq = 0
        self.recent_mismatches: deque[Mismatch] = deque(maxlen=max_recent)
        self.verified = 0
        self.mismatches = 0
        self.unverifiable = 0
        self.last_verified: dict[str, int] = {}  # worker -> newest version verified
        self.log = logger if logger is not None else log

    # ------------------------------------------------------------------ inputs

    def announce(self, ann: WeightsAnnounced) -> None:
        """Record a version's digest, then settle every held report it (or the trimming) decides."""
        if not ann.state_digest:
            return  # a producer that predates state digests: reports for it stay undecidable
        self.announced.setdefault(ann.version, set()).add(ann.state_digest)
        while len(self.announced) > self.keep_versions:
            del self.announced[min(self.announced)]
        for key, report in list(self.held.items()):
            if report.version in self.announced or report.version < self._oldest():
                del self.held[key]
                self._check(report)

    def report(self, held: WeightsHeld) -> str:
        """Check one report; returns its outcome: verified, mismatch, held or unverifiable."""
        if not held.state_digest:
            self.unverifiable += 1
            return "unverifiable"
        if held.version not in self.announced and (not self.announced or held.version > self._oldest()):
            self.held[self._held_seq] = held
            self._held_seq += 1
            if len(self.held) > self.max_held:  # bounded: the oldest waiting report gives up
                _, dropped = self.held.popitem(last=False)
                self.unverifiable += 1
                self.log.warning("weights_report_unverifiable", worker=dropped.worker_id, version=dropped.version)
            return "held"
        return self._check(held)

    # ------------------------------------------------------------------ outputs

    def stats(self) -> dict[str, float]:
        """Counters for the controller heartbeat and summary.json."""
        return {
            "weights_verified": float(self.verified),
            "weights_mismatches": float(self.mismatches),
            "weights_unverifiable": float(self.unverifiable),
            "weights_pending": float(len(self.held)),
        }

    def summary(self) -> dict[str, Any]:
        """Plain data for summary.json."""
        return {
            **{k: int(v) for k, v in self.stats().items()},
            "weights_last_verified": dict(sorted(self.last_verified.items())),
            "weights_recent_mismatches": [
                {"worker": m.worker_id, "version": m.version, "expected": list(m.expected), "got": m.got}
                for m in self.recent_mismatches
            ],
        }

    def part(self) -> AuditPart:
        """The audit as a part of the controller's snapshot."""
        return AuditPart(
            announced=[(v, sorted(digests)) for v, digests in sorted(self.announced.items())],
            held=list(self.held.values()),
            verified=self.verified,
            mismatches=self.mismatches,
            unverifiable=self.unverifiable,
            last_verified=dict(self.last_verified),
            recent_mismatches=[(m.worker_id, m.version, list(m.expected), m.got) for m in self.recent_mismatches],
        )

    def restore(self, part: AuditPart) -> None:
        """Take the state of a snapshot (a fresh audit: nothing fed yet)."""
        self.announced = {v: set(digests) for v, digests in part.announced}
        self.held = OrderedDict(enumerate(part.held))
        self._held_seq = len(part.held)
        self.verified, self.mismatches, self.unverifiable = part.verified, part.mismatches, part.unverifiable
        self.last_verified = dict(part.last_verified)
        self.recent_mismatches.extend(Mismatch(w, v, tuple(e), g) for w, v, e, g in part.recent_mismatches)

    # ------------------------------------------------------------------ internals

    def _oldest(self) -> int:
        return min(self.announced)

    def _check(self, held: WeightsHeld) -> str:
        expected = self.announced.get(held.version)
        if expected is None:  # older than every announcement still known
            self.unverifiable += 1
            return "unverifiable"
        if held.state_digest in expected:
            self.verified += 1
            if held.version > self.last_verified.get(held.worker_id, -1):
                self.last_verified[held.worker_id] = held.version
            return "verified"
        self.mismatches += 1
        mismatch = Mismatch(held.worker_id, held.version, tuple(sorted(expected)), held.state_digest)
        self.recent_mismatches.append(mismatch)
        self.log.error(
            "weights_mismatch",
            worker=held.worker_id,
            version=held.version,
            expected=",".join(mismatch.expected),
            got=held.state_digest,
            mode=held.mode,
        )
        return "mismatch"
