"""TRL ``GRPOTrainer`` on a Miles recipe's model, task and sample budget: the baseline of the Miles-vs-TRL benchmark.

    python benchmarks/trl_grpo.py --recipe recipes/quickstart.yaml --out benchmarks/results/trl_grpo.json
    python benchmarks/trl_grpo.py --recipe recipes/quickstart.yaml --set trainer.steps=3   # quick check

Usually run by ``benchmarks/miles_vs_trl.py`` in its own process (so that it shares no torch thread
state with the Miles run); it can be run alone. It needs the ``benchmark`` extra (``trl``, ``datasets``).

What is aligned with Miles, and how (so that the comparison measures the frameworks, not the settings):

* the model is the very checkpoint Miles trains (``prepare_model``: the cached tiny model, or the
  pretrained path), loaded with Miles' own ``load_policy`` in float32;
* prompts are the task's train split, tokenised exactly like a Miles rollout worker (the task's
  ``raw`` render of the single-turn environment's user message: BOS + the prompt's tokens, nothing
  appended). TRL's plain-text path calls ``tokenizer(text=...)``, which for the tiny character
  tokenizer adds no BOS, so the dataset prompt is ``bos_token + prompt``; every train prompt is checked
  to tokenise to the worker's ids before training starts and again on every generation batch, and the
  run aborts otherwise. A plain string ``prompt`` column is TRL's non-conversational path, so no chat
  template is applied (the tiny tokenizer has none anyway);
* the reward is ``task.reward`` on the completion decoded with ``skip_special_tokens=True`` (as the
  Miles rollout worker decodes it), looked up by a ``sample_index`` column;
* budget: ``trainer.steps`` optimizer steps, each on ``groups_per_step`` prompts x ``group_size``
  completions of at most ``max_new_tokens`` tokens, sampled at the recipe's temperature / top-p, one
  optimizer step per generation batch (``num_iterations=1``), no reference model when ``kl_coef == 0``;
* optimizer: ``torch.optim.AdamW`` over all parameters with the recipe's lr / betas / weight decay, as
  Miles' FSDP backend builds it, passed to the trainer with a ``LambdaLR`` that follows Miles' own
  ``lr_at`` step for step (warm-up, cosine or linear decay to ``min_lr_ratio``), the same global
  grad-norm clip, PPO-clip with ``epsilon=clip_low``, ``epsilon_high=clip_high``; the loss is averaged
  over all completion tokens of the batch (TRL ``loss_type="dapo"`` == Miles ``aggregation: token``);
* fp32 on CPU, no bf16, no gradient checkpointing (TRL's default is on), no vLLM, no reporting;
* held-out accuracy is measured by :class:`HeldOutEval`: Miles' own evaluation as a rollout worker plays
  it (:func:`miles.rollout.evaluate.evaluate`, greedy, the eval split up to ``eval.max_samples``,
  ``max_new_tokens``, a ``rollout.engine`` engine, the same renderer, environment and reward), on the
  weights rounded to ``sync.dtype`` exactly as the Miles trainer publishes them and a worker decodes them
  (``to_rollout_state`` then ``EngineWeights``), before and after training, so both frameworks are scored
  by the same code. ``eval_after_fp32`` is the same on the unrounded weights.

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
    "for a group of 8 TRL's advantages are sqrt(7/8)=0.935x Miles' (same sign and ranking)",
    "scheduling: TRL is synchronous (generate, then train, on the same process); Miles generates on "
    "rollout.workers processes concurrently with training, on weights up to staleness.max_staleness versions old",
    "behaviour weights: TRL samples from its fp32 training weights; Miles workers sample from weights rounded "
    "to sync.dtype (the evaluator scores both frameworks' final weights rounded the same way)",
    "sampling: TRL uses transformers' model.generate (its own RNG stream and logits processors); Miles uses its "
    "TorchEngine loop, so the sampled completions differ even from the same seed",
    "off-policy correction: both take the PPO ratio against the pre-update (proximal) policy of the same step, so it "
    "is 1 in both with one optimizer step per batch; Miles (trainer.algo.off_policy: decoupled_ppo) also weights "
    "each token by min(pi_prox / pi_behaviour, clip) for its stale, bf16-sampled trajectories, TRL has nothing to "
    "correct",
    "side work: Miles writes a sharded checkpoint every trainer.checkpoint_every steps and its rollout workers play "
    "a held-out evaluation every eval.every versions while training goes on; TRL saves nothing (save_strategy=no) "
    "and evaluates only before and after, outside its step times",
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
    advantage, several optimizer steps per rollout batch, a chat-rendered task).
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
    """Miles' optimizer and learning-rate curve for TRL's ``optimizers=``: ``torch.optim.AdamW`` over every
    parameter with the recipe's lr / betas / weight decay (as ``FsdpBackend`` builds it), and a ``LambdaLR``
    whose factor at optimizer step ``s`` is ``lr_at(trainer, s) / lr``: the same warm-up and cosine/linear decay,
    step for step (HF's own cosine schedule starts its warm-up at 0 and decays to 0, not to ``min_lr_ratio``)."""
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


class HeldOutEval:
    """Miles' held-out evaluation, as a rollout worker plays an evaluation shard, for a model TRL trained.

    Same samples (``task.samples("eval")[: eval.max_samples]``), same ``max_new_tokens`` (``eval`` or
    ``rollout.sampling``), greedy episodes through :func:`miles.rollout.evaluate.evaluate` on a
    ``rollout.engine`` engine (same renderer, environment, reward and episode limits); the weights reach the
    engine the way a worker gets them: :func:`~miles.sync.precision.to_rollout_state` at ``sync.dtype`` (what
    the trainer publishes), decoded by :class:`~miles.sync.engine_weights.EngineWeights`.
    """

    def __init__(self, cfg: RunConfig, model_dir: Any) -> None:
        from miles.engines.base import SamplingParams
        from miles.engines.registry import build_engine
        from miles.models.loading import load_tokenizer, stop_token_ids
        from miles.rollout.episode import EpisodeLimits
        from miles.rollout.render import Renderer
        from miles.tasks.registry import build_task

        self.cfg = cfg
        self.task = build_task(cfg.task)
        self.samples = self.task.samples("eval")[: cfg.eval.max_samples]
        self.max_new_tokens = cfg.eval.max_new_tokens or cfg.rollout.sampling.max_new_tokens
        # note: build_engine applies rollout.engine.threads to this process (the caller sets its own after)
        self.engine = build_engine(cfg.rollout.engine, model_dir, 0, cfg.seed)
        tokenizer = load_tokenizer(model_dir)
        self.renderer = Renderer(tokenizer, self.task.render)
        self.params = SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=cfg.rollout.sampling.temperature,  # evaluate() plays greedily whatever this says
            top_p=cfg.rollout.sampling.top_p,
            stop_token_ids=stop_token_ids(tokenizer),
        )
        episode = cfg.rollout.episode
        self.limits = EpisodeLimits(
            max_turns=episode.max_turns,
            max_tokens=episode.max_tokens,
            timeout_s=episode.timeout_s,
            reward_timeout_s=episode.reward_timeout_s,
            check_template=episode.check_template,
        )

    def score(self, model: Any, version: int, precision: str | None = None) -> float:
        """Greedy held-out accuracy of ``model``'s weights rounded to ``precision`` (default ``sync.dtype``)."""
        import asyncio

        from miles.rollout.evaluate import evaluate
        from miles.sync.engine_weights import EngineWeights
        from miles.sync.precision import to_rollout_state

        precision = precision or self.cfg.sync.dtype
        state = {name: t.detach().to("cpu") for name, t in model.state_dict().items()}
        published = to_rollout_state(state, precision)
        weights, complete = EngineWeights(self.engine.model.state_dict, precision=precision).decode(published)
        self.engine.load_weights(weights, version, complete=complete)

        async def play() -> Any:
            async with self.engine:
                return await evaluate(self.engine, self.renderer, self.task, self.samples, self.params, self.limits)

        outcome = asyncio.run(play())
        if outcome.failed or outcome.infra:
            raise RuntimeError(f"held-out evaluation: {outcome.failed} reward failures, {outcome.infra} infra errors")
        return outcome.accuracy


def miles_prompt_ids(renderer: Any, prompt: str) -> list[int]:
    """The prompt ids a Miles rollout worker generates from: the renderer's opening render of the single-turn
    environment's one user message."""
    return renderer.initial([{"role": "user", "content": prompt}])


def check_prompt_tokenisation(renderer: Any, dataset_prompts: list[str], task_prompts: list[str]) -> None:
    """Fail unless TRL's call (``tokenizer(text=...)``) gives exactly Miles' prompt ids for every prompt."""
    got = renderer.tokenizer(text=dataset_prompts)["input_ids"]
    for text, ids, original in zip(dataset_prompts, got, task_prompts, strict=True):
        want = miles_prompt_ids(renderer, original)
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
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from miles.models.loading import load_policy
    from miles.prepare import prepare_model

    model_dir = prepare_model(cfg)
    _log("model", dir=str(model_dir))
    evaluator = HeldOutEval(cfg, model_dir)
    if threads is not None:
        torch.set_num_threads(threads)

    task = evaluator.task
    if task.render != "raw":
        raise ValueError(f"task renders its prompts with a chat template ({task.render!r}); the benchmark is raw only")
    train = task.samples("train")
    model, tokenizer = load_policy(model_dir, "float32", "cpu")
    t_eval = time.perf_counter()
    eval_before = evaluator.score(model, 0)
    _log("eval before", accuracy=eval_before, eval_s=round(time.perf_counter() - t_eval, 2))

    prompts = [trl_prompt(tokenizer, s.prompt) for s in train]
    check_prompt_tokenisation(evaluator.renderer, prompts, [s.prompt for s in train])
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
        expected = {
            text: miles_prompt_ids(evaluator.renderer, s.prompt) for text, s in zip(prompts, train, strict=True)
        }
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
            optimizers=optimizer_and_schedule(cfg, model),
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

    eval_after = evaluator.score(trained, steps_done)
    eval_after_fp32 = evaluator.score(trained, steps_done, "float32")
    _log("eval after", accuracy=eval_after, fp32=eval_after_fp32)
    # Step 1 on, like Miles' cadence (which has no interval before its first step): the first step also pays
    # the trainer's first-call set-up. The whole list, first step included, is step_s_all.
    step_s = clock.step_s[1:]
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
        "step_s_first": round(clock.step_s[0], 4) if clock.step_s else None,
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
