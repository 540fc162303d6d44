"""FsdpBackend driven by the algorithm layer (RLStep) on a tiny random Llama: learning signal, layout
independence (packing, micro-batches), data-parallel equivalence, mixed precision, export."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from miles.backends.base import TrainSample
from miles.backends.distributed import distributed, spawn_ranks
from miles.backends.fsdp import FsdpBackend
from miles.config import AlgoConfig, FsdpBackendConfig, LoraConfig, TrainerConfig
from miles.ports import free_port
from miles.training.packing import pack_micro_batches
from miles.training.step import RLStep, plan_batch

PAD = 0
VOCAB = 20


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(cfg)


def trainer_cfg(
    lr: float = 1e-3, lora: LoraConfig | None = None, backend: dict | None = None, **algo: Any
) -> TrainerConfig:
    """lr is small by default: Adam's first step maps a gradient g to ~lr * g / (|g| + eps), which amplifies
    float-rounding differences of near-zero gradients, and the equivalence tests compare weights to 1e-5."""
    return TrainerConfig(lr=lr, algo=AlgoConfig(**algo), backend=FsdpBackendConfig(**(backend or {})), lora=lora)


LORA = LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"])


def global_batch(step: int) -> list[TrainSample]:
    """Six samples of different prompt/completion lengths, advantages of both signs, one with an environment
    turn in the middle (loss mask 0 there)."""
    g = torch.Generator().manual_seed(100 + step)
    samples = []
    for i, (p, o) in enumerate([(3, 4), (2, 6), (5, 1), (4, 3), (2, 2), (3, 5)]):
        ids = torch.randint(1, VOCAB, (p + o,), generator=g).tolist()
        mask = [1] * o if i != 1 else [1, 1, 0, 0, 1, 1]
        behaviour = [(-torch.rand(1, generator=g) * 3).item() if m else 0.0 for m in mask]
        samples.append(TrainSample(ids[:p], ids[p:], mask, behaviour, advantage=(-1.0) ** i * (0.5 + i / 4)))
    return samples


def grouped_batch(step: int) -> list[TrainSample]:
    """Three prompts, four samples each (GRPO groups), completions of different lengths, one with an
    environment turn: what shared-prompt packing puts behind one copy of each prompt."""
    g = torch.Generator().manual_seed(200 + step)
    samples = []
    for p in (3, 1, 5):
        prompt = torch.randint(1, VOCAB, (p,), generator=g).tolist()
        for i, o in enumerate((4, 1, 6, 2)):
            tokens = torch.randint(1, VOCAB, (o,), generator=g).tolist()
            mask = [1, 1, 0, 0, 1, 1] if o == 6 else [1] * o
            behaviour = [(-torch.rand(1, generator=g) * 3).item() if m else 0.0 for m in mask]
            samples.append(TrainSample(prompt, tokens, mask, behaviour, advantage=(-1.0) ** i * (0.5 + p / 4)))
    return samples


def weights(backend: FsdpBackend) -> dict[str, torch.Tensor]:
    return dict(backend.export_params())


def run_steps(
    backend: FsdpBackend, cfg: TrainerConfig, steps: int, world: int = 1, batch: Any = global_batch
) -> list[dict[str, float]]:
    step = RLStep(backend, cfg, pad_id=PAD)
    plans = [plan_batch(batch(s), cfg.algo.minibatches, world)[backend.dp_rank] for s in range(steps)]
    return [step.run(plan) for plan in plans]


def completion_logprobs(backend: FsdpBackend, samples: list[TrainSample]) -> list[list[float]]:
    (mb,) = pack_micro_batches(samples, pad_id=PAD)
    (out,) = backend.score([mb])
    cut = mb.per_sample(out.logp)
    return [cut[i] for i in range(len(samples))]


# --------------------------------------------------------------------------- single process


def test_positive_advantage_raises_logprob_and_masked_tokens_do_not_train() -> None:
    backend = FsdpBackend(tiny_model(), trainer_cfg(lr=1e-2), 0, 1)
    sample = TrainSample([1, 2, 3], [4, 5, 6, 7], [1, 1, 0, 0], [0.0] * 4, advantage=1.0)
    before = completion_logprobs(backend, [sample])[0]
    step = RLStep(backend, trainer_cfg(lr=1e-2, off_policy="none"), pad_id=PAD)
    for _ in range(5):
        step.run([[sample]])
    after = completion_logprobs(backend, [sample])[0]
    assert after[0] > before[0] and after[1] > before[1]
    assert step.steps_done == 5


def test_a_users_per_token_surrogate_trains() -> None:
    """A two-line per-token term by import path (tests/unit/test_losses.py) steps the policy like Miles' own."""
    loss = {"type": "surrogate", "path": "tests.unit.test_losses:scaled_reinforce", "params": {"scale": 1.0}}
    cfg = trainer_cfg(lr=1e-2, off_policy="none", loss=loss)
    backend = FsdpBackend(tiny_model(), cfg, 0, 1)
    sample = TrainSample([1, 2, 3], [4, 5, 6, 7], [1, 1, 0, 0], [0.0] * 4, advantage=1.0)
    before = completion_logprobs(backend, [sample])[0]
    step = RLStep(backend, cfg, pad_id=PAD)
    metrics = [step.run([[sample]]) for _ in range(5)]
    after = completion_logprobs(backend, [sample])[0]
    assert after[0] > before[0] and after[1] > before[1]  # the trained tokens rose
    assert all(m["pg_loss"] < 0 for m in metrics) and step.steps_done == 5


def test_scores_equal_the_models_own_logits() -> None:
    """Chunked log-probs of packed rows are the full-logits log-softmax of each sequence alone."""
    model = tiny_model()
    plain = tiny_model()
    cfg = trainer_cfg(backend={"logprob_chunk_tokens": 3})
    backend = FsdpBackend(model, cfg, 0, 1, temperature=0.7)
    samples = global_batch(0)
    got = completion_logprobs(backend, samples)
    for s, row in zip(samples, got, strict=True):
        ids = torch.tensor([s.prompt_ids + s.token_ids])
        logits = plain(input_ids=ids).logits[0, :-1] / 0.7
        want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)[len(s.prompt_ids) - 1 :]
        assert row == pytest.approx(want.tolist(), abs=1e-5)


@pytest.mark.parametrize(
    "layout",
    [{"pack_sequences": False}, {"micro_batch_tokens": 9}, {"micro_batch_tokens": 9, "pack_sequences": False}],
)
def test_packing_and_micro_batches_do_not_change_the_step(layout: dict[str, Any]) -> None:
    algo = {"kl_coef": 0.1, "entropy_coef": 0.01, "loss": {"aggregation": "sequence"}, "off_policy": "sequence"}
    one = FsdpBackend(tiny_model(), trainer_cfg(**algo), 0, 1)
    other = FsdpBackend(tiny_model(), trainer_cfg(backend=layout, **algo), 0, 1)
    m1 = run_steps(one, trainer_cfg(**algo), 2)
    m2 = run_steps(other, trainer_cfg(backend=layout, **algo), 2)
    for a, b in zip(m1, m2, strict=True):
        for key, value in a.items():
            assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for name, value in weights(one).items():
        torch.testing.assert_close(weights(other)[name], value, rtol=0, atol=1e-5, msg=name)


SHARED_ALGOS = [
    {"off_policy": "decoupled_ppo"},
    {"kl_coef": 0.1, "entropy_coef": 0.01, "loss": {"aggregation": "sequence"}, "off_policy": "sequence"},
    {"off_policy": "none", "loss": {"type": "gspo"}, "minibatches": 2},
]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("algo", SHARED_ALGOS)
def test_shared_prompts_give_the_same_step(algo: dict[str, Any], attention: str) -> None:
    """Groups packed behind one copy of their prompt: the metrics and weights of packing every sample whole."""

    def backend(share: bool) -> FsdpBackend:
        model = tiny_model()
        model.config._attn_implementation = attention
        return FsdpBackend(model, trainer_cfg(backend={"share_prompts": share}, **algo), 0, 1)

    whole, shared = backend(False), backend(True)
    assert shared.shares_prompts and not whole.shares_prompts
    m1 = run_steps(whole, trainer_cfg(backend={"share_prompts": False}, **algo), 2, batch=grouped_batch)
    m2 = run_steps(shared, trainer_cfg(**algo), 2, batch=grouped_batch)
    for a, b in zip(m1, m2, strict=True):
        for key, value in a.items():
            assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for name, value in weights(whole).items():
        torch.testing.assert_close(weights(shared)[name], value, rtol=0, atol=1e-5, msg=name)
    (mb,) = pack_micro_batches(grouped_batch(0), pad_id=PAD, share_prompts=True)
    assert mb.attention_mask is not None and mb.input_ids.numel() < sum(
        len(s.prompt_ids) + len(s.token_ids) for s in grouped_batch(0)
    )


def test_shared_prompt_scores_equal_the_models_own_logits() -> None:
    plain = tiny_model()
    backend = FsdpBackend(tiny_model(), trainer_cfg(backend={"logprob_chunk_tokens": 5}), 0, 1, temperature=0.7)
    samples = grouped_batch(1)
    (mb,) = pack_micro_batches(samples, pad_id=PAD, share_prompts=True)
    (out,) = backend.score([mb], entropy=True)
    got = mb.per_sample(out.logp)
    for i, s in enumerate(samples):
        ids = torch.tensor([s.prompt_ids + s.token_ids])
        logits = plain(input_ids=ids).logits[0, :-1] / 0.7
        want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)[len(s.prompt_ids) - 1 :]
        assert got[i] == pytest.approx(want.tolist(), abs=1e-5)


def test_prompts_are_shared_only_where_the_mask_applies_unchanged() -> None:
    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from miles.backends.fsdp import shared_prompt_support

    assert shared_prompt_support(tiny_model()) is None
    small = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    small |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    assert shared_prompt_support(Qwen3ForCausalLM(Qwen3Config(**small))) is None
    windowed = Qwen3ForCausalLM(Qwen3Config(**small, use_sliding_window=True, sliding_window=16, max_window_layers=1))
    assert "sliding_attention" in (shared_prompt_support(windowed) or "")
    assert "MistralForCausalLM" in (shared_prompt_support(MistralForCausalLM(MistralConfig(**small))) or "")
    sdpa_only = tiny_model()
    sdpa_only.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in (shared_prompt_support(sdpa_only) or "")
    assert not FsdpBackend(tiny_model(), trainer_cfg(backend={"share_prompts": False}), 0, 1).shares_prompts


def test_activation_checkpointing_gives_the_same_step() -> None:
    plain = FsdpBackend(tiny_model(), trainer_cfg(), 0, 1)
    recomputed = FsdpBackend(tiny_model(), trainer_cfg(backend={"activation_checkpointing": True}), 0, 1)
    (a,), (b,) = run_steps(plain, trainer_cfg(), 1), run_steps(recomputed, trainer_cfg(), 1)
    assert b == pytest.approx(a)
    for name, value in weights(plain).items():
        torch.testing.assert_close(weights(recomputed)[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "algo",
    [
        {"off_policy": "decoupled_ppo"},  # the quickstart's: token weights from the proximal log-probs
        {"off_policy": "sequence", "kl_coef": 0.1, "entropy_coef": 0.01, "loss": {"aggregation": "sequence"}},
        {"off_policy": "none", "loss": {"type": "gspo"}},
    ],
)
def test_one_minibatch_takes_the_proximal_policy_from_the_training_forward(algo: dict[str, Any]) -> None:
    """With one mini-batch RLStep skips the separate no-grad proximal pass: same metrics, same weights."""
    separate_backend = FsdpBackend(tiny_model(), trainer_cfg(**algo), 0, 1)
    fused_backend = FsdpBackend(tiny_model(), trainer_cfg(**algo), 0, 1)
    separate, fused = (
        RLStep(separate_backend, trainer_cfg(**algo), pad_id=PAD),
        RLStep(fused_backend, trainer_cfg(**algo), pad_id=PAD),
    )
    separate.fuse_proximal = False
    scored = 0
    original_score = fused_backend.score

    def counting_score(*args: Any, **kwargs: Any) -> Any:
        nonlocal scored
        scored += not kwargs.get("reference", False)
        return original_score(*args, **kwargs)

    fused_backend.score = counting_score  # type: ignore[method-assign]
    for s in range(3):
        plan = plan_batch(global_batch(s), 1, 1)[0]
        a, b = separate.run(plan), fused.run(plan)
        assert set(a) == set(b)
        for key, value in a.items():
            assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        assert a["entropy"] > 0
    assert scored == 0, "the fused step still ran a proximal pass"
    for name, value in weights(separate_backend).items():
        torch.testing.assert_close(weights(fused_backend)[name], value, rtol=0, atol=1e-6, msg=name)


def test_several_minibatches_move_the_ratio_and_clip() -> None:
    """The second mini-batch's ratio is taken against the batch's start: ppo_kl and clip_frac are no longer 0."""
    backend = FsdpBackend(tiny_model(), trainer_cfg(lr=5e-2), 0, 1)
    (one,) = run_steps(backend, trainer_cfg(lr=5e-2, minibatches=1), 1)
    backend = FsdpBackend(tiny_model(), trainer_cfg(lr=5e-2), 0, 1)
    (three,) = run_steps(backend, trainer_cfg(lr=5e-2, minibatches=3), 1)
    assert one["ppo_kl"] == pytest.approx(0.0, abs=1e-7) and one["clip_frac"] == 0.0
    assert three["optimizer_steps"] == 3 and abs(three["ppo_kl"]) > 1e-4 and three["clip_frac"] > 0


def test_a_batch_without_signal_is_not_stepped() -> None:
    """After a step with signal, a batch whose advantages are all 0 leaves every weight where it was (an AdamW
    step on its zero gradient would replay the earlier momentum); a KL term has a gradient, so it steps."""
    cfg = trainer_cfg(lr=1e-2)
    backend = FsdpBackend(tiny_model(), cfg, 0, 1)
    step = RLStep(backend, cfg, pad_id=PAD)
    step.run(plan_batch(global_batch(0), 1, 1)[0])
    before = {name: value.clone() for name, value in weights(backend).items()}
    silent = [replace(s, advantage=0.0) for s in global_batch(1)]
    metrics = step.run(plan_batch(silent, 2, 1)[0])
    assert metrics["skipped_no_signal"] == 2 and metrics["optimizer_steps"] == 0
    assert metrics["entropy"] > 0 and step.steps_done == 3  # scored as usual; the lr clock advances
    for name, value in weights(backend).items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)

    kl = trainer_cfg(lr=1e-2, kl_coef=0.1)
    backend = FsdpBackend(tiny_model(), kl, 0, 1)
    step = RLStep(backend, kl, pad_id=PAD)
    step.run(plan_batch(global_batch(0), 1, 1)[0])
    before = {name: value.clone() for name, value in weights(backend).items()}
    metrics = step.run(plan_batch(silent, 1, 1)[0])
    assert metrics["skipped_no_signal"] == 0 and metrics["optimizer_steps"] == 1
    assert any(not torch.equal(value, before[name]) for name, value in weights(backend).items())


@pytest.mark.parametrize("layout", [{}, {"micro_batch_tokens": 9, "pack_sequences": False}])
def test_the_log_prob_audit_measures_each_samples_gap_from_the_current_weights(layout: dict[str, Any]) -> None:
    """Per sample, the summed |log pi - log mu| over its loss-masked tokens and their count: ~0 for behaviour
    log-probs the weights give, 0.5 per token where a sample's were shifted by 0.5."""
    backend = FsdpBackend(tiny_model(), trainer_cfg(backend=layout), 0, 1)
    samples = grouped_batch(0)  # shared prompts, one sample with an environment turn
    true = completion_logprobs(backend, samples)
    shifted = {1, 6, 10}
    indexed = []
    for i, (s, logps) in enumerate(zip(samples, true, strict=True)):
        behaviour = [(lp + 0.5 * (i in shifted)) * m for lp, m in zip(logps, s.loss_mask, strict=True)]
        indexed.append((i, replace(s, behaviour_logprobs=behaviour)))
    sums = RLStep(backend, trainer_cfg(backend=layout), pad_id=PAD).logprob_gaps(indexed[::-1], len(indexed))
    for i, s in enumerate(samples):
        tokens = sum(s.loss_mask)
        assert sums[2 * i + 1] == tokens
        assert sums[2 * i] == pytest.approx(0.5 * tokens if i in shifted else 0.0, abs=1e-4), i


def test_a_version_snapshot_scores_the_weights_of_its_version_and_puts_the_live_ones_back() -> None:
    from miles.training.snapshots import VersionSnapshots

    backend = FsdpBackend(tiny_model(), trainer_cfg(lr=1e-2), 0, 1)
    snapshots = VersionSnapshots(backend, keep=2)
    samples = global_batch(0)
    snapshots.take(0)
    v0 = completion_logprobs(backend, samples)
    run_steps(backend, trainer_cfg(lr=1e-2), 1)
    snapshots.take(1)
    v1, live = completion_logprobs(backend, samples), weights(backend)
    assert v1 != v0
    with snapshots.weights_of(0):
        assert completion_logprobs(backend, samples) == v0
    assert completion_logprobs(backend, samples) == v1
    for name, value in weights(backend).items():
        assert torch.equal(value, live[name]), name  # bitwise: the optimizer's weights are untouched
    run_steps(backend, trainer_cfg(lr=1e-2), 1)
    snapshots.take(2)  # keeps 2: version 0 is gone
    assert 0 not in snapshots and 1 in snapshots
    with pytest.raises(KeyError, match="no snapshot of version 0"), snapshots.weights_of(0):
        pass


def test_snapshots_in_rollout_precision_score_the_weights_as_workers_hold_them() -> None:
    from miles.training.snapshots import VersionSnapshots

    backend = FsdpBackend(tiny_model(), trainer_cfg(), 0, 1)
    snapshots = VersionSnapshots(backend, keep=1, dtype=torch.bfloat16)
    snapshots.take(0)
    live = weights(backend)
    worker = tiny_model()  # the same weights, sent in bfloat16
    with torch.no_grad():
        for param in worker.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    samples = global_batch(0)
    held = completion_logprobs(FsdpBackend(worker, trainer_cfg()), samples)
    assert completion_logprobs(backend, samples) != held
    with snapshots.weights_of(0):  # the current version, in the workers' precision
        assert completion_logprobs(backend, samples) == held
    for name, value in weights(backend).items():
        assert torch.equal(value, live[name]), name  # the float32 weights are back, bit for bit


def test_export_params_hf_names_and_values() -> None:
    model = tiny_model()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    backend = FsdpBackend(model, trainer_cfg(), 0, 1)
    exported = weights(backend)
    assert list(exported) == sorted(reference)  # streamed in byte-wise name order
    for name, value in reference.items():
        assert torch.equal(exported[name], value), name
    LlamaForCausalLM(model.config).load_state_dict(exported)  # loadable by a plain HF model


def test_lora_trains_only_the_adapter_and_exports_it_merged_or_alone() -> None:
    base = weights(FsdpBackend(tiny_model(), trainer_cfg(), 0, 1))
    backend = FsdpBackend(tiny_model(), trainer_cfg(lr=1e-2, lora=LORA), 0, 1)
    run_steps(backend, trainer_cfg(lr=1e-2, lora=LORA), 2)
    adapter = dict(backend.export_params(adapter_only=True))
    assert len(adapter) == 2 * (3 * 2 + 1)  # A and B: three modules in two layers, and lm_head
    assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in adapter)
    merged = weights(backend)
    assert list(merged) == sorted(base)
    changed = {n for n in base if not torch.equal(merged[n], base[n])}
    assert changed and all(any(m in n for m in LORA.target_modules) for n in changed)
    model = LlamaForCausalLM(tiny_model().config)
    model.load_state_dict(merged)  # the merged stream is a plain HF state dict


def test_lora_kl_reference_is_the_frozen_base() -> None:
    cfg = trainer_cfg(lr=1e-2, lora=LORA, kl_coef=0.5)
    backend = FsdpBackend(tiny_model(), cfg, 0, 1)
    assert backend.ref_model is None  # no second copy of the model
    metrics = run_steps(backend, cfg, 3)
    assert metrics[0]["kl_ref"] == pytest.approx(0.0, abs=1e-9)  # B = 0 at the start: policy == base
    assert metrics[-1]["kl_ref"] > 0


def test_reference_model_only_with_kl() -> None:
    assert FsdpBackend(tiny_model(), trainer_cfg(), 0, 1).ref_model is None
    assert FsdpBackend(tiny_model(), trainer_cfg(kl_coef=0.1), 0, 1).ref_model is not None
    with pytest.raises(ValueError, match="reference"):
        FsdpBackend(tiny_model(), trainer_cfg(), 0, 1).score([], reference=True)


def test_bfloat16_needs_a_process_group() -> None:
    with pytest.raises(ValueError, match="param_dtype"):
        FsdpBackend(tiny_model(), trainer_cfg(backend={"param_dtype": "bfloat16"}), 0, 1)


# --------------------------------------------------------------------------- two ranks

STEPS = 2
ALGOS: dict[str, dict[str, Any]] = {
    "token_kl": {"kl_coef": 0.1, "entropy_coef": 0.01},
    "sequence": {"loss": {"aggregation": "sequence"}},
    "masked_is": {"off_policy": {"type": "masked_is", "low": 0.2, "high": 5.0}, "minibatches": 2},
    "sequence_is": {"loss": {"aggregation": "sequence"}, "off_policy": "sequence"},
}


def _rank_main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    with distributed(rank, world_size, "127.0.0.1", port, device="cpu", timeout_s=120):
        for name, algo in ALGOS.items():
            cfg = trainer_cfg(backend={"micro_batch_tokens": 12}, **algo)
            backend = FsdpBackend(tiny_model(), cfg, rank, world_size)
            metrics = run_steps(backend, cfg, STEPS, world_size)
            results[name] = {"metrics": metrics, "weights": weights(backend)}
        lora_cfg = trainer_cfg(lr=1e-2, lora=LORA)
        lora = FsdpBackend(tiny_model(), lora_cfg, rank, world_size)
        run_steps(lora, lora_cfg, STEPS, world_size)
        results["lora"] = {"adapter": dict(lora.export_params(adapter_only=True)), "weights": weights(lora)}
        shared_cfg = trainer_cfg(backend={"micro_batch_tokens": 40})
        shared = FsdpBackend(tiny_model(), shared_cfg, rank, world_size)
        metrics = run_steps(shared, shared_cfg, STEPS, world_size, batch=grouped_batch)
        results["shared"] = {"metrics": metrics, "weights": weights(shared)}
        bf16_cfg = trainer_cfg(backend={"param_dtype": "bfloat16"})
        bf16 = FsdpBackend(tiny_model(), bf16_cfg, rank, world_size)
        results["bf16"] = {"metrics": run_steps(bf16, bf16_cfg, 1, world_size), "weights": weights(bf16)}
        results["master_dtypes"] = sorted({str(p.dtype) for p in bf16.model.parameters()})
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("fsdp2")
    spawn_ranks(_rank_main, 2, 2, free_port(), str(out_dir))
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("algo", list(ALGOS))
def test_two_ranks_match_one_rank(two_rank_results: list[dict[str, Any]], algo: str) -> None:
    cfg = trainer_cfg(**ALGOS[algo])
    single = FsdpBackend(tiny_model(), cfg, 0, 1)
    single_metrics = run_steps(single, cfg, STEPS)
    rank0, rank1 = two_rank_results[0][algo], two_rank_results[1][algo]
    expected = weights(single)
    for name, value in expected.items():
        torch.testing.assert_close(rank0["weights"][name], value, rtol=0, atol=1e-5, msg=name)
        assert rank1["weights"][name].numel() == 0  # rank 0 consumes the export; rank 1 only takes part
    for step in range(STEPS):
        assert rank0["metrics"][step] == rank1["metrics"][step]  # identical on every rank
        for key, value in single_metrics[step].items():
            assert rank0["metrics"][step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)


@pytest.mark.slow
def test_two_ranks_with_shared_prompts_match_one_rank_packing_whole(two_rank_results: list[dict[str, Any]]) -> None:
    cfg = trainer_cfg(backend={"share_prompts": False})
    single = FsdpBackend(tiny_model(), cfg, 0, 1)
    single_metrics = run_steps(single, cfg, STEPS, batch=grouped_batch)
    got = two_rank_results[0]["shared"]
    for name, value in weights(single).items():
        torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=1e-5, msg=name)
    for step in range(STEPS):
        for key, value in single_metrics[step].items():
            assert got["metrics"][step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)


@pytest.mark.slow
def test_two_rank_lora_matches_one_rank(two_rank_results: list[dict[str, Any]]) -> None:
    cfg = trainer_cfg(lr=1e-2, lora=LORA)
    single = FsdpBackend(tiny_model(), cfg, 0, 1)
    run_steps(single, cfg, STEPS)
    expected = dict(single.export_params(adapter_only=True))
    got = two_rank_results[0]["lora"]["adapter"]
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)
    for name, value in weights(single).items():
        torch.testing.assert_close(two_rank_results[0]["lora"]["weights"][name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_master_weights(two_rank_results: list[dict[str, Any]]) -> None:
    """Mixed precision over gloo: float32 parameters (the master copy), a bf16 step close to the fp32 one."""
    assert two_rank_results[0]["master_dtypes"] == ["torch.float32"]
    cfg = trainer_cfg()
    single = FsdpBackend(tiny_model(), cfg, 0, 1)
    (fp32,) = run_steps(single, cfg, 1)
    (bf16,) = two_rank_results[0]["bf16"]["metrics"]
    assert bf16["entropy"] == pytest.approx(fp32["entropy"], rel=2e-2)
    assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=5e-2)
    for name, value in weights(single).items():
        delta = (two_rank_results[0]["bf16"]["weights"][name] - value).abs().max().item()
        assert delta < 2e-3, name  # one step of lr 1e-3: within a bf16 rounding of the update
