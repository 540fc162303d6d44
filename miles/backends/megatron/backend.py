"""``MegatronBackend``: :class:`~miles.backends.base.TrainBackend` over megatron-core (GPU only).

Layout: ``trainer.ranks`` processes, one GPU each, tiled ``tp * pp * cp`` per model replica and ``dp`` replicas
(``ep`` folded into ``dp * cp`` for experts). Weights are bf16 on the GPUs; megatron's distributed optimizer
keeps float32 master weights and Adam state sharded over the data-parallel ranks, reduces gradients in
float32, clips by the global norm and skips a step whose gradients are not finite (a constant loss scale of
1 turns on its inf/NaN check; bf16 needs no real scaling).

Each call runs megatron-core's own forward-backward schedule (``get_forward_backward_func``: plain, 1F1B
pipelined, or interleaved with virtual stages) with :func:`~miles.backends.megatron.forward.make_forward_step`.
Micro-batches: every data-parallel rank runs the same number (the largest over ranks; the others are
padded with copies whose loss mask is 0, which add nothing), and a multiple of ``pp`` with virtual stages.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import Tensor

from miles.backends.base import LossFn, MicroBatch, TokenOutputs
from miles.backends.megatron import checkpoint
from miles.backends.megatron.config import McoreModelArgs, translate
from miles.backends.megatron.converters import converter_for
from miles.backends.megatron.export import export_hf
from miles.backends.megatron.forward import StepOptions, make_forward_step, moe_aux_scale
from miles.backends.megatron.hf_io import SafetensorsReader
from miles.backends.megatron.model import build_chunks, load_hf_weights, wants_te
from miles.backends.megatron.settings import MegatronSettings
from miles.config import MegatronBackendConfig, TrainerConfig

log = structlog.get_logger(__name__)


def init_model_parallel(settings: MegatronSettings, seed: int) -> None:
    """megatron's process groups on the already-joined default group, and its model-parallel RNG."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    settings.data_parallel_size(dist.get_world_size())  # raises naming the layout if it does not tile
    if ps.model_parallel_is_initialized():  # a second backend in one process (the GPU check): same layout
        if ps.get_tensor_model_parallel_world_size() != settings.tensor_parallel:
            raise RuntimeError("megatron's process groups already exist with another layout")
        return
    ps.initialize_model_parallel(
        tensor_model_parallel_size=settings.tensor_parallel,
        pipeline_model_parallel_size=settings.pipeline_parallel,
        virtual_pipeline_model_parallel_size=settings.virtual_pipeline_parallel,
        context_parallel_size=settings.context_parallel,
        expert_model_parallel_size=settings.expert_parallel,
        expert_tensor_parallel_size=settings.expert_tensor_parallel,
    )
    model_parallel_cuda_manual_seed(seed)


def _blank(mb: MicroBatch) -> MicroBatch:
    """A copy of ``mb`` that trains nothing (loss mask 0), to even out micro-batch counts."""
    return MicroBatch(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        targets=mb.targets,
        loss_mask=torch.zeros_like(mb.loss_mask),
        seq_index=torch.full_like(mb.seq_index, -1),
        tensors={k: torch.zeros_like(v) for k, v in mb.tensors.items()},
    )


class MegatronBackend:
    """See the module docstring. Construct after ``torch.distributed`` is joined (NCCL, one GPU per rank).

    Args:
        model_dir: HF checkpoint directory (``config.json`` + safetensors).
        pad_token_id: id the micro-batches are padded with.
        trainer_cfg: optimizer and algorithm settings; ``trainer_cfg.backend`` a ``MegatronBackendConfig``.
        temperature: sampling temperature of the rollouts (log-probs use ``logits / temperature``).
        settings: overrides what is read from ``trainer_cfg.backend`` (the GPU check sets precision with it,
            until ``MegatronBackendConfig`` has every field of :class:`MegatronSettings`).
    """

    def __init__(
        self,
        model_dir: str | Path,
        pad_token_id: int,
        trainer_cfg: TrainerConfig,
        *,
        temperature: float = 1.0,
        settings: MegatronSettings | None = None,
    ) -> None:
        if not isinstance(trainer_cfg.backend, MegatronBackendConfig):
            raise TypeError(f"MegatronBackend needs a MegatronBackendConfig, got {type(trainer_cfg.backend).__name__}")
        if trainer_cfg.lora is not None:
            raise ValueError("trainer.lora is not supported by the Megatron backend (use trainer.backend.type=fsdp)")
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        self.cfg = trainer_cfg
        self.settings = settings or MegatronSettings.from_backend_config(trainer_cfg.backend, seed=trainer_cfg.seed)
        self.args: McoreModelArgs = translate(AutoConfig.from_pretrained(str(model_dir)))
        init_model_parallel(self.settings, trainer_cfg.seed)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.shares_prompts = False  # its masks come from position ids (batches.block_causal_mask)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.use_te = wants_te(self.settings)
        self.converter = converter_for(self.args, self.settings.tensor_parallel)
        reader = SafetensorsReader(model_dir)

        chunks = build_chunks(self.args, self.settings, use_te=self.use_te)
        load_hf_weights(chunks, self.converter, reader, self.settings, self.args)
        self.reference: list[torch.nn.Module] | None = None
        if trainer_cfg.algo.kl_coef > 0:  # the initial policy, frozen (the HF checkpoint again)
            self.reference = [c.requires_grad_(False).eval() for c in copy.deepcopy(chunks)]
        self.model = self._wrap(chunks)
        self.optimizer = self._optimizer()
        self._zero_grad()
        self.opts = StepOptions(
            vocab_size=self.args.vocab_size,
            temperature=temperature,
            layout=self._layout(),
            pad_token_id=pad_token_id,
            chunk_tokens=self.settings.logprob_chunk_tokens,
        )
        log.info(
            "megatron.ready",
            rank=self.rank,
            family=self.args.family,
            tp=self.settings.tensor_parallel,
            pp=self.settings.pipeline_parallel,
            vp=self.settings.virtual_pipeline_parallel,
            cp=self.settings.context_parallel,
            ep=self.settings.expert_parallel,
            dp=self.dp_size,
            transformer_engine=self.use_te,
            layout=self.opts.layout,
        )

    # ------------------------------------------------------------------ setup

    def _layout(self) -> str:
        packing = self.settings.packing
        if packing == "auto":
            packing = "thd" if self.use_te else "mask"
        if (packing == "thd" or self.settings.context_parallel > 1) and not self.use_te:
            raise RuntimeError("thd packing and context parallelism need TransformerEngine")
        if self.settings.context_parallel > 1 and packing != "thd":
            raise ValueError("context_parallel > 1 needs trainer.backend.packing=thd")
        if packing == "mask" and self.use_te:  # TE's causal attention would ignore the block-diagonal mask
            raise ValueError("packing=mask needs transformer_engine=off (TE's causal attention ignores masks)")
        return packing

    def _wrap(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.settings.use_distributed_optimizer,
            check_for_nan_in_grad=False,  # a non-finite step is skipped by the optimizer, not raised
            average_in_collective=False,  # sum: Miles' losses are shares of the global loss
        )
        model = [
            DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)
        ]
        config = chunks[0].config

        def finalize(models: list[torch.nn.Module], num_tokens: Tensor | None, **kwargs: Any) -> None:
            finalize_model_grads(models, None, **kwargs)  # no 1/num_tokens: the loss is already normalised

        config.finalize_model_grads_func = finalize
        syncs = [m.no_sync for m in model]
        config.no_sync_func = syncs[0] if len(syncs) == 1 else syncs
        return model

    def _optimizer(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        bf16 = self.settings.bf16
        config = OptimizerConfig(
            optimizer="adam",
            lr=self.cfg.lr,
            weight_decay=self.cfg.weight_decay,
            adam_beta1=self.cfg.betas[0],
            adam_beta2=self.cfg.betas[1],
            adam_eps=1e-8,
            clip_grad=self.cfg.grad_clip,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=self.settings.use_distributed_optimizer,
            loss_scale=1.0,  # constant scale 1: enables the inf/NaN check that skips a bad step
        )
        return get_megatron_optimizer(config, self.model)

    def _zero_grad(self) -> None:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    # ------------------------------------------------------------------ schedule

    def _even(self, batches: list[MicroBatch]) -> list[MicroBatch]:
        """The same number of micro-batches on every DP rank (a multiple of pp with virtual stages)."""
        from megatron.core import parallel_state as ps

        if not batches:
            raise ValueError("need at least one micro-batch on every rank")
        count = torch.tensor([len(batches)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group(with_context_parallel=True))
        target = int(count.item())
        if self.settings.virtual_pipeline_parallel:
            target = -(-target // self.settings.pipeline_parallel) * self.settings.pipeline_parallel
        return batches + [_blank(batches[-1]) for _ in range(target - len(batches))]

    def _run(
        self, chunks: list[torch.nn.Module], batches: list[MicroBatch], loss_fn: LossFn | None, opts: StepOptions
    ) -> list[dict[str, Any]]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_only = loss_fn is None
        for chunk in chunks:
            chunk.train(not forward_only)
        config = chunks[0].config
        config.grad_scale_func = None
        if not forward_only and self.args.num_experts and self.settings.moe_aux_loss_coef > 0:
            scale = moe_aux_scale(len(batches))
            opts = dataclasses.replace(opts, aux_scale=scale)
            config.grad_scale_func = lambda t: t * scale  # megatron weighs the router loss with this
        iterators: Any = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
        store = get_forward_backward_func()(
            forward_step_func=make_forward_step(opts, loss_fn, self.device),
            data_iterator=iterators,
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(batches),
            seq_length=max(b.input_ids.shape[1] for b in batches),
            micro_batch_size=max(b.input_ids.shape[0] for b in batches),
            forward_only=forward_only,
        )
        config.grad_scale_func = None
        return list(store)

    def _from_last_stage(self, obj: Any) -> Any:
        """The last pipeline stage's ``obj`` on every stage of this pipeline. Collective over PP."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            return obj
        box = [obj]
        src = ps.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(box, src=src, group=ps.get_pipeline_model_parallel_group())
        return box[0]

    # ------------------------------------------------------------------ TrainBackend

    def score(self, batches: list[MicroBatch], *, reference: bool = False, entropy: bool = False) -> list[TokenOutputs]:
        if reference and self.reference is None:
            raise ValueError("score(reference=True) needs trainer.algo.kl_coef > 0 (no reference model kept)")
        chunks = self.reference if reference else self.model
        evened = self._even(batches)
        opts = dataclasses.replace(self.opts, entropy=entropy)
        with torch.no_grad():
            store = self._run(chunks, evened, None, opts)
        outputs = [item["outputs"] for item in store][: len(batches)] if store else None
        cpu = None
        if outputs is not None:
            cpu = [TokenOutputs(o.logp.cpu(), None if o.entropy is None else o.entropy.cpu()) for o in outputs]
        return self._from_last_stage(cpu)

    def forward_backward(
        self, batches: list[MicroBatch], loss_fn: LossFn, *, entropy: bool = False
    ) -> dict[str, float]:
        opts = dataclasses.replace(self.opts, entropy=entropy)
        store = self._run(self.model, self._even(batches), loss_fn, opts)
        sums: dict[str, float] | None = None
        if store:
            sums = {}
            for item in store:
                for key, value in item["metrics"].items():
                    sums[key] = sums.get(key, 0.0) + float(value)
        return self._from_last_stage(sums)

    def optimizer_step(self, lr: float, *, skip: bool = False) -> float:
        if skip:
            self._zero_grad()
            return 0.0
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        success, grad_norm, _ = self.optimizer.step()
        norm = float(grad_norm) if success and grad_norm is not None else math.nan
        if not success:
            log.warning("megatron.step_skipped", rank=self.rank, reason="non-finite gradients")
        self._zero_grad()
        return norm

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        from megatron.core import parallel_state as ps

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=ps.get_data_parallel_group())
        return t.tolist()

    def policy_tensors(self) -> list[Tensor]:
        """This rank's (tensor/pipeline/expert-parallel) part of each trainable parameter of every chunk."""
        return [p.data for chunk in self.model for p in chunk.parameters() if p.requires_grad]

    def export_params(self, *, adapter_only: bool = False) -> Iterator[tuple[str, Tensor]]:
        if adapter_only:
            raise ValueError("the Megatron backend trains no LoRA adapter")
        return export_hf(self.model, self.converter, self.settings, self.args)

    def save_checkpoint(self, path: str) -> None:
        layout = {k: getattr(self.settings, k) for k in ("tensor_parallel", "pipeline_parallel", "expert_parallel")}
        checkpoint.save(path, self.model, self.optimizer, {"family": self.args.family, "layout": layout})

    def load_checkpoint(self, path: str) -> None:
        info = checkpoint.load(path, self.model, self.optimizer)
        if info.get("family") != self.args.family:
            raise ValueError(f"{path}: a {info.get('family')} checkpoint, this model is {self.args.family}")
