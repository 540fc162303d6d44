"""Model state through megatron-core's distributed checkpointing, resumed on another parallel layout.

Two gloo processes write a Qwen3 model's shards under one layout; another layout (or one process) reads
them back into a freshly initialised model and must hold the HF weights bit for bit. The optimizer state
needs megatron's distributed optimizer, which is CUDA-only: it is exercised by the GPU check, not here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _worker(rank: int, world: int, tp: int, pp: int, path: str, port: int, write: bool) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from miles.backends.megatron import checkpoint
    from miles.backends.megatron.config import translate
    from miles.backends.megatron.converters import converter_for
    from miles.backends.megatron.cpu_shims import cpu_megatron
    from miles.backends.megatron.export import export_hf
    from miles.backends.megatron.model import build_chunks, load_hf_weights
    from miles.backends.megatron.settings import MegatronSettings
    from tests.unit.test_megatron_support import tiny_hf

    torch.set_num_threads(1)
    model, disk = tiny_hf("qwen3")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ps.initialize_model_parallel(tp, pp)
    try:
        with cpu_megatron():
            args = translate(model.config)
            settings = MegatronSettings(tensor_parallel=tp, pipeline_parallel=pp, bf16=False)
            converter = converter_for(args, tp)
            torch.manual_seed(rank + 7)  # different random weights than any other run
            chunks = build_chunks(args, settings, cpu=True)
            for chunk in chunks:
                for p in chunk.parameters():
                    p.data.normal_()
            if write:
                load_hf_weights(chunks, converter, disk.__getitem__, settings, args)
                checkpoint.save(path, chunks, None, {"family": args.family})
            else:
                assert checkpoint.load(path, chunks, None)["family"] == "llama"
                exported = dict(export_hf(chunks, converter, settings, args))
                if rank == 0:
                    for name, tensor in disk.items():
                        assert torch.equal(exported[name], tensor), name
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _run(world: int, tp: int, pp: int, path: str, write: bool) -> None:
    from miles.ports import free_port

    mp.start_processes(_worker, args=(world, tp, pp, path, free_port(), write), nprocs=world, start_method="spawn")


# (world, tp, pp): TP 2 -> PP 2 (TP 1), so reading merges the TP shards and splits the layers over stages.
@pytest.mark.slow  # two spawned processes, megatron imported in each
@pytest.mark.parametrize(("save", "load"), [((2, 2, 1), (2, 1, 2))], ids=["tp2-to-pp2"])
def test_checkpoint_resumes_on_another_layout(tmp_path, save: tuple[int, int, int], load: tuple[int, int, int]) -> None:
    path = str(tmp_path / "ckpt")
    _run(*save, path, write=True)
    _run(*load, path, write=False)
