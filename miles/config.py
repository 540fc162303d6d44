"""The one typed config tree of a Miles run: YAML recipe + dotted ``--set`` overrides.

Torch-free on purpose, so that ``miles --help`` and config errors are instant. Every model
forbids unknown keys; variants are discriminated unions on ``type``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, Tag, ValidationError, field_validator, model_validator

from miles.algo.config import AlgoConfig  # the RL objective's sections live next to their code
from miles.bus.urls import split_urls
from miles.config_base import IMPORT_TAG, REGISTERED_NAME, REWARD_RANGE_DOC, RewardRange, Strict, TaskBase, variant
from miles.models.families.config import FamilyModelConfig
from miles.sandbox.config import SandboxConfig
from miles.security.config import BusSecurityFields
from miles.tasks.scratchpad import ScratchpadTaskConfig
from miles.tasks.terminal.config import TerminalTaskConfig

_variant = variant


# --------------------------------------------------------------------------- model


class TinyModelConfig(Strict):
    """A tiny Llama-style model and character tokenizer built offline, then warmed up with SFT."""

    type: Literal["tiny"] = "tiny"
    hidden_size: int = Field(64, gt=0, description="Width of the residual stream.")
    num_layers: int = Field(2, gt=0, description="Transformer blocks.")
    num_heads: int = Field(4, gt=0, description="Attention heads.")
    warmup_steps: int = Field(
        400, ge=0, description="Supervised warm-up steps on the task's train split (a cap when a target is set)."
    )
    warmup_lr: float = Field(3e-3, gt=0, description="Learning rate of the warm-up.")
    warmup_batch_size: int = Field(64, gt=0, description="Batch size of the warm-up.")
    warmup_target_accuracy: float | None = Field(
        0.25,
        ge=0,
        le=1,
        description="Stop the warm-up once greedy held-out accuracy reaches this (checked every "
        "warmup_check_every steps); None: run all warmup_steps.",
    )
    warmup_check_every: int = Field(
        10, ge=1, description="Steps between accuracy checks of the warm-up (each plays the eval split's episodes)."
    )
    seed: int = Field(0, description="Seed of the random init and of the warm-up batch order.")
    cache_dir: str | None = Field(
        None, description="Where built models are cached (default: ~/.cache/miles/models); keyed by config hash."
    )


class PretrainedModelConfig(Strict):
    """A real checkpoint on disk: a Hugging Face directory, or a GGUF file converted once into the model cache
    (docs/models.md); no hub access is attempted."""

    type: Literal["pretrained"] = "pretrained"
    path: str = Field(
        description="Directory with config.json, weights and tokenizer files, or a .gguf file (dequantized once "
        "by `miles prepare`); 'package:NAME/FILE' names a file inside an installed Python package."
    )
    cache_dir: str | None = Field(
        None, description="Where a GGUF file's conversion is cached (default: ~/.cache/miles/models)."
    )


ModelConfig = Annotated[
    Annotated[TinyModelConfig, Tag("tiny")]
    | Annotated[PretrainedModelConfig, Tag("pretrained")]
    | Annotated[FamilyModelConfig, Tag("family")],
    _variant("tiny"),
]


# --------------------------------------------------------------------------- task


class ArithmeticTaskConfig(TaskBase):
    """Built-in verifiable task: integer arithmetic with an exact-answer reward."""

    type: Literal["arithmetic"] = "arithmetic"
    operations: list[Literal["+", "-", "*"]] = Field(["+"], description="Operators to draw from.")
    max_operand: int = Field(30, gt=0, description="Operands are drawn from [0, max_operand].")
    train_size: int = Field(4000, gt=0, description="Number of training prompts.")
    eval_size: int = Field(200, gt=0, description="Number of held-out prompts (disjoint from train).")
    seed: int = Field(0, description="Seed of the problem generator.")


class JsonlData(TaskBase):
    """Samples from JSONL files (one row per sample; other fields go to ``sample.meta``)."""

    train_path: str = Field(description="JSONL file of training rows.")
    eval_path: str = Field(description="JSONL file of held-out rows.")
    prompt_field: str = Field("prompt", description="Row key holding the prompt text.")
    answer_field: str = Field("answer", description="Row key holding the reference answer.")


class JsonlTaskConfig(JsonlData):
    """User task: JSONL files of prompts and a reward function given by import path."""

    type: Literal["jsonl"] = "jsonl"
    reward: str = Field(description="Reward function 'package.module:function(completion, sample) -> float'.")
    render: Literal["auto", "chat", "raw"] = Field(
        "auto",
        description="chat: the prompt (a string, or a row's list of messages) through the model's chat template; "
        "raw: BOS + the prompt text (string prompts only); auto: chat for a pretrained or family model, raw for "
        "the tiny one.",
    )
    reward_range: RewardRange | None = Field(
        None,
        description=REWARD_RANGE_DOC + " Declare it when workers are not all trusted: a user's reward has no "
        "known range.",
    )


class AgentTaskConfig(JsonlData):
    """A black-box agent of your own (docs/agents.md, "Agents of your own"): ``agent`` names
    ``async def run_agent(base_url, sample) -> reward``, which talks to an OpenAI-compatible chat endpoint the
    rollout worker serves for each episode; the samples are JSONL rows as for ``jsonl``."""

    type: Literal["agent"] = "agent"
    agent: str = Field(description="The agent: import path 'package.module:function' of run_agent(base_url, sample).")

    @model_validator(mode="after")
    def _importable(self) -> AgentTaskConfig:
        from miles.plugins import import_callable

        import_callable(self.agent, "task.agent")  # a wrong path fails the recipe, not a worker later
        return self


class CopyTaskConfig(TaskBase):
    """Built-in task with long-tailed generation lengths: copy a digit string ("3141=" -> "3141").

    String lengths follow a clipped log-normal, so most completions are a few tokens and a few are
    many times longer (p99 / median >= 8 at the defaults): the case where asynchronous rollouts pay off.
    """

    type: Literal["copy"] = "copy"
    median_len: float = Field(4.0, gt=0, description="Median string length (exp of the log-normal's mean).")
    sigma: float = Field(1.1, ge=0, description="Log-normal sigma of the length (0: every string has median_len).")
    min_len: int = Field(1, ge=1, description="Lengths are clipped to [min_len, max_len].")
    max_len: int = Field(56, ge=1, description="Longest string; set rollout.sampling.max_new_tokens >= max_len + 1.")
    reverse: bool = Field(False, description="The answer is the string reversed instead of copied.")
    train_size: int = Field(4000, gt=0, description="Number of training prompts.")
    eval_size: int = Field(200, gt=0, description="Number of held-out prompts (disjoint strings from train).")
    seed: int = Field(0, description="Seed of the string and length generator.")


class ImportTaskConfig(TaskBase):
    """A task of your own, by import path (docs/extending.md): ``type: my_envs:GuessGame`` names a class (or a
    factory) returning a :class:`miles.tasks.base.Task`; every other key of the section is an option of its
    ``Config`` (a pydantic model, the class's ``Config`` attribute), validated when the recipe is loaded."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    type: str = Field(description="Import path 'package.module:Name' of the task class or factory.")

    @model_validator(mode="after")
    def _options(self) -> ImportTaskConfig:
        self.options()  # a bad import path or option fails the recipe, not a worker later
        return self

    def options(self) -> BaseModel | None:
        """The task's own options (the section's other keys) validated by its ``Config``; None without one."""
        from miles.plugins import import_callable

        target = import_callable(self.type, "task.type")
        extra = dict(self.model_extra or {})
        model = getattr(target, "Config", None)
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            if extra:
                raise ValueError(
                    f"unknown keys {', '.join(sorted(extra))}: {self.type} takes no options (give it a Config model)"
                )
            return None
        try:
            return model.model_validate(extra)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
            raise ValueError(f"{self.type} options: {problems}") from None


TaskConfig = Annotated[
    Annotated[ArithmeticTaskConfig, Tag("arithmetic")]
    | Annotated[JsonlTaskConfig, Tag("jsonl")]
    | Annotated[CopyTaskConfig, Tag("copy")]
    | Annotated[ScratchpadTaskConfig, Tag("scratchpad")]
    | Annotated[TerminalTaskConfig, Tag("terminal")]
    | Annotated[AgentTaskConfig, Tag("agent")]
    | Annotated[ImportTaskConfig, Tag(IMPORT_TAG)],
    _variant("arithmetic"),
]


# --------------------------------------------------------------------------- rollout


class SamplingConfig(Strict):
    max_new_tokens: int = Field(8, gt=0, description="Generation budget per completion.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")


class TorchEngineConfig(Strict):
    """Embedded HF-transformers engine (CPU or GPU)."""

    type: Literal["torch"] = "torch"
    device: str = Field("cpu", description="torch device for generation.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Compute dtype.")
    threads: int | None = Field(1, description="torch intra-op threads per rollout process (None: torch default).")
    max_batch: int = Field(
        64, ge=1, description="Rows (requests) in the running batch; more wait in the queue until a row finishes."
    )
    forward: Literal["auto", "hf"] = Field(
        "auto",
        description="Model call per token boundary. auto: Miles' lean forward where the architecture is one it "
        "implements (LlamaForCausalLM with a silu MLP and bias-free projections), else the HF forward; hf: always "
        "the HF forward.",
    )
    max_prefill_tokens: int = Field(
        4096,
        ge=1,
        description="Padded prompt tokens (distinct prompts x longest) prefilled at one token boundary; bounds "
        "how long running rows wait while newcomers join (one request is always admitted).",
    )


class SglangEngineConfig(Strict):
    """An SGLang server driven over HTTP (GPU nodes)."""

    type: Literal["sglang"] = "sglang"
    url: str = Field(description="Base URL of the SGLang server, e.g. http://127.0.0.1:30000.")
    timeout_s: float = Field(600.0, gt=0, description="HTTP timeout per request.")
    adapter_dir: str | None = Field(
        None,
        description="LoRA mode: directory, readable by the SGLang server, where each adapter version is written "
        "before /load_lora_adapter, and full mode's checkpoints (None: <run dir>/engines/<worker>/weights).",
    )
    keep_adapters: int = Field(
        2, ge=1, description="LoRA mode: adapter versions kept loaded in the server (older ones are unloaded)."
    )
    max_context: int | None = Field(
        None,
        ge=1,
        description="Most tokens (prompt + output) per request; None: the checkpoint's max_position_embeddings. "
        "Set it to the server's --context-length if that is smaller.",
    )


class VllmEngineConfig(Strict):
    """A vLLM server driven over HTTP (docs/engines.md): started and supervised by the rollout worker, from the
    cached vLLM environment (``miles vllm-env``), or an existing server at ``url``."""

    type: Literal["vllm"] = "vllm"
    url: str | None = Field(
        None,
        description="Base URL of a running vLLM server (started with Miles' worker extension, docs/engines.md); "
        "None: the worker starts its own server and restarts it when it dies or hangs.",
    )
    python: str | None = Field(
        None, description="Python of the vLLM environment (None: the one `miles vllm-env` builds and caches)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Server compute dtype. float32 on CPUs that advertise but cannot run AMX bf16 kernels.",
    )
    threads: int = Field(1, ge=1, description="OMP threads of the server's worker process.")
    kv_cache_gib: int = Field(1, ge=1, description="CPU KV cache of the server (VLLM_CPU_KVCACHE_SPACE), GiB.")
    max_num_seqs: int = Field(256, ge=1, description="Requests the server batches at once.")
    max_context: int | None = Field(
        None, ge=1, description="Prompt + output tokens per request (--max-model-len; None: the checkpoint's)."
    )
    enforce_eager: bool = Field(True, description="No graph capture or compilation (faster start on CPU).")
    seed: int = Field(0, description="The server's sampling seed.")
    extra_args: list[str] = Field(default_factory=list, description="More `vllm serve` arguments, appended as given.")
    timeout_s: float = Field(600.0, gt=0, description="HTTP timeout per request.")
    startup_timeout_s: float = Field(600.0, gt=0, description="How long a starting server may take to answer /health.")
    health_every_s: float = Field(2.0, gt=0, description="Seconds between the supervisor's /health checks.")
    health_timeout_s: float = Field(10.0, gt=0, description="Timeout of one /health check.")
    hang_checks: int = Field(3, ge=1, description="Unanswered /health checks in a row that count as a hung server.")
    max_restarts: int = Field(5, ge=0, description="Server restarts before the engine (and the worker) fails.")
    max_loras: int = Field(
        4,
        ge=2,
        description="LoRA mode: adapters one batch may mix (--max-loras). Requests started on older versions keep "
        "theirs; below staleness.max_staleness + 2 some of them wait for a slot.",
    )


EngineConfig = Annotated[
    Annotated[TorchEngineConfig, Tag("torch")]
    | Annotated[SglangEngineConfig, Tag("sglang")]
    | Annotated[VllmEngineConfig, Tag("vllm")],
    _variant("torch"),
]


class EpisodeConfig(Strict):
    """Limits of one episode (docs/agents.md). A single-turn task ends after its one model turn anyway."""

    max_turns: int = Field(1, ge=1, description="Model turns per episode (ends with end reason max_turns).")
    max_tokens: int | None = Field(
        None, ge=1, description="Tokens after the prompt, model and environment together (None: the context window)."
    )
    timeout_s: float | None = Field(
        None, gt=0, description="Wall clock for an episode's turns and environment steps (end reason timeout)."
    )
    reward_timeout_s: float | None = Field(
        60.0, gt=0, description="Wall clock for scoring an episode; past it the sample fails (reward_failed)."
    )
    check_template: bool = Field(
        True,
        description="Re-render each multi-turn conversation with the chat template and count where it differs "
        "from the exact sampled ids (template_mismatches); training always uses the sampled ids.",
    )


# How a rollout worker's room for prompt groups comes free (miles.actors.seats).
AdmitBy = Literal["groups", "episodes"]


class RolloutConfig(Strict):
    workers: int = Field(2, ge=1, description="Rollout worker processes `miles run` starts.")
    engine: EngineConfig = Field(default_factory=TorchEngineConfig, description="Generation engine.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling for training rollouts.")
    group_size: int = Field(8, ge=1, description="Episodes sampled per prompt (a GRPO group).")
    groups_in_flight: int = Field(
        4, ge=1, description="Prompt groups a worker plays at once; their episodes share the engine's batch."
    )
    admit_by: AdmitBy = Field(
        "groups",
        description="groups: a worker plays at most groups_in_flight groups, a group's room coming free when it is "
        "stored. episodes: it keeps at most groups_in_flight x group_size episodes running, each finished episode "
        "making room at once, so on long-tailed lengths the next group starts while a long group's last episode "
        "still runs (the engine's rows stay busy; the worker may then hold more than groups_in_flight groups). "
        "Give it one group more than the engine's rows, so a freed row never waits for a whole group's seats "
        "(docs/staleness.md).",
    )
    episode: EpisodeConfig = Field(default_factory=EpisodeConfig, description="Turn, token and time limits.")
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig, description="Where agents' commands run (terminal tasks; docs/agents.md)."
    )


class EvalConfig(Strict):
    """Held-out evaluation: the controller sends the eval split to rollout workers (greedy), never the trainer."""

    every: int = Field(10, ge=0, description="Versions between evaluations (0: only the first and the last version).")
    shard_size: int = Field(50, ge=1, description="Held-out samples per evaluation work item.")
    max_new_tokens: int | None = Field(None, ge=1, description="Per model turn (None: rollout.sampling's).")
    max_samples: int | None = Field(None, ge=1, description="Evaluate only the first this many held-out samples.")
    hold_rollouts: bool = Field(
        True,
        description="While an evaluation pins a worker's weights and a newer version is announced, the worker "
        "starts no new rollout group (played on the pinned weights, it would reach the trainer too old and be "
        "issued again): the generation goes to the evaluation instead. false: start them anyway "
        "(benchmarks/eval_staleness.py measures both).",
    )
    final_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="How long the controller waits for the last version's evaluation before it "
        "writes summary.json without it (the summary then says so).",
    )


# --------------------------------------------------------------------------- trainer


class FsdpBackendConfig(Strict):
    """torch FSDP2 data parallel (gloo on CPU, NCCL on GPU): the same code on both."""

    type: Literal["fsdp"] = "fsdp"
    device: str = Field("cpu", description="'cpu' or 'cuda'.")
    threads: int | None = Field(1, description="torch intra-op threads per trainer rank (None: torch default).")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Compute dtype of parameters in forward/backward; master weights, optimizer state and gradient "
        "reduction stay float32 (FSDP2 MixedPrecisionPolicy). bfloat16 is the choice on GPUs.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer's activations in backward instead of keeping them."
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="Token budget of one forward/backward on a rank (rows x row length, padding included); "
        "gradients accumulate into one optimizer step. None: the rank's whole shard at once.",
    )
    pack_sequences: bool = Field(
        True,
        description="Pack several short sequences into one row (position ids restart per sequence, attention "
        "stays within each) instead of padding every sequence to the longest.",
    )
    logprob_chunk_tokens: int = Field(
        1024,
        ge=1,
        description="Tokens whose logits are materialised at once when computing log-probs and entropies "
        "(the (tokens, vocab) float32 logits of a whole batch are never held).",
    )
    share_prompts: bool = Field(
        True,
        description="Pack the samples of one prompt (a GRPO group) behind one copy of it, with an attention mask "
        "that keeps them apart: the same log-probs and gradients, the prompt computed once per group. Applies to "
        "full-attention Llama, Qwen2 and Qwen3 models under SDPA or eager attention; other models, and runs with "
        "a teacher in the trainer, pack every sample whole.",
    )


class MegatronBackendConfig(Strict):
    """megatron-core at scale (GPU only): tensor, pipeline, expert and context parallelism, the distributed
    optimizer, bf16 with float32 master weights (docs/megatron.md)."""

    type: Literal["megatron"] = "megatron"
    tensor_parallel: int = Field(1, ge=1, description="Tensor-parallel size (must divide the attention and KV heads).")
    pipeline_parallel: int = Field(1, ge=1, description="Pipeline stages.")
    virtual_pipeline_parallel: int | None = Field(
        None, ge=2, description="Virtual stages per pipeline rank (interleaved 1F1B); needs pipeline_parallel >= 2."
    )
    context_parallel: int = Field(
        1, ge=1, description="Context-parallel size (splits each sequence; needs transformer-engine and packing=thd)."
    )
    expert_parallel: int = Field(1, ge=1, description="Expert-parallel size (must divide dp * cp).")
    sequence_parallel: bool = Field(
        True,
        description="Shard activations over the TP ranks when tensor_parallel > 1 (needs transformer-engine or apex "
        "norms; otherwise off with a warning).",
    )
    bf16: bool = Field(
        True, description="bf16 weights and compute with float32 master weights and Adam state; False: float32."
    )
    use_distributed_optimizer: bool = Field(
        True, description="Shard optimizer state and master weights over the data-parallel ranks."
    )
    transformer_engine: Literal["auto", "on", "off"] = Field(
        "auto", description="TransformerEngine layers when installed ('auto'), required ('on'), or local ('off')."
    )
    packing: Literal["auto", "thd", "mask"] = Field(
        "auto",
        description="Packed rows as 'thd' (cu_seqlens, TransformerEngine; needed for context parallelism) or 'mask' "
        "(block-diagonal mask, local layers); 'auto': thd with TE, else mask.",
    )
    logprob_chunk_tokens: int = Field(
        4096, ge=1, description="Tokens per chunk when computing log-probs from vocab-parallel logits."
    )
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="Activation recomputation (megatron's recompute_granularity)."
    )
    moe_aux_loss_coef: float = Field(
        0.0, ge=0, description="Weight of the router load-balancing loss (mean over micro-batches and replicas)."
    )
    moe_capacity_factor: float | None = Field(
        None, gt=0, description="Expert capacity as a multiple of the even share of tokens (None: no dropping)."
    )
    moe_token_drop_policy: Literal["probs", "position"] = Field(
        "probs", description="With a capacity: drop the lowest-probability tokens, or the latest ones."
    )
    moe_pad_expert_input_to_capacity: bool = Field(
        False, description="With a capacity: pad every expert's input to it (static shapes)."
    )
    moe_token_dispatcher: Literal["alltoall", "allgather"] = Field(
        "alltoall", description="How tokens reach experts across expert-parallel ranks."
    )
    moe_expert_bias_update_rate: float = Field(
        0.0, ge=0, description="Aux-free balancing: update rate of the routing-score bias (0: frozen)."
    )


BackendConfig = Annotated[
    Annotated[FsdpBackendConfig, Tag("fsdp")] | Annotated[MegatronBackendConfig, Tag("megatron")], _variant("fsdp")
]


class LoraConfig(Strict):
    """LoRA RL: low-rank adapters trained on a frozen base (peft); only adapter tensors are synced."""

    rank: int = Field(8, ge=1, description="Adapter rank r.")
    alpha: float = Field(16.0, gt=0, description="Scaling numerator: the update is (alpha / rank) * B @ A.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names of the linear layers that get adapters (suffixes of module names, as in peft).",
    )


class AuditConfig(Strict):
    """The trajectory audit (docs/security.md): the trainer checks a random share of workers' rewards and
    behaviour log-probs itself."""

    rate: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of trajectories whose rewards the trainer recomputes with the task's own reward, drawn "
        "at random (0: off). Single-turn text tasks only. A worker lying on n trajectories is caught with "
        "probability 1 - (1 - rate)^n.",
    )
    tolerance: float = Field(1e-6, ge=0, description="Largest difference between a worker's reward and the task's.")
    logprob_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of trajectories whose behaviour log-probs the trainer recomputes with its own forward "
        "(0: off) under the weights that sampled them (every rank keeps its shards of the last max_staleness + 1 "
        "versions; an episode whose weights changed mid-generation is not checked). Any task, agents included; "
        "costs a no-grad forward of the checked trajectories.",
    )
    logprob_tolerance: float | None = Field(
        None,
        gt=0,
        description="Largest mean |log pi - log mu| per token of a checked trajectory (nats). Default 0.05 where "
        "the trainer scores with exactly the weights workers hold (sync.dtype bfloat16 or float32, no LoRA); "
        "otherwise required: an honest run's summary.json audit.logprob_gap_max says where to set it.",
    )
    exclude_after: int = Field(
        1,
        ge=1,
        description="Disagreeing trajectories after which a worker is no longer believed (all it sends is "
        "refused and re-issued).",
    )


class TrainerConfig(Strict):
    backend: BackendConfig = Field(default_factory=FsdpBackendConfig, description="Training backend.")
    ranks: int = Field(1, ge=1, description="Trainer ranks `miles run` starts (data-parallel for fsdp).")
    steps: int = Field(40, ge=1, description="Rollout batches to train on (one published policy version each).")
    groups_per_step: int = Field(8, ge=1, description="Prompt groups per rollout batch.")
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate (the peak, with a schedule).")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="After warm-up: keep lr, or decay it to lr * min_lr_ratio at the last step."
    )
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear learning-rate warm-up from ~0 to lr.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="End of a cosine/linear decay, as a fraction of lr.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters on a frozen base instead of all weights (None: full fine-tuning)."
    )
    checkpoint_every: int = Field(
        50,
        ge=1,
        description="Steps between sharded checkpoints (and one at the end). A crash replays, on the restored "
        "weights, the trajectories the steps since the last checkpoint consumed (docs/architecture.md).",
    )
    keep_checkpoints: int = Field(2, ge=1, description="Complete checkpoints kept (older ones are deleted).")
    async_checkpoint: bool = Field(
        True, description="Write checkpoints in the background while training goes on (torch.distributed async save)."
    )
    seed: int = Field(0, description="Seed of model init and sampling in the trainer.")
    audit: AuditConfig = Field(
        default_factory=AuditConfig, description="Check workers' rewards and log-probs (untrusted ones)."
    )


# --------------------------------------------------------------------------- staleness / sync / bus


class StalenessConfig(Strict):
    max_staleness: int = Field(
        2, ge=0, description="eta: a trained token is at most this many versions old (0 = synchronous on-policy)."
    )
    on_stale: Literal["drop", "requeue"] = Field(
        "requeue", description="What the trainer does with a trajectory older than the bound: drop, or re-issue it."
    )
    stale_prefix: Literal["discard", "mask"] = Field(
        "mask",
        description="A trajectory whose first tokens are older than the bound but whose last ones are not (a long "
        "answer the engine continued under newer weights): 'mask' trains it with its too-old tokens out of the "
        "loss (they stay as context), so its generation is not thrown away and redone; 'discard' treats it as "
        "stale (on_stale). Either way no trained token is more than max_staleness versions old "
        "(docs/staleness.md).",
    )


class SyncConfig(Strict):
    mode: str = Field(
        "full",
        pattern=REGISTERED_NAME,
        description="Weight-sync mode, a name registered in miles.sync.modes (register_sync_mode; a recipe's "
        "plugins may add one): 'full' publishes every version whole; 'delta' publishes a sparse delta against the "
        "previous version, with a full anchor every anchor_every versions; 'lora' publishes only the adapter "
        "tensors (needs trainer.lora) (docs/weight-sync.md).",
    )
    dtype: Literal["bfloat16", "float32", "fp8_e4m3", "fp4_e2m1"] = Field(
        "bfloat16",
        description="Rollout precision of published weights: 'fp8_e4m3' (per-tensor power-of-two scale) and "
        "'fp4_e2m1' (MXFP4: e8m0 scale per 32 elements) quantize the decoder's linear weights, the rest is bf16; "
        "workers compute with the dequantized values, so rollout sees exactly the trainer's quantized weights.",
    )
    keep_versions: int = Field(
        3,
        ge=1,
        description="Full payloads kept in the data plane (in delta mode: full anchors; the delta key space keeps "
        "anchor_every + keep_versions deltas, so every delta since the newest anchor stays fetchable).",
    )
    anchor_every: int = Field(10, ge=1, description="Delta mode: publish a full anchor every this many versions.")
    transport: str = Field(
        "bus",
        pattern=REGISTERED_NAME,
        description="How full-mode payloads reach the workers (the announcement, digests and audit are the same "
        "for all), a name registered on both sides (miles.sync.sender.register_transport, "
        "miles.sync.receiver.register_receiver; checked by `miles prepare`): 'bus' (the JetStream data plane), "
        "'fs' (a directory every trainer and worker host sees: sync.fs_dir), 'broadcast' (a torch.distributed "
        "weight-update group of the trainer and the workers, falling back to the bus for good if a member dies). "
        "docs/weight-sync.md",
    )
    fs_dir: str | None = Field(
        None, description="transport 'fs': the shared directory (None: <run dir>/weights-fs, fine on one machine)."
    )
    broadcast_addr: str = Field("127.0.0.1", description="transport 'broadcast': the trainer leader's address.")
    broadcast_port: int = Field(
        0, ge=0, le=65535, description="transport 'broadcast': rendezvous port (0: `miles run` picks a free one)."
    )
    broadcast_bucket_mb: int = Field(64, ge=1, description="transport 'broadcast': bytes per broadcast, in MiB.")
    broadcast_timeout_s: float = Field(
        120.0, gt=0, description="transport 'broadcast': the group's rendezvous and collective timeout."
    )


class BusConfig(BusSecurityFields):
    """How actors reach NATS and who they are on it (per-role identities: docs/security.md)."""

    nats_url: str | None = Field(
        None,
        description="Join this NATS server or cluster; several URLs comma-separated (a cluster's nodes: the client "
        "moves to another when one goes away). Used when no --nats-url (or $NATS_URL) is given; None: `miles run` "
        "starts an embedded server.",
    )
    creds: str | None = Field(None, description="NATS credentials file.")
    tls_ca: str | None = Field(None, description="CA bundle for TLS.")
    tls_cert: str | None = Field(None, description="Client certificate for mutual TLS.")
    tls_key: str | None = Field(None, description="Client key for mutual TLS.")
    replicas: int = Field(1, ge=1, le=5, description="JetStream stream replicas (3 on a cluster).")
    outage_budget_s: float = Field(
        120.0,
        gt=0,
        description="How long an actor rides out an unusable bus (a server restart, a lost cluster node, a leader "
        "election, a cut leaf link): JetStream requests are retried with backoff for this long, then the actor "
        "exits with one line saying what it waited for (docs/deploy.md, 'Outages').",
    )
    js_domain: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Address JetStream in this domain ($JS.<domain>.API): a client of a server with a JetStream of "
        "its own that uses the run's streams in another domain. None: the server's (a leaf node without JetStream "
        "maps its clients to the hub's domain itself, docs/deploy.md).",
    )
    request_timeout_s: float = Field(
        10.0,
        gt=0,
        description="How long one JetStream request (publish ack, API call, direct get) waits for its answer before "
        "the retry layer sends it again (within bus.outage_budget_s). Raise it for links with long round trips.",
    )
    ack_wait_s: float = Field(30.0, gt=0, description="Redelivery delay of an unacked prompt or trajectory.")
    heartbeat_s: float = Field(1.0, gt=0, description="Actor heartbeat period.")
    retention: Literal["recovery", "all"] = Field(
        "recovery",
        description="What TRAJ, EVENTS and METRICS keep. recovery: what a restart can still need, so they stay "
        "bounded for a run of any length: the trainer purges trajectories its oldest kept checkpoint no longer "
        "needs, the controller the events and metrics its snapshots hold (and the trainer's checkpoints do not "
        "need); the run record in the run directory keeps the history. all: nothing is purged (the whole run "
        "stays on the bus, growing with it).",
    )
    snapshot_every_steps: int = Field(
        50,
        ge=1,
        description="The controller writes a snapshot of its state to the bus every this many recorded steps: a "
        "restarted controller reads the newest one and replays only what was stored after it, so a restart costs "
        "the same at any run length, and nothing on EVENTS or METRICS older than the newest snapshot is needed "
        "(docs/architecture.md, 'Controller snapshots').",
    )
    max_payload_mb: int = Field(8, ge=1, description="max_payload of the embedded server (weight chunk size follows).")
    embedded_threads: int | None = Field(
        1,
        ge=1,
        description="OS threads running the Go code of the nats-server `miles run` embeds (GOMAXPROCS). One serves a "
        "single machine's actors with the fewest thread wake-ups (-20% of its CPU in the quickstart, "
        "benchmarks/RESULTS.md); None: one per core, Go's default.",
    )
    secure: bool = Field(
        True,
        description="`miles run` with its embedded server: generate the run's credentials bundle in <run dir>/auth "
        "(kept across restarts of the run), start the server with per-role logins and mutual TLS, and have the "
        "trainer and the controller sign what the others must believe (docs/security.md). false: an open loopback "
        "server, no identities, no signatures. Ignored when bus.nats_url or bus.credentials_dir is set.",
    )

    @field_validator("nats_url")
    @classmethod
    def _check_urls(cls, value: str | None) -> str | None:
        if value is not None:
            split_urls(value)  # a ValueError naming the bad entry becomes the field's error
        return value


class MonitorConfig(Strict):
    """The live monitor (``miles top`` / ``miles-node --role monitor``) and its Prometheus endpoint."""

    prometheus_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve Prometheus /metrics on this port (None: off; 0: any free port, logged).",
    )
    prometheus_addr: str = Field("0.0.0.0", description="Address the /metrics endpoint binds to.")
    refresh_s: float = Field(1.0, gt=0, description="Seconds between redraws, queue polls and metric updates.")
    rate_window_s: float = Field(30.0, gt=0, description="Window of the tokens/s and trajectories/s rates.")
    reward_points: int = Field(40, ge=1, description="Steps shown in the reward trend (sparkline).")
    plots: bool = Field(
        True, description="Write reward, staleness and length PNG plots to the run directory at the end."
    )
    wandb: bool = Field(
        False,
        description="Also log the run's scalars to Weights & Biases when wandb is installed (offline unless "
        "WANDB_MODE says otherwise); TensorBoard event files are written whenever tensorboard is installed.",
    )


class RunConfig(Strict):
    """Top of the tree: one run."""

    name: str = Field("miles", pattern=r"^[A-Za-z0-9_-]+$", description="Run id; prefixes every stream and bucket.")
    seed: int = Field(0, description="Global seed.")
    plugins: list[str] = Field(
        default_factory=list,
        description="Modules every process of the run imports when it loads this recipe, before it builds "
        "anything: where your own registrations run (a weight transport's two sides, docs/extending.md). "
        "Found on sys.path and in the working directory.",
    )
    model: ModelConfig = Field(default_factory=TinyModelConfig)
    task: TaskConfig = Field(default_factory=ArithmeticTaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation by rollout workers.")
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig, description="Live monitor and plots.")

    @property
    def rollout_weights_are_a_cast(self) -> bool:
        """Workers hold the trained tensors cast to ``sync.dtype`` (not quantized codes, no LoRA merged into
        them): the trainer can reproduce their weights exactly by the same cast (the log-prob audit does)."""
        return self.sync.dtype in ("bfloat16", "float32") and self.trainer.lora is None

    @field_validator("plugins")
    @classmethod
    def _import_plugins(cls, modules: list[str]) -> list[str]:
        from miles.plugins import import_module

        for name in modules:
            import_module(name, "")  # a module that does not import fails the recipe, in one line (under 'plugins')
        return modules

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if isinstance(self.task, JsonlTaskConfig) and self.task.render == "auto":  # chat models get their template
            self.task.render = "raw" if self.model.type == "tiny" else "chat"
        if self.trainer.groups_per_step % self.trainer.ranks:
            raise ValueError(
                f"trainer.groups_per_step ({self.trainer.groups_per_step}) must be divisible by "
                f"trainer.ranks ({self.trainer.ranks})"
            )
        from miles.sync.modes import sync_mode  # registered by the built-ins and the recipe's plugins (above)

        sync_mode(self).check()
        if self.trainer.lora is not None and self.sync.dtype in ("fp8_e4m3", "fp4_e2m1"):
            raise ValueError(f"sync.dtype {self.sync.dtype!r} is not supported with trainer.lora (adapters are bf16)")
        if self.rollout.engine.type == "vllm":
            if self.sync.transport == "broadcast":
                raise ValueError(
                    "rollout.engine.type 'vllm' loads weights from files: use sync.transport 'bus' or 'fs'"
                )
            if self.rollout.sampling.top_p < 1:
                raise ValueError(
                    "rollout.sampling.top_p < 1 with rollout.engine.type 'vllm': vLLM reports log-probs after the "
                    "top-p cut, not the behaviour log-probs the off-policy corrections need; keep top_p at 1"
                )
        audit = self.trainer.audit
        if audit.logprob_rate > 0 and audit.logprob_tolerance is None and not self.rollout_weights_are_a_cast:
            raise ValueError(
                "trainer.audit.logprob_tolerance: required with trainer.audit.logprob_rate > 0 when workers do not "
                f"hold a plain cast of the trained weights (sync.dtype {self.sync.dtype!r}, LoRA "
                f"{'on' if self.trainer.lora else 'off'}): the honest gap includes the rollout quantization; run "
                "once with a large tolerance and set it well above summary.json's audit.logprob_gap_max"
            )
        if self.trainer.audit.rate > 0 and self.task.type == "terminal":
            raise ValueError(
                "trainer.audit.rate > 0 re-scores single-turn text tasks; a terminal task's reward comes from a "
                "sandbox the trainer does not replay (trainer.audit.logprob_rate checks an agent's log-probs)"
            )
        return self


# --------------------------------------------------------------------------- loading


class ConfigError(Exception):
    """A recipe or override that cannot be loaded; the message names the file and every problem found."""


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form dotted.key=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override '{item}' has an empty key segment")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{item}': value is not valid YAML ({exc.__class__.__name__})") from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set ``a.b.c=value`` items into a nested dict (values parsed as YAML scalars/lists)."""
    for item in overrides:
        parts, value = _parse_override(item)
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if isinstance(child, str):  # a variant given by its type alone ('off_policy: masked_is')
                child = node[part] = {"type": child}
            if not isinstance(child, dict):
                raise ConfigError(f"override '{item}': '{part}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def _variant_tags() -> set[str]:
    """Every ``type`` tag of a config variant (pydantic puts the tag in an error's location; we drop it)."""
    tags: set[str] = set()
    pending: list[type[BaseModel]] = [Strict]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        field = cls.model_fields.get("type")
        if field is not None and isinstance(field.default, str):
            tags.add(field.default)
    return tags


# Keys renamed or moved since an earlier release: a recipe that still uses one is told the new name.
RENAMED_KEYS: dict[str, str] = {
    "rollout.groups_per_batch": "rollout.groups_in_flight (groups a worker plays at once)",
    "trainer.eval_every": "eval.every (evaluations are played by rollout workers)",
}


def _describe(error: Any) -> str:
    """One validation problem as ``key: what is wrong``."""
    loc = ".".join(str(p) for p in error["loc"] if not str(p).startswith("function-after"))
    # Discriminated unions put the tag ('tiny', 'fsdp') in the location; drop it for readability.
    loc = ".".join(p for p in loc.split(".") if p not in _variant_tags())
    msg = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        msg = f"unknown key; renamed: use {RENAMED_KEYS[loc]}" if loc in RENAMED_KEYS else "unknown key"
    elif error["type"] == "union_tag_invalid":
        ctx = error.get("ctx", {})
        tags = str(ctx.get("expected_tags"))
        own = f"'{IMPORT_TAG}'" in tags
        tags = tags.replace(f", '{IMPORT_TAG}'", "") + (", or 'package.module:Name' of your own" if own else "")
        tag = ctx.get("tag")
        what = "an import path is not taken here" if tag == IMPORT_TAG else f"unknown type {tag!r}"
        msg = f"{what}; expected one of {tags}"
    return f"{loc}: {msg}" if loc else msg


def _format_problems(problems: list[str], source: str) -> str:
    """One problem: one line. Several: a header and one indented line each, so a user fixes them in one go."""
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    return f"{source}: {len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems)


def add_override_option(parser: argparse.ArgumentParser) -> None:
    """The ``--set dotted.key=value`` option every Miles command takes (collected in ``args.overrides``)."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Dotted config override, e.g. --set trainer.lr=2e-5 (repeatable).",
    )


def load_config(recipe: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a recipe (or the defaults when ``recipe`` is None) and apply dotted overrides.

    Raises :class:`ConfigError` naming the file and, for each problem, the key and what is wrong (one line for
    one problem; every problem at once when there are several).
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if recipe is not None:
        path = Path(recipe)
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"{path}: recipe file not found")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}:{line} is not valid YAML") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        data = loaded
    problems: list[str] = []
    for item in overrides or []:  # every malformed override is reported, beside the recipe's problems
        try:
            apply_overrides(data, [item])
        except ConfigError as exc:
            problems.append(str(exc))
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        problems.extend(_describe(e) for e in err.errors())
    else:
        if not problems:
            return cfg
    raise ConfigError(_format_problems(problems, source))


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (written into every run directory)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
