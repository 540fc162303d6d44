"""How long a restarted controller takes to rebuild its state, against the length of the run.

    python benchmarks/controller_restart.py --steps 1000 10000 --out benchmarks/results/controller_restart.json

For each run length in ``--steps``, an embedded nats-server (JetStream on a temporary directory) is filled with
the streams of a synthetic run of that many steps, ``--groups-per-step`` groups each: per step the issue record
(``groups_issued``), the trainer's announcement of the new version (``weights_announced``) and its step report
(``step_metrics``), and a discard (``groups_discarded``, re-queued) every ``--discard-every`` steps; version 0 is
announced first. Then a fresh :class:`~miles.actors.controller.Controller` on that bus (its own task, sample
order, evaluations and run record, as in ``Controller.main``) runs its real restart path, ``_rebuild``, which
is timed (wall and CPU of this process), ``--repeats`` times with a fresh controller and run directory each
time. Beside it, the floor: reading the same messages off the streams and doing nothing with them.

Checked after every rebuild: nothing refused, every group issued, trained or discarded as the streams say, and
the issue count the admission would go on from. Reported per run length: the rebuild's median wall seconds,
CPU seconds, the floor, and the bytes of the run record it rewrote (``groups.jsonl`` and ``metrics.jsonl``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

from miles.bus.client import Bus
from miles.bus.follow import stored_messages
from miles.bus.schema import GroupsDiscarded, GroupsIssued, StepMetrics, WeightsAnnounced
from miles.bus.server import EmbeddedNats
from miles.config import RunConfig, load_config

PIPELINE = 512  # publishes in flight while filling the streams


def config(groups_per_step: int, steps: int) -> RunConfig:
    sets = {
        "name": "restart",
        "trainer.groups_per_step": groups_per_step,
        "trainer.steps": steps,
        "eval.every": steps,  # no evaluation falls due inside the replayed run
    }
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


async def fill(bus: Bus, cfg: RunConfig, sample_ids: list[str], discard_every: int) -> dict[str, int]:
    """The streams of a run of ``cfg.trainer.steps`` steps; returns what they hold (the expected fold)."""
    s, per_step = bus.subjects, cfg.trainer.groups_per_step
    pending: set[asyncio.Task[Any]] = set()

    async def put(subject: str, message: Any, msg_id: str) -> None:
        while len(pending) >= PIPELINE:
            _, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.create_task(bus.publish(subject, message, msg_id=msg_id))
        pending.add(task)
        task.add_done_callback(pending.discard)

    async def settle() -> None:  # the order across subjects matters to the replay: wait before the next kind
        while pending:
            await asyncio.gather(*list(pending))

    def announcement(version: int) -> WeightsAnnounced:
        return WeightsAnnounced(version=version, step=version, digest=f"{version:032x}", size=1, chunks=1)

    await bus.publish(s.weights, announcement(0), msg_id="v0")
    issued = discarded = 0
    for step in range(cfg.trainer.steps):
        first = issued
        ids = [sample_ids[(first + i) % len(sample_ids)] for i in range(per_step)]
        batch = GroupsIssued(
            first_index=first, sample_ids=ids, attempts=[0] * per_step, issued_at_version=step, cursor=first + per_step
        )
        await put(s.issued, batch, f"issued-{first}")
        issued += per_step
        await settle()
        trained = [f"g{first + i}" for i in range(per_step)]
        if discard_every and step % discard_every == discard_every - 1:
            gone, trained = trained[:1], trained[1:]
            message = GroupsDiscarded(
                group_ids=gone, sample_ids=ids[:1], requeue=True, trainer_version=step, reason="stale"
            )
            await put(s.discarded, message, f"discard-{step}")
            discarded += 1
        await put(s.weights, announcement(step + 1), f"v{step + 1}")
        await settle()
        report = StepMetrics(
            step=step,
            policy_version=step + 1,
            trained_group_ids=trained,
            staleness=[1] * len(trained),
            metrics={"reward_mean": 0.5, "samples": float(4 * len(trained)), "step_s": 0.1},
        )
        await put(s.step, report, f"step-{step}")
    await settle()
    return {"issued": issued, "discarded": discarded, "trained": issued - discarded}


async def floor_s(bus: Bus) -> float:
    """Reading every message the rebuild reads, doing nothing with them."""
    s = bus.subjects
    start = time.perf_counter()
    for stream, subject in (
        (s.events_stream, s.weights),
        (s.metrics_stream, s.metrics_all),
        (s.events_stream, f"{s.run}.events.>"),
    ):
        async for _ in stored_messages(bus.js, stream, subject):
            pass
    return time.perf_counter() - start


async def rebuild_once(bus: Bus, cfg: RunConfig, run_dir: Path, expected: dict[str, int]) -> dict[str, Any]:
    from miles.actors.admission import SampleOrder
    from miles.actors.controller import Controller
    from miles.actors.evaluations import EvalCoordinator
    from miles.tasks.registry import build_task

    controller = Controller(cfg, bus, run_dir)
    task = build_task(cfg.task, sandbox=cfg.rollout.sandbox)
    controller.samples = {sample.id: sample for sample in task.samples("train")}
    controller.order = SampleOrder(controller.samples, cfg.seed)
    controller.evals = EvalCoordinator(
        bus,
        task.samples("eval")[:8],
        every=cfg.eval.every,
        shard_size=cfg.eval.shard_size,
        max_new_tokens=8,
        last_step=cfg.trainer.steps,
        reward_range=cfg.task.reward_range,
        step_of=controller.version_steps.get,
        claim_key=b"bench",
    )
    refused_before = sum(bus.refused.values())
    wall, cpu = time.perf_counter(), time.process_time()
    await controller._rebuild()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    controller.record.close()
    got = {
        "issued": controller.state.issued,
        "discarded": controller.state.discarded,
        "trained": controller.record.groups_trained,
    }
    if got != expected or sum(bus.refused.values()) != refused_before:
        raise RuntimeError(f"the rebuild folded {got} with refusals {dict(bus.refused)}; the streams hold {expected}")
    record_bytes = sum((run_dir / name).stat().st_size for name in ("groups.jsonl", "metrics.jsonl"))
    return {"wall_s": wall, "cpu_s": cpu, "record_bytes": record_bytes}


async def measure(steps: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    cfg = config(args.groups_per_step, steps)
    from miles.tasks.registry import build_task

    sample_ids = [sample.id for sample in build_task(cfg.task, sandbox=cfg.rollout.sandbox).samples("train")]
    async with EmbeddedNats(root / f"nats-{steps}") as server:
        bus = await Bus.open(cfg.bus, server.url, cfg.name, "bench-controller", role="controller")
        try:
            start = time.perf_counter()
            expected = await fill(bus, cfg, sample_ids, args.discard_every)
            fill_s = time.perf_counter() - start
            runs = [await rebuild_once(bus, cfg, root / f"run-{steps}-{i}", expected) for i in range(args.repeats)]
            floor = await floor_s(bus)
        finally:
            await bus.close()
    row = {
        "steps": steps,
        "groups_per_step": args.groups_per_step,
        "messages": 1 + 3 * steps + expected["discarded"],
        "fill_s": round(fill_s, 1),
        "rebuild_wall_s": round(statistics.median(r["wall_s"] for r in runs), 3),
        "rebuild_cpu_s": round(statistics.median(r["cpu_s"] for r in runs), 3),
        "rebuild_wall_s_all": [round(r["wall_s"], 3) for r in runs],
        "read_only_floor_s": round(floor, 3),
        "record_bytes_rewritten": runs[0]["record_bytes"],
    }
    print(json.dumps(row), flush=True)
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| steps | messages | rebuild wall s (median) | rebuild CPU s | reading alone s | record rewritten |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        mb = r["record_bytes_rewritten"] / 1e6
        lines.append(
            f"| {r['steps']:,} | {r['messages']:,} | {r['rebuild_wall_s']:.2f} | {r['rebuild_cpu_s']:.2f} | "
            f"{r['read_only_floor_s']:.2f} | {mb:.1f} MB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, nargs="+", default=[1000, 10000], help="Run lengths (default 1000 10000).")
    p.add_argument("--groups-per-step", type=int, default=32, help="Groups per step (default 32).")
    p.add_argument("--discard-every", type=int, default=10, help="A re-queued discard every this many steps.")
    p.add_argument("--repeats", type=int, default=3, help="Rebuilds per run length (median reported).")
    p.add_argument("--out", help="Write the rows as JSON here.")
    args = p.parse_args(argv)
    logging.disable(logging.WARNING)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    with tempfile.TemporaryDirectory(prefix="controller-restart-") as tmp:
        rows = [asyncio.run(measure(steps, args, Path(tmp))) for steps in args.steps]
    text = markdown(rows)
    print(text)
    if args.out:
        result = {
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "rows": rows,
            "markdown": text,
            "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "load": os.getloadavg()},
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
