"""Replays of an earlier run's signed messages suppress nothing of the run that comes after it.

Run A (secured, its own bundle) runs to the end while a listener with every permission records every message
published under the run's name, headers included (signatures and ``Nats-Msg-Id``). Run B has the same name and a
new bundle (another run instance). Before B's actors start, every recorded message is published again on B's
server, as an attacker who kept them would. The server's duplicate window drops a message whose id it has
seen: with predictable ids (``g0``, ``issued-0``, ``step-v1``, ``v0-0``, ``evalres-v0-0``, ``eval-v0``) B's genuine
prompts, issue records, step reports and evaluations were dropped. B must complete with every step, ledger
entry, prompt group and evaluation present, and the replayed messages refused.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from miles.bus.connect import processed
from miles.bus.server import EmbeddedNats
from miles.bus.setup import setup_run
from miles.security.bundle import RoleCredentials, server_config, write_bundle
from miles.security.nkey import KeyPair
from tests.integration.harness import Cluster, small_run_config

RUN = "replayed"
STEPS = 6

Recorded = list[tuple[str, bytes, dict[str, str]]]


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[[str], tuple[EmbeddedNats, Path, Path]]]:
    """Start a server for a fresh bundle of the run, with a listener user holding every permission."""
    with ExitStack() as stack:

        def start(label: str) -> tuple[EmbeddedNats, Path, Path]:
            bundle = write_bundle(tmp_path / label / "auth", RUN)
            listener = KeyPair.generate("user")
            seed = tmp_path / label / "listener.nk"
            seed.write_text(listener.seed)
            seed.chmod(0o600)
            config = server_config(bundle).replace(
                "  users: [\n", f'  users: [\n    {{"nkey": "{listener.public_key}"}}\n', 1
            )
            server = stack.enter_context(EmbeddedNats(tmp_path / label / "bus", extra_config=config))
            return server, bundle, seed

        yield start


async def _listener(url: str, bundle: Path, seed: Path) -> Client:
    nc = Client()
    tls = RoleCredentials.load(bundle, "monitor").ssl_context()  # any certificate of the run's CA
    await nc.connect(servers=[url], nkeys_seed=str(seed), tls=tls, allow_reconnect=False, name="listener")
    return nc


def _run(
    label: str,
    servers: Callable[[str], tuple[EmbeddedNats, Path, Path]],
    tmp_path: Path,
    model_cache: Path,
    *,
    record: Recorded | None = None,
    replay: Recorded | None = None,
) -> Cluster:
    """One secured run to its end: recording every message of the run into ``record`` (run A), or publishing
    ``replay`` before the actors start (run B)."""
    server, bundle, seed = servers(label)
    cfg = small_run_config(
        model_cache, RUN, **{"trainer.steps": STEPS, "eval.every": 3, "bus.credentials_dir": str(bundle)}
    )
    asyncio.run(setup_run(cfg.bus, server.url, RUN))
    cluster = Cluster(cfg, tmp_path / label / "run", server.url)

    async def record_while_running() -> None:
        nc = await _listener(server.url, bundle, seed)

        async def keep(msg: Msg) -> None:
            assert record is not None
            record.append((msg.subject, msg.data, dict(msg.headers or {})))

        await nc.subscribe(f"{RUN}.>", cb=keep)
        await processed(nc)
        cluster.start_all()
        summary = cluster.run_dir / "summary.json"
        async with asyncio.timeout(300):
            while not summary.exists():
                await asyncio.sleep(0.2)
                for name, proc in cluster.procs.items():
                    assert proc.poll() in (None, 0), f"{name} exited {proc.poll()}:\n{cluster.log(name)[-3000:]}"
        await nc.drain()

    async def publish_again(messages: Recorded) -> int:
        nc = await _listener(server.url, bundle, seed)
        replayed = 0
        for subject, data, headers in messages:
            await nc.publish(subject, data, headers=headers or None)
            replayed += 1
        await processed(nc)
        await nc.close()
        return replayed

    try:
        if replay is None:
            asyncio.run(record_while_running())
        else:
            assert asyncio.run(publish_again(replay)) == len(replay)
            cluster.start_all()
            cluster.wait_for(lambda: (cluster.run_dir / "summary.json").exists(), 300, "run B to complete")
        cluster.wait_all_exit(60)
    finally:
        cluster.stop()
    for name, proc in cluster.procs.items():
        assert proc.returncode == 0, (
            f"{name} of run {label} exited with {proc.returncode}:\n{cluster.log(name)[-3000:]}"
        )
    return cluster


@pytest.mark.slow
def test_an_earlier_runs_replayed_messages_suppress_nothing(
    servers: Callable, tmp_path: Path, model_cache: Path
) -> None:  # type: ignore[type-arg]
    from miles.prepare import prepare

    saved: Recorded = []
    prepare(small_run_config(model_cache, RUN, **{"trainer.steps": STEPS}))
    first = _run("a", servers, tmp_path, model_cache, record=saved)
    ids = {h.get("Nats-Msg-Id", "") for _, _, h in saved}
    # What run A published with a message id: prompts, issue records, step reports, evaluation tasks and results.
    for prefix in ("g0.", "issued-0.", "step-v1.", "v0-0.", "evalres-v0-0-", "eval-v0."):
        assert any(i.startswith(prefix) for i in ids), (prefix, sorted(ids)[:20])
    second = _run("b", servers, tmp_path, model_cache, replay=saved)

    summary = second.summary()
    assert summary["status"] == "complete" and summary["steps"] == STEPS
    rows = [json.loads(line) for line in (second.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    ledger = second.ledger()
    groups = STEPS * second.cfg.trainer.groups_per_step
    trained = [e["group_id"] for e in ledger if e["event"] == "trained"]
    assert len(trained) == len(set(trained)) == groups and summary["groups_outstanding"] == 0
    issued = sorted(int(e["group_id"][1:]) for e in ledger if e["event"] == "issued")
    assert issued == list(range(len(issued)))  # no hole: every issue record and prompt group of B was stored
    evals = {json.loads(line)["step"] for line in (second.run_dir / "evals.jsonl").read_text().splitlines()}
    assert evals == {0, 3, STEPS} == {json.loads(x)["step"] for x in (first.run_dir / "evals.jsonl").open()}
    # The replayed messages were refused as unsigned for this run instance, not believed.
    assert summary["refused"].get("unsigned", 0) > 0
    assert any("without a valid signature" in alarm for alarm in summary["alarms"])
