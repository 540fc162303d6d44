"""Preparation before launch: build the task and the model once, before NATS or any actor starts.

``miles run`` calls :func:`prepare` first, and ``miles prepare RECIPE`` runs it alone (on every machine of a
split run). Whatever can be wrong with a recipe's data is found here and reported in one line with exit 2:
a missing or malformed JSONL file, a reward import path that does not resolve, task folders that do not
load, a sandbox that cannot start, a model path that is not a checkpoint, a tokenizer without the chat
template a task needs. The tiny model's build and supervised warm-up happen here too, so actors only load
what was prepared (:func:`miles.models.loading.prepared_model_dir`) and never race to build it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from miles.config import RunConfig

log = structlog.get_logger(__name__)


class PrepareError(ValueError):
    """The recipe cannot run: the message names the field, file or path at fault (one line)."""


def prepare(cfg: RunConfig) -> Path:
    """Check the task and make the model ready; returns the model directory."""
    from miles.models.gguf import GgufError
    from miles.models.loading import ModelNotFoundError, load_tokenizer
    from miles.models.tokenizer_facts import tokenizer_facts
    from miles.rollout.render import Renderer, TemplateError
    from miles.sandbox.base import SandboxError
    from miles.tasks.jsonl import TaskError
    from miles.tasks.registry import build_task

    if cfg.trainer.backend.type == "megatron":
        from miles.backends.megatron import megatron_unavailable_reason

        reason = megatron_unavailable_reason(cfg)
        if reason is not None:
            raise PrepareError(reason)
    try:
        task = build_task(cfg.task, sandbox=cfg.rollout.sandbox)
        task.check()
    except (TaskError, SandboxError, ValueError) as exc:
        raise PrepareError(f"task: {exc}") from None
    try:
        model_dir = prepare_model(cfg, task)
        tokenizer = load_tokenizer(model_dir)
        Renderer(tokenizer, task.render)  # the tokenizer can render this task's episodes
        tokenizer_facts(model_dir, tokenizer)  # cached for the controller's run info (no transformers there)
    except (ModelNotFoundError, TemplateError, GgufError) as exc:
        raise PrepareError(f"model: {exc}") from None
    if cfg.trainer.algo.distill is not None:  # a missing teacher, or the student itself, is refused here
        from miles.training.teacher import TeacherError, check_teacher

        try:
            check_teacher(cfg.trainer.algo.distill.teacher.path, model_dir)
        except TeacherError as exc:
            raise PrepareError(str(exc)) from None
    prepare_engine(cfg)
    from miles.plugins import PluginError
    from miles.sync.receiver import check_transport

    try:
        check_transport(cfg.sync.transport)
    except PluginError as exc:
        raise PrepareError(f"sync.transport: {exc}") from None
    return model_dir


def prepare_engine(cfg: RunConfig) -> None:
    """A vLLM engine that the workers start themselves needs the vLLM environment: built here, once (cached)."""
    engine = cfg.rollout.engine
    if engine.type != "vllm" or engine.url or engine.python:
        return
    from miles.engines.vllm.env import VllmEnvError, ensure_vllm_env

    try:
        ensure_vllm_env()
    except VllmEnvError as exc:
        raise PrepareError(f"rollout.engine: {exc}") from None


def prepare_model(cfg: RunConfig, task: Any = None) -> Path:
    """The model directory of ``cfg.model``: a pretrained path checked (a GGUF file converted), the tiny model or
    a family's tiny twin built (cached)."""
    from miles.models.loading import family_dir, pretrained_dir
    from miles.models.tiny_cache import ensure_tiny_model, tiny_model_dir
    from miles.tasks.fingerprint import task_fingerprint
    from miles.tasks.registry import build_task

    if cfg.model.type == "family":
        return family_dir(cfg.model, build=True)  # a tiny twin is built (cached), a full-size path checked
    if cfg.model.type != "tiny":
        from miles.models.gguf import convert_gguf, is_gguf
        from miles.models.loading import model_path

        path = model_path(cfg.model.path)
        if is_gguf(path) and path.is_file():
            convert_gguf(path, cfg.model.cache_dir)  # once per machine: every process loads the conversion
        return pretrained_dir(cfg.model)
    task = task if task is not None else build_task(cfg.task, sandbox=cfg.rollout.sandbox)
    fingerprint = task_fingerprint(cfg.task)
    final = tiny_model_dir(cfg.model, fingerprint)
    return ensure_tiny_model(final, lambda out: _build_tiny(cfg, task, fingerprint, out))


def _build_tiny(cfg: RunConfig, task: Any, fingerprint: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    from miles.models.loading import stop_token_ids
    from miles.models.tiny import build_char_tokenizer, build_tiny_model_dir
    from miles.rollout.render import Renderer, demonstration_tokens, turn_end_token

    tokenizer = build_char_tokenizer()
    renderer = Renderer(tokenizer, task.render)
    stop_id = turn_end_token(renderer, stop_token_ids(tokenizer))
    examples = [demonstration_tokens(renderer, _demonstration(task, s), stop_id) for s in task.samples("train")]
    accuracy = _accuracy_fn(cfg, task, renderer, tokenizer)
    return build_tiny_model_dir(cfg.model, out_dir, examples, accuracy, fingerprint)


def _demonstration(task: Any, sample: Any) -> Any:
    """The warm-up conversation of ``sample``; a :class:`PrepareError` naming it when the task has none (a Harbor
    task of your own, a user's task whose ``demonstration`` raised)."""
    try:
        return task.demonstration(sample)
    except Exception as exc:  # the task's code (a user's); the run cannot start either way: one line, no traceback
        raise PrepareError(
            f"model: the tiny model is warmed up on the task's demonstrations; for sample {sample.id!r} "
            f"task.demonstration raised {type(exc).__name__}: {exc}"
        ) from None


def _accuracy_fn(cfg: RunConfig, task: Any, renderer: Any, tokenizer: Any) -> Callable[[Any], float]:
    """Greedy held-out accuracy of a model, measured with the episodes the workers play (same renderer,
    engine, environment and limits), to stop the warm-up at ``model.warmup_target_accuracy``."""
    from miles.engines.base import SamplingParams
    from miles.engines.torch_engine import TorchEngine
    from miles.models.loading import stop_token_ids
    from miles.rollout.episode import EpisodeLimits
    from miles.rollout.evaluate import evaluate

    samples = task.samples("eval")[: cfg.eval.max_samples]
    episode = cfg.rollout.episode
    limits = EpisodeLimits(
        max_turns=episode.max_turns,
        max_tokens=episode.max_tokens,
        timeout_s=episode.timeout_s,
        reward_timeout_s=episode.reward_timeout_s,
        reward_range=cfg.task.reward_range,
        check_template=False,
    )
    params = SamplingParams(
        max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.sampling.max_new_tokens,
        temperature=0.0,
        stop_token_ids=stop_token_ids(tokenizer),
    )

    def accuracy(model: Any) -> float:
        async def run() -> float:
            async with TorchEngine(model, tokenizer.pad_token_id) as engine:
                outcome = await evaluate(engine, renderer, task, samples, params, limits)
            return outcome.accuracy

        return asyncio.run(run())

    return accuracy
