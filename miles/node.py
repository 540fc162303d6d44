"""``miles-node --role ROLE``: one actor process of a run (controller, rollout, trainer, monitor, teacher), or setup.

Config is parsed before torch is imported, so ``--help`` and config errors are instant.
Examples (one nats-server reachable at $NATS)::

    miles-node --role controller --config recipes/quickstart.yaml --run-dir runs/q --nats-url $NATS
    miles-node --role rollout    --config recipes/quickstart.yaml --run-dir runs/q --nats-url $NATS --actor-id w0
    miles-node --role trainer    --config recipes/quickstart.yaml --run-dir runs/q --nats-url $NATS \\
        --rank 0 --world-size 2 --master-addr 10.0.0.5 --master-port 29500
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.bus.urls import split_urls
from miles.config import ConfigError, RunConfig, add_override_option, load_config

if TYPE_CHECKING:  # keep `miles-node --help` free of torch and nats imports
    from miles.actors.base import Actor
    from miles.bus.client import Bus
    from miles.training.rank_worker import RankWorker

ROLES = ("controller", "rollout", "trainer", "monitor", "teacher", "setup")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles-node", description="Run one Miles actor process.")
    p.add_argument(
        "--role",
        required=True,
        choices=ROLES,
        help="Which actor this process runs; setup: create the run's streams and buckets once, then exit.",
    )
    p.add_argument("--config", "-c", help="YAML recipe (defaults if omitted).")
    add_override_option(p)
    p.add_argument("--run-dir", default="runs/default", help="Run directory (logs, checkpoints, metrics).")
    p.add_argument(
        "--nats-url",
        default=os.environ.get("NATS_URL"),
        help="NATS server to join, or a cluster's nodes comma-separated (default: $NATS_URL, then bus.nats_url).",
    )
    p.add_argument("--actor-id", help="Unique id of this actor (default: role-hostname-pid).")
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)), help="Trainer rank.")
    p.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)), help="Trainer ranks.")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"), help="Rank-0 address.")
    p.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT", 29500)), help="Rank-0 port.")
    p.add_argument(
        "--weight-group-rank",
        type=int,
        default=None,
        help="rollout, with sync.transport broadcast: this worker's rank in the weight-update group (1..workers).",
    )
    p.add_argument(
        "--gpu",
        type=int,
        default=None,
        help="rollout: this machine's GPU for a torch engine whose rollout.engine.device is 'cuda' without an "
        "index (default 0; `miles run` gives each worker a GPU after the trainer ranks', docs/deploy.md).",
    )
    p.add_argument("--json", action="store_true", help="monitor: print JSON snapshots instead of a live view.")
    p.add_argument("--once", action="store_true", help="monitor: print one snapshot and exit.")
    p.add_argument(
        "--prometheus-port",
        type=int,
        default=None,
        metavar="PORT",
        help="monitor: serve Prometheus /metrics on PORT (0: any free port; default: monitor.prometheus_port).",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """``miles-node``: run one actor until it ends; returns the exit status."""
    code = _main(argv)
    if _leave_without_static_destructors:
        # A trainer process has finished and left its process group: skip torch's static destructors.
        from miles.backends.distributed import exit_skipping_teardown

        exit_skipping_teardown(code)
    return code


_leave_without_static_destructors = False


def _main(argv: list[str] | None) -> int:
    global _leave_without_static_destructors
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"miles-node: error: {exc}", file=sys.stderr)
        return 2
    args.nats_url = args.nats_url or cfg.bus.nats_url
    if not args.nats_url:
        print(
            "miles-node: error: --nats-url (or $NATS_URL, or bus.nats_url) is required; `miles run` starts an "
            "embedded server",
            file=sys.stderr,
        )
        return 2
    try:
        split_urls(args.nats_url)
    except ValueError as exc:
        print(f"miles-node: error: --nats-url: {exc}", file=sys.stderr)
        return 2
    actor_id = args.actor_id or f"{args.role}-{socket.gethostname()}-{os.getpid()}"
    if args.role == "trainer" and args.world_size > 1:
        actor_id = f"{actor_id}-r{args.rank}" if args.actor_id else actor_id

    from miles.logs import configure_logging

    configure_logging()
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    from miles.backends.registry import BackendUnavailable
    from miles.bus.errors import BusError
    from miles.models.loading import ModelNotFoundError, ModelNotPrepared
    from miles.training.teacher import TeacherError

    if args.role == "setup":
        return _setup(cfg, args.nats_url)
    if args.role == "rollout" and cfg.rollout.engine.type == "torch":
        cfg = _pin_engine_device(cfg, args.gpu)
    try:
        worker = _build_rank_worker(cfg, args, run_dir) if args.role == "trainer" else None
        scoring = _build_teacher_scoring(cfg) if args.role == "teacher" else None
    except (BackendUnavailable, ModelNotFoundError, ModelNotPrepared, TeacherError) as exc:
        print(f"miles-node: error: {exc}", file=sys.stderr)
        return 2
    try:
        if worker is not None and args.rank > 0:
            from miles.actors.trainer_ranks import follow_leader
            from miles.heap import freeze_startup_heap

            freeze_startup_heap()  # imports and the model: never walked by the collector again
            follow_leader(worker)
            return 0
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:  # pragma: no cover - non-POSIX
            runner = asyncio.run
        try:
            return runner(_run_actor(cfg, args, actor_id, run_dir, worker, scoring))
        except Exception as exc:  # an actor's tasks fail as an exception group: find the bus error in it
            bus_error = _bus_error(exc, BusError)
            if bus_error is None:
                raise
            print(f"miles-node: error: {bus_error}", file=sys.stderr)
            return 1
    finally:
        if worker is not None:
            from miles.backends.distributed import destroy_distributed

            destroy_distributed()  # a process that exits with a live gloo group aborts in its destructor
            _leave_without_static_destructors = True


async def _run_actor(
    cfg: RunConfig,
    args: argparse.Namespace,
    actor_id: str,
    run_dir: Path,
    worker: RankWorker | None,
    scoring: Any = None,
) -> int:
    from miles.bus.client import Bus
    from miles.heap import freeze_startup_heap

    bus = await Bus.open(cfg.bus, args.nats_url, cfg.name, actor_id, role=args.role)
    try:
        actor = _build_actor(cfg, args, bus, run_dir, worker, scoring)
        freeze_startup_heap()  # imports, a trainer's or teacher's model: never walked by the collector again
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, actor.request_stop, f"signal {sig.name}")
        await actor.run()
    finally:
        await bus.close()
    return 0


def _bus_error(exc: BaseException, kind: type[Exception]) -> Exception | None:
    """``exc`` itself if it is a ``kind`` (a :class:`BusError`), else the first one inside its exception group."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _bus_error(inner, kind)) is not None:
                return found
    return None


def _setup(cfg: RunConfig, nats_url: str) -> int:
    from miles.bus.errors import BusError
    from miles.bus.setup import setup_run

    try:
        asyncio.run(setup_run(cfg.bus, nats_url, cfg.name))
    except BusError as exc:
        print(f"miles-node: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _build_actor(
    cfg: RunConfig, args: argparse.Namespace, bus: Bus, run_dir: Path, worker: RankWorker | None, scoring: Any = None
) -> Actor:
    if args.role == "controller":
        from miles.actors.controller import Controller

        return Controller(cfg, bus, run_dir)
    if args.role == "rollout":
        from miles.actors.rollout import RolloutWorker

        _limit_threads(cfg.rollout.engine.threads if cfg.rollout.engine.type == "torch" else None)
        return RolloutWorker(cfg, bus, run_dir, weight_group_rank=args.weight_group_rank)
    if args.role == "monitor":
        from miles.actors.monitor import Monitor

        return Monitor(cfg, bus, run_dir, as_json=args.json, once=args.once, prometheus_port=args.prometheus_port)
    if args.role == "teacher":
        from miles.actors.teacher import TeacherActor

        return TeacherActor(cfg, bus, run_dir, scoring=scoring)
    from miles.actors.trainer import TrainerLeader
    from miles.actors.trainer_ranks import LeaderRanks

    assert worker is not None
    return TrainerLeader(cfg, bus, run_dir, ranks=LeaderRanks(worker))


def _pin_engine_device(cfg: RunConfig, gpu: int | None) -> RunConfig:
    """The config with this worker's engine device resolved (a bare 'cuda' gets ``--gpu``), pinned before the
    engine loads its model or the worker joins a weight-update group (NCCL binds to the current device)."""
    from miles.devices import pin, process_device

    engine = cfg.rollout.engine
    device = process_device(engine.device, gpu)
    pin(device)
    if device == engine.device:
        return cfg
    rollout = cfg.rollout.model_copy(update={"engine": engine.model_copy(update={"device": device})})
    return cfg.model_copy(update={"rollout": rollout})


def _limit_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def _build_teacher_scoring(cfg: RunConfig) -> Any:
    """A teacher actor's scoring engine, its teacher checked against the student (before the bus)."""
    from miles.actors.teacher import build_teacher_scoring

    _limit_threads(1)
    return build_teacher_scoring(cfg)


def _build_rank_worker(cfg: RunConfig, args: argparse.Namespace, run_dir: Path) -> RankWorker:
    """Join torch.distributed, load the prepared policy into the backend, and wrap it for this rank."""
    from miles.backends.registry import build_backend
    from miles.training.rank_worker import RankWorker

    if cfg.trainer.backend.type == "fsdp":
        _limit_threads(cfg.trainer.backend.threads)
    backend, pad_id = build_backend(
        cfg, rank=args.rank, world_size=args.world_size, master_addr=args.master_addr, master_port=args.master_port
    )
    return RankWorker(backend, cfg, run_dir, pad_id=pad_id)


if __name__ == "__main__":
    sys.exit(main())
