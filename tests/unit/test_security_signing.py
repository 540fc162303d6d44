"""Signed weight announcements: the canonical encoding, signing, and every way verification must fail."""

from __future__ import annotations

import hashlib
from typing import Any

import nkeys
import pytest

from miles.bus.schema import WeightsAnnounced
from miles.security.nkey import KeyPair, NkeyError, decode_public
from miles.security.signing import (
    AnnouncementSigner,
    AnnouncementVerifier,
    SignatureError,
    canonical_bytes,
    payload_sha256,
    sign_announcement,
    verify_announcement,
    verify_payload,
)

RUN, NONCE = "demo", "0123456789abcdef0123456789abcdef"
# The test vector of docs/security.md: seed bytes 0..31, this announcement, run and nonce.
VECTOR_SEED = nkeys.encode_seed(bytes(range(32)), nkeys.PREFIX_BYTE_ACCOUNT).decode()
VECTOR_FIELDS: dict[str, Any] = dict(
    version=7,
    digest="00112233445566778899aabbccddeeff",
    size=1048576,
    chunks=1,
    mode="delta",
    base_version=6,
    format="miles-delta",
    dtype="bfloat16",
    published_at=1767225600.5,
    state_digest="ffeeddccbbaa99887766554433221100",
    precision="fp8_e4m3",
    payload_sha256="",
)
VECTOR_PUBLIC = "AAB2CB576PHBBPQ5ODORRZ2LYCMWPZGWGCN2KDK7DXOIMZASKUY3QPZV"
VECTOR_BYTES = (
    "6d696c65732e776569676874735f616e6e6f756e6365642e7631000000000464656d6f00000020303132333435363738396162636465"
    "6630313233343536373839616263646566000000000000000700000020303031313232333334343535363637373838393961616262"
    "6363646465656666000000000010000000000000000000010000000564656c74610100000000000000060000000b6d696c65732d64"
    "656c74610000000862666c6f6174313641da556e40200000000000206666656564646363626261613939383837373636353534343333"
    "323231313030000000086670385f65346d3300000000"
)
VECTOR_SIGNATURE = (
    "4e06d1d19abd5974577fa0c3ec7a4929e99fcc21b3d1a1b9a7819f1f44de1ed4"
    "f7711c8fd4359dd8082981676520c9b5c873e434c7ac2f78d1005b785ec3ee00"
)


@pytest.fixture(scope="module")
def key() -> KeyPair:
    return KeyPair.generate("account")


def announcement(**overrides: Any) -> dict[str, Any]:
    """A real announcement as the wire carries it (WeightsAnnounced's fields)."""
    ann = WeightsAnnounced(version=3, digest="ab" * 16, size=4096, chunks=1, state_digest="cd" * 16, published_at=12.25)
    return {**ann.model_dump(), **overrides}


def signed(key: KeyPair, run: str = RUN, nonce: str = NONCE, **overrides: Any) -> dict[str, Any]:
    fields = announcement(**overrides)
    return {**fields, "signature": sign_announcement(fields, key=key, run=run, run_nonce=nonce)}


def verifier(key: KeyPair, run: str = RUN, nonce: str = NONCE) -> AnnouncementVerifier:
    return AnnouncementVerifier.from_nkey(key.public_key, run=run, run_nonce=nonce)


def test_test_vector_of_the_docs() -> None:
    kp = KeyPair.from_seed(VECTOR_SEED, "account")
    assert kp.public_key == VECTOR_PUBLIC
    assert canonical_bytes(VECTOR_FIELDS, run=RUN, run_nonce=NONCE).hex() == VECTOR_BYTES
    assert sign_announcement(VECTOR_FIELDS, key=kp, run=RUN, run_nonce=NONCE) == VECTOR_SIGNATURE
    verify_announcement(VECTOR_FIELDS, VECTOR_SIGNATURE, public_key=VECTOR_PUBLIC, run=RUN, run_nonce=NONCE)


def test_signatures_are_plain_ed25519_any_nkeys_library_verifies() -> None:
    # PyNaCl under the nkeys package: an implementation independent of the `cryptography` signer
    message = bytes.fromhex(VECTOR_BYTES)
    assert nkeys.from_seed(bytearray(VECTOR_SEED.encode())).verify(message, bytes.fromhex(VECTOR_SIGNATURE))


def test_a_valid_signature_verifies(key: KeyPair) -> None:
    verifier(key).verify(signed(key))
    ann = signed(key, mode="delta", base_version=2, format="miles-delta", payload_sha256="ef" * 32)
    verifier(key).verify(ann)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("version", 4),
        ("digest", "ba" * 16),
        ("size", 4097),
        ("chunks", 2),
        ("mode", "lora"),
        ("dtype", "float32"),
        ("published_at", 12.5),
        ("state_digest", "dc" * 16),
        ("precision", "fp4_e2m1"),
        ("payload_sha256", "00" * 32),
        ("base_version", 1),
        ("format", "miles-delta"),
    ],
)
def test_any_tampered_field_fails(key: KeyPair, name: str, value: Any) -> None:
    ann = signed(key)
    ann[name] = value
    with pytest.raises(SignatureError, match="no valid signature"):
        verifier(key).verify(ann)


def test_a_forged_announcement_with_a_self_computed_digest_fails(key: KeyPair) -> None:
    forged_payload = b"weights chosen by the forger"
    ann = signed(key)
    ann["digest"] = hashlib.md5(forged_payload).hexdigest()  # any digest the forger likes: not covered by its key
    ann["size"] = len(forged_payload)
    with pytest.raises(SignatureError):
        verifier(key).verify(ann)
    forger = KeyPair.generate("account")
    with pytest.raises(SignatureError):
        verifier(key).verify(signed(forger, digest=ann["digest"], size=ann["size"]))


def test_another_key_fails(key: KeyPair) -> None:
    with pytest.raises(SignatureError, match="no valid signature"):
        verifier(KeyPair.generate("account")).verify(signed(key))


def test_a_missing_or_malformed_signature_fails(key: KeyPair) -> None:
    with pytest.raises(SignatureError, match="not signed"):
        verifier(key).verify(announcement())
    with pytest.raises(SignatureError, match="not signed"):
        verifier(key).verify({**announcement(), "signature": ""})
    with pytest.raises(SignatureError, match="128 hex"):
        verifier(key).verify({**announcement(), "signature": "ab"})
    with pytest.raises(SignatureError, match="not hex"):
        verifier(key).verify({**announcement(), "signature": "zz" * 64})


def test_replay_into_another_run_instance_or_run_fails(key: KeyPair) -> None:
    ann = signed(key)
    with pytest.raises(SignatureError, match="another run instance"):
        verifier(key, nonce="f" * 32).verify(ann)
    with pytest.raises(SignatureError):
        verifier(key, run="demo2").verify(ann)


def test_length_prefixes_keep_run_and_nonce_apart(key: KeyPair) -> None:
    # "ab" + "cd" and "a" + "bcd" must not sign the same bytes
    assert canonical_bytes(announcement(), run="ab", run_nonce="cd") != canonical_bytes(
        announcement(), run="a", run_nonce="bcd"
    )


def test_defaulted_fields_sign_the_same_omitted_or_spelled_out(key: KeyPair) -> None:
    full = announcement()
    minimal = {k: full[k] for k in ("version", "digest", "size", "chunks", "published_at", "state_digest")}
    assert canonical_bytes(full, run=RUN, run_nonce=NONCE) == canonical_bytes(minimal, run=RUN, run_nonce=NONCE)
    verifier(key).verify({**minimal, "signature": sign_announcement(full, key=key, run=RUN, run_nonce=NONCE)})
    # an integer timestamp from another producer is the same number
    assert canonical_bytes({**full, "published_at": 12}, run=RUN, run_nonce=NONCE) == canonical_bytes(
        {**full, "published_at": 12.0}, run=RUN, run_nonce=NONCE
    )


def test_unknown_fields_are_refused_not_silently_unsigned(key: KeyPair) -> None:
    with pytest.raises(SignatureError, match="not covered"):
        sign_announcement({**announcement(), "adapter_path": "/x"}, key=key, run=RUN, run_nonce=NONCE)
    with pytest.raises(SignatureError, match="not covered"):
        verifier(key).verify({**signed(key), "adapter_path": "/x"})
    # the msgpack envelope is not a field
    verifier(key).verify({**signed(key), "schema": 1, "kind": "weights_announced"})


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("version", True, "integer"),
        ("version", 2**63, "64-bit"),
        ("size", "4096", "integer"),
        ("digest", b"ab", "string"),
        ("published_at", float("nan"), "finite"),
        ("base_version", "1", "integer"),
    ],
)
def test_mistyped_fields_are_refused(key: KeyPair, name: str, value: Any, match: str) -> None:
    with pytest.raises(SignatureError, match=match):
        canonical_bytes({**announcement(), name: value}, run=RUN, run_nonce=NONCE)


def test_required_fields_must_be_present(key: KeyPair) -> None:
    fields = announcement()
    del fields["digest"]
    with pytest.raises(SignatureError, match="digest is missing"):
        canonical_bytes(fields, run=RUN, run_nonce=NONCE)


def test_the_signer_takes_only_an_account_key() -> None:
    with pytest.raises(ValueError, match="account-type"):
        AnnouncementSigner(key=KeyPair.generate("user"), run=RUN, run_nonce=NONCE)
    with pytest.raises(SignatureError, match="invalid trainer signing key"):
        AnnouncementVerifier.from_nkey(KeyPair.generate("user").public_key, run=RUN, run_nonce=NONCE)


def test_nkey_decoding_checks_type_and_checksum() -> None:
    public = KeyPair.generate("account").public_key
    decode_public(public, "account")
    corrupted = public[:-1] + ("A" if public[-1] != "A" else "B")
    with pytest.raises(NkeyError):
        decode_public(corrupted, "account")
    with pytest.raises(NkeyError, match="type"):
        decode_public(public, "user")
    with pytest.raises(NkeyError):
        KeyPair.from_seed("SUnotaseed", "user")


def test_payload_sha256_binds_the_bytes() -> None:
    payload = b"\x01" * 1000
    fields = announcement(payload_sha256=payload_sha256(payload))
    verify_payload(memoryview(payload), fields, required=True)
    with pytest.raises(SignatureError, match="sha256"):
        verify_payload(b"\x02" * 1000, fields, required=False)
    verify_payload(payload, announcement(), required=False)  # none announced, none required
    with pytest.raises(SignatureError, match="carries no payload_sha256"):
        verify_payload(payload, announcement(), required=True)
