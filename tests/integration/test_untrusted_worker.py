"""A dishonest rollout worker in a real, secured run: nothing it may publish crashes, fakes or suppresses.

The attacker logs in with the run's own ``rollout`` credentials (the permissions every worker has, which is
what a compromised or buggy worker holds) and, during the run:

* publishes empty, truncated, garbage and large payloads on every subject a rollout identity may publish on;
* takes every shard of the initial evaluation off the queue (it is the only worker then) and answers each with
  a reward sum of 1000 per sample, carrying the shard's genuine claim;
* sends shard results for evaluations nobody requested;
* takes a genuine prompt group off the queue and answers it with a trajectory whose rewards are 1000.

The run must complete every step with exit 0, nothing out of a 0/1 task's range in metrics.jsonl, evals.jsonl
or summary.json, every refusal counted, the stolen shards issued again and the forged group played again.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from miles.bus.connect import processed
from miles.bus.schema import (
    Episode,
    EvalShardResult,
    EvalTask,
    PromptGroup,
    Trajectory,
    WeightsAnnounced,
    decode,
    encode,
)
from miles.bus.server import EmbeddedNats
from miles.bus.setup import setup_run
from miles.bus.subjects import Subjects
from miles.config import RunConfig
from miles.security.bundle import RoleCredentials, server_config, write_bundle
from miles.security.signing import SIGNATURE_HEADER
from tests.integration.harness import Cluster, small_run_config

RUN = "untrusted"
S = Subjects(RUN)
STEPS = 8
SHARDS = 3  # 40 held-out samples in shards of 15


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[EmbeddedNats, Path]]:
    bundle = write_bundle(tmp_path / "auth", RUN)
    with EmbeddedNats(tmp_path / "bus", extra_config=server_config(bundle)) as server:
        yield server, bundle


async def _connect(url: str, bundle: Path, role: str) -> Client:
    nc = Client()
    opts = RoleCredentials.load(bundle, role).nats_options()  # type: ignore[arg-type]
    await nc.connect(servers=[url], allow_reconnect=False, name=f"attacker:{role}", **opts)
    return nc


async def _until(predicate, what: str, timeout_s: float = 180.0) -> None:  # noqa: ANN001
    async with asyncio.timeout(timeout_s):
        while not await predicate():
            await asyncio.sleep(0.05)


async def _steal_the_initial_evaluation(js) -> list[EvalTask]:  # noqa: ANN001
    """Take every shard of the first evaluation (no genuine worker runs yet) and answer it with 1000 per sample."""
    evalq = await js.pull_subscribe_bind(durable=S.ROLLOUT_EVAL_CONSUMER, stream=f"{RUN}_EVALQ")
    stolen: list[EvalTask] = []
    async with asyncio.timeout(180):
        while len(stolen) < SHARDS:
            try:
                msgs = await evalq.fetch(SHARDS - len(stolen), timeout=5)
            except asyncio.TimeoutError:
                continue
            for msg in msgs:
                task = decode(msg.data, EvalTask)
                assert task.claim, "eval tasks carry a claim"
                forged = EvalShardResult(
                    eval_id=task.eval_id,
                    shard=task.shard,
                    worker_id="rollout-0",
                    version=task.version,
                    samples=len(task.samples),
                    reward_sum=1000.0 * len(task.samples),
                    claim=task.claim,
                )
                await js.publish(S.eval_results, encode(forged))
                await msg.ack()
                stolen.append(task)
    return stolen


async def _garbage_everywhere(nc: Client, js) -> int:  # noqa: ANN001
    """Empty, truncated, garbage and large payloads on every subject rollout may publish; returns how many of them
    reach a reader that must refuse them (the controller or the trainer)."""
    good = encode(EvalShardResult(eval_id="v0", shard=0, worker_id="w", version=0, samples=1, reward_sum=0.0))
    payloads = [b"", good[:-4], b"\xc1 not msgpack", b"\x93" + b"\x01" * 700_000]
    read = 0
    for subject in (S.traj, S.weights_held, S.eval_results):
        for data in payloads:
            await js.publish(subject, data)
            read += 1
    for data in payloads[:3]:
        await nc.publish(S.heartbeat("rollout", "rollout-9"), data)
        read += 1
        await js.publish(S.dead_letter("rollout", S.traj), data)  # nobody reads these: not counted
    # Results of evaluations nobody requested: a version never announced, and a made-up eval id.
    for eval_id in ("v999", "bogus"):
        forged = EvalShardResult(
            eval_id=eval_id, shard=0, worker_id="rollout-0", version=0, samples=15, reward_sum=15_000.0, claim="0" * 32
        )
        await js.publish(S.eval_results, encode(forged))
    await processed(nc)
    return read


async def _answer(  # noqa: ANN001
    js, msg: Msg, group: PromptGroup, ids: list[int], *, reward: float, worker_id: str, version: int | None = None
) -> None:
    """Publish a trajectory for the pulled prompt group (its genuine ticket): every episode ``ids`` scored
    ``reward``, sampled (it claims) under ``version`` (default: the version it was issued at) with made-up
    log-probs; then ack the prompt, as a worker does."""
    episode = Episode(
        prompt_ids=[1, 2],
        token_ids=ids,
        loss_mask=[1] * len(ids),
        logprobs=[-0.5] * len(ids),
        turns=[(0, len(ids), "model")],
        weight_version=group.issued_at_version if version is None else version,
        reward=reward,
        status="ok",
        end_reason="done",
    )
    traj = Trajectory(
        group_id=group.group_id,
        sample_id=group.sample_id,
        worker_id=worker_id,
        episodes=[episode] * group.group_size,
        issued_at_version=group.issued_at_version,
        gen_s=0.1,
        ticket=msg.data,
        ticket_signature=(msg.headers or {}).get(SIGNATURE_HEADER, ""),
    )
    await js.publish(S.traj, encode(traj))
    await msg.ack()


async def _forge_a_trajectory(js, prompts_fetch: asyncio.Task) -> str:  # noqa: ANN001
    """Answer the genuine prompt group the attacker's pull got with rewards of 1000 (its genuine ticket)."""
    (msg,) = await prompts_fetch
    group = decode(msg.data, PromptGroup)
    await _answer(js, msg, group, [5, 6], reward=1000.0, worker_id="rollout-0")
    return group.group_id


async def _attack(cluster: Cluster, url: str, bundle: Path) -> dict[str, object]:
    nc = await _connect(url, bundle, "rollout")
    setup = await _connect(url, bundle, "setup")  # only to watch the prompt queue's waiting pulls
    try:
        js, setup_js = nc.jetstream(timeout=10.0), setup.jetstream(timeout=10.0)
        stolen = await _steal_the_initial_evaluation(js)
        sent = await _garbage_everywhere(nc, js)
        prompts = await js.pull_subscribe_bind(durable=S.ROLLOUT_CONSUMER, stream=S.prompts_stream)
        fetch = asyncio.create_task(prompts.fetch(1, timeout=240))

        async def pull_waiting() -> bool:
            info = await setup_js.consumer_info(S.prompts_stream, S.ROLLOUT_CONSUMER)
            return (info.num_waiting or 0) >= 1

        await _until(pull_waiting, "the attacker's pull to wait on the prompt queue")
        # Now the genuine workers: they play the re-issued evaluation shards; the first prompt goes to the attacker.
        for i in range(2):
            cluster.start(f"rollout-{i}", "rollout")
        forged_group = await _forge_a_trajectory(js, fetch)
        return {"stolen": stolen, "garbage": sent, "forged_group": forged_group}
    finally:
        await nc.close()
        await setup.close()


def _completed(cluster: Cluster, steps: int) -> dict[str, Any]:
    """Wait for the run's end (stopping the actors whatever happens): every actor exited 0, all steps done."""
    try:
        cluster.wait_for(lambda: (cluster.run_dir / "summary.json").exists(), 300, "the run to complete")
        cluster.wait_all_exit(60)
    finally:
        cluster.stop()
    for name, proc in cluster.procs.items():
        assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{cluster.log(name)[-3000:]}"
    summary = cluster.summary()
    assert summary["status"] == "complete" and summary["steps"] == steps
    return summary


@pytest.mark.slow
def test_a_dishonest_rollout_identity_cannot_crash_fake_or_suppress_anything(
    tmp_path: Path, secured: tuple[EmbeddedNats, Path], model_cache: Path
) -> None:
    server, bundle = secured
    cfg = small_run_config(
        model_cache,
        RUN,
        **{"trainer.steps": STEPS, "eval.every": 4, "eval.shard_size": 15, "bus.credentials_dir": str(bundle)},
    )
    assert cfg.task.reward_range == (0.0, 1.0)
    asyncio.run(setup_run(cfg.bus, server.url, RUN))
    from miles.prepare import prepare

    prepare(cfg)
    cluster = Cluster(cfg, tmp_path / "run", server.url)
    cluster.start("controller", "controller")
    cluster.start_trainer()
    try:
        facts = asyncio.run(_attack(cluster, server.url, bundle))
    except BaseException:
        cluster.stop()
        raise
    summary = _completed(cluster, STEPS)

    def in_range(value: object) -> bool:
        return isinstance(value, int | float) and math.isfinite(value) and 0.0 <= value <= 1.0

    rows = [json.loads(line) for line in (cluster.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(in_range(r["reward_mean"]) for r in rows), [r["reward_mean"] for r in rows]
    evals = [json.loads(line) for line in (cluster.run_dir / "evals.jsonl").read_text().splitlines()]
    assert {e["step"] for e in evals} == {0, 4, STEPS}  # the stolen initial evaluation completed after all
    assert all(in_range(e["eval_accuracy"]) for e in evals), evals
    assert in_range(summary["eval_before"]) and in_range(summary["eval_after"])
    # The stolen shards were refused and issued again; the forged group was refused, issued again and trained.
    controller_log = cluster.log("controller")
    assert controller_log.count('"eval_shard_reissued"') >= SHARDS
    ledger = cluster.ledger()
    forged = facts["forged_group"]
    assert any(e["group_id"] == forged and e["event"] == "requeued" and e["reason"] == "invalid" for e in ledger)
    trained = [e for e in ledger if e["event"] == "trained"]
    assert forged not in {e["group_id"] for e in trained}
    assert len(trained) == STEPS * cfg.trainer.groups_per_step
    # Every refusal counted: the garbage each reader got, and the values out of range or unrequested.
    refused = summary["refused"]
    assert refused.get("malformed", 0) >= facts["garbage"], refused
    assert refused.get("untrusted", 0) >= SHARDS + 2 + 1, refused  # stolen shards, unrequested evals, trajectory


async def _dishonest_worker(
    url: str, bundle: Path, cfg: RunConfig, done: asyncio.Event, *, worker_id: str, count: int, lies: str
) -> list[bool]:
    """A worker of its own that answers ``count`` prompt groups (early in the run: the trainer reads them all)
    with the answer "99" and made-up log-probs, and returns whether each trajectory it sent lied:

    * ``lies="rewards"``: sampled (it says) at the version issued, scored honestly on its 1st, 3rd, ...
      trajectory and inflated (1 - the task's reward, still in range) on its 2nd, 4th, ...;
    * ``lies="logprobs"``: every reward honest, every trajectory sampled (it says) under the weights before the
      newest announced (a worker one version behind); its log-probs are all made up.
    """
    from miles.models.loading import load_tokenizer, prepared_model_dir
    from miles.tasks.base import Sample
    from miles.tasks.registry import build_task

    task = build_task(cfg.task)
    tokenizer = load_tokenizer(prepared_model_dir(cfg.model, cfg.task))
    nc = await _connect(url, bundle, "rollout")
    newest = [0]

    async def announced(msg: Msg) -> None:
        newest[0] = max(newest[0], decode(msg.data, WeightsAnnounced).version)

    sent: list[bool] = []
    try:
        await nc.subscribe(S.weights, cb=announced)
        js = nc.jetstream(timeout=10.0)
        prompts = await js.pull_subscribe_bind(durable=S.ROLLOUT_CONSUMER, stream=S.prompts_stream)
        while not done.is_set() and len(sent) < count:
            try:
                (msg,) = await prompts.fetch(1, timeout=0.5)
            except asyncio.TimeoutError:
                continue
            group = decode(msg.data, PromptGroup)
            ids = tokenizer.encode("99", add_special_tokens=False)
            text = tokenizer.decode(ids, skip_special_tokens=True)
            sample = Sample(id=group.sample_id, prompt=group.prompt, answer=group.answer, meta=group.meta)
            true = float(task.reward(text, sample))  # type: ignore[attr-defined]
            if lies == "rewards":
                lie = len(sent) % 2 == 1
                await _answer(js, msg, group, ids, reward=1.0 - true if lie else true, worker_id=worker_id)
            else:
                lie = True
                version = max(newest[0] - 1, group.issued_at_version)  # one behind: the trainer kept it
                await _answer(js, msg, group, ids, reward=true, worker_id=worker_id, version=version)
            sent.append(lie)
    finally:
        await nc.close()
    return sent


def _run_with_a_dishonest_worker(
    tmp_path: Path, server: EmbeddedNats, cfg: RunConfig, **attack: Any
) -> tuple[Cluster, list[bool], dict[str, Any]]:
    """A real run with one dishonest worker beside the genuine ones: its cluster, what it sent, the summary."""
    from miles.prepare import prepare

    asyncio.run(setup_run(cfg.bus, server.url, RUN))
    prepare(cfg)
    cluster = Cluster(cfg, tmp_path / "run", server.url)
    assert cfg.bus.credentials_dir is not None

    async def attack_during_the_run() -> list[bool]:
        done = asyncio.Event()
        bundle = Path(cfg.bus.credentials_dir)  # type: ignore[arg-type]
        liar = asyncio.create_task(_dishonest_worker(server.url, bundle, cfg, done, **attack))
        cluster.start_all()
        summary = cluster.run_dir / "summary.json"
        async with asyncio.timeout(300):
            while not summary.exists() and not liar.done():
                await asyncio.sleep(0.2)
        done.set()
        return await liar

    try:
        sent = asyncio.run(attack_during_the_run())
    except BaseException:
        cluster.stop()
        raise
    return cluster, sent, _completed(cluster, cfg.trainer.steps)


def _excluded(cluster: Cluster) -> list[str]:
    return [json.loads(x)["worker"] for x in cluster.log("trainer-0").splitlines() if '"audit_worker_excluded"' in x]


@pytest.mark.slow
def test_the_reward_audit_excludes_a_worker_that_inflates_rewards(
    tmp_path: Path, secured: tuple[EmbeddedNats, Path], model_cache: Path
) -> None:
    """Every trajectory re-scored (rate 1): the two honest workers' rewards all agree with the task's; the lying
    worker is caught on its first lie and excluded; everything it sends afterwards is refused and re-issued."""
    server, bundle = secured
    cfg = small_run_config(
        model_cache,
        RUN,
        **{"trainer.steps": 10, "eval.every": 0, "bus.credentials_dir": str(bundle), "trainer.audit.rate": 1.0},
    )
    cluster, sent, summary = _run_with_a_dishonest_worker(
        tmp_path, server, cfg, worker_id="rollout-evil", count=4, lies="rewards"
    )
    assert sent == [False, True, False, True], sent  # honest, lie, honest, lie
    audit = summary["audit"]
    # Every trajectory was re-scored; only the liar's disagreed (the honest workers' rewards all matched).
    assert audit["audited"] >= 10 * cfg.trainer.groups_per_step
    assert audit["mismatches"] == 1 and audit["excluded_workers"] == 1, audit
    assert audit["refused_excluded"] == 2, (audit, sent)  # everything it sent after its first lie
    assert audit["logprobs_checked"] == 0  # the log-prob audit is off
    assert any("1 on rewards" in alarm for alarm in summary["alarms"]), summary["alarms"]
    assert _excluded(cluster) == ["rollout-evil"]


@pytest.mark.slow
def test_the_log_prob_audit_excludes_a_worker_that_forges_behaviour_log_probs(
    tmp_path: Path, secured: tuple[EmbeddedNats, Path], model_cache: Path
) -> None:
    """Every held trajectory's log-probs re-computed under the weights that sampled them (logprob_rate 1): the
    honest workers' all agree with the trainer's forward; the forger, honest on rewards, is caught and excluded,
    and what it sends afterwards is refused and re-issued."""
    server, bundle = secured
    cfg = small_run_config(
        model_cache,
        RUN,
        **{"trainer.steps": 10, "eval.every": 0, "bus.credentials_dir": str(bundle), "trainer.audit.logprob_rate": 1},
    )
    cluster, sent, summary = _run_with_a_dishonest_worker(
        tmp_path, server, cfg, worker_id="rollout-forger", count=6, lies="logprobs"
    )
    assert sent == [True] * 6, sent
    audit = summary["audit"]
    assert audit["audited"] == 0  # rewards are not re-scored
    assert audit["logprobs_checked"] >= cfg.trainer.groups_per_step  # the honest workers' trajectories too
    assert audit["excluded_workers"] == 1 and audit["mismatches"] == audit["logprob_mismatches"] >= 1, audit
    assert audit["logprob_mismatches"] + audit["refused_excluded"] <= len(sent), audit
    assert any("on log-probs" in alarm for alarm in summary["alarms"]), summary["alarms"]
    assert _excluded(cluster) == ["rollout-forger"]  # the honest workers' log-probs never disagreed
