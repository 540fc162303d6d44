"""The CI guard of a model family: a few RL steps of its tiny twin, end to end over NATS, and the gates on them.

A guard run is a real ``miles-node`` cluster (controller, one rollout worker, one trainer rank) training the
family's tiny twin (its transformers class, a tiny config, its BPE tokenizer and chat template) on a small
JSONL task whose reward gives partial credit, so that advantages, gradients and weight changes are never
all zero even for a random-init twin. It runs in the **on-policy mode** of the torch engine: float32 engine
weights, float32 sync, ``max_staleness: 0``. The engine then holds bit for bit the trainer's weights of the
version it samples with, and computes with the same transformers modules in the same dtype, so the only
engine-versus-trainer difference left is float reduction order (KV-cache decoding against one packed
forward). Sync is ``delta`` with an anchor every two versions, so every run applies deltas.

The gates (:func:`check_guard`), per step unless said otherwise, with the thresholds of
:data:`THRESHOLDS` (docs/models.md lists them per family):

* ``logp_mismatch`` (mean ``|trainer proximal logp - engine behaviour logp|`` over trained tokens) at most
  the family's threshold at *every* step: the strict gate (1e-6 for every family; figures in docs/models.md);
* entropy of the trainer's policy in ``(0, ln V]`` (``V`` the twin's vocabulary: a random-init twin is
  close to uniform, so the reference's ``(0, 0.7)`` band for trained checkpoints does not apply);
* ``grad_norm`` finite at every step, and non-zero at some step (the reward gave a signal);
* held-weight audit: every version a worker generated with was reported and matched the trainer's
  announced digest (``weights_mismatches == 0`` in summary.json);
* delta round trip: at least one version reached the workers as a delta, and the audit verified it.

Tensor-level checks at other rollout precisions (bf16, FP8 in the family's native format, MXFP4 for
GPT-OSS) and LoRA on the family's targets run in process over a real nats-server in
``test_family_guards.py``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from miles.config import RunConfig, load_config

from .harness import Cluster, check_accounting, check_held_weights

# Mean |logp difference| allowed per step in the on-policy mode, per family: 1e-6 leaves room for reduction-order
# noise and none for a wrong weight (measured figures per family in docs/models.md). GLM-5.2 measured 2.6e-4 at
# step 0 until the DSA indexers got a position tie-break in their top-k (miles/models/dsa_topk.py): many keys score
# exactly 0 and torch.topk picked different tied keys from the engine's cached row than from the trainer's full one.
THRESHOLDS: dict[str, float] = {
    "deepseek_v32": 1e-6,
    "gemma4": 1e-6,
    "glm52": 1e-6,
    "gpt_oss": 1e-6,
    "kimi_k26": 1e-6,
    "qwen38": 1e-6,
}
STEPS = 3

REWARD_MODULE = '''
def digit_share(completion, sample):
    """Partial credit: the share of the completion's non-space characters that are digits."""
    chars = [c for c in completion if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0
'''


class GuardFailure(AssertionError):
    """One or more gates of a family guard failed; ``failed`` names them."""

    def __init__(self, family: str, failed: dict[str, str]) -> None:
        self.failed = failed
        lines = "\n".join(f"  {gate}: {why}" for gate, why in failed.items())
        super().__init__(f"{family} guard failed:\n{lines}")


@dataclass
class GuardRun:
    family: str
    cluster: Cluster
    metrics: list[dict[str, Any]]
    summary: dict[str, Any]
    vocab_size: int


def write_task(root: Path) -> dict[str, Any]:
    """Train/eval JSONL files and the reward module (importable by every actor through PYTHONPATH). Prompts
    are long enough (about 20 tokens) that sliding windows (8) and the DSA top-k (8) of the twins engage."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "family_guard_reward.py").write_text(REWARD_MODULE)
    for split, offset, n in (("train", 0, 64), ("eval", 500, 4)):
        rows = []
        for i in range(n):
            a, b = (i * 7 + offset) % 50, (i * 13 + offset) % 50
            rows.append({"id": f"{split}-{i}", "prompt": f"Compute the result and reply with the number only. {a}+{b}=",
                         "answer": str(a + b)})  # fmt: skip
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "type": "jsonl",
        "train_path": str(root / "train.jsonl"),
        "eval_path": str(root / "eval.jsonl"),
        "reward": "family_guard_reward:digit_share",
    }


def guard_config(family: str, model_cache: Path, task: dict[str, Any], **overrides: Any) -> RunConfig:
    """The guard's run: the family's tiny twin, on-policy torch engine, delta sync, three synchronous steps."""
    sets: dict[str, Any] = {
        "name": f"guard-{family}".replace("_", "-"),
        "model": {"type": "family", "family": family, "size": "tiny", "cache_dir": str(model_cache)},
        "task": task,
        "rollout.workers": 1,
        "rollout.engine.dtype": "float32",
        "rollout.group_size": 4,
        "rollout.groups_in_flight": 2,
        "rollout.sampling.max_new_tokens": 8,
        "rollout.sampling.temperature": 1.0,
        "trainer.steps": STEPS,
        "trainer.groups_per_step": 2,
        "trainer.lr": 1e-3,
        "staleness.max_staleness": 0,
        "sync.mode": "delta",
        "sync.dtype": "float32",
        "sync.anchor_every": 2,
        "eval.every": 0,
        "eval.max_samples": 4,
        "monitor.plots": False,
        "bus.ack_wait_s": 4.0,
        "bus.heartbeat_s": 0.5,
        "bus.retention": "all",  # the guard audits the run from the streams at its end (check_held_weights)
    }
    sets.update(overrides)
    return load_config(None, [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in sets.items()])


def run_guard(
    cfg: RunConfig, run_dir: Path, nats_url: str, task_dir: Path, trainer_pythonpath: str | None = None
) -> GuardRun:
    """Prepare the twin, run the cluster to the end of the run, return its record. ``trainer_pythonpath`` is
    prepended to the trainer's PYTHONPATH only (the broken-mapping test plants a ``sitecustomize`` there)."""
    from miles.models.loading import load_tokenizer
    from miles.prepare import prepare

    model_dir = prepare(cfg)  # the twin is built once (cached per module), before any process starts
    base = f"{task_dir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    cluster = Cluster(cfg=cfg, run_dir=run_dir, nats_url=nats_url)
    saved = os.environ.get("PYTHONPATH")
    try:
        os.environ["PYTHONPATH"] = base
        cluster.start("controller", "controller")
        cluster.start("rollout-0", "rollout")
        if trainer_pythonpath is not None:
            os.environ["PYTHONPATH"] = f"{trainer_pythonpath}{os.pathsep}{base}"
        cluster.start_trainer(1)
        os.environ["PYTHONPATH"] = base
        cluster.wait_for(lambda: (run_dir / "summary.json").exists(), 240, "the end of the guard run")
        cluster.wait_all_exit(60)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
        cluster.stop()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return GuardRun(cfg.model.family, cluster, metrics, cluster.summary(), len(load_tokenizer(model_dir)))


def check_guard(run: GuardRun, threshold: float | None = None) -> None:
    """Every gate of the module docstring; raises :class:`GuardFailure` naming each one that failed."""
    threshold = THRESHOLDS[run.family] if threshold is None else threshold
    failed: dict[str, str] = {}
    summary, metrics = run.summary, run.metrics
    if summary.get("status") != "complete" or len(metrics) != STEPS:
        failed["run"] = f"status {summary.get('status')!r}, {len(metrics)} of {STEPS} steps recorded"
    gaps = [m["logp_mismatch"] for m in metrics]
    if not gaps or max(gaps) > threshold:
        failed["logp_mismatch"] = f"per-step engine-vs-trainer gaps {gaps}, threshold {threshold:g}"
    ceiling = math.log(run.vocab_size)
    entropies = [m["entropy"] for m in metrics]
    if not entropies or not all(0.0 < e <= ceiling + 1e-4 for e in entropies):
        failed["entropy"] = f"{entropies} not in (0, ln V = {ceiling:.4f}]"
    norms = [m["grad_norm"] for m in metrics]
    if not norms or not all(math.isfinite(g) for g in norms) or max(norms) <= 0:
        failed["grad_norm"] = f"{norms}: must be finite, and non-zero at some step"
    try:
        check_held_weights(run.cluster)
        check_accounting(run.cluster)
    except AssertionError as exc:
        failed["weights_audit"] = str(exc).splitlines()[0]
    delta = summary.get("sync_bytes", {}).get("delta", {})
    if delta.get("versions", 0) < 1:
        failed["delta"] = f"no version was published as a delta: {summary.get('sync_bytes')}"
    if failed:
        raise GuardFailure(run.family, failed)
