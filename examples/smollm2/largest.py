"""The SmolLM2-135M-Instruct recipe's task: "Which is the largest of A, B and C?", as conversational JSONL rows.

    python examples/smollm2/largest.py recipes/data/largest    # writes train.jsonl (500) and eval.jsonl (100)

The reward is 1 only for a reply that states the largest number and no other number: an answer that restates
the question ("The largest of 12, 85 and 40 is 85") names all three and scores 0, so it cannot be won by
copying the prompt, where the largest number is often the last one.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

from miles.tasks.base import Sample

_NUMBER = re.compile(r"-?\d+")
SYSTEM = "You are a helpful assistant. Reply with the number only."


def row(rng: random.Random) -> dict[str, object]:
    numbers = rng.sample(range(1, 100), 3)
    question = f"Which is the largest of {numbers[0]}, {numbers[1]} and {numbers[2]}? Answer with the number only."
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"prompt": prompt, "answer": str(max(numbers)), "numbers": numbers}


def reward(completion: str, sample: Sample) -> float:
    """1 if the only number in the reply is the largest one; 0 otherwise (restating the question included)."""
    found = _NUMBER.findall(completion)
    return 1.0 if found == [sample.answer] else 0.0


def main(out: str) -> None:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    for split, count, seed in (("train", 500, 0), ("eval", 100, 1)):
        rng = random.Random(seed)
        rows = [row(rng) for _ in range(count)]
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "recipes/data/largest")
