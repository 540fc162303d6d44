"""Which GPU each process of a run uses (miles/devices.py): trainer ranks first, then each CUDA rollout worker on
its own GPU, pinned before a model loads or a weight-update group forms; NCCL for that group only when both
sides compute on CUDA, Megatron included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles import launch
from miles.config import RunConfig, load_config
from miles.devices import DevicePlanError, local_gpus, process_device
from miles.node import _pin_engine_device
from miles.sync.transport.broadcast import group_backend


def _cfg(*overrides: str) -> RunConfig:
    return load_config(None, list(overrides))


CUDA_RUN = ("trainer.backend.device=cuda", "trainer.ranks=2", "rollout.engine.device=cuda", "rollout.workers=2")


def test_trainer_ranks_first_then_one_gpu_per_cuda_worker() -> None:
    plan = local_gpus(_cfg(*CUDA_RUN), available=4)
    assert plan == {"trainer-0": 0, "trainer-1": 1, "rollout-0": 2, "rollout-1": 3}
    with pytest.raises(DevicePlanError, match="needs 4 GPUs .* 3 visible"):
        local_gpus(_cfg(*CUDA_RUN), available=3)


def test_cpu_parts_and_servers_take_no_gpu() -> None:
    assert local_gpus(_cfg(), available=0) == {}
    cpu_engine = _cfg("trainer.backend.device=cuda", "trainer.ranks=2")
    assert local_gpus(cpu_engine, available=2) == {"trainer-0": 0, "trainer-1": 1}
    pinned = _cfg("rollout.engine.device=cuda:1", "rollout.workers=2")  # the recipe names the GPU itself
    assert local_gpus(pinned, available=2) == {}
    vllm = _cfg("rollout.engine.type=vllm", "trainer.backend.device=cuda")  # the server picks its own GPUs
    assert local_gpus(vllm, available=1) == {"trainer-0": 0}


def test_the_weight_group_backend_covers_megatron() -> None:
    assert group_backend(_cfg("trainer.backend.type=megatron", "rollout.engine.device=cuda")) == "nccl"
    assert group_backend(_cfg("trainer.backend.type=megatron")) == "gloo"  # a CPU engine: host memory
    assert group_backend(_cfg(*CUDA_RUN)) == "nccl"
    assert group_backend(_cfg()) == "gloo"


def test_a_bare_cuda_gets_the_process_gpu() -> None:
    assert process_device("cuda", 3) == "cuda:3"
    assert process_device("cuda", None) == "cuda:0"
    assert process_device("cuda:1", 3) == "cuda:1"
    assert process_device("cpu", 3) == "cpu"


def test_miles_run_tells_each_cuda_worker_its_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: dict[str, list[str]] = {}
    monkeypatch.setattr(launch, "_spawn", lambda name, cmd, run_dir: started.setdefault(name, cmd))
    cfg = _cfg(*CUDA_RUN)
    launch.spawn_actors(cfg, tmp_path / "c.yaml", tmp_path, "nats://x", local_gpus(cfg, available=4))
    assert started["rollout-1"][-2:] == ["--gpu", "3"] and "--gpu" not in started["controller"]


def test_a_cpu_worker_keeps_its_config() -> None:
    cfg = _cfg()
    assert _pin_engine_device(cfg, 2) is cfg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_worker_is_pinned_to_its_gpu() -> None:
    gpu = torch.cuda.device_count() - 1
    cfg = _pin_engine_device(_cfg("rollout.engine.device=cuda"), gpu)
    assert cfg.rollout.engine.device == f"cuda:{gpu}" and torch.cuda.current_device() == gpu
