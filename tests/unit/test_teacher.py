"""The distillation teacher: resolved from a checkpoint or a run directory, never falling back to the student,
refused (one line, exit 2) when its weights equal the student's, and scoring tokens like the student."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from miles.backends.base import TrainSample
from miles.backends.fsdp import FsdpBackend
from miles.config import RunConfig, dump_config, load_config
from miles.models.loading import load_policy
from miles.training.checkpoint import CheckpointManager
from miles.training.packing import pack_micro_batches
from miles.training.teacher import TeacherError, TeacherScorer, check_teacher, load_teacher_model

SETS = {
    "name": "teach",
    "model.hidden_size": 16,
    "model.num_layers": 1,
    "model.num_heads": 2,
    "model.warmup_steps": 4,
    "model.warmup_target_accuracy": None,
    "task.max_operand": 9,
    "task.train_size": 50,
    "task.eval_size": 10,
    "rollout.sampling.max_new_tokens": 3,
}


def _config(cache: Path, **extra: object) -> RunConfig:
    sets = {**SETS, "model.cache_dir": str(cache), **extra}
    return load_config(None, [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in sets.items()])


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunConfig, Path]:
    from miles.prepare import prepare

    cfg = _config(tmp_path_factory.mktemp("models"))
    return cfg, prepare(cfg)


def _copy(src: Path, dst: Path, *, perturb: bool) -> Path:
    shutil.copytree(src, dst)
    if perturb:
        (weights,) = dst.glob("*.safetensors")
        state = load_file(str(weights))
        name = sorted(state)[-1]
        state[name] = state[name] + 1e-3
        save_file(state, str(weights), metadata={"format": "pt"})
    return dst


def test_the_students_own_directory_and_a_copy_of_it_are_refused(student, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, student_dir = student
    with pytest.raises(TeacherError, match="student's own model directory"):
        check_teacher(str(student_dir), student_dir)
    twin = _copy(student_dir, tmp_path / "twin", perturb=False)
    with pytest.raises(TeacherError, match="equal the student's") as exc:
        check_teacher(str(twin), student_dir)
    assert "\n" not in str(exc.value)


def test_missing_or_unrecognised_paths_are_refused_not_replaced(student, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, student_dir = student
    with pytest.raises(TeacherError, match="not a directory"):
        check_teacher(str(tmp_path / "nowhere"), student_dir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TeacherError, match="neither a Hugging Face checkpoint"):
        check_teacher(str(tmp_path / "empty"), student_dir)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(dump_config(student[0]))
    with pytest.raises(TeacherError, match="no complete checkpoint"):
        check_teacher(str(tmp_path / "run"), student_dir)


def test_a_different_teacher_is_accepted_and_scores_other_log_probs(student, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg, student_dir = student
    other = _copy(student_dir, tmp_path / "other", perturb=True)
    source = check_teacher(str(other), student_dir)
    sample = TrainSample(prompt_ids=[1, 5, 6], token_ids=[7, 8, 2], loss_mask=[1, 1, 1], behaviour_logprobs=[])
    (mb,) = pack_micro_batches([sample], pad_id=0)
    teacher = TeacherScorer(load_teacher_model(source), temperature=1.0, chunk_tokens=8).score(mb)
    twin = TeacherScorer(load_policy(student_dir)[0], temperature=1.0, chunk_tokens=8).score(mb)
    on = mb.loss_mask > 0
    assert not torch.equal(teacher[on], twin[on])


def test_a_run_directory_teacher_is_its_newest_checkpoint(student, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Phase 2 names the phase-1 run: its newest complete checkpoint, in its model's architecture."""
    cfg, student_dir = student
    run = tmp_path / "teacher-run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(cfg))
    model, _ = load_policy(student_dir)
    backend = FsdpBackend(model, cfg.trainer)
    manager = CheckpointManager(run / "checkpoints", every=1, keep=2)
    manager.save(1, backend, {"step": 1})
    with pytest.raises(TeacherError, match="equal the student's"):  # not trained yet: the student itself
        check_teacher(str(run), student_dir)
    with torch.no_grad():
        next(backend.model.parameters()).add_(0.01)
    manager.save(2, backend, {"step": 2})
    source = check_teacher(str(run), student_dir)
    assert source.checkpoint == manager.path(2)
    loaded = load_teacher_model(source)
    expected = {k: v for k, v in backend.model.lm.state_dict().items()}
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)


def _teacher_sets(path: Path) -> list[str]:
    return [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in SETS.items()] + [
        "trainer.algo.distill.teacher.type=in_trainer",
        f"trainer.algo.distill.teacher.path={path}",
    ]


@pytest.mark.slow  # two processes that import torch and load the model: ~20 s on two shared cores
def test_cli_refuses_a_teacher_equal_to_the_student_with_one_line_and_exit_2(student, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg, student_dir = student
    twin = _copy(student_dir, tmp_path / "twin", perturb=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(dump_config(load_config(None, [*_teacher_sets(twin), f"model.cache_dir={cfg.model.cache_dir}"])))
    proc = subprocess.run(
        [sys.executable, "-m", "miles.cli", "prepare", str(recipe)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("miles: error: trainer.algo.distill.teacher.path") and "equal the student's" in last

    # The trainer process refuses it too (a split run starts miles-node without `miles run`).
    node = [sys.executable, "-m", "miles.node", "--role", "trainer", "--config", str(recipe)]
    node += ["--run-dir", str(tmp_path / "run"), "--nats-url", "nats://127.0.0.1:1"]
    proc = subprocess.run(node, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "equal the student's" in proc.stderr.strip().splitlines()[-1]
