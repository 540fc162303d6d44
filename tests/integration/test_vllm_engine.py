"""The vLLM engine against a real vLLM CPU server (no stand-in): generation with token ids and log-probs, a
verified weight update, a refused one, an update with requests in flight, and the server SIGKILLed mid-run.

The server comes from the cached vLLM environment (``miles vllm-env``; built by the first run, minutes).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from miles.config import LoraConfig, VllmEngineConfig
from miles.engines.base import SamplingParams
from miles.engines.vllm.engine import VllmEngine, VllmError
from miles.engines.vllm.env import ensure_vllm_env
from miles.sync.precision import state_digest

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PROMPT = [1, 20, 21, 22, 23]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama with head_dim 32 (vLLM's CPU attention needs >= 32), float32, saved as HF."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    out = tmp_path_factory.mktemp("vllm-model")
    model.save_pretrained(out)
    return out


async def make_engine(model_dir: Path, work: Path, version: int) -> VllmEngine:
    """An engine (not started) whose server the test's own vLLM environment runs, watched closely."""
    python = await asyncio.to_thread(ensure_vllm_env)
    cfg = VllmEngineConfig(python=str(python), max_context=128, health_every_s=0.5, hang_checks=4)
    return VllmEngine(
        cfg, model_dir, version=version, weights_dir=work / "weights", log_path=work / "vllm.log", max_context=128
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    eng = await make_engine(tiny_model_dir, tmp_path_factory.mktemp("vllm-engine"), version=0)
    await eng.start()
    yield eng
    await eng.close()


MAX_GAP = 1e-5  # float32 engine vs float32 torch: the step-0 expectation


def reference_logprobs(
    model_dir: Path, state: dict[str, torch.Tensor] | None, prompt: list[int], out: list[int]
) -> list[float]:
    """The sampled tokens' log-probs under HF transformers' forward of the same weights (temperature 1)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(out)]


async def wait_version(engine: VllmEngine, version: int, timeout_s: float = 60) -> None:
    async with asyncio.timeout(timeout_s):
        while engine.version < version:
            assert engine.last_error is None, engine.last_error
            await asyncio.sleep(0.05)


def scaled_state(model_dir: Path, factor: float) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    return {k: (v * factor).to(torch.bfloat16) for k, v in state.items()}


async def test_generation_returns_sampled_ids_with_their_logprobs(engine: VllmEngine, tiny_model_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=[])
    gens = await asyncio.gather(*(engine.generate(PROMPT, params) for _ in range(16)))
    assert {len(g.output_ids) for g in gens} == {12}
    assert all(g.finish_reason == "length" and g.version_spans == [(0, 0)] for g in gens)
    assert len({tuple(g.output_ids) for g in gens}) > 1  # sampled, not greedy
    gap = 0.0
    for gen in gens[:4]:
        ref = reference_logprobs(tiny_model_dir, None, PROMPT, gen.output_ids)
        gap = max(gap, max(abs(a - b) for a, b in zip(gen.logprobs, ref, strict=True)))
    assert gap <= MAX_GAP, f"engine vs torch log-prob gap {gap}"
    greedy = await engine.generate(PROMPT, SamplingParams(max_new_tokens=3, temperature=0.0, stop_token_ids=[2]))
    assert greedy.finish_reason in ("stop", "length") and len(greedy.logprobs) == len(greedy.output_ids)


async def test_a_weight_update_is_verified_by_the_server_and_changes_generation(
    engine: VllmEngine, tiny_model_dir: Path
) -> None:
    state = scaled_state(tiny_model_dir, 0.5)
    assert engine.stage_weights(state, 1)
    assert not engine.stage_weights(state, 1)  # not newer than what is staged
    await wait_version(engine, 1)
    assert await engine.held_digest() == state_digest(state)  # the server's own word
    gen = await engine.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=[]))
    assert gen.version_spans == [(0, 1)]
    ref = reference_logprobs(tiny_model_dir, state, PROMPT, gen.output_ids)
    assert max(abs(a - b) for a, b in zip(gen.logprobs, ref, strict=True)) <= MAX_GAP


async def test_a_file_whose_digest_differs_is_not_loaded(engine: VllmEngine, tiny_model_dir: Path) -> None:
    before, version = await engine.held_digest(), engine.version
    path, digest = engine._write(99, scaled_state(tiny_model_dir, 2.0))
    with pytest.raises(VllmError, match="not loaded"):
        await engine._rpc_load(path, "0" * 32)
    assert await engine.held_digest() == before and engine.version == version
    gen = await engine.generate(PROMPT, SamplingParams(max_new_tokens=2, temperature=1.0, stop_token_ids=[]))
    assert gen.weight_version == version
    del digest


async def test_an_update_with_requests_in_flight_splits_their_versions_exactly(
    engine: VllmEngine, tiny_model_dir: Path
) -> None:
    """The update is staged once the requests are observed decoding, not after a sleep: a one-token probe sent
    after them has come back, so the server (first come, first served) has admitted them and run a step.
    Then the test pauses the server itself, so they stay in flight however long the update takes to arrive
    (the engine's own pause and resume, around the load, end that pause). They need 120 tokens each; a batch
    that still ends between the probe and the pause (a machine stalled meanwhile) is played again at the next
    version. (vLLM's /metrics cannot tell: on this build it reports no running request until they have all
    finished.)"""
    n, new_tokens = 32, 120
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=[])
    probe = SamplingParams(max_new_tokens=1, temperature=1.0, stop_token_ids=[])
    split: list = []
    for attempt in range(3):
        start = engine.version
        tasks = [asyncio.create_task(engine.generate(PROMPT, params)) for _ in range(n)]
        await asyncio.sleep(0)  # every request task takes its first step (its connection) before the probe's
        await engine.generate(PROMPT, probe)
        await engine._call("POST", "/pause", params={"mode": "keep"})  # frozen until the engine's switch resumes
        state = scaled_state(tiny_model_dir, 0.75 - 0.05 * attempt)
        assert engine.stage_weights(state, start + 1)
        gens = await asyncio.gather(*tasks)
        await wait_version(engine, start + 1)
        assert all(len(g.output_ids) == new_tokens for g in gens)
        versions = {v for g in gens for _, v in g.version_spans}
        assert versions <= {start, start + 1}
        split = [g for g in gens if len(g.version_spans) == 2]
        if split:
            break
    assert split, "no request was in flight across the update in 3 batches observed decoding"
    for gen in split:
        (_, v0), (cut, v1) = gen.version_spans
        assert (v0, v1) == (start, start + 1) and 0 < cut < len(gen.output_ids)
        # Tokens after the cut were sampled by the new weights: their log-probs are the new model's.
        ref = reference_logprobs(tiny_model_dir, state, PROMPT, gen.output_ids)
        assert max(abs(a - b) for a, b in zip(gen.logprobs[cut:], ref[cut:], strict=True)) <= MAX_GAP
    assert engine.last_pause_s > 0


async def test_a_killed_server_is_restarted_with_the_held_weights_and_no_request_is_lost(
    engine: VllmEngine,
) -> None:
    """The server is stopped (SIGSTOP) before the requests are sent, so all 16 are certainly in flight, sent
    and unanswered, when it is killed: a fast server cannot finish them first."""
    assert engine.server is not None
    held, version, restarts, resent = await engine.held_digest(), engine.version, engine.restarts, engine.resent
    params = SamplingParams(max_new_tokens=60, temperature=1.0, stop_token_ids=[])
    pid = engine.server.pid
    os.killpg(pid, signal.SIGSTOP)
    tasks = [asyncio.create_task(engine.generate(PROMPT, params)) for _ in range(16)]
    async with asyncio.timeout(60):
        while engine.requests_in_flight < 16:
            await asyncio.sleep(0.01)
    os.killpg(pid, signal.SIGKILL)
    gens = await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
    assert len(gens) == 16 and all(len(g.output_ids) == 60 for g in gens)
    assert engine.restarts == restarts + 1 and engine.resent == resent + 16
    assert engine.heartbeat_stats()["engine_restarts"] == restarts + 1
    assert engine.version == version and await engine.held_digest() == held
    assert all(g.version_spans == [(0, version)] for g in gens)


def ulp_moves(state: dict[str, torch.Tensor], frac: float = 0.02) -> dict[str, torch.Tensor]:
    """``state`` (bf16) with ``frac`` of every tensor's elements moved by one ulp: an Adam step's delta."""
    gen = torch.Generator().manual_seed(3)
    out = {}
    for name, t in state.items():
        bits = t.contiguous().view(torch.int16).clone().reshape(-1)
        hit = (torch.rand(bits.numel(), generator=gen) < frac) & (t.reshape(-1) != 0)
        bits[hit] += 1
        out[name] = bits.view(torch.bfloat16).reshape(t.shape)
    return out


async def test_delta_versions_reach_the_server_with_the_trainers_digest(
    engine: VllmEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """sync.mode delta end to end over a real nats-server: the trainer side publishes a full anchor then a
    delta, the worker's follower decodes through the engine's own weight sink, and the server reports holding
    exactly the state the trainer's digest names."""
    from miles.bus.client import Bus
    from miles.bus.server import EmbeddedNats
    from miles.config import BusConfig
    from miles.sync.follower import WeightFollower
    from miles.sync.publisher import WeightPublisher, delta_keep_versions
    from miles.sync.transport.dataplane import WeightStore

    from .sync_helpers import running

    first = engine.version + 10
    async with EmbeddedNats(tmp_path / "bus") as server:
        bus = await Bus.open(BusConfig(), server.url, "vdelta", "test")
        try:
            full = await WeightStore.create(bus.js, "vdelta", keep_versions=3)
            delta = await WeightStore.create(bus.js, "vdelta", keep_versions=delta_keep_versions(3, 100), kind="delta")
            pub = WeightPublisher(bus, full, "bfloat16", mode="delta", delta_store=delta, anchor_every=100)
            follower = WeightFollower(
                bus, full, engine, delta_store=delta, decoder=engine.weight_sink("bfloat16", None)
            )
            anchor = scaled_state(tiny_model_dir, 0.9)
            step = ulp_moves(anchor)
            async with running(follower) as stopping:
                assert (await pub.publish(anchor, first)).announcement.mode == "full"
                assert await asyncio.wait_for(follower.wait_for(first, stopping), 60)
                await wait_version(engine, first)
                ann = (await pub.publish(step, first + 1)).announcement
                assert ann.mode == "delta" and ann.base_version == first
                assert await asyncio.wait_for(follower.wait_for(first + 1, stopping), 60)
                await wait_version(engine, first + 1)
            assert follower.checksum_failures == 0 and follower.delta_fallbacks == 0
            assert await engine.held_digest() == ann.state_digest == state_digest(step)
        finally:
            await bus.close()


LORA = LoraConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lora_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A second server, started with LoRA serving: sync.mode lora on vLLM."""
    eng = await make_engine(tiny_model_dir, tmp_path_factory.mktemp("vllm-lora"), version=-1)
    eng.serve_adapters(LORA)
    await eng.start()
    yield eng
    await eng.close()


def random_adapter(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    adapter = {}
    for layer in range(2):
        for module in LORA.target_modules:
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            adapter[f"{key}.lora_A.weight"] = (0.3 * torch.randn(LORA.rank, 64)).bfloat16()
            adapter[f"{key}.lora_B.weight"] = (0.3 * torch.randn(64, LORA.rank)).bfloat16()
    return adapter


async def served_adapters(engine: VllmEngine) -> set[str]:
    reply = await engine._call("GET", "/v1/models")
    return {m["id"] for m in reply["data"]} - {str(engine.model_dir)}


async def test_lora_versions_are_served_as_adapters_without_a_pause(
    lora_engine: VllmEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """sync.mode lora over a real nats-server into a server that applies the adapter itself: only the adapter
    travels and is loaded (no merged model), the server checks the file's digest first, requests started before
    a load keep their adapter (per-token versions exact), and log-probs match HF's forward of base + merged
    adapter. Adapters no request names any more are unloaded."""
    from safetensors.torch import load_file

    from miles.bus.client import Bus
    from miles.bus.server import EmbeddedNats
    from miles.config import BusConfig
    from miles.sync.follower import WeightFollower
    from miles.sync.lora import merge_adapter
    from miles.sync.publisher import WeightPublisher
    from miles.sync.transport.dataplane import WeightStore

    from .sync_helpers import running

    engine = lora_engine
    adapters = {v: random_adapter(v) for v in (1, 2, 3)}
    async with EmbeddedNats(tmp_path / "bus") as server:
        bus = await Bus.open(BusConfig(), server.url, "vlora", "test")
        try:
            store = await WeightStore.create(bus.js, "vlora", keep_versions=3)
            pub = WeightPublisher(bus, store, "bfloat16", mode="lora")
            sink = engine.weight_sink("bfloat16", LORA.alpha / LORA.rank)
            follower = WeightFollower(bus, store, engine, decoder=sink)
            async with running(follower) as stopping:
                published = await pub.publish(adapters[1], 1)
                assert await asyncio.wait_for(follower.wait_for(1, stopping), 60)
                await wait_version(engine, 1)
                assert follower.staged_versions[1].state_digest == published.announcement.state_digest
                assert published.announcement.size < 0.2 * (tiny_model_dir / "model.safetensors").stat().st_size
                assert await served_adapters(engine) == {"miles-v1"}
                assert engine.last_pause_s == 0.0 and engine.failures == 0

                six = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=[])
                gen = await engine.generate(PROMPT, six)
                assert gen.version_spans == [(0, 1)]
                base = load_file(str(tiny_model_dir / "model.safetensors"))
                merged = base | merge_adapter(base, adapters[1], LORA.alpha / LORA.rank, dtype=torch.float32)
                ref = reference_logprobs(tiny_model_dir, merged, PROMPT, gen.output_ids)
                assert max(abs(a - b) for a, b in zip(gen.logprobs, ref, strict=True)) <= 1e-4
                plain = reference_logprobs(tiny_model_dir, None, PROMPT, gen.output_ids)
                assert max(abs(a - b) for a, b in zip(gen.logprobs, plain, strict=True)) > 1e-2  # it is applied

                # Requests in flight when adapter 2 loads: a probe sent after them has come back, so they run.
                params = SamplingParams(max_new_tokens=100, temperature=1.0, stop_token_ids=[])
                running_requests = [asyncio.create_task(engine.generate(PROMPT, params)) for _ in range(8)]
                await asyncio.sleep(0)
                probe = SamplingParams(max_new_tokens=1, temperature=1.0, stop_token_ids=[])
                assert (await engine.generate(PROMPT, probe)).version_spans == [(0, 1)]
                await pub.publish(adapters[2], 2)
                await wait_version(engine, 2)
                assert (await engine.generate(PROMPT, probe)).version_spans == [(0, 2)]
                finished = await asyncio.gather(*running_requests)
                assert all(g.version_spans == [(0, 1)] for g in finished)  # one adapter for a whole request

                await pub.publish(adapters[3], 3)
                await wait_version(engine, 3)
                async with asyncio.timeout(30):  # unloaded right after the switch: 1 and 2, nothing names them
                    while await served_adapters(engine) != {"miles-v3"}:
                        await asyncio.sleep(0.05)
                assert not (engine.weights_dir / "lora-v1").exists() and (engine.weights_dir / "lora-v3").is_dir()
        finally:
            await bus.close()
