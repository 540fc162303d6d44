"""megatron-core models on CPU, built from tiny HF configs and loaded through the converters.

Checks, per family (dense Llama, Qwen2 with q/k/v bias, Qwen3, Qwen3-MoE, DeepSeek-V3 MLA+MoE): the
converter covers exactly megatron-core's own parameter names and shapes; the megatron forward gives the
HF model's per-token log-probs; export gives back the HF checkpoint bit for bit. One process, a 1-rank
gloo group (TP = PP = EP = 1); the CUDA-only schedule, DDP and optimizer are not exercised here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from miles.backends.megatron.config import translate  # noqa: E402
from miles.backends.megatron.converters import converter_for  # noqa: E402
from miles.backends.megatron.converters.base import LocalNames, hf_to_mcore, mcore_to_hf_iter, shard_rule  # noqa: E402
from miles.backends.megatron.settings import MegatronSettings  # noqa: E402
from tests.unit.test_megatron_support import TINY_FAMILIES, cpu_model, hf_logprobs, mcore_logprobs, tiny_hf  # noqa: E402


@pytest.fixture(scope="module")
def mcore():
    with cpu_model() as ctx:
        yield ctx


@pytest.mark.parametrize("kind", TINY_FAMILIES)
def test_converter_covers_megatron_parameters(mcore, kind: str) -> None:
    model, disk = tiny_hf(kind)
    args = translate(model.config)
    chunk = mcore.build(args, MegatronSettings(moe_token_dispatcher="allgather"))
    shapes = {k: tuple(v.shape) for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}
    table = converter_for(args).mappings()
    assert set(shapes) == set(table), set(shapes) ^ set(table)
    assert sorted(n for m in table.values() for n in m.hf_names) == sorted(disk)
    loaded = hf_to_mcore(converter_for(args), disk.__getitem__, shapes, LocalNames({i: i for i in range(99)}))
    assert {k: tuple(v.shape) for k, v in loaded.items()} == shapes
    for name in shapes:
        shard_rule(name)  # every parameter has a TP rule


@pytest.mark.parametrize("kind", TINY_FAMILIES)
def test_megatron_forward_matches_hf(mcore, kind: str) -> None:
    model, disk = tiny_hf(kind)
    args = translate(model.config)
    chunk = mcore.build(args, MegatronSettings(moe_token_dispatcher="allgather"))
    mcore.load(chunk, args, disk)
    batch = mcore.packed_batch(model.config.vocab_size)
    expected = hf_logprobs(model, batch)
    got = mcore_logprobs(chunk, args, batch)
    mask = batch.loss_mask.bool() | (batch.seq_index >= 0)
    torch.testing.assert_close(got[mask], expected[mask], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", TINY_FAMILIES)
def test_export_round_trip_is_bit_exact(mcore, kind: str) -> None:
    model, disk = tiny_hf(kind)
    args = translate(model.config)
    chunk = mcore.build(args, MegatronSettings(moe_token_dispatcher="allgather"))
    mcore.load(chunk, args, disk)
    names = LocalNames({i: i for i in range(args.transformer["num_layers"])})
    full = ((names.canonical(k), v) for k, v in chunk.state_dict().items() if not k.endswith("_extra_state"))
    back = dict(mcore_to_hf_iter(converter_for(args), full))
    assert set(back) == set(disk)
    for name, tensor in disk.items():
        assert torch.equal(back[name], tensor), name


def test_bf16_model_keeps_the_expert_bias_in_float32(mcore) -> None:
    """bf16 weights everywhere (norms included, as megatron's Float16Module casts them), except the routing
    bias, which stays float32 and bit-equal to the checkpoint's; log-probs within bf16 rounding of HF's."""
    from miles.backends.megatron.converters import converter_for
    from miles.backends.megatron.model import build_chunks, load_hf_weights

    model, disk = tiny_hf("deepseek_v3")
    args = translate(model.config)
    settings = MegatronSettings(moe_token_dispatcher="allgather", bf16=True)
    (chunk,) = build_chunks(args, settings, cpu=True)
    load_hf_weights([chunk], converter_for(args), disk.__getitem__, settings, args)
    dtypes = {name: t.dtype for name, t in chunk.state_dict().items() if isinstance(t, torch.Tensor)}
    biases = [name for name in dtypes if name.endswith("expert_bias")]
    assert biases and all(dtypes[n] == torch.float32 for n in biases)
    assert all(dtype == torch.bfloat16 for name, dtype in dtypes.items() if name not in biases)
    hf_bias = disk["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(chunk.state_dict()["decoder.layers.1.mlp.router.expert_bias"], hf_bias)
    batch = mcore.packed_batch(model.config.vocab_size)
    got, expected = mcore_logprobs(chunk.eval(), args, batch), hf_logprobs(model, batch)
    mask = batch.seq_index >= 0
    assert (got[mask] - expected[mask]).abs().max() < 0.15
