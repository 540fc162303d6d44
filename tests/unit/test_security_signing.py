"""Signed bus messages: the signed bytes, signing, and every way verification must fail."""

from __future__ import annotations

import nkeys
import pytest

from miles.security.nkey import KeyPair, NkeyError, decode_public
from miles.security.signing import (
    SIGNATURE_HEADER,
    SIGNER_HEADER,
    MessageSigner,
    MessageVerifier,
    SignatureError,
    payload_sha256,
    signed_bytes,
    verify_payload,
)

RUN, NONCE = "demo", "0123456789abcdef0123456789abcdef"
SUBJECT = "demo.events.control"
PAYLOAD = bytes.fromhex("83a6736368656d6102a46b696e64a7636f6e74726f6ca7636f6d6d616e64a473746f70")
# The test vector of docs/security.md: the account seed made of bytes 0..31 signs PAYLOAD on SUBJECT.
VECTOR_SEED = nkeys.encode_seed(bytes(range(32)), nkeys.PREFIX_BYTE_ACCOUNT).decode()
VECTOR_PUBLIC = "AAB2CB576PHBBPQ5ODORRZ2LYCMWPZGWGCN2KDK7DXOIMZASKUY3QPZV"
VECTOR_BYTES = (
    "6d696c65732e7369676e65642e763100"
    "0000000464656d6f"
    "00000020" + NONCE.encode().hex() + "00000013"
    "64656d6f2e6576656e74732e636f6e74726f6c"
    "0000000000000023" + PAYLOAD.hex()
)
VECTOR_SIGNATURE = (
    "9fdb5bc6bca4110e13f2f792d0c932d5525f7667d4fc41b07f49d9a2fdd4745b"
    "d594c4188f1c7edbce1f6a37b402a09a8ba59f498aebad99c2a2d6d26bb6a90b"
)


@pytest.fixture(scope="module")
def keys() -> dict[str, KeyPair]:
    return {"trainer": KeyPair.generate("account"), "controller": KeyPair.generate("account")}


def signer(keys: dict[str, KeyPair], role: str = "controller", run: str = RUN, nonce: str = NONCE) -> MessageSigner:
    return MessageSigner(key=keys[role], signer=role, run=run, run_nonce=nonce)  # type: ignore[arg-type]


def verifier(keys: dict[str, KeyPair], run: str = RUN, nonce: str = NONCE) -> MessageVerifier:
    return MessageVerifier.from_nkeys({k: v.public_key for k, v in keys.items()}, run=run, run_nonce=nonce)  # type: ignore[misc]


def test_test_vector_of_the_docs() -> None:
    key = KeyPair.from_seed(VECTOR_SEED, "account")
    assert key.public_key == VECTOR_PUBLIC
    message = signed_bytes(SUBJECT, PAYLOAD, run=RUN, run_nonce=NONCE)
    assert message.hex() == VECTOR_BYTES
    signature = MessageSigner(key=key, signer="controller", run=RUN, run_nonce=NONCE).sign(SUBJECT, PAYLOAD)
    assert signature == VECTOR_SIGNATURE  # ed25519 is deterministic
    # Any nkeys implementation verifies it: nothing Miles-specific beyond the signed bytes.
    assert nkeys.from_seed(VECTOR_SEED.encode()).verify(message, bytes.fromhex(signature))


def test_a_valid_signature_verifies_with_its_signer_only(keys: dict[str, KeyPair]) -> None:
    headers = signer(keys).headers(SUBJECT, PAYLOAD)
    assert set(headers) == {SIGNER_HEADER, SIGNATURE_HEADER} and headers[SIGNER_HEADER] == "controller"
    verifier(keys).verify(SUBJECT, memoryview(PAYLOAD), headers, "controller")
    with pytest.raises(SignatureError, match="expected the trainer"):
        verifier(keys).verify(SUBJECT, PAYLOAD, headers, "trainer")
    relabelled = {**headers, SIGNER_HEADER: "trainer"}  # the controller's signature claimed as the trainer's
    with pytest.raises(SignatureError, match="no valid signature by the trainer"):
        verifier(keys).verify(SUBJECT, PAYLOAD, relabelled, "trainer")


def test_altered_bytes_or_another_subject_fail(keys: dict[str, KeyPair]) -> None:
    headers = signer(keys).headers(SUBJECT, PAYLOAD)
    for i in (0, len(PAYLOAD) // 2, len(PAYLOAD) - 1):
        altered = bytearray(PAYLOAD)
        altered[i] ^= 1
        with pytest.raises(SignatureError, match="forged, altered"):
            verifier(keys).verify(SUBJECT, bytes(altered), headers, "controller")
    with pytest.raises(SignatureError):
        verifier(keys).verify(SUBJECT, PAYLOAD + b"\x00", headers, "controller")
    with pytest.raises(SignatureError):  # a signed stop replayed onto another subject
        verifier(keys).verify("demo.prompts", PAYLOAD, headers, "controller")


def test_a_forger_with_another_key_fails(keys: dict[str, KeyPair]) -> None:
    forger = {"controller": KeyPair.generate("account")}
    headers = signer(forger).headers(SUBJECT, PAYLOAD)
    with pytest.raises(SignatureError, match="no valid signature"):
        verifier(keys).verify(SUBJECT, PAYLOAD, headers, "controller")


def test_missing_or_malformed_signatures_fail(keys: dict[str, KeyPair]) -> None:
    good = signer(keys).headers(SUBJECT, PAYLOAD)
    for headers, match in (
        (None, "not signed"),
        ({}, "not signed"),
        ({SIGNER_HEADER: "controller"}, "not signed"),
        ({**good, SIGNATURE_HEADER: "ab"}, "128 hex"),
        ({**good, SIGNATURE_HEADER: "zz" * 64}, "not hex"),
        ({SIGNATURE_HEADER: good[SIGNATURE_HEADER]}, "signed by None"),
    ):
        with pytest.raises(SignatureError, match=match):
            verifier(keys).verify(SUBJECT, PAYLOAD, headers, "controller")


def test_another_run_or_run_instance_fails(keys: dict[str, KeyPair]) -> None:
    headers = signer(keys).headers(SUBJECT, PAYLOAD)
    with pytest.raises(SignatureError):
        verifier(keys, nonce="f" * 32).verify(SUBJECT, PAYLOAD, headers, "controller")
    with pytest.raises(SignatureError):
        verifier(keys, run="demo2").verify(SUBJECT, PAYLOAD, headers, "controller")


def test_length_prefixes_keep_the_fields_apart() -> None:
    assert signed_bytes("s", b"", run="ab", run_nonce="c") != signed_bytes("s", b"", run="a", run_nonce="bc")
    assert signed_bytes("ab", b"c", run="r", run_nonce="n") != signed_bytes("a", b"bc", run="r", run_nonce="n")


def test_signing_keys_are_account_keys() -> None:
    with pytest.raises(ValueError, match="account-type"):
        MessageSigner(key=KeyPair.generate("user"), signer="trainer", run=RUN, run_nonce=NONCE)
    with pytest.raises(SignatureError, match="invalid trainer signing key"):
        MessageVerifier.from_nkeys({"trainer": KeyPair.generate("user").public_key}, run=RUN, run_nonce=NONCE)


def test_a_signer_shows_no_secret() -> None:
    key = KeyPair.generate("account")
    signer = MessageSigner(key=key, signer="controller", run=RUN, run_nonce=NONCE)
    assert key.seed not in repr(signer) and key.seed not in repr(key) and key.public_key in repr(key)


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
    fields = {"version": 3, "payload_sha256": payload_sha256(payload)}
    verify_payload(memoryview(payload), fields, required=True)
    with pytest.raises(SignatureError, match="sha256"):
        verify_payload(b"\x02" * 1000, fields, required=False)
    verify_payload(payload, {"version": 3}, required=False)  # none announced, none required
    with pytest.raises(SignatureError, match="carries no payload_sha256"):
        verify_payload(payload, {"version": 3}, required=True)
