"""TRL ``GRPOTrainer`` on a Miles recipe's model, task and sample budget: the baseline of the Miles-vs-TRL benchmark.

    python benchmarks/trl_grpo.py --recipe recipes/quickstart.yaml --out benchmarks/results/trl_grpo.json
    python benchmarks/trl_grpo.py --recipe recipes/quickstart.yaml --set trainer.steps=3   # quick check

Usually run by ``benchmarks/miles_vs_trl.py`` in its own process (so that it shares no torch thread
state with the Miles run); it can be run alone. It needs the ``benchmark`` extra (``trl``, ``datasets``).

What is aligned with Miles, and how (so that the comparison measures the frameworks, not the settings):

* the model is the very checkpoint Miles trains (``prepare_model``: the cached tiny model, or the
  pretrained path), loaded with Miles' own ``load_policy`` in float32;
* prompts are the task's train split, tokenised exactly like Miles (``encode_prompt``: BOS + the
  prompt's tokens, nothing appended). TRL's plain-text path calls ``tokenizer(text=...)``, which for the
  tiny character tokenizer adds no BOS, so the dataset prompt is ``bos_token + prompt``; every train
  prompt is checked to tokenise to the same ids as ``encode_prompt`` before training starts, and the
  run aborts otherwise. A plain string ``prompt`` column is TRL's non-conversational path, so no chat
  template is applied (the tiny tokenizer has none anyway);
* the reward is ``task.reward`` on the completion decoded with ``skip_special_tokens=True`` (as the
  Miles rollout worker decodes it), looked up by a ``sample_index`` column;
* budget: ``trainer.steps`` optimizer steps, each on ``groups_per_step`` prompts x ``group_size``
  completions of at most ``max_new_tokens`` tokens, sampled at the recipe's temperature / top-p, one
  optimizer step per generation batch (``num_iterations=1``), no reference model when ``kl_coef == 0``;
* optimizer: AdamW with the recipe's lr / betas / weight decay, constant schedule, the same global
  grad-norm clip, PPO-clip with ``epsilon=clip_low``, ``epsilon_high=clip_high``; the loss is averaged
  over all completion tokens of the batch (TRL ``loss_type="dapo"`` == Miles ``aggregation: token``);
* fp32 on CPU, no bf16, no gradient checkpointing (TRL's default is on), no vLLM, no reporting;
* held-out accuracy is measured by Miles' own :class:`miles.actors.evaluator.Evaluator` (greedy, the
  eval split, ``max_new_tokens``, weights rounded to ``sync.dtype`` exactly as Miles scores its own
  published weights), before and after training, so both frameworks are scored by the same code.

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

from miles.config import ConfigError, FsdpBackendConfig, RunConfig, add_override_option, load_config  # noqa: E402

# Behaviour of TRL's GRPOTrainer that no GRPOConfig field aligns with Miles (checked against trl 1.16).
NOT_ALIGNED: tuple[str, ...] = (
    "advantage std: TRL divides by the Bessel-corrected (sample) std + 1e-4, Miles by the population std + 1e-6; "
    "for a group of 8 TRL's advantages are sqrt(7/8)=0.935x Miles' (same sign and ranking)",
    "scheduling: TRL is synchronous (generate, then train, on the same process); Miles generates on "
    "rollout.workers processes concurrently with training, on weights up to staleness.max_staleness versions old",
    "behaviour weights: TRL samples from its fp32 training weights; Miles workers sample from weights rounded "
    "to sync.dtype (the evaluator scores both frameworks' final weights rounded the same way)",
    "sampling: TRL uses transformers' model.generate (its own RNG stream and logits processors); Miles uses its "
    "TorchEngine loop, so the sampled completions differ even from the same seed",
    "importance ratio: both take the ratio against the pre-update policy of the same step, so it is 1 in both "
    "with one optimizer step per batch; Miles' off-policy lag is not corrected in either",
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

    Raises ``ValueError`` for a recipe TRL cannot express (greedy training rollouts, a micro-batch
    size that does not divide the step's completions).
    """
    sampling = cfg.rollout.sampling
    if sampling.temperature == 0:
        raise ValueError("rollout.sampling.temperature=0 (greedy) gives GRPO groups no spread; TRL needs sampling")
    algo = cfg.trainer.algo
    completions_per_step = cfg.trainer.groups_per_step * cfg.rollout.group_size
    micro = completions_per_step
    if isinstance(cfg.trainer.backend, FsdpBackendConfig) and cfg.trainer.backend.micro_batch_size is not None:
        micro = cfg.trainer.backend.micro_batch_size
        if completions_per_step % micro:
            raise ValueError(
                f"trainer.backend.micro_batch_size ({micro}) must divide the completions of a step "
                f"({completions_per_step}) for TRL's gradient accumulation"
            )
    # Only when used: trl 1.0 had no entropy bonus (GRPOConfig rejects the key), and the default is off anyway.
    extra = {"entropy_coef": algo.entropy_coef} if algo.entropy_coef else {}
    return {
        **extra,
        "output_dir": output_dir,
        # budget: one generation batch of groups_per_step x group_size completions per optimizer step
        "max_steps": cfg.trainer.steps,
        "num_generations": cfg.rollout.group_size,
        "per_device_train_batch_size": micro,  # counts completions, not prompts, in TRL
        "gradient_accumulation_steps": completions_per_step // micro,
        "num_iterations": 1,
        "max_completion_length": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": 0,
        "mask_truncated_completions": False,  # Miles trains on truncated completions too
        # algorithm
        "loss_type": "dapo" if algo.aggregation == "token" else "grpo",
        "scale_rewards": "group" if algo.advantage == "grpo" else "none",
        "epsilon": algo.clip_low,
        "epsilon_high": algo.clip_high,
        "beta": algo.kl_coef,
        "use_bias_correction_kl": False,  # Miles' KL term is plain k3, not ratio-weighted
        "importance_sampling_level": "token",
        # optimizer
        "learning_rate": cfg.trainer.lr,
        "adam_beta1": cfg.trainer.betas[0],
        "adam_beta2": cfg.trainer.betas[1],
        "adam_epsilon": 1e-8,  # torch.optim.AdamW's default, which Miles uses
        "weight_decay": cfg.trainer.weight_decay,
        "max_grad_norm": cfg.trainer.grad_clip,
        "optim": "adamw_torch",
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
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


def check_prompt_tokenisation(tokenizer: Any, dataset_prompts: list[str], task_prompts: list[str]) -> None:
    """Fail unless TRL's call (``tokenizer(text=...)``) gives exactly Miles' ``encode_prompt`` ids for every prompt."""
    from miles.models.loading import encode_prompt

    got = tokenizer(text=dataset_prompts)["input_ids"]
    for text, ids, original in zip(dataset_prompts, got, task_prompts, strict=True):
        want = encode_prompt(tokenizer, original)
        if list(ids) != want:
            raise RuntimeError(
                f"TRL would tokenise prompt {text!r} as {list(ids)}, Miles as {want}; the benchmark would not compare "
                "the same inputs"
            )


def trl_prompt(tokenizer: Any, prompt: str) -> str:
    """The dataset text that TRL's ``tokenizer(text=...)`` turns into ``encode_prompt``'s ids.

    ``encode_prompt`` puts BOS first; tokenisers that do not add it themselves get it as text (an
    added special token, so it maps to the BOS id and nothing else).
    """
    plain = tokenizer(text=[prompt])["input_ids"][0]
    bos = tokenizer.bos_token_id
    if bos is None or (plain and plain[0] == bos):
        return prompt
    return f"{tokenizer.bos_token}{prompt}"


def run(cfg: RunConfig, threads: int | None) -> dict[str, Any]:
    """Train with TRL under ``cfg``'s budget; return the result dict (see the module docstring)."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from miles.actors.evaluator import Evaluator
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from miles.models.loading import encode_prompt, load_policy
    from miles.prepare import prepare_model
    from miles.tasks.registry import build_task

    model_dir = prepare_model(cfg)
    _log("model", dir=str(model_dir))
    evaluator = Evaluator.create(cfg)  # note: build_engine applies rollout.engine.threads to this process
    if threads is not None:
        torch.set_num_threads(threads)
    sync_dtype = getattr(torch, cfg.sync.dtype)

    def score(model: torch.nn.Module, version: int, dtype: torch.dtype) -> float:
        weights = {k: v.detach().to(device="cpu", dtype=dtype, copy=True) for k, v in model.state_dict().items()}
        accuracy, _ = evaluator.evaluate(weights, version)
        return accuracy

    task = build_task(cfg.task)
    train = task.samples("train")
    model, tokenizer = load_policy(model_dir, "float32", "cpu")
    t_eval = time.perf_counter()
    eval_before = score(model, 0, sync_dtype)
    _log("eval before", accuracy=eval_before, eval_s=round(time.perf_counter() - t_eval, 2))

    prompts = [trl_prompt(tokenizer, s.prompt) for s in train]
    check_prompt_tokenisation(tokenizer, prompts, [s.prompt for s in train])
    dataset = Dataset.from_dict({"prompt": prompts, "sample_index": list(range(len(train)))})

    rewards_seen: list[float] = []

    def reward(prompts: list[str], completions: list[str], sample_index: list[int], **_: Any) -> list[float]:
        """Miles' task reward on each decoded completion (TRL decodes with skip_special_tokens=True)."""
        values = [float(task.reward(c, train[i])) for c, i in zip(completions, sample_index, strict=True)]
        rewards_seen.extend(values)
        return values

    reward.__name__ = "task_reward"

    class StepClock(TrainerCallback):
        """Wall time of each optimizer step: generation + scoring + forward/backward + optimizer step."""

        def __init__(self) -> None:
            self.last = 0.0
            self.step_s: list[float] = []
            self.logs: list[dict[str, float]] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.last = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            self.step_s.append(now - self.last)
            self.last = now

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

    clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="miles-trl-") as out_dir:
        kwargs = grpo_config_kwargs(cfg, out_dir)
        try:
            args = GRPOConfig(**kwargs)
        except TypeError as exc:  # a field this trl version lacks: fail, rather than silently misalign
            raise RuntimeError(f"trl {trl.__version__} cannot express this recipe: {exc}") from None
        expected = {text: encode_prompt(tokenizer, s.prompt) for text, s in zip(prompts, train, strict=True)}
        checked = [0]

        class CheckedGRPOTrainer(GRPOTrainer):
            """Asserts, on every generation batch, that the prompt ids TRL generates from are Miles' ids."""

            def _tokenize_prompts(self, prompts: list) -> Any:  # private in TRL: checked to have been called below
                out = super()._tokenize_prompts(prompts)
                for text, ids in zip(prompts, out[0], strict=True):
                    if list(ids) != expected[text]:
                        raise RuntimeError(f"TRL generated from {list(ids)} for {text!r}, Miles uses {expected[text]}")
                checked[0] += len(prompts)
                return out

        trainer = CheckedGRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[clock],
        )
        _log(
            "train",
            steps=cfg.trainer.steps,
            completions_per_step=cfg.trainer.groups_per_step * cfg.rollout.group_size,
            threads=torch.get_num_threads(),
        )
        t_train = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t_train
        trained = trainer.accelerator.unwrap_model(trainer.model)
        steps_done = int(trainer.state.global_step)
    if not checked[0]:
        _log(
            f"warning: trl {trl.__version__} never called _tokenize_prompts; prompt ids were checked before "
            "training only"
        )

    eval_after = score(trained, steps_done, sync_dtype)
    eval_after_fp32 = score(trained, steps_done, torch.float32)
    _log("eval after", accuracy=eval_after, fp32=eval_after_fp32)
    step_s = clock.step_s
    samples = len(rewards_seen)
    return {
        "framework": "trl",
        "eval_before": eval_before,
        "eval_after": eval_after,
        "eval_after_fp32": eval_after_fp32,
        "steps": steps_done,
        "wall_s": round(time.perf_counter() - _T0, 2),
        "train_s": round(train_s, 3),
        "step_s_mean": statistics.fmean(step_s) if step_s else None,
        "step_s_median": statistics.median(step_s) if step_s else None,
        "step_s": [round(s, 4) for s in step_s],
        "samples": samples,
        "prompts_checked_in_flight": checked[0],
        "reward_mean": statistics.fmean(rewards_seen) if rewards_seen else None,
        "threads": {
            "processes": 1,
            "torch_intra_op": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
        },
        "eval_samples": len(evaluator.samples),
        "eval_max_new_tokens": evaluator.max_new_tokens,
        "eval_weights_dtype": cfg.sync.dtype,
        "grpo_config": {k: v for k, v in kwargs.items() if k != "output_dir"},
        "log_history": clock.logs,
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
            result = run(cfg, threads)
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
