"""A black-box agent written against an OpenAI-compatible endpoint only (plain httpx), on the real episode runner,
torch engine and tokenizers: the trained tokens are the engine's sampled ids, the agent's own text between calls
carries loss mask 0, and a call that rewrites history or comes after a limit is refused (HTTP 409), not
re-tokenised."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from miles.engines.base import SamplingParams
from miles.models import tiny
from miles.rollout.agent_env import AgentEnv
from miles.rollout.episode import EpisodeLimits
from miles.rollout.render import Renderer
from miles.tasks.base import Sample
from tests.helpers_tokenizers import bpe_chatml_tokenizer
from tests.unit.test_episode import Recording, _engine, play

SAMPLE = Sample(id="s0", prompt="2+3=", answer="5")
SEEN: dict[str, Any] = {}


async def _ask(client: httpx.AsyncClient, messages: list[dict[str, str]]) -> httpx.Response:
    return await client.post("/chat/completions", json={"model": "anything", "messages": messages, "temperature": 0.2})


async def two_calls(base_url: str, sample: Sample) -> float:
    """Ask, then append a message of its own and ask again; reward 1 if the second answer is the answer."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        models = (await client.get("/models")).json()
        messages = [{"role": "user", "content": sample.prompt}]
        first = (await _ask(client, messages)).json()["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "sure?"}]
        reply = await _ask(client, messages)
        SEEN.update(models=models, first=first, status=reply.status_code, reply=reply.json())
        if reply.status_code != 200:
            return 0.25  # refused: the agent still returns a reward
        second = reply.json()["choices"][0]["message"]["content"]
        SEEN["second"] = second
        return 1.0 if second.strip() == sample.answer else 0.0


async def rewrites_history(base_url: str, sample: Sample) -> float:
    """The second call drops the first answer (as a summarising agent would)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        await _ask(client, [{"role": "user", "content": sample.prompt}])
        reply = await _ask(client, [{"role": "user", "content": "forget that; " + sample.prompt}])
        SEEN.update(status=reply.status_code, reply=reply.json())
        return 0.5


@pytest.fixture(autouse=True)
def _clear() -> None:
    SEEN.clear()


@pytest.mark.parametrize("kind", ["char", "bpe"])
async def test_the_trained_tokens_are_the_sampled_ones_and_the_agents_text_is_masked(kind: str) -> None:
    tok = tiny.build_char_tokenizer() if kind == "char" else bpe_chatml_tokenizer()
    engine = Recording(_engine(tok))
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=[tok.eos_token_id])
    renderer = Renderer(tok, "chat")
    ep = await play(engine, renderer, AgentEnv(two_calls, SAMPLE), params, EpisodeLimits(max_turns=4), sample_id="s0")
    assert SEEN["models"]["data"][0]["id"] == "miles-policy" and SEEN["status"] == 200
    assert [who for _, _, who in ep.turns] == ["model", "env", "model"]
    model_spans = [(s, e) for s, e, who in ep.turns if who == "model"]
    sampled = [g.output_ids for g in engine.generations]
    assert [ep.token_ids[s:e] for s, e in model_spans] == sampled  # exactly the engine's ids, trained
    assert [renderer.decode(ids) for ids in sampled] == [SEEN["first"], SEEN["second"]]  # what the agent got
    (env_start, env_end, _) = ep.turns[1]
    assert set(ep.loss_mask[env_start:env_end]) == {0} and all(
        ep.loss_mask[s:e] == [1] * (e - s) for s, e in model_spans
    )
    assert "sure?" in tok.decode(ep.token_ids[env_start:env_end])  # the agent's message, tokenised once
    logprobs = [g.logprobs for g in engine.generations]
    assert [ep.logprobs[s:e] for s, e in model_spans] == logprobs and ep.logprobs[env_start:env_end] == [0.0] * (
        env_end - env_start
    )
    assert ep.reward in (0.0, 1.0) and ep.status == "ok" and ep.end_reason == "done" and ep.stats["turns"] == 2


async def test_a_call_that_rewrites_history_is_refused_and_counted_not_retokenised() -> None:
    tok = tiny.build_char_tokenizer()
    params = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=[tok.eos_token_id])
    env = AgentEnv(rewrites_history, SAMPLE)
    ep = await play(_engine(tok), Renderer(tok, "chat"), env, params, EpisodeLimits(max_turns=4))
    assert SEEN["status"] == 409 and "rewrites the conversation" in SEEN["reply"]["error"]["message"]
    assert ep.stats["agent_history_rewrites"] == 1 and ep.stats["turns"] == 1 and ep.reward == 0.5
    assert [who for _, _, who in ep.turns] == ["model"]  # only what the model saw in one sequence is trained


async def test_a_call_after_the_episodes_last_turn_is_refused_and_the_agent_still_scores() -> None:
    tok = tiny.build_char_tokenizer()
    params = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=[tok.eos_token_id])
    ep = await play(
        _engine(tok), Renderer(tok, "chat"), AgentEnv(two_calls, SAMPLE), params, EpisodeLimits(max_turns=1)
    )
    assert SEEN["status"] == 409 and "limit" in SEEN["reply"]["error"]["message"]
    assert ep.end_reason == "max_turns" and ep.reward == 0.25 and ep.status == "ok"


async def broken(base_url: str, sample: Sample) -> float:
    raise RuntimeError("no API key")


async def test_an_agent_that_fails_before_calling_the_model_is_excluded_not_a_crash() -> None:
    tok = tiny.build_char_tokenizer()
    params = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=[tok.eos_token_id])
    ep = await play(_engine(tok), Renderer(tok, "chat"), AgentEnv(broken, SAMPLE), params, EpisodeLimits())
    assert ep.status == "infra_error" and "raised RuntimeError: no API key" in ep.error
