"""Tiny model: char tokenizer round trip, seeded build, cached atomic build dir, loading helpers."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from miles.config import ArithmeticTaskConfig, JsonlTaskConfig, PretrainedModelConfig, RunConfig, TinyModelConfig
from miles.models import tiny, tiny_cache
from miles.models.loading import (
    ModelNotFoundError,
    ModelNotPrepared,
    encode_prompt,
    load_policy,
    prepared_model_dir,
    stop_token_ids,
)
from miles.models.model_cache import BUILD_INFO_FILE
from miles.prepare import prepare_model
from miles.rollout.render import Renderer, demonstration_tokens
from miles.tasks.fingerprint import task_fingerprint
from miles.tasks.registry import build_task

TASK = ArithmeticTaskConfig(max_operand=9, train_size=200, eval_size=20)


def small_cfg(tmp_path: Path, **kw: object) -> TinyModelConfig:
    base: dict[str, object] = dict(hidden_size=32, num_layers=1, num_heads=2, warmup_steps=3, warmup_batch_size=8)
    base.update(kw)
    return TinyModelConfig(cache_dir=str(tmp_path / "cache"), **base)


def run_cfg(model: TinyModelConfig) -> RunConfig:
    return RunConfig(model=model, task=TASK)


def key(cfg: TinyModelConfig, task: object = TASK) -> str:
    return tiny_cache.cache_key(cfg, task_fingerprint(task))


def test_char_tokenizer_round_trips_after_save(tmp_path: Path) -> None:
    tiny.build_char_tokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "12+7=19 -3*4 abc\nXY"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_token_id, *ids, tok.eos_token_id], skip_special_tokens=True) == text
    assert tok.padding_side == "left"


def test_encode_prompt_prepends_bos_once_and_stop_ids_have_eos() -> None:
    tok = tiny.build_char_tokenizer()
    ids = encode_prompt(tok, "3+4=")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids[1:]) == "3+4="
    assert stop_token_ids(tok) == [tok.eos_token_id]


def test_model_init_is_seeded() -> None:
    tok = tiny.build_char_tokenizer()
    cfg = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2)
    a, b = tiny.build_tiny_model(cfg, tok), tiny.build_tiny_model(cfg, tok)
    c = tiny.build_tiny_model(cfg.model_copy(update={"seed": 1}), tok)
    assert isinstance(a, LlamaForCausalLM)
    assert a.config.vocab_size == len(tok)
    w = "model.embed_tokens.weight"
    assert torch.equal(a.state_dict()[w], b.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], c.state_dict()[w])


def test_warm_up_lowers_answer_loss() -> None:
    tok = tiny.build_char_tokenizer()
    cfg = TinyModelConfig(
        hidden_size=32, num_layers=1, num_heads=2, warmup_steps=30, warmup_batch_size=32, warmup_target_accuracy=None
    )
    task = build_task(TASK)
    model = tiny.build_tiny_model(cfg, tok)
    renderer = Renderer(tok, "raw")
    examples = [demonstration_tokens(renderer, task.demonstration(s), tok.eos_token_id) for s in task.samples("train")]
    ids, mask, labels = tiny._collate(examples[:64], tok.pad_token_id)
    # Labels cover exactly the answer characters plus EOS.
    first = task.samples("train")[0]
    assert int((labels[0] != -100).sum()) == len(first.answer) + 1

    def loss() -> float:
        with torch.no_grad():
            return float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)

    before = loss()
    assert tiny.warm_up(model, tok.pad_token_id, examples, cfg)[0] == 30
    assert loss() < 0.6 * before
    assert not model.training


def test_warm_up_stops_at_the_target_accuracy(tmp_path: Path) -> None:
    reached = prepare_model(run_cfg(small_cfg(tmp_path / "a", warmup_steps=25, warmup_target_accuracy=0.0)))
    info = json.loads((reached / BUILD_INFO_FILE).read_text())
    assert info["warmup_steps_run"] == 10  # any accuracy meets 0.0 at the first check
    unreachable = prepare_model(run_cfg(small_cfg(tmp_path / "b", warmup_steps=25, warmup_target_accuracy=1.0)))
    assert json.loads((unreachable / BUILD_INFO_FILE).read_text())["warmup_steps_run"] == 25


def test_ensure_tiny_model_builds_once_and_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = small_cfg(tmp_path)
    built: list[Path] = []
    real_build = tiny.build_tiny_model_dir

    def counting_build(*args: object, **kwargs: object) -> dict:
        built.append(args[1])  # type: ignore[arg-type]
        return real_build(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tiny, "build_tiny_model_dir", counting_build)
    results: list[Path] = []
    with pytest.raises(ModelNotPrepared, match="miles prepare"):
        prepared_model_dir(cfg, TASK)  # actors only locate what was prepared
    threads = [threading.Thread(target=lambda: results.append(prepare_model(run_cfg(cfg)))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and len(set(results)) == 1
    model_dir = results[0]
    assert model_dir.parent == tmp_path / "cache"
    assert model_dir.name == f"tiny-{key(cfg)}"
    assert (model_dir / "model.safetensors").is_file()
    info = json.loads((model_dir / BUILD_INFO_FILE).read_text())
    assert 0.0 <= info["eval_accuracy"] <= 1.0
    # No temporary build directories are left behind.
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()] == [model_dir.name]
    # A second call is a cache hit.
    assert prepare_model(run_cfg(cfg)) == model_dir and len(built) == 1
    assert prepared_model_dir(cfg, TASK) == model_dir

    model, tok = load_policy(model_dir, "float32", "cpu")
    assert isinstance(model, LlamaForCausalLM) and not model.training
    assert tok.decode(encode_prompt(tok, "1+2="), skip_special_tokens=True) == "1+2="


def test_build_is_deterministic(tmp_path: Path) -> None:
    a = prepare_model(run_cfg(small_cfg(tmp_path / "a")))
    b = prepare_model(run_cfg(small_cfg(tmp_path / "b")))
    ma, _ = load_policy(a)
    mb, _ = load_policy(b)
    for (name, pa), (_, pb) in zip(ma.state_dict().items(), mb.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name


def test_cache_key_tracks_what_changes_the_model(tmp_path: Path) -> None:
    cfg = small_cfg(tmp_path)
    k = key(cfg)
    assert key(cfg.model_copy(update={"cache_dir": "/elsewhere"})) == k
    assert key(cfg.model_copy(update={"warmup_steps": 4})) != k
    assert key(cfg, TASK.model_copy(update={"seed": 1})) != k
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "a", "answer": "b"}\n')
    jcfg = JsonlTaskConfig(train_path=str(train), eval_path=str(train), reward="m:f")
    jkey = key(cfg, jcfg)
    train.write_text('{"prompt": "a", "answer": "c"}\n')
    assert key(cfg, jcfg) != jkey  # the warm-up data changed


def test_resolve_pretrained_checks_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not a directory"):
        prepared_model_dir(PretrainedModelConfig(path=str(tmp_path / "nope")), TASK)
    with pytest.raises(ModelNotFoundError, match="config.json"):
        prepared_model_dir(PretrainedModelConfig(path=str(tmp_path)), TASK)
    (tmp_path / "config.json").write_text("{}")
    assert prepared_model_dir(PretrainedModelConfig(path=str(tmp_path)), TASK) == tmp_path


def test_a_model_path_may_name_a_file_inside_an_installed_package() -> None:
    from miles.models.loading import model_path

    assert model_path("package:miles/models/gguf.py") == Path(__file__).resolve().parents[2] / "miles/models/gguf.py"
    assert model_path("~/m") == Path.home() / "m"
    with pytest.raises(ModelNotFoundError, match="no installed package 'no_such_pkg_xyz'"):
        model_path("package:no_such_pkg_xyz/model.gguf")
