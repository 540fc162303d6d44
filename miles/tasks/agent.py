"""A black-box agent's task: JSONL samples, one :class:`~miles.rollout.agent_env.AgentEnv` per episode."""

from __future__ import annotations

from typing import Literal

from miles.config import AgentTaskConfig
from miles.plugins import import_callable
from miles.rollout.agent_env import AgentEnv
from miles.rollout.env import ChatMessage, EpisodeSpec
from miles.tasks.base import Sample
from miles.tasks.jsonl import JsonlSplits


class AgentTask:
    """``task.type: agent``: the agent at ``cfg.agent`` plays every episode through the worker's chat endpoint."""

    render: Literal["raw", "chat"] = "chat"

    def __init__(self, cfg: AgentTaskConfig) -> None:
        self.cfg = cfg
        self.agent = import_callable(cfg.agent, "task.agent")
        self._splits = JsonlSplits(cfg)

    def samples(self, split: str) -> list[Sample]:
        return self._splits.samples(split)

    def environment(self, spec: EpisodeSpec) -> AgentEnv:
        sample = Sample(id=spec.sample_id, prompt=spec.prompt, answer=spec.answer, meta=dict(spec.meta))
        return AgentEnv(self.agent, sample)

    def demonstration(self, sample: Sample) -> list[ChatMessage]:
        """For the tiny model's warm-up only: the prompt answered with the reference answer (an agent's own
        transcripts are not known)."""
        return [{"role": "user", "content": sample.prompt}, {"role": "assistant", "content": sample.answer}]

    def check(self) -> None:
        """Nothing to start: the agent runs in the worker's process."""
