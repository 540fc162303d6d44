"""The tiny model: a character tokenizer and a small Llama, built offline and warmed up with SFT.

It exists so that a full RL run (and the test-suite) needs no model download: the builder makes a
policy that already emits well-formed answers but is only *sometimes* right, which leaves room for
RL to show a measurable gain. Builds are cached by a hash of (model config, task config) and written
atomically, so concurrent processes of one run can all call :func:`ensure_tiny_model`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import string
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from miles.config import ArithmeticTaskConfig, JsonlTaskConfig, TinyModelConfig
from miles.models.loading import encode_prompt
from miles.tasks.base import Sample, Task

log = structlog.get_logger(__name__)

# Bump when the builder changes in a way that changes the built model, to invalidate caches.
BUILD_FORMAT = 1
BUILD_INFO_FILE = "miles_build.json"
TARGET_CHECK_EVERY = 10

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
# Arithmetic characters get the lowest ids; the rest of printable ASCII lets JSONL tasks use it too.
_CHARS: str = (
    string.digits
    + "+-*= "
    + "".join(c for c in string.printable if c not in string.digits + "+-*= " and c not in "\r\x0b\x0c")
)


def default_cache_dir() -> Path:
    """``~/.cache/miles/models`` (respects ``XDG_CACHE_HOME``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "miles" / "models"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, specials ``<pad> <bos> <eos> <unk>`` at ids 0-3; left padding."""
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *_CHARS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char, newlines too
    core.decoder = decoders.Fuse()  # concatenate, no spaces between characters
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


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


def _sft_example(tokenizer: PreTrainedTokenizerFast, sample: Sample) -> tuple[list[int], int]:
    """``<bos>prompt answer<eos>`` ids (no separator: the completion is the answer) and the prompt length."""
    prompt = encode_prompt(tokenizer, sample.prompt)
    answer = list(tokenizer.encode(sample.answer, add_special_tokens=False)) + [tokenizer.eos_token_id]
    return prompt + answer, len(prompt)


def _collate(examples: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, T), attention mask (B, T) and labels (B, T) that are -100 off the answer."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros_like(ids)  # (B, T)
    labels = torch.full_like(ids, -100)  # (B, T)
    for i, (seq, prompt_len) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, prompt_len : len(seq)] = torch.tensor(seq[prompt_len:])
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
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, task: Task, cfg: TinyModelConfig
) -> tuple[int, float]:
    """Supervised warm-up on the task's train split, loss on answer tokens only; returns (steps run, last loss).

    With ``cfg.warmup_target_accuracy`` set, greedy held-out accuracy is checked every
    ``TARGET_CHECK_EVERY`` steps and training stops as soon as it reaches the target. The step at
    which a seed crosses a given accuracy varies a lot (175 to 300 steps for 0.2 on the default task),
    so a target lands far closer to "sometimes right" than any fixed step count. The eval split only
    picks the stopping step; it is never trained on.
    """
    examples = [_sft_example(tokenizer, s) for s in task.samples("train")]
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
        ids, mask, labels = _collate([examples[i] for i in pick], tokenizer.pad_token_id)
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
        if cfg.warmup_target_accuracy is not None and step % TARGET_CHECK_EVERY == 0:
            model.eval()
            accuracy = measure_accuracy(model, tokenizer, task)
            model.train()
            if accuracy >= cfg.warmup_target_accuracy:
                log.info("tiny warm-up reached target", step=step, eval_accuracy=accuracy, loss=round(loss_value, 4))
                break
    model.eval()
    return step, loss_value


def measure_accuracy(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, task: Task) -> float:
    """Greedy held-out accuracy of ``model`` on the task's eval split."""
    from miles.engines.torch_engine import TorchEngine
    from miles.tasks.evaluate import evaluate

    engine = TorchEngine(model, tokenizer.pad_token_id)
    max_new = max(len(tokenizer.encode(s.answer, add_special_tokens=False)) for s in task.samples("eval")) + 2
    return evaluate(engine, tokenizer, task, task.samples("eval"), max_new_tokens=max_new)


def _task_fingerprint(task_cfg: ArithmeticTaskConfig | JsonlTaskConfig) -> dict[str, Any]:
    """The task config, plus a digest of the JSONL train file's bytes (the warm-up reads it)."""
    fp: dict[str, Any] = task_cfg.model_dump(mode="json")
    if task_cfg.type == "jsonl":
        train = Path(task_cfg.train_path)
        fp["train_sha256"] = hashlib.sha256(train.read_bytes()).hexdigest() if train.is_file() else None
    return fp


def cache_key(model_cfg: TinyModelConfig, task_cfg: ArithmeticTaskConfig | JsonlTaskConfig) -> str:
    """Stable short hash of everything that determines the built model (not where it is cached)."""
    payload = {
        "format": BUILD_FORMAT,
        "model": model_cfg.model_dump(mode="json", exclude={"cache_dir"}),
        "task": _task_fingerprint(task_cfg),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Advisory inter-process lock so that concurrent callers build once (atomic rename keeps it safe anyway)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: rely on the atomic rename alone
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_tiny_model_dir(
    model_cfg: TinyModelConfig, task_cfg: ArithmeticTaskConfig | JsonlTaskConfig, out_dir: Path
) -> dict[str, Any]:
    """Build tokenizer + model, warm up, save both (safetensors) into ``out_dir``; return the build info."""
    from miles.tasks.registry import build_task

    start = time.perf_counter()
    task = build_task(task_cfg)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(model_cfg, tokenizer)
    # One intra-op thread: the tiny matmuls gain nothing from more, and the float reduction order (so the
    # built model) then does not depend on the calling process's thread setting.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(model_cfg.seed)
            steps_run, loss = warm_up(model, tokenizer, task, model_cfg)
        warmup_s = time.perf_counter() - start
        accuracy = measure_accuracy(model, tokenizer, task)
    finally:
        torch.set_num_threads(threads)
    info = {
        "key": cache_key(model_cfg, task_cfg),
        "model": model_cfg.model_dump(mode="json"),
        "task": task_cfg.model_dump(mode="json"),
        "warmup_steps_run": steps_run,
        "final_loss": loss if math.isfinite(loss) else None,
        "eval_accuracy": accuracy,
        "build_s": round(time.perf_counter() - start, 3),
        "warmup_s": round(warmup_s, 3),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2))
    log.info("tiny model built", eval_accuracy=round(accuracy, 4), steps=steps_run, build_s=info["build_s"])
    return info


def ensure_tiny_model(model_cfg: TinyModelConfig, task_cfg: ArithmeticTaskConfig | JsonlTaskConfig) -> Path:
    """Directory of the tiny model for (``model_cfg``, ``task_cfg``), building it on a cache miss.

    The build goes to a private temporary directory that is renamed into place, so a reader never
    sees a half-written model even if the builder crashes.
    """
    root = Path(model_cfg.cache_dir).expanduser() if model_cfg.cache_dir else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"tiny-{cache_key(model_cfg, task_cfg)}"
    if (final / BUILD_INFO_FILE).is_file():
        return final
    with _build_lock(root / f".{final.name}.lock"):
        if (final / BUILD_INFO_FILE).is_file():  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.", dir=root))
        try:
            log.info("building tiny model", dir=str(final))
            build_tiny_model_dir(model_cfg, task_cfg, tmp)
            try:
                os.rename(tmp, final)
            except OSError as exc:
                if not (final / BUILD_INFO_FILE).is_file():
                    raise RuntimeError(f"{final} exists but is not a complete tiny-model build; delete it") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("tiny model ready", dir=str(final))
    return final
