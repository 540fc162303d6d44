"""The plugin seam: one resolver, one registry, a user's task by import path with its own options."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict

from miles.config import ConfigError, load_config
from miles.plugins import PluginError, Registry, import_object, source_digest
from miles.tasks.base import Sample
from miles.tasks.fingerprint import task_fingerprint
from miles.tasks.registry import TASKS, build_task

HERE = __name__


class Tiny:
    """A task of one sample (the seam only needs the members)."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        size: int = 1

    render: Literal["raw", "chat"] = "chat"

    def __init__(self, config: Tiny.Config) -> None:
        self.config = config

    def samples(self, split: str) -> list[Sample]:
        return [Sample(id=str(i), prompt="p", answer="a") for i in range(self.config.size)]

    def environment(self, spec: object) -> None: ...
    def demonstration(self, sample: Sample) -> list[dict[str, str]]:
        return []

    def check(self) -> None: ...


class NoOptions(Tiny):
    Config = None  # type: ignore[assignment]

    def __init__(self) -> None:
        self.config = Tiny.Config()


def not_a_task() -> object:
    return object()


def test_the_resolver_explains_every_failure_in_one_line() -> None:
    assert import_object(f"{HERE}:Tiny.Config", "x") is Tiny.Config  # dotted attributes
    for path, message in [
        ("nocolon", "must have the form 'package.module:name'"),
        ("miles_no_such_module_xyz:f", "cannot import module 'miles_no_such_module_xyz'.*working directory"),
        (f"{HERE}:absent", "has no attribute 'absent'"),
    ]:
        with pytest.raises(PluginError, match=message) as info:
            import_object(path, "thing")
        assert "\n" not in str(info.value)


def test_the_working_directory_is_importable_after_everything_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "miles_user_plugin_xyz.py").write_text("VALUE = 42\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "miles_user_plugin_xyz", raising=False)
    assert import_object("miles_user_plugin_xyz:VALUE", "thing") == 42
    assert sys.path[-1] == str(tmp_path)  # appended: a local file never shadows an installed module


def test_a_registry_builds_built_ins_by_name_and_a_users_factory_by_path() -> None:
    registry: Registry[str] = Registry("widget")

    @registry.register("plain")
    def plain(cfg: object) -> str:
        return "plain"

    with pytest.raises(ValueError, match="registered twice"):
        registry.register("plain")(plain)
    assert registry.factory("plain")(None) == "plain"
    assert registry.factory(f"{HERE}:not_a_task") is not_a_task
    with pytest.raises(PluginError, match="unknown widget 'fancy'; known: plain, or 'package.module:name'"):
        registry.factory("fancy")
    builtins = {"arithmetic", "jsonl", "copy", "scratchpad", "agent", "terminal"}
    assert set(TASKS.names) == builtins  # built-ins register through the same seam


def test_a_users_task_is_named_by_import_path_and_its_options_validated_by_its_config() -> None:
    cfg = load_config(None, [f"task.type={HERE}:Tiny", "task.size=3"])
    task = build_task(cfg.task)
    assert isinstance(task, Tiny) and len(task.samples("train")) == 3
    assert cfg.task.reward_range == (0.0, 1.0)  # what every task declares stays a key of the section
    assert isinstance(build_task(load_config(None, [f"task.type={HERE}:NoOptions"]).task), NoOptions)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["task.sise=3"], r"task: .*Tiny options: sise: Extra inputs are not permitted"),
        (["task.size=many"], r"task: .*Tiny options: size: Input should be a valid integer"),
        ([f"task.type={HERE}:NoOptions", "task.size=3"], "unknown keys size: .*NoOptions takes no options"),
        (["task.type=miles_no_such_module_xyz:Env"], "task: task.type 'miles_no_such_module_xyz:Env': cannot import"),
        (["task.type=custom"], "unknown type 'custom'; expected one of .*, or 'package.module:Name' of your own"),
        (["rollout.engine.type=pkg:Engine"], "rollout.engine: an import path is not taken here"),
    ],
)
def test_bad_user_tasks_fail_the_recipe_in_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, [f"task.type={HERE}:Tiny", *overrides])
    assert "\n" not in str(info.value)


def test_what_is_not_a_task_is_refused_when_built() -> None:
    cfg = load_config(None, [f"task.type={HERE}:not_a_task"])
    with pytest.raises(PluginError, match="made a object, which lacks samples, environment, render"):
        build_task(cfg.task)


def test_the_cache_key_covers_the_users_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = tmp_path / "miles_user_task_xyz.py"
    module.write_text(Path(__file__).read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["task.type=miles_user_task_xyz:Tiny"])
    before = task_fingerprint(cfg.task)
    assert before["type_source_sha256"] == source_digest("miles_user_task_xyz:Tiny")
    module.write_text(module.read_text() + "\n# edited\n")
    assert task_fingerprint(cfg.task)["type_source_sha256"] != before["type_source_sha256"]
