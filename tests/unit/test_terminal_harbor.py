"""Loading Harbor task folders: good folders load, bad ones fail in one line naming folder and file."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.tasks.terminal.harbor import DEFAULT_VERIFIER_TIMEOUT_S, TaskFormatError, load_task, load_tasks


def make_task(folder: Path, *, toml: str = "", instruction: str = "Do it.\n", test: str | None = "exit 0\n") -> Path:
    (folder / "environment").mkdir(parents=True)
    (folder / "task.toml").write_text(toml)
    (folder / "instruction.md").write_text(instruction)
    if test is not None:
        (folder / "tests").mkdir()
        (folder / "tests" / "test.sh").write_text(test)
    return folder


def test_loads_a_folder(tmp_path: Path) -> None:
    toml = (
        'version = "1.0"\n[task]\nname = "org/hello"\n[metadata]\ndifficulty = "easy"\n'
        '[verifier]\ntimeout_sec = 30.0\nenv = { MODE = "strict" }\n[agent]\ntimeout_sec = 120\n'
        '[environment]\ndocker_image = "ubuntu:24.04"\ncpus = 1\n'
    )
    task = load_task(make_task(tmp_path / "hello", toml=toml, instruction="  Say hello.\n\n"))
    assert (task.name, task.instruction, task.verifier_timeout_s, task.agent_timeout_s) == (
        "org/hello",
        "Say hello.",
        30.0,
        120.0,
    )
    assert task.verifier_env == {"MODE": "strict"} and task.metadata == {"difficulty": "easy"}
    assert task.environment == tmp_path / "hello" / "environment"
    assert task.config["environment"]["docker_image"] == "ubuntu:24.04"


def test_defaults_and_optional_environment(tmp_path: Path) -> None:
    folder = make_task(tmp_path / "bare")
    (folder / "environment").rmdir()
    task = load_task(folder)
    assert (task.name, task.environment, task.verifier_timeout_s, task.agent_timeout_s) == (
        "bare",
        None,
        DEFAULT_VERIFIER_TIMEOUT_S,
        None,
    )


def test_loads_a_directory_of_folders_sorted(tmp_path: Path) -> None:
    for name in ("b", "a", ".hidden"):
        make_task(tmp_path / name)
    assert [t.name for t in load_tasks(tmp_path)] == ["a", "b"]
    assert [t.name for t in load_tasks(tmp_path / "a")] == ["a"]


@pytest.mark.parametrize(
    ("setup", "file", "message"),
    [
        (lambda f: (f / "task.toml").unlink(), "task.toml", "missing"),
        (lambda f: (f / "task.toml").write_text("version = \n"), "task.toml", "Invalid"),
        (
            lambda f: (f / "task.toml").write_text("[verifier]\ntimeout_sec = 'soon'\n"),
            "task.toml",
            "verifier.timeout_sec",
        ),
        (lambda f: (f / "task.toml").write_text("[verifier]\ntimeout_sec = -1\n"), "task.toml", "greater than 0"),
        (lambda f: (f / "task.toml").write_text("[verifier.env]\n'A B' = 'x'\n"), "task.toml", "shell variable"),
        (lambda f: (f / "instruction.md").unlink(), "instruction.md", "missing"),
        (lambda f: (f / "instruction.md").write_text(" \n"), "instruction.md", "empty"),
        (lambda f: (f / "instruction.md").write_bytes(b"\xff\xfe"), "instruction.md", "UTF-8"),
        (lambda f: (f / "tests" / "test.sh").unlink(), "test.sh", "missing"),
    ],
)
def test_bad_folders_fail_in_one_line(tmp_path: Path, setup, file: str, message: str) -> None:
    folder = make_task(tmp_path / "broken")
    make_task(tmp_path / "fine")
    setup(folder)
    with pytest.raises(TaskFormatError) as info:
        load_tasks(tmp_path)
    text = str(info.value)
    assert "\n" not in text and "broken" in text and file in text and message in text, text


def test_empty_or_missing_directories_and_duplicate_names(tmp_path: Path) -> None:
    with pytest.raises(TaskFormatError, match="does not exist"):
        load_tasks(tmp_path / "nope")
    with pytest.raises(TaskFormatError, match="no task folders"):
        load_tasks(tmp_path)
    make_task(tmp_path / "one", toml='[task]\nname = "same"\n')
    make_task(tmp_path / "two", toml='[task]\nname = "same"\n')
    with pytest.raises(TaskFormatError, match="also used by"):
        load_tasks(tmp_path)


def test_a_tiny_model_cannot_warm_up_on_a_users_harbor_task_and_prepare_says_so_in_one_line(tmp_path: Path) -> None:
    from miles.config import load_config
    from miles.prepare import PrepareError, prepare

    for split in ("train", "eval"):
        make_task(tmp_path / split / "t0")
    overrides = [
        "task.type=terminal",
        f"task.train_dir={tmp_path / 'train'}",
        f"task.eval_dir={tmp_path / 'eval'}",
        f"model.cache_dir={tmp_path / 'models'}",
    ]
    with pytest.raises(PrepareError, match=r"model: .*'train:t0' is a Harbor task of your own: .*pretrained") as e:
        prepare(load_config(None, overrides))
    assert "\n" not in str(e.value)
