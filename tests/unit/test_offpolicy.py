"""Off-policy corrections (miles.algo.offpolicy), checked against hand-computed weights and metrics."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from miles.algo.losses import policy_loss
from miles.algo.offpolicy import METRIC_KEYS, SUM_KEYS, build_correction, correct_rows, summarize
from miles.config import AlgoConfig, ConfigError, load_config
from miles.plugins import PluginError

OFF_POLICY_MODES = ("none", "behaviour_ratio", "masked_is", "sequence", "decoupled_ppo")
CFG = SimpleNamespace(clip=2.0, low=0.5, high=2.0)
CLIP = {"clip_low": 0.2, "clip_high": 0.28}
F64 = torch.float64

# k = pi_prox / pi_behaviour per token; row 1 has two padding positions (mask 0, junk log-probs).
RATIOS = [[1.0, 3.0, 0.25, 1.5], [0.8, 1.25, 7.0, 0.01]]
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])


def _logps(ratios: list[list[float]] = RATIOS) -> tuple[torch.Tensor, torch.Tensor]:
    behaviour = torch.full((len(ratios), len(ratios[0])), math.log(0.1), dtype=F64)
    prox = behaviour + torch.tensor(ratios, dtype=F64).log()
    return prox, behaviour


def _correction(mode: str, cfg: SimpleNamespace = CFG):  # type: ignore[no-untyped-def]
    """The registered correction ``mode`` with the bounds of ``cfg`` (``cap`` for behaviour_ratio is its clip)."""
    return build_correction(SimpleNamespace(type=mode, cap=cfg.clip, **vars(cfg)))


def importance_weights(mode: str, prox, behaviour, mask, cfg=CFG):  # type: ignore[no-untyped-def]
    out = correct_rows(_correction(mode, cfg), prox, behaviour, mask)
    return out.token_weights, out.sums


def ratio_base(mode: str, prox, behaviour):  # type: ignore[no-untyped-def]
    return correct_rows(_correction(mode), prox, behaviour, torch.ones_like(prox)).ratio_base


def ratio_cap(mode: str, cfg=CFG):  # type: ignore[no-untyped-def]
    prox = torch.zeros(1, 1)
    return correct_rows(_correction(mode, cfg), prox, prox, torch.ones(1, 1)).ratio_cap


def _weights(mode: str, cfg: SimpleNamespace = CFG) -> tuple[torch.Tensor | None, dict[str, float]]:
    prox, behaviour = _logps()
    weights, sums = importance_weights(mode, prox, behaviour, MASK, cfg)
    assert set(sums) == set(SUM_KEYS)
    return weights, {k: float(v) for k, v in sums.items()}


# --------------------------------------------------------------------------- weights by hand


def test_none_has_no_weights() -> None:
    weights, sums = _weights("none")
    assert weights is None
    assert sums["is_tokens"] == 6 and sums["is_weight"] == 6 and sums["is_weight_sq"] == 6
    assert sums["is_clipped"] == 0


def test_decoupled_ppo_truncates_token_ratios() -> None:
    weights, sums = _weights("decoupled_ppo")
    assert weights is not None
    expected = torch.tensor([[1.0, 2.0, 0.25, 1.5], [0.8, 1.25, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(weights, expected)
    assert sums["is_clipped"] == 1  # the 3.0
    assert sums["is_weight"] == pytest.approx(1 + 2 + 0.25 + 1.5 + 0.8 + 1.25)


def test_behaviour_ratio_moves_the_correction_into_the_ratio() -> None:
    weights, sums = _weights("behaviour_ratio")
    assert weights is None  # no extra weight: the ratio is pi_theta / pi_behaviour, truncated
    _, decoupled = _weights("decoupled_ppo")
    assert sums == pytest.approx(decoupled)  # its effective weight at the step start is min(k, clip)
    prox, behaviour = _logps()
    assert ratio_base("behaviour_ratio", prox, behaviour) is behaviour and ratio_cap("behaviour_ratio", CFG) == 2.0  # type: ignore[arg-type]
    for mode in ("none", "masked_is", "sequence", "decoupled_ppo"):
        assert ratio_base(mode, prox, behaviour) is prox and ratio_cap(mode, CFG) is None  # type: ignore[arg-type]


def test_masked_is_zeroes_tokens_outside_the_band_and_keeps_the_ratio() -> None:
    weights, sums = _weights("masked_is")
    assert weights is not None
    expected = torch.tensor([[1.0, 0.0, 0.0, 1.5], [0.8, 1.25, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(weights, expected)
    assert sums["is_clipped"] == 2  # 3.0 above, 0.25 below; padding never counts


def test_sequence_weights_are_truncated_products_broadcast_to_tokens() -> None:
    weights, sums = _weights("sequence")
    assert weights is not None
    # row 0: 1 * 3 * 0.25 * 1.5 = 1.125; row 1: 0.8 * 1.25 = 1 (padding ratios ignored)
    expected = torch.tensor([[1.125] * 4, [1.0, 1.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(weights, expected)
    assert sums["is_clipped"] == 0
    weights, sums = _weights("sequence", SimpleNamespace(clip=1.1, low=0.5, high=2.0))
    assert weights is not None
    torch.testing.assert_close(weights, torch.tensor([[1.1] * 4, [1.0, 1.0, 0.0, 0.0]], dtype=F64))
    assert sums["is_clipped"] == 4  # every token of the truncated sequence


def test_weights_are_detached_and_keep_the_dtype() -> None:
    prox = torch.zeros(1, 2, requires_grad=True)
    weights, _ = importance_weights("decoupled_ppo", prox, torch.zeros(1, 2), torch.ones(1, 2), CFG)  # type: ignore[arg-type]
    assert weights is not None and not weights.requires_grad and weights.dtype == torch.float32


def test_unknown_mode_raises() -> None:
    prox, behaviour = _logps()
    with pytest.raises(PluginError, match="unknown off-policy correction 'vtrace'"):
        importance_weights("vtrace", prox, behaviour, MASK, CFG)


# --------------------------------------------------------------------------- metrics


def test_ess_mismatch_and_kl_on_a_known_example() -> None:
    prox, behaviour = _logps([[2.0, 1.0, 1.0, 0.5]])
    _, sums = importance_weights("decoupled_ppo", prox, behaviour, torch.ones(1, 4), CFG)  # type: ignore[arg-type]
    metrics = summarize({k: float(v) for k, v in sums.items()})
    assert set(metrics) == set(METRIC_KEYS)
    # w = [2, 1, 1, 0.5]: (sum w)^2 / (N sum w^2) = 4.5^2 / (4 * 6.25) = 0.81
    assert metrics["is_ess"] == pytest.approx(0.81)
    assert metrics["is_weight_mean"] == pytest.approx(4.5 / 4)
    assert metrics["is_clipped_frac"] == 0.0  # 2.0 is at the clip, not above
    assert metrics["logp_mismatch"] == pytest.approx(2 * math.log(2) / 4)
    # k3 = k - 1 - log k: 2 -> 1 - ln 2, 0.5 -> -0.5 + ln 2
    assert metrics["behaviour_kl"] == pytest.approx(0.5 / 4)


def test_ess_edge_cases() -> None:
    zero = dict.fromkeys(SUM_KEYS, 0.0)
    assert summarize(zero)["is_ess"] == 1.0  # empty batch
    assert summarize({**zero, "is_tokens": 3.0})["is_ess"] == 0.0  # every weight masked
    uniform = {**zero, "is_tokens": 3.0, "is_weight": 3 * 0.7, "is_weight_sq": 3 * 0.49}
    assert summarize(uniform)["is_ess"] == pytest.approx(1.0)


def test_sums_add_over_shards() -> None:
    prox, behaviour = _logps()
    for mode in OFF_POLICY_MODES:
        _, whole = importance_weights(mode, prox, behaviour, MASK, CFG)  # type: ignore[arg-type]
        parts = [
            importance_weights(mode, prox[i : i + 1], behaviour[i : i + 1], MASK[i : i + 1], CFG)[1] for i in (0, 1)
        ]  # type: ignore[arg-type]
        added = {k: float(parts[0][k] + parts[1][k]) for k in SUM_KEYS}
        assert summarize(added) == pytest.approx(summarize({k: float(v) for k, v in whole.items()})), mode


# --------------------------------------------------------------------------- with the loss


def _loss(mode: str, logp: torch.Tensor, prox: torch.Tensor, behaviour: torch.Tensor, **kw: object):  # type: ignore[no-untyped-def]
    weights, _ = importance_weights(mode, prox, behaviour, MASK, CFG)  # type: ignore[arg-type]
    return policy_loss(
        logp,
        ratio_base(mode, prox, behaviour),
        torch.tensor([1.0, -1.0]),
        MASK,
        token_weights=weights,
        ratio_cap=ratio_cap(mode, CFG),  # type: ignore[arg-type]
        **CLIP,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("mode", OFF_POLICY_MODES)
def test_on_policy_every_mode_equals_none(mode: str, aggregation: str) -> None:
    """behaviour == prox: every weight is 1 and loss, metrics and gradients are those of 'none'."""
    prox = torch.log(torch.tensor([[0.3, 0.1, 0.5, 0.2], [0.6, 0.05, 0.9, 0.9]], dtype=F64))
    drift = torch.tensor([[0.1, -0.3, 0.2, 0.05], [-0.1, 0.15, 0.0, 0.0]], dtype=F64)  # pi_theta != pi_prox
    weights, sums = importance_weights(mode, prox, prox.clone(), MASK, CFG)  # type: ignore[arg-type]
    if weights is not None:
        torch.testing.assert_close(weights, MASK.to(F64))
    metrics = summarize({k: float(v) for k, v in sums.items()})
    assert metrics == pytest.approx(
        {"logp_mismatch": 0, "behaviour_kl": 0, "is_weight_mean": 1, "is_ess": 1, "is_clipped_frac": 0}
    )

    results = []
    for m in ("none", mode):
        logp = (prox + drift).clone().requires_grad_(True)
        out = _loss(m, logp, prox, prox.clone(), aggregation=aggregation)
        out.loss.backward()
        results.append((out, logp.grad))
    (base, base_grad), (got, got_grad) = results
    torch.testing.assert_close(got.loss, base.loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_grad, base_grad, rtol=0, atol=1e-12)
    for key, value in base.metrics.items():
        torch.testing.assert_close(got.metrics[key], value, rtol=0, atol=1e-12, msg=key)


def test_masked_tokens_get_zero_gradient() -> None:
    prox, behaviour = _logps()
    logp = prox.clone().requires_grad_(True)
    _loss("masked_is", logp, prox, behaviour).loss.backward()
    assert logp.grad is not None
    outside = torch.tensor([[False, True, True, False], [False, False, True, True]])  # masked or padding
    assert torch.all(logp.grad[outside] == 0)
    assert torch.all(logp.grad[~outside] != 0)
    # at pi_theta = pi_prox the ratio is 1, so d loss / d logp = -A * w / N per kept token
    assert logp.grad[0, 3].item() == pytest.approx(-1.5 / 6)
    assert logp.grad[1, 1].item() == pytest.approx(1.25 / 6)


def test_behaviour_ratio_is_decoupled_ppo_at_the_step_start_except_for_the_clip() -> None:
    """At pi_theta = pi_prox the 'behaviour_ratio' ratio is k: its gradient is -A min(k, clip) like
    'decoupled_ppo', except on tokens the PPO clip (or the truncation) cuts: A > 0 with k > 1 + clip_high,
    A < 0 with k < 1 - clip_low or k > cap."""
    prox, behaviour = _logps()
    grads = {}
    for mode in ("behaviour_ratio", "decoupled_ppo"):
        logp = prox.clone().requires_grad_(True)
        out = _loss(mode, logp, prox, behaviour)
        out.loss.backward()
        grads[mode] = logp.grad
    # row 0 (A = +1): k = [1, 3, 0.25, 1.5] -> 'behaviour_ratio' clips 3 and 1.5 (> 1.28)
    torch.testing.assert_close(grads["decoupled_ppo"][0], torch.tensor([-1, -2, -0.25, -1.5], dtype=F64) / 6)
    torch.testing.assert_close(grads["behaviour_ratio"][0], torch.tensor([-1, 0, -0.25, 0], dtype=F64) / 6)
    # row 1 (A = -1): k = [0.8, 1.25] are inside [0.8, 2]: identical
    torch.testing.assert_close(grads["behaviour_ratio"][1], grads["decoupled_ppo"][1])


def test_ratio_cap_is_dual_clip_for_negative_advantages() -> None:
    logp = torch.tensor([[math.log(3.0), math.log(1.5)]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=F64)
    out = policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), ratio_cap=2.0, **CLIP)
    # A = -1: max(r, clip(r)) with r truncated at 2 -> [2, 1.5]; the truncated token has no gradient
    assert out.loss.item() == pytest.approx((2.0 + 1.5) / 2)
    assert out.metrics["clip_frac"].item() == pytest.approx(0.5)
    assert out.metrics["ppo_kl"].item() == pytest.approx(-(math.log(3.0) + math.log(1.5)) / 2)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 1.5 / 2]], dtype=F64))
    with pytest.raises(ValueError, match="ratio_cap"):
        policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), ratio_cap=0.0, **CLIP)


def test_config_modes_and_bounds() -> None:
    assert AlgoConfig().off_policy.type == "decoupled_ppo"
    for mode in OFF_POLICY_MODES:
        assert AlgoConfig(off_policy=mode).off_policy.type == mode  # type: ignore[arg-type]  # shorthand
    bad = (
        {"type": "masked_is", "low": 1.5},
        {"type": "masked_is", "high": 0.9},
        {"type": "decoupled_ppo", "clip": 0.5},
    )
    for section in (*bad, "vtrace"):
        with pytest.raises(ValidationError):
            AlgoConfig(off_policy=section)  # type: ignore[arg-type]


def test_the_old_tis_name_is_refused_with_a_hint() -> None:
    with pytest.raises(ConfigError, match="'tis' was renamed: 'behaviour_ratio'"):
        load_config(None, ["trainer.algo.off_policy=tis"])
    with pytest.raises(ConfigError, match="'tis' was renamed"):
        load_config(None, ["trainer.algo.off_policy.type=tis"])


def test_a_users_correction_by_import_path() -> None:
    algo = AlgoConfig(off_policy={"type": "custom", "path": "tests.unit.test_offpolicy:halving", "params": {"f": 0.5}})
    out = correct_rows(build_correction(algo.off_policy), *_logps(), MASK)
    torch.testing.assert_close(out.token_weights, MASK.to(F64) * 0.5)
    with pytest.raises(PluginError, match="cannot import module"):
        build_correction(AlgoConfig(off_policy={"type": "custom", "path": "no_such_mod:f"}).off_policy)


def halving(cfg):  # type: ignore[no-untyped-def]
    """A user's correction: every trained token weighted by params.f (for the import-path test)."""
    inner = build_correction(SimpleNamespace(type="none"))

    def correct(prox, behaviour, mask, seq_index):  # type: ignore[no-untyped-def]
        out = inner(prox, behaviour, mask, seq_index)
        out.token_weights = mask.to(prox.dtype) * cfg.params["f"]
        return out

    return correct
