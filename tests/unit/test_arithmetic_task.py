"""ArithmeticTask: deterministic disjoint splits, correct answers, exact-answer reward; evaluate()."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from miles.config import ArithmeticTaskConfig
from miles.engines.base import Generation, SamplingParams
from miles.models.tiny import build_char_tokenizer
from miles.rollout.episode import EpisodeLimits
from miles.rollout.evaluate import evaluate
from miles.rollout.render import Renderer
from miles.tasks.arithmetic import ArithmeticTask
from miles.tasks.base import Sample, first_answer
from miles.tasks.registry import build_task


def test_splits_are_deterministic_and_seed_dependent() -> None:
    a = ArithmeticTask(ArithmeticTaskConfig(seed=3))
    b = ArithmeticTask(ArithmeticTaskConfig(seed=3))
    c = ArithmeticTask(ArithmeticTaskConfig(seed=4))
    for split in ("train", "eval"):
        assert [s.prompt for s in a.samples(split)] == [s.prompt for s in b.samples(split)]
        assert [s.prompt for s in a.samples(split)] != [s.prompt for s in c.samples(split)]


@pytest.mark.parametrize("ops", [["+"], ["-"], ["+", "-", "*"]])
def test_eval_is_disjoint_from_train_and_sizes_match(ops: list[str]) -> None:
    cfg = ArithmeticTaskConfig(operations=ops, max_operand=12, train_size=3000, eval_size=50, seed=1)
    task = ArithmeticTask(cfg)
    train, held_out = task.samples("train"), task.samples("eval")
    assert len(train) == 3000 and len(held_out) == 50
    eval_prompts = [s.prompt for s in held_out]
    assert len(set(eval_prompts)) == len(eval_prompts)
    assert not set(eval_prompts) & {s.prompt for s in train}
    assert len({s.id for s in train + held_out}) == len(train) + len(held_out)


def test_answers_are_correct_including_negative() -> None:
    task = ArithmeticTask(ArithmeticTaskConfig(operations=["+", "-", "*"], max_operand=9, train_size=500))
    negatives = 0
    for s in task.samples("train") + task.samples("eval"):
        a, op, b = s.meta["a"], s.meta["op"], s.meta["b"]
        assert s.prompt == f"{a}{op}{b}="
        assert 0 <= a <= 9 and 0 <= b <= 9
        assert int(s.answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
        negatives += s.answer.startswith("-")
    assert negatives > 0


def test_eval_size_must_leave_training_problems() -> None:
    with pytest.raises(ValueError, match="eval_size"):
        ArithmeticTask(ArithmeticTaskConfig(max_operand=2, eval_size=9))  # only 9 distinct problems


def test_unknown_split_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown split"):
        ArithmeticTask(ArithmeticTaskConfig()).samples("test")


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("19", "19", 1.0),
        (" 19 ", "19", 1.0),
        ("19<eos>", "19", 1.0),
        ("19<eos>junk", "19", 1.0),
        ("19 20", "19", 1.0),
        ("19\n7", "19", 1.0),
        ("190", "19", 0.0),
        ("1", "19", 0.0),
        ("", "19", 0.0),
        ("<eos>19", "19", 0.0),
        ("-3", "-3", 1.0),
        ("3", "-3", 0.0),
        ("- 3", "-3", 0.0),
    ],
)
def test_reward_is_exact_first_token(completion: str, answer: str, reward: float) -> None:
    task = ArithmeticTask(ArithmeticTaskConfig(operations=["-"], max_operand=5, train_size=10, eval_size=5))
    sample = Sample(id="x", prompt="?", answer=answer)
    assert task.reward(completion, sample) == reward


def test_first_answer_cuts_at_whitespace_and_end_markers() -> None:
    assert first_answer("  42 and more") == "42"
    assert first_answer("42</s>") == "42"
    assert first_answer("\t") == ""


def test_build_task_dispatches_arithmetic() -> None:
    assert isinstance(build_task(ArithmeticTaskConfig()), ArithmeticTask)


class ScriptedEngine:
    """Engine stand-in (control logic only) that answers correctly for prompts in ``right``, '0' otherwise."""

    max_context = 512
    error = None

    def __init__(self, tokenizer: PreTrainedTokenizerFast, task: ArithmeticTask, right: set[str]) -> None:
        self.tokenizer, self.right = tokenizer, right
        self.answers = {s.prompt: s.answer for s in task.samples("eval")}
        self.calls: list[SamplingParams] = []

    @property
    def version(self) -> int:
        return 0

    async def generate(self, ids: list[int], params: SamplingParams) -> Generation:
        self.calls.append(params)
        prompt = self.tokenizer.decode(ids, skip_special_tokens=True)
        text = self.answers[prompt] if prompt in self.right else "0"
        tokens = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Generation(list(ids), tokens, [0.0] * len(tokens), "stop", 0)


async def test_evaluate_is_greedy_mean_reward() -> None:
    tokenizer = build_char_tokenizer()
    task = ArithmeticTask(ArithmeticTaskConfig(eval_size=10, train_size=10))
    samples = task.samples("eval")
    right = {s.prompt for s in samples[:3] if s.answer != "0"}
    engine = ScriptedEngine(tokenizer, task, right)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=[tokenizer.eos_token_id])
    out = await evaluate(engine, Renderer(tokenizer, "raw"), task, samples, params, EpisodeLimits())  # type: ignore[arg-type]
    expected = sum(1 for s in samples if s.prompt in right or s.answer == "0") / len(samples)
    assert out.accuracy == pytest.approx(expected) and out.samples == 10 and out.failed == 0
    assert all(p.temperature == 0 and p.max_new_tokens == 4 for p in engine.calls)
    empty = await evaluate(engine, Renderer(tokenizer, "raw"), task, [], params, EpisodeLimits())  # type: ignore[arg-type]
    assert empty.accuracy == 0.0
