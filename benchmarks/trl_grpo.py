"""TRL ``GRPOTrainer`` on a Miles recipe's model, task and sample budget: the baseline of the Miles-vs-TRL benchmarks.

    python benchmarks/trl_grpo.py --recipe recipes/quickstart.yaml --out benchmarks/results/trl_grpo.json
    python benchmarks/trl_grpo.py --recipe recipes/quickstart.yaml --set trainer.steps=3   # quick check
    python benchmarks/trl_grpo.py --recipe recipes/smollm2-135m.yaml --threads 2 --max-wall-s 1200  # real model

Usually run by ``benchmarks/miles_vs_trl.py`` (the quickstart) or ``benchmarks/real_model_vs_trl.py`` (a
pretrained model with LoRA and a chat template) in its own process, so that it shares no torch thread state
with the Miles run; it can be run alone. It needs the ``benchmark`` extra (``trl``, ``datasets``).

What is aligned with Miles, and how (so that the comparison measures the frameworks, not the settings):

* the model is the very checkpoint Miles trains (``prepare_model``: the cached tiny model, or the
  pretrained path, e.g. the converted GGUF file of ``recipes/smollm2-135m.yaml``), loaded with Miles' own
  ``load_policy`` in float32;
* prompts are the task's train split, tokenised exactly like a Miles rollout worker renders a sample's
  opening messages (``Renderer.initial(prompt_messages(sample))``), checked for every train prompt before
  training and again on every generation batch (the run aborts on any difference):

  - ``raw`` tasks (the tiny model): BOS + the prompt's tokens, nothing appended. TRL's plain-text path calls
    ``tokenizer(text=...)``, which for the tiny character tokenizer adds no BOS, so the dataset prompt is
    ``bos_token + prompt`` (a plain string: no chat template);
  - ``chat`` tasks (a pretrained model, ``task.render`` auto -> chat): the dataset prompt is the sample's
    messages (system + user for ``recipes/data/largest``), TRL's conversational path, which renders them with
    the tokenizer's chat template and the generation prompt (``apply_chat_template(..., tokenize=True)``),
    as the Miles renderer does (template text, then ``encode(add_special_tokens=False)``);
* stop tokens: the model's ``generation_config.eos_token_id`` is set to Miles' ``stop_token_ids(tokenizer,
  model_dir)`` (EOS, the template's end-of-turn tokens, the checkpoint's generation config), which TRL uses
  both to stop ``generate`` and to cut each completion after its first stop token;
* the reward is ``task.reward`` on the completion ids decoded as the Miles rollout worker decodes them
  (``Renderer.decode``: ``skip_special_tokens=True``), looked up by a ``sample_index`` column;
* LoRA (``trainer.lora``): TRL's ``peft_config`` is the ``peft.LoraConfig`` that Miles' ``add_adapters``
  builds: the recipe's rank, alpha and ``target_modules`` (default q/k/v/o projections), dropout 0, no bias;
  only the adapters train, the base is frozen, no reference model (``kl_coef == 0``);
* budget: ``trainer.steps`` optimizer steps, each on ``groups_per_step`` prompts x ``group_size``
  completions of at most ``max_new_tokens`` tokens, sampled at the recipe's temperature / top-p, one
  optimizer step per generation batch (``num_iterations=1``), no reference model when ``kl_coef == 0``;
* optimizer: ``torch.optim.AdamW`` over the trainable parameters (all of them, or the LoRA adapters) with the
  recipe's lr / betas / weight decay, as Miles' FSDP backend builds it, given to the trainer with a
  ``LambdaLR`` that follows Miles' own ``lr_at`` step for step (warm-up, cosine or linear decay to
  ``min_lr_ratio``), the same global grad-norm clip, PPO-clip with ``epsilon=clip_low``,
  ``epsilon_high=clip_high``; the loss is averaged over all completion tokens of the batch (TRL
  ``loss_type="dapo"`` == Miles ``aggregation: token``);
* fp32 on CPU, no bf16, no gradient checkpointing (TRL's default is on), no vLLM, no reporting; torch
  intra-op threads: ``--threads`` (the comparison drivers give TRL every core);
* held-out accuracy is measured by :class:`HeldOutEval`: Miles' own evaluation as a rollout worker plays
  it (:func:`miles.rollout.evaluate.evaluate`, greedy, the eval split up to ``eval.max_samples``,
  ``max_new_tokens``, a ``rollout.engine`` engine, the same renderer, environment, reward and stop tokens),
  on the weights a worker would hold: rounded to ``sync.dtype`` exactly as the Miles trainer publishes them
  and decoded by the worker's ``weight_sink`` (full weights; in ``sync.mode: lora`` the adapter, rounded,
  merged in float32 on the frozen base), so both frameworks are scored by the same code.
  ``eval_after_fp32`` is the same on the unrounded weights;
* evaluation schedule: like Miles, version 0 (before training), every ``eval.every`` optimizer steps and the
  last version. Each evaluation runs between two steps and records the step, the accuracy, the training
  clock (wall seconds since training began *minus the seconds spent in evaluations*, so evaluating costs TRL
  nothing), the wall time with evaluations, and the CPU seconds per step of training (this process, the
  evaluations' CPU left out);
* wall-clock cap (``--max-wall-s``, default 1200): after a step, if the training clock plus that step's
  duration would pass the cap, training stops (no step is started that would end past it), and the last
  version is evaluated.

Differences that cannot be aligned are listed in ``NOT_ALIGNED`` and written into the output JSON.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # before the heavy imports: wall_s covers the whole process, like Miles' run wall

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from transformers import TrainerCallback  # noqa: E402

from miles.algo.config import GrpoAdvantage, GrpoNoStdAdvantage, PpoClipLoss  # noqa: E402
from miles.config import (  # noqa: E402
    ConfigError,
    FsdpBackendConfig,
    RunConfig,
    add_override_option,
    load_config,
)

# Behaviour of TRL's GRPOTrainer that no GRPOConfig field aligns with Miles (checked against trl 1.16).
NOT_ALIGNED: tuple[str, ...] = (
    "advantage std: TRL divides by the Bessel-corrected (sample) std + 1e-4, Miles by the population std + 1e-6; "
    "for a group of n TRL's advantages are sqrt((n-1)/n) of Miles' (0.935x for 8, 0.866x for 4; same sign and "
    "ranking)",
    "scheduling: TRL is synchronous (generate, then train, on the same process); Miles generates on "
    "rollout.workers processes concurrently with training, on weights up to staleness.max_staleness versions old",
    "behaviour weights: TRL samples from its fp32 training weights; Miles workers sample from weights rounded "
    "to sync.dtype (the evaluator scores both frameworks' weights rounded the same way)",
    "sampling: TRL uses transformers' model.generate (its own RNG stream and logits processors); Miles uses its "
    "TorchEngine loop, so the sampled completions differ even from the same seed",
    "off-policy correction: both take the PPO ratio against the pre-update (proximal) policy of the same step, so it "
    "is 1 in both with one optimizer step per batch; Miles (trainer.algo.off_policy: decoupled_ppo) also weights "
    "each token by min(pi_prox / pi_behaviour, clip) for its stale, bf16-sampled trajectories, TRL has nothing to "
    "correct",
    "side work: Miles writes a sharded checkpoint every trainer.checkpoint_every steps; TRL saves nothing "
    "(save_strategy=no)",
    "evaluations: Miles' rollout workers play the held-out evaluation of every eval.every-th version while training "
    "goes on (with one worker and eval.hold_rollouts, the worker starts no training rollout meanwhile), so they "
    "delay Miles' later steps and share its cores; TRL evaluates between two steps and takes the evaluation's "
    "seconds off its training clock (real_model_vs_trl.py also reports both clocks the other way round)",
    "wall-clock cap: TRL stops itself before a step that would end past --max-wall-s of training clock; Miles has no "
    "cap of its own (real_model_vs_trl.py drops its evaluations past the cap and stops a run that outlasts it)",
    "seeds: TRL has one seed (trainer.seed: prompt order, sampling, LoRA init); Miles also draws its prompt order "
    "and its workers' sampling from the global seed (the comparison drivers set both to the same value)",
    "LoRA init: both use peft's default (Kaiming-uniform A, zero B) of the same config, drawn from different RNG "
    "streams, so the initial A matrices differ (the initial policy, B = 0, is the same)",
    "entropy bonus (only when entropy_coef != 0): TRL always averages it over tokens; Miles aggregates it like the "
    "loss, which differs under aggregation: sequence",
    "data parallelism: TRL runs one process; trainer.ranks > 1 only shards Miles' batch (the update is the same)",
    "data order: TRL draws prompts with its RepeatSampler (seeded shuffle of the train split); Miles' controller "
    "issues prompts in its own order",
)


def _log(msg: str, **fields: Any) -> None:
    """Progress on stderr (stdout stays clean for a caller that reads the JSON)."""
    extra = " ".join(f"{k}={v}" for k, v in fields.items())
    print(f"[trl_grpo +{time.perf_counter() - _T0:6.1f}s] {msg} {extra}".rstrip(), file=sys.stderr, flush=True)


def grpo_config_kwargs(cfg: RunConfig, output_dir: str) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments that reproduce the recipe's budget and algorithm.

    Raises ``ValueError`` for a recipe TRL cannot express (greedy training rollouts, a custom loss or
    advantage, several optimizer steps per rollout batch).
    """
    sampling = cfg.rollout.sampling
    if sampling.temperature == 0:
        raise ValueError("rollout.sampling.temperature=0 (greedy) gives GRPO groups no spread; TRL needs sampling")
    algo = cfg.trainer.algo
    if not isinstance(algo.loss, PpoClipLoss):
        raise ValueError(f"trainer.algo.loss {algo.loss.type!r}: TRL's GRPOTrainer has only PPO-clip")
    if not isinstance(algo.advantage, GrpoAdvantage | GrpoNoStdAdvantage):
        raise ValueError(f"trainer.algo.advantage {algo.advantage.type!r}: TRL has only grpo / grpo_no_std")
    if algo.minibatches != 1:
        raise ValueError("trainer.algo.minibatches != 1: the benchmark aligns one optimizer step per rollout batch")
    completions_per_step = cfg.trainer.groups_per_step * cfg.rollout.group_size
    # Only when used: trl 1.0 had no entropy bonus (GRPOConfig rejects the key), and the default is off anyway.
    extra = {"entropy_coef": algo.entropy_coef} if algo.entropy_coef else {}
    return {
        **extra,
        "output_dir": output_dir,
        # budget: one generation batch of groups_per_step x group_size completions per optimizer step. Miles'
        # backend.micro_batch_tokens only splits the forward/backward (same gradient), so TRL takes the batch whole.
        "max_steps": cfg.trainer.steps,
        "num_generations": cfg.rollout.group_size,
        "per_device_train_batch_size": completions_per_step,  # counts completions, not prompts, in TRL
        "gradient_accumulation_steps": 1,
        "num_iterations": 1,
        "max_completion_length": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": 0,
        "mask_truncated_completions": False,  # Miles trains on truncated completions too
        # algorithm
        "loss_type": "dapo" if algo.loss.aggregation == "token" else "grpo",
        "scale_rewards": "group" if isinstance(algo.advantage, GrpoAdvantage) else "none",
        "epsilon": algo.loss.clip_low,
        "epsilon_high": algo.loss.clip_high,
        "beta": algo.kl_coef,
        "use_bias_correction_kl": False,  # Miles' KL term is plain k3, not ratio-weighted
        "importance_sampling_level": "token",
        # optimizer: the AdamW and the schedule are built by `optimizer_and_schedule` (passed to the trainer);
        # these fields only record the values for a reader of the JSON
        "learning_rate": cfg.trainer.lr,
        "adam_beta1": cfg.trainer.betas[0],
        "adam_beta2": cfg.trainer.betas[1],
        "adam_epsilon": 1e-8,  # torch.optim.AdamW's default, which Miles uses
        "weight_decay": cfg.trainer.weight_decay,
        "max_grad_norm": cfg.trainer.grad_clip,
        "warmup_steps": cfg.trainer.warmup_steps,
        # execution
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "gradient_checkpointing": False,
        "use_vllm": False,
        "seed": cfg.trainer.seed,
        "dataloader_num_workers": 0,
        # no side effects
        "report_to": [],
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "log_completions": False,
    }


def optimizer_and_schedule(cfg: RunConfig, model: Any) -> tuple[Any, Any]:
    """Miles' optimizer and learning-rate curve for TRL's trainer: ``torch.optim.AdamW`` over every trainable
    parameter (all of them, or the LoRA adapters) with the recipe's lr / betas / weight decay (as
    ``FsdpBackend`` builds it), and a ``LambdaLR`` whose factor at optimizer step ``s`` is
    ``lr_at(trainer, s) / lr``: the same warm-up and cosine/linear decay, step for step (HF's own cosine
    schedule starts its warm-up at 0 and decays to 0, not to ``min_lr_ratio``)."""
    import torch

    from miles.backends.lr_schedule import lr_at

    trainer = cfg.trainer
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=trainer.lr,
        betas=trainer.betas,
        weight_decay=trainer.weight_decay,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(trainer, step) / trainer.lr)
    return optimizer, schedule


def peft_lora_config(cfg: RunConfig) -> Any:
    """The ``peft.LoraConfig`` of Miles' ``add_adapters`` (rank, alpha, target modules, dropout 0, no bias), for
    TRL's ``peft_config``; None without ``trainer.lora``."""
    lora = cfg.trainer.lora
    if lora is None:
        return None
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules), lora_dropout=0.0, bias="none"
    )


class HeldOutEval:
    """Miles' held-out evaluation, as a rollout worker plays an evaluation shard, for a model TRL trained.

    Same samples (``task.samples("eval")[: eval.max_samples]``), same ``max_new_tokens`` (``eval`` or
    ``rollout.sampling``), greedy episodes through :func:`miles.rollout.evaluate.evaluate` on a
    ``rollout.engine`` engine (same renderer, environment, reward, stop tokens and episode limits); the weights
    reach the engine the way a worker gets them: what the trainer publishes at ``sync.dtype`` (the whole state
    through :func:`~miles.sync.precision.to_rollout_state`; in ``sync.mode: lora`` the adapter alone, cast to
    ``sync.dtype``), decoded by the engine's own ``weight_sink`` (in LoRA mode: merged in float32 on the frozen
    base the engine loaded, captured before the first adapter).
    """

    def __init__(self, cfg: RunConfig, model_dir: Any) -> None:
        from miles.engines.base import SamplingParams
        from miles.engines.registry import build_engine
        from miles.models.loading import load_tokenizer, stop_token_ids
        from miles.rollout.episode import EpisodeLimits
        from miles.rollout.render import Renderer
        from miles.sync.lora import lora_scale
        from miles.tasks.registry import build_task

        self.cfg = cfg
        self.task = build_task(cfg.task)
        self.samples = self.task.samples("eval")[: cfg.eval.max_samples]
        self.max_new_tokens = cfg.eval.max_new_tokens or cfg.rollout.sampling.max_new_tokens
        # note: build_engine applies rollout.engine.threads to this process (the caller sets its own after)
        self.engine = build_engine(cfg.rollout.engine, model_dir, 0, cfg.seed)
        tokenizer = load_tokenizer(model_dir)
        self.renderer = Renderer(tokenizer, self.task.render)
        self.stop_token_ids = stop_token_ids(tokenizer, model_dir)  # as the rollout worker computes them
        self.params = SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=cfg.rollout.sampling.temperature,  # evaluate() plays greedily whatever this says
            top_p=cfg.rollout.sampling.top_p,
            stop_token_ids=self.stop_token_ids,
        )
        episode = cfg.rollout.episode
        self.limits = EpisodeLimits(
            max_turns=episode.max_turns,
            max_tokens=episode.max_tokens,
            timeout_s=episode.timeout_s,
            reward_timeout_s=episode.reward_timeout_s,
            check_template=episode.check_template,
        )
        lora = cfg.trainer.lora
        self.lora_scale = lora_scale(lora) if lora is not None else None
        # LoRA sync: one sink for the whole run, as a worker keeps one (it captures the frozen base the first time
        # a module is adapted, so every adapter is merged on the base, never on an earlier merge).
        lora_sync = lora is not None and cfg.sync.mode == "lora"
        self.adapter_sink = self.engine.weight_sink(cfg.sync.dtype, self.lora_scale) if lora_sync else None

    def published(self, model: Any, precision: str) -> tuple[dict[str, Any], bool]:
        """``(tensors to load into the engine, complete)`` for ``model``'s weights published at ``precision``."""
        import torch

        from miles.sync.lora import merged_state, split_peft_state
        from miles.sync.precision import is_quantized, to_rollout_state

        state = {name: t.detach().to("cpu") for name, t in model.state_dict().items()}
        peft = self.lora_scale is not None and any(".lora_A." in name for name in state)
        if self.adapter_sink is not None and peft:
            adapter, _ = split_peft_state(state)
            dtype = getattr(torch, "bfloat16" if is_quantized(precision) else precision)
            return self.adapter_sink.decode({name: t.to(dtype, copy=True) for name, t in adapter.items()})
        if self.adapter_sink is not None:
            raise ValueError("sync.mode lora: evaluate the trainer's model with its adapters (B = 0 at version 0)")
        if peft:  # LoRA trained, full weights synced: the trainer exports each adapted module merged
            state = merged_state(state, self.lora_scale)
        sink = self.engine.weight_sink(precision, None)
        return sink.decode(to_rollout_state(state, precision))

    def score(self, model: Any, version: int, precision: str | None = None) -> float:
        """Greedy held-out accuracy of ``model``'s weights rounded to ``precision`` (default ``sync.dtype``)."""
        import asyncio

        from miles.rollout.evaluate import evaluate

        weights, complete = self.published(model, precision or self.cfg.sync.dtype)
        self.engine.load_weights(weights, version, complete=complete)

        async def play() -> Any:
            async with self.engine:
                return await evaluate(self.engine, self.renderer, self.task, self.samples, self.params, self.limits)

        outcome = asyncio.run(play())
        if outcome.failed or outcome.infra:
            raise RuntimeError(f"held-out evaluation: {outcome.failed} reward failures, {outcome.infra} infra errors")
        return outcome.accuracy


def miles_prompt_ids(renderer: Any, sample: Any) -> list[int]:
    """The prompt ids a Miles rollout worker generates from: the renderer's opening render of the single-turn
    environment's opening messages (the sample's conversation, or one user message of its prompt)."""
    from miles.tasks.base import prompt_messages

    return renderer.initial(prompt_messages(sample))


def trl_prompt(tokenizer: Any, sample: Any, render: str) -> str | list[dict[str, str]]:
    """The dataset ``prompt`` that TRL turns into ``miles_prompt_ids``' ids.

    ``chat``: the sample's messages (TRL's conversational path applies the chat template with the generation
    prompt). ``raw``: the text for TRL's ``tokenizer(text=...)``; the Miles renderer puts BOS first, so tokenisers
    that do not add it themselves get it as text (an added special token: it maps to the BOS id and nothing else).
    """
    from miles.tasks.base import prompt_messages

    if render == "chat":
        return prompt_messages(sample)
    prompt = "".join(m["content"] for m in prompt_messages(sample))
    plain = tokenizer(text=[prompt])["input_ids"][0]
    bos = tokenizer.bos_token_id
    if bos is None or (plain and plain[0] == bos):
        return prompt
    return f"{tokenizer.bos_token}{prompt}"


def trl_prompt_ids(tokenizer: Any, prompts: list[Any]) -> list[list[int]]:
    """What TRL 1.16's ``GRPOTrainer._tokenize_prompts`` computes for ``prompts`` (no tools, no images)."""
    if prompts and isinstance(prompts[0], list):  # conversational
        out = tokenizer.apply_chat_template(
            conversation=prompts, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    else:
        out = tokenizer(text=prompts)["input_ids"]
    return [list(ids) for ids in out]


def prompt_key(prompt: str | list[dict[str, str]]) -> str:
    """A dataset prompt (text or messages) as a dict key."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def check_prompt_tokenisation(renderer: Any, dataset_prompts: list[Any], samples: list[Any]) -> None:
    """Fail unless TRL's tokenisation of every dataset prompt gives exactly Miles' prompt ids."""
    got = trl_prompt_ids(renderer.tokenizer, dataset_prompts)
    for prompt, ids, sample in zip(dataset_prompts, got, samples, strict=True):
        want = miles_prompt_ids(renderer, sample)
        if ids != want:
            raise RuntimeError(
                f"TRL would tokenise prompt {prompt!r} as {ids}, Miles as {want}; the benchmark would not compare "
                "the same inputs"
            )


def drop_gguf_marker(model: Any) -> None:
    """Clear the GGUF quantization marker of a converted GGUF checkpoint, whose weights are dense float32.

    ``miles prepare`` saves the dequantized model with the GGUF file's config, ``quantization_config``
    (``quant_method: gguf``) included, so transformers loads it with a no-op GGUF quantizer and
    ``is_quantized`` set, and the HF ``Trainer`` under TRL refuses to train "a GGUF-quantized model". Miles'
    trainer does not look at the flag. Cleared only when every parameter is a plain float32 tensor (nothing
    was left in GGUF blocks), so the model TRL trains is the one Miles trains."""
    import torch

    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or str(getattr(method, "value", method)).lower() != "gguf":
        return
    if not all(p.dtype == torch.float32 for p in model.parameters()):
        raise ValueError("the GGUF checkpoint holds quantized blocks; the benchmark trains dense float32 weights")
    quantizer.remove_quantization_config(model)
    _log("converted GGUF checkpoint: cleared its quantization marker (the weights are dense float32)")


class Progress(TrainerCallback):
    """Step times, the held-out evaluations on Miles' schedule, and the wall-clock cap.

    Clocks: ``train_s`` is wall time since training began minus the time spent in evaluations; the CPU of
    training is this process's CPU time since training began minus the evaluations' CPU (TRL runs in one
    process, so that is all of it).
    """

    def __init__(self, evaluate: Any, every: int, max_train_s: float | None) -> None:
        self.evaluate_fn = evaluate
        self.every = every
        self.max_train_s = max_train_s
        self.last = 0.0
        self.step_s: list[float] = []
        self.logs: list[dict[str, float]] = []
        self.evals: list[dict[str, Any]] = []
        self.eval_s = 0.0
        self.eval_cpu_s = 0.0
        self.stopped_by_cap = False
        self.t0 = self.cpu0 = self.epoch0 = self.epoch_last_step = 0.0

    def train_s(self, now: float) -> float:
        return now - self.t0 - self.eval_s

    def train_cpu_s(self) -> float:
        return time.process_time() - self.cpu0 - self.eval_cpu_s

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.t0 = self.last = time.perf_counter()
        self.cpu0 = time.process_time()
        self.epoch0 = self.epoch_last_step = time.time()

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        now = time.perf_counter()
        self.epoch_last_step = time.time()
        self.step_s.append(now - self.last)
        step = int(state.global_step)
        last = step >= state.max_steps
        if self.max_train_s is not None and not last and self.train_s(now) + self.step_s[-1] > self.max_train_s:
            control.should_training_stop = True  # the next step would end past the cap
            self.stopped_by_cap = last = True
        if last or (self.every and step % self.every == 0):
            self.record(model, step, now)
        self.last = time.perf_counter()  # the next step's time starts after the evaluation

    def record(self, model: Any, step: int, now: float) -> None:
        train_s, cpu = self.train_s(now), self.train_cpu_s()
        t, c = time.perf_counter(), time.process_time()
        accuracy = self.evaluate_fn(model, step)
        eval_s = time.perf_counter() - t
        self.eval_s += eval_s
        self.eval_cpu_s += time.process_time() - c
        self.evals.append(
            {
                "step": step,
                "accuracy": accuracy,
                "train_s": round(train_s, 3),
                "wall_s": round(now - self.t0, 3),  # since training began, earlier evaluations included
                "time": round(time.time() - eval_s, 3),  # epoch seconds when the evaluation began
                "eval_s": round(eval_s, 3),
                "cpu_s": round(cpu, 3),
                "cpu_s_per_step": round(cpu / step, 4) if step else None,
            }
        )
        _log("eval", step=step, accuracy=accuracy, train_s=round(train_s, 1), eval_s=round(eval_s, 1))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs:
            self.logs.append({"step": state.global_step, **{k: v for k, v in logs.items() if _is_num(v)}})
            if "reward" in logs:
                _log(
                    "step",
                    step=state.global_step,
                    reward=round(logs["reward"], 3),
                    step_s=round(self.step_s[-1], 3) if self.step_s else None,
                )


def run(cfg: RunConfig, threads: int | None, max_train_s: float | None = None) -> dict[str, Any]:
    """Train with TRL under ``cfg``'s budget; return the result dict (see the module docstring)."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from miles.models.loading import load_policy
    from miles.prepare import prepare_model

    model_dir = prepare_model(cfg)
    _log("model", dir=str(model_dir))
    default_threads = torch.get_num_threads()
    evaluator = HeldOutEval(cfg, model_dir)
    torch.set_num_threads(threads or default_threads)  # build_engine set the engine's count
    threads = torch.get_num_threads()

    task = evaluator.task
    train = task.samples("train")
    model, tokenizer = load_policy(model_dir, "float32", "cpu")
    drop_gguf_marker(model)
    # Miles' stop tokens: TRL stops generate() at, and cuts each completion after, generation_config's eos ids.
    model.generation_config.eos_token_id = list(evaluator.stop_token_ids)

    prompts = [trl_prompt(tokenizer, s, task.render) for s in train]
    check_prompt_tokenisation(evaluator.renderer, prompts, train)
    dataset = Dataset.from_dict({"prompt": prompts, "sample_index": list(range(len(train)))})

    rewards_seen: list[float] = []

    def reward(completion_ids: list[list[int]], sample_index: list[int], **_: Any) -> list[float]:
        """Miles' task reward on each completion, decoded as the Miles rollout worker decodes it."""
        texts = [evaluator.renderer.decode(ids) for ids in completion_ids]
        values = [float(task.reward(t, train[i])) for t, i in zip(texts, sample_index, strict=True)]
        rewards_seen.extend(values)
        return values

    reward.__name__ = "task_reward"

    def evaluate(trained: Any, step: int) -> float:
        accuracy = evaluator.score(trained, step)
        torch.set_num_threads(threads)
        return accuracy

    progress = Progress(evaluate, cfg.eval.every, max_train_s)
    with tempfile.TemporaryDirectory(prefix="miles-trl-") as out_dir:
        kwargs = grpo_config_kwargs(cfg, out_dir)
        try:
            args = GRPOConfig(**kwargs)
        except TypeError as exc:  # a field this trl version lacks: fail, rather than silently misalign
            raise RuntimeError(f"trl {trl.__version__} cannot express this recipe: {exc}") from None
        expected = {prompt_key(p): miles_prompt_ids(evaluator.renderer, s) for p, s in zip(prompts, train, strict=True)}
        checked = [0]

        class CheckedGRPOTrainer(GRPOTrainer):
            """Asserts, on every generation batch, that the prompt ids TRL generates from are Miles' ids."""

            def _tokenize_prompts(self, prompts: list) -> Any:  # private in TRL: checked to have been called below
                out = super()._tokenize_prompts(prompts)
                for prompt, ids in zip(prompts, out[0], strict=True):
                    want = expected[prompt_key(prompt)]
                    if list(ids) != want:
                        raise RuntimeError(f"TRL generated from {list(ids)} for {prompt!r}, Miles uses {want}")
                checked[0] += len(prompts)
                return out

        transformers.set_seed(cfg.trainer.seed)  # before peft draws the adapters' initial A matrices
        trainer = CheckedGRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[progress],
            peft_config=peft_lora_config(cfg),
        )
        # Built on the trainer's model: with LoRA, TRL wraps the model in __init__ and only the adapters train.
        trainer.optimizer, trainer.lr_scheduler = optimizer_and_schedule(cfg, trainer.model)
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        t_eval = time.perf_counter()
        eval_before = evaluator.score(trainer.model, 0)
        torch.set_num_threads(threads)
        before_s = time.perf_counter() - t_eval
        _log("eval before", accuracy=eval_before, eval_s=round(before_s, 2))
        _log(
            "train",
            steps=cfg.trainer.steps,
            completions_per_step=cfg.trainer.groups_per_step * cfg.rollout.group_size,
            threads=torch.get_num_threads(),
            trainable_params=trainable,
            max_train_s=max_train_s,
        )
        t_train = time.perf_counter()
        trainer.train()
        train_wall_s = time.perf_counter() - t_train
        train_cpu_s = progress.train_cpu_s()  # the evaluations' CPU taken off
        trained = trainer.accelerator.unwrap_model(trainer.model)
        steps_done = int(trainer.state.global_step)
    if not checked[0]:
        _log(
            f"warning: trl {trl.__version__} never called _tokenize_prompts; prompt ids were checked before "
            "training only"
        )
    evals = [
        {"step": 0, "accuracy": eval_before, "train_s": 0.0, "wall_s": 0.0, "eval_s": round(before_s, 3)},
        *progress.evals,
    ]
    eval_after = progress.evals[-1]["accuracy"] if progress.evals else evaluator.score(trained, steps_done)
    eval_after_fp32 = evaluator.score(trained, steps_done, "float32")
    _log("eval after", accuracy=eval_after, fp32=eval_after_fp32)
    # Step 1 on, like Miles' cadence (which has no interval before its first step): the first step also pays
    # the trainer's first-call set-up. The whole list, first step included, is step_s_all.
    step_s = progress.step_s[1:]
    return {
        "framework": "trl",
        "eval_before": eval_before,
        "eval_after": eval_after,
        "eval_after_fp32": eval_after_fp32,
        "evals": evals,
        "steps": steps_done,
        "stopped_by_cap": progress.stopped_by_cap,
        "max_train_s": max_train_s,
        "wall_s": round(time.perf_counter() - _T0, 2),
        "train_s": round(train_wall_s - progress.eval_s, 3),  # training clock: evaluations taken off
        "train_wall_s": round(train_wall_s, 3),
        "eval_s_in_training": round(progress.eval_s, 3),
        "train_begin_time": progress.epoch0,
        "train_end_time": progress.epoch_last_step,
        "train_cpu_s": round(train_cpu_s, 3),
        "train_cpu_s_per_step": round(train_cpu_s / steps_done, 4) if steps_done else None,
        "step_s_mean": statistics.fmean(step_s) if step_s else None,
        "step_s_median": statistics.median(step_s) if step_s else None,
        "step_s": [round(s, 4) for s in step_s],
        "step_s_first": round(progress.step_s[0], 4) if progress.step_s else None,
        "samples": len(rewards_seen),
        "prompts_checked_in_flight": checked[0],
        "prompt_render": task.render,
        "stop_token_ids": list(evaluator.stop_token_ids),
        "lora": None if cfg.trainer.lora is None else {**cfg.trainer.lora.model_dump(), "trainable_params": trainable},
        "reward_mean": statistics.fmean(rewards_seen) if rewards_seen else None,
        "threads": {
            "processes": 1,
            "torch_intra_op": threads,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
        },
        "eval_samples": len(evaluator.samples),
        "eval_max_new_tokens": evaluator.max_new_tokens,
        "eval_weights_dtype": cfg.sync.dtype,
        "eval_every": cfg.eval.every,
        "grpo_config": {k: v for k, v in kwargs.items() if k != "output_dir"},
        "log_history": progress.logs,
        "not_aligned": list(NOT_ALIGNED),
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }


def _is_num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True, help="Miles recipe, e.g. recipes/quickstart.yaml.")
    add_override_option(p)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads while training (default: the recipe's trainer.backend.threads).",
    )
    p.add_argument(
        "--max-wall-s",
        type=float,
        default=1200.0,
        help="Cap on the training clock (wall seconds of training, evaluations not counted): no step is started "
        "that would end past it (default 1200; 0: no cap).",
    )
    p.add_argument("--out", help="Write the result JSON here (it is always printed on stdout).")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as exc:
        print(f"trl_grpo: error: {exc}", file=sys.stderr)
        return 2
    threads = args.threads
    if threads is None and isinstance(cfg.trainer.backend, FsdpBackendConfig):
        threads = cfg.trainer.backend.threads
    try:
        # Libraries print progress (transformers' PrinterCallback, loading bars) on stdout: keep stdout for the JSON.
        with contextlib.redirect_stdout(sys.stderr):
            result = run(cfg, threads, args.max_wall_s or None)
    except (ValueError, RuntimeError) as exc:
        print(f"trl_grpo: error: {exc}", file=sys.stderr)
        return 1
    result["recipe"] = args.recipe
    result["overrides"] = args.overrides
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
