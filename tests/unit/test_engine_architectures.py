"""Continuous batching on every architecture family Miles ships recipes for, with tiny random models built from
configs (float32, 2 layers): the engine's greedy tokens and log-probs under requests that arrive staggered, share
prompts and leave at different steps must equal teacher forcing (one unpadded, uncached forward of prompt +
output, with the model's own masks) and one-request-at-a-time generation.

Architectures whose caches cannot be merged (linear attention, DSA indexer keys) run the engine's fallback
(identical prompts only, no padding); they are checked the same way, and against the model's own incremental
decoding. The DSA models (DeepSeek-V3.2, GLM-5.2) hold to teacher forcing only because the engine gives their
indexers a position tie-break in the top-k (:mod:`miles.models.dsa_topk`): with two indexer heads many keys
score exactly 0, and ``torch.topk`` picks different tied keys from a cached row than from a full-sequence one.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, PretrainedConfig

from miles.config import TorchEngineConfig
from miles.engines.base import Generation, SamplingParams
from miles.engines.kv_cache import batching_plan
from miles.engines.torch_engine import TorchEngine

from .test_torch_engine import single_intra_op_thread

VOCAB = 64
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
WINDOW = 4  # sliding window of the local layers: far shorter than the sequences below
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
MLA = dict(
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1
)


def _configs() -> dict[str, Callable[[], PretrainedConfig]]:
    t = transformers
    local_global = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], head_dim=8)
    return {
        "llama": lambda: t.LlamaConfig(intermediate_size=64, **COMMON),
        "qwen3": lambda: t.Qwen3Config(intermediate_size=64, head_dim=8, **COMMON),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(intermediate_size=64, num_experts=4, head_dim=8, **MOE, **COMMON),
        "gemma3": lambda: t.Gemma3TextConfig(intermediate_size=64, **local_global, **COMMON),
        "gpt_oss": lambda: t.GptOssConfig(
            intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, **local_global, **COMMON
        ),
        "deepseek_v3": lambda: t.DeepseekV3Config(
            intermediate_size=64,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **MOE,
            **MLA,
            **{**COMMON, "num_key_value_heads": 4},
        ),
        # Fallback: the cache holds more than per-token keys and values.
        "qwen3_next": lambda: t.Qwen3NextConfig(
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            head_dim=8,
            num_experts=4,
            shared_expert_intermediate_size=16,
            intermediate_size=32,
            **MOE,
            **COMMON,
        ),
        "deepseek_v32": lambda: t.DeepseekV32Config(
            intermediate_size=64,
            n_routed_experts=4,
            index_n_heads=2,
            index_head_dim=16,
            index_topk=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **MOE,
            **MLA,
            **{**COMMON, "num_key_value_heads": 4},
        ),
        "glm_moe_dsa": lambda: t.GlmMoeDsaConfig(
            intermediate_size=64,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            index_n_heads=2,
            index_head_dim=16,
            index_topk=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **MOE,
            **MLA,
            **{**COMMON, "num_key_value_heads": 4},
        ),
    }


CONFIGS = _configs()
one_thread = pytest.fixture(single_intra_op_thread, name="one_thread", autouse=True, scope="module")
CONTINUOUS = ["llama", "qwen3", "qwen3_moe", "gemma3", "gpt_oss", "deepseek_v3"]
FALLBACK = ["qwen3_next", "deepseek_v32", "glm_moe_dsa"]


def build(name: str, **overrides: object) -> torch.nn.Module:
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def requests() -> list[tuple[list[int], SamplingParams]]:
    """Varied prompt lengths (1-12 tokens), three copies of one prompt (a group), budgets of 1-20 tokens."""
    rng = random.Random(0)
    group = [1] + [rng.randrange(3, VOCAB) for _ in range(5)]
    out = []
    for i in range(10):
        prompt = group if i in (2, 3, 6) else [1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(0, 12))]
        out.append((prompt, SamplingParams(max_new_tokens=rng.randrange(1, 21), temperature=0.0)))
    return out


def incremental_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens from the model's own cache (built from its config), batch of one, no engine involved."""
    cache = DynamicCache(config=model.config)
    tokens: list[int] = []
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]  # (V,)
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits[0, -1]
    return tokens


def teacher_forced(model: torch.nn.Module, gen: Generation) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs (T = 1) from one unpadded, uncached forward over prompt + output."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([gen.prompt_ids + gen.output_ids])).logits[0].float()  # (P + N, V)
    steps = logits[len(gen.prompt_ids) - 1 : -1]  # (N, V): the distributions the outputs were drawn from
    logp = torch.log_softmax(steps, dim=-1).gather(-1, torch.tensor(gen.output_ids).unsqueeze(-1)).squeeze(-1)
    return steps.argmax(-1).tolist(), logp.tolist()


@pytest.mark.parametrize(("name", "forward"), [(n, "auto") for n in CONTINUOUS + FALLBACK] + [("llama", "hf")])
async def test_greedy_batched_generation_matches_teacher_forcing(name: str, forward: str) -> None:
    model = build(name)
    assert batching_plan(model).continuous == (name in CONTINUOUS)
    engine = TorchEngine(model, pad_token_id=0, cfg=TorchEngineConfig(forward=forward))
    # Llama runs Miles' lean forward unless told otherwise; every other family runs HF's.
    assert engine.forward_kind.startswith("lean") == (name == "llama" and forward == "auto")
    work = requests()
    shapes: list[tuple[int, int]] = []  # (rows, input tokens) of every forward: prefills have more than one
    # On the input embedding, which every forward (HF's or the lean one) calls once with the input ids.
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))

    async with engine:
        first = [asyncio.create_task(engine.generate(*w)) for w in work[:5]]
        while not any(t == 1 for _, t in shapes):  # a decode step ran: the rest join a running batch
            await asyncio.sleep(0.001)
        together = await asyncio.gather(*first, *(engine.generate(*w) for w in work[5:]))
        hook.remove()
        alone = [await engine.generate(prompt, params) for prompt, params in work]
    first_decode = next(i for i, (_, t) in enumerate(shapes) if t == 1)
    if name in CONTINUOUS:  # newcomers were prefilled while rows were running, then merged
        assert any(t > 1 for _, t in shapes[first_decode:])
    for gen, ref, (prompt, params) in zip(together, alone, work, strict=True):
        assert gen.prompt_ids == prompt and len(gen.output_ids) == params.max_new_tokens
        assert gen.output_ids == ref.output_ids == incremental_greedy(model, prompt, params.max_new_tokens)
        assert gen.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        tokens, logprobs = teacher_forced(model, gen)
        assert gen.output_ids == tokens
        assert gen.logprobs == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_the_sliding_window_shapes_these_outputs(name: str) -> None:
    """The window matters on these sequences, so the test above would catch a mask that ignored it."""
    ids = torch.tensor([[1] + list(range(3, 27))])  # 25 tokens, window 4
    with torch.no_grad():
        windowed = build(name)(input_ids=ids).logits
        unwindowed = build(name, sliding_window=10_000)(input_ids=ids).logits
    assert torch.allclose(windowed[:, :WINDOW], unwindowed[:, :WINDOW], atol=1e-5)  # inside the window: same
    assert (windowed[:, 2 * WINDOW :] - unwindowed[:, 2 * WINDOW :]).abs().max() > 1e-3
