"""A black-box agent (plain httpx against the worker's chat endpoint) plays episodes on a real vLLM CPU server:
the trained tokens are the ids vLLM sampled, the agent's own text between calls has loss mask 0."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from miles.config import VllmEngineConfig
from miles.engines.base import SamplingParams
from miles.engines.vllm.engine import VllmEngine
from miles.engines.vllm.env import ensure_vllm_env
from miles.models import tiny
from miles.rollout.agent_env import AgentEnv
from miles.rollout.episode import EpisodeLimits, run_episode
from miles.rollout.render import Renderer
from tests.unit.test_agent_endpoint import SAMPLE, SEEN, Recording, two_calls

pytestmark = pytest.mark.slow


def _model_dir(out: Path) -> Path:
    """A random 2-layer Llama over the character tokenizer (head_dim 32: vLLM's CPU attention needs >= 32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny.build_char_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_an_agent_plays_through_the_endpoint_on_vllm(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path / "model")
    tok = tiny.build_char_tokenizer()

    async def play() -> tuple[Recording, object]:
        python = await asyncio.to_thread(ensure_vllm_env)
        cfg = VllmEngineConfig(python=str(python), max_context=256)
        work = tmp_path / "vllm"
        engine = VllmEngine(
            cfg, model_dir, version=0, weights_dir=work / "weights", log_path=work / "vllm.log", max_context=256
        )
        await engine.start()
        try:
            recording = Recording(engine)
            params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=[tok.eos_token_id])
            env = AgentEnv(two_calls, SAMPLE)
            episode = await run_episode(recording, Renderer(tok, "chat"), env, params, EpisodeLimits(max_turns=4))
            return recording, episode
        finally:
            await engine.close()

    recording, ep = asyncio.run(play())
    assert SEEN["status"] == 200
    model_spans = [(s, e) for s, e, who in ep.turns if who == "model"]  # type: ignore[attr-defined]
    assert [ep.token_ids[s:e] for s, e in model_spans] == [g.output_ids for g in recording.generations]  # type: ignore[attr-defined]
    (env_start, env_end, who) = ep.turns[1]  # type: ignore[attr-defined]
    assert who == "env" and set(ep.loss_mask[env_start:env_end]) == {0}  # type: ignore[attr-defined]
    assert ep.status == "ok" and ep.stats["turns"] == 2  # type: ignore[attr-defined]
