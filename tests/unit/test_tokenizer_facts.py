"""The tokenizer facts of the run info: transformers' own values, cached by content, read back without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.models import tokenizer_facts as tf
from miles.models.tiny import build_char_tokenizer
from tests.helpers_tokenizers import bpe_chatml_tokenizer


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _saved(tmp_path: Path, which: str) -> Path:
    out = tmp_path / which
    if which == "char":
        build_char_tokenizer().save_pretrained(out)
    else:
        bpe_chatml_tokenizer().save_pretrained(out)
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [7]}))  # one more stop token
    return out


@pytest.mark.parametrize("which", ["char", "bpe"])
def test_cached_facts_are_transformers_own(tmp_path: Path, cache_home: Path, which: str) -> None:
    model_dir = _saved(tmp_path, which)
    computed = tf.compute_facts(model_dir)
    assert tf.tokenizer_facts(model_dir) == computed  # computed and stored
    assert [p.suffix for p in (cache_home / "miles" / "tokenizers").iterdir()] == [".json"]
    assert tf.tokenizer_facts(model_dir) == computed  # read back
    if which == "bpe":
        assert computed.stop_token_ids[-1] == 7 and computed.chat_template and computed.pad_token_id is not None


def test_the_key_follows_the_files(tmp_path: Path) -> None:
    model_dir = _saved(tmp_path, "char")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [5]}))
    assert tf.tokenizer_facts(model_dir).stop_token_ids == [2, 5]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    assert tf.tokenizer_facts(model_dir).stop_token_ids == [2]


def test_a_warm_cache_lets_the_controller_start_without_transformers(tmp_path: Path, cache_home: Path) -> None:
    """The controller's module, its run info and its TensorBoard writer, in a fresh process: no transformers, no
    torch (about 4 CPU seconds of every run's start)."""
    model_dir = _saved(tmp_path, "char")
    (model_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    tf.tokenizer_facts(model_dir)  # what `miles prepare` leaves behind
    script = (
        "import sys; from pathlib import Path; from miles.config import load_config; import miles.actors.controller; "
        "from miles.bus.runinfo import build_run_info; from miles.monitoring.tensorboard import TensorboardWriter; "
        f"info, _ = build_run_info(load_config(None, []), {str(model_dir)!r}, run_nonce='0' * 32); "
        f"assert TensorboardWriter(Path({str(tmp_path / 'run')!r})).available; "
        "print(info.sampling.stop_token_ids, 'transformers' in sys.modules, 'torch' in sys.modules)"
    )
    env = {"XDG_CACHE_HOME": str(cache_home), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[2]", "False", "False"]
