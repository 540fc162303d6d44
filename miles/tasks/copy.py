"""Built-in task with long-tailed generation lengths: copy a digit string ("3141=" -> "3141").

String lengths are drawn from a log-normal (median ``median_len``, shape ``sigma``), rounded and
clipped to ``[min_len, max_len]``. At the defaults most completions are a handful of tokens while
the longest 1% are 10x the median: a batch that waits for its longest completion idles most of the
time, which is what asynchronous rollouts (``staleness.max_staleness > 0``) recover. With
``sigma: 0`` every string has the same length (a uniform-length control).

A tiny model learns to copy short strings quickly and long ones slowly, so after the warm-up it is
partly right and the reward (exact match) still has room to rise. Train and eval strings are
disjoint: eval accuracy measures copying, not memorised strings.

    python -m miles.tasks.copy   # prints the length percentiles of the default train split
"""

from __future__ import annotations

import math
import random

from miles.config import CopyTaskConfig
from miles.tasks.base import ExactMatchTask, Sample

PERCENTILES: tuple[int, ...] = (50, 90, 99, 100)


def draw_length(rng: random.Random, cfg: CopyTaskConfig) -> int:
    """One string length: ``round(exp(N(log median_len, sigma)))`` clipped to ``[min_len, max_len]``."""
    raw = math.exp(rng.gauss(math.log(cfg.median_len), cfg.sigma)) if cfg.sigma > 0 else cfg.median_len
    return max(cfg.min_len, min(cfg.max_len, round(raw)))


def percentile(values: list[int], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] of ``values`` (non-empty)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


def completion_lengths(samples: list[Sample]) -> list[int]:
    """Tokens a correct completion takes with the character tokenizer: the answer plus ``<eos>``."""
    return [len(s.answer) + 1 for s in samples]


def length_stats(samples: list[Sample]) -> dict[str, float]:
    """``p50``, ``p90``, ``p99``, ``p100``, ``mean`` and ``p99_over_p50`` of the completion lengths."""
    lengths = completion_lengths(samples)
    stats = {f"p{q}": percentile(lengths, q) for q in PERCENTILES}
    stats["mean"] = round(sum(lengths) / len(lengths), 3)
    stats["p99_over_p50"] = round(stats["p99"] / stats["p50"], 3)
    return stats


class CopyTask(ExactMatchTask):
    """``digits=`` -> the same digits (or reversed); exact-match reward; deterministic, disjoint splits."""

    def __init__(self, cfg: CopyTaskConfig) -> None:
        if cfg.min_len > cfg.max_len:
            raise ValueError(f"copy task: min_len ({cfg.min_len}) must be <= max_len ({cfg.max_len})")
        self.cfg = cfg
        rng = random.Random(cfg.seed)
        eval_strings: list[str] = []
        seen: set[str] = set()
        attempts = 0
        while len(eval_strings) < cfg.eval_size:
            attempts += 1
            if attempts > 100 * cfg.eval_size:
                raise ValueError(
                    f"copy task: cannot draw {cfg.eval_size} distinct eval strings; raise median_len or max_len"
                )
            s = self._draw(rng)
            if s not in seen:
                seen.add(s)
                eval_strings.append(s)
        train_strings: list[str] = []
        attempts = 0
        while len(train_strings) < cfg.train_size:
            attempts += 1
            if attempts > 100 * cfg.train_size:
                raise ValueError("copy task: the eval split covers almost every string; raise median_len or max_len")
            s = self._draw(rng)  # redraw length and digits on a collision: short lengths are not starved forever
            if s not in seen:
                train_strings.append(s)  # duplicates within train are fine (like arithmetic)
        self._splits: dict[str, list[Sample]] = {
            "train": [self._sample(f"train-{k}", s) for k, s in enumerate(train_strings)],
            "eval": [self._sample(f"eval-{k}", s) for k, s in enumerate(eval_strings)],
        }

    def _draw(self, rng: random.Random) -> str:
        return "".join(rng.choice("0123456789") for _ in range(draw_length(rng, self.cfg)))

    def _sample(self, sample_id: str, text: str) -> Sample:
        answer = text[::-1] if self.cfg.reverse else text
        return Sample(id=sample_id, prompt=f"{text}=", answer=answer, meta={"length": len(text)})


def main() -> None:  # pragma: no cover - a convenience printout
    task = CopyTask(CopyTaskConfig())
    for split in ("train", "eval"):
        print(split, length_stats(task.samples(split)))


if __name__ == "__main__":  # pragma: no cover
    main()
