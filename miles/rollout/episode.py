"""Running one episode: model turns from the engine, environment turns from the environment, tokens exact.

:func:`run_episode` is the only place where an episode's token sequence is built. It keeps every model
turn as sampled (ids, behaviour log-probs, version spans), appends environment turns once, tokenised by
the :class:`~miles.rollout.render.Renderer`, marks them with loss mask 0, and enforces the episode's
limits: turns, total tokens, the model's context window, and wall-clock time (generation and environment
together; the reward gets its own budget). Failures are classified, never raised past the episode:

* the environment (or its sandbox) raises :class:`~miles.rollout.env.InfraError` -> ``infra_error``;
* the reward raises, returns None, a non-finite number or one outside the task's ``reward_range`` ->
  ``reward_failed`` (logged with the sample id);
* any other exception from the environment's ``step`` -> the episode ends with ``env_error`` and is scored.

Engine failures (:class:`~miles.engines.base.EngineError`) are not the episode's: they propagate and fail
the worker loudly.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import time
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from miles.bus.schema import Episode
from miles.engines.base import Engine, Generation, SamplingParams
from miles.rollout.env import ChatMessage, EndReason, Environment, InfraError
from miles.rollout.render import Renderer

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class EpisodeLimits:
    max_turns: int = 1
    max_tokens: int | None = None  # tokens after the prompt, model and environment turns together
    timeout_s: float | None = None  # wall clock for turns and environment steps
    reward_timeout_s: float | None = None
    check_template: bool = True
    reward_range: tuple[float, float] | None = None  # task.reward_range: what the trainer will believe


@dataclass(slots=True)
class _Builder:
    """The growing token sequence of one episode."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[tuple[int, int, str]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)

    def model_turn(self, gen: Generation) -> None:
        start = len(self.token_ids)
        for offset, version in gen.version_spans:
            if not self.spans or version != self.spans[-1][1]:
                self.spans.append((start + offset, version))
        self.token_ids += gen.output_ids
        self.loss_mask += [1] * len(gen.output_ids)
        self.logprobs += gen.logprobs
        self.turns.append((start, len(self.token_ids), "model"))

    def env_turn(self, ids: list[int]) -> None:
        if not ids:
            return
        start = len(self.token_ids)
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.turns.append((start, len(self.token_ids), "env"))

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.token_ids


async def run_episode(
    engine: Engine,
    renderer: Renderer,
    env: Environment,
    params: SamplingParams,
    limits: EpisodeLimits,
    *,
    sample_id: str = "",
) -> Episode:
    """Play one episode to its end and score it; the environment is closed in every case."""
    start = time.monotonic()
    stats: dict[str, float] = {"turns": 0.0, "gen_s": 0.0, "env_s": 0.0, "template_mismatches": 0.0}
    builder: _Builder | None = None
    end: EndReason = "max_turns"
    truncated = False
    status = "ok"
    error = ""
    reward: float | None = None
    try:
        try:
            # One deadline for generation and environment together (one timer per episode, not one task per await).
            async with asyncio.timeout(limits.timeout_s):
                messages: list[ChatMessage] = list(await env.reset())
                builder = _Builder(renderer.initial(messages))
                for _ in range(limits.max_turns):
                    room = engine.max_context - len(builder.context)
                    if limits.max_tokens is not None:
                        room = min(room, limits.max_tokens - len(builder.token_ids))
                    if room <= 0:
                        end = "context_full"
                        break
                    turn_params = params if room >= params.max_new_tokens else replace(params, max_new_tokens=room)
                    t0 = time.monotonic()
                    gen = await engine.generate(builder.context, turn_params)
                    stats["gen_s"] += time.monotonic() - t0
                    stats["turns"] += 1
                    builder.model_turn(gen)
                    truncated = gen.finish_reason == "length"
                    if gen.finish_reason == "context":
                        end = "context_full"
                        break
                    text = renderer.decode(gen.output_ids)
                    messages.append({"role": "assistant", "content": text})
                    t0 = time.monotonic()
                    try:
                        step = await env.step(text)
                    except (InfraError, TimeoutError):
                        raise
                    except Exception as exc:  # the environment broke on this action: the episode ends, scored
                        log.warning("episode_env_error", sample=sample_id, error=f"{type(exc).__name__}: {exc}")
                        end, error = "env_error", f"{type(exc).__name__}: {exc}"[:2000]
                        break
                    finally:
                        stats["env_s"] += time.monotonic() - t0
                    for key, value in step.info.items():
                        stats[key] = stats.get(key, 0.0) + float(value)
                    if step.done:
                        end = step.end_reason or "done"
                        break
                    suffix = renderer.environment_turn(gen.output_ids, step.messages)
                    over_budget = (
                        limits.max_tokens is not None and len(builder.token_ids) + len(suffix) >= limits.max_tokens
                    )
                    if over_budget or len(builder.context) + len(suffix) >= engine.max_context:
                        end = "context_full"  # the environment's answer does not fit: no room for another turn
                        break
                    builder.env_turn(suffix)
                    messages.extend(step.messages)
                    if limits.check_template and not renderer.check_prefix(messages, builder.context):
                        stats["template_mismatches"] += 1
        except TimeoutError:
            end = "timeout"
        if builder is None:
            raise InfraError("the environment timed out before the episode started")
        reward, status, error = await _score(env, limits, sample_id, error)
    except InfraError as exc:
        log.warning("episode_infra_error", sample=sample_id, error=str(exc))
        end, status, reward, error = "infra_error", "infra_error", None, str(exc)[:2000]
    finally:
        await env.close()
    if builder is None:  # the environment failed before the first render
        builder = _Builder([0])
    stats["wall_s"] = time.monotonic() - start
    stats["model_tokens"] = float(sum(builder.loss_mask))
    stats["env_tokens"] = float(len(builder.loss_mask) - sum(builder.loss_mask))
    versions = builder.spans or [(0, engine.version)]
    return Episode(
        prompt_ids=builder.prompt_ids,
        token_ids=builder.token_ids,
        loss_mask=builder.loss_mask,
        logprobs=builder.logprobs,
        turns=builder.turns,  # type: ignore[arg-type]
        weight_version=versions[0][1],
        version_spans=versions if builder.token_ids else [],
        reward=reward,
        status=status,  # type: ignore[arg-type]
        end_reason=end,
        truncated=truncated,
        error=error,
        stats=stats,
    )


async def _score(env: Environment, limits: EpisodeLimits, sample_id: str, error: str) -> tuple[Any, str, str]:
    """``(reward, status, error)``: a reward that raises, times out or is not a finite number fails the sample."""
    try:
        async with asyncio.timeout(limits.reward_timeout_s):
            value = await env.reward()
    except InfraError:
        raise
    except TimeoutError:
        why = f"reward timed out after {limits.reward_timeout_s} s"
        log.warning("reward_failed", sample=sample_id, error=why)
        return None, "reward_failed", why
    except Exception as exc:
        why = f"reward raised {type(exc).__name__}: {exc}"[:2000]
        log.warning("reward_failed", sample=sample_id, error=why)
        return None, "reward_failed", why
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        why = f"reward returned {value!r}, not a finite number"
        log.warning("reward_failed", sample=sample_id, error=why)
        return None, "reward_failed", why
    bounds = limits.reward_range
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        # The trainer would refuse it as a dishonest worker's: fail the sample here, where the cause is visible.
        why = f"reward returned {value!r}, outside task.reward_range {list(bounds)}"
        log.warning("reward_failed", sample=sample_id, error=why)
        return None, "reward_failed", why
    return float(value), "ok", error
