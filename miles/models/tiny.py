"""The tiny model: a character tokenizer and a small Llama, built offline and warmed up with SFT.

It exists so that a full RL run (and the test-suite) needs no model download: the builder makes a
policy that already emits well-formed answers but is only *sometimes* right, which leaves room for
RL to show a measurable gain. Builds are cached by a hash of (model config, task fingerprint) and
written atomically (:mod:`miles.models.tiny_cache`, which locating a build needs without torch).

This module knows nothing of tasks or engines: the preparation step (:mod:`miles.prepare`) hands it the
warm-up examples (token ids and a loss mask, rendered from the task's demonstrations exactly as episodes
are rendered) and a function that measures held-out accuracy.
"""

from __future__ import annotations

import json
import math
import string
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from miles.config import TinyModelConfig
from miles.models.model_cache import BUILD_INFO_FILE

log = structlog.get_logger(__name__)

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
# One token per chat role, so that a conversation costs a single token per turn boundary.
ROLE_TOKENS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
# Each message is <|role|>content<eos>; a model turn is therefore its content, then <eos> (its stop token).
CHAT_TEMPLATE = (
    "{%- for m in messages -%}{{ '<|' + m['role'] + '|>' + m['content'] + '<eos>' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)

Example = tuple[list[int], list[int]]  # token ids, and 1 where a token is trained on (model-turn tokens)
# Arithmetic characters get the lowest ids; the rest of printable ASCII lets JSONL tasks use it too.
_CHARS: str = (
    string.digits
    + "+-*= "
    + "".join(c for c in string.printable if c not in string.digits + "+-*= " and c not in "\r\x0b\x0c")
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, specials ``<pad> <bos> <eos> <unk>`` at ids 0-3, one token per chat role
    and a chat template (``<|role|>content<eos>`` per message); left padding."""
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *_CHARS, *ROLE_TOKENS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char, newlines too
    core.decoder = decoders.Fuse()  # concatenate, no spaces between characters
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A randomly initialised (seeded) Llama sized by ``cfg``; the MLP is 4x wide, embeddings untied."""
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"hidden_size ({cfg.hidden_size}) must be divisible by num_heads ({cfg.num_heads})")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=4 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
    return model


def _collate(examples: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, T), attention mask (B, T) and labels (B, T) that are -100 off the model turns."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros_like(ids)  # (B, T)
    labels = torch.full_like(ids, -100)  # (B, T)
    for i, (seq, trained) in enumerate(examples):
        row = torch.tensor(seq)
        ids[i, : len(seq)] = row
        mask[i, : len(seq)] = 1
        labels[i, : len(seq)] = torch.where(torch.tensor(trained, dtype=torch.bool), row, -100)
    return ids, mask, labels


def lr_factor(step: int, total: int) -> float:
    """Linear warm-up over the first 10% of steps, then cosine decay to 10% of the peak.

    A fixed-length run then ends settled rather than mid-oscillation (at a constant rate, held-out
    accuracy swings by +-0.1 from one step to the next in this phase).
    """
    ramp = max(1, total // 10)
    if step < ramp:
        return (step + 1) / ramp
    progress = (step - ramp) / max(1, total - ramp)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def warm_up(
    model: LlamaForCausalLM,
    pad_id: int,
    examples: Sequence[Example],
    cfg: TinyModelConfig,
    accuracy: Callable[[LlamaForCausalLM], float] | None = None,
) -> tuple[int, float]:
    """Supervised warm-up on the task's demonstrations, loss on model-turn tokens only; returns (steps run,
    last loss).

    With ``cfg.warmup_target_accuracy`` set, greedy held-out accuracy is checked every
    ``cfg.warmup_check_every`` steps and training stops as soon as it reaches the target. The step at
    which a seed crosses a given accuracy varies a lot (175 to 300 steps for 0.2 on the default task),
    so a target lands far closer to "sometimes right" than any fixed step count. The eval split only
    picks the stopping step (through ``accuracy``); it is never trained on.
    """
    if not examples:
        raise ValueError("the warm-up needs at least one demonstration")
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg.warmup_steps))
    model.train()
    loss_value = float("nan")
    step = 0
    every = max(1, cfg.warmup_steps // 10)
    start = time.perf_counter()
    for step in range(1, cfg.warmup_steps + 1):
        pick = torch.randint(len(examples), (cfg.warmup_batch_size,), generator=gen).tolist()
        ids, mask, labels = _collate([examples[i] for i in pick], pad_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
        if step % every == 0 or step == cfg.warmup_steps:
            log.info(
                "tiny warm-up", step=step, steps=cfg.warmup_steps, loss=round(loss_value, 4),
                elapsed_s=round(time.perf_counter() - start, 2),
            )  # fmt: skip
        if accuracy is not None and cfg.warmup_target_accuracy is not None and step % cfg.warmup_check_every == 0:
            model.eval()
            value = accuracy(model)
            model.train()
            if value >= cfg.warmup_target_accuracy:
                log.info("tiny warm-up reached target", step=step, eval_accuracy=value, loss=round(loss_value, 4))
                break
    model.eval()
    return step, loss_value


def build_tiny_model_dir(
    model_cfg: TinyModelConfig,
    out_dir: Path,
    examples: Sequence[Example],
    accuracy: Callable[[LlamaForCausalLM], float],
    task_info: dict[str, Any],
) -> dict[str, Any]:
    """Build tokenizer + model, warm up on ``examples``, save both (safetensors) into ``out_dir``; return the
    build info (written next to them)."""
    start = time.perf_counter()
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(model_cfg, tokenizer)
    # One intra-op thread: the tiny matmuls gain nothing from more, and the float reduction order (so the
    # built model) then does not depend on the calling process's thread setting.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(model_cfg.seed)
            steps_run, loss = warm_up(model, tokenizer.pad_token_id, examples, model_cfg, accuracy)
        warmup_s = time.perf_counter() - start
        final_accuracy = accuracy(model)
    finally:
        torch.set_num_threads(threads)
    info = {
        "model": model_cfg.model_dump(mode="json"),
        "task": task_info,
        "warmup_steps_run": steps_run,
        "final_loss": loss if math.isfinite(loss) else None,
        "eval_accuracy": final_accuracy,
        "build_s": round(time.perf_counter() - start, 3),
        "warmup_s": round(warmup_s, 3),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2))
    log.info("tiny model built", eval_accuracy=round(final_accuracy, 4), steps=steps_run, build_s=info["build_s"])
    return info
