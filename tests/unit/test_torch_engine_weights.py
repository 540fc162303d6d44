"""TorchEngine weight changes: load_weights (immediate) and staging semantics (validation, newest wins,
partial and sparse updates in order, the right base), on the tiny Llama."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from miles.engines.base import SamplingParams, SparseValues
from miles.engines.batch import generate_all
from miles.engines.torch_engine import TorchEngine
from miles.models import tiny

from .test_torch_engine import (
    CFG,
    PROMPTS_TEXT,
    ForwardGate,
    encode_all,
    make_engine,
    make_model,
    released_at_exit,
    single_intra_op_thread,
    until,
)

gates = pytest.fixture(released_at_exit, name="gates")
one_thread = pytest.fixture(single_intra_op_thread, name="one_thread", autouse=True, scope="module")


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return tiny.build_char_tokenizer()


@pytest.fixture(scope="module")
def prompts(tok: PreTrainedTokenizerFast) -> list[list[int]]:
    return encode_all(tok, PROMPTS_TEXT)


def _state(tok: PreTrainedTokenizerFast, seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in make_model(tok, seed).state_dict().items()}


def _faulty_state(tok: PreTrainedTokenizerFast, fault: str) -> tuple[dict[str, torch.Tensor], str]:
    """A full state with one ``fault`` (a missing, an unexpected or a misshapen tensor) and the key at fault."""
    state = _state(tok, 1)
    key = "model.layers.1.self_attn.q_proj.weight"
    if fault == "missing":
        del state[key]
    elif fault == "unexpected":
        key = "model.layers.9.extra.weight"
        state[key] = torch.zeros(2)
    else:
        state[key] = torch.zeros(3, 3)
    return state, key


async def test_load_weights_swaps_model_and_propagates_version(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]]
) -> None:
    engine, other = make_engine(tok, 0), make_engine(tok, 1, version=7)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    async with engine, other:
        before = await generate_all(engine, prompts, params)
        target = await generate_all(other, prompts, params)
        assert all(g.weight_version == 0 for g in before) and all(g.weight_version == 7 for g in target)
        assert [g.output_ids for g in before] != [g.output_ids for g in target]
        await asyncio.to_thread(engine.load_weights, other.model.state_dict(), 3)
        after = await generate_all(engine, prompts, params)
    assert engine.version == 3 and all(g.weight_version == 3 for g in after)
    assert [g.output_ids for g in after] == [g.output_ids for g in target]
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())

    # bf16 payloads (rollout precision) are converted into the fp32 model in place; no loop thread needed.
    bf16 = {k: v.to(torch.bfloat16) for k, v in make_model(tok, 2).state_dict().items()}
    engine.load_weights(bf16, version=4)
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(engine.model.state_dict()[name], bf16[name].float())
    assert engine.model.state_dict()[name].dtype == torch.float32 and engine.version == 4


async def test_load_weights_lands_at_a_token_boundary_of_a_running_batch(
    tok: PreTrainedTokenizerFast, prompts: list[list[int]], gates: list[ForwardGate]
) -> None:
    engine = make_engine(tok, 0)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    async with engine:
        gate = ForwardGate(engine.model, hold=2)
        gates.append(gate)
        tasks = [asyncio.create_task(engine.generate(p, params)) for p in prompts]
        await gate.wait_reached()
        loading = asyncio.create_task(asyncio.to_thread(engine.load_weights, _state(tok, 1), 9))
        await asyncio.sleep(0.02)
        assert not loading.done() and engine.version == 0  # it waits for the forward under way
        gate.release()
        await loading
        gens = await asyncio.gather(*tasks)
    assert all(g.version_spans == [(0, 0), (3, 9)] for g in gens)  # tokens 0-2 before, the rest after


@pytest.mark.parametrize("fault", ["missing", "unexpected", "shape"])
def test_load_weights_rejects_bad_payloads_atomically(tok: PreTrainedTokenizerFast, fault: str) -> None:
    engine = make_engine(tok, 0)
    state, key = _faulty_state(tok, fault)
    snapshot = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        engine.load_weights(state, version=9)
    assert engine.version == 0
    assert all(torch.equal(v, snapshot[k]) for k, v in engine.model.state_dict().items())


@pytest.mark.parametrize("fault", ["missing", "unexpected", "shape"])
def test_stage_weights_rejects_bad_payloads_up_front(tok: PreTrainedTokenizerFast, fault: str) -> None:
    engine = make_engine(tok, 0)
    state, key = _faulty_state(tok, fault)
    with pytest.raises(ValueError, match=r"stage_weights: .*" + key.replace(".", r"\.")):
        engine.stage_weights(state, version=9)
    assert engine.pending_version is None and engine.version == 0


def test_tied_weights_may_be_sent_once(tok: PreTrainedTokenizerFast) -> None:
    def tied(seed: int) -> LlamaForCausalLM:
        torch.manual_seed(seed)
        config = make_model(tok, 0).config
        config.tie_word_embeddings = True
        return LlamaForCausalLM(config).eval()

    engine, source = TorchEngine(tied(0), tok.pad_token_id), tied(1)
    state = dict(source.state_dict())
    state.pop("lm_head.weight", None)
    engine.load_weights(state, version=1)
    assert torch.equal(engine.model.lm_head.weight, source.model.embed_tokens.weight)


def _sparse_delta(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, SparseValues]:
    """The positions where ``new`` differs from ``old`` and its values there, per tensor."""
    out = {}
    for name, t in new.items():
        idx = torch.nonzero(t.reshape(-1) != old[name].reshape(-1)).reshape(-1)
        out[name] = SparseValues(idx, t.reshape(-1)[idx])
    return out


async def test_sparse_deltas_queue_in_order_and_need_the_right_base(tok: PreTrainedTokenizerFast) -> None:
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

    # Not started: everything queues, then the loop thread applies it in order.
    assert not engine.stage_weights(d2, 2, base_version=1, complete=False)  # engine is at 0, not 1
    assert engine.stage_weights(d1, 1, base_version=0, complete=False)
    assert engine.stage_weights(d2, 2, base_version=1, complete=False)  # queues behind version 1
    assert engine.pending_version == 2
    async with engine:
        await until(lambda: engine.version == 2)
        assert engine.switches == 1
        assert all(torch.equal(t, v2[n]) for n, t in engine.model.state_dict().items())

        # A complete state replaces the queue; a delta against a version that will not be reached is refused.
        async with engine.pinned():
            assert engine.stage_weights(d1, 3, base_version=2, complete=False)
            assert engine.stage_weights(v0, 4)
            assert not engine.stage_weights(d2, 5, base_version=3, complete=False)
        await until(lambda: engine.version == 4)
        assert all(torch.equal(t, v0[n]) for n, t in engine.model.state_dict().items())

        # Absolute partial updates (adapter-merged tensors on a fixed base) need no base version.
        assert engine.stage_weights({key: v2[key]}, 5, complete=False)
        await until(lambda: engine.version == 5)
    assert torch.equal(engine.model.state_dict()[key], v2[key]) and engine.switches == 3


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
    assert CFG.num_layers == 2  # the keys above exist in the tiny model
