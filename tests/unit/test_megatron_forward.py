"""The forward step megatron's schedule calls, driven on CPU the way the schedule drives it.

``forward_backward_no_pipelining`` (CUDA-only: it allocates a CUDA token counter) does, per micro-batch,
``output, loss_func = forward_step(iterator, model)``, ``loss, num_tokens, extra = loss_func(output)`` and
with ``calculate_per_token_loss=True`` back-propagates ``loss`` unchanged. :func:`_schedule` does exactly
that, so the loss plumbing, the vocab-parallel log-probs and the gradients are checked against the HF
model with the same algorithm loss (Miles' PPO loss from :mod:`miles.algo.losses`).
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from miles.algo.losses import policy_loss  # noqa: E402
from miles.backends.base import MicroBatch, TokenOutputs  # noqa: E402
from miles.backends.megatron.config import translate  # noqa: E402
from miles.backends.megatron.converters import converter_for  # noqa: E402
from miles.backends.megatron.converters.base import LocalNames  # noqa: E402
from miles.backends.megatron.forward import StepOptions, make_forward_step  # noqa: E402
from miles.backends.megatron.settings import MegatronSettings  # noqa: E402
from tests.unit.test_megatron_support import cpu_model, hf_logprobs, pack_rows, tiny_hf  # noqa: E402

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def mcore():
    with cpu_model() as ctx:
        yield ctx


def _batches(vocab: int) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(3)

    def seq(n: int) -> list[int]:
        ids = torch.randint(1, vocab, (n,), generator=g).tolist()
        ids[-2] = 0  # a sampled pad token: HF's padding_idx row must stay without gradient
        return ids

    out = [pack_rows([[seq(6), seq(5)], [seq(8)]], width=12), pack_rows([[seq(9)]], width=10)]
    for i, mb in enumerate(out):
        mb.tensors["advantages"] = torch.randn(mb.targets.shape, generator=g)
        mb.tensors["old_logp"] = -3.0 + 0.1 * torch.randn(mb.targets.shape, generator=g)
        mb.tensors["index"] = torch.full(mb.targets.shape, float(i))
    return out


def _loss_fn(num_tokens: float):
    def loss_fn(out: TokenOutputs, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        res = policy_loss(
            out.logp,
            mb.tensors["old_logp"],
            mb.tensors["advantages"],
            mb.loss_mask,
            clip_low=0.2,
            clip_high=0.28,
            entropy=out.entropy,
            entropy_coef=0.01,
            num_tokens=num_tokens,
        )
        return res.loss, {"loss": res.metrics["loss"], "tokens": mb.loss_mask.sum()}

    return loss_fn


def _schedule(chunk, batches: list[MicroBatch], opts: StepOptions, loss_fn) -> list[dict]:
    """megatron's no-pipelining schedule, minus its CUDA counter (see the module docstring)."""
    step = make_forward_step(opts, loss_fn, torch.device("cpu"))
    it = iter(batches)
    store = []
    for _ in batches:
        output, loss_func = step(it, chunk)
        loss, num_tokens, extra = loss_func(output)
        assert int(num_tokens) >= 0
        if loss_fn is not None:
            loss.backward()
        store.append(extra)
    return store


def _hf_outputs(model, mb: MicroBatch) -> TokenOutputs:
    """Differentiable HF log-probs and entropies on the same grid (each sequence run alone)."""
    from miles.algo.logprobs import token_entropy, token_logprobs
    from miles.backends.megatron.batches import segment_ids

    logp = torch.zeros(mb.targets.shape)
    ent = torch.zeros(mb.targets.shape)
    seg = segment_ids(mb.position_ids)
    for r in range(mb.input_ids.shape[0]):
        for s in torch.unique(seg[r]).tolist():
            idx = (seg[r] == s).nonzero().flatten()
            logits = model(input_ids=mb.input_ids[r, idx].unsqueeze(0)).logits
            logp = logp.index_put(
                (torch.full_like(idx, r), idx), token_logprobs(logits, mb.targets[r, idx][None], TEMPERATURE)[0]
            )
            ent = ent.index_put((torch.full_like(idx, r), idx), token_entropy(logits, TEMPERATURE)[0])
    return TokenOutputs(logp=logp, entropy=ent)


@pytest.mark.parametrize("kind", ["llama", "llama_pad", "qwen3_moe"])
def test_forward_backward_gives_the_hf_gradient_of_the_algorithm_loss(mcore, kind: str) -> None:
    model, disk = tiny_hf(kind)
    args = translate(model.config)
    chunk = mcore.build(args, MegatronSettings(moe_token_dispatcher="allgather"))
    mcore.load(chunk, args, disk)
    batches = _batches(args.vocab_size)
    total = float(sum(mb.num_tokens for mb in batches))
    loss_fn = _loss_fn(total)
    opts = StepOptions(vocab_size=args.vocab_size, temperature=TEMPERATURE, entropy=True, chunk_tokens=7)

    chunk.zero_grad()
    store = _schedule(chunk.train(), batches, opts, loss_fn)
    model.zero_grad()
    hf_loss = sum(loss_fn(_hf_outputs(model, mb), mb)[0] for mb in batches)
    hf_loss.backward()

    mcore_loss = sum(float(item["metrics"]["loss"]) for item in store)
    assert mcore_loss == pytest.approx(float(hf_loss), abs=1e-5)
    assert sum(float(item["metrics"]["tokens"]) for item in store) == total
    names = LocalNames({i: i for i in range(args.transformer["num_layers"])})
    table = converter_for(args).mappings()
    hf_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    compared = 0
    for local, param in chunk.named_parameters():
        mapping = table[names.canonical(local)]
        for hf_name, grad in zip(mapping.hf_names, mapping.to_hf(param.grad), strict=True):
            if hf_name in hf_grads:  # HF keeps fused experts in memory; checked through the forward test
                torch.testing.assert_close(grad, hf_grads[hf_name], atol=2e-5, rtol=1e-4)
                compared += 1
    assert compared >= 10


def test_scoring_returns_detached_outputs_without_a_loss(mcore) -> None:
    model, disk = tiny_hf("qwen3")
    args = translate(model.config)
    chunk = mcore.build(args, MegatronSettings())
    mcore.load(chunk, args, disk)
    batches = _batches(args.vocab_size)
    opts = StepOptions(vocab_size=args.vocab_size, temperature=TEMPERATURE)
    with torch.no_grad():
        store = _schedule(chunk.eval(), batches, opts, None)
    for mb, item in zip(batches, store, strict=True):
        out = item["outputs"]
        assert out.entropy is None and not out.logp.requires_grad
        mask = mb.seq_index >= 0
        torch.testing.assert_close(out.logp[mask], hf_logprobs(model, mb, TEMPERATURE)[mask], atol=2e-5, rtol=1e-5)
