"""Weight sync as one component: the trainer's sender and the workers' receiver are built from the same
registries, a weight-update group's members agree on its backend and rendezvous keys, and each engine
owns the sink that turns a published state into its weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
import torch.distributed as dist

from miles.config import RunConfig, load_config
from miles.sync import receiver, sender
from miles.sync.transport.broadcast import group_backend, rendezvous_store


def run_config(tmp_path: Path, yaml: str) -> RunConfig:
    path = tmp_path / "r.yaml"
    path.write_text(yaml + "sync:\n  transport: broadcast\n")
    return load_config(str(path), [])


def test_every_built_in_transport_has_both_sides() -> None:
    assert {"bus", "fs", "broadcast"} <= set(sender.TRANSPORTS.names)
    assert set(sender.TRANSPORTS.names) == set(receiver.RECEIVER_TRANSPORTS.names)
    for name in sender.TRANSPORTS.names:
        receiver.check_transport(name)


@pytest.mark.parametrize(
    ("yaml", "backend"),
    [
        ("trainer:\n  backend: {type: fsdp, device: cuda}\nrollout:\n  engine: {device: cuda}\n", "nccl"),
        ("trainer:\n  backend: {type: fsdp, device: cuda}\n", "gloo"),  # CPU engines: the group is gloo for all
        ("", "gloo"),
    ],
)
async def test_the_trainer_and_the_workers_join_one_group_with_one_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, yaml: str, backend: str
) -> None:
    """Before, a CUDA trainer joined with NCCL under the 'cuda/' key prefix and every worker with gloo under
    'cpu/': they could never meet. Both sides now take the backend from the run's config."""
    cfg = run_config(tmp_path, yaml)
    joined: list[tuple[int, str]] = []

    class Group:
        def __init__(self, rank: int) -> None:
            self.rank, self.name = rank, "g"

    def join(addr: str, port: int, rank: int, world: int, *, name: str, backend: str, timeout_s: float) -> Group:
        joined.append((rank, backend))
        return Group(rank)

    class NoVersionYet:
        async def get_bytes(self, key: str) -> bytes | None:
            return None

    monkeypatch.setattr("miles.sync.transport.broadcast.WeightUpdateGroup.join", join)
    log = structlog.get_logger()
    await sender.TRANSPORTS.factory("broadcast")(
        sender.TransportContext(cfg, tmp_path, store=None, first_start=True, log=log)
    )  # type: ignore[arg-type]
    ctx = receiver.ReceiverContext(cfg, NoVersionYet(), tmp_path, group_rank=1, log=log)  # type: ignore[arg-type]
    side = await receiver.RECEIVER_TRANSPORTS.factory("broadcast")(ctx)
    assert side.source is not None and side.service is side.source
    assert joined == [(0, backend), (1, backend)]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_the_rendezvous_keys_are_those_of_torchs_group_helper(backend: str) -> None:
    """SGLang's /init_weights_update_group joins through torch's helper, which nests the prefixes
    ``<name>``, ``<name>/`` and the backend's device: a member of ours must write where it reads."""
    raw = dist.HashStore()
    ours = rendezvous_store(raw, "run_weights", backend)
    ours.set("rank0", b"here")
    device = "cuda" if backend == "nccl" else "cpu"
    helpers = dist.PrefixStore(f"{device}/", dist.PrefixStore("run_weights/", dist.PrefixStore("run_weights", raw)))
    assert helpers.get("rank0") == b"here"
    other = "cpu" if device == "cuda" else "cuda"
    elsewhere = dist.PrefixStore(f"{other}/", dist.PrefixStore("run_weights/", dist.PrefixStore("run_weights", raw)))
    assert not elsewhere.check(["rank0"])


def test_the_group_backend_is_refused_unless_gloo_or_nccl() -> None:
    from miles.sync.transport.broadcast import WeightUpdateGroup

    with pytest.raises(ValueError, match="gloo or nccl"):
        WeightUpdateGroup.join("127.0.0.1", 1, 0, 1, backend="mpi")


def test_group_backend_of_the_default_run_is_gloo(tmp_path: Path) -> None:
    assert group_backend(run_config(tmp_path, "")) == "gloo"


# ------------------------------------------------------------------ engine-owned sinks


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(6, 4, bias=False)


def lora_adapter() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {
        "base_model.model.q.lora_A.weight": torch.randn(2, 6).bfloat16(),
        "base_model.model.q.lora_B.weight": torch.randn(4, 2).bfloat16(),
    }


def test_the_torch_engine_merges_an_adapter_on_its_own_frozen_base() -> None:
    from miles.engines.torch_engine import TorchEngine
    from miles.sync.lora import merge_adapter

    engine: Any = TorchEngine.__new__(TorchEngine)  # the sink needs only the model
    engine.model = TinyModel()
    base = {"q.weight": engine.model.q.weight.detach().clone()}
    merged, complete = engine.weight_sink("bfloat16", 2.0).decode(lora_adapter())
    assert not complete
    torch.testing.assert_close(merged["q.weight"], merge_adapter(base, lora_adapter(), 2.0)["q.weight"])
    state, complete = engine.weight_sink("bfloat16", None).decode(base)
    assert complete and state.keys() == base.keys()


def test_an_sglang_server_gets_the_adapter_itself(tmp_path: Path) -> None:
    from miles.config import LoraConfig
    from miles.engines.sglang_staging import SglangStagingEngine

    staging = SglangStagingEngine(object(), tmp_path, lora=LoraConfig(rank=2))  # type: ignore[arg-type]
    adapter = lora_adapter()
    passed, complete = staging.weight_sink("bfloat16", 2.0).decode(adapter)
    assert not complete and passed.keys() == adapter.keys()  # the server applies it, not us
    full = SglangStagingEngine(object(), tmp_path)  # type: ignore[arg-type]
    codes = {"w": torch.ones(2, 2)}
    state, complete = full.weight_sink("bfloat16", None).decode(codes)
    assert complete and torch.equal(state["w"], codes["w"])
