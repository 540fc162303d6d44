"""The torch engine's lean Llama forward against the HF forward, side by side, on the quickstart's model.

    python benchmarks/lean_forward.py --out benchmarks/results/lean_forward.json

Two measurements, both with one torch thread (as rollout workers run) and CPU time of the thread doing
the work (``time.thread_time``), so another process on the machine costs neither side:

* **forward**: one call of each forward on the running-batch tensors the engine feeds it: a decode step
  (one new token per row over a cache of ``--context`` columns) and a prefill (``--prompt`` tokens per
  row), at 8, 32 and 128 rows. The two forwards alternate call by call, ``--calls`` each.
* **engine**: one quickstart step's share of a rollout worker's generation: ``--groups`` arithmetic prompt
  groups of 8 samples at T = 1 and at most 4 new tokens, ``--in-flight`` groups at once (the recipe's
  ``rollout.groups_in_flight``), through a :class:`~miles.engines.torch_engine.TorchEngine` configured with
  ``forward: auto`` (lean) or ``forward: hf``. CPU of the whole process per group set (the engine
  thread and the event loop). Rounds alternate lean, hf, then hf, lean, for ``--rounds`` rounds; both sides
  sample the same tokens (same seed; checked: ``same_outputs``).

Reported: ms per call / per group set of each side, and hf / lean (how many times faster the lean one is),
median with min and max over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from miles.config import RunConfig, TorchEngineConfig, load_config
from miles.engines.base import SamplingParams
from miles.engines.model_forward import Forward, hf_forward, lean_forward_for
from miles.engines.torch_engine import TorchEngine
from miles.models.loading import encode_prompt, load_policy, stop_token_ids
from miles.prepare import prepare_model
from miles.tasks.registry import build_task

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
GROUP_SIZE = 8


def _cache(model: Any, rows: int, columns: int) -> DynamicCache:
    """A cache of ``columns`` random keys and values per row, shaped as the model's layers hold them."""
    config = model.config
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    cache = DynamicCache()
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(rows, heads, columns, dim), torch.randn(rows, heads, columns, dim), layer)
    return cache


def time_forwards(model: Any, rows: int, context: int, prompt: int, calls: int) -> dict[str, float]:
    """ms of CPU per call of each forward, decode and prefill, alternating call by call."""
    lean, _ = lean_forward_for(model)
    assert lean is not None, "the quickstart model is a Llama: the lean forward must apply"
    sides: dict[str, Forward] = {"lean": lean, "hf": hf_forward(model)}
    vocab = model.config.vocab_size
    token = torch.randint(4, vocab, (rows, 1))
    decode_mask = torch.ones((rows, context + 1), dtype=torch.long)
    decode_pos = torch.full((rows, 1), context)
    ids = torch.randint(4, vocab, (rows, prompt))
    mask = torch.ones_like(ids)
    positions = torch.arange(prompt).expand(rows, prompt)
    spent = {f"{side}_{kind}": 0.0 for side in sides for kind in ("decode", "prefill")}
    base = _cache(model, rows, context)
    with torch.inference_mode():
        for call in range(calls + 1):  # call 0 warms up and is not counted
            for side, forward in sides.items():
                cache = DynamicCache()  # a fresh cache per decode: each call appends one column to it
                for layer, held in enumerate(base.layers):
                    cache.update(held.keys, held.values, layer)
                start = time.thread_time()
                forward(token, decode_mask, decode_pos, cache)
                decode = time.thread_time() - start
                start = time.thread_time()
                forward(ids, mask, positions, DynamicCache())
                prefill = time.thread_time() - start
                if call > 0:
                    spent[f"{side}_decode"] += decode
                    spent[f"{side}_prefill"] += prefill
    ms = {key: round(value / calls * 1e3, 4) for key, value in spent.items()}
    ms["decode_hf_over_lean"] = round(ms["hf_decode"] / ms["lean_decode"], 3)
    ms["prefill_hf_over_lean"] = round(ms["hf_prefill"] / ms["lean_prefill"], 3)
    return ms


async def play_groups(
    engine: TorchEngine, prompts: list[list[int]], params: SamplingParams, in_flight: int
) -> list[list[int]]:
    """Every prompt as a group of 8 samples, at most ``in_flight`` groups at once (as a worker plays them)."""
    room = asyncio.Semaphore(in_flight)
    outputs: dict[int, list[list[int]]] = {}

    async def group(index: int, prompt: list[int]) -> None:
        async with room:
            gens = await asyncio.gather(*(engine.generate(prompt, params) for _ in range(GROUP_SIZE)))
            outputs[index] = [g.output_ids for g in gens]

    await asyncio.gather(*(group(i, p) for i, p in enumerate(prompts)))
    return [ids for i in range(len(prompts)) for ids in outputs[i]]


async def time_engine(
    model: Any, pad: int, forward: str, prompts: list[list[int]], params: SamplingParams, in_flight: int
) -> tuple[float, list[list[int]]]:
    engine = TorchEngine(model, pad, cfg=TorchEngineConfig(forward=forward), version=0, seed=0)
    async with engine:
        await play_groups(engine, prompts[:4], params, in_flight)  # warm-up, its own seeds consumed alike
        start = time.process_time()
        outputs = await play_groups(engine, prompts, params, in_flight)
        return time.process_time() - start, outputs


def summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


async def benchmark(args: argparse.Namespace, model_dir: Path, cfg: RunConfig) -> dict[str, Any]:
    model, tokenizer = load_policy(model_dir, "float32", "cpu")
    pad = tokenizer.pad_token_id
    forwards = {str(rows): time_forwards(model, rows, args.context, args.prompt, args.calls) for rows in (8, 32, 128)}
    samples = build_task(cfg.task).samples("train")[: args.groups]
    prompts = [encode_prompt(tokenizer, s.prompt) for s in samples]
    params = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=stop_token_ids(tokenizer, model_dir))
    runs: list[dict[str, Any]] = []
    ratios: list[float] = []
    same = True
    for round_ in range(args.rounds):
        order = ("auto", "hf") if round_ % 2 == 0 else ("hf", "auto")
        got: dict[str, tuple[float, list[list[int]]]] = {}
        for forward in order:
            got[forward] = await time_engine(model, pad, forward, prompts, params, args.in_flight)
            runs.append({"round": round_, "forward": forward, "cpu_ms": round(got[forward][0] * 1e3, 1)})
        same = same and got["auto"][1] == got["hf"][1]
        ratios.append(got["hf"][0] / got["auto"][0])
    lean_ms = [r["cpu_ms"] for r in runs if r["forward"] == "auto"]
    hf_ms = [r["cpu_ms"] for r in runs if r["forward"] == "hf"]
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": 1},
        "model": {"parameters": sum(p.numel() for p in model.parameters()), "layers": model.config.num_hidden_layers},
        "forward_ms_per_call": forwards,
        "engine": {
            "groups": len(prompts),
            "group_size": GROUP_SIZE,
            "in_flight": args.in_flight,
            "runs": runs,
            "lean_cpu_ms": summary(lean_ms),
            "hf_cpu_ms": summary(hf_ms),
            "hf_over_lean": summary(ratios),
            "same_outputs": same,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls of each forward per shape")
    parser.add_argument("--context", type=int, default=12, help="cached columns of a decode step")
    parser.add_argument("--prompt", type=int, default=10, help="tokens per row of a prefill")
    parser.add_argument("--groups", type=int, default=16, help="prompt groups per engine run (a worker's step share)")
    parser.add_argument("--in-flight", type=int, default=4, help="groups played at once (rollout.groups_in_flight)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds of the engine runs")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here (it is printed either way)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(RECIPE)
    model_dir = prepare_model(cfg)  # the quickstart's warmed-up tiny model (built once, then cached)
    result = asyncio.run(benchmark(args, model_dir, cfg))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
