"""FsdpBackend on a tiny random Llama: learning signal, DP equivalence, exact resume, export."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from miles.backends.base import TrainSample
from miles.backends.distributed import distributed, find_free_port
from miles.backends.fsdp import FsdpBackend
from miles.config import AlgoConfig, FsdpBackendConfig, LoraConfig, TrainerConfig

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
    micro_batch_size: int | None = None, lr: float = 1e-3, lora: LoraConfig | None = None, **algo: Any
) -> TrainerConfig:
    """lr is small by default: Adam's first step maps a gradient g to ~lr * g / (|g| + eps), which
    amplifies float-rounding differences of near-zero gradients, and the equivalence tests compare
    updated weights to 1e-5."""
    return TrainerConfig(
        lr=lr,
        algo=AlgoConfig(**algo),
        backend=FsdpBackendConfig(threads=1, micro_batch_size=micro_batch_size),
        lora=lora,
    )


LORA = LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj", "down_proj"])


def global_batch(step: int) -> list[TrainSample]:
    """Six samples of different prompt/output lengths, advantages of both signs."""
    g = torch.Generator().manual_seed(100 + step)
    samples = []
    for i, (p, o) in enumerate([(3, 4), (2, 6), (5, 1), (4, 3), (2, 2), (3, 5)]):
        ids = torch.randint(1, VOCAB, (p + o,), generator=g).tolist()
        behaviour = (-torch.rand(o, generator=g) * 3).tolist()
        samples.append(
            TrainSample(ids[:p], ids[p:], behaviour, advantage=(-1.0) ** i * (0.5 + i / 4), weight_version=0)
        )
    return samples


def shard(samples: list[TrainSample], rank: int) -> list[TrainSample]:
    """Uneven split on purpose (4 + 2), so micro-batch padding and global normalisation are exercised."""
    return samples[:4] if rank == 0 else samples[4:]


def weights(backend: FsdpBackend) -> dict[str, torch.Tensor]:
    return backend.export_weights(torch.float32)


# --------------------------------------------------------------------------- single process


def test_positive_advantage_raises_logprob() -> None:
    backend = FsdpBackend(tiny_model(), PAD, trainer_cfg(lr=1e-2), 0, 1)
    sample = TrainSample([1, 2, 3], [4, 5, 6], [-3.0, -3.0, -3.0], advantage=1.0, weight_version=0)
    other = TrainSample([7, 8], [9, 10], [-3.0, -3.0], advantage=-1.0, weight_version=0)
    before = backend.logprobs([sample, other])
    result = backend.train_step([sample, other])
    after = backend.logprobs([sample, other])
    assert sum(after[0]) > sum(before[0])
    assert sum(after[1]) < sum(before[1])
    assert result.metrics["num_tokens"] == 5 and result.metrics["num_sequences"] == 2
    assert result.metrics["clip_frac"] == 0.0 and result.metrics["ppo_kl"] == 0.0  # proximal = current weights
    assert result.metrics["logp_mismatch"] == pytest.approx(
        sum(abs(lp + 3.0) for row in before for lp in row) / 5, rel=1e-5
    )


OFF_POLICY_MODES = ("none", "tis", "masked_is", "sequence", "decoupled_ppo")
OFF_POLICY_METRICS = ("logp_mismatch", "behaviour_kl", "is_weight_mean", "is_ess", "is_clipped_frac")


@pytest.mark.parametrize("mode", OFF_POLICY_MODES)
def test_stale_behaviour_step_reports_offpolicy_metrics(mode: str) -> None:
    """Behaviour log-probs off the proximal ones by log-ratios of both signs (some tokens and sequences beyond
    every clip and band; the one-token sample has ratio e > tis_clip)."""
    backend = FsdpBackend(tiny_model(), PAD, trainer_cfg(micro_batch_size=4, off_policy=mode), 0, 1)
    samples = global_batch(0)
    prox = backend.logprobs(samples)
    shifts = iter([-1.0, 0.3, 0.9, -0.2, 1.5] * 5)  # log pi_behaviour - log pi_prox, token by token
    samples = [
        TrainSample(s.prompt_ids, s.output_ids, [p + next(shifts) for p in row], s.advantage, s.weight_version)
        for s, row in zip(samples, prox, strict=True)
    ]
    metrics = backend.train_step(samples).metrics
    pairs = [(p, b) for s, row in zip(samples, prox, strict=True) for p, b in zip(row, s.behaviour_logprobs)]
    assert metrics["num_tokens"] == len(pairs)
    assert metrics["logp_mismatch"] == pytest.approx(sum(abs(p - b) for p, b in pairs) / len(pairs), rel=1e-5)
    k3 = sum(math.exp(p - b) - 1 - (p - b) for p, b in pairs) / len(pairs)
    assert metrics["behaviour_kl"] == pytest.approx(k3, rel=1e-4)
    assert all(math.isfinite(metrics[k]) for k in OFF_POLICY_METRICS)
    assert 0 < metrics["is_ess"] <= 1 and 0 <= metrics["is_clipped_frac"] <= 1
    if mode == "none":
        assert metrics["is_ess"] == 1.0 and metrics["is_clipped_frac"] == 0.0 and metrics["ppo_kl"] == 0.0
    else:
        assert metrics["is_ess"] < 1 and metrics["is_clipped_frac"] > 0
    if mode in ("tis", "decoupled_ppo"):  # the effective weight is min(pi_prox / pi_behaviour, tis_clip)
        w = [min(math.exp(p - b), 2.0) for p, b in pairs]
        assert metrics["is_ess"] == pytest.approx(sum(w) ** 2 / (len(w) * sum(x * x for x in w)), rel=1e-4)
    if mode == "tis":  # the ratio is against the behaviour policy: ppo_kl = mean(behaviour - proximal)
        assert metrics["ppo_kl"] == pytest.approx(sum(b - p for p, b in pairs) / len(pairs), rel=1e-4)
    else:  # proximal = current weights at the step start
        assert metrics["ppo_kl"] == 0.0


@pytest.mark.parametrize("mode", OFF_POLICY_MODES)
def test_on_policy_behaviour_makes_every_mode_equal_none(mode: str) -> None:
    """max_staleness 0 and no numeric mismatch: behaviour == proximal, so every correction is a no-op."""

    def on_policy(backend: FsdpBackend) -> list[TrainSample]:
        samples = global_batch(0)
        return [
            TrainSample(s.prompt_ids, s.output_ids, lp, s.advantage, s.weight_version)
            for s, lp in zip(samples, backend.logprobs(samples), strict=True)
        ]

    plain = FsdpBackend(tiny_model(), PAD, trainer_cfg(micro_batch_size=4, off_policy="none"), 0, 1)
    corrected = FsdpBackend(tiny_model(), PAD, trainer_cfg(micro_batch_size=4, off_policy=mode), 0, 1)
    expected = plain.train_step(on_policy(plain)).metrics
    metrics = corrected.train_step(on_policy(corrected)).metrics
    assert abs(metrics["ppo_kl"]) < 1e-6
    assert metrics["logp_mismatch"] < 1e-6 and abs(metrics["behaviour_kl"]) < 1e-6
    assert metrics["is_ess"] == pytest.approx(1.0) and metrics["is_weight_mean"] == pytest.approx(1.0)
    assert metrics["is_clipped_frac"] == 0.0
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for (name, a), b in zip(weights(plain).items(), weights(corrected).values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_micro_batches_match_one_batch() -> None:
    whole = FsdpBackend(tiny_model(), PAD, trainer_cfg(), 0, 1)
    micro = FsdpBackend(tiny_model(), PAD, trainer_cfg(micro_batch_size=4), 0, 1)
    m_whole = whole.train_step(global_batch(0)).metrics
    m_micro = micro.train_step(global_batch(0)).metrics
    for key, value in m_whole.items():
        assert m_micro[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for (name, a), b in zip(weights(whole).items(), weights(micro).values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)


def test_checkpoint_resume_is_bit_identical(tmp_path: Path) -> None:
    cfg = trainer_cfg(kl_coef=0.1, entropy_coef=0.01)
    uninterrupted = FsdpBackend(tiny_model(0), PAD, cfg, 0, 1)
    uninterrupted.train_step(global_batch(0))
    ckpt = tmp_path / "ckpt" / "step-1.pt"
    uninterrupted.save_checkpoint(str(ckpt), {"version": 1, "bus": {"seq": 42}})
    expected = uninterrupted.train_step(global_batch(1)).metrics

    restored = FsdpBackend(tiny_model(seed=7), PAD, cfg, 0, 1)  # different init: everything must come from disk
    assert restored.load_checkpoint(str(ckpt)) == {"version": 1, "bus": {"seq": 42}}
    assert restored.train_step(global_batch(1)).metrics == expected
    for (name, a), b in zip(weights(uninterrupted).items(), weights(restored).values(), strict=True):
        assert torch.equal(a, b), name
    assert [p.name for p in tmp_path.joinpath("ckpt").iterdir()] == ["step-1.pt"]  # no temp file left


def test_export_weights_hf_names_and_dtype() -> None:
    model = tiny_model()
    expected_names = list(model.state_dict())
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    backend = FsdpBackend(model, PAD, trainer_cfg(), 0, 1)
    exported = backend.export_weights(torch.bfloat16)
    assert list(exported) == expected_names
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in exported.values())
    assert torch.equal(exported["lm_head.weight"], reference["lm_head.weight"].to(torch.bfloat16))
    fresh = LlamaForCausalLM(model.config)
    fresh.load_state_dict({k: v.float() for k, v in exported.items()})  # loadable by a plain HF model
    backend.train_step(global_batch(0))
    assert torch.equal(exported["lm_head.weight"], reference["lm_head.weight"].to(torch.bfloat16))  # a snapshot


# --------------------------------------------------------------------------- two ranks


STEPS = 2
ALGOS: dict[str, dict[str, Any]] = {
    "token_kl": {"aggregation": "token", "kl_coef": 0.1, "entropy_coef": 0.01},
    "sequence": {"aggregation": "sequence"},
    "masked_is": {"off_policy": "masked_is", "mis_low": 0.2, "mis_high": 5.0},
    "sequence_is": {"aggregation": "sequence", "off_policy": "sequence"},
}


def _rank_main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    with distributed(rank, world_size, "127.0.0.1", port, device="cpu", timeout_s=120):
        backends: dict[str, FsdpBackend] = {}
        for name, algo in ALGOS.items():
            backend = backends[name] = FsdpBackend(
                tiny_model(), PAD, trainer_cfg(micro_batch_size=2, **algo), rank, world_size
            )
            metrics = [backend.train_step(shard(global_batch(step), rank)).metrics for step in range(STEPS)]
            results[name] = {
                "metrics": metrics,
                "weights": weights(backend),
                "logprobs": backend.logprobs(shard(global_batch(0), rank)),
            }

        lora = FsdpBackend(tiny_model(), PAD, trainer_cfg(micro_batch_size=2, lr=1e-2, lora=LORA), rank, world_size)
        for step in range(STEPS):
            lora.train_step(shard(global_batch(step), rank))
        results["lora"] = {"adapter": lora.export_adapter(torch.float32), "weights": weights(lora)}

        # Resume: save after STEPS, take one more step, then restore into a fresh differently-initialised backend.
        backend = backends["token_kl"]
        cfg = trainer_cfg(micro_batch_size=2, **ALGOS["token_kl"])
        ckpt = str(Path(out_dir) / "ckpt.pt")
        backend.save_checkpoint(ckpt, {"version": STEPS})
        next_metrics = backend.train_step(shard(global_batch(STEPS), rank)).metrics
        restored = FsdpBackend(tiny_model(seed=3), PAD, cfg, rank, world_size)
        extra = restored.load_checkpoint(ckpt)
        resumed_metrics = restored.train_step(shard(global_batch(STEPS), rank)).metrics
        results["resume"] = {
            "checkpoint": ckpt,
            "extra": extra,
            "next": next_metrics,
            "resumed": resumed_metrics,
            "weights": weights(backend),
            "resumed_weights": weights(restored),
        }
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("fsdp2")
    mp.spawn(_rank_main, args=(2, find_free_port(), str(out_dir)), nprocs=2, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("algo", list(ALGOS))
def test_two_ranks_match_one_rank(two_rank_results: list[dict[str, Any]], algo: str) -> None:
    single = FsdpBackend(tiny_model(), PAD, trainer_cfg(**ALGOS[algo]), 0, 1)
    single_metrics = [single.train_step(global_batch(step)).metrics for step in range(STEPS)]
    rank0, rank1 = two_rank_results[0][algo], two_rank_results[1][algo]

    assert rank1["weights"] == {}  # export is rank 0 only
    expected = weights(single)
    assert list(rank0["weights"]) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(rank0["weights"][name], value, rtol=0, atol=1e-5, msg=name)
    for step in range(STEPS):
        assert rank0["metrics"][step] == rank1["metrics"][step]  # identical on every rank
        for key, value in single_metrics[step].items():
            assert rank0["metrics"][step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)

    single_logprobs = single.logprobs(global_batch(0))
    for got, want in zip(rank0["logprobs"] + rank1["logprobs"], single_logprobs, strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_two_rank_lora_matches_one_rank(two_rank_results: list[dict[str, Any]]) -> None:
    single = FsdpBackend(tiny_model(), PAD, trainer_cfg(lr=1e-2, lora=LORA), 0, 1)
    for step in range(STEPS):
        single.train_step(global_batch(step))
    rank0, rank1 = two_rank_results[0]["lora"], two_rank_results[1]["lora"]
    assert rank1["adapter"] == {} and rank1["weights"] == {}
    expected = single.export_adapter(torch.float32)
    assert sorted(rank0["adapter"]) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(rank0["adapter"][name], value, rtol=0, atol=1e-5, msg=name)
    for name, value in weights(single).items():
        torch.testing.assert_close(rank0["weights"][name], value, rtol=0, atol=1e-5, msg=name)


def test_lora_trains_only_the_adapter_and_exports_it_merged() -> None:
    base = weights(FsdpBackend(tiny_model(), PAD, trainer_cfg(), 0, 1))
    backend = FsdpBackend(tiny_model(), PAD, trainer_cfg(lr=1e-2, lora=LORA), 0, 1)
    adapter0 = backend.export_adapter(torch.float32)
    assert len(adapter0) == 2 * 3 * 2  # A and B, three modules, two layers
    assert all(name.startswith("base_model.model.model.layers.") for name in adapter0)
    assert all(torch.count_nonzero(t) == 0 for n, t in adapter0.items() if ".lora_B." in n)  # B = 0: no change yet
    for _ in range(3):
        backend.train_step(global_batch(0))
    adapter = backend.export_adapter(torch.float32)
    assert any(not torch.equal(adapter[n], adapter0[n]) for n in adapter)
    merged = weights(backend)
    assert list(merged) == list(base)  # plain HF names, nothing from peft
    adapted = {n for n in merged if n.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight"))}
    assert len(adapted) == 6
    for name, value in base.items():
        if name in adapted:
            module = name.removesuffix(".weight")
            a = adapter[f"base_model.model.{module}.lora_A.weight"]
            b = adapter[f"base_model.model.{module}.lora_B.weight"]
            torch.testing.assert_close(merged[name], value + (LORA.alpha / LORA.rank) * b @ a)
            assert not torch.equal(merged[name], value)
        else:
            assert torch.equal(merged[name], value), name  # frozen: bit-identical to the base
    with pytest.raises(ValueError, match="needs trainer.lora"):
        FsdpBackend(tiny_model(), PAD, trainer_cfg(), 0, 1).export_adapter(torch.float32)


def test_lora_kl_reference_is_the_frozen_base_without_a_copy() -> None:
    """With LoRA the KL reference is the base with the adapters off: the same penalty as a copied base."""
    batch = global_batch(0)
    lora = FsdpBackend(tiny_model(), PAD, trainer_cfg(lr=1e-2, lora=LORA, kl_coef=0.5), 0, 1)
    assert lora.ref_model is None
    first = lora.train_step(batch).metrics
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-9)  # B = 0: the policy is the base
    second = lora.train_step(batch).metrics
    assert second["kl_ref"] > 0  # the adapter moved the policy away from the base
    # The same penalty computed against an explicit base copy (a full fine-tuning reference).
    base = FsdpBackend(tiny_model(), PAD, trainer_cfg(), 0, 1)
    base_logps = base.logprobs(batch)
    with lora.model.disable_adapter():  # type: ignore[operator]
        off = lora.logprobs(batch)
    for got, want in zip(off, base_logps, strict=True):
        assert got == pytest.approx(want, abs=1e-6)


def test_two_rank_resume_is_bit_identical(two_rank_results: list[dict[str, Any]]) -> None:
    for rank in range(2):
        res = two_rank_results[rank]["resume"]
        assert res["extra"] == {"version": STEPS}
        assert res["resumed"] == res["next"]
    rank0 = two_rank_results[0]["resume"]
    assert rank0["weights"]
    for name, value in rank0["weights"].items():
        assert torch.equal(rank0["resumed_weights"][name], value), name


def test_one_rank_process_group_shards_and_matches_unsharded() -> None:
    """world_size 1 with a joined process group goes through fully_shard (a one-device mesh)."""
    from torch.distributed.fsdp import FSDPModule

    plain = FsdpBackend(tiny_model(), PAD, trainer_cfg(kl_coef=0.1), 0, 1)
    plain_metrics = plain.train_step(global_batch(0)).metrics
    with distributed(0, 1, "127.0.0.1", find_free_port(), timeout_s=60):
        sharded = FsdpBackend(tiny_model(), PAD, trainer_cfg(kl_coef=0.1), 0, 1)
        assert sharded.sharded and isinstance(sharded.model, FSDPModule)
        assert isinstance(sharded.ref_model, FSDPModule)
        sharded_metrics = sharded.train_step(global_batch(0)).metrics
        sharded_weights = weights(sharded)
    for key, value in plain_metrics.items():
        assert sharded_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name, value in weights(plain).items():
        torch.testing.assert_close(sharded_weights[name], value, rtol=0, atol=1e-5, msg=name)


def test_reference_model_only_with_kl() -> None:
    assert FsdpBackend(tiny_model(), PAD, trainer_cfg(), 0, 1).ref_model is None
    assert FsdpBackend(tiny_model(), PAD, trainer_cfg(kl_coef=0.05), 0, 1).ref_model is not None


def test_two_rank_checkpoint_resumes_on_one_rank(two_rank_results: list[dict[str, Any]]) -> None:
    """Full state dicts make checkpoints independent of the rank count."""
    res = two_rank_results[0]["resume"]
    single = FsdpBackend(tiny_model(seed=5), PAD, trainer_cfg(**ALGOS["token_kl"]), 0, 1)
    assert single.load_checkpoint(res["checkpoint"]) == {"version": STEPS}
    metrics = single.train_step(global_batch(STEPS)).metrics
    for key, value in res["next"].items():
        assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    for name, value in weights(single).items():
        torch.testing.assert_close(res["weights"][name], value, rtol=0, atol=1e-5, msg=name)


def test_lr_schedule_is_applied_and_resumes_where_it_stopped(tmp_path: Path) -> None:
    cfg = TrainerConfig(lr=1e-3, steps=4, lr_schedule="linear", min_lr_ratio=0.0, backend=FsdpBackendConfig(threads=1))
    backend = FsdpBackend(tiny_model(), PAD, cfg, 0, 1)
    lrs = [backend.train_step(global_batch(s)).metrics["lr"] for s in range(2)]
    assert lrs == pytest.approx([1e-3, 2e-3 / 3])
    backend.save_checkpoint(str(tmp_path / "c.pt"), {})
    restored = FsdpBackend(tiny_model(seed=1), PAD, cfg, 0, 1)
    restored.load_checkpoint(str(tmp_path / "c.pt"))
    assert restored.train_step(global_batch(2)).metrics["lr"] == pytest.approx(1e-3 / 3)


def test_load_checkpoint_errors(tmp_path: Path) -> None:
    plain = FsdpBackend(tiny_model(), PAD, trainer_cfg(), 0, 1)
    plain.save_checkpoint(str(tmp_path / "plain.pt"), {})
    with pytest.raises(ValueError, match="reference"):
        FsdpBackend(tiny_model(), PAD, trainer_cfg(kl_coef=0.1), 0, 1).load_checkpoint(str(tmp_path / "plain.pt"))
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="format"):
        plain.load_checkpoint(str(tmp_path / "other.pt"))


def test_logprobs_ignores_behaviour() -> None:
    backend = FsdpBackend(tiny_model(), PAD, trainer_cfg(), 0, 1)
    with_behaviour = TrainSample([1, 2], [3, 4], [-1.0, -1.0], 0.0, 0)
    without = TrainSample([1, 2], [3, 4], [], 0.0, 0)
    assert backend.logprobs([without]) == backend.logprobs([with_behaviour])
