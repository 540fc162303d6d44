"""The controller's snapshot: each part of its state survives the trip through the wire form, the record files are
cut back to a snapshot's sizes, and a cut never falls inside a change of the state (the gate)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from miles.actors.admission import AdmissionState
from miles.actors.run_record import RunRecord
from miles.actors.snapshots import FoldGate
from miles.actors.step_totals import StepTotals
from miles.actors.weight_audit import WeightAudit
from miles.bus.schema import (
    ControllerSnapshot,
    EvalResult,
    GroupsDiscarded,
    GroupsIssued,
    RecordPart,
    StepMetrics,
    WeightsAnnounced,
    WeightsHeld,
    decode,
    encode,
)
from tests.unit.test_evaluations import _coordinator, _result


def _step(step: int) -> StepMetrics:
    ids = [f"g{2 * step}", f"g{2 * step + 1}"]
    return StepMetrics(step=step, policy_version=step + 1, trained_group_ids=ids, staleness=[0, 1], metrics={})


def _batch(first: int) -> GroupsIssued:
    return GroupsIssued(first_index=first, sample_ids=["a", "b"], attempts=[0, 0], issued_at_version=0, cursor=2)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _through_the_wire(snapshot: ControllerSnapshot) -> ControllerSnapshot:
    return decode(encode(snapshot), ControllerSnapshot)


async def _snapshot_of(record: RunRecord, audit: WeightAudit, state: AdmissionState) -> ControllerSnapshot:
    ev, _ = _coordinator()
    await ev.request(5)
    await ev.on_result(_result(ev, "v5", 0))  # one shard of three in: open
    return ControllerSnapshot(
        positions={"metrics": 7, "weights": 3, "discarded": 4, "weights_held": 0, "eval_results": 9},
        admission=state.part(),
        last_batch=_batch(2),
        trainer_version=3,
        trainer_step=2,
        version_steps=[(1, 0), (2, 1), (3, 2)],
        sync_bytes={"full": {"versions": 3, "bytes": 30, "max": 10}},
        audit=audit.part(),
        evaluations=ev.parts(),
        due_evals=[5],
        trainer_done=None,
        refused={"untrusted": 2},
        dead_lettered=2,
        record=record.part(),
    )


async def test_every_part_survives_the_wire_and_restores_the_same_state(tmp_path: Path) -> None:
    record = RunRecord(tmp_path)
    record.issued(_batch(0), t=1.0)
    record.step(_step(0), t=2.0)
    record.step(_step(2), t=3.0)  # a gap: step 1 not recorded yet
    record.eval(EvalResult(policy_version=1, accuracy=0.5, samples=4, requested_version=1, tokens=8), step=1, t=4.0)
    record.count_discarded(1, True, "stale", model_tokens=7)
    audit = WeightAudit()
    audit.announce(WeightsAnnounced(version=2, step=1, digest="d" * 32, size=1, chunks=1, state_digest="s2"))
    audit.report(WeightsHeld(worker_id="w", version=2, state_digest="s2", mode="full"))
    audit.report(WeightsHeld(worker_id="w", version=3, state_digest="s3", mode="full"))  # held: not announced yet
    audit.report(WeightsHeld(worker_id="x", version=2, state_digest="bad", mode="full"))
    state = AdmissionState(issued=6, discarded=1, cursor=5, reissue=["c"], attempts={"c": 1}, discards_seq=4)
    for index in (0, 1, 2, 4):
        state.resolved.add(index)

    snapshot = _through_the_wire(await _snapshot_of(record, audit, state))

    again = AdmissionState.from_part(snapshot.admission)
    assert again == state and again.resolved.floor == 3 and again.resolved.above == {4}
    audit_again = WeightAudit()
    audit_again.restore(snapshot.audit)
    assert audit_again.summary() == audit.summary() and list(audit_again.held.values()) == list(audit.held.values())
    # the held report is settled by its announcement after the restore, as it would have been before
    audit_again.announce(WeightsAnnounced(version=3, step=2, digest="e" * 32, size=1, chunks=1, state_digest="s3"))
    assert audit_again.verified == 2 and not audit_again.held
    record.close()
    restored = RunRecord(tmp_path)
    restored.restore(snapshot.record)
    assert restored.write_summary() | {"wall_s": 0} == record.write_summary() | {"wall_s": 0}
    assert 2 in restored.totals.steps and 1 not in restored.totals.steps and restored.eval_versions == {1: 1}
    restored.close()


async def test_an_evaluation_restored_open_takes_its_other_shards_and_a_complete_one_refuses_copies() -> None:
    ev, _ = _coordinator()
    await ev.request(5)
    await ev.on_result(_result(ev, "v5", 0))
    await ev.request(10)
    for shard in range(3):
        await ev.on_result(_result(ev, "v10", shard))
    parts = _through_the_wire(_wire_carrier(ev)).evaluations
    assert [p.results for p in parts if p.eval_id == "v10"] == [[]]  # a complete one keeps no results

    again, _ = _coordinator()
    again.restore(parts)
    assert again.open_versions() == [5] and again.completed(10)
    assert "counted already" in again.refusal(_result(again, "v10", 1))  # type: ignore[operator]
    assert "counted already" in again.refusal(_result(again, "v5", 0))  # type: ignore[operator]
    assert again.refusal(_result(again, "v5", 1)) is None
    await again.on_result(_result(again, "v5", 1))
    result = await again.on_result(_result(again, "v5", 2))
    assert result is not None and result.samples == 10 and again.completed(5)


def _wire_carrier(ev: object) -> ControllerSnapshot:
    """A snapshot around ``ev``'s evaluations (the rest empty)."""
    return ControllerSnapshot(
        positions={},
        admission=AdmissionState().part(),
        last_batch=None,
        trainer_version=-1,
        trainer_step=0,
        version_steps=[],
        sync_bytes={},
        audit=WeightAudit().part(),
        evaluations=ev.parts(),  # type: ignore[attr-defined]
        due_evals=[],
        trainer_done=None,
        refused={},
        dead_lettered=0,
        record=_empty_record_part(),
    )


def _empty_record_part() -> RecordPart:
    return RecordPart(
        evals=[],
        steps=StepTotals().part(),
        dropped=0,
        requeued=0,
        discard_reasons={},
        discarded_tokens={},
        groups_issued=0,
        file_sizes={},
    )


def test_a_restart_cuts_the_files_back_to_the_snapshot_and_writes_the_rest_once(tmp_path: Path) -> None:
    record = RunRecord(tmp_path)
    record.issued(_batch(0), t=1.0)
    record.step(_step(0), t=2.0)
    cut = record.part()
    record.step(_step(1), t=3.0)  # after the snapshot: replayed at the restart
    record.close()

    again = RunRecord(tmp_path)
    again.restore(cut)
    again.begin_rebuild(cut.file_sizes)
    assert [row["step"] for row in _lines(again.metrics_path)] == [0]
    again.step(_step(0), t=2.0)  # in the snapshot already: not written twice
    again.step(_step(1), t=3.0)
    again.end_rebuild()
    assert [row["step"] for row in _lines(again.metrics_path)] == [0, 1]
    assert [row["event"] for row in _lines(again.ledger_path)] == ["issued"] * 2 + ["trained"] * 4
    assert again.totals.groups == 4
    again.close()


def test_a_run_directory_shorter_than_the_snapshot_is_kept_and_said(tmp_path: Path) -> None:
    record = RunRecord(tmp_path)
    record.step(_step(0), t=2.0)
    cut = record.part()
    record.close()
    record.metrics_path.write_text("")  # another machine's empty run directory
    again = RunRecord(tmp_path)
    again.restore(cut)
    again.begin_rebuild(cut.file_sizes)
    again.step(_step(1), t=3.0)
    again.end_rebuild()
    assert [row["step"] for row in _lines(again.metrics_path)] == [1]
    assert again.totals.groups == 4  # the totals are the snapshot's, exact
    again.close()


def test_an_issue_record_the_restored_state_includes_changes_nothing() -> None:
    state = AdmissionState(issued=4, cursor=4)
    state.fold_discard(
        GroupsDiscarded(group_ids=["g1"], sample_ids=["b"], requeue=True, trainer_version=0), seq=9, known={"b"}
    )
    state.restore(GroupsIssued(first_index=2, sample_ids=["a", "b"], attempts=[0, 0], issued_at_version=0, cursor=4))
    assert state.reissue == ["b"] and state.discards_seq == 9  # the discard folded after the record stays
    state.restore(GroupsIssued(first_index=4, sample_ids=["c"], attempts=[0], issued_at_version=0, cursor=5))
    assert state.issued == 5 and state.reissue == [] and state.cursor == 5


async def test_a_cut_waits_for_a_change_in_progress_and_holds_new_ones_back() -> None:
    gate = FoldGate()
    log: list[str] = []
    changing, release = asyncio.Event(), asyncio.Event()

    async def change(name: str, hold: asyncio.Event | None = None) -> None:
        async with gate.folding():
            log.append(f"{name} start")
            if hold is not None:
                changing.set()
                await hold.wait()
            log.append(f"{name} end")

    async def cut() -> None:
        async with gate.quiet():
            log.append("cut")

    first = asyncio.create_task(change("a", release))
    await changing.wait()
    cutting = asyncio.create_task(cut())
    await asyncio.sleep(0)  # the cut is waiting now ...
    second = asyncio.create_task(change("b"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert log == ["a start"]  # ... for a; and b waits for the cut
    release.set()
    await asyncio.gather(first, cutting, second)
    assert log == ["a start", "a end", "cut", "b start", "b end"]


async def test_a_reader_waiting_outside_the_gate_does_not_hold_a_cut_back() -> None:
    gate = FoldGate()
    log: list[str] = []
    waiting, release = asyncio.Event(), asyncio.Event()

    async def reader() -> None:
        async with gate.folding():
            async with gate.outside():  # waits for something before it changes anything
                waiting.set()
                await release.wait()
            log.append("changed")

    task = asyncio.create_task(reader())
    await waiting.wait()
    async with gate.quiet():
        log.append("cut")
    release.set()
    await task
    assert log == ["cut", "changed"]
