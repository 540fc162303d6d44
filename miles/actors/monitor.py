"""Monitor: a read-only live view of a run from any machine that reaches its NATS.

``miles top -c recipe.yaml --nats-url URL`` (or ``miles-node --role monitor``) redraws in place
every ``monitor.refresh_s``; ``--json`` prints one JSON snapshot per refresh instead, and
``--json --once`` prints a single snapshot (after about 2.5 heartbeat periods, once the METRICS
stream and the weight announcements have been replayed) and exits. ``--prometheus-port N`` (or
``monitor.prometheus_port``; 0 = any free port, logged as ``prometheus_listening``) serves the same
snapshot on ``/metrics`` (:mod:`miles.monitoring.prom` lists the families).

It publishes nothing and acks nothing: heartbeats come over core NATS; it starts from the controller's newest
snapshot (the run's totals so far, its version map and its evaluations: the steps whose reports were purged are
in it), then reads metrics and weight announcements in order from what the METRICS and EVENTS streams still hold,
by direct gets (:mod:`miles.bus.follow`); queue depths come from stream and consumer info. With the run's keys,
a signed kind without a valid signature is skipped and counted (``alarms``), never shown. The model is
:class:`miles.monitoring.state.RunState`, the view :mod:`miles.monitoring.view`.

Versions are unique ids (a trainer restart jumps them), so every lag is in lineage steps: the
announcements' ``step`` turns a version into a step.

JSON snapshot fields (``--json``; strict JSON, a non-finite metric is null):

``run``, ``time`` (unix s), ``status`` (``waiting`` | ``running`` | ``done``),
``trainer_version`` (newest policy version), ``trainer_step`` (its lineage step; null until known),
``trainer_alive``, ``max_staleness`` (the bound eta, in steps), ``steps_seen``;
``workers``: ``{actor_id: {version, step (of that version), lag (trainer_step - step; null before
the first sync), state (``engine_error`` when its engine died), age_s (since its last heartbeat),
alive, groups, tokens, tokens_per_s, groups_per_s, syncs, checksum_failures, last_pause_ms,
engine_error (bool), engine_load_failures (weight loads the engine refused), and its episodes since
it started: episodes, turns_per_episode, tool_calls, parse_errors, env_s_per_episode,
infra_errors (sandbox/verifier failures), reward_failed, truncated, output_truncated,
commands_killed, template_mismatches, length_mean (model tokens per episode),
end_reasons ({reason: n})}}``; ``worker_lag_max`` (over live workers);
``rollout_episodes``: the same episode fields summed over all workers; ``engine_errors`` (ids of
workers whose engine died); ``engine_load_failures`` (summed);
``staleness_histogram``: ``{"0": n, "1": n, ...}`` trained trajectories (groups) per staleness,
every key from 0 to max(bound, largest seen); ``staleness_mean``; ``staleness_over_bound``;
``queues``: ``prompts_waiting`` (messages in ``<run>_PROMPTS``), ``trajectories_waiting``
(``trainer`` consumer's num_pending + num_ack_pending on ``<run>_TRAJ``), ints (null until read);
``rates`` over ``window_s``: ``rollout_tokens_per_s``, ``rollout_groups_per_s`` (worker heartbeat
counters), ``trained_trajectories_per_s``, ``trained_tokens_per_s`` (step reports),
``step_tokens_per_s`` (the last step's own figure);
``reward``: ``last``, ``mean_last_n``, ``trend`` (last ``monitor.reward_points`` step means),
``sparkline``; ``last_step``: ``{step, policy_version, age_s, staleness_mean, staleness_max, ...
every metric of the step}`` (reward_mean, samples, episodes, infra_excluded, reward_failed,
truncated, groups_without_signal, length_mean/p50/p90/max, turns_mean, tool_calls, parse_errors,
env_s_mean, template_mismatches, the loss terms, grad_norm, lr, ...);
``lengths``: ``last`` ``{mean, p50, p90, max}``, ``trend`` (``[{step, mean, p50, p90, max}]``,
last ``monitor.reward_points`` steps), ``sparkline`` (of the means);
``trained``: totals over the steps seen (``miles.actors.step_totals.SUMMED``, the same fold as summary.json) of
samples, episodes, infra_excluded, reward_failed, truncated, groups_without_signal, sandbox_failures,
tool_calls, parse_errors, template_mismatches, model_tokens, stale_tokens_masked;
``discards``: ``dropped``, ``requeued``, ``duplicates`` (trainer heartbeat);
``controller``: ``{issued, discarded}``; ``dead_lettered`` (``<run>_DLQ`` size); ``refused``
(``{category: n}`` summed over the actors' heartbeats: malformed, unsigned, untrusted), ``refused_total``,
``alarms`` (lines to show in red: unsigned messages refused anywhere, held-weight mismatches);
``evals``: ``{step: accuracy}`` keyed by the steps trained into the evaluated version;
``eval_results``: ``[{step, requested_version, policy_version, accuracy, samples, failed}]``;
``eval_accuracy`` (of the highest step);
``weights``: the controller's held-weight audit ``{verified, mismatches, unverifiable, pending}``
(null before its first heartbeat; docs/weight-sync.md);
``prometheus_port`` (only when the endpoint is on).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from datetime import datetime
from typing import Any

import nats.errors
from nats.aio.msg import Msg

from miles.actors import trust
from miles.actors.base import Actor
from miles.actors.snapshots import newest_snapshot
from miles.bus.errors import BusError
from miles.bus.follow import follow, last_message
from miles.bus.schema import Heartbeat, Message, SchemaError, WeightsAnnounced, decode_any
from miles.monitoring.state import RunState
from miles.security.signing import SignatureError
from miles.training.lineage import VersionSteps, versions_kept


def _published_at(raw: Any) -> float:
    """When JetStream stored a message read by direct get (its ``Nats-Time-Stamp``), else now."""
    stamp = (raw.headers or {}).get("Nats-Time-Stamp")
    if stamp:
        with contextlib.suppress(ValueError):
            return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    return time.time()


class Monitor(Actor):
    role = "monitor"
    heartbeats = False  # read-only: a monitor publishes nothing

    def __init__(
        self,
        *args: Any,
        as_json: bool = False,
        once: bool = False,
        prometheus_port: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.as_json = as_json
        self.once = once
        mcfg = self.cfg.monitor
        self.prometheus_port = prometheus_port if prometheus_port is not None else mcfg.prometheus_port
        self.state = RunState(
            run=self.cfg.name,
            max_staleness=self.cfg.staleness.max_staleness,
            rate_window_s=mcfg.rate_window_s,
            reward_points=mcfg.reward_points,
            stale_after_s=max(5.0, 5 * self.cfg.bus.heartbeat_s),
            versions=VersionSteps(versions_kept(self.cfg.staleness.max_staleness)),
        )
        self.exporter: Any = None
        self._metrics_seq = 0
        self._weights_seq = 0

    # ------------------------------------------------------------------ inputs

    def _decoded(self, received: Any) -> Message | None:
        """A message read off the bus, decoded and (with the run's keys) verified; None to skip it. The
        monitor may not publish, so it counts what it skips instead of dead-lettering it."""
        try:
            message = decode_any(received.data)
            self.bus.check_signature(received, message.KIND)
        except SchemaError:
            return None  # the owning consumer dead-letters it
        except SignatureError:
            self.state.unverified += 1
            return None
        return message

    async def _on_heartbeat(self, msg: Msg) -> None:
        hb = self._decoded(msg)
        if isinstance(hb, Heartbeat):
            self.state.on_heartbeat(hb)

    async def _follow_metrics(self) -> None:
        s = self.bus.subjects
        async for raw in follow(
            self.bus.nc, self.bus.js, s.metrics_stream, s.metrics_all, self._finished, start="first"
        ):
            self._metrics_seq = max(self._metrics_seq, int(raw.seq or 0))
            message = self._decoded(raw)
            if message is not None:
                self.state.absorb(message, _published_at(raw))

    async def _follow_weights(self) -> None:
        """Every announcement (not just the last): a lagging worker's version needs its step too."""
        s = self.bus.subjects
        async for raw in follow(self.bus.nc, self.bus.js, s.events_stream, s.weights, self._finished, start="first"):
            self._weights_seq = max(self._weights_seq, int(raw.seq or 0))
            message = self._decoded(raw)
            if isinstance(message, WeightsAnnounced):
                self.state.on_weights(message)

    async def _poll_queues(self) -> None:
        js, s = self.bus.js, self.bus.subjects
        try:
            prompts = await js.stream_info(s.prompts_stream)
            trainer = await js.consumer_info(s.traj_stream, s.TRAINER_CONSUMER)
            dlq = await js.stream_info(s.dlq_stream)
        except nats.errors.Error as exc:  # a restarting server, a stream not created yet: keep the last values
            self.log.debug("queue_poll_failed", error=repr(exc))
            return
        self.state.set_queues(
            prompts_waiting=int(prompts.state.messages),
            trajectories_waiting=int(trainer.num_pending or 0) + int(trainer.num_ack_pending or 0),
            dead_lettered=int(dlq.state.messages),
        )

    async def _start_from_snapshot(self) -> None:
        """The run so far, as the controller's newest snapshot folded it (nothing before the first one: the
        streams then still hold the whole run). One that cannot be believed is counted and the one before taken."""
        snapshot = await newest_snapshot(self.bus)
        if snapshot is not None:
            self.state.start_from(snapshot)
            self.log.info("monitor_started_from_snapshot", steps=len(self.state.totals.steps))
        self.state.unverified += self.bus.refused["unsigned"]  # a forged snapshot, refused

    async def _metrics_last_seq(self) -> int:
        with contextlib.suppress(nats.errors.Error):
            return int((await self.bus.js.stream_info(self.bus.subjects.metrics_stream)).state.last_seq)
        return 0

    async def _weights_last_seq(self) -> int:
        """EVENTS sequence of the newest weight announcement (0: none yet, or the stream is not there)."""
        s = self.bus.subjects
        with contextlib.suppress(nats.errors.Error, BusError):
            newest = await last_message(self.bus.js, s.events_stream, s.weights)
            return int(newest.seq or 0) if newest is not None else 0
        return 0

    # ------------------------------------------------------------------ outputs

    def snapshot(self) -> dict[str, Any]:
        """Plain-data view (the --json form); see the module docstring for the fields."""
        snap = self.state.snapshot(time.time())
        if self.exporter is not None:
            snap["prometheus_port"] = self.exporter.port
        return snap

    def render(self) -> Any:
        from miles.monitoring.view import render

        return render(self.snapshot())

    def _start_exporter(self) -> None:
        if self.prometheus_port is None:
            return
        from miles.monitoring.prom import PrometheusExporter

        self.exporter = PrometheusExporter()
        port = self.exporter.start(self.prometheus_port, self.cfg.monitor.prometheus_addr)
        self.log.info(
            "prometheus_listening", port=port, url=f"http://{self.cfg.monitor.prometheus_addr}:{port}/metrics"
        )

    async def main(self) -> None:
        refresh = self.cfg.monitor.refresh_s
        self._start_exporter()
        # one subscription per role: a remote fleet's heartbeats cross a leaf link only so (Subjects.heartbeats)
        hb_subs = [
            await self.bus.nc.subscribe(subject, cb=self._on_heartbeat)
            for subject in self.bus.subjects.heartbeats(trust.ROLES)
        ]
        replay_to = await self._metrics_last_seq()
        weights_to = await self._weights_last_seq()
        await self._start_from_snapshot()
        readers = [
            asyncio.create_task(self._follow_metrics(), name="monitor.metrics"),
            asyncio.create_task(self._follow_weights(), name="monitor.weights"),
        ]
        try:
            if self.once:
                await self._run_once(replay_to, weights_to)
            elif self.as_json:
                while True:
                    await self._poll_queues()
                    self._publish(json_line=True)
                    if await self.sleep_unless_stopping(refresh):
                        break
            else:
                await self._run_live(refresh)
        finally:
            for hb_sub in hb_subs:
                with contextlib.suppress(nats.errors.Error):
                    await hb_sub.unsubscribe()
            for reader in readers:
                if reader.done():
                    reader.result()  # a reader that failed fails the monitor
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            if self.exporter is not None:
                self.exporter.stop()

    def _publish(self, json_line: bool = False) -> dict[str, Any]:
        snap = self.snapshot()
        if self.exporter is not None:
            self.exporter.update(snap)
        if json_line:
            print(json.dumps(snap), flush=True)
        return snap

    async def _run_once(self, replay_to: int, weights_to: int) -> None:
        """Collect ~2.5 heartbeat periods, the replayed metrics and announcements (at most 10 s more), print once."""
        start = time.monotonic()
        deadline = start + max(2.5 * self.cfg.bus.heartbeat_s, 1.0)
        while not self.stopping.is_set():
            now = time.monotonic()
            replayed = self._metrics_seq >= replay_to and self._weights_seq >= weights_to
            if now >= deadline and (replayed or now >= deadline + 10.0):
                break
            await asyncio.sleep(0.1)
        await self._poll_queues()
        if self.as_json:
            self._publish(json_line=True)
        else:
            from rich.console import Console

            self._publish()
            Console().print(self.render())

    async def _run_live(self, refresh: float) -> None:
        from rich.console import Console
        from rich.live import Live

        from miles.monitoring.view import render

        await self._poll_queues()
        with Live(render(self._publish()), console=Console(), auto_refresh=False, transient=False) as live:
            while not await self.sleep_unless_stopping(refresh):
                await self._poll_queues()
                live.update(render(self._publish()), refresh=True)
            live.update(render(self._publish()), refresh=True)
