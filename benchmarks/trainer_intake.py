"""Whether the trainer's step time includes its intake: the real trainer loop on large synthetic batches.

    python benchmarks/trainer_intake.py --groups 512 --group-size 16 --tokens 2000 --train-s 4 --steps 4 \
        --out benchmarks/results/trainer_intake.json

An embedded nats-server is filled with ``--steps`` x ``--groups`` trajectories of ``--group-size`` episodes of
``--tokens`` tokens each (with their tickets, on an open bus). Then the real
:class:`~miles.actors.trainer.TrainerLeader` runs its loop over them: pull, decode, check, classify, build the
batch, "train", publish the step report, ack. Two parts are stand-ins, and say what the trainer's CPU sees of
them on a GPU: the update is a wait of ``--train-s`` seconds on the rank thread (a GPU step holds no Python
lock), and the weight export publishes nothing. ``step_s`` is the trainer's own figure: from the end of one
step to the end of the next, so it includes whatever intake is not overlapped with training.

Beside it, in the same process: the intake alone, decoding and checking one batch as the trainer does
(msgpack and schema, the ticket, the trust checks), on this thread. Run it on another tree to compare
(``PYTHONPATH=<tree> python benchmarks/trainer_intake.py ...`` from that tree).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import structlog

from miles.actors import trust
from miles.bus.client import KEY_GROUPS_ISSUED, Bus
from miles.bus.follow import stored_messages
from miles.bus.schema import Episode, PromptGroup, StepMetrics, Trajectory, decode, encode
from miles.bus.server import EmbeddedNats
from miles.config import RunConfig, load_config

PIPELINE = 64  # publishes in flight while filling the stream


def config(args: argparse.Namespace) -> RunConfig:
    sets = {
        "name": "intake",
        "bus.secure": False,
        "trainer.groups_per_step": args.groups,
        "trainer.steps": args.steps,
        "rollout.group_size": args.group_size,
        "staleness.max_staleness": args.steps + 1,  # nothing is stale: every group is trained
        "eval.every": args.steps,
    }
    return load_config(args.recipe, [f"{k}={v}" for k, v in sets.items()])


def group(index: int, episodes: list[Episode], group_size: int) -> bytes:
    """One encoded trajectory with its ticket (the same episodes under another group id)."""
    ticket = PromptGroup(
        group_id=f"g{index}", sample_id=f"s{index}", prompt="p", answer="a", group_size=group_size,
        issue_index=index, issued_at_version=0,
    )  # fmt: skip
    traj = Trajectory(
        group_id=f"g{index}", sample_id=f"s{index}", worker_id="w", episodes=episodes, issued_at_version=0,
        gen_s=1.0, ticket=encode(ticket),
    )  # fmt: skip
    return encode(traj)


def episodes(group_size: int, tokens: int, vocab: int) -> list[Episode]:
    prompt = [i % vocab for i in range(64)]
    ids = [(7 * i + 3) % vocab for i in range(tokens)]
    return [
        Episode(
            prompt_ids=prompt,
            token_ids=ids,
            loss_mask=[1] * tokens,
            logprobs=[-1.25] * tokens,
            turns=[(0, tokens, "model")],
            weight_version=0,
            reward=float(e % 2),
            status="ok",
            end_reason="done",
        )  # fmt: skip
        for e in range(group_size)
    ]


class StandInWorker:
    """The rank's side: the update is a wait on the rank thread (a GPU step holds no Python lock)."""

    world_size = 1

    def __init__(self, train_s: float) -> None:
        self.train_s = train_s
        self.backend = SimpleNamespace(dp_size=1)
        self.checkpoints = SimpleNamespace(due=lambda step: False, oldest_extra=lambda: None)

    def restore(self) -> None:
        return None

    def train(self, plan: Any) -> dict[str, float]:
        time.sleep(self.train_s)
        return {}

    def poll_checkpoint(self) -> None:
        return None

    def save_checkpoint(self, step: int, extra: Any) -> None:
        return None

    def close(self) -> None:
        return None


class StandInSender:
    """The export: nothing is published (the benchmark is about intake)."""

    async def connect(self, first_start: bool) -> None:
        return None

    async def stored_versions(self) -> list[int]:
        return []

    async def publish(self, version: int, lineage: Any) -> Any:
        return SimpleNamespace(seq=0)


async def fill(bus: Bus, cfg: RunConfig, args: argparse.Namespace, vocab: int) -> int:
    eps = episodes(args.group_size, args.tokens, vocab)
    total = args.steps * args.groups
    pending: set[asyncio.Task[Any]] = set()
    size = 0
    for index in range(total):
        data = group(index, eps, args.group_size)
        size = len(data)
        while len(pending) >= PIPELINE:
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.create_task(bus.js.publish(bus.subjects.traj, data))
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.gather(*pending)
    await bus.put_int(KEY_GROUPS_ISSUED, total)
    return size


def intake_alone(data: list[bytes], vocab: int) -> float:
    """Seconds to decode and check one batch as the trainer does, on this thread."""
    start = time.perf_counter()
    for raw in data:
        traj = decode(raw, Trajectory)
        ticket = decode(traj.ticket, PromptGroup)
        refusal = trust.trajectory_refusal(traj, ticket, vocab_size=vocab, issued=10**9, newest=0)
        assert refusal is None, refusal
    return time.perf_counter() - start


async def measure(args: argparse.Namespace, cfg: RunConfig, vocab: int, work: Path) -> dict[str, Any]:
    import miles.actors.trainer as trainer_module
    from miles.actors.trainer_ranks import LeaderRanks

    async with EmbeddedNats(work / "bus", max_payload=64 * 1024 * 1024) as server:
        bus = await Bus.open(cfg.bus, server.url, cfg.name, "trainer-0", role="trainer")
        try:
            start = time.perf_counter()
            size = await fill(bus, cfg, args, vocab)
            fill_s = time.perf_counter() - start
            batch = [group(i, episodes(args.group_size, args.tokens, vocab), args.group_size) for i in range(8)]
            alone_s = intake_alone(batch, vocab) / len(batch) * args.groups

            async def no_sender(*_: Any) -> StandInSender:
                return StandInSender()

            trainer_module.build_sender = no_sender  # type: ignore[assignment]
            leader = trainer_module.TrainerLeader(
                cfg,
                bus,
                work / "run",
                ranks=LeaderRanks(StandInWorker(args.train_s)),  # type: ignore[arg-type]
            )
            (work / "run").mkdir(parents=True, exist_ok=True)
            start = time.perf_counter()
            await leader.run()
            loop_s = time.perf_counter() - start
            reports = [
                decode(raw.data, StepMetrics)
                async for raw in stored_messages(bus.js, bus.subjects.metrics_stream, bus.subjects.step)
            ]
        finally:
            await bus.close()
    trained = sorted(int(g[1:]) for r in reports for g in r.trained_group_ids)
    if trained != list(range(args.steps * args.groups)) or bus.dead_lettered:
        raise SystemExit(f"trainer_intake: not every group trained once ({len(trained)}), {bus.refused} refused")
    steps = [r.metrics["step_s"] for r in sorted(reports, key=lambda r: r.step)]
    later = steps[1:]  # the first also holds the start-up (the first pulls, a version-0 announcement)
    return {
        "groups": args.groups,
        "group_size": args.group_size,
        "tokens": args.tokens,
        "train_s": args.train_s,
        "group_bytes": size,
        "fill_s": round(fill_s, 1),
        "intake_alone_s_per_batch": round(alone_s, 3),
        "step_s": [round(s, 3) for s in steps],
        "step_s_median_after_first": round(statistics.median(later), 3) if later else None,
        "step_s_over_train_s": round(statistics.median(later) / args.train_s, 3) if later else None,
        "loop_s": round(loop_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/quickstart.yaml", help="Base recipe (default: %(default)s).")
    p.add_argument("--groups", type=int, default=512, help="Groups per step (default 512).")
    p.add_argument("--group-size", type=int, default=16, help="Episodes per group (default 16).")
    p.add_argument("--tokens", type=int, default=2000, help="Generated tokens per episode (default 2000).")
    p.add_argument("--train-s", type=float, default=4.0, help="The stand-in update's seconds (default 4).")
    p.add_argument("--steps", type=int, default=4, help="Steps (default 4; the first is not counted).")
    p.add_argument("--out", help="Write the result JSON here.")
    args = p.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and up
    from miles.models.loading import vocab_size
    from miles.prepare import prepare_model

    cfg = config(args)
    vocab = vocab_size(prepare_model(cfg))  # the model the trainer reads its vocabulary from (built once, cached)
    with tempfile.TemporaryDirectory(prefix="trainer-intake-") as tmp:
        result = asyncio.run(measure(args, cfg, vocab, Path(tmp)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result |= {"commit": commit, "python": platform.python_version(), "cpus": os.cpu_count(), "argv": sys.argv[1:]}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
