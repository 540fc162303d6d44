"""The reference worker with a ``miles creds`` rollout identity: its URL, its role directory and the run name
are all it needs, every request it makes is within the rollout role's permissions, and it believes only what
the trainer and the controller signed.

The server enforces the bundle (nkey users, mutual TLS, the permission table of docs/security.md). The run's
other roles are the project's own code under their identities: the setup step creates the streams, a
controller ``Bus`` (signing) claims the run instance, writes the run info and issues work, a trainer ``Bus``
(signing) publishes version 0. Unsigned copies of a prompt group and of a stop (right instance, no signature)
are refused.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError

from miles.bus.client import Bus
from miles.bus.runinfo import build_run_info, publish_run_info
from miles.bus.schema import Control, PromptGroup, Trajectory, WeightsAnnounced, WeightsHeld, decode, encode
from miles.bus.server import EmbeddedNats
from miles.bus.setup import setup_run
from miles.config import RunConfig
from miles.models.loading import load_policy, prepared_model_dir
from miles.security.bundle import server_config, write_bundle
from miles.security.signing import SIGNATURE_HEADER, SIGNER_HEADER
from miles.sync.payload import serialize_state
from miles.sync.precision import state_digest, to_rollout_state
from miles.sync.transport.dataplane import WeightStore
from miles.tasks.registry import build_task

from .conftest import REFERENCE_WORKER, conformance_config

pytestmark = pytest.mark.slow
RUN = "credrun"


async def _next(bus: Bus, stream: str, subject: str, timeout_s: float) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return await bus.js.get_msg(stream, seq=1, subject=subject, direct=True, next=True)
        except NotFoundError:
            await asyncio.sleep(0.2)
    raise AssertionError(f"nothing on {subject} after {timeout_s}s")


async def _refused(bus: Bus, origin: str) -> int:
    """Dead letters the rollout role parked for ``origin`` (stream info: all the controller may read of the DLQ)."""
    s = bus.subjects
    info = await bus.js.stream_info(s.dlq_stream, subjects_filter=s.dead_letter("rollout", origin))
    return sum((info.state.subjects or {}).values())


def _group(sample: object, index: int, group_size: int) -> PromptGroup:
    return PromptGroup(
        group_id=f"g{index}",
        sample_id=sample.id,  # type: ignore[attr-defined]
        prompt=sample.prompt,  # type: ignore[attr-defined]
        answer=sample.answer,  # type: ignore[attr-defined]
        group_size=group_size,
        issue_index=index,
        issued_at_version=0,
    )


async def _session(url: str, cfg: RunConfig, worker: subprocess.Popen) -> dict[str, object]:
    await setup_run(cfg.bus, url, RUN)
    controller = await Bus.open(cfg.bus, url, RUN, "controller", role="controller")
    trainer = await Bus.open(cfg.bus, url, RUN, "trainer-0", role="trainer")
    s = controller.subjects
    try:
        instance = await controller.claim_run_instance()
        model_dir = prepared_model_dir(cfg.model, cfg.task)
        info, files = await asyncio.to_thread(build_run_info, cfg, model_dir, run_nonce=instance)
        await publish_run_info(controller.js, info, files)
        model, _ = load_policy(model_dir)
        state = to_rollout_state(dict(model.state_dict()), "bfloat16")
        store = await WeightStore.create(trainer.js, RUN, chunk_bytes=16 * 1024, ensure=False)  # several chunks
        stored = await store.put(0, serialize_state(state, 0))
        ann = WeightsAnnounced(
            version=0, digest=stored.digest, size=stored.size, chunks=stored.chunks, state_digest=state_digest(state)
        )
        await trainer.publish(s.weights, ann)  # signed by the trainer's key
        samples = build_task(cfg.task).samples("train")
        size = cfg.rollout.group_size
        await controller.js.publish(s.prompts, encode(_group(samples[1], 1, size)))  # unsigned: refused
        await controller.publish(s.prompts, _group(samples[0], 0, size))  # signed by the controller's key
        held = await _next(controller, s.events_stream, s.weights_held, 120)
        sub = await trainer.js.pull_subscribe_bind(durable=s.TRAINER_CONSUMER, stream=s.traj_stream)
        (traj,) = await sub.fetch(1, timeout=120)
        await traj.ack()
        unsigned_prompts = await _refused(controller, s.prompts)
        await controller.js.publish(s.control, encode(Control(command="stop", run_instance=instance)))  # unsigned
        await asyncio.sleep(1.5)
        alive_after_unsigned_stop = worker.poll() is None
        await controller.publish(s.control, Control(command="stop", reason="done", run_instance=instance))
        deadline = time.monotonic() + 30
        while worker.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        trajectory = decode(traj.data, Trajectory)
        ticket_headers = {SIGNER_HEADER: "controller", SIGNATURE_HEADER: trajectory.ticket_signature}
        assert controller.verifier is not None
        controller.verifier.verify(s.prompts, trajectory.ticket, ticket_headers, "controller")  # raises if not
        return {
            "held": decode(held.data, WeightsHeld),  # type: ignore[attr-defined]
            "traj": trajectory,
            "announced": ann,
            "unsigned_prompts": unsigned_prompts,
            "unsigned_stops": await _refused(controller, s.control),
            "alive_after_unsigned_stop": alive_after_unsigned_stop,
        }
    finally:
        await controller.close()
        await trainer.close()


def test_the_reference_worker_joins_with_its_rollout_identity_only(tmp_path: Path, conformance_models: Path) -> None:
    from miles.prepare import prepare

    bundle = write_bundle(tmp_path / "auth", RUN, hostnames=["localhost"])
    cfg = conformance_config(conformance_models, RUN, **{"bus.credentials_dir": str(bundle)})
    prepare(cfg)
    log = tmp_path / "worker.log"
    with EmbeddedNats(tmp_path / "bus", extra_config=server_config(bundle)) as server:
        cmd = [sys.executable, str(REFERENCE_WORKER), "--nats-url", server.url, "--run", RUN, "--worker-id", "ref-c"]
        with open(log, "ab") as out:
            worker = subprocess.Popen(
                [*cmd, "--credentials", str(bundle / "rollout")],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
            )
        try:
            seen = asyncio.run(_session(server.url, cfg, worker))
        finally:
            if worker.poll() is None:
                worker.kill()
            worker.wait(30)
    text = log.read_text(errors="replace")
    assert worker.returncode == 0, text[-3000:]
    assert "ermissions violation" not in text, text[-3000:]  # nothing the worker asked for was refused
    traj, held = seen["traj"], seen["held"]
    assert traj.worker_id == "ref-c" and traj.group_id == "g0"  # type: ignore[attr-defined]
    assert (held.version, held.state_digest) == (0, seen["announced"].state_digest)  # type: ignore[attr-defined]
    assert seen["unsigned_prompts"] == 1 and seen["unsigned_stops"] == 1 and seen["alive_after_unsigned_stop"]
