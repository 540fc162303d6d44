"""JsonlTask: rows become samples, malformed files and bad reward paths fail with precise messages."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles.config import JsonlTaskConfig
from miles.tasks.base import Sample
from miles.tasks.jsonl import JsonlTask, TaskError, load_reward_fn
from miles.tasks.registry import build_task

REWARD_MODULE = """
def exact(completion, sample):
    return completion.strip() == sample.answer

class Scorer:
    @staticmethod
    def prefix(completion, sample):
        return 0.5 if completion.startswith(sample.meta["hint"]) else 0.0

NOT_CALLABLE = 3
"""


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A user reward module importable as ``user_rewards_<id>`` (unique so tests never share a cached import)."""
    name = f"user_rewards_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def write_jsonl(path: Path, rows: list[object]) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def make_cfg(tmp_path: Path, module: str, train: list[object] | None = None, **kw: str) -> JsonlTaskConfig:
    train_rows = train if train is not None else [{"prompt": "2+2=", "answer": "4"}, "", {"prompt": "q", "answer": 7}]
    return JsonlTaskConfig(
        train_path=write_jsonl(tmp_path / "train.jsonl", train_rows),
        eval_path=write_jsonl(tmp_path / "eval.jsonl", [{"id": "e1", "prompt": "1+1=", "answer": "2", "hint": "2"}]),
        reward=kw.pop("reward", f"{module}:exact"),
        **kw,
    )


def test_rows_become_samples_and_reward_delegates(tmp_path: Path, reward_module: str) -> None:
    task = build_task(make_cfg(tmp_path, reward_module))
    assert isinstance(task, JsonlTask)
    train = task.samples("train")
    assert [(s.id, s.prompt, s.answer) for s in train] == [("train-1", "2+2=", "4"), ("train-3", "q", "7")]
    (ev,) = task.samples("eval")
    assert ev == Sample(id="e1", prompt="1+1=", answer="2", meta={"id": "e1", "hint": "2"})
    assert task.reward(" 4 ", train[0]) == 1.0 and isinstance(task.reward("5", train[0]), float)
    assert task.reward("5", train[0]) == 0.0


def test_custom_fields_and_dotted_reward(tmp_path: Path, reward_module: str) -> None:
    rows = [{"question": "x", "gold": "y", "hint": "y"}]
    cfg = make_cfg(tmp_path, reward_module, train=rows, reward=f"{reward_module}:Scorer.prefix")
    cfg = cfg.model_copy(update={"prompt_field": "question", "answer_field": "gold"})
    (tmp_path / "eval.jsonl").write_text(json.dumps(rows[0]) + "\n")
    task = JsonlTask(cfg)
    (s,) = task.samples("train")
    assert (s.prompt, s.answer) == ("x", "y")
    assert task.reward("yes", s) == 0.5


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (['{"prompt": "a", "answer": "b"}', "{not json"], r"train\.jsonl:2: not valid JSON"),
        ([{"prompt": "a", "answer": "b"}, [1, 2]], r"train\.jsonl:2: expected a JSON object"),
        ([{"prompt": "a", "answer": "b"}, "", {"prompt": "a"}], r"train\.jsonl:3: missing field 'answer'"),
        ([{"answer": "b"}], r"train\.jsonl:1: missing field 'prompt'"),
        ([{"prompt": 3, "answer": "b"}], r"train\.jsonl:1: field 'prompt' must be a string"),
        ([""], r"train\.jsonl: train file has no rows"),
    ],
)
def test_malformed_rows_name_file_and_line(
    tmp_path: Path, reward_module: str, rows: list[object], message: str
) -> None:
    with pytest.raises(TaskError, match=message):
        JsonlTask(make_cfg(tmp_path, reward_module, train=rows))


def test_missing_file_is_named(tmp_path: Path, reward_module: str) -> None:
    cfg = make_cfg(tmp_path, reward_module).model_copy(update={"eval_path": str(tmp_path / "gone.jsonl")})
    with pytest.raises(TaskError, match=r"gone\.jsonl: eval file not found"):
        JsonlTask(cfg)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "must have the form"),
        ("{mod}:", "must have the form"),
        ("miles_no_such_module_xyz:f", "cannot import module 'miles_no_such_module_xyz'"),
        ("{mod}:missing", "has no attribute 'missing'"),
        ("{mod}:NOT_CALLABLE", "is not callable"),
    ],
)
def test_bad_reward_paths_are_explained(reward_module: str, spec: str, message: str) -> None:
    with pytest.raises(TaskError, match=message):
        load_reward_fn(spec.format(mod=reward_module))


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]


def test_a_conversational_row_is_rendered_with_the_chat_template_token_exact(
    tmp_path: Path, reward_module: str
) -> None:
    from miles.models.tiny import build_char_tokenizer
    from miles.rollout.env import EpisodeSpec
    from miles.rollout.render import Renderer
    from miles.rollout.single_turn import SingleTurnEnv

    rows = [{"prompt": CONVERSATION, "answer": "4"}]
    task = build_task(make_cfg(tmp_path, reward_module, train=rows, render="chat"))
    (sample,) = task.samples("train")
    assert sample.prompt == "2+2=" and task.render == "chat"  # the text of its last (user) message
    env = SingleTurnEnv(EpisodeSpec(sample.id, sample.prompt, sample.answer, sample.meta), task.reward)
    opening = asyncio.run(env.reset())
    assert opening == CONVERSATION
    tok = build_char_tokenizer()
    want = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    assert Renderer(tok, "chat").initial(opening) == list(want["input_ids"] if hasattr(want, "keys") else want)
    assert task.demonstration(sample) == [*CONVERSATION, {"role": "assistant", "content": "4"}]


@pytest.mark.parametrize(
    ("prompt", "render", "message"),
    [
        (CONVERSATION, "raw", "a prompt given as messages needs task.render chat"),
        ([{"role": "user"}], "chat", r"prompt'\[0\] must be an object with a 'role' and a text 'content'"),
        ([{"role": "assistant", "content": "x"}], "chat", "ending with a user message"),
        (3, "chat", "must be a string or a list of messages"),
    ],
)
def test_bad_conversations_are_named(
    tmp_path: Path, reward_module: str, prompt: object, render: str, message: str
) -> None:
    with pytest.raises(TaskError, match=message):
        build_task(make_cfg(tmp_path, reward_module, train=[{"prompt": prompt, "answer": "4"}], render=render))


def test_render_auto_is_chat_for_pretrained_models_and_raw_for_the_tiny_one(tmp_path: Path, reward_module: str) -> None:
    from miles.config import load_config

    base = ["task.type=jsonl", "task.train_path=t", "task.eval_path=e", f"task.reward={reward_module}:exact"]
    assert load_config(None, base).task.render == "raw"  # type: ignore[union-attr]
    pretrained = load_config(None, [*base, "model.type=pretrained", "model.path=/m"])
    assert pretrained.task.render == "chat"  # type: ignore[union-attr]
    assert load_config(None, [*base, "model.type=pretrained", "model.path=/m", "task.render=raw"]).task.render == "raw"  # type: ignore[union-attr]
