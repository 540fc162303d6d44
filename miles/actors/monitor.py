"""Monitor: a read-only live view of a run from any machine that reaches its NATS.

It never publishes work and never acks anything: heartbeats come over core NATS, metrics are
replayed from the METRICS stream with an ephemeral ordered consumer.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from miles.actors.base import Actor
from miles.bus.schema import EvalResult, Heartbeat, SchemaError, StepMetrics, decode_any


class Monitor(Actor):
    role = "monitor"

    def __init__(self, *args: Any, as_json: bool = False, once: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.as_json = as_json
        self.once = once
        self.actors: dict[str, Heartbeat] = {}
        self.last_step: StepMetrics | None = None
        self.evals: dict[int, float] = {}
        self.staleness_hist: dict[int, int] = {}

    async def main(self) -> None:
        hb_sub = await self.bus.nc.subscribe(self.bus.subjects.heartbeat("*", "*"))
        metrics_sub = await self.bus.js.subscribe(self.bus.subjects.metrics_all, ordered_consumer=True)
        console = Console()
        deadline = time.monotonic() + 2.5 * self.cfg.bus.heartbeat_s
        try:
            with Live(
                self.render(), console=console, refresh_per_second=2, auto_refresh=not (self.as_json or self.once)
            ) as live:
                while not self.stopping.is_set():
                    await self._drain(hb_sub, metrics_sub)
                    if self.once and time.monotonic() >= deadline:
                        break
                    if self.as_json and not self.once:
                        print(json.dumps(self.snapshot()), flush=True)
                    elif not self.as_json:
                        live.update(self.render())
                    await self.sleep_unless_stopping(0.5 if self.once else self.cfg.bus.heartbeat_s)
                if self.once:
                    if self.as_json:
                        print(json.dumps(self.snapshot()), flush=True)
                    else:
                        live.update(self.render())
        finally:
            await hb_sub.unsubscribe()
            await metrics_sub.unsubscribe()

    async def _drain(self, *subs: Any) -> None:
        for sub in subs:
            while True:
                try:
                    msg = await sub.next_msg(timeout=0.01)
                except asyncio.TimeoutError:
                    break
                try:
                    message = decode_any(msg.data)
                except SchemaError:
                    continue  # read-only: the owning consumer dead-letters it
                self._absorb(message)

    def _absorb(self, message: Any) -> None:
        if isinstance(message, Heartbeat):
            self.actors[message.actor_id] = message
        elif isinstance(message, StepMetrics):
            self.last_step = message
            for lag in message.staleness:
                self.staleness_hist[lag] = self.staleness_hist.get(lag, 0) + 1
        elif isinstance(message, EvalResult):
            self.evals[message.policy_version] = message.accuracy

    def trainer_version(self) -> int:
        return max((hb.version for hb in self.actors.values() if hb.role == "trainer"), default=0)

    def snapshot(self) -> dict[str, Any]:
        """Plain-data view (the --json form)."""
        v = self.trainer_version()
        now = time.time()
        workers = {
            hb.actor_id: {
                "version": hb.version,
                "lag": v - hb.version if hb.version >= 0 else None,
                "age_s": round(now - hb.ts, 2),
                **hb.stats,
            }
            for hb in self.actors.values()
            if hb.role == "rollout"
        }
        step = self.last_step
        return {
            "run": self.cfg.name,
            "trainer_version": v,
            "max_staleness": self.cfg.staleness.max_staleness,
            "workers": workers,
            "staleness_histogram": {str(k): n for k, n in sorted(self.staleness_hist.items())},
            "last_step": None if step is None else {"step": step.step, **step.metrics},
            "evals": {str(k): a for k, a in sorted(self.evals.items())},
        }

    def render(self) -> Table:
        snap = self.snapshot()
        table = Table(
            title=f"miles run {snap['run']}: trainer version {snap['trainer_version']} "
            f"(max staleness {snap['max_staleness']})"
        )
        for col in ("worker", "version", "lag", "groups", "tokens", "last seen"):
            table.add_column(col)
        for wid, w in sorted(snap["workers"].items()):
            table.add_row(
                wid,
                str(w["version"]),
                str(w["lag"]),
                str(int(w.get("groups", 0))),
                str(int(w.get("tokens", 0))),
                f"{w['age_s']:.1f}s ago",
            )
        step = snap["last_step"]
        if step:
            table.caption = (
                f"step {step['step']}: reward {step.get('reward_mean', 0):.3f}, "
                f"{step.get('tokens_per_s', 0):.0f} tok/s; staleness histogram "
                f"{snap['staleness_histogram']}"
            )
        return table
