"""A black-box agent outside the package (examples/chat_agent.py, plain httpx) trains through `miles run`: the
rollout worker serves its chat endpoint per episode, with the torch engine, from the directory the run starts in."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

RECIPE = """
name: agent-run
model: {type: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, warmup_steps: 100, warmup_target_accuracy: 0.3}
task: {type: agent, agent: "chat_agent:solve", train_path: train.jsonl, eval_path: eval.jsonl}
rollout:
  workers: 1
  group_size: 4
  groups_in_flight: 4
  sampling: {max_new_tokens: 3, temperature: 1.0}
  episode: {max_turns: 2}
trainer: {ranks: 1, steps: 6, groups_per_step: 4}
eval: {every: 0, max_samples: 20}
"""


def _rows(count: int, seed: int) -> str:
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(count)]
    return "".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in pairs)


@pytest.mark.slow
def test_an_agent_written_against_the_endpoint_trains_through_miles_run(tmp_path: Path, model_cache: Path) -> None:
    work = tmp_path / "mine"
    work.mkdir()
    shutil.copy(EXAMPLES / "chat_agent.py", work / "chat_agent.py")
    (work / "train.jsonl").write_text(_rows(200, 0))
    (work / "eval.jsonl").write_text(_rows(20, 1))
    (work / "agent.yaml").write_text(RECIPE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    miles = Path(sys.executable).parent / "miles"
    cmd = [str(miles), "run", "agent.yaml", "--run-dir", "run", "--quiet", "--set", f"model.cache_dir={model_cache}"]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((work / "run" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["steps"] == 6
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["turns_mean"] for r in rows) / len(rows) > 1.5  # the agent's two calls: two model turns
    assert all(r["reward_failed"] == 0 and r["infra_excluded"] == 0 for r in rows)
    assert sum(r["model_tokens"] for r in rows) > 0
