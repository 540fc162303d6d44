"""Tensor, pipeline and expert parallelism on CPU: two gloo processes build one megatron-core model.

Each layout loads the HF checkpoint through the converters' sharding, then (where the model runs in one
forward without a pipeline schedule, i.e. PP = 1) checks the vocab-parallel log-probs against the HF
model, and streams the weights back through :func:`miles.backends.megatron.export.export_hf` (TP
all-gathers, PP/EP sends to rank 0), which must give the HF checkpoint bit for bit, and FP8 rollout
tensors equal to the shared codec's.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

LAYOUTS = [
    pytest.param("llama", 2, 1, 1, id="llama-tp2"),
    pytest.param("deepseek_v3", 2, 1, 1, id="deepseek-tp2"),
    pytest.param("qwen3", 1, 2, 1, id="qwen3-pp2"),
    pytest.param("qwen3_moe", 1, 1, 2, id="qwen3moe-ep2"),
    pytest.param("deepseek_v3", 1, 1, 2, id="deepseek-ep2"),
]


def _worker(rank: int, kind: str, tp: int, pp: int, ep: int, port: int) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from miles.backends.megatron.config import translate
    from miles.backends.megatron.converters import converter_for
    from miles.backends.megatron.cpu_shims import cpu_megatron
    from miles.backends.megatron.export import export_hf, rollout_stream
    from miles.backends.megatron.model import build_chunks, load_hf_weights
    from miles.backends.megatron.settings import MegatronSettings
    from miles.sync.precision import to_rollout_state
    from tests.unit.test_megatron_support import hf_logprobs, mcore_logprobs, sample_batch, tiny_hf

    torch.set_num_threads(1)
    model, disk = tiny_hf(kind)  # before joining: transformers saves on rank 0 only inside a process group
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    try:
        with cpu_megatron():
            args = translate(model.config)
            layout = dict(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
            settings = MegatronSettings(**layout, moe_token_dispatcher="allgather", bf16=False)
            converter = converter_for(args, tp)
            chunks = build_chunks(args, settings, cpu=True)
            load_hf_weights(chunks, converter, disk.__getitem__, settings, args)
            if pp == 1:
                batch = sample_batch(args.vocab_size)
                got = mcore_logprobs(chunks[0].eval(), args, batch)
                expected = hf_logprobs(model, batch)
                mask = batch.seq_index >= 0
                torch.testing.assert_close(got[mask], expected[mask], atol=2e-5, rtol=1e-5)
                if not (args.num_experts and tp > 1):  # megatron refuses to train MoE + TP without SP (no TE here)
                    _check_gradients(chunks, converter, settings, args, model, disk, batch, rank)
            exported = list(export_hf(chunks, converter, settings, args))
            names = [n for n, _ in exported]
            assert sorted(names) == sorted(disk), set(names) ^ set(disk)
            if rank == 0:
                for name, tensor in exported:
                    assert torch.equal(tensor, disk[name]), name
                fp8 = dict(rollout_stream(iter(exported), "fp8_e4m3"))
                ref = to_rollout_state(disk, "fp8_e4m3")
                assert fp8.keys() == ref.keys()
                for name in ref:
                    assert fp8[name].dtype == ref[name].dtype, name
                    assert torch.equal(fp8[name].float(), ref[name].float()), name
            else:
                assert all(t.numel() == 0 for _, t in exported)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _check_gradients(chunks, converter, settings, args, model, disk, batch, rank) -> None:
    """The sharded gradient of ``-sum(mask * logp)`` equals HF's. Each data-parallel rank takes its share
    of the loss (1 / dp) and non-expert gradients are summed over DP, as megatron's DDP does; the gradients
    are then streamed out through the export path (swapped into the weights) and compared in HF names."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from miles.algo.logprobs import token_logprobs
    from miles.backends.megatron.batches import segment_ids
    from miles.backends.megatron.export import export_hf
    from miles.backends.megatron.forward import StepOptions, make_forward_step
    from miles.backends.megatron.model import load_hf_weights

    dp = ps.get_data_parallel_world_size()
    opts = StepOptions(vocab_size=args.vocab_size, chunk_tokens=5)

    def loss_fn(out, mb):
        return -(out.logp * mb.loss_mask).sum() / dp, {}

    chunk = chunks[0].train()
    output, loss_func = make_forward_step(opts, loss_fn, torch.device("cpu"))(iter([batch]), chunk)
    loss_func(output)[0].backward()
    with torch.no_grad():
        for name, param in chunk.named_parameters():
            if dp > 1 and ".experts." not in name:
                dist.all_reduce(param.grad, group=ps.get_data_parallel_group())
            param.copy_(param.grad)
    grads = dict(export_hf(chunks, converter, settings, args))
    model.zero_grad()
    seg = segment_ids(batch.position_ids)
    total = 0.0
    for r in range(batch.input_ids.shape[0]):
        for s in torch.unique(seg[r]).tolist():
            idx = (seg[r] == s).nonzero().flatten()
            logits = model(input_ids=batch.input_ids[r, idx].unsqueeze(0)).logits
            lp = token_logprobs(logits, batch.targets[r, idx][None])[0]
            total = total - (lp * batch.loss_mask[r, idx]).sum()
    total.backward()
    if rank == 0:
        hf = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        checked = [n for n in hf if n in grads]
        assert len(checked) >= 10
        for name in checked:
            torch.testing.assert_close(grads[name], hf[name], atol=2e-5, rtol=1e-4)
    load_hf_weights(chunks, converter, disk.__getitem__, settings, args)  # the weights again, for the export check


@pytest.mark.slow  # two spawned processes, megatron imported in each
@pytest.mark.parametrize(("kind", "tp", "pp", "ep"), LAYOUTS)
def test_parallel_layout_loads_runs_and_exports(kind: str, tp: int, pp: int, ep: int) -> None:
    from miles.ports import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(kind, tp, pp, ep, free_port()), nprocs=2, start_method="spawn")
