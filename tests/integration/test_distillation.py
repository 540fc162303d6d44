"""On-policy distillation end to end: a teacher loaded in the trainer (actors started one by one), and teacher
actors on the bus under the default secured ``miles run`` (per-role logins, the teacher's least-privilege
identity); every step carries a non-zero reverse KL."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from miles.bus.server import EmbeddedNats
from miles.config import RunConfig, dump_config

from .harness import Cluster, check_accounting, small_run_config

pytestmark = pytest.mark.slow


def _teacher_beside(student_dir: Path, dst: Path) -> Path:
    """A copy of the student with every weight shifted: a teacher that differs, with the student's tokenizer."""
    shutil.copytree(student_dir, dst)
    (weights,) = dst.glob("*.safetensors")
    state = load_file(str(weights))
    save_file({k: v * 1.05 for k, v in state.items()}, str(weights), metadata={"format": "pt"})
    return dst


def _config(model_cache: Path, name: str, tmp_path: Path, teacher: dict) -> RunConfig:
    from miles.prepare import prepare

    base = small_run_config(model_cache, name)
    student_dir = prepare(base)
    teacher_dir = _teacher_beside(student_dir, tmp_path / "teacher")
    distill = {"teacher": {**teacher, "path": str(teacher_dir)}, "coef": 0.2}
    return small_run_config(model_cache, name, **{"trainer.steps": 4, "trainer.algo.distill": distill})


def _check_distilled(run_dir: Path, steps: int) -> None:
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == steps
    for m in metrics:
        assert m["distill_reverse_kl"] != 0.0 and m["distill_kl_zero"] == 0.0, m


def _run(cfg: RunConfig, run_dir: Path, url: str, *, teachers: int) -> Cluster:
    cluster = Cluster(cfg=cfg, run_dir=run_dir, nats_url=url)
    try:
        for i in range(teachers):
            cluster.start(f"teacher-{i}", "teacher")
        cluster.start_all(rollouts=2, ranks=1)
        cluster.wait_for(lambda: (cluster.run_dir / "summary.json").exists(), 300, "the end of the run")
        cluster.wait_all_exit(60)
    finally:
        cluster.stop()
    for name, proc in cluster.procs.items():
        assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{cluster.log(name)[-2000:]}"
    check_accounting(cluster)
    return cluster


def test_distillation_from_a_teacher_in_the_trainer(tmp_path: Path, server: EmbeddedNats, model_cache: Path) -> None:
    cfg = _config(model_cache, "distill-local", tmp_path, {"type": "in_trainer"})
    cluster = _run(cfg, tmp_path / "run", server.url, teachers=0)
    _check_distilled(cluster.run_dir, cfg.trainer.steps)


def test_secured_miles_run_distills_from_teacher_actors_on_the_bus(tmp_path: Path, model_cache: Path) -> None:
    cfg = _config(model_cache, "distill-bus", tmp_path, {"type": "actor", "timeout_s": 60.0})
    recipe, run_dir = tmp_path / "recipe.yaml", tmp_path / "run"
    recipe.write_text(dump_config(cfg))
    cmd = [sys.executable, "-m", "miles.cli", "run", str(recipe), "--run-dir", str(run_dir), "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "auth" / "teacher" / "identity.json").is_file()  # bus.secure (the default): per-role logins
    _check_distilled(run_dir, cfg.trainer.steps)
    assert "teacher_ready" in (run_dir / "logs" / "teacher-0.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["refused"] == {} and summary["dead_lettered"] == 0
    # The teacher's heartbeats were believed and nobody tried what its permissions do not allow.
    assert "Violation" not in (run_dir / "nats" / "nats-server.log").read_text()
