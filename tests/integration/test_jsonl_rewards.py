"""A user's JSONL task in a real multi-process run: the reward reads extra fields of its row (they travel with
the prompt group), and a reward that raises or returns NaN fails only its sample, not the run."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from miles.bus.server import EmbeddedNats
from tests.integration.harness import run_to_completion, small_run_config

REWARD_MODULE = '''
import math


def scored(completion, sample):
    """Exact match, worth the row's own 'points' (a KeyError if the field did not travel with the sample);
    rows of kind 'raise' raise, rows of kind 'nan' return NaN."""
    kind = sample.meta["kind"]
    if kind == "raise":
        raise RuntimeError(f"no reward for {sample.id}")
    if kind == "nan":
        return math.nan
    return sample.meta["points"] * float(completion.strip().startswith(sample.answer))
'''


def _rows(n: int, offset: int) -> list[dict[str, object]]:
    rows = []
    for i in range(n):
        a, b = (i * 7 + offset) % 10, (i * 3 + offset) % 10
        kind = "raise" if i % 9 == 4 else "nan" if i % 9 == 7 else "ok"
        rows.append({"id": f"r{offset}-{i}", "prompt": f"{a}+{b}=", "answer": str(a + b), "kind": kind, "points": 2.0})
    return rows


@pytest.mark.slow
def test_jsonl_reward_reads_row_fields_and_failures_stay_local(
    tmp_path: Path, server: EmbeddedNats, model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "my_rewards.py").write_text(REWARD_MODULE)
    for split, rows in (("train", _rows(90, 0)), ("eval", _rows(18, 5))):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Every actor process must be able to import the reward: here through PYTHONPATH, like an installed package.
    monkeypatch.setenv("PYTHONPATH", f"{pkg}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(pkg))
    cfg = small_run_config(
        model_cache,
        "jsonl",
        **{
            "task": {
                "type": "jsonl",
                "train_path": str(tmp_path / "train.jsonl"),
                "eval_path": str(tmp_path / "eval.jsonl"),
                "reward": "my_rewards:scored",
            },
            "trainer.steps": 4,
            "eval.every": 0,
        },
    )
    cluster = run_to_completion(cfg, tmp_path / "run", server.url, timeout_s=300)
    summary = cluster.summary()
    assert summary["status"] == "complete" and summary["steps"] == 4
    assert summary["reward_failed"] > 0  # the raising and NaN rows failed alone, counted
    rows = [json.loads(line) for line in (cluster.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["reward_failed"] >= 0 for r in rows)
    rewards = {r["reward_mean"] for r in rows}
    assert all(0.0 <= x <= 2.0 and math.isfinite(x) for x in rewards)  # "points" (2.0) came from the row
    failed = cluster.log("rollout-0") + cluster.log("rollout-1")
    assert "reward_failed" in failed and "no reward for" in failed  # logged with the sample id
    assert summary["eval_before"] is not None and summary["eval_after"] is not None
