"""The episode runner on a real tiny model: token-exact multi-turn episodes, masks, limits and failures.

The environments here are small scripted ones (the terminal environment with a real sandbox has its own
tests); the engine and the tokenizers are real.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from miles.config import TinyModelConfig
from miles.engines.base import Generation, SamplingParams
from miles.engines.registry import build_engine
from miles.models import tiny
from miles.rollout.env import EnvStep, InfraError
from miles.rollout.episode import EpisodeLimits, run_episode
from miles.rollout.render import Renderer
from miles.rollout.single_turn import SingleTurnEnv
from tests.helpers_tokenizers import bpe_chatml_tokenizer


class Recording:
    """The real engine, plus a record of every generation it returned (what the model sampled)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.generations: list[Generation] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        gen = await self.engine.generate(prompt_ids, params)
        self.generations.append(gen)
        return gen


class ScriptedEnv:
    """Answers every model turn with the next observation; done after ``turns`` model turns."""

    def __init__(self, turns: int, reward: Any = 1.0, fail: str | None = None) -> None:
        self.turns, self._reward, self.fail = turns, reward, fail
        self.seen: list[str] = []
        self.closed = False

    async def reset(self) -> list[dict[str, str]]:
        if self.fail == "reset":
            raise InfraError("sandbox did not start")
        return [{"role": "user", "content": "look at the file"}]

    async def step(self, action: str) -> EnvStep:
        self.seen.append(action)
        if self.fail == "step":
            raise RuntimeError("the shell died")
        if self.fail == "slow":
            await asyncio.sleep(5)
        if len(self.seen) >= self.turns:
            return EnvStep(done=True, end_reason="done", info={"tool_calls": 1.0})
        return EnvStep(messages=[{"role": "user", "content": f"obs {len(self.seen)}"}], info={"tool_calls": 1.0})

    async def reward(self) -> Any:
        if callable(self._reward):
            return self._reward()
        return self._reward

    async def close(self) -> None:
        self.closed = True


def _engine(tokenizer: Any, seed: int = 0) -> Any:
    from miles.engines.torch_engine import TorchEngine

    cfg = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, seed=seed)
    torch.manual_seed(seed)
    model = tiny.build_tiny_model(cfg, tiny.build_char_tokenizer())
    if len(tokenizer) != model.config.vocab_size:
        model.resize_token_embeddings(len(tokenizer))
    return TorchEngine(model, tokenizer.pad_token_id, version=3, seed=seed)


async def play(engine: Any, *args: Any, **kw: Any) -> Any:
    async with engine.engine if isinstance(engine, Recording) else engine:
        return await run_episode(engine, *args, **kw)


PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)


@pytest.mark.parametrize("kind", ["char", "bpe"])
async def test_multi_turn_episode_is_token_exact(kind: str) -> None:
    tok = tiny.build_char_tokenizer() if kind == "char" else bpe_chatml_tokenizer()
    engine = Recording(_engine(tok))
    env = ScriptedEnv(turns=4)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=[tok.eos_token_id])
    ep = await play(engine, Renderer(tok, "chat"), env, params, EpisodeLimits(max_turns=8), sample_id="s")
    assert ep.end_reason == "done" and ep.status == "ok" and ep.reward == 1.0 and env.closed
    model_turns = [t for t in ep.turns if t[2] == "model"]
    assert len(model_turns) == 4 == len(engine.generations)
    for (start, end, _), gen in zip(model_turns, engine.generations, strict=True):
        assert ep.token_ids[start:end] == gen.output_ids  # exactly what was sampled
        assert ep.logprobs[start:end] == gen.logprobs
        assert ep.loss_mask[start:end] == [1] * len(gen.output_ids)
    for start, end, role in ep.turns:
        if role == "env":
            assert ep.loss_mask[start:end] == [0] * (end - start)
    assert sum(ep.loss_mask) == sum(len(g.output_ids) for g in engine.generations)
    # every model turn was generated from exactly the accumulated sequence before it
    for (start, _, _), gen in zip(model_turns, engine.generations, strict=True):
        assert gen.prompt_ids == ep.prompt_ids + ep.token_ids[:start]
    assert ep.stats["turns"] == 4 and ep.stats["tool_calls"] == 4
    assert ep.weight_version == 3


async def test_single_turn_scored_on_the_text() -> None:
    tok = tiny.build_char_tokenizer()
    from miles.rollout.env import EpisodeSpec

    got: list[Any] = []

    def reward(text: str, sample: Any) -> float:
        got.append((text, sample.meta))
        return 0.5

    env = SingleTurnEnv(EpisodeSpec("s1", "3+4=", "7", {"difficulty": 2}), reward)
    ep = await play(_engine(tok), Renderer(tok, "raw"), env, PARAMS, EpisodeLimits())
    assert ep.reward == 0.5 and ep.end_reason == "done" and len(ep.turns) == 1
    assert ep.prompt_ids == [tok.bos_token_id, *tok.encode("3+4=")]
    assert got[0][1] == {"difficulty": 2}  # the reward sees the sample's fields


async def test_a_user_reward_runs_off_the_loop_and_a_builtin_string_check_on_it() -> None:
    import threading

    from miles.rollout.env import EpisodeSpec
    from miles.tasks.arithmetic import ArithmeticTask
    from miles.tasks.jsonl import JsonlTask

    assert ArithmeticTask.reward_inline and not JsonlTask.reward_inline
    threads: list[int] = []

    def reward(text: str, sample: Any) -> float:
        threads.append(threading.get_ident())
        return 1.0

    spec = EpisodeSpec("s1", "3+4=", "7", {})
    for inline in (False, True):
        env = SingleTurnEnv(spec, reward, inline=inline)
        await env.step("7")
        assert await env.reward() == 1.0
    assert threads[0] != threading.get_ident() and threads[1] == threading.get_ident()


@pytest.mark.parametrize("bad", [float("nan"), None, "x", math.inf])
async def test_a_bad_reward_fails_the_sample_only(bad: Any) -> None:
    tok = tiny.build_char_tokenizer()
    ep = await play(_engine(tok), Renderer(tok, "chat"), ScriptedEnv(1, reward=bad), PARAMS, EpisodeLimits())
    assert ep.status == "reward_failed" and ep.reward is None and "not a finite number" in ep.error


async def test_a_reward_outside_the_tasks_range_fails_the_sample_on_the_worker() -> None:
    """The trainer would refuse it as a dishonest worker's; the worker's own episode says why instead."""
    tok = tiny.build_char_tokenizer()
    limits = EpisodeLimits(reward_range=(0.0, 1.0))
    ep = await play(_engine(tok), Renderer(tok, "chat"), ScriptedEnv(1, reward=2.5), PARAMS, limits)
    assert ep.status == "reward_failed" and "outside task.reward_range [0.0, 1.0]" in ep.error
    ok = await play(_engine(tok), Renderer(tok, "chat"), ScriptedEnv(1, reward=1.0), PARAMS, limits)
    assert ok.status == "ok" and ok.reward == 1.0


async def test_a_raising_reward_fails_the_sample_only() -> None:
    tok = tiny.build_char_tokenizer()

    def boom() -> float:
        raise KeyError("difficulty")

    ep = await play(_engine(tok), Renderer(tok, "chat"), ScriptedEnv(1, reward=boom), PARAMS, EpisodeLimits())
    assert ep.status == "reward_failed" and "KeyError" in ep.error


async def test_infrastructure_failure_is_marked_not_scored() -> None:
    tok = tiny.build_char_tokenizer()
    env = ScriptedEnv(1, fail="reset")
    ep = await play(_engine(tok), Renderer(tok, "chat"), env, PARAMS, EpisodeLimits())
    assert ep.status == "infra_error" and ep.end_reason == "infra_error" and ep.reward is None and env.closed


async def test_limits_end_the_episode_with_their_reason() -> None:
    tok = tiny.build_char_tokenizer()
    renderer = Renderer(tok, "chat")
    ep = await play(_engine(tok), renderer, ScriptedEnv(10), PARAMS, EpisodeLimits(max_turns=3))
    assert ep.end_reason == "max_turns" and ep.stats["turns"] == 3 and ep.status == "ok"
    ep = await play(_engine(tok), renderer, ScriptedEnv(10), PARAMS, EpisodeLimits(max_turns=10, max_tokens=20))
    assert ep.end_reason == "context_full" and len(ep.token_ids) <= 20
    ep = await play(
        _engine(tok), renderer, ScriptedEnv(10, fail="slow"), PARAMS, EpisodeLimits(max_turns=5, timeout_s=0.5)
    )
    assert ep.end_reason == "timeout" and ep.status == "ok"  # still scored by its verifier
    ep = await play(_engine(tok), renderer, ScriptedEnv(10, fail="step"), PARAMS, EpisodeLimits(max_turns=5))
    assert ep.end_reason == "env_error" and "shell died" in ep.error and ep.status == "ok"


def test_engine_registry_builds_the_tiny_model(tmp_path: Any) -> None:
    tok = tiny.build_char_tokenizer()
    model = tiny.build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2), tok)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    from miles.config import TorchEngineConfig

    engine = build_engine(TorchEngineConfig(), tmp_path, -1, 0)
    assert engine.version == -1 and engine.max_context == 512
