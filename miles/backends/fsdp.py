"""Data-parallel policy training with torch FSDP2 (``fully_shard``): gloo on CPU, NCCL on CUDA.

Every public method is collective when a process group is joined: all ranks call it, in the same
order, each with its own shard of the batch. One ``train_step`` is one optimizer step, so it is one
policy version.

Sharding: each decoder layer is ``fully_shard``-ed, then the root module. FSDP2 needs a device mesh,
hence a process group; when none is joined (a plain single-process run, ``world_size == 1``) the
model is left unsharded and the same code paths run without collectives. A one-rank process group
shards over a one-device mesh, which also works.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import PreTrainedModel

from miles.algo.logprobs import token_entropy, token_logprobs
from miles.algo.losses import policy_loss
from miles.algo.offpolicy import SUM_KEYS, importance_weights, ratio_base, ratio_cap, summarize
from miles.backends.base import StepResult, TrainSample
from miles.backends.checkpoint_io import atomic_torch_save, load_torch
from miles.backends.lr_schedule import lr_at
from miles.backends.packing import PackedBatch, micro_batches, num_micro_batches, pack
from miles.config import FsdpBackendConfig, TrainerConfig
from miles.sync.lora import add_adapters, lora_scale, merged_state, split_peft_state

log = structlog.get_logger(__name__)

CHECKPOINT_FORMAT = 1
# Loss metrics that policy_loss returns as additive per-rank shares (summed across ranks).
_SHARE_METRICS = ("loss", "pg_loss", "clip_frac", "ppo_kl", "kl_ref", "entropy")


class FsdpBackend:
    """:class:`miles.backends.base.TrainBackend` over FSDP2.

    Args:
        model: a causal LM (``PreTrainedModel``) with the initial weights, on CPU; the backend takes
            ownership (moves and shards it in place).
        pad_token_id: id used to right-pad batches (never trained on).
        trainer_cfg: optimizer, clipping and algorithm settings; ``trainer_cfg.backend`` must be an
            :class:`FsdpBackendConfig`.
        rank, world_size: this process's place in the joined process group (1 rank: none needed).
        temperature: sampling temperature of the rollouts. Log-probs are computed from
            ``logits / temperature`` so that the proximal policy matches the distribution the engine
            sampled from (the behaviour log-probs are reported that way). Pass 1.0 for greedy rollouts.

    ``trainer_cfg.backend.threads`` is not applied here (a constructor should not change
    process-wide state); the process that hosts the rank calls ``torch.set_num_threads``.

    The model runs in eval mode throughout: dropout would make the no-grad proximal log-probs differ
    from the training forward, and RL fine-tuning does not want it anyway.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        trainer_cfg: TrainerConfig,
        rank: int = 0,
        world_size: int = 1,
        *,
        temperature: float = 1.0,
    ) -> None:
        if not isinstance(trainer_cfg.backend, FsdpBackendConfig):
            raise TypeError(f"FsdpBackend needs an FsdpBackendConfig, got {type(trainer_cfg.backend).__name__}")
        if temperature <= 0:
            raise ValueError("temperature must be > 0 (use 1.0 for greedy rollouts)")
        self.cfg = trainer_cfg
        self.backend_cfg: FsdpBackendConfig = trainer_cfg.backend
        self.algo = trainer_cfg.algo
        self.pad_token_id = pad_token_id
        self.rank = rank
        self.world_size = world_size
        self.temperature = temperature
        self.device = torch.device(self.backend_cfg.device)

        self.sharded = dist.is_available() and dist.is_initialized()
        if self.sharded:
            if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
                raise ValueError(
                    f"rank/world_size ({rank}/{world_size}) disagree with the process group "
                    f"({dist.get_rank()}/{dist.get_world_size()})"
                )
        elif world_size != 1:
            raise RuntimeError(f"world_size {world_size} needs torch.distributed initialised first")

        # The reference is the initial policy, copied before any update (and before sharding). With LoRA it
        # is the frozen base itself, read with the adapters switched off: no second copy of the model.
        self.ref_model: nn.Module | None = None
        if self.algo.kl_coef > 0 and trainer_cfg.lora is None:
            self.ref_model = copy.deepcopy(model).requires_grad_(False)
            self._place(self.ref_model)
        self.lora_scale: float | None = None
        if trainer_cfg.lora is not None:  # LoRA RL: only the adapters train, the base stays frozen in memory
            model = add_adapters(model, trainer_cfg.lora)
            self.lora_scale = lora_scale(trainer_cfg.lora)
        self.model: nn.Module = model
        self._place(self.model)

        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=trainer_cfg.lr,
            betas=trainer_cfg.betas,
            weight_decay=trainer_cfg.weight_decay,
        )
        self.steps_done = 0  # optimizer steps taken (checkpointed): the learning-rate schedule's clock
        # FSDP averages gradients over ranks; the loss is already a share of the global mean, so
        # scaling it by world_size makes the averaged gradient the gradient of the global loss.
        self._grad_scale = float(world_size) if self.sharded else 1.0
        log.info(
            "fsdp.ready",
            rank=rank,
            world_size=world_size,
            sharded=self.sharded,
            device=str(self.device),
            params=sum(p.numel() for p in self.model.parameters()),
            trainable=sum(p.numel() for p in self.model.parameters() if p.requires_grad),
            reference=self.ref_model is not None,
        )

    # ------------------------------------------------------------------ setup

    def _place(self, module: nn.Module) -> None:
        """Move to the device, switch dropout off, and shard (layers first, then the root)."""
        module.to(self.device)
        module.eval()
        if not self.sharded:
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        for layer in _decoder_layers(module):
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)

    # ------------------------------------------------------------------ collectives helpers

    def _all_reduce(self, values: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        if self.sharded:
            dist.all_reduce(values, op=op)
        return values

    def _chunks(self, samples: Sequence[TrainSample]) -> list[list[TrainSample]]:
        """Micro-batches of this rank's samples, padded so that every rank runs the same number."""
        size = self.backend_cfg.micro_batch_size
        count = torch.tensor([num_micro_batches(len(samples), size)], dtype=torch.long, device=self.device)
        count = self._all_reduce(count, dist.ReduceOp.MAX)
        return micro_batches(samples, size, int(count.item()))

    # ------------------------------------------------------------------ forward

    def _logits(self, module: nn.Module, batch: PackedBatch) -> Tensor:
        out = module(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        return out.logits[:, :-1]  # (B, T-1, V): position t predicts targets[:, t]

    @torch.no_grad()
    def _logprobs_no_grad(self, module: nn.Module, batch: PackedBatch) -> Tensor:
        return token_logprobs(self._logits(module, batch), batch.targets, self.temperature)  # (B, T-1)

    # ------------------------------------------------------------------ TrainBackend

    def logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Current-policy log-probs of each sample's output tokens (no grad). Collective.

        ``behaviour_logprobs`` and ``advantage`` of the samples are ignored (may be empty / 0).
        """
        out: list[list[float]] = []
        for chunk in self._chunks(samples):
            batch = pack(chunk, self.pad_token_id, self.device, require_behaviour=False)
            values = self._logprobs_no_grad(self.model, batch).cpu()  # (B, T-1)
            if chunk:
                out.extend(batch.per_sample(values))
        return out

    def train_step(self, samples: Sequence[TrainSample]) -> StepResult:
        """One optimizer step over this rank's shard. Collective; every rank gets the same metrics.

        The proximal ("old") log-probs are the current weights before the update, from a no-grad
        forward. ``algo.off_policy`` decides how the behaviour log-probs of the engine correct the
        objective (``miles.algo.offpolicy``: importance weights, or the ratio taken against the
        behaviour policy for ``"tis"``); in every mode they are compared against the proximal ones
        (``logp_mismatch``, ``behaviour_kl``, ``is_ess``, ``is_weight_mean``, ``is_clipped_frac``).
        ``ppo_kl`` is the mean of ``log pi_base - log pi_theta`` over the first forward, where
        ``pi_base`` is the policy the ratio is taken against: 0 for the proximal modes (one
        optimizer step per call), and the behaviour-vs-current log-ratio for ``"tis"``. Token and
        sequence means, and these statistics, are normalised by the global counts, so the update
        and the metrics equal a single-rank step on the concatenated batch.
        """
        batches = [pack(chunk, self.pad_token_id, self.device) for chunk in self._chunks(samples)]
        counts = torch.tensor(
            [sum(b.num_tokens for b in batches), sum(b.num_sequences for b in batches)],
            dtype=torch.float32,
            device=self.device,
        )
        num_tokens, num_sequences = self._all_reduce(counts).tolist()

        old_logps = [self._logprobs_no_grad(self.model, b) for b in batches]  # each (B, T-1)
        ref_logps: list[Tensor | None] = [None] * len(batches)
        if self.ref_model is not None:
            ref_logps = [self._logprobs_no_grad(self.ref_model, b) for b in batches]
        elif self.algo.kl_coef > 0:  # LoRA: the base is the reference
            with self.model.disable_adapter():  # type: ignore[operator]  # a peft model
                ref_logps = [self._logprobs_no_grad(self.model, b) for b in batches]

        self.optimizer.zero_grad(set_to_none=True)
        lr = lr_at(self.cfg, self.steps_done)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        mode, cap = self.algo.off_policy, ratio_cap(self.algo.off_policy, self.algo)
        # policy_loss shares, then off-policy sums; float64 so that the sums stay exact at scale.
        shares = torch.zeros(len(_SHARE_METRICS) + len(SUM_KEYS), dtype=torch.float64, device=self.device)
        for batch, old_logp, ref_logp in zip(batches, old_logps, ref_logps, strict=True):
            logits = self._logits(self.model, batch)  # (B, T-1, V)
            logp = token_logprobs(logits, batch.targets, self.temperature)  # (B, T-1)
            if self.algo.entropy_coef != 0:
                entropy = token_entropy(logits, self.temperature)  # (B, T-1), with grad
            else:
                with torch.no_grad():
                    entropy = token_entropy(logits.detach(), self.temperature)  # metric only
            token_weights, sums = importance_weights(
                mode, old_logp, batch.behaviour_logp, batch.loss_mask, self.algo
            )  # (B, T-1) or None
            out = policy_loss(
                logp,
                ratio_base(mode, old_logp, batch.behaviour_logp),
                batch.advantages,
                batch.loss_mask,
                clip_low=self.algo.clip_low,
                clip_high=self.algo.clip_high,
                aggregation=self.algo.aggregation,
                ref_logp=ref_logp,
                kl_coef=self.algo.kl_coef,
                entropy=entropy,
                entropy_coef=self.algo.entropy_coef,
                num_tokens=num_tokens,
                num_sequences=num_sequences,
                token_weights=token_weights,
                ratio_cap=cap,
            )
            (out.loss * self._grad_scale).backward()
            shares += torch.stack([out.metrics[k].double() for k in _SHARE_METRICS] + [sums[k] for k in SUM_KEYS])

        grad_norm = _as_local(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        grad_norm_value = float(grad_norm.item())
        skipped = not math.isfinite(grad_norm_value)
        if skipped:  # the norm is global, so every rank skips together
            log.warning("fsdp.step_skipped", rank=self.rank, grad_norm=grad_norm_value)
        else:
            self.optimizer.step()
        self.steps_done += 1  # a skipped step still advances the schedule (it is one policy version)
        self.optimizer.zero_grad(set_to_none=True)

        totals = self._all_reduce(shares).tolist()  # shares sum to the global values
        metrics = dict(zip(_SHARE_METRICS, totals[: len(_SHARE_METRICS)], strict=True))
        metrics.update(summarize(dict(zip(SUM_KEYS, totals[len(_SHARE_METRICS) :], strict=True))))
        metrics.update(
            grad_norm=grad_norm_value,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            skipped=float(skipped),
            lr=lr,
        )
        return StepResult(metrics=metrics)

    def export_weights(self, dtype: torch.dtype) -> dict[str, Tensor]:
        """Full weights with HF names, on CPU, cast to ``dtype``; rank 0 only (``{}`` elsewhere). Collective.

        The tensors are copies: later training steps never change an exported payload. With LoRA the
        adapters are merged in (the policy as a plain HF model, e.g. for evaluation or full sync).
        """
        state = self._full_state(self.model)
        if self.rank != 0:
            return {}
        if self.lora_scale is not None:
            state = merged_state(state, self.lora_scale)
        return {name: t.detach().to(device="cpu", dtype=dtype, copy=True) for name, t in state.items()}

    def export_adapter(self, dtype: torch.dtype) -> dict[str, Tensor]:
        """The LoRA adapter tensors under peft's saved names, on CPU, cast to ``dtype``; rank 0 only. Collective."""
        if self.lora_scale is None:
            raise ValueError("export_adapter needs trainer.lora")
        # Only the trainable (adapter) parameters are gathered, never the frozen base: every step publishes
        # this, and the base can be orders of magnitude larger. Same order on every rank (a collective each).
        with torch.no_grad():
            trainable = {n: _as_local(p.detach()) for n, p in self.model.named_parameters() if p.requires_grad}
        if self.rank != 0:
            return {}
        adapter, _ = split_peft_state(trainable)
        return {name: t.to(device="cpu", dtype=dtype, copy=True) for name, t in adapter.items()}

    def save_checkpoint(self, path: str, extra: dict[str, Any]) -> None:
        """Write model, optimizer, reference and ``extra`` durably to the single file ``path``. Collective.

        Rank 0 writes full (unsharded) state dicts keyed by parameter names. Chosen over sharded
        DCP checkpoints because the file is then independent of the rank count (resume on a
        different ``world_size``), is one atomic rename, and is loadable by plain ``torch.load``;
        at the sizes the FSDP backend targets, gathering to rank 0 is cheap. ``extra`` must be plain
        data (dicts, lists, str, int, float, bool, None, tensors): checkpoints load with
        ``weights_only=True``.
        """
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = self._full_state(self.model)
        optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        ref_state = self._full_state(self.ref_model) if self.ref_model is not None else None
        error: str | None = None
        if self.rank == 0:
            payload = {
                "format": CHECKPOINT_FORMAT,
                "model": model_state,
                "optimizer": optim_state,
                "reference": ref_state,
                "extra": extra,
                "world_size": self.world_size,
                "steps_done": self.steps_done,
            }
            try:
                atomic_torch_save(payload, path)
                log.info("fsdp.checkpoint_saved", path=str(Path(path)))
            except Exception as exc:  # re-raised on every rank below, so no rank waits for a dead peer
                error = f"{type(exc).__name__}: {exc}"
        # No rank returns (and e.g. acks trajectories) before the file is durable; a failure is raised everywhere.
        error = self._from_rank0(error)
        if error is not None:
            raise RuntimeError(f"saving checkpoint {path} failed on rank 0: {error}")

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore model, optimizer and reference from ``path``; return ``extra`` on every rank. Collective.

        Only rank 0 reads the file; the states are broadcast to the other ranks' shards.
        """
        payload: dict[str, Any] = {}
        error: str | None = None
        if self.rank == 0:
            try:
                payload = load_torch(path)
                if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
                    raise ValueError("not a Miles FSDP checkpoint (unknown format)")
                if (payload.get("reference") is not None) != (self.ref_model is not None):
                    raise ValueError(
                        f"reference model present={payload.get('reference') is not None}, "
                        f"but kl_coef={self.algo.kl_coef}"
                    )
            except Exception as exc:  # raised on every rank, so no rank waits in a broadcast
                error = f"{type(exc).__name__}: {exc}"
        error = self._from_rank0(error)
        if error is not None:
            raise ValueError(f"cannot load checkpoint {path}: {error}")

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.sharded)
        set_model_state_dict(self.model, payload.get("model", {}), options=options)
        set_optimizer_state_dict(self.model, self.optimizer, payload.get("optimizer", {}), options=options)
        if self.ref_model is not None:
            set_model_state_dict(self.ref_model, payload.get("reference") or {}, options=options)

        extra, self.steps_done = self._from_rank0((payload.get("extra", {}), int(payload.get("steps_done", 0))))
        log.info("fsdp.checkpoint_loaded", path=str(Path(path)), rank=self.rank)
        return dict(extra)

    def _from_rank0(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a broadcast, hence also a barrier). Collective."""
        if not self.sharded:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ------------------------------------------------------------------ state

    def _full_state(self, module: nn.Module) -> dict[str, Tensor]:
        """Unsharded state dict on CPU (rank 0 only when sharded; ``{}`` on the others). Collective."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(module, options=options)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks to shard one by one.

    HF models name their block class in ``_no_split_modules`` (e.g. ``LlamaDecoderLayer``); failing
    that, the longest ``nn.ModuleList`` is taken to be the stack of blocks.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _as_local(value: Tensor) -> Tensor:
    """A DTensor (a sharded parameter, FSDP's global grad norm) as a full plain tensor (a collective)."""
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value
