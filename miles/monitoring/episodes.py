"""What a rollout worker's heartbeat counters say about its episodes (pure functions over ``Heartbeat.stats``).

Workers publish monotone totals (:mod:`miles.actors.rollout_stats`) so that any observer can derive means from
one heartbeat and rates from two. Agent-RL users read these to see whether the environment works: turns per
episode, tool calls and parse failures, time spent in the environment, sandbox (infrastructure) failures,
samples whose reward failed, truncations and how episodes ended.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

END_PREFIX = "end_"
# Totals summed over workers for the run-wide figures (per-episode means are taken after summing).
SUMMED = (
    "episodes",
    "model_tokens",
    "turns",
    "tool_calls",
    "parse_errors",
    "env_s",
    "infra_errors",
    "reward_failed",
    "truncated",
    "output_truncated",
    "commands_killed",
    "template_mismatches",
    "engine_load_failures",
)


def end_reasons(stats: Mapping[str, float]) -> dict[str, int]:
    """``{reason: episodes}`` from the ``end_<reason>`` counters, most frequent first."""
    found = {k[len(END_PREFIX) :]: int(v) for k, v in stats.items() if k.startswith(END_PREFIX)}
    return dict(sorted(found.items(), key=lambda kv: (-kv[1], kv[0])))


def episode_summary(stats: Mapping[str, float]) -> dict[str, Any]:
    """Counts and per-episode means of one worker's (or the summed) counters; means are None before an episode."""
    episodes = stats.get("episodes", 0.0)

    def per_episode(key: str, digits: int) -> float | None:
        return round(stats.get(key, 0.0) / episodes, digits) if episodes else None

    def count(key: str) -> int:
        return int(stats.get(key, 0.0))

    return {
        "episodes": int(episodes),
        "turns_per_episode": per_episode("turns", 3),
        "tool_calls": count("tool_calls"),
        "parse_errors": count("parse_errors"),
        "env_s_per_episode": per_episode("env_s", 3),
        "infra_errors": count("infra_errors"),
        "reward_failed": count("reward_failed"),
        "truncated": count("truncated"),
        "output_truncated": count("output_truncated"),
        "commands_killed": count("commands_killed"),
        "template_mismatches": count("template_mismatches"),
        "length_mean": per_episode("model_tokens", 2),
        "end_reasons": end_reasons(stats),
    }


def summed(all_stats: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The episode counters of several workers added up (``end_<reason>`` included)."""
    total: dict[str, float] = {}
    for stats in all_stats:
        for key, value in stats.items():
            if key in SUMMED or key.startswith(END_PREFIX):
                total[key] = total.get(key, 0.0) + value
    return total


def engine_flags(state: str, stats: Mapping[str, float]) -> dict[str, Any]:
    """Engine health: weight loads that failed, whether the engine is dead, and for an inference server the
    worker supervises (vLLM) whether it is up and how often it was restarted."""
    return {
        "engine_error": state == "engine_error" or stats.get("engine_error", 0.0) > 0,
        "engine_load_failures": int(stats.get("engine_load_failures", 0.0)),
        "engine_server_down": stats.get("engine_server_up", 1.0) == 0,
        "engine_restarts": int(stats.get("engine_restarts", 0.0)),
    }
