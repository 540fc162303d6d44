"""The ``forward_step`` that megatron-core's forward-backward schedules call, around Miles' loss.

megatron's contract (``megatron.core.pipeline_parallel.schedules``): ``forward_step(data_iterator, model)``
returns the model output and a ``loss_func``; on the last pipeline stage the schedule calls
``loss_func(output)`` and, with ``calculate_per_token_loss=True`` (set by
:func:`miles.backends.megatron.config.transformer_config`), back-propagates the returned loss **as is**
(no division by micro-batch or token counts) and gradients are summed, not averaged, over data-parallel
ranks. Miles' :data:`~miles.backends.base.LossFn` already returns each micro-batch's share of the global
loss, so this sum is exactly the gradient of the batch loss, as in the FSDP backend.

``loss_func`` turns the vocab-parallel logits into :class:`~miles.backends.base.TokenOutputs` on Miles'
``(R, L)`` grid (:mod:`.batches`, :mod:`.logprobs`), calls the algorithm's loss, and hands the schedule
``(loss / aux_scale, num_tokens, {"metrics": ...})``. ``aux_scale`` (see :func:`moe_aux_scale`) is how MoE
router losses get their weight: megatron scales them by ``config.grad_scale_func(1)``, and also scales the
main loss by it, which dividing by ``aux_scale`` here undoes.

With context parallelism each CP rank computes the log-probs of its own tokens; they are all-gathered
(forward) into the full grid so that every CP rank evaluates the same loss, whose backward keeps only the
local slice: summed over the CP ranks by megatron's gradient reduction, that is the true gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles.backends.base import LossFn, MicroBatch, TokenOutputs
from miles.backends.megatron.batches import McoreBatch, mask_layout, thd_layout
from miles.backends.megatron.logprobs import vocab_parallel_logprobs


class _GatherSlice(torch.autograd.Function):
    """All-gather along a new leading dim over ``group`` forward; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, rank: int, size: int) -> Tensor:  # type: ignore[override]
        ctx.rank = rank
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        return grad[ctx.rank], None, None, None


@dataclass(frozen=True, slots=True)
class StepOptions:
    """What every micro-batch's forward needs besides the batch."""

    vocab_size: int  # the real vocabulary (logits carry TP padding)
    temperature: float = 1.0
    entropy: bool = False
    layout: str = "mask"  # "mask" or "thd" (batches.py)
    pad_token_id: int = 0
    chunk_tokens: int = 4096
    aux_scale: float = 1.0


def model_inputs(mb: MicroBatch, opts: StepOptions) -> McoreBatch:
    """The layout ``opts.layout`` on this rank (TP / CP sizes from megatron's parallel state)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    sequence_parallel = tp > 1  # padding to a multiple of TP is harmless when SP is off
    if opts.layout == "mask":
        return mask_layout(mb, tp if sequence_parallel else 1, opts.pad_token_id)
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    gather = None
    if cp > 1:
        group = ps.get_context_parallel_group()

        def gather(x: Tensor) -> Tensor:
            return _GatherSlice.apply(x, group, cp_rank, cp)

    return thd_layout(mb, cp=cp, cp_rank=cp_rank, tp=tp, pad_token_id=opts.pad_token_id, gather_cp=gather)


def token_outputs(logits: Tensor, inputs: McoreBatch, opts: StepOptions) -> TokenOutputs:
    """Log-probs (and entropies) of the targets on Miles' ``(R, L)`` grid, from ``(B, S, V / tp)`` logits."""
    from megatron.core import parallel_state as ps

    logp, entropy = vocab_parallel_logprobs(
        logits,
        inputs.targets.to(logits.device),
        vocab_size=opts.vocab_size,
        temperature=opts.temperature,
        entropy=opts.entropy,
        chunk_tokens=opts.chunk_tokens,
        group=ps.get_tensor_model_parallel_group(),
    )
    return TokenOutputs(logp=inputs.scatter(logp), entropy=None if entropy is None else inputs.scatter(entropy))


def _to(mb: MicroBatch, device: torch.device) -> MicroBatch:
    return MicroBatch(
        input_ids=mb.input_ids.to(device),
        position_ids=mb.position_ids.to(device),
        targets=mb.targets.to(device),
        loss_mask=mb.loss_mask.to(device),
        seq_index=mb.seq_index.to(device),
        tensors={k: v.to(device) for k, v in mb.tensors.items()},
    )


def make_forward_step(
    opts: StepOptions, loss_fn: LossFn | None, device: torch.device
) -> Callable[[Iterator[MicroBatch], torch.nn.Module], tuple[Tensor, Callable[[Tensor], Any]]]:
    """megatron's ``forward_step_func``. ``loss_fn=None`` scores: the loss is 0 and ``loss_func`` returns
    ``{"outputs": TokenOutputs}`` (detached) instead of metrics."""

    def forward_step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module) -> tuple[Tensor, Any]:
        mb = _to(next(data_iterator), device)
        inputs = model_inputs(mb, opts)
        output = model(
            inputs.input_ids,
            inputs.position_ids,
            attention_mask=inputs.attention_mask,
            packed_seq_params=inputs.packed_seq_params,
        )
        return output, partial(_loss_func, mb=mb, inputs=inputs, opts=opts, loss_fn=loss_fn)

    return forward_step


def _loss_func(
    logits: Tensor, *, mb: MicroBatch, inputs: McoreBatch, opts: StepOptions, loss_fn: LossFn | None
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    outputs = token_outputs(logits, inputs, opts)
    num_tokens = torch.tensor(mb.num_tokens, dtype=torch.int, device=logits.device)
    if loss_fn is None:
        detached = TokenOutputs(
            logp=outputs.logp.detach(), entropy=None if outputs.entropy is None else outputs.entropy.detach()
        )
        return logits.new_zeros((), dtype=torch.float32), num_tokens, {"outputs": detached}
    loss, metrics = loss_fn(outputs, mb)
    return loss / opts.aux_scale, num_tokens, {"metrics": {k: v.detach() for k, v in metrics.items()}}


def moe_aux_scale(num_microbatches: int) -> float:
    """Weight of one micro-batch's router auxiliary loss: ``1 / (micro-batches * dp * cp)``, so that
    ``trainer.backend.moe_aux_loss_coef`` weighs the mean over the step's micro-batches and data replicas
    (megatron sums it otherwise, growing with the batch split)."""
    from megatron.core import parallel_state as ps

    replicas = ps.get_data_parallel_world_size(with_context_parallel=True)
    return 1.0 / (num_microbatches * replicas)
