"""Fuzz of every documented subject during a real, secured run: nobody dies, no forgery is believed.

The run uses generated credentials (per-role nkeys, mutual TLS, signed messages) like the default
``miles run``. The forger is stronger than any role: a user of the run's account with *every* permission
(a compromised server, a mis-set permission), so what stops its messages is the actors' own rules
(signatures, trust rules, validation), not the server. During the run it publishes malformed bytes on
every subject and the well-formed forgeries found by the bus audit (docs/security.md lists them); then
each is checked not to have been applied.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from nats.aio.client import Client

from miles.bus.connect import processed
from miles.bus.schema import (
    SCHEMA_VERSION,
    Control,
    Episode,
    EvalResult,
    EvalShardResult,
    GroupsDiscarded,
    Heartbeat,
    PromptGroup,
    StepMetrics,
    TrainerDone,
    Trajectory,
    WeightsAnnounced,
    WeightsHeld,
    decode,
    encode,
)
from miles.bus.server import EmbeddedNats
from miles.bus.setup import setup_run
from miles.bus.subjects import Subjects
from miles.security.bundle import RoleCredentials, server_config, write_bundle
from miles.security.nkey import KeyPair
from miles.sync.payload import deserialize_state, serialize_state
from miles.sync.precision import state_digest
from miles.sync.transport.dataplane import WeightStore
from tests.integration.harness import Cluster, small_run_config

RUN = "fuzz"
S = Subjects(RUN)
STEPS = 24


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[EmbeddedNats, Path, Path]]:
    """A server with the run's bundle plus an all-powerful forger user; yields (server, bundle, forger seed)."""
    bundle = write_bundle(tmp_path / "auth", RUN)
    forger = KeyPair.generate("user")
    seed = tmp_path / "forger.nk"
    seed.write_text(forger.seed)
    seed.chmod(0o600)
    config = server_config(bundle)
    marker = "  users: [\n"
    assert marker in config
    config = config.replace(marker, marker + f'    {{"nkey": "{forger.public_key}"}}\n', 1)  # no permissions: all
    with EmbeddedNats(tmp_path / "bus", extra_config=config) as server:
        yield server, bundle, seed


async def _forger(url: str, bundle: Path, seed: Path) -> Client:
    tls = RoleCredentials.load(bundle, "monitor").ssl_context()  # any certificate of the run's CA
    nc = Client()
    await nc.connect(servers=[url], nkeys_seed=str(seed), tls=tls, allow_reconnect=False, name="forger")
    return nc


def _raw(kind: str, **fields: object) -> bytes:
    return msgpack.packb({"schema": SCHEMA_VERSION, "kind": kind, **fields}, use_bin_type=True)


def _episode(**overrides: object) -> dict[str, object]:
    fields: dict[str, object] = dict(
        prompt_ids=[1, 2],
        token_ids=[3, 4],
        loss_mask=[1, 1],
        logprobs=[-0.5, -0.5],
        turns=[(0, 2, "model")],
        weight_version=0,
        reward=1.0,
        status="ok",
        end_reason="done",
    )
    fields.update(overrides)
    return fields


async def _forge(nc: Client) -> dict[str, object]:
    """Publish every forgery once; returns facts the assertions need."""
    js = nc.jetstream(timeout=10.0)
    newest = decode((await js.get_msg(S.events_stream, subject=S.weights, direct=True)).data, WeightsAnnounced)

    async def put(subject: str, data: bytes) -> None:
        await js.publish(subject, data)

    # Malformed bytes and wrong kinds on every documented subject (streams and core subjects alike).
    garbage = [b"\xc1 not msgpack", msgpack.packb([1, 2, 3]), _raw("no_such_kind"), _raw("heartbeat", role=1)]
    stream_subjects = [
        S.prompts,
        S.evalq,
        S.traj,
        S.weights,
        S.weights_held,
        S.eval_results,
        S.discarded,
        S.control,
        S.step,
        S.eval,
        S.done,
    ]
    for subject in stream_subjects:
        for data in garbage:
            await put(subject, data)
    for data in garbage:
        await nc.publish(S.heartbeat("rollout", "rollout-0"), data)
        await nc.publish(S.control, data)

    forged_version = newest.version + 50
    # 1. An announcement with a wrong digest, and one of the largest version there is (unsigned both).
    wrong = WeightsAnnounced(version=newest.version + 40, step=newest.step, digest="00" * 16, size=1, chunks=1)
    await put(S.weights, encode(wrong))
    huge = WeightsAnnounced(version=2**53 - 1, step=1, digest="00" * 16, size=1, chunks=1)
    await put(S.weights, encode(huge))
    await put(S.weights, _raw("weights_announced", version=2**63 - 1, digest="x", size=1, chunks=1))
    # 2. Forged weights: the real payload with the output layer sign-flipped, digests computed by the forger.
    store = await WeightStore.create(js, RUN, ensure=False)
    state = dict(deserialize_state(await store.get(newest.version)))
    head = next(name for name in sorted(state) if "embed" in name or "lm_head" in name)
    state[head] = (-state[head].float()).to(state[head].dtype)
    info = await store.put(forged_version, serialize_state(state, forged_version))
    forged = newest.model_copy(
        update=dict(
            version=forged_version,
            digest=info.digest,
            size=info.size,
            chunks=info.chunks,
            state_digest=state_digest(state),
        )
    )
    await put(S.weights, encode(forged))
    # 3. A discard whose lists disagree (crashed the controller once), and 200 never-issued ids.
    await put(
        S.discarded, _raw("groups_discarded", group_ids=["g1", "g2"], sample_ids=["a"], requeue=True, trainer_version=0)
    )
    never = [f"g{900_000 + i}" for i in range(200)]
    await put(S.discarded, encode(GroupsDiscarded(group_ids=never, sample_ids=never, requeue=False, trainer_version=0)))
    # 4. Stop from anyone: without a run instance, with an old run's, and as a stored event.
    for instance in ("", "0" * 32):
        stop = encode(Control(command="stop", reason="forged", run_instance=instance))
        await nc.publish(S.control, stop)
        await put(S.control, stop)
    # 5. Step metrics, an evaluation and trainer_done, forged.
    await put(
        S.step,
        encode(
            StepMetrics(
                step=9999,
                policy_version=newest.version,
                metrics={"reward_mean": 1234.5},
                trained_group_ids=[],
                staleness=[],
            )
        ),
    )
    await put(S.eval, encode(EvalResult(policy_version=newest.version, accuracy=0.999, samples=40, eval_id="v0")))
    shard = EvalShardResult(eval_id="v999", shard=0, worker_id="rollout-0", version=0, samples=40, reward_sum=40.0)
    await put(S.eval_results, encode(shard))
    await put(S.done, encode(TrainerDone(policy_version=newest.version, steps=3)))
    # 6. A trajectory for a group never issued, and ones with NaN rewards, tokens outside the vocabulary,
    #    mismatched lengths; a prompt group of size -1 and an unsigned one.
    ok_episode = Episode.model_validate(_episode())
    never_issued = Trajectory(
        group_id="g999999", sample_id="s", worker_id="rollout-0", episodes=[ok_episode], issued_at_version=0, gen_s=0.1
    )
    await put(S.traj, encode(never_issued))
    for bad in (_episode(reward=math.nan), _episode(token_ids=[3, 10**6]), _episode(logprobs=[-0.5])):
        await put(
            S.traj,
            _raw(
                "trajectory",
                group_id="g1",
                sample_id="s",
                worker_id="rollout-0",
                episodes=[bad],
                issued_at_version=0,
                gen_s=0.1,
            ),
        )
    oov = Trajectory(
        group_id="g2",
        sample_id="s",
        worker_id="rollout-0",
        episodes=[Episode.model_validate(_episode(token_ids=[3, 2**30]))],
        issued_at_version=0,
        gen_s=0.1,
    )
    await put(S.traj, encode(oov))
    await put(
        S.prompts,
        _raw(
            "prompt_group",
            group_id="g5",
            sample_id="s",
            prompt="1+1=",
            answer="2",
            group_size=-1,
            issue_index=5,
            issued_at_version=0,
        ),
    )
    forged_prompt = PromptGroup(
        group_id="g100000",
        sample_id="s",
        prompt="1+1=",
        answer="3",
        group_size=4,
        issue_index=100000,
        issued_at_version=0,
    )
    await put(S.prompts, encode(forged_prompt))
    # 7. A held-weight report that would raise a false mismatch alarm, and an absurd heartbeat version.
    await put(
        S.weights_held,
        encode(WeightsHeld(worker_id="rollout-7", version=newest.version, state_digest="ff" * 16, mode="full")),
    )
    for _ in range(3):
        await nc.publish(
            S.heartbeat("rollout", "rollout-7"),
            encode(Heartbeat(role="rollout", actor_id="rollout-7", version=2**53 - 1)),
        )
        await nc.publish(S.heartbeat("rollout", "rollout-0"), encode(Heartbeat(role="trainer", actor_id="x")))
    # 8. Messages put straight onto the dead-letter stream.
    for i in range(5):
        await put(f"{RUN}.dlq.rollout.forged", b"junk %d" % i)
    await processed(nc)
    return {"forged_version": forged_version, "forged_state_digest": forged.state_digest, "never": set(never)}


@pytest.mark.slow
def test_forgeries_on_every_subject_are_refused_and_the_run_completes(
    tmp_path: Path, secured: tuple[EmbeddedNats, Path, Path], model_cache: Path
) -> None:
    server, bundle, seed = secured
    cfg = small_run_config(
        model_cache,
        RUN,
        **{"trainer.steps": STEPS, "eval.every": 7, "bus.credentials_dir": str(bundle), "trainer.checkpoint_every": 7},
    )
    asyncio.run(setup_run(cfg.bus, server.url, RUN))
    from miles.prepare import prepare

    prepare(cfg)
    cluster = Cluster(cfg, tmp_path / "run", server.url)
    cluster.start_all()
    try:
        cluster.wait_for(lambda: cluster.steps_recorded() >= 2, 240, "two steps", poll_s=0.02)
        # A tiny step takes ~0.05 s, so the forgeries are published with the trainer paused: every one of them
        # must reach the actors mid-run, not after the summary (where no refusal would be counted).
        trainer = cluster.procs["trainer-0"]
        trainer.send_signal(signal.SIGSTOP)
        try:
            assert '"trainer_done"' not in cluster.log("trainer-0"), "the trainer finished before the forgeries"
            facts = asyncio.run(_forge_once(server.url, bundle, seed))
        finally:
            trainer.send_signal(signal.SIGCONT)
        cluster.wait_for(lambda: (cluster.run_dir / "summary.json").exists(), 240, "the run to complete")
        cluster.wait_all_exit(60)
    finally:
        cluster.stop()
    for name, proc in cluster.procs.items():
        assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{cluster.log(name)[-2000:]}"
    summary = cluster.summary()
    assert summary["status"] == "complete" and summary["steps"] == STEPS  # no forged stop or trainer_done
    assert summary["final_version"] < facts["forged_version"] and summary["final_version"] < 2**53 - 1
    rows = [json.loads(line) for line in (cluster.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))  # each step once, no forged step 9999
    assert all(r["reward_mean"] != 1234.5 for r in rows)
    evals = [json.loads(line) for line in (cluster.run_dir / "evals.jsonl").read_text().splitlines()]
    assert all(e["eval_accuracy"] != 0.999 for e in evals) and summary["eval_after"] != 0.999
    ledger = cluster.ledger()
    issued = {e["group_id"] for e in ledger if e["event"] == "issued"}
    assert not facts["never"] & {e["group_id"] for e in ledger if e["event"] != "issued"}  # no forged discard
    trained = [e["group_id"] for e in ledger if e["event"] == "trained"]
    assert set(trained) <= issued and len(trained) == len(set(trained)) == STEPS * cfg.trainer.groups_per_step
    assert summary["weights_mismatches"] == 0  # no false alarm from the forged report
    assert max(summary["workers"].values()) <= summary["final_version"]  # nobody adopted a forged version
    assert all(v <= summary["final_version"] for v in summary["weights_last_verified"].values())
    # Every refusal was counted where it happened, apart from what was put on the dead-letter stream by hand.
    assert summary["refused"]["unsigned"] >= 8 and summary["refused"]["malformed"] > 0
    assert summary["refused"]["untrusted"] > 0
    assert summary["dlq_messages"] >= summary["dead_lettered"] + 5
    assert any("without a valid signature" in alarm for alarm in summary["alarms"])
    for worker in ("rollout-0", "rollout-1"):
        applied = [json.loads(line) for line in cluster.log(worker).splitlines() if '"weights_applied"' in line]
        assert applied and all(a["version"] <= summary["final_version"] for a in applied)  # never the forged one
        assert '"reason": "forged"' not in cluster.log(worker)  # no forged stop was obeyed
    # The monitor skips what it cannot verify and raises the alarm too.
    monitor_alarms = _monitor_snapshot(cluster, bundle)["alarms"]
    assert any("without a valid signature" in alarm for alarm in monitor_alarms)


async def _forge_once(url: str, bundle: Path, seed: Path) -> dict[str, object]:
    nc = await _forger(url, bundle, seed)
    try:
        return await _forge(nc)
    finally:
        await nc.close()


def _monitor_snapshot(cluster: Cluster, bundle: Path) -> dict[str, object]:
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles.node",
            "--role",
            "monitor",
            "--config",
            str(cluster.config_path),
            "--nats-url",
            cluster.nats_url,
            "--run-dir",
            str(cluster.run_dir / "monitor"),
            "--json",
            "--once",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])
