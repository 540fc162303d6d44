"""TorchEngine on a real (random-init) tiny Llama: continuous batching, log-probs, per-request parameters, stops,
the context window, cancellation, shared prefills, weight switches in flight, pinning and loop failures."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch
from transformers import DynamicCache, LlamaForCausalLM, PreTrainedTokenizerFast

from miles.config import TinyModelConfig, TorchEngineConfig
from miles.engines.base import EngineError, Generation, SamplingParams
from miles.engines.batch import generate_all, generate_all_sync
from miles.engines.model_forward import hf_forward
from miles.engines.registry import build_engine
from miles.engines.torch_engine import TorchEngine
from miles.engines.torch_loop import Request
from miles.models import tiny
from miles.models.loading import encode_prompt

CFG = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4)
PROMPTS_TEXT = ["1+2=", "13+27=", "7=", "30+30=", "0+0=", "9+11="]  # different lengths: left padding matters


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return tiny.build_char_tokenizer()


@pytest.fixture(scope="module")
def prompts(tok: PreTrainedTokenizerFast) -> list[list[int]]:
    return encode_all(tok, PROMPTS_TEXT)


def encode_all(tok: PreTrainedTokenizerFast, texts: list[str]) -> list[list[int]]:
    return [encode_prompt(tok, p) for p in texts]


def make_model(tok: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    return tiny.build_tiny_model(CFG.model_copy(update={"seed": seed}), tok).eval()


def make_engine(tok: PreTrainedTokenizerFast, model_seed: int = 0, **kw: object) -> TorchEngine:
    """An engine (not started) over the tiny Llama initialised with ``model_seed``; ``kw`` go to TorchEngine."""
    return TorchEngine(make_model(tok, model_seed), tok.pad_token_id, **kw)  # type: ignore[arg-type]


def teacher_forced_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int], temp: float) -> list[float]:
    """log_softmax(logits / T) of ``output`` given ``prompt``, from one unpadded, uncached forward."""
    ids = torch.tensor([prompt + output])  # (1, P + N)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # (P + N, V)
    logp = torch.log_softmax(logits / (temp if temp > 0 else 1.0), dim=-1)
    steps = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[steps, torch.tensor(output)].tolist()


async def one_at_a_time(engine: TorchEngine, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
    return [await engine.generate(p, params) for p in prompts]


async def until(predicate: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


class ForwardGate:
    """Records the input shape of every model forward (0 = the first) and can hold forward ``hold`` until
    released, so a test can act while the loop thread is mid-batch (stage weights, submit, cancel).

    It hooks the input embedding, which the HF forward and the lean one both call once per forward."""

    def __init__(self, model: LlamaForCausalLM, hold: int | None = None) -> None:
        self.shapes: list[tuple[int, int]] = []  # (rows, input tokens) per forward
        self.hold = hold
        self.reached, self.go = threading.Event(), threading.Event()
        self._handle = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self.shapes.append(tuple(args[0].shape))  # type: ignore[arg-type]
        if len(self.shapes) - 1 == self.hold:
            self.reached.set()
            assert self.go.wait(30), "test never released the forward"

    async def wait_reached(self) -> None:
        assert await asyncio.to_thread(self.reached.wait, 30), "the loop never reached the held forward"

    def release(self) -> None:
        self.go.set()

    def remove(self) -> None:
        self.go.set()
        self._handle.remove()


def released_at_exit() -> Iterator[list[ForwardGate]]:
    """Gates made by a test, released and removed at the end even if it fails (never a stuck loop thread)."""
    made: list[ForwardGate] = []
    yield made
    for gate in made:
        gate.remove()


gates = pytest.fixture(released_at_exit, name="gates")


def single_intra_op_thread() -> Iterator[None]:
    """One torch thread, as rollout workers run (``TorchEngineConfig.threads``); on shared CPUs two threads
    spin against other processes and make these tiny forwards several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


one_thread = pytest.fixture(single_intra_op_thread, name="one_thread", autouse=True, scope="module")


# ---------------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.5, 1.0), (0.0, 1.0)])
async def test_logprobs_match_teacher_forced_recomputation(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]], temperature: float, top_p: float
) -> None:
    engine = make_engine(tok)
    params = SamplingParams(max_new_tokens=6, temperature=temperature, top_p=top_p)
    async with engine:
        gens = await generate_all(engine, prompts, params)
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.prompt_ids == prompt
        assert len(gen.output_ids) == len(gen.logprobs) == 6 and gen.finish_reason == "length"
        expected = teacher_forced_logprobs(engine.model, prompt, gen.output_ids, temperature)
        assert gen.logprobs == pytest.approx(expected, abs=1e-4)


async def test_greedy_continuous_batching_equals_one_request_at_a_time(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]]
) -> None:
    engine = make_engine(tok)
    lengths = [9, 2, 6, 12, 1, 4]  # rows leave the batch at different steps
    async with engine:
        reference = [
            await engine.generate(p, SamplingParams(max_new_tokens=n, temperature=0.0))
            for p, n in zip(prompts, lengths, strict=True)
        ]

        async def arrive(i: int) -> Generation:
            await asyncio.sleep(0.002 * i)  # staggered: most join a batch already running
            return await engine.generate(prompts[i], SamplingParams(max_new_tokens=lengths[i], temperature=0.0))

        together = await asyncio.gather(*(arrive(i) for i in range(len(prompts))))
    assert [g.output_ids for g in together] == [g.output_ids for g in reference]
    for a, b in zip(together, reference, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # Each greedy token is the argmax of the teacher-forced logits.
    prompt, out = prompts[3], reference[3].output_ids
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt + out])).logits[0]  # (P + N, V)
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out


async def test_requests_join_and_leave_a_running_batch(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]], gates: list[ForwardGate]
) -> None:
    engine = make_engine(tok)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    async with engine:
        reference = await one_at_a_time(engine, prompts, greedy)
        gate = ForwardGate(engine.model, hold=2)  # the second decode step of the first batch
        gates.append(gate)
        first = [asyncio.create_task(engine.generate(p, greedy)) for p in prompts[:2]]
        await gate.wait_reached()
        late = [asyncio.create_task(engine.generate(p, greedy)) for p in prompts[2:]]
        await asyncio.sleep(0.02)  # the late requests are queued while the batch is mid-step
        gate.release()
        gens = await asyncio.gather(*first, *late)
    assert [g.output_ids for g in gens] == [g.output_ids for g in reference]
    # Forwards: prefill (2 rows), two decodes, then one prefill of the 4 newcomers and decodes of all 6 rows.
    assert gate.shapes[:3] == [(2, max(len(p) for p in prompts[:2])), (2, 1), (2, 1)]
    assert gate.shapes[3] == (4, max(len(p) for p in prompts[2:])) and gate.shapes[4] == (6, 1)
    assert engine.running_rows == 0 and engine.queued == 0


async def test_sampling_is_reproducible_per_seed_whatever_shares_the_batch(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    batched, alone = make_engine(tok, seed=5), make_engine(tok, seed=5)
    async with batched, alone:
        together = await generate_all(batched, prompts * 4, params)
        separate = await one_at_a_time(alone, prompts * 4, params)  # same order: the same per-request seeds
        assert [g.output_ids for g in together] == [g.output_ids for g in separate]
        assert len({tuple(g.output_ids) for g in together}) > len(prompts)  # it does sample, not argmax
        greedy = await generate_all(batched, prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
        nucleus = await generate_all(batched, prompts, SamplingParams(max_new_tokens=6, top_p=1e-6))
    assert [g.output_ids for g in nucleus] == [g.output_ids for g in greedy]


async def test_each_request_keeps_its_own_sampling_parameters_in_a_shared_batch(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]]
) -> None:
    mixed = [
        SamplingParams(max_new_tokens=7, temperature=0.0),
        SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9),
        SamplingParams(max_new_tokens=9, temperature=1.5),
        SamplingParams(max_new_tokens=1, temperature=1.0),
        SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[tok.convert_tokens_to_ids("1")]),
        SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.5),
    ]
    batched, alone = make_engine(tok, seed=11), make_engine(tok, seed=11)
    async with batched, alone:
        together = await asyncio.gather(*(batched.generate(p, sp) for p, sp in zip(prompts, mixed, strict=True)))
        separate = [await alone.generate(p, sp) for p, sp in zip(prompts, mixed, strict=True)]
    for gen, ref, sp in zip(together, separate, mixed, strict=True):
        assert gen.output_ids == ref.output_ids and gen.finish_reason == ref.finish_reason
        assert len(gen.output_ids) <= sp.max_new_tokens
        expected = teacher_forced_logprobs(batched.model, gen.prompt_ids, gen.output_ids, sp.temperature)
        assert gen.logprobs == pytest.approx(expected, abs=1e-4)


async def test_stop_tokens_end_rows_individually(tok: PreTrainedTokenizerFast, prompts: list[list[int]]) -> None:
    engine = make_engine(tok)
    async with engine:
        free = await generate_all(engine, prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
        stop = free[0].output_ids[2]  # a token the first row emits at step 3
        params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[stop])
        stopped = await generate_all(engine, prompts, params)
        every = SamplingParams(max_new_tokens=8, stop_token_ids=list(range(len(tok))))
        first_only = await generate_all(engine, prompts, every)
        assert await generate_all(engine, [], SamplingParams()) == []
    for f, s in zip(free, stopped, strict=True):
        if stop in f.output_ids:
            cut = f.output_ids.index(stop) + 1
            assert s.output_ids == f.output_ids[:cut] and s.finish_reason == "stop"  # the stop token is kept
            assert s.logprobs == pytest.approx(f.logprobs[:cut], abs=1e-5)
        else:
            assert s.output_ids == f.output_ids and s.finish_reason == "length"
    assert stopped[0].finish_reason == "stop" and len(stopped[0].output_ids) <= 3
    assert all(len(g.output_ids) == 1 and g.finish_reason == "stop" for g in first_only)


async def test_the_context_window_clamps_requests(tok: PreTrainedTokenizerFast) -> None:
    model = make_model(tok, 0)
    model.config.max_position_embeddings = 16  # default RoPE: the limit is the config's, nothing to rebuild
    engine = TorchEngine(model, tok.pad_token_id)
    assert engine.max_context == 16
    ten = encode_prompt(tok, "123456789")  # BOS + 9 = 10 tokens
    async with engine:
        clamped = await engine.generate(ten, SamplingParams(max_new_tokens=20, temperature=0.0))
        fits = await engine.generate(ten, SamplingParams(max_new_tokens=6, temperature=0.0))
        full = await engine.generate(ten + ten[1:7], SamplingParams(max_new_tokens=4))
        over = await engine.generate(ten * 2, SamplingParams(max_new_tokens=4))
        short = await engine.generate(ten[:2], SamplingParams(max_new_tokens=3, temperature=0.0))
    assert len(clamped.output_ids) == 6 and clamped.finish_reason == "context"
    assert fits.output_ids == clamped.output_ids and fits.finish_reason == "length"
    for gen in (full, over):
        assert gen.output_ids == [] and gen.logprobs == [] and gen.finish_reason == "context"
        assert gen.version_spans == [(0, 0)]
    assert len(short.output_ids) == 3 and short.finish_reason == "length"


async def test_group_samples_share_one_prefill(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]], gates: list[ForwardGate]
) -> None:
    engine = make_engine(tok, seed=2)
    async with engine:
        gate = ForwardGate(engine.model, hold=0)
        gates.append(gate)
        blocker = asyncio.create_task(engine.generate(prompts[2], SamplingParams(max_new_tokens=2)))
        await gate.wait_reached()  # everything below is queued before the next boundary admits it
        group = [engine.generate(prompts[1], SamplingParams(max_new_tokens=6, temperature=1.0)) for _ in range(8)]
        greedy = [engine.generate(prompts[1], SamplingParams(max_new_tokens=6, temperature=0.0)) for _ in range(2)]
        other = engine.generate(prompts[0], SamplingParams(max_new_tokens=6, temperature=0.0))
        tasks = [asyncio.create_task(c) for c in (*group, *greedy, other)]
        await asyncio.sleep(0.02)
        gate.release()
        gens = await asyncio.gather(*tasks)
        await blocker
    # Forwards: the blocker's prefill and decode (its 2 tokens), then one prefill for the 11 newcomers with two
    # distinct prompts, so two rows, then decodes of all 11 rows.
    assert gate.shapes[:2] == [(1, len(prompts[2])), (1, 1)]
    assert gate.shapes[2] == (2, max(len(prompts[0]), len(prompts[1])))
    assert gate.shapes[3] == (11, 1)
    samples, (g1, g2), _ = gens[:8], gens[8:10], gens[10]
    assert g1.output_ids == g2.output_ids
    assert len({tuple(g.output_ids) for g in samples}) > 1  # each sample has its own random stream
    for gen in samples:
        expected = teacher_forced_logprobs(engine.model, prompts[1], gen.output_ids, 1.0)
        assert gen.logprobs == pytest.approx(expected, abs=1e-4)


async def test_cancelling_a_request_removes_it_from_the_batch(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]], gates: list[ForwardGate]
) -> None:
    engine = make_engine(tok)
    async with engine:
        gate = ForwardGate(engine.model, hold=3)
        gates.append(gate)
        long = asyncio.create_task(engine.generate(prompts[0], SamplingParams(max_new_tokens=400)))
        short = asyncio.create_task(engine.generate(prompts[1], SamplingParams(max_new_tokens=10, temperature=0.0)))
        await gate.wait_reached()
        queued = asyncio.create_task(engine.generate(prompts[2], SamplingParams(max_new_tokens=400)))
        await asyncio.sleep(0.01)
        long.cancel()
        queued.cancel()
        gate.release()
        assert len((await short).output_ids) == 10
        for task in (long, queued):
            with pytest.raises(asyncio.CancelledError):
                await task
        await until(lambda: engine.running_rows == 0)
        assert len(gate.shapes) < 20  # the 400-token requests stopped (and the queued one never ran)
        assert all(rows <= 2 for rows, _ in gate.shapes)
        again = await engine.generate(prompts[1], SamplingParams(max_new_tokens=10, temperature=0.0))
    assert again.output_ids == (await short).output_ids


# ---------------------------------------------------------------------------------------------- lifecycle


async def test_a_failing_loop_thread_fails_every_request_with_engine_error(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]]
) -> None:
    engine = make_engine(tok)
    calls = []

    def explode(module: torch.nn.Module, args: object) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom: simulated device failure")

    engine.model.get_input_embeddings().register_forward_pre_hook(explode)  # every forward embeds once
    with structlog.testing.capture_logs() as logs:
        async with engine:
            results = await asyncio.gather(
                *(engine.generate(p, SamplingParams(max_new_tokens=8)) for p in prompts), return_exceptions=True
            )
            assert all(isinstance(r, EngineError) and "boom" in str(r) for r in results)
            with pytest.raises(EngineError, match="boom"):
                await engine.generate(prompts[0], SamplingParams())
    assert isinstance(engine.error, EngineError) and isinstance(engine.error.__cause__, RuntimeError)
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["engine_loop_failed"]
    with pytest.raises(EngineError, match="boom"):
        await engine.start()


async def test_close_fails_pending_requests_and_the_engine_can_start_again(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]]
) -> None:
    engine = make_engine(tok)
    with pytest.raises(EngineError, match="not started"):
        await engine.generate(prompts[0], SamplingParams())
    await engine.start()
    with pytest.raises(EngineError, match="already started"):
        await engine.start()
    pending = asyncio.create_task(engine.generate(prompts[0], SamplingParams(max_new_tokens=400)))
    await until(lambda: engine.running_rows == 1)
    await engine.close()
    with pytest.raises(EngineError, match="closed"):
        await pending
    assert engine.error is None
    async with engine:
        gens = await generate_all(engine, prompts, SamplingParams(max_new_tokens=3, temperature=0.0))
    assert [len(g.output_ids) for g in gens] == [3] * len(prompts)


async def test_invalid_requests_are_rejected(tok: PreTrainedTokenizerFast) -> None:
    engine = make_engine(tok)
    async with engine:
        with pytest.raises(ValueError, match="at least one token"):
            await engine.generate([], SamplingParams())
        with pytest.raises(ValueError, match="max_new_tokens"):
            await engine.generate([1], SamplingParams(max_new_tokens=0))
        with pytest.raises(ValueError, match="top_p"):
            await engine.generate([1], SamplingParams(top_p=0.0))
        with pytest.raises(ValueError, match="token ids"):
            await engine.generate([1, len(tok) + 5], SamplingParams())
        assert len((await engine.generate([1], SamplingParams(max_new_tokens=2))).output_ids) == 2
        with pytest.raises(ValueError, match="at least one token"):  # the failure itself, the others cancelled
            await generate_all(engine, [[1] * 5, [], [1, 2]], SamplingParams(max_new_tokens=300))
        await until(lambda: engine.running_rows == 0 and engine.queued == 0)


def test_generate_all_sync_serves_code_outside_asyncio(tok: PreTrainedTokenizerFast, prompts: list[list[int]]) -> None:
    engine = make_engine(tok)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    first = generate_all_sync(engine, prompts, params)
    assert [g.output_ids for g in generate_all_sync(engine, prompts, params)] == [g.output_ids for g in first]
    assert [g.prompt_ids for g in first] == prompts


def test_generate_is_fast_on_one_thread(tok: PreTrainedTokenizerFast) -> None:
    """64 prompts x 8 new tokens on the default tiny model: budget 0.5 s (loose: shared CI CPUs)."""
    engine = TorchEngine(tiny.build_tiny_model(TinyModelConfig(), tok), tok.pad_token_id)
    batch = [encode_prompt(tok, f"{i % 31}+{(7 * i) % 31}=") for i in range(64)]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    async def timed() -> float:
        async with engine:
            await generate_all(engine, batch, params)  # warm-up
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                await generate_all(engine, batch, params)
                best = min(best, time.perf_counter() - start)
            return best

    try:
        best = asyncio.run(timed())
    finally:
        torch.set_num_threads(threads)
    assert best < 0.5, f"64x8 generation took {best * 1e3:.0f} ms"


async def test_build_engine_loads_a_saved_checkpoint(
    tok: PreTrainedTokenizerFast, tmp_path: Path, prompts: list[list[int]]
) -> None:
    model = make_model(tok, 0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    threads = torch.get_num_threads()
    try:
        engine = build_engine(TorchEngineConfig(threads=None), tmp_path, version=2, seed=0)
    finally:
        torch.set_num_threads(threads)
    assert isinstance(engine, TorchEngine) and engine.version == 2 and engine.max_context == 512
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    reference = TorchEngine(model, tok.pad_token_id)
    async with engine, reference:
        got = await generate_all(engine, prompts, params)
        want = await generate_all(reference, prompts, params)
    assert [g.output_ids for g in got] == [g.output_ids for g in want]
    assert all(g.weight_version == 2 for g in got)


# ---------------------------------------------------------------------------------------------- in-flight weights


def _state(tok: PreTrainedTokenizerFast, seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in make_model(tok, seed).state_dict().items()}


def kept_cache_logprobs(
    old: LlamaForCausalLM, new: LlamaForCausalLM, prompt: list[int], output: list[int], switch: int, temp: float
) -> list[float]:
    """Reference for the keep-the-KV-cache policy: ``output[:switch]`` scored by ``old`` (prompt prefill
    included), the rest by ``new`` attending to the cache ``old`` computed; unpadded, one token per step."""
    cache, forwards = DynamicCache(), {id(old): hf_forward(old), id(new): hf_forward(new)}
    out = []
    with torch.no_grad():
        ids = torch.tensor([prompt])  # (1, P)
        logits = forwards[id(old)](ids, torch.ones_like(ids), torch.arange(len(prompt))[None], cache)[0]
        for i, token in enumerate(output):
            logp = torch.log_softmax(logits.float() / (temp if temp > 0 else 1.0), dim=-1)  # (V,)
            out.append(float(logp[token]))
            model = old if i + 1 < switch else new
            pos = torch.tensor([[len(prompt) + i]])  # (1, 1)
            mask = torch.ones((1, len(prompt) + i + 1), dtype=torch.long)  # (1, T)
            logits = forwards[id(model)](torch.tensor([[token]]), mask, pos, cache)[0]
    return out


async def test_version_spans_follow_an_in_flight_switch_while_requests_come_and_go(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]], gates: list[ForwardGate]
) -> None:
    engine = make_engine(tok, 0, seed=3)
    old, new, new_state = make_model(tok, 0), make_model(tok, 1), _state(tok, 1)
    temp, k = 0.8, 3  # forward k computes token k: tokens 0..k at version 0, the switch starts at k + 1
    long, short = SamplingParams(max_new_tokens=8, temperature=temp), SamplingParams(max_new_tokens=2)
    async with engine:
        gate = ForwardGate(engine.model, hold=k)
        gates.append(gate)
        before = [asyncio.create_task(engine.generate(p, long)) for p in prompts[:3]]
        ended = asyncio.create_task(engine.generate(prompts[3], short))  # leaves before the switch
        await gate.wait_reached()
        assert engine.stage_weights(new_state, 1)
        assert engine.version == 0 and engine.pending_version == 1
        after = [asyncio.create_task(engine.generate(p, long)) for p in prompts[4:]]  # joins after the switch
        gate.release()
        gens, ended_gen, late = await asyncio.gather(*before), await ended, await asyncio.gather(*after)
        assert engine.version == 1 and engine.pending_version is None and engine.switches == 1
        assert engine.pauses_s == [engine.last_pause_s] and engine.last_pause_s > 0
        nxt = await engine.generate(prompts[0], long)
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, new_state[name]), name
    assert ended_gen.version_spans == [(0, 0)] and len(ended_gen.output_ids) == 2
    for prompt, gen in zip(prompts[:3], gens, strict=True):
        assert gen.weight_version == 0 and gen.version_spans == [(0, 0), (k + 1, 1)]
        # Before the switch: the old weights' distribution; after it, the new weights over the kept cache.
        assert gen.logprobs[: k + 1] == pytest.approx(
            teacher_forced_logprobs(old, prompt, gen.output_ids[: k + 1], temp), abs=1e-4
        )
        kept = kept_cache_logprobs(old, new, prompt, gen.output_ids, k + 1, temp)
        assert gen.logprobs == pytest.approx(kept, abs=1e-4)
        assert gen.logprobs[k + 1 :] != pytest.approx(
            teacher_forced_logprobs(old, prompt, gen.output_ids, temp)[k + 1 :], abs=1e-3
        )
    for prompt, gen in zip(prompts[4:], late, strict=True):
        assert gen.version_spans == [(0, 1)]
        assert gen.logprobs == pytest.approx(teacher_forced_logprobs(new, prompt, gen.output_ids, temp), abs=1e-4)
    assert nxt.version_spans == [(0, 1)]


async def test_weights_staged_before_admission_apply_before_the_first_token(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]], gates: list[ForwardGate]
) -> None:
    """The rollout worker's staleness floor (it waits until a version is staged, then submits): a request
    sampled nothing before weights staged ahead of its admission are in. White-box: the stage is made to
    land at the last moment, inside admission, where a boundary that applied weights first would miss it."""
    engine = make_engine(tok, 0)
    real_admit = engine._loop.admit
    state = _state(tok, 1)

    def admit_after_a_late_stage(inbox: deque[Request]) -> list[Request]:
        if any(r.prompt == prompts[1] for r in inbox) and engine.pending_version is None and engine.version == 0:
            assert engine.stage_weights(state, 1)  # the late request is about to be admitted
        return real_admit(inbox)

    engine._loop.admit = admit_after_a_late_stage  # type: ignore[method-assign]
    async with engine:
        gate = ForwardGate(engine.model, hold=1)
        gates.append(gate)
        running = asyncio.create_task(engine.generate(prompts[0], SamplingParams(max_new_tokens=6)))
        await gate.wait_reached()  # admission of `running` is over; the next request is admitted later
        late = asyncio.create_task(engine.generate(prompts[1], SamplingParams(max_new_tokens=3)))
        await asyncio.sleep(0.01)
        gate.release()
        first, second = await running, await late
    assert second.version_spans == [(0, 1)]
    assert first.version_spans == [(0, 0), (2, 1)]


async def test_pinned_holds_staged_weights_back(tok: PreTrainedTokenizerFast, prompts: list[list[int]]) -> None:
    engine = make_engine(tok, 0)
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    async with engine:
        async with engine.pinned() as version:
            assert version == 0
            running = asyncio.create_task(engine.generate(prompts[0], SamplingParams(max_new_tokens=30)))
            assert engine.stage_weights(_state(tok, 1), 1)
            gens = await generate_all(engine, prompts, params)
            assert all(g.version_spans == [(0, 0)] for g in gens) and (await running).version_spans == [(0, 0)]
            assert engine.version == 0 and engine.pending_version == 1
        await until(lambda: engine.version == 1)  # idle: applied as soon as the pin is gone
        assert all(g.weight_version == 1 for g in await generate_all(engine, prompts, params))
    assert engine.switches == 1


async def test_worker_several_versions_behind_jumps_to_the_newest(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]], gates: list[ForwardGate]
) -> None:
    engine = make_engine(tok, 0)
    v2, v5 = _state(tok, 2), _state(tok, 5)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    async with engine:
        gate = ForwardGate(engine.model, hold=1)
        gates.append(gate)
        tasks = [asyncio.create_task(engine.generate(p, params)) for p in prompts]
        await gate.wait_reached()
        # Mid-generation: v2 then v5 arrive before the boundary; only v5 is applied, v2 never after it.
        assert engine.stage_weights(v2, 2) and engine.stage_weights(v5, 5)
        assert not engine.stage_weights(v2, 2) and not engine.stage_weights(v2, 4)
        assert engine.pending_version == 5
        gate.release()
        gens = await asyncio.gather(*tasks)
    assert all(g.version_spans == [(0, 0), (2, 5)] for g in gens)
    assert engine.version == 5 and engine.switches == 1 and engine.pending_version is None
    assert not engine.stage_weights(v2, 2) and not engine.stage_weights(v5, 5)  # older / same: ignored
    assert all(torch.equal(t, v5[n]) for n, t in engine.model.state_dict().items())

    # Not started: staged weights wait; the loop thread applies them as soon as it runs, idle or not.
    idle = make_engine(tok, 0)
    assert idle.stage_weights(v2, 2) and idle.stage_weights(v5, 5) and not idle.stage_weights(v2, 2)
    assert idle.version == 0 and idle.pending_version == 5
    reference = TorchEngine(make_model(tok, 5), tok.pad_token_id)
    async with idle, reference:
        await until(lambda: idle.version == 5)
        assert idle.switches == 1 and idle.pending_version is None
        got, want = await generate_all(idle, prompts, params), await generate_all(reference, prompts, params)
        assert [g.output_ids for g in got] == [g.output_ids for g in want]
        assert idle.stage_weights(_state(tok, 6), 6)
        await until(lambda: idle.version == 6)
        assert all(g.version_spans == [(0, 6)] for g in await generate_all(idle, prompts, params))
        # load_weights stays immediate and drops a staged version it supersedes.
        async with idle.pinned():
            assert idle.stage_weights(v2, 7)
            await asyncio.to_thread(idle.load_weights, v5, 8)
            assert idle.pending_version is None and idle.version == 8
    assert idle.switches == 2


async def test_staging_racing_generation_keeps_spans_consistent(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]]
) -> None:
    """Versions staged while requests keep arriving: spans well formed, never backwards, last version wins."""
    engine = make_engine(tok, 0)
    states = [_state(tok, 1), _state(tok, 2)]
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    seen: list[list[tuple[int, int]]] = []
    done = asyncio.Event()

    async def roll(prompt: list[int]) -> None:
        while not done.is_set():
            seen.append((await engine.generate(prompt, params)).version_spans)

    async with engine:
        rollers = [asyncio.create_task(roll(p)) for p in prompts]
        for v in range(1, 31):
            engine.stage_weights(states[v % 2], v)
            await asyncio.sleep(0.002)
        done.set()
        await asyncio.gather(*rollers)
        await until(lambda: engine.version == 30)
    assert seen
    for spans in seen:
        starts, versions = [s for s, _ in spans], [v for _, v in spans]
        assert starts[0] == 0 and starts == sorted(set(starts)) and versions == sorted(set(versions))
        assert all(0 < s < 6 for s in starts[1:])
