"""A rollout worker's running counters (heartbeat ``stats``): episodes, tokens, turns and what went wrong.

Agent-RL users need to see these live: turns per episode, tool calls and parse failures, time in the
environment, sandbox (infrastructure) failures, samples whose reward failed, truncations, and how episodes
ended. Every value is a monotone total, so monitors derive rates and means from two heartbeats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.bus.schema import Trajectory

EPISODE_COUNTERS = ("tool_calls", "parse_errors", "env_s", "output_truncated", "commands_killed", "template_mismatches")


@dataclass(slots=True)
class RolloutStats:
    groups: int = 0
    episodes: int = 0
    tokens: int = 0
    model_tokens: int = 0
    turns: float = 0.0
    busy_s: float = 0.0
    infra_errors: int = 0
    reward_failed: int = 0
    truncated: int = 0
    evals: int = 0
    groups_held_for_eval: int = 0  # groups that waited for an evaluation's pinned weights (eval.hold_rollouts)
    counters: dict[str, float] = field(default_factory=dict)
    end_reasons: dict[str, int] = field(default_factory=dict)

    def add_group(self, traj: Trajectory) -> None:
        self.groups += 1
        self.busy_s += traj.gen_s
        for ep in traj.episodes:
            self.episodes += 1
            self.tokens += len(ep.token_ids)
            self.model_tokens += ep.num_model_tokens
            self.turns += ep.stats.get("turns", 0.0)
            self.infra_errors += ep.status == "infra_error"
            self.reward_failed += ep.status == "reward_failed"
            self.truncated += ep.truncated
            self.end_reasons[ep.end_reason] = self.end_reasons.get(ep.end_reason, 0) + 1
            for key in EPISODE_COUNTERS:
                if key in ep.stats:
                    self.counters[key] = self.counters.get(key, 0.0) + ep.stats[key]

    def as_dict(self) -> dict[str, float]:
        out = {
            "groups": float(self.groups),
            "episodes": float(self.episodes),
            "tokens": float(self.tokens),
            "model_tokens": float(self.model_tokens),
            "turns": self.turns,
            "busy_s": self.busy_s,
            "infra_errors": float(self.infra_errors),
            "reward_failed": float(self.reward_failed),
            "truncated": float(self.truncated),
            "evals": float(self.evals),
            "groups_held_for_eval": float(self.groups_held_for_eval),
        }
        out |= {key: value for key, value in self.counters.items()}
        out |= {f"end_{reason}": float(n) for reason, n in self.end_reasons.items()}
        return out
