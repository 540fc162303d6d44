"""A stopping controller never waits out the bus for a step report's announcement, and never refuses it for that:
the report is left for its next start (a SIGKILLed launcher takes the server with it, and its controller held on
for the whole outage budget, then refused a genuine report as never announced)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.actors.controller import Abandoned, Controller
from miles.bus.client import Bus
from miles.bus.follow import stored_messages
from miles.bus.schema import StepMetrics
from miles.config import load_config


@pytest.mark.timeout(60)  # waiting for the announcement would take the whole 900 s budget
async def test_a_stopping_controller_leaves_an_unannounced_step_report_for_its_restart(
    nats_server: str, tmp_path: Path
) -> None:
    cfg = load_config(None, ["name=stopping", "bus.outage_budget_s=900", "bus.secure=false"])
    bus = await Bus.open(cfg.bus, nats_server, cfg.name, "controller", role="controller")
    try:
        report = StepMetrics(step=0, policy_version=1, metrics={}, trained_group_ids=["g0"], staleness=[0])
        await bus.publish(bus.subjects.step, report)
        (raw,) = [raw async for raw in stored_messages(bus.js, bus.subjects.metrics_stream, bus.subjects.step)]
        controller = Controller(cfg, bus, tmp_path / "run")
        controller.stopping.set()
        with pytest.raises(Abandoned):
            await controller._on_metrics(raw, False)
        assert not bus.refused and bus.dead_lettered == 0
        assert len(controller.record.totals.steps) == 0  # not recorded either: its restart reads it again
        controller.record.close()
    finally:
        await bus.close()
