"""How long a restarted controller takes to rebuild its state, against the length of the run.

    python benchmarks/controller_restart.py --steps 1000 10000 100000 --out benchmarks/results/controller_restart.json

For each run length in ``--steps``, an embedded nats-server (JetStream on a temporary directory) is filled with
the streams of a synthetic run, ``--groups-per-step`` groups per step: per step the issue record
(``groups_issued``), the trainer's announcement of the new version (``weights_announced``) and its step report
(``step_metrics``), and a discard (``groups_discarded``, re-queued) every ``--discard-every`` steps; version 0 is
announced first.

1. The streams of all but the last ``--tail`` steps are written. A fresh
   :class:`~miles.actors.controller.Controller` on that bus (its own task, sample order, evaluations and run
   record, as in ``Controller.main``) runs its real restart path, ``_rebuild``, with no snapshot on the bus: it
   replays every message (timed once: "without a snapshot"). It then cuts and writes a snapshot, as it does
   every ``bus.snapshot_every_steps`` steps of a live run.
2. The last ``--tail`` steps are written (default: one less than the snapshot interval, the most a restart can
   find after the newest snapshot). A fresh controller runs ``_rebuild`` ``--repeats`` times (the same run
   directory: each restart cuts the record files back to the snapshot's sizes and writes the tail again):
   "with a snapshot", the restart of a live run.

Checked after every rebuild: nothing refused, every group issued, trained or discarded as the streams say, and
the issue count the admission would go on from. Reported per run length: wall and CPU seconds of both rebuilds
(median for the restart), and the bytes of the run record each rewrote (``groups.jsonl`` and ``metrics.jsonl``).
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
from miles.bus.schema import GroupsDiscarded, GroupsIssued, StepMetrics, WeightsAnnounced, encode
from miles.bus.server import EmbeddedNats
from miles.config import RunConfig, load_config

PIPELINE = 512  # publishes in flight while filling the streams
RECORD_FILES = ("groups.jsonl", "metrics.jsonl")
EMPTY = {"issued": 0, "discarded": 0, "trained": 0, "discards_seq": 0}


def config(groups_per_step: int, steps: int) -> RunConfig:
    sets = {
        "name": "restart",
        "trainer.groups_per_step": groups_per_step,
        "trainer.steps": steps,
        "eval.every": steps,  # no evaluation falls due inside the replayed run
    }
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


async def fill(
    bus: Bus, cfg: RunConfig, sample_ids: list[str], discard_every: int, steps: range, held: dict[str, int]
) -> dict[str, int]:
    """Append ``steps`` of a run to the streams, which hold ``held`` (the expected fold) so far; returns what
    they hold then."""
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

    if steps.start == 0:
        await bus.publish(s.weights, announcement(0), msg_id="v0")
    issued, discarded, discards_seq = held["issued"], held["discarded"], held["discards_seq"]
    for step in steps:
        first = issued
        ids = [sample_ids[(first + i) % len(sample_ids)] for i in range(per_step)]
        # The state once the batch is out has folded the discards before it (as the controller's records do).
        batch = GroupsIssued(
            first_index=first,
            sample_ids=ids,
            attempts=[0] * per_step,
            issued_at_version=step,
            cursor=first + per_step,
            discards_seq=discards_seq,
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
            discards_seq = (await bus.publish(s.discarded, message, msg_id=f"discard-{step}")).seq
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
    return {"issued": issued, "discarded": discarded, "trained": issued - discarded, "discards_seq": discards_seq}


def controller_on(bus: Bus, cfg: RunConfig, run_dir: Path) -> Any:
    """A fresh controller on ``bus``, set up as ``Controller.main`` sets it up before its rebuild."""
    from miles.actors.admission import SampleOrder
    from miles.actors.controller import Controller
    from miles.actors.evaluations import EvalCoordinator
    from miles.tasks.registry import build_task

    controller = Controller(cfg, bus, run_dir)
    controller.bus.refused.clear()  # the bus is shared by every controller of this script
    controller.bus.dead_lettered = 0
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
    return controller


async def rebuild_once(controller: Any, expected: dict[str, int], kept_bytes: int = 0) -> dict[str, Any]:
    """Time ``controller``'s rebuild and check what it folded; ``kept_bytes`` of the record are the snapshot's."""
    wall, cpu = time.perf_counter(), time.process_time()
    await controller._rebuild()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    controller.record.close()
    got = {
        "issued": controller.state.issued,
        "discarded": controller.state.discarded,
        "trained": controller.record.totals.groups,
    }
    refused = dict(controller.bus.refused)
    if got != {key: expected[key] for key in got} or any(refused.values()):
        raise RuntimeError(f"the rebuild folded {got} with refusals {refused}; the streams hold {expected}")
    return {"wall_s": wall, "cpu_s": cpu, "record_bytes": record_bytes(controller.run_dir) - kept_bytes}


def record_bytes(run_dir: Path) -> int:
    return sum((run_dir / name).stat().st_size for name in RECORD_FILES)


async def measure(steps: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    cfg = config(args.groups_per_step, steps)
    from miles.tasks.registry import build_task

    sample_ids = [sample.id for sample in build_task(cfg.task, sandbox=cfg.rollout.sandbox).samples("train")]
    tail = min(args.tail if args.tail is not None else cfg.bus.snapshot_every_steps - 1, steps - 1)
    run_dir = root / f"run-{steps}"
    async with EmbeddedNats(root / f"nats-{steps}") as server:
        bus = await Bus.open(cfg.bus, server.url, cfg.name, "bench-controller", role="controller")
        try:
            start = time.perf_counter()
            held = await fill(bus, cfg, sample_ids, args.discard_every, range(steps - tail), EMPTY)
            fill_s = time.perf_counter() - start
            # 1. no snapshot on the bus: the whole run is replayed; then the snapshot a live run would write
            controller = controller_on(bus, cfg, run_dir)
            full = await rebuild_once(controller, held)
            async with controller.gate.quiet():
                snapshot = controller._snapshot()
            await controller._write_snapshot(snapshot)
            kept = sum(snapshot.record.file_sizes[name] for name in RECORD_FILES)
            # 2. the tail after it, and the restarts
            expected = await fill(bus, cfg, sample_ids, args.discard_every, range(steps - tail, steps), held)
            os.sync()  # the full replay's record (up to 678 MB) on disk: the restarts' cuts wait on no writeback
            runs = []
            for _ in range(args.repeats):
                controller = controller_on(bus, cfg, run_dir)
                runs.append(await rebuild_once(controller, expected, kept))
                if controller.snapshots["restored_from_step"] != steps - tail:
                    raise RuntimeError(f"restored from step {controller.snapshots['restored_from_step']}")
        finally:
            await bus.close()
    row = {
        "steps": steps,
        "groups_per_step": args.groups_per_step,
        "messages": 1 + 3 * steps + expected["discarded"],
        "steps_after_snapshot": tail,
        "snapshot_bytes": len(encode(snapshot)),
        "fill_s": round(fill_s, 1),
        "full_replay_wall_s": round(full["wall_s"], 3),
        "full_replay_cpu_s": round(full["cpu_s"], 3),
        "full_replay_record_bytes": full["record_bytes"],
        "restart_wall_s": round(statistics.median(r["wall_s"] for r in runs), 3),
        "restart_cpu_s": round(statistics.median(r["cpu_s"] for r in runs), 3),
        "restart_wall_s_all": [round(r["wall_s"], 3) for r in runs],
        "restart_record_bytes": runs[0]["record_bytes"],
    }
    print(json.dumps(row), flush=True)
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| steps | messages | without a snapshot: wall s, CPU s, record rewritten | with a snapshot (steps after it): "
        "wall s (median), CPU s, record rewritten | snapshot |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['steps']:,} | {r['messages']:,} | {r['full_replay_wall_s']:.2f}, {r['full_replay_cpu_s']:.2f}, "
            f"{r['full_replay_record_bytes'] / 1e6:.1f} MB | "
            f"({r['steps_after_snapshot']}) **{r['restart_wall_s']:.3f}**, "
            f"{r['restart_cpu_s']:.3f}, {r['restart_record_bytes'] / 1e3:.0f} kB | {r['snapshot_bytes'] / 1e3:.1f} kB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--steps", type=int, nargs="+", default=[1000, 10000, 100000], help="Run lengths (default 1000 10000 100000)."
    )
    p.add_argument("--groups-per-step", type=int, default=32, help="Groups per step (default 32).")
    p.add_argument("--discard-every", type=int, default=10, help="A re-queued discard every this many steps.")
    p.add_argument("--repeats", type=int, default=3, help="Restarts per run length (median reported).")
    p.add_argument(
        "--tail", type=int, help="Steps stored after the snapshot (default: bus.snapshot_every_steps - 1, the most)."
    )
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
