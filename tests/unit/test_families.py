"""Model families: records, tiny twins (build, load, train, chat template, stops), LoRA targets, quant rule, caches.

Everything is built offline from code; no hub access. One twin per family is built once for the module.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from miles.config import LoraConfig
from miles.engines.base import SamplingParams
from miles.engines.batch import generate_all_sync
from miles.engines.torch_engine import TorchEngine
from miles.models.families import ModelFamily, TinyDims, UnknownFamilyError, family_names, get_family
from miles.models.families.build import BUILD_INFO_FILE, build_tiny_twin, twin_cache_key, write_tiny_twin
from miles.models.families.rules import MissingStopTokenError, lora_targets, quantizable, stop_token_ids_for
from miles.models.families.tokenizer import build_tokenizer
from miles.models.loading import load_policy, load_tokenizer
from miles.sync.lora import add_adapters

SUPPORTED = {"deepseek_v32", "kimi_k26", "qwen38", "glm52", "gemma4", "gpt_oss"}  # the reference release's six
FAMILIES = family_names()
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 12+7?"},
    {"role": "assistant", "content": "19"},
    {"role": "user", "content": "Run: ls -la"},
]


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every family's default twin, built once for the module (in a private cache root)."""
    root = tmp_path_factory.mktemp("twins")
    return {name: build_tiny_twin(name, root) for name in FAMILIES}


def _ids(tokenizer, messages: list[dict], **kwargs: object) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


# --------------------------------------------------------------------------- records


def test_registry_has_the_six_families() -> None:
    assert SUPPORTED <= set(family_names())
    with pytest.raises(UnknownFamilyError, match="known: deepseek_v32"):
        get_family("llama")


@pytest.mark.parametrize("name", FAMILIES)
def test_record_matches_transformers(name: str) -> None:
    """The class, model type and causal-LM mapping exist as the record says; every stop token is a token."""
    family = get_family(name)
    assert family.model_type in CONFIG_MAPPING
    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family.model_type] == family.architecture
    assert set(family.chat.stop_tokens) <= set(family.chat.all_tokens())
    assert family.chat.eos in family.chat.stop_tokens or family.chat.eos in family.chat.all_tokens()
    if family.class_note:  # closest-class families say which class stands in, and why
        assert family.architecture in family.class_note


@pytest.mark.parametrize(("name", "variant"), [(n, v) for n in FAMILIES for v in get_family(n).variants])
def test_full_config_has_the_published_size(name: str, variant: str) -> None:
    """The real dims, built on the meta device (no memory), count within 3% of the published total."""
    family = get_family(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family.full_config(variant))
    assert type(model).__name__ == family.architecture
    total_b = sum(p.numel() for p in model.parameters()) / 1e9
    published_b = family.published_params_b[variant][0]
    assert abs(total_b - published_b) / published_b < 0.03, f"{total_b:.1f}B vs published {published_b}B"


# --------------------------------------------------------------------------- building


@pytest.mark.parametrize("name", FAMILIES)
def test_twin_builds_offline_fast_and_is_cached(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    path = build_tiny_twin(name, tmp_path)
    assert time.perf_counter() - start < 15
    info = json.loads((path / BUILD_INFO_FILE).read_text())
    assert info["family"] == name and info["key"] in path.name
    assert info["num_parameters"] < 400_000 and info["vocab_size"] <= 600
    stamp = (path / BUILD_INFO_FILE).stat().st_mtime_ns
    assert build_tiny_twin(name, tmp_path) == path  # cache hit: same directory, not rebuilt
    assert (path / BUILD_INFO_FILE).stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{path.name}.") and p.is_dir()]


def test_twin_init_is_seeded_and_keyed(tmp_path: Path) -> None:
    family = get_family("gpt_oss")
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for out, seed in ((a, 0), (b, 0), (c, 1)):
        out.mkdir()
        write_tiny_twin(family, out, seed=seed)
    sa, sb, sc = (load_policy(p)[0].state_dict() for p in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert json.loads((a / "tokenizer.json").read_text()) == json.loads((b / "tokenizer.json").read_text())
    assert twin_cache_key(family, TinyDims(), 0) != twin_cache_key(family, TinyDims(), 1)
    assert twin_cache_key(family, TinyDims(), 0) != twin_cache_key(family, TinyDims(hidden_size=32), 0)


@pytest.mark.parametrize(
    "dims",
    [
        TinyDims(hidden_size=32, num_layers=3, num_experts=2, experts_per_token=1),
        TinyDims(hidden_size=96, num_experts=6),
    ],
    ids=["h32-l3-e2", "h96-e6"],
)
@pytest.mark.parametrize("name", FAMILIES)
def test_twin_dims_are_knobs(name: str, dims: TinyDims, tmp_path: Path) -> None:
    """Other sizes build too, keep the family's class, and keep every expert quantizable on its input axis."""
    family = get_family(name)
    write_tiny_twin(family, tmp_path, dims)
    model, tokenizer = load_policy(tmp_path)
    assert model.config.hidden_size == dims.hidden_size and model.config.num_hidden_layers == dims.num_layers
    ids = torch.tensor([tokenizer.encode("12+7=19 ls -la", add_special_tokens=False)])
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
    state = model.state_dict()
    experts = [n for n, t in state.items() if t.dim() == 3 and ".experts." in n]
    assert experts and all(quantizable(n, state[n], family) is not None for n in experts)


@pytest.mark.parametrize("name", FAMILIES)
def test_twin_loads_runs_forward_and_backward(name: str, twins: dict[str, Path]) -> None:
    """The loader builds the family's class; a loss backpropagates into the fused experts; AdamW moves them."""
    family = get_family(name)
    model, tokenizer = load_policy(twins[name])
    assert type(model).__name__ == family.architecture
    text = "12+7=19\nls -la /tmp && cat notes.txt\n" * 3
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])  # (1, T)
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    # transformers runs the DSA indexer under no_grad: its weights (and only those) get no gradient.
    assert all(".indexer." in n for n in no_grad), no_grad
    experts = {n: p for n, p in model.named_parameters() if p.dim() == 3 and ".experts." in n + "."}
    assert experts and all(p.grad is not None and p.grad.abs().sum() > 0 for p in experts.values())
    before = {n: p.detach().clone() for n, p in experts.items()}
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    assert all(not torch.equal(before[n], p) for n, p in experts.items())


# --------------------------------------------------------------------------- tokenizer and chat template


@pytest.mark.parametrize("name", FAMILIES)
def test_chat_template_renders_three_turns_and_ids_round_trip(name: str, twins: dict[str, Path]) -> None:
    family = get_family(name)
    tokenizer = load_tokenizer(twins[name])
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    ids = _ids(tokenizer, CONVERSATION, add_generation_prompt=True)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids
    for message in CONVERSATION:
        assert message["content"] in text
    if family.chat.end_of_turn is not None:  # the assistant turn is closed by the family's end-of-turn token
        assert "19" + family.chat.end_of_turn in text
    vocab = tokenizer.get_vocab()
    for token in family.chat.all_tokens():  # control and tag tokens are single ids
        assert tokenizer.encode(token, add_special_tokens=False) == [vocab[token]]


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("name", FAMILIES)
def test_generation_prompt_is_a_prefix_of_the_rendered_turn(name: str, thinking: bool, twins: dict[str, Path]) -> None:
    """Token-in/token-out: the prompt the engine continues is a prefix of the history rendered afterwards."""
    tokenizer = load_tokenizer(twins[name])
    turn = {"role": "assistant", "content": "ls -la"}
    if thinking:
        turn["reasoning_content"] = "List the files."
    prompt = _ids(tokenizer, CONVERSATION, add_generation_prompt=True, enable_thinking=thinking)
    history = _ids(tokenizer, [*CONVERSATION, turn], enable_thinking=thinking)
    assert history[: len(prompt)] == prompt


@pytest.mark.parametrize("name", FAMILIES)
def test_tool_call_and_result_render(name: str, twins: dict[str, Path]) -> None:
    tokenizer = load_tokenizer(twins[name])
    function = {"name": "shell", "arguments": {"cmd": "ls -la"}}
    call = {"id": "functions.shell:0", "type": "function", "function": function}
    messages = [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.shell:0", "name": "shell", "content": "a.txt b.txt"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "shell" in text and "ls -la" in text and "a.txt b.txt" in text
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("name", FAMILIES)
def test_stop_tokens_are_in_the_vocab_and_the_generation_config(name: str, twins: dict[str, Path]) -> None:
    family = get_family(name)
    model, tokenizer = load_policy(twins[name])
    stops = stop_token_ids_for(tokenizer, family)
    vocab = tokenizer.get_vocab()
    assert stops[0] == tokenizer.eos_token_id
    assert {vocab[t] for t in family.chat.stop_tokens} <= set(stops)
    assert list(model.generation_config.eos_token_id) == stops


def test_stop_tokens_of_another_family_fail_loudly() -> None:
    qwen_tokenizer = build_tokenizer(get_family("qwen38"))
    with pytest.raises(MissingStopTokenError, match="GLM-5.2"):
        stop_token_ids_for(qwen_tokenizer, get_family("glm52"))


# --------------------------------------------------------------------------- LoRA and quantization


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_targets_exist_and_peft_wraps_them(name: str, twins: dict[str, Path]) -> None:
    family = get_family(name)
    model, tokenizer = load_policy(twins[name])
    linear_names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for suffix in family.lora.modules:
        assert any(n.split(".")[-1] == suffix for n in linear_names), f"no nn.Linear named {suffix}"
    targets = lora_targets(family)
    wrapped = add_adapters(model, LoraConfig(rank=2, alpha=4, target_modules=targets["target_modules"]))
    adapted = {n.split(".lora_")[0].split(".")[-1] for n, _ in wrapped.named_parameters() if ".lora_A." in n}
    assert adapted == set(family.lora.modules)
    ids = torch.tensor([tokenizer.encode("3+4=7", add_special_tokens=False)])
    wrapped(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_on_fused_experts_through_target_parameters(name: str, twins: dict[str, Path]) -> None:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    model, tokenizer = load_policy(twins[name])
    wrapped = get_peft_model(model, PeftLoraConfig(r=2, lora_alpha=4, **lora_targets(get_family(name), experts=True)))
    assert any(".experts." in n and "lora_A" in n for n, _ in wrapped.named_parameters())
    ids = torch.tensor([tokenizer.encode("3+4=7", add_special_tokens=False)])
    wrapped(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize("name", FAMILIES)
def test_quant_rule_selects_fused_experts_on_their_input_axis(name: str, twins: dict[str, Path]) -> None:
    family = get_family(name)
    model, _ = load_policy(twins[name])
    cfg = model.config
    hidden = cfg.hidden_size
    expert_width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    state = model.state_dict()
    picked = {n: quantizable(n, t, family) for n, t in state.items()}
    experts = [n for n in state if n.endswith((".gate_up_proj", ".down_proj")) and state[n].dim() == 3]
    assert experts
    for n in experts:
        target = picked[n]
        assert target is not None and target.fused_experts and target.format == family.quant.experts, n
        assert state[n].shape[target.in_axis] == (hidden if n.endswith("gate_up_proj") else expert_width), n
    never = ("embed", "lm_head", "norm", "router", ".mlp.gate.", "sinks", "conv1d", "_bias", ".bias")
    for n, target in picked.items():
        if target is not None:
            assert not any(word in n for word in never), n
    linear = [n for n, t in picked.items() if t is not None and not t.fused_experts]
    assert bool(linear) == (family.quant.linear is not None)
    assert all(state[n].dim() == 2 and picked[n].in_axis == 1 for n in linear)


# --------------------------------------------------------------------------- caches


@pytest.mark.parametrize("name", FAMILIES)
def test_cached_greedy_decoding_matches_full_recompute(name: str, twins: dict[str, Path]) -> None:
    """model.generate and the engine's plain KV-cache loop agree, and both match recomputing without a cache.

    Prompt 12 + 20 new tokens runs past the twins' sliding window (8) and DSA top-k (8); the batched
    call left-pads a 5-token prompt next to it, so padding meets sliding windows, sinks, the
    linear-attention state and the indexer.
    """
    model, tokenizer = load_policy(twins[name])
    gen = torch.Generator().manual_seed(0)
    low = len(get_family(name).chat.all_tokens())  # ordinary tokens only
    long, short = (torch.randint(low, len(tokenizer), (n,), generator=gen).tolist() for n in (12, 5))
    steps = 20

    with torch.no_grad():
        out = model.generate(
            torch.tensor([long]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
        new = out.sequences[0, len(long) :].tolist()
        full = torch.log_softmax(model(input_ids=out.sequences, use_cache=False).logits[0].float(), -1)  # (T, V)
        ref = [float(full[len(long) - 1 + i, t]) for i, t in enumerate(new)]
        gen_lp = [float(torch.log_softmax(lg[0].float(), -1)[t]) for lg, t in zip(out.logits, new)]
    assert max(abs(a - b) for a, b in zip(gen_lp, ref)) < 1e-4

    engine = TorchEngine(model, tokenizer.pad_token_id)
    params = SamplingParams(max_new_tokens=steps, temperature=0.0, stop_token_ids=[])
    single_long, single_short = (generate_all_sync(engine, [p], params)[0] for p in (long, short))
    batch = generate_all_sync(engine, [long, short], params)  # continuous batching: the two share the batch
    assert single_long.output_ids == new
    assert max(abs(a - b) for a, b in zip(single_long.logprobs, ref)) < 1e-4
    for row, single in zip(batch, (single_long, single_short)):
        assert row.output_ids == single.output_ids
        assert max(abs(a - b) for a, b in zip(row.logprobs, single.logprobs)) < 1e-4


def _my_family() -> ModelFamily:
    return dataclasses.replace(get_family("qwen38"), name="my_qwen")


def _not_a_family() -> str:
    return "qwen38"


def test_a_family_of_your_own_by_import_path() -> None:
    assert get_family(f"{__name__}:_my_family").name == "my_qwen"
    with pytest.raises(UnknownFamilyError, match="not a ModelFamily"):
        get_family(f"{__name__}:_not_a_family")
