"""Data-parallel policy training with torch FSDP2 (``fully_shard``): gloo on CPU, NCCL on CUDA.

:class:`FsdpBackend` implements :class:`miles.backends.base.TrainBackend`: it computes per-token log-probs
of packed micro-batches and applies the gradients of the loss function the algorithm layer gives it; it
knows nothing of the RL objective. Every public method is collective when a process group is joined.

Sharding: each decoder layer is ``fully_shard``-ed, then the root, over a one-dimensional data-parallel
mesh. Parameters, gradients and optimizer state live sharded in float32 (the master weights); forward and
backward compute in ``param_dtype`` with float32 gradient reduction (``MixedPrecisionPolicy``). Without a
process group (a plain single process, as in unit tests) the model is left unsharded in float32.

Log-probs never materialise the ``(tokens, vocab)`` float32 logits of a whole micro-batch: the decoder's
final hidden states go through the unembedding a chunk of positions at a time
(:func:`miles.algo.logprobs.chunked_logprobs`), and in backward each chunk is recomputed.

Shared prompts (``trainer.backend.share_prompts``): for an architecture whose every layer attends causally
over the whole sequence (:func:`shared_prompt_support`), the samples of one prompt are packed behind one copy
of it and the decoder gets the packer's attention mask (:mod:`miles.training.packing`): the same log-probs
and gradients, the prompt computed once per group instead of once per sample.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import structlog
import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import PreTrainedModel

from miles.algo.logprobs import chunked_logprobs
from miles.backends.base import LossFn, MicroBatch, TokenOutputs
from miles.config import FsdpBackendConfig, TrainerConfig
from miles.sync.lora import add_adapters, lora_scale

log = structlog.get_logger(__name__)


class TokenScorer(nn.Module):
    """A causal LM whose forward returns per-token log-probs (and entropies) of given targets.

    Wrapping the model in one module makes its forward the FSDP root's forward, so the root's parameters
    (embeddings, final norm, ``lm_head``) are gathered by FSDP's own hooks while we call the decoder and the
    head separately (chunked log-probs need the hidden states, not the logits).
    """

    def __init__(self, lm: nn.Module, *, temperature: float, chunk_tokens: int) -> None:
        super().__init__()
        self.lm = lm
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.softcap = getattr(lm.config, "final_logit_softcapping", None)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        targets: Tensor,
        with_entropy: bool,
        attention_mask: Tensor | None = None,
    ) -> TokenOutputs:
        # attention_mask=None + position ids that restart per sequence: transformers keeps packed sequences apart.
        # A shared-prompt mask (R, 1, L, L) is passed as is (transformers uses a 4D mask unchanged).
        decoder = self.lm.get_decoder()
        mask = None if attention_mask is None else self._attention_mask(attention_mask)
        hidden = decoder(
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False
        ).last_hidden_state  # (R, L, H)
        rows, length = input_ids.shape
        logp, entropy = chunked_logprobs(
            hidden.reshape(rows * length, -1),
            self.lm.get_output_embeddings(),
            targets.reshape(-1),
            temperature=self.temperature,
            chunk_tokens=self.chunk_tokens,
            softcap=self.softcap,
            with_entropy=with_entropy,
        )
        return TokenOutputs(logp.view(rows, length), None if entropy is None else entropy.view(rows, length))

    def _attention_mask(self, allowed: Tensor) -> Tensor:
        """The packer's boolean mask in the form the attention implementation takes: SDPA a boolean one,
        eager attention an additive float one (0 where allowed, the dtype's minimum elsewhere)."""
        if self.lm.config._attn_implementation == "sdpa":
            return allowed
        dtype = next(self.lm.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )


# Causal LMs whose every layer attends over the whole sequence when no sliding window is configured: a 4D mask
# given to them is applied unchanged in every layer (transformers' masking utilities return it as is).
_FULL_ATTENTION_MODELS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def shared_prompt_support(model: nn.Module) -> str | None:
    """None if ``model`` computes exactly the same log-probs with shared prompts and the packer's attention mask,
    else why not (then every sample is packed whole): a known full-attention architecture, without sliding
    window layers, under SDPA or eager attention."""
    name = type(model).__name__
    if name not in _FULL_ATTENTION_MODELS:
        return f"{name} is not one of {', '.join(_FULL_ATTENTION_MODELS)}"
    config = model.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return f"{name} has {sorted(set(layer_types) - {'full_attention'})} layers"
    if layer_types is None and getattr(config, "sliding_window", None) is not None:
        return f"{name} has a sliding window"
    if config._attn_implementation not in ("sdpa", "eager"):
        return f"attention implementation {config._attn_implementation!r} (sdpa or eager apply the mask)"
    return None


class FsdpBackend:
    """:class:`~miles.backends.base.TrainBackend` over FSDP2.

    Args:
        model: a causal LM with the initial weights, on CPU, float32; the backend takes ownership.
        trainer_cfg: optimizer and clipping settings; ``trainer_cfg.backend`` is an :class:`FsdpBackendConfig`.
        rank, world_size: this process's place in the joined process group (1 rank: none needed).
        temperature: sampling temperature of the rollouts: log-probs are those of ``logits / temperature``,
            the distribution the engine sampled from. Pass 1.0 for greedy rollouts.

    The model runs in eval mode throughout: dropout would make the no-grad proximal log-probs differ from
    the training forward, and RL fine-tuning does not want it anyway.
    """

    def __init__(
        self,
        model: PreTrainedModel,
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
        self.rank = rank
        self.world_size = world_size
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
        elif self.backend_cfg.param_dtype != "float32":
            raise ValueError("trainer.backend.param_dtype bfloat16 needs FSDP (a process group, even of one rank)")
        self.dp_rank, self.dp_size = rank, world_size

        chunk = self.backend_cfg.logprob_chunk_tokens
        # The KL reference is the initial policy, copied before any update (and before sharding). With LoRA it
        # is the frozen base itself, read with the adapters switched off: no second copy of the model.
        self.ref_model: TokenScorer | None = None
        if trainer_cfg.algo.kl_coef > 0 and trainer_cfg.lora is None:
            self.ref_model = TokenScorer(
                copy.deepcopy(model).requires_grad_(False), temperature=temperature, chunk_tokens=chunk
            )
            self._place(self.ref_model)
        self.lora_scale: float | None = None
        # Decided on the bare architecture (a LoRA adapter changes no attention): see shared_prompt_support.
        unsupported = shared_prompt_support(model) if self.backend_cfg.share_prompts else "off in the config"
        self.shares_prompts = unsupported is None
        if self.backend_cfg.share_prompts and unsupported is not None:
            log.info("fsdp.prompts_not_shared", reason=unsupported)
        if trainer_cfg.lora is not None:  # LoRA RL: only the adapters train, the base stays frozen in memory
            model = add_adapters(model, trainer_cfg.lora)
            self.lora_scale = lora_scale(trainer_cfg.lora)
        if self.backend_cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = TokenScorer(model, temperature=temperature, chunk_tokens=chunk)
        self._place(self.model)

        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=trainer_cfg.lr,
            betas=trainer_cfg.betas,
            weight_decay=trainer_cfg.weight_decay,
        )
        # FSDP averages gradients over ranks; the loss is already a share of the global mean, so scaling it by
        # world_size makes the averaged gradient the gradient of the global loss.
        self._grad_scale = float(world_size) if self.sharded else 1.0
        log.info(
            "fsdp.ready",
            rank=rank,
            world_size=world_size,
            sharded=self.sharded,
            device=str(self.device),
            param_dtype=self.backend_cfg.param_dtype,
            params=sum(p.numel() for p in self.model.parameters()),
            trainable=sum(p.numel() for p in self.model.parameters() if p.requires_grad),
            reference=self.ref_model is not None,
            shares_prompts=self.shares_prompts,
        )

    # ------------------------------------------------------------------ setup

    def _place(self, module: nn.Module) -> None:
        """Move to the device, switch dropout off, and shard (layers first, then the root)."""
        module.to(self.device)
        module.eval()
        if not self.sharded:
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        policy = MixedPrecisionPolicy(
            param_dtype=getattr(torch, self.backend_cfg.param_dtype), reduce_dtype=torch.float32
        )
        for layer in _decoder_layers(module):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(module, mesh=mesh, mp_policy=policy)

    # ------------------------------------------------------------------ TrainBackend

    def _forward(self, module: TokenScorer, mb: MicroBatch, entropy: bool) -> TokenOutputs:
        return module(mb.input_ids, mb.position_ids, mb.targets, entropy, mb.attention_mask)

    def _reference(self) -> tuple[TokenScorer, AbstractContextManager[Any]]:
        if self.ref_model is not None:
            return self.ref_model, nullcontext()
        if self.lora_scale is not None:  # the frozen base, adapters off
            return self.model, self.model.lm.disable_adapter()  # type: ignore[operator]  # a peft model
        raise ValueError("no reference policy: it exists with trainer.algo.kl_coef > 0 or with LoRA")

    @torch.no_grad()
    def score(self, batches: list[MicroBatch], *, reference: bool = False, entropy: bool = False) -> list[TokenOutputs]:
        """No-grad per-token log-probs (and entropies) of each micro-batch. Collective."""
        module, context = self._reference() if reference else (self.model, nullcontext())
        with context:
            return [self._forward(module, mb, entropy) for mb in batches]

    def forward_backward(
        self, batches: list[MicroBatch], loss_fn: LossFn, *, entropy: bool = False
    ) -> dict[str, float]:
        """Accumulate gradients of the loss over ``batches``; this rank's metric sums. Collective."""
        sums: dict[str, Tensor] = {}
        for mb in batches:
            loss, metrics = loss_fn(self._forward(self.model, mb, entropy), mb)
            (loss * self._grad_scale).backward()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value.detach().double()  # type: ignore[assignment]
        return {key: float(value) for key, value in sums.items()}

    def optimizer_step(self, lr: float, *, skip: bool = False) -> float:
        """Clip, step (skipped on a non-finite norm, on every rank alike), zero the gradients. Collective
        unless ``skip``, which only zeroes the gradients."""
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
            return 0.0
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = float(_as_local(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)).item())
        if math.isfinite(norm):  # the norm is global, so every rank decides alike
            self.optimizer.step()
        else:
            log.warning("fsdp.step_skipped", rank=self.rank, grad_norm=norm)
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def all_reduce(self, values: list[float], op: Literal["sum", "max"] = "sum") -> list[float]:
        """Sum or max over the ranks, in float64. Collective."""
        if not values:
            return []
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.sharded:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor.tolist()

    def export_params(self, *, adapter_only: bool = False) -> Iterator[tuple[str, Tensor]]:
        """The policy's tensors under HF names, float32 on CPU, gathered one parameter at a time, in sorted
        name order (:func:`miles.backends.fsdp_export.iter_full_params`). Collective: every rank iterates
        to the end; only rank 0 receives them (the others get empty tensors).

        With LoRA: ``adapter_only`` gives the adapter under peft's saved names (only the trainable parameters
        are gathered, never the frozen base); otherwise each adapted module's weight comes merged,
        ``W0 + scale * B @ A``, so the stream is a plain HF state dict.
        """
        from miles.backends.fsdp_export import iter_full_params

        if adapter_only and self.lora_scale is None:
            raise ValueError("adapter_only export needs trainer.lora")
        scale = None if adapter_only else self.lora_scale
        return iter_full_params(self.model.lm, adapter_only=adapter_only, lora_scale=scale, dst=0)

    def policy_tensors(self) -> list[Tensor]:
        """This rank's shard of each trainable parameter (a sharded parameter's local tensor shares its
        storage)."""
        params = (p for p in self.model.parameters() if p.requires_grad)
        return [p.to_local() if hasattr(p, "to_local") else p.data for p in params]

    def export_specs(self, *, adapter_only: bool = False) -> list[Any]:
        """Names, dtypes and shapes of what :meth:`export_params` yields, without any collective (the streamed
        payload's header is computed from them)."""
        from miles.backends.fsdp_export import export_specs

        scale = None if adapter_only else self.lora_scale
        return export_specs(self.model.lm, adapter_only=adapter_only, lora_scale=scale)

    def save_checkpoint(self, path: str, *, asynchronous: bool = False) -> Any:
        """This rank's shard of model, optimizer and KL reference under ``path`` (DCP; LoRA: adapters and their
        optimizer state only). Collective. Asynchronous: a handle whose ``result()`` waits for the write."""
        from miles.backends.fsdp_checkpoint import save_sharded

        return save_sharded(
            self.model,
            self.optimizer,
            path,
            adapter_only=self.lora_scale is not None,
            asynchronous=asynchronous,
            reference=self.ref_model,
        )

    def load_checkpoint(self, path: str) -> None:
        """Restore from ``path``, whatever rank count wrote it. Collective."""
        from miles.backends.fsdp_checkpoint import load_sharded

        load_sharded(
            self.model, self.optimizer, path, adapter_only=self.lora_scale is not None, reference=self.ref_model
        )


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks to shard one by one.

    HF models name their block class in ``_no_split_modules`` (e.g. ``LlamaDecoderLayer``); failing
    that, the longest ``nn.ModuleList`` is taken to be the stack of blocks.
    """
    names: set[str] = set()
    for module in model.modules():
        names |= set(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _as_local(value: Tensor) -> Tensor:
    """A DTensor (a sharded parameter, FSDP's global grad norm) as a full plain tensor (a collective)."""
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value
