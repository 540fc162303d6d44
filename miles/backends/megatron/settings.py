"""The Megatron backend's own settings, read from ``trainer.backend`` (a ``MegatronBackendConfig``).

``MegatronBackendConfig`` in :mod:`miles.config` owns the user-facing fields; this module reads them into
one frozen value with defaults, so that the rest of the backend never touches pydantic and a field that
the config does not have yet falls back to the default documented here (docs/megatron.md lists the
fields to add). Pure Python: importable without torch or megatron-core.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

Packing = Literal["auto", "thd", "mask"]


@dataclass(frozen=True, slots=True)
class MegatronSettings:
    """Parallel layout, precision and MoE knobs of one Megatron run.

    ``world_size`` must be a multiple of ``tp * pp * cp``; the data-parallel size is the quotient, and
    ``ep`` must divide ``dp * cp`` (megatron-core folds expert parallelism into the data-parallel ranks).
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline_parallel: int | None = None
    context_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1
    sequence_parallel: bool = True  # only meaningful with tensor_parallel > 1
    bf16: bool = True  # bf16 model weights and compute, float32 master weights in the optimizer
    use_distributed_optimizer: bool = True
    transformer_engine: Literal["auto", "on", "off"] = "auto"
    packing: Packing = "auto"
    logprob_chunk_tokens: int = 4096
    recompute: Literal["none", "selective", "full"] = "none"
    moe_aux_loss_coef: float = 0.0
    moe_capacity_factor: float | None = None
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    moe_expert_bias_update_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.expert_tensor_parallel != 1:
            raise ValueError("expert_tensor_parallel > 1 is not supported yet (experts are not TP-sharded)")
        if self.virtual_pipeline_parallel is not None and self.pipeline_parallel < 2:
            raise ValueError("virtual_pipeline_parallel needs pipeline_parallel >= 2")
        if self.logprob_chunk_tokens < 1:
            raise ValueError("logprob_chunk_tokens must be >= 1")
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ValueError("moe_capacity_factor must be > 0 (None: no token dropping)")

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one replica of the model: tp * pp * cp."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def uses_sequence_parallel(self) -> bool:
        return self.sequence_parallel and self.tensor_parallel > 1

    def data_parallel_size(self, world_size: int) -> int:
        """``world_size / (tp * pp * cp)``; raises if the layout does not tile the world."""
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"world size {world_size} is not a multiple of tp*pp*cp = {self.tensor_parallel}*"
                f"{self.pipeline_parallel}*{self.context_parallel}"
            )
        dp = world_size // self.model_parallel_size
        if (dp * self.context_parallel) % self.expert_parallel:
            raise ValueError(f"expert_parallel {self.expert_parallel} must divide dp*cp = {dp * self.context_parallel}")
        return dp

    @classmethod
    def from_backend_config(cls, backend_cfg: Any, *, seed: int = 0) -> MegatronSettings:
        """Read every field this class has from ``backend_cfg`` (missing ones keep their defaults)."""
        values = {f.name: getattr(backend_cfg, f.name) for f in fields(cls) if hasattr(backend_cfg, f.name)}
        values.setdefault("seed", seed)
        return cls(**values)
