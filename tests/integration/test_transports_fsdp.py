"""Streamed export from two FSDP2 ranks into a real data-plane store: rank 0 publishes while rank 1 drains,
and what workers fetch is bit for bit the whole-state export of the same model."""

from __future__ import annotations

import asyncio

import pytest
import torch
from nats.aio.client import Client
from transformers import LlamaConfig, LlamaForCausalLM

from miles.backends.distributed import distributed, spawn_ranks
from miles.backends.fsdp_export import export_specs, iter_full_params
from miles.bus.connect import connect
from miles.bus.errors import PayloadMissing
from miles.config import LoraConfig
from miles.ports import free_port
from miles.sync.lora import add_adapters, lora_scale, merged_state, split_peft_state
from miles.sync.precision import state_digest, to_rollout_state
from miles.sync.stream_export import PayloadLayout, drain
from miles.sync.transport import verified_state
from miles.sync.transport.bus import BusTransport
from miles.sync.transport.dataplane import WeightStore

LORA = LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"])
# (version, precision, model kind, adapter_only)
CASES = [
    (1, "bfloat16", "tied", False),
    (2, "fp8_e4m3", "untied", False),
    (3, "fp4_e2m1", "untied", False),
    (4, "bfloat16", "lora", False),
    (5, "float32", "lora", True),
]


def model_of(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=48,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=kind == "tied",
    )
    model = LlamaForCausalLM(cfg)
    if kind == "lora":
        model = add_adapters(model, LORA)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_()
    return model


def shard(model: torch.nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    for layer in [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _rank_main(rank: int, port: int, url: str) -> None:
    torch.set_num_threads(1)
    with distributed(rank, 2, "127.0.0.1", port, timeout_s=120):
        for version, precision, kind, adapter_only in CASES:
            model = model_of(kind)
            shard(model)
            scale = lora_scale(LORA) if kind == "lora" else None

            def params(m: torch.nn.Module = model, a: bool = adapter_only, s: float | None = scale):
                return iter_full_params(m, adapter_only=a, lora_scale=s, dst=0)

            if rank == 0:
                layout = PayloadLayout.plan(
                    export_specs(model, adapter_only=adapter_only, lora_scale=scale), precision, version
                )
                asyncio.run(_publish(url, layout, params))
            else:
                drain(params())


async def _publish(url: str, layout: PayloadLayout, params: object) -> None:
    nc = await connect(url, name="rank0")
    try:
        store = await WeightStore.create(nc.jetstream(), "t", chunk_bytes=8192, keep_versions=10)
        await BusTransport(store).publish(layout, params)  # type: ignore[arg-type]
    finally:
        await nc.close()


def expected_state(kind: str, adapter_only: bool) -> dict[str, torch.Tensor]:
    model = model_of(kind)
    sd = model.state_dict()
    if kind == "lora":
        return split_peft_state(sd)[0] if adapter_only else merged_state(sd, lora_scale(LORA))
    if kind == "tied":
        sd.pop("lm_head.weight")
    return sd


async def test_two_rank_streamed_export_reads_back_as_the_whole_state(nc: Client, nats_server: str) -> None:
    await asyncio.to_thread(spawn_ranks, _rank_main, 2, free_port(), nats_server)
    store = await WeightStore.create(nc.jetstream(), "t", keep_versions=10)
    for version, precision, kind, adapter_only in CASES:
        expected = to_rollout_state(expected_state(kind, adapter_only), precision)
        payload = await store.get(version)
        got = verified_state(payload, state_digest(expected))  # raises unless the state digest matches
        assert sorted(got) == sorted(expected), version
        if kind == "lora" and adapter_only:
            assert all(".lora_" in name for name in got)
    with pytest.raises(PayloadMissing):
        await store.get(99)
