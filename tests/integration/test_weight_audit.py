"""The controller's weight audit over a real nats-server: the Controller actor, in process, on uvloop.

The trainer side (an announcement carrying the state digest of an FP8 rollout state) and the worker
side (``weights_held`` reports: one holding exactly that state, one holding it with a single bit
flipped, plus garbage and a wrong kind on the same subject) are published by hand; the controller
must count one verified and one mismatch, dead-letter the rest, show the counters in its heartbeat
and write them to summary.json at the end of the run. The controller owns held-out evaluation (the first
version's and the last one's), so the peer also answers its evaluation shards, as rollout workers would.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from miles.actors.controller import Controller
from miles.bus.client import Bus
from miles.bus.schema import EvalShardResult, EvalTask, Heartbeat, TrainerDone, WeightsAnnounced, WeightsHeld, decode
from miles.config import load_config
from miles.sync.precision import state_digest, to_rollout_state
from miles.sync.transport.dataplane import WeightStore

from .sync_helpers import until

RUN = "audit"


@pytest.fixture
async def peer(nats_server: str) -> AsyncIterator[Bus]:
    """Plays trainer and rollout workers."""
    handle = await Bus.open(load_config(None, [f"name={RUN}"]).bus, nats_server, RUN, "peer")
    yield handle
    await handle.close()


async def _answer_evaluations(bus: Bus, stop: asyncio.Event) -> list[EvalTask]:
    """Play the rollout workers' side of the controller's evaluations: take every shard from the work queue
    and report it scored (all samples right); returns the shards answered."""
    s = bus.subjects
    sub = await bus.js.pull_subscribe_bind(durable=s.ROLLOUT_EVAL_CONSUMER, stream=s.evalq_stream)
    answered: list[EvalTask] = []
    try:
        while not stop.is_set():
            try:
                (msg,) = await sub.fetch(1, timeout=0.2)
            except asyncio.TimeoutError:
                continue
            work = await bus.accept(msg, EvalTask)
            assert work is not None
            result = EvalShardResult(
                eval_id=work.eval_id,
                shard=work.shard,
                worker_id="rollout-0",
                version=work.version,
                samples=len(work.samples),
                reward_sum=float(len(work.samples)),
                claim=work.claim,
            )
            await bus.publish(s.eval_results, result)
            await msg.ack()
            answered.append(work)
    finally:
        await sub.unsubscribe()
    return answered


def _published_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    model = {
        "model.embed_tokens.weight": torch.randn(16, 32, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 64, generator=g),
        "model.norm.weight": torch.ones(32),
    }
    return to_rollout_state(model, "fp8_e4m3")


async def test_controller_flags_a_worker_holding_other_weights(nats_server: str, peer: Bus, tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            f"name={RUN}",
            "task.train_size=20",
            "task.eval_size=4",
            "trainer.steps=2",
            "monitor.plots=false",
            "bus.heartbeat_s=0.2",
            "eval.final_timeout_s=0.5",  # no rollout worker here plays the final evaluation
            # the controller publishes the model's tokenizer and config in the run info: a small one, built here
            f"model.cache_dir={tmp_path / 'models'}",
            "model.hidden_size=16",
            "model.num_layers=1",
            "model.num_heads=2",
            "model.warmup_steps=1",
        ],
    )
    from miles.prepare import prepare

    await asyncio.to_thread(prepare, cfg)
    s = peer.subjects
    published = _published_state()
    digest = state_digest(published)
    held_wrong = dict(published)
    name = "model.layers.0.mlp.down_proj.weight"
    held_wrong[name] = published[name].clone()
    held_wrong[name].view(torch.uint8)[0, 0] ^= 0x01  # one bit of one fp8 code
    wrong = state_digest(held_wrong)
    assert wrong != digest

    beats: list[Heartbeat] = []

    async def on_heartbeat(msg: object) -> None:
        beats.append(decode(msg.data, Heartbeat))  # type: ignore[attr-defined]

    await peer.nc.subscribe(s.heartbeat("controller", "*"), cb=on_heartbeat)

    async def worker_heartbeats(stop: asyncio.Event) -> None:  # the two workers are alive
        while not stop.is_set():
            for wid in ("rollout-0", "rollout-1"):
                await peer.emit(s.heartbeat("rollout", wid), Heartbeat(role="rollout", actor_id=wid, version=1))
            await asyncio.sleep(0.1)

    # The payload is in the data plane (the controller believes no announcement without it).
    info = await (await WeightStore.create(peer.js, RUN)).put(1, b"payload bytes")

    # A report that overtakes its announcement, then garbage and a wrong kind on the same subject.
    await peer.publish(s.weights_held, WeightsHeld(worker_id="rollout-0", version=1, state_digest=digest, mode="full"))
    await peer.js.publish(s.weights_held, b"\xc1 not msgpack")
    await peer.publish(s.weights_held, Heartbeat(role="rollout", actor_id="rollout-9"))

    bus = await Bus.open(cfg.bus, nats_server, RUN, "controller", role="controller")
    controller = Controller(cfg, bus, tmp_path / "run")
    evaluated = asyncio.Event()
    beating = asyncio.create_task(worker_heartbeats(evaluated))
    task = asyncio.create_task(controller.run())
    evaluator = asyncio.create_task(_answer_evaluations(peer, evaluated))
    try:
        await until(lambda: {"rollout-0", "rollout-1"} <= controller.live_workers())
        announced = WeightsAnnounced(
            version=1,
            step=2,
            digest=info.digest,
            size=info.size,
            chunks=info.chunks,
            state_digest=digest,
            precision="fp8_e4m3",
        )
        await peer.publish(s.weights, announced)
        await peer.publish(
            s.weights_held,
            WeightsHeld(worker_id="rollout-1", version=1, state_digest=wrong, mode="delta", fetch_bytes=10),
        )
        audit = controller.audit
        await until(lambda: audit.verified + audit.mismatches == 2)
        assert (audit.verified, audit.mismatches, audit.unverifiable) == (1, 1, 0)
        assert audit.last_verified == {"rollout-0": 1}
        [mismatch] = audit.recent_mismatches
        assert (mismatch.worker_id, mismatch.version, mismatch.expected, mismatch.got) == (
            "rollout-1",
            1,
            (digest,),
            wrong,
        )
        await _until_dead_lettered(peer, 2)
        # Both bad messages were parked unchanged, with their origin, and not fed to the audit.
        dlq = await peer.js.subscribe(s.dead_letter("controller", s.weights_held), ordered_consumer=True)
        parked = [await dlq.next_msg(timeout=5) for _ in range(2)]
        await dlq.unsubscribe()
        assert parked[0].data == b"\xc1 not msgpack"
        assert all(m.headers["Miles-Origin"] == s.weights_held for m in parked)
        assert "not a weights_held" in parked[1].headers["Miles-Reason"]
        # The live monitor reads the counters from the controller's heartbeat.
        await until(lambda: any(b.stats.get("weights_mismatches") == 1.0 for b in beats))
        last = [b for b in beats if b.stats.get("weights_mismatches") == 1.0][-1]
        assert last.stats["weights_verified"] == 1.0 and last.stats["weights_pending"] == 0.0

        await peer.publish(s.done, TrainerDone(policy_version=1, steps=2))
        await asyncio.wait_for(task, timeout=30)  # the controller stops itself after the summary
    finally:
        controller.request_stop("test over")
        if not task.done():
            await asyncio.wait_for(task, timeout=30)
        evaluated.set()
        shards = await asyncio.wait_for(evaluator, timeout=30)
        await beating
        await bus.close()
    assert {(t.eval_id, t.version) for t in shards} == {("v1", 1)}  # the first version is also the last
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["weights_verified"] == 1 and summary["weights_mismatches"] == 1
    assert summary["weights_recent_mismatches"][0]["worker"] == "rollout-1"
    assert summary["dead_lettered"] == 2


async def _until_dead_lettered(bus: Bus, n: int, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if await bus.dead_letter_stream_size() == n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"DLQ never held {n} messages (has {await bus.dead_letter_stream_size()})")
