"""The training-backend interface: per-token log-probs, gradients, optimizer steps, export, checkpoints.

A backend knows how to run a model in parallel (FSDP2 data parallel; megatron-core with tensor, pipeline,
expert and context parallelism). It does **not** know the RL algorithm: the algorithm layer
(:mod:`miles.algo`) builds the loss from the per-token log-probs a backend computes and hands the backend a
loss function to differentiate (:data:`LossFn`), so every backend optimises exactly the same objective.

Every method is collective: all ranks of the trainer call it, in the same order. Data-parallel ranks get
different micro-batches; ranks of one model-parallel group (Megatron's TP/PP/CP) get the same ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch
    from torch import Tensor


@dataclass(slots=True)
class TrainSample:
    """One episode as the trainer consumes it: exactly the token ids the engine sampled.

    ``token_ids`` is everything after the prompt, model turns and environment turns alike;
    ``loss_mask[i]`` is 1 where ``token_ids[i]`` was sampled by the model and is trained on, 0 on tokens
    the environment (or the chat template) added. ``behaviour_logprobs`` has one entry per ``token_ids``
    (0.0 where the mask is 0). ``advantage`` is one value for the whole sequence or one per token.
    ``teacher_logprobs`` (per token, optional) feeds on-policy distillation.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    advantage: float | list[float] = 0.0
    weight_version: int = 0
    teacher_logprobs: list[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {n} tokens")
        if self.behaviour_logprobs and len(self.behaviour_logprobs) != n:
            raise ValueError(f"{len(self.behaviour_logprobs)} behaviour log-probs for {n} tokens")
        if isinstance(self.advantage, list) and len(self.advantage) != n:
            raise ValueError(f"{len(self.advantage)} per-token advantages for {n} tokens")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise ValueError(f"{len(self.teacher_logprobs)} teacher log-probs for {n} tokens")
        if not self.prompt_ids:
            raise ValueError("empty prompt (the first token needs a context)")

    @property
    def num_trained(self) -> int:
        return sum(self.loss_mask)


@dataclass(slots=True)
class MicroBatch:
    """Packed token tensors of one forward pass, every per-token tensor ``(R, L)``.

    Row ``r`` holds one or more whole sequences back to back (``prompt + token_ids`` each), right-padded;
    ``position_ids`` restart at 0 at each sequence, which is how the model keeps packed sequences apart.
    Position ``t`` predicts ``targets[r, t]`` (the next input token of the same sequence). ``loss_mask`` is 1
    exactly where that target is a trained token; ``seq_index`` is the batch-global index of the sequence
    a target belongs to (-1 where there is none), for per-sequence reductions. ``tensors`` holds the other
    per-token inputs of the loss, filled by the algorithm layer: ``advantages``, ``behaviour_logp``, and as
    needed ``prox_logp``, ``ref_logp``, ``teacher_logp``.

    ``attention_mask`` is set when samples share one copy of their prompt (``share_prompts`` in
    :func:`miles.training.packing.pack_micro_batches`): which positions each position may attend to, since
    position ids no longer say it. Only a backend with ``shares_prompts`` gets such micro-batches.
    """

    input_ids: Tensor  # (R, L) long
    position_ids: Tensor  # (R, L) long
    targets: Tensor  # (R, L) long
    loss_mask: Tensor  # (R, L) float
    seq_index: Tensor  # (R, L) long
    tensors: dict[str, Tensor] = field(default_factory=dict)  # each (R, L) float
    spans: list[SampleSpan] = field(default_factory=list)  # where each packed sample's completion sits
    attention_mask: Tensor | None = None  # (R, 1, L, L) bool, True: may attend; None: from position_ids

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def num_sequences(self) -> int:
        """Sequences with at least one trained token (the per-sequence normaliser's share)."""
        return sum(1 for span in self.spans if span.trained)

    def per_sample(self, values: Tensor) -> dict[int, list[float]]:
        """An ``(R, L)`` per-position tensor cut back to each sample's completion tokens (by sample index):
        ``values[r, t]`` belongs to the token the position predicts, so the list has one entry per token."""
        rows = values.detach().cpu()
        return {s.sample: rows[s.row, s.start : s.start + s.length].tolist() for s in self.spans}


@dataclass(frozen=True, slots=True)
class SampleSpan:
    """Sample ``sample`` (index into the list that was packed) predicts its ``length`` completion tokens
    from positions ``start .. start + length - 1`` of row ``row``; ``trained``: any of them has loss mask 1."""

    sample: int
    row: int
    start: int
    length: int
    trained: bool


@dataclass(slots=True)
class TokenOutputs:
    """What a forward pass gives the loss: ``logp`` of each target (with grad when training) and, when
    asked for, the entropy of each next-token distribution; both ``(R, L)`` float32, temperature applied."""

    logp: Tensor
    entropy: Tensor | None = None


# The algorithm's loss of one micro-batch: (differentiable scalar, additive metric sums).
LossFn = Callable[[TokenOutputs, MicroBatch], "tuple[Tensor, dict[str, Tensor]]"]


class TrainBackend(Protocol):
    """Parallel policy training. Every method is collective over all trainer ranks."""

    rank: int
    world_size: int
    dp_rank: int  # this rank's data-parallel index: ranks with the same dp_rank get the same data
    dp_size: int
    shares_prompts: bool  # takes micro-batches whose samples share a prompt copy (MicroBatch.attention_mask)

    def score(self, batches: list[MicroBatch], *, reference: bool = False, entropy: bool = False) -> list[TokenOutputs]:
        """No-grad per-token log-probs (and entropies) of each micro-batch, under the current policy or,
        with ``reference``, the reference policy (the initial weights; with LoRA, the base with adapters
        off). Computed in chunks: the ``(R, L, V)`` logits are never materialised in float32 at once."""
        ...

    def forward_backward(
        self, batches: list[MicroBatch], loss_fn: LossFn, *, entropy: bool = False
    ) -> dict[str, float]:
        """Accumulate gradients of ``sum(loss_fn(outputs, mb))`` over ``batches``; returns the summed metrics
        of this rank (the caller reduces them). ``loss_fn`` must return shares of the global loss (it
        normalises by global counts), so summing over ranks and micro-batches gives the batch loss."""
        ...

    def optimizer_step(self, lr: float, *, skip: bool = False) -> float:
        """Clip the gradient to ``trainer.grad_clip``, step (skipped on a non-finite norm), zero the
        gradients; returns the global grad norm before clipping. With ``skip`` (decided alike on every rank)
        the gradients are only zeroed: no step, no momentum, no weight decay; returns 0.0."""
        ...

    def all_reduce(self, values: list[float], op: Literal["sum", "max"] = "sum") -> list[float]:
        """Sums (or maxima) over the data-parallel ranks: counts for global normalisers, metrics, and the
        number of micro-batches every rank must run."""
        ...

    def policy_tensors(self) -> list[torch.Tensor]:
        """This rank's local storage of the trainable policy weights (its shards; with LoRA the adapters),
        in a fixed order, on their device: what a version snapshot copies and puts back
        (:mod:`miles.training.snapshots`). Local: no collective."""
        ...

    def export_params(self, *, adapter_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's full tensors under Hugging Face names, one at a time in byte-wise sorted name order,
        float32 on CPU, each gathered only when it is yielded (no rank ever holds the whole model). Every rank
        must iterate to the end (the gathers are collective); ranks other than rank 0 get empty tensors.
        ``adapter_only``: only the LoRA adapter, under peft's saved names."""
        ...

    def export_specs(self, *, adapter_only: bool = False) -> list[Any]:
        """Name, dtype and full shape (:class:`miles.sync.stream_export.TensorSpec`) of every tensor
        :meth:`export_params` yields, in its order. Local: no collective."""
        ...

    def save_checkpoint(self, path: str, *, asynchronous: bool = False) -> Any:
        """Write this rank's shard of model and optimizer state (LoRA: adapters and their optimizer state
        only) under directory ``path`` (torch.distributed.checkpoint or megatron's dist_checkpointing).
        Asynchronous: returns a handle with ``done()`` and ``result()`` once the state is staged; else None
        once written (:class:`miles.training.checkpoint.CheckpointManager` owns the rest)."""
        ...

    def load_checkpoint(self, path: str) -> None:
        """Restore from ``path``, also when it was written by another number of ranks where supported."""
        ...
