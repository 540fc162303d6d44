"""``miles``: run a recipe on this machine, inspect a config, or serve a bus for a multi-process run.

miles run recipes/quickstart.yaml --run-dir runs/quickstart
miles prepare recipes/quickstart.yaml    # check the task, build the model (done by `miles run` too)
miles config recipes/quickstart.yaml --set trainer.lr=1e-3
miles bus --run-dir runs/shared          # an embedded nats-server for miles-node processes
miles top --nats-url nats://host:4222 -c recipes/quickstart.yaml   # live monitor
miles creds --run myrun --out runs/myrun/auth --hostname nats.example.org   # per-role credentials
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from miles.bus.errors import BusError
from miles.bus.urls import split_urls
from miles.config import ConfigError, RunConfig, add_override_option, dump_config, load_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles", description="Asynchronous RL post-training over NATS JetStream.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="Run a recipe: all actors on this machine.")
    run.add_argument("recipe", help="YAML recipe, e.g. recipes/quickstart.yaml.")
    run.add_argument("--run-dir", help="Run directory (default: runs/<name>).")
    add_override_option(run)
    run.add_argument(
        "--nats-url",
        help="Use this NATS server (or a cluster's nodes, comma-separated) instead of starting an embedded one "
        "(default: bus.nats_url).",
    )
    run.add_argument("--quiet", action="store_true", help="No progress output, only the summary.")

    prep = sub.add_parser(
        "prepare", help="Check the task and build the model of a recipe (on every machine of a split run)."
    )
    prep.add_argument("recipe", help="YAML recipe.")
    add_override_option(prep)

    cfg = sub.add_parser("config", help="Print the resolved config of a recipe with overrides.")
    cfg.add_argument("recipe", nargs="?", help="YAML recipe (defaults if omitted).")
    add_override_option(cfg)

    bus = sub.add_parser("bus", help="Serve an embedded nats-server with JetStream until interrupted.")
    bus.add_argument("--run-dir", default="runs/bus", help="Where the server keeps its store and log.")
    bus.add_argument("--max-payload-mb", type=int, default=8)

    top = sub.add_parser("top", help="Live view of a running run (same as miles-node --role monitor).")
    top.add_argument("--config", "-c", help="The run's recipe (for its name and bounds).")
    add_override_option(top)
    top.add_argument("--nats-url", help="The run's NATS server(s), comma-separated (default: bus.nats_url).")
    top.add_argument("--json", action="store_true", help="Print JSON snapshots instead of the live view.")
    top.add_argument("--once", action="store_true", help="Print one snapshot and exit.")
    top.add_argument(
        "--prometheus-port", type=int, metavar="PORT", help="Serve Prometheus /metrics on PORT (0: any free port)."
    )
    sub.add_parser(
        "vllm-env",
        help="Build (once) and print the python of the cached vLLM environment (rollout.engine.type: vllm).",
    )
    # Listed for --help only: main() hands everything after `creds` to its own parser (miles.security.cli).
    sub.add_parser("creds", help="Generate a run's per-role NATS credentials, TLS and signing keys (docs/security.md).")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["creds"]:
        from miles.security.cli import main_creds

        return main_creds(argv[1:])
    args = build_parser().parse_args(argv)
    from miles.logs import configure_logging

    configure_logging(json_lines=False)  # logs go to stderr: stdout carries only results (e.g. the bus URL)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "prepare":
            return _prepare(load_config(args.recipe, args.overrides))
        if args.command == "config":
            print(dump_config(load_config(args.recipe, args.overrides)), end="")
            return 0
        if args.command == "vllm-env":
            from miles.engines.vllm.env import VllmEnvError, ensure_vllm_env

            try:
                print(ensure_vllm_env())
            except VllmEnvError as exc:
                print(f"miles: error: {exc}", file=sys.stderr)
                return 1
            return 0
        if args.command == "bus":
            return asyncio.run(_serve_bus(Path(args.run_dir), args.max_payload_mb))
        if args.command == "top":
            from miles.node import main as node_main

            extra = ["--json"] * args.json + ["--once"] * args.once
            if args.prometheus_port is not None:
                extra += ["--prometheus-port", str(args.prometheus_port)]
            conf = ["--config", args.config] if args.config else []
            sets = [x for o in args.overrides for x in ("--set", o)]
            url = ["--nats-url", args.nats_url] if args.nats_url else []  # else miles-node takes bus.nats_url
            return node_main(["--role", "monitor", *url, "--run-dir", "runs/monitor", *conf, *sets, *extra])
    except ConfigError as exc:
        print(f"miles: error: {exc}", file=sys.stderr)
        return 2
    except BusError as exc:
        print(f"miles: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2


def _prepare(cfg: RunConfig) -> int:
    """Build the task and the model before anything starts; 0, or 2 with the one-line reason."""
    from miles.prepare import PrepareError, prepare

    print(f"miles: preparing task ({cfg.task.type}) and model ({cfg.model.type}) ...", file=sys.stderr)
    try:
        model_dir = prepare(cfg)
    except PrepareError as exc:
        print(f"miles: error: {exc}", file=sys.stderr)
        return 2
    print(f"miles: prepared {model_dir}", file=sys.stderr)
    return 0


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args.recipe, args.overrides)
    run_dir = Path(args.run_dir or f"runs/{cfg.name}")
    status = _prepare(cfg)  # before NATS or any actor: a bad file or reward path is one line and exit 2
    if status:
        return status
    from miles.devices import DevicePlanError
    from miles.launch import gpu_plan, run_local

    try:
        gpus = gpu_plan(cfg)  # before NATS or any actor: a run that does not fit this machine's GPUs is one line
    except DevicePlanError as exc:
        print(f"miles: error: {exc}", file=sys.stderr)
        return 2
    nats_url = args.nats_url or cfg.bus.nats_url
    if nats_url:
        try:
            split_urls(nats_url)
        except ValueError as exc:
            print(f"miles: error: --nats-url: {exc}", file=sys.stderr)
            return 2
    return asyncio.run(run_local(cfg, run_dir, nats_url, quiet=args.quiet, gpus=gpus))


async def _serve_bus(run_dir: Path, max_payload_mb: int) -> int:
    from miles.bus.server import EmbeddedNats

    async with EmbeddedNats(run_dir, max_payload=max_payload_mb * 2**20) as server:
        print(server.url, flush=True)
        print(f"miles: nats-server with JetStream at {server.url} (Ctrl-C stops it)", file=sys.stderr)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
