"""Run info in its bucket on a real nats-server: written once, chunked files verified, mismatches named."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest
from nats.aio.client import Client

from miles.bus.runinfo import (
    FILE_CHUNK_BYTES,
    RunInfo,
    RunInfoError,
    build_run_info,
    check_worker_config,
    decode_run_info,
    file_key,
    new_run_nonce,
    publish_run_info,
    read_run_file,
    read_run_info,
)
from miles.bus.schema import SchemaError, encode
from miles.bus.streams import ensure_run_streams
from miles.bus.subjects import Subjects
from miles.config import load_config
from miles.models.tiny import build_char_tokenizer

RUN = "infotest"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A tokenizer and an architecture file (no weights: run info never carries them)."""
    out = tmp_path / "model"
    build_char_tokenizer().save_pretrained(out)
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 512, "model_type": "llama"}
    (out / "config.json").write_text(json.dumps(config))
    (out / "vocab.json").write_bytes(b"x" * (2 * FILE_CHUNK_BYTES + 17))  # a file of three chunks
    return out


def _cfg(*sets: str) -> object:
    return load_config(None, [f"name={RUN}", *sets])


async def _bucket(nc: Client) -> None:
    await ensure_run_streams(nc.jetstream(), Subjects(RUN), replicas=1, ack_wait_s=5.0)


async def test_written_once_then_read_back_with_its_files(nc: Client, model_dir: Path) -> None:
    await _bucket(nc)
    js = nc.jetstream()
    assert await read_run_info(js, RUN) is None
    info, files = build_run_info(_cfg("rollout.sampling.temperature=0.7"), model_dir, run_nonce=new_run_nonce())
    assert info.sampling.temperature == 0.7 and info.sampling.stop_token_ids == [2]  # <eos>
    assert info.model.max_context == 512 and info.task.reward == "exact_match" and info.task.render == "raw"
    assert "tokenizer.json" in info.tokenizer.files and info.tokenizer.chat_template
    assert info.file("vocab.json").chunks == 3
    stored = await publish_run_info(js, info, files)
    assert stored == info
    read = await read_run_info(js, RUN)
    assert read == info
    for name, data in files.items():
        assert await read_run_file(js, read, name) == data
    # A restarted controller (same config, a fresh nonce drawn) keeps the run instance it finds.
    again, files2 = build_run_info(_cfg("rollout.sampling.temperature=0.7"), model_dir, run_nonce=new_run_nonce())
    assert (await publish_run_info(js, again, files2)).run_nonce == info.run_nonce


async def test_another_run_under_the_same_name_is_refused(nc: Client, model_dir: Path) -> None:
    await _bucket(nc)
    js = nc.jetstream()
    info, files = build_run_info(_cfg(), model_dir, run_nonce=new_run_nonce())
    await publish_run_info(js, info, files)
    other, files = build_run_info(_cfg("rollout.group_size=3"), model_dir, run_nonce=new_run_nonce())
    with pytest.raises(RunInfoError, match="another run instance .*group_size"):
        await publish_run_info(js, other, files)


async def test_a_damaged_file_is_detected(nc: Client, model_dir: Path) -> None:
    await _bucket(nc)
    js = nc.jetstream()
    info, files = build_run_info(_cfg(), model_dir, run_nonce=new_run_nonce())
    await publish_run_info(js, info, files)
    kv = await js.key_value(f"{RUN}_RUNINFO")
    await kv.put(file_key("vocab.json", 1), b"y" * FILE_CHUNK_BYTES)
    with pytest.raises(RunInfoError, match="vocab.json: .* do not match its size and sha256"):
        await read_run_file(js, info, "vocab.json")
    await kv.delete(file_key("vocab.json", 2))
    with pytest.raises(RunInfoError, match="chunk 2 of 3 is missing"):
        await read_run_file(js, info, "vocab.json")


def test_a_worker_recipe_that_differs_from_the_run_is_named(model_dir: Path) -> None:
    info, _ = build_run_info(_cfg(), model_dir, run_nonce=new_run_nonce())
    check_worker_config(info, _cfg())
    with pytest.raises(RunInfoError, match=r"sampling\.temperature is 0\.5, but run 'infotest' uses 1\.0"):
        check_worker_config(info, _cfg("rollout.sampling.temperature=0.5"))
    with pytest.raises(RunInfoError, match=r"task\.fingerprint"):
        check_worker_config(info, _cfg("task.max_operand=7"))
    with pytest.raises(RunInfoError, match=r"group_size is 2"):
        check_worker_config(info, _cfg("rollout.group_size=2"))


def test_wire_form_is_a_msgpack_map_of_the_schema(model_dir: Path) -> None:
    info, _ = build_run_info(_cfg(), model_dir, run_nonce=new_run_nonce())
    body = msgpack.unpackb(encode(info))
    assert (body["schema"], body["kind"], body["run_nonce"]) == (2, "run_info", info.run_nonce)
    assert isinstance(decode_run_info(encode(info)), RunInfo)
    body["schema"] = 1
    with pytest.raises(SchemaError, match="another schema version"):
        decode_run_info(msgpack.packb(body))
    with pytest.raises(SchemaError, match="not msgpack"):
        decode_run_info(b"\xc1")
    body["schema"], body["run_nonce"] = 2, "short"
    with pytest.raises(SchemaError, match="run_nonce"):
        decode_run_info(msgpack.packb(body))
