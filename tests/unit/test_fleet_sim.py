"""The pure admission/intake rules, proof that the actors call them, and the fleet simulator's outcomes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import pytest

import miles.actors.controller as controller_mod
import miles.actors.trainer as trainer_mod
from miles.actors.admission import AdmissionState, issue_room
from miles.actors.controller import Controller
from miles.actors.trainer import TrainerLeader
from miles.actors.trainer_intake import Examined
from miles.sim.fleet import EngineModel, FleetParams, LengthModel, simulate
from miles.training.intake import RecentSet, classify
from miles.training.lineage import IndexSet, VersionLineage

# ------------------------------------------------------------------ classify


def _verdict(**kw):
    base = dict(resolved=IndexSet(), held=set(), lag=0, max_staleness=2, has_trained_episodes=True, keep=None)
    base.update(kw)
    return classify(7, **base)


def test_classify_each_verdict() -> None:
    done = IndexSet()
    done.add(7)
    assert _verdict(resolved=done) == "duplicate"
    assert _verdict(held={7}) == "duplicate"
    assert _verdict(lag=3) == "stale"
    assert _verdict(lag=None) == "stale"  # an unknown version is too old
    assert _verdict(lag=2) == "accept"  # the bound itself is allowed
    assert _verdict(has_trained_episodes=False) == "no_signal"
    assert _verdict(keep=lambda: False) == "filtered"
    assert _verdict(keep=lambda: True) == "accept"


def test_classify_order_and_lazy_filter() -> None:
    calls: list[int] = []

    def keep() -> bool:
        calls.append(1)
        return False

    assert _verdict(held={7}, lag=9, has_trained_episodes=False, keep=keep) == "duplicate"
    assert _verdict(lag=9, has_trained_episodes=False, keep=keep) == "stale"
    assert _verdict(has_trained_episodes=False, keep=keep) == "no_signal"
    assert calls == []  # the filter (rewards) is only computed when every earlier check passed


# ------------------------------------------------------------------ issue_room


def test_issue_room_values() -> None:
    s = AdmissionState()
    kw = dict(max_staleness=2, groups_per_step=8, steps=100)
    assert issue_room(s, step=0, **kw) == 24  # (eta + 0 + 1) * B
    s.issued = 24
    assert issue_room(s, step=0, **kw) == 0
    assert issue_room(s, step=1, **kw) == 8
    s.discarded = 3  # discards free their credit
    assert issue_room(s, step=1, **kw) == 11
    assert issue_room(s, step=1, over_issue=4, **kw) == 15
    s.issued, s.discarded = 800, 0
    assert issue_room(s, step=99, **kw) == 0  # capped at steps * B


# ------------------------------------------------------------------ the actors call them


async def test_controller_admit_calls_issue_room(monkeypatch: pytest.MonkeyPatch) -> None:
    done = asyncio.Event()
    seen: list[dict] = []

    def spy(state, **kw):
        seen.append(kw)
        done.set()
        return 0

    monkeypatch.setattr(controller_mod, "issue_room", spy)
    ctl = Controller.__new__(Controller)
    algo = SimpleNamespace(filter=SimpleNamespace(over_issue=0.5))
    ctl.cfg = SimpleNamespace(
        trainer=SimpleNamespace(groups_per_step=8, steps=10, algo=algo),
        staleness=SimpleNamespace(max_staleness=3),
    )
    ctl._admit_open, ctl._wake = asyncio.Event(), asyncio.Event()
    ctl._admit_open.set()
    ctl.trainer_step, ctl.trainer_version, ctl.state = 5, -1, AdmissionState()
    await asyncio.wait_for(ctl._admit(done), timeout=5)
    assert seen == [dict(step=5, max_staleness=3, groups_per_step=8, steps=10, over_issue=4)]


class _Msg:
    _seq = 0

    def __init__(self, traj) -> None:
        _Msg._seq += 1
        self.traj, self.acked = traj, False
        self.metadata = SimpleNamespace(sequence=SimpleNamespace(stream=_Msg._seq))

    async def ack(self) -> None:
        self.acked = True


class _Intake:
    """The trainer's intake (miles/actors/trainer_intake.py) as the leader sees it: examined trajectories in order."""

    def __init__(self, msgs) -> None:
        self.msgs = list(msgs)

    async def take(self, n, timeout_s):
        out, self.msgs = self.msgs[:n], self.msgs[n:]
        return [Examined(m, m.traj, None, None) for m in out]


@pytest.mark.parametrize(("stale_prefix", "expected"), [("discard", "stale"), ("mask", "accept")])
async def test_trainer_collect_acts_on_classify(
    monkeypatch: pytest.MonkeyPatch, stale_prefix: str, expected: str
) -> None:
    """Feed a duplicate, a stale and a fresh trajectory: the trainer asks classify and acts on each verdict. The
    second one's last tokens are fresh: with ``stale_prefix: mask`` it is judged by them and kept."""
    verdicts: list[str] = []

    def spy(index, **kw):
        verdicts.append(classify(index, **kw))
        return verdicts[-1]

    monkeypatch.setattr(trainer_mod, "classify", spy)
    tr = TrainerLeader.__new__(TrainerLeader)
    tr.cfg = SimpleNamespace(
        trainer=SimpleNamespace(groups_per_step=1),
        bus=SimpleNamespace(ack_wait_s=30.0),
        staleness=SimpleNamespace(max_staleness=1, on_stale="requeue", stale_prefix=stale_prefix),
    )
    tr.stopping = asyncio.Event()
    tr.resolved = IndexSet()
    tr.resolved.add(0)
    tr.lineage = VersionLineage()
    for v in range(4):
        tr.lineage.advance(v, v)
    tr.group_filter, tr.shaper = None, None
    tr.counts = {"duplicates": 0, "generated_again": 0}
    tr._seen_seqs = RecentSet(keep=16)
    tr.audit = None  # trainer.audit off
    discards: list[tuple[int, str, bool]] = []

    async def accept(examined):
        return examined.trajectory

    async def discard(m, traj, reason, *, requeue):
        discards.append((traj.issue_index, reason, requeue))
        await m.ack()

    tr._accept, tr._discard = accept, discard
    tr.cfg.trainer.groups_per_step = 1 if expected == "stale" else 2
    trajs = [
        SimpleNamespace(issue_index=i, oldest_version=v, newest_version=n, trained_episodes=[1], episodes=[])
        for i, v, n in [(0, 3, 3), (1, 1, 3), (2, 3, 3)]
    ]
    msgs = [_Msg(t) for t in trajs]
    held, got = await asyncio.wait_for(tr._collect(_Intake(msgs)), timeout=5)
    assert verdicts == ["duplicate", expected, "accept"]
    assert tr.counts["duplicates"] == 1 and msgs[0].acked
    assert tr.counts["generated_again"] == 1  # a trajectory of a trained group it had not seen: played twice
    if expected == "stale":
        assert discards == [(1, "stale", True)]
        assert [t.issue_index for t in got] == [2] and held == [msgs[2]]
    else:
        assert discards == []
        assert [t.issue_index for t in got] == [1, 2] and held == msgs[1:]


# ------------------------------------------------------------------ the simulator

TINY = FleetParams(
    gpus=8,
    groups_per_step=8,
    group_size=4,
    steps=8,
    warmup_steps=2,
    engine=EngineModel(max_batch=16, step_base_s=0.006, step_per_seq_s=0.0003),
    lengths=LengthModel(median=200, sigma=1.0, max_len=3200),
    train_s_per_token=1e-4,
    train_overhead_s=0.5,
    transfer_s=0.3,
    pause_s=0.1,
    colocated_switch_s=0.4,
    dataset=256,
    stale_prefix="discard",  # the tests of re-queueing; the masking ones say mask
)


def test_sim_outcomes_hold_the_rules() -> None:
    sync = simulate(dataclasses.replace(TINY, mode="sync"))
    assert sync.staleness_max == 0 and sync.requeued == 0
    assert sync.samples_per_s <= sync.bound_samples_per_s
    for eta in (0, 1, 2, 4):
        r = simulate(dataclasses.replace(TINY, mode="async", eta=eta))
        assert r.trained_groups == TINY.steps * TINY.groups_per_step  # every step got a full batch
        assert r.staleness_max <= eta  # never trains a group past the bound
        assert r.samples_per_s <= r.bound_samples_per_s
        if eta == 0:
            assert r.staleness_mean == 0.0


def test_sim_requeues_long_groups() -> None:
    """The length bias: what goes stale and is re-queued is the long tail."""
    r = simulate(dataclasses.replace(TINY, mode="async", eta=1, steps=16, seed=3))
    assert r.requeued > 0
    assert r.requeued_len_mean > r.trained_len_mean
    assert 0.0 < r.regenerated_fraction < 1.0


def test_sim_masking_a_stale_prefix_keeps_long_groups_within_the_bound() -> None:
    """``stale_prefix: mask``: the long groups that re-queueing regenerates are kept, their too-old tokens masked;
    no trained token is past the bound either way."""
    base = dataclasses.replace(TINY, mode="async", eta=1, steps=16, seed=3)
    requeue = simulate(base)
    mask = simulate(dataclasses.replace(base, stale_prefix="mask"))
    assert requeue.masked_fraction == 0.0 and requeue.regenerated_fraction > 0.0
    assert mask.regenerated_fraction < requeue.regenerated_fraction and mask.masked_fraction > 0.0
    assert mask.staleness_max <= 1 and mask.trained_groups == base.steps * base.groups_per_step


def test_more_groups_in_flight_than_rows_keep_a_stragglers_rows_busy() -> None:
    """A worker that plays more groups than its engine has rows for leaves sequences waiting, which take the
    rows a long group's finished members free: the engines fill better, and never past their rows."""
    base = dataclasses.replace(TINY, mode="async", eta=4, steps=16, seed=3, stale_prefix="mask")
    rows = base.engine.max_batch // base.group_size
    tight = simulate(dataclasses.replace(base, groups_in_flight=rows))
    deep = simulate(dataclasses.replace(base, groups_in_flight=2 * rows))
    assert 0.0 < tight.engine_fill < deep.engine_fill <= 1.0
    assert 0.0 < tight.trainer_busy <= 1.0 and 0.0 < deep.trainer_busy <= 1.0
    assert deep.trained_groups == base.steps * base.groups_per_step and deep.staleness_max <= base.eta


def test_admitting_by_episodes_fills_the_rows_a_long_group_frees() -> None:
    """``admit_by="episodes"`` (the worker's seats): the next group takes the seats of a long group's finished
    members, so the engines are fuller than when the whole group's room waits for its longest member, and
    no engine runs more episodes than its worker has seats."""
    base = dataclasses.replace(TINY, mode="async", eta=4, steps=16, seed=3, stale_prefix="mask")
    by_groups = simulate(base)
    by_episodes = simulate(dataclasses.replace(base, admit_by="episodes"))
    assert 0.0 < by_groups.engine_fill < by_episodes.engine_fill <= 1.0
    assert by_episodes.samples_per_s > by_groups.samples_per_s
    assert by_episodes.staleness_max <= base.eta


def test_an_open_ended_run_does_not_drain_inside_its_window() -> None:
    """A run capped at its last step admits nothing new for its last eta + 1 steps and waits on its stragglers;
    an open-ended one (a window of a longer run) keeps issuing, so its measured throughput is higher."""
    base = dataclasses.replace(TINY, mode="async", eta=2, steps=16, seed=3, stale_prefix="mask")
    capped = simulate(base)
    open_ended = simulate(dataclasses.replace(base, open_ended=True))
    assert open_ended.samples_per_s > capped.samples_per_s
    assert open_ended.staleness_max <= base.eta


def test_engine_token_versions_split_at_each_switch() -> None:
    from miles.sim.fleet import Engine

    e = Engine(0, EngineModel())
    e.tokens = 10.0
    e.switch(1)
    e.tokens = 12.5
    e.switch(2)
    e.switch(2)  # not newer: no new span
    assert e.token_versions(8.0, 7) == [(0, 2), (1, 3), (2, 2)]  # steps 8-9 | 10-12 | 13-14
    assert e.token_versions(12.5, 3) == [(2, 3)]
    assert e.token_versions(0.0, 4) == [(0, 4)]


def test_cli_smoke(tmp_path, capsys) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "fleet_sim.py"
    spec = importlib.util.spec_from_file_location("fleet_sim_cli", path)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = tmp_path / "rows.json"
    args = ["--gpus", "8", "--sigma", "1", "--eta", "0", "2", "--steps", "6", "--groups-in-flight", "3", "4"]
    assert cli.main([*args, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["groups_in_flight"]) for r in rows] == [("sync", 3)] + [("async", 3)] * 2 + [("async", 4)] * 2
    assert all(r["staleness_max"] <= r["eta"] for r in rows)
    assert "| mode |" in capsys.readouterr().out
    assert cli.main(["--preset", "machine", "--eta", "2", "--steps", "10"]) == 0
