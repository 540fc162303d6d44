"""What a run's run info says about its tokenizer, computed by transformers once per tokenizer and then cached.

The controller publishes the tokenizer's special-token ids, chat template and stop tokens in the run info
(docs/protocol.md), and needs nothing else of transformers: loading a tokenizer with it imports torch, about
4 CPU seconds of every run's start. Preparation (``miles prepare``, and ``miles run`` before any actor starts)
loads the tokenizer anyway; it records these facts in ``~/.cache/miles/tokenizers/<key>.json``, keyed by the
bytes of the tokenizer files and ``generation_config.json`` and by the transformers release, and the
controller reads them back. A miss (a controller on a machine where ``miles prepare`` did not run) computes
them with transformers, as before: the facts are always transformers' own, never reimplemented.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

FACTS_FORMAT = 1
# Every file transformers may read a tokenizer from (Hugging Face names; the run info publishes these too).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
# What the facts depend on: the tokenizer, and the generation config that adds stop tokens.
SOURCE_FILES = (*TOKENIZER_FILES, "generation_config.json")


@dataclass(frozen=True, slots=True)
class TokenizerFacts:
    bos_token_id: int | None
    eos_token_id: int | None  # None when the tokenizer names several (they are all in stop_token_ids)
    pad_token_id: int | None
    chat_template: str | None
    stop_token_ids: list[int] = field(default_factory=list)


def cache_dir() -> Path:
    """``~/.cache/miles/tokenizers`` (respects ``XDG_CACHE_HOME``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "miles" / "tokenizers"


def facts_key(model_dir: str | Path) -> str:
    """Hash of the tokenizer's source files (by name and content), the transformers release and this format."""
    digest = hashlib.sha256(f"{FACTS_FORMAT}:{version('transformers')}".encode())
    for name in SOURCE_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:32]


def tokenizer_facts(model_dir: str | Path, tokenizer: Any = None) -> TokenizerFacts:
    """The facts of ``model_dir``'s tokenizer: from the cache, else computed (with ``tokenizer`` if given, else
    loaded with transformers) and cached."""
    path = cache_dir() / f"{facts_key(model_dir)}.json"
    try:
        return TokenizerFacts(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):  # absent, or unreadable: computed again and rewritten below
        pass
    facts = compute_facts(model_dir, tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as out:
        json.dump(asdict(facts), out)
    os.replace(out.name, path)  # atomic: a concurrent reader sees the whole file or none
    return facts


def compute_facts(model_dir: str | Path, tokenizer: Any = None) -> TokenizerFacts:
    """The facts as transformers reads them (imports transformers, and torch with it)."""
    from miles.models.loading import load_tokenizer, stop_token_ids

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
    eos = tokenizer.eos_token_id
    return TokenizerFacts(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos if isinstance(eos, int) else None,
        pad_token_id=tokenizer.pad_token_id,
        chat_template=getattr(tokenizer, "chat_template", None) or None,
        stop_token_ids=stop_token_ids(tokenizer, model_dir),
    )
