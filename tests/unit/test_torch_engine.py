"""TorchEngine invariants on a real (random-init) tiny Llama: log-probs, stops, greedy, weight swaps."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from miles.config import TinyModelConfig, TorchEngineConfig
from miles.engines.base import SamplingParams, SparseValues
from miles.engines.registry import build_engine
from miles.engines.torch_engine import TorchEngine, _forward_kwargs, _new_cache
from miles.models import tiny
from miles.models.loading import encode_prompt

CFG = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4)
PROMPTS_TEXT = ["1+2=", "13+27=", "7=", "30+30=", "0+0=", "9+11="]  # different lengths: left padding matters


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return tiny.build_char_tokenizer()


@pytest.fixture(scope="module")
def prompts(tok: PreTrainedTokenizerFast) -> list[list[int]]:
    return [encode_prompt(tok, p) for p in PROMPTS_TEXT]


def make_model(tok: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    return tiny.build_tiny_model(CFG.model_copy(update={"seed": seed}), tok).eval()


def make_engine(tok: PreTrainedTokenizerFast, seed: int = 0, **kw: object) -> TorchEngine:
    return TorchEngine(make_model(tok, seed), tok.pad_token_id, **kw)  # type: ignore[arg-type]


def teacher_forced_logprobs(model: LlamaForCausalLM, prompt: list[int], output: list[int], temp: float) -> list[float]:
    """log_softmax(logits / T) of ``output`` given ``prompt``, from one unpadded, uncached forward."""
    ids = torch.tensor([prompt + output])  # (1, P + N)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # (P + N, V)
    logp = torch.log_softmax(logits / (temp if temp > 0 else 1.0), dim=-1)
    steps = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[steps, torch.tensor(output)].tolist()


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.5, 1.0), (0.0, 1.0)])
def test_logprobs_match_teacher_forced_recomputation(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]], temperature: float, top_p: float
) -> None:
    engine = make_engine(tok)
    params = SamplingParams(max_new_tokens=6, temperature=temperature, top_p=top_p)
    gens = engine.generate(prompts, params)
    assert len(gens) == len(prompts)
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.prompt_ids == prompt
        assert len(gen.output_ids) == len(gen.logprobs) == 6 and gen.finish_reason == "length"
        expected = teacher_forced_logprobs(engine.model, prompt, gen.output_ids, temperature)
        assert gen.logprobs == pytest.approx(expected, abs=1e-4)


def test_greedy_is_deterministic_argmax_and_batch_independent(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]]
) -> None:
    engine = make_engine(tok)
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    first = engine.generate(prompts, params)
    assert [g.output_ids for g in engine.generate(prompts, params)] == [g.output_ids for g in first]
    # Alone (no padding) gives the same tokens as inside the left-padded batch.
    for prompt, gen in zip(prompts, first, strict=True):
        assert engine.generate([prompt], params)[0].output_ids == gen.output_ids
    # Each greedy token is the argmax of the teacher-forced logits.
    prompt, out = prompts[1], first[1].output_ids
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt + out])).logits[0]  # (P + N, V)
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out


def test_sampling_is_reproducible_per_seed_and_tiny_top_p_is_greedy(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    a = TorchEngine(make_model(tok, 0), tok.pad_token_id, seed=5)
    b = TorchEngine(make_model(tok, 0), tok.pad_token_id, seed=5)
    outs_a = [g.output_ids for g in a.generate(prompts * 4, params)]
    assert outs_a == [g.output_ids for g in b.generate(prompts * 4, params)]
    assert len({tuple(o) for o in outs_a}) > len(prompts)  # it does sample, not argmax
    greedy = [g.output_ids for g in a.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))]
    nucleus = [g.output_ids for g in a.generate(prompts, SamplingParams(max_new_tokens=6, top_p=1e-6))]
    assert nucleus == greedy


def test_stop_tokens_end_rows_individually(tok: PreTrainedTokenizerFast, prompts: list[list[int]]) -> None:
    engine = make_engine(tok)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    stop = free[0].output_ids[2]  # a token the first row emits at step 3
    stopped = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[stop]))
    for f, s in zip(free, stopped, strict=True):
        if stop in f.output_ids:
            cut = f.output_ids.index(stop) + 1
            assert s.output_ids == f.output_ids[:cut] and s.finish_reason == "stop"
            assert s.logprobs == pytest.approx(f.logprobs[:cut], abs=1e-5)
        else:
            assert s.output_ids == f.output_ids and s.finish_reason == "length"
    assert stopped[0].finish_reason == "stop" and len(stopped[0].output_ids) <= 3
    # If every row stops at once the loop ends early, and an empty batch is fine.
    every = engine.generate(prompts, SamplingParams(max_new_tokens=8, stop_token_ids=list(range(len(tok)))))
    assert all(len(g.output_ids) == 1 and g.finish_reason == "stop" for g in every)
    assert engine.generate([], SamplingParams()) == []


def test_load_weights_swaps_model_and_propagates_version(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]]
) -> None:
    engine, other = make_engine(tok, 0), make_engine(tok, 1, version=7)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = engine.generate(prompts, params)
    target = other.generate(prompts, params)
    assert all(g.weight_version == 0 for g in before) and all(g.weight_version == 7 for g in target)
    assert [g.output_ids for g in before] != [g.output_ids for g in target]

    engine.load_weights(other.model.state_dict(), version=3)
    after = engine.generate(prompts, params)
    assert engine.version == 3 and all(g.weight_version == 3 for g in after)
    assert [g.output_ids for g in after] == [g.output_ids for g in target]
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())

    # bf16 payloads (rollout precision) are converted into the fp32 model in place.
    bf16 = {k: v.to(torch.bfloat16) for k, v in make_model(tok, 2).state_dict().items()}
    engine.load_weights(bf16, version=4)
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(engine.model.state_dict()[name], bf16[name].float())
    assert engine.model.state_dict()[name].dtype == torch.float32 and engine.version == 4


def _faulty_state(tok: PreTrainedTokenizerFast, fault: str) -> tuple[dict[str, torch.Tensor], str]:
    """A full state with one ``fault`` (a missing, an unexpected or a misshapen tensor) and the key at fault."""
    state = {k: v.clone() for k, v in make_model(tok, 1).state_dict().items()}
    key = "model.layers.1.self_attn.q_proj.weight"
    if fault == "missing":
        del state[key]
    elif fault == "unexpected":
        key = "model.layers.9.extra.weight"
        state[key] = torch.zeros(2)
    else:
        state[key] = torch.zeros(3, 3)
    return state, key


@pytest.mark.parametrize("fault", ["missing", "unexpected", "shape"])
def test_load_weights_rejects_bad_payloads_atomically(tok: PreTrainedTokenizerFast, fault: str) -> None:
    engine = make_engine(tok, 0)
    state, key = _faulty_state(tok, fault)
    snapshot = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        engine.load_weights(state, version=9)
    assert engine.version == 0
    assert all(torch.equal(v, snapshot[k]) for k, v in engine.model.state_dict().items())


def test_generation_never_mixes_weight_versions(tok: PreTrainedTokenizerFast, prompts: list[list[int]]) -> None:
    """A generate racing load_weights sees one whole weight set, and reports which one."""
    engine = make_engine(tok, 0)
    states = {v: {k: t.clone() for k, t in make_model(tok, v).state_dict().items()} for v in (1, 2)}
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    reference = {}
    for v, state in states.items():
        engine.load_weights(state, v)
        reference[v] = [g.output_ids for g in engine.generate(prompts, params)]
    assert reference[1] != reference[2]

    seen: list[tuple[int, list[list[int]]]] = []
    done = threading.Event()

    def roll() -> None:
        while not done.is_set():
            gens = engine.generate(prompts, params)
            assert len({g.weight_version for g in gens}) == 1
            seen.append((gens[0].weight_version, [g.output_ids for g in gens]))

    worker = threading.Thread(target=roll)
    worker.start()
    try:
        for i in range(20):
            engine.load_weights(states[1 + i % 2], 1 + i % 2)
            time.sleep(0.002)
    finally:
        done.set()
        worker.join()
    assert seen and all(outputs == reference[v] for v, outputs in seen)


def test_generate_is_fast_on_one_thread(tok: PreTrainedTokenizerFast) -> None:
    """64 prompts x 8 new tokens on the default tiny model: budget 100 ms (asserted loosely: shared CI CPUs)."""
    engine = TorchEngine(tiny.build_tiny_model(TinyModelConfig(), tok), tok.pad_token_id)
    batch = [encode_prompt(tok, f"{i % 31}+{(7 * i) % 31}=") for i in range(64)]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine.generate(batch, params)  # warm-up
        best = min(_timed(engine, batch, params) for _ in range(3))
    finally:
        torch.set_num_threads(threads)
    assert best < 0.5, f"64x8 generation took {best * 1e3:.0f} ms"


def _timed(engine: TorchEngine, batch: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    engine.generate(batch, params)
    return time.perf_counter() - start


def test_build_engine_loads_a_saved_checkpoint(
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
    assert isinstance(engine, TorchEngine) and engine.version == 2
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    assert [g.output_ids for g in engine.generate(prompts, params)] == [
        g.output_ids for g in TorchEngine(model, tok.pad_token_id).generate(prompts, params)
    ]


def test_invalid_requests_are_rejected(tok: PreTrainedTokenizerFast) -> None:
    engine = make_engine(tok)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[1]], SamplingParams(max_new_tokens=0))


def test_tied_weights_may_be_sent_once(tok: PreTrainedTokenizerFast) -> None:
    def tied(seed: int) -> LlamaForCausalLM:
        torch.manual_seed(seed)
        config = tiny.build_tiny_model(CFG, tok).config
        config.tie_word_embeddings = True
        return LlamaForCausalLM(config).eval()

    engine, source = TorchEngine(tied(0), tok.pad_token_id), tied(1)
    state = dict(source.state_dict())
    if "lm_head.weight" in state:
        del state["lm_head.weight"]
    engine.load_weights(state, version=1)
    assert torch.equal(engine.model.lm_head.weight, source.model.embed_tokens.weight)


# ---------------------------------------------------------------------------- in-flight weight updates


def _state(tok: PreTrainedTokenizerFast, seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in make_model(tok, seed).state_dict().items()}


class PauseAtForward:
    """Blocks the engine's ``call``-th model forward (0 = prefill) until released, from another thread.

    While forward ``call`` (which computes token ``call``) waits, the test stages weights; the loop
    takes them at the next token boundary, so tokens ``0..call`` come from the old weights and the
    switch starts at output index ``call + 1``.
    """

    def __init__(self, model: torch.nn.Module, call: int) -> None:
        self.call, self.calls = call, 0
        self.reached, self.go = threading.Event(), threading.Event()
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: object) -> None:
        if self.calls == self.call:
            self.reached.set()
            assert self.go.wait(30), "test never released the forward"
        self.calls += 1

    def run(self, engine: TorchEngine, prompts: list[list[int]], params: SamplingParams, while_paused) -> list:  # type: ignore[no-untyped-def,type-arg]
        """``engine.generate`` in a worker thread; ``while_paused()`` runs on this thread mid-generation."""
        result: list = []  # type: ignore[type-arg]
        worker = threading.Thread(target=lambda: result.extend(engine.generate(prompts, params)))
        worker.start()
        try:
            assert self.reached.wait(30), "generation never reached the paused forward"
            while_paused()
        finally:
            self.go.set()
            worker.join(30)
            self.handle.remove()
        assert not worker.is_alive()
        return result


def kept_cache_logprobs(
    old: LlamaForCausalLM, new: LlamaForCausalLM, prompt: list[int], output: list[int], switch: int, temp: float
) -> list[float]:
    """Reference for the keep-the-KV-cache policy: ``output[:switch]`` scored by ``old`` (prompt prefill
    included), the rest by ``new`` attending to the cache ``old`` computed; unpadded, one token per step."""
    cache_arg, extra = _forward_kwargs(old)
    fwd = {cache_arg: _new_cache(old), **extra}
    ids = torch.tensor([prompt])  # (1, P)
    out = []
    with torch.no_grad():
        logits = old(input_ids=ids, position_ids=torch.arange(len(prompt)).unsqueeze(0), **fwd).logits[0, -1]
        for i, token in enumerate(output):
            logp = torch.log_softmax(logits.float() / (temp if temp > 0 else 1.0), dim=-1)  # (V,)
            out.append(float(logp[token]))
            model = old if i + 1 < switch else new
            pos = torch.tensor([[len(prompt) + i]])  # (1, 1)
            logits = model(input_ids=torch.tensor([[token]]), position_ids=pos, **fwd).logits[0, -1]
    return out


def test_weights_staged_mid_generation_switch_at_a_token_boundary(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]]
) -> None:
    engine = TorchEngine(make_model(tok, 0), tok.pad_token_id, seed=3)
    old, new, new_state = make_model(tok, 0), make_model(tok, 1), _state(tok, 1)
    k, temp = 3, 0.8
    params = SamplingParams(max_new_tokens=8, temperature=temp)
    pause = PauseAtForward(engine.model, call=k)
    staged: list[bool] = []
    gens = pause.run(engine, prompts, params, lambda: staged.append(engine.stage_weights(new_state, 1)))

    assert staged == [True] and engine.version == 1 and engine.pending_version is None
    assert engine.switches == 1 and engine.pauses_s == [engine.last_pause_s] and engine.last_pause_s > 0
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, new_state[name]), name
    for prompt, gen in zip(prompts, gens, strict=True):
        assert len(gen.output_ids) == 8 and gen.finish_reason == "length"
        assert gen.weight_version == 0 and gen.version_spans == [(0, 0), (k + 1, 1)]
        # Tokens before the switch: exactly the old weights' distribution (plain teacher forcing).
        assert gen.logprobs[: k + 1] == pytest.approx(
            teacher_forced_logprobs(old, prompt, gen.output_ids[: k + 1], temp), abs=1e-4
        )
        # After it: the new weights over the kept (old-weights) cache, i.e. the engine's semantics.
        expected = kept_cache_logprobs(old, new, prompt, gen.output_ids, k + 1, temp)
        assert gen.logprobs == pytest.approx(expected, abs=1e-4)
        # ...which really is a different distribution from the old weights'.
        assert gen.logprobs[k + 1 :] != pytest.approx(
            teacher_forced_logprobs(old, prompt, gen.output_ids, temp)[k + 1 :], abs=1e-3
        )
    # The next generation starts at the new version, one span.
    assert all(g.version_spans == [(0, 1)] for g in engine.generate(prompts, params))


def test_rows_that_ended_before_a_switch_keep_one_span(tok: PreTrainedTokenizerFast, prompts: list[list[int]]) -> None:
    engine = make_engine(tok, 0)
    k = 2
    free = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    # A stop token some row emits by index k (ends before the switch at k+1) and another row never emits.
    stop = next(t for g in free for t in g.output_ids[: k + 1] if any(t not in h.output_ids for h in free))
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[stop])
    pause = PauseAtForward(engine.model, call=k)
    gens = pause.run(engine, prompts, params, lambda: engine.stage_weights(_state(tok, 1), 4))
    assert engine.version == 4
    for gen in gens:
        if len(gen.output_ids) <= k + 1:
            assert gen.version_spans == [(0, 0)]
        else:
            assert gen.version_spans == [(0, 0), (k + 1, 4)]
    assert any(len(g.output_ids) <= k + 1 for g in gens) and any(len(g.output_ids) > k + 1 for g in gens)


def test_worker_several_versions_behind_jumps_to_the_newest(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]]
) -> None:
    engine = make_engine(tok, 0)
    v2, v5 = _state(tok, 2), _state(tok, 5)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)

    # Mid-generation: v2 then v5 arrive before the boundary; only v5 is applied, v2 never after it.
    def stage_all() -> None:
        assert engine.stage_weights(v2, 2) and engine.stage_weights(v5, 5)
        assert not engine.stage_weights(v2, 2) and not engine.stage_weights(v2, 4)
        assert engine.pending_version == 5

    gens = PauseAtForward(engine.model, call=1).run(engine, prompts, params, stage_all)
    assert all(g.version_spans == [(0, 0), (2, 5)] for g in gens)
    assert engine.version == 5 and engine.switches == 1 and engine.pending_version is None
    assert not engine.stage_weights(v2, 2) and not engine.stage_weights(v5, 5)  # older / same: ignored
    assert not engine.apply_pending() and engine.version == 5
    assert all(torch.equal(t, v5[n]) for n, t in engine.model.state_dict().items())

    # Idle: the same through apply_pending, and a staged version is also applied by the next generate.
    idle = make_engine(tok, 0)
    assert idle.stage_weights(v2, 2) and idle.stage_weights(v5, 5) and not idle.stage_weights(v2, 2)
    assert idle.version == 0 and idle.pending_version == 5
    assert idle.apply_pending() and idle.version == 5 and not idle.apply_pending()
    assert idle.switches == 1 and [g.output_ids for g in idle.generate(prompts, params)] == [
        g.output_ids for g in TorchEngine(make_model(tok, 5), tok.pad_token_id).generate(prompts, params)
    ]
    assert idle.stage_weights(_state(tok, 6), 6)
    assert all(g.weight_version == 6 and g.version_spans == [(0, 6)] for g in idle.generate(prompts, params))
    assert idle.version == 6 and idle.switches == 2

    # load_weights stays immediate and drops a staged version it supersedes.
    assert idle.stage_weights(v2, 7)
    idle.load_weights(v5, 8)
    assert idle.pending_version is None and not idle.apply_pending() and idle.version == 8


@pytest.mark.parametrize("fault", ["missing", "unexpected", "shape"])
def test_stage_weights_rejects_bad_payloads_up_front(tok: PreTrainedTokenizerFast, fault: str) -> None:
    engine = make_engine(tok, 0)
    state, key = _faulty_state(tok, fault)
    with pytest.raises(ValueError, match=r"stage_weights: .*" + key.replace(".", r"\.")):
        engine.stage_weights(state, version=9)
    assert engine.pending_version is None and not engine.apply_pending() and engine.version == 0


def test_staging_racing_generation_keeps_spans_consistent(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]]
) -> None:
    """Versions staged from another thread while generations run: spans well formed, never backwards."""
    engine = make_engine(tok, 0)
    states = [_state(tok, 1), _state(tok, 2)]
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    seen: list[list[tuple[int, int]]] = []
    done = threading.Event()

    def roll() -> None:
        while not done.is_set():
            seen.extend(g.version_spans for g in engine.generate(prompts, params))

    worker = threading.Thread(target=roll)
    worker.start()
    try:
        for v in range(1, 31):
            engine.stage_weights(states[v % 2], v)
            time.sleep(0.002)
    finally:
        done.set()
        worker.join()
    engine.apply_pending()
    assert engine.version == 30 and seen
    last = -1
    for spans in seen:
        starts, versions = [s for s, _ in spans], [v for _, v in spans]
        assert starts[0] == 0 and starts == sorted(set(starts)) and versions == sorted(set(versions))
        assert all(0 < s < 6 for s in starts[1:])
        assert versions[0] >= last  # a later generation never starts at an older version
        last = versions[0]


def _sparse_delta(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, SparseValues]:
    """The positions where ``new`` differs from ``old`` and its values there, per tensor."""
    out = {}
    for name, t in new.items():
        idx = torch.nonzero(t.reshape(-1) != old[name].reshape(-1)).reshape(-1)
        out[name] = SparseValues(idx, t.reshape(-1)[idx])
    return out


def test_sparse_deltas_queue_in_order_and_need_the_right_base(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]]
) -> None:
    engine = make_engine(tok, 0)
    v0 = _state(tok, 0)
    v1 = {k: v.clone() for k, v in v0.items()}
    v2 = {k: v.clone() for k, v in v0.items()}
    key = "model.layers.0.mlp.up_proj.weight"
    v1[key].view(-1)[::7] += 0.5  # 1/7 of one tensor changes, then a disjoint and an overlapping set
    v2[key].copy_(v1[key])
    v2[key].view(-1)[::5] -= 0.25
    d1, d2 = _sparse_delta(v0, v1), _sparse_delta(v1, v2)
    assert 0 < d2[key].index.numel() < v2[key].numel()

    assert not engine.stage_weights(d2, 2, base_version=1, complete=False)  # engine is at 0, not 1
    assert engine.stage_weights(d1, 1, base_version=0, complete=False)
    assert engine.stage_weights(d2, 2, base_version=1, complete=False)  # queues behind version 1
    assert engine.pending_version == 2
    assert engine.apply_pending() and engine.version == 2 and engine.switches == 1
    assert all(torch.equal(t, v2[n]) for n, t in engine.model.state_dict().items())

    # A complete state replaces the queue; a delta against a version that will not be reached is refused.
    assert engine.stage_weights(d1, 3, base_version=2, complete=False)
    assert engine.stage_weights(v0, 4)
    assert not engine.stage_weights(d2, 5, base_version=3, complete=False)
    assert engine.apply_pending() and engine.version == 4
    assert all(torch.equal(t, v0[n]) for n, t in engine.model.state_dict().items())

    # Absolute partial updates (adapter-merged tensors on a fixed base) need no base version.
    merged = {key: v2[key]}
    assert engine.stage_weights(merged, 5, complete=False) and engine.apply_pending()
    assert torch.equal(engine.model.state_dict()[key], v2[key]) and engine.version == 5


def test_sparse_updates_are_validated_up_front(tok: PreTrainedTokenizerFast) -> None:
    engine = make_engine(tok, 0)
    key = "model.layers.0.mlp.up_proj.weight"
    n = engine.model.state_dict()[key].numel()
    bad = {
        "outside": SparseValues(torch.tensor([n]), torch.zeros(1)),
        "index dtype": SparseValues(torch.tensor([0], dtype=torch.int32), torch.zeros(1)),
        "equal length": SparseValues(torch.tensor([0, 1]), torch.zeros(1)),
    }
    for what, value in bad.items():
        with pytest.raises(ValueError, match=what):
            engine.stage_weights({key: value}, 1, base_version=0, complete=False)
    with pytest.raises(ValueError, match="need base_version"):
        engine.stage_weights({key: SparseValues(torch.tensor([0]), torch.zeros(1))}, 1, complete=False)
    assert engine.pending_version is None and engine.version == 0
