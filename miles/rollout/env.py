"""The environment interface: an episode is a conversation between the policy and an environment.

The rollout worker's episode runner (:mod:`miles.rollout.episode`) owns the tokens; an environment only
ever sees and produces *text*:

1. ``messages = await env.reset()`` gives the opening conversation (system and user messages, e.g. a
   task's instruction). The runner renders it once with the tokenizer's chat template (or, for a raw
   single-turn task, as BOS + text).
2. The model's turn is sampled by the engine; its token ids and behaviour log-probs are kept exactly as
   sampled and never re-tokenised. The runner decodes them only to hand the text to the environment:
   ``step = await env.step(text)``.
3. ``step.messages`` (tool output, a user reply) are tokenised once and appended with loss mask 0, and the
   next model turn starts. ``step.done`` ends the episode with ``step.end_reason``.
4. After the episode ends (done, or a limit the runner enforces: max turns, episode timeout, a full
   context window), ``await env.reward()`` scores it (a verifier, an exact-match check), then
   ``await env.close()``.

Contract for implementations: every method is a coroutine that never blocks the event loop (run blocking
work with ``asyncio.to_thread``). An environment is used for one episode only.

Failures, and what they mean for training:

* :class:`InfraError` (from any method): the infrastructure failed (a sandbox did not start, the verifier
  crashed). The episode is marked ``infra_error``, excluded from its group's advantages and counted; it is
  never scored 0, which would bias the group's baseline.
* Any other exception from :meth:`Environment.reward`, or a reward that is None or not finite: the sample
  fails alone (``reward_failed``, counted, logged with the sample id, excluded from training).
* A malformed action (an unparsable tool call) is not an error: the environment answers it with an
  error observation and counts it in ``step.info["parse_errors"]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

# Why an episode ended (the runner sets the last three; an environment reports done or env_error).
EndReason = Literal["done", "max_turns", "timeout", "context_full", "env_error", "infra_error"]
END_REASONS: tuple[str, ...] = ("done", "max_turns", "timeout", "context_full", "env_error", "infra_error")

ChatMessage = dict[str, str]  # {"role": "system" | "user" | "assistant" | "tool", "content": "..."}


class InfraError(RuntimeError):
    """Infrastructure, not the agent, failed: the episode is excluded from training and counted."""


@dataclass(slots=True)
class EnvStep:
    """The environment's answer to one model turn.

    ``messages``: what to append before the next model turn (empty when ``done``). ``info``: counters
    summed over the episode, e.g. ``tool_calls``, ``parse_errors``, ``env_s`` (seconds spent in the
    environment, commands included), ``output_truncated``.
    """

    messages: list[ChatMessage] = field(default_factory=list)
    done: bool = False
    end_reason: EndReason | None = None  # when done: "done" or "env_error"
    info: dict[str, float] = field(default_factory=dict)


class Environment(Protocol):
    """One episode's environment (made fresh per episode by the task)."""

    async def reset(self) -> list[ChatMessage]:
        """The opening messages of the episode."""
        ...

    async def step(self, action: str) -> EnvStep:
        """React to the model's turn (its decoded text, special tokens removed)."""
        ...

    async def reward(self) -> float | None:
        """Score the finished episode (called once, after the last step or a limit)."""
        ...

    async def close(self) -> None:
        """Release what the episode held (a sandbox). Idempotent; called even after errors."""
        ...


@dataclass(frozen=True, slots=True)
class EpisodeSpec:
    """What a worker knows of one sample when it starts an episode: the prompt group's fields."""

    sample_id: str
    prompt: str
    answer: str
    meta: Mapping[str, Any]


class EnvironmentFactory(Protocol):
    """Makes the environment of one episode; a task provides one (``Task.environment``)."""

    def __call__(self, spec: EpisodeSpec) -> Environment: ...
