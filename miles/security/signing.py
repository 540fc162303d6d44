"""Signed weight announcements: the trainer signs each ``weights_announced``, everyone else verifies.

Why: NATS permissions stop a rollout identity from publishing an announcement, but not a party that
sits between the trainer and a worker: a compromised hub or leaf server, a third-party fleet that
mirrors the run's streams into its own JetStream domain, a mis-configured permission. An ed25519
signature by a key only the trainer holds, over every field of the announcement, makes a forged or
altered announcement detectable wherever it was relayed; since the announcement carries the digest
of the payload (and ``payload_sha256`` when the trainer computes it), the payload's bytes are bound to
the signature through it: nothing in the data plane needs a signature of its own.

The canonical byte encoding (docs/security.md spells it out byte for byte, for verifiers in other
languages) is length-prefixed binary, not JSON: no float formatting, key order or Unicode
normalisation to agree on. It starts with a tag naming the scheme, then the run name and the run
instance's nonce (so an announcement of another run, or of an earlier run under the same name, does
not verify), then each field in a fixed order. A field this scheme does not know makes signing and
verification fail: it would otherwise travel unprotected.

The signing key is an account-type nkey (public key ``A...``), separate from every login key: a
NATS server asks a client to sign a nonce of its choosing at login, so a key that also logs in could
be made to sign announcement bytes by a malicious server.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from miles.security.nkey import KeyPair, NkeyError, decode_public

TAG = b"miles.weights_announced.v1\x00"
SIGNATURE_BYTES = 64
# Envelope keys and the signature itself are not signed (the tag stands for schema and kind).
UNSIGNED_KEYS = frozenset({"schema", "kind", "signature"})


class SignatureError(ValueError):
    """An announcement whose signature is missing, malformed, made by another key, or over other fields."""


def _str(value: Any, name: str) -> bytes:
    if not isinstance(value, str):
        raise SignatureError(f"announcement field {name} must be a string, got {type(value).__name__}")
    data = value.encode("utf-8")
    return struct.pack(">I", len(data)) + data


def _i64(value: Any, name: str) -> bytes:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SignatureError(f"announcement field {name} must be an integer, got {type(value).__name__}")
    if not -(2**63) <= value < 2**63:
        raise SignatureError(f"announcement field {name} is out of the signed 64-bit range")
    return struct.pack(">q", value)


def _opt_i64(value: Any, name: str) -> bytes:
    return b"\x00" if value is None else b"\x01" + _i64(value, name)


def _f64(value: Any, name: str) -> bytes:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SignatureError(f"announcement field {name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise SignatureError(f"announcement field {name} must be finite")
    return struct.pack(">d", value)


_MISSING = object()
Encoder = Callable[[Any, str], bytes]
# (field, encoding, default when absent). Defaults are the schema's (miles.bus.schema.WeightsAnnounced),
# so a message that omits a defaulted field signs the same as one that spells it out.
FIELDS: tuple[tuple[str, Encoder, Any], ...] = (
    ("version", _i64, _MISSING),
    ("digest", _str, _MISSING),
    ("size", _i64, _MISSING),
    ("chunks", _i64, _MISSING),
    ("mode", _str, "full"),
    ("base_version", _opt_i64, None),
    ("format", _str, "safetensors"),
    ("dtype", _str, "bfloat16"),
    ("published_at", _f64, _MISSING),
    ("state_digest", _str, ""),
    ("precision", _str, "bfloat16"),
    ("payload_sha256", _str, ""),
)
SIGNED_KEYS = frozenset(name for name, _, _ in FIELDS)


def canonical_bytes(fields: Mapping[str, Any], *, run: str, run_nonce: str) -> bytes:
    """The bytes that are signed: ``TAG || str(run) || str(run_nonce) || field...`` (see docs/security.md).

    ``fields`` is the announcement as a mapping (``WeightsAnnounced.model_dump()`` or the decoded
    msgpack map); envelope keys and ``signature`` are ignored, any other unknown key is an error.
    """
    unknown = set(fields) - SIGNED_KEYS - UNSIGNED_KEYS
    if unknown:
        raise SignatureError(f"announcement fields not covered by {TAG[:-1].decode()}: {', '.join(sorted(unknown))}")
    out = [TAG, _str(run, "run"), _str(run_nonce, "run_nonce")]
    for name, encode, default in FIELDS:
        value = fields.get(name, default)
        if value is _MISSING:
            raise SignatureError(f"announcement field {name} is missing")
        out.append(encode(value, name))
    return b"".join(out)


def payload_sha256(payload: bytes | bytearray | memoryview) -> str:
    """SHA-256 hex of a weight payload: the cryptographic digest for ``payload_sha256``.

    The data plane's own digest (xxh3-128) is fast but not collision resistant: someone who can write
    the data plane (a compromised server, a mirroring fleet) could prepare a different payload with
    the same xxh3. hashlib releases the GIL, so this can run in a worker thread during the fetch.
    """
    return hashlib.sha256(payload).hexdigest()


@dataclass(frozen=True, slots=True)
class AnnouncementSigner:
    """The trainer's side: signs the announcements of one run instance."""

    key: KeyPair
    run: str
    run_nonce: str

    def __post_init__(self) -> None:
        if self.key.key_type != "account":
            raise ValueError("the signing key must be an account-type nkey (seed 'SA...')")

    @property
    def public_key(self) -> str:
        return self.key.public_key

    def sign(self, fields: Mapping[str, Any]) -> str:
        """The signature of ``fields``: 64 bytes ed25519, as 128 lower-case hex characters."""
        message = canonical_bytes(fields, run=self.run, run_nonce=self.run_nonce)
        return self.key.private_key().sign(message).hex()


@dataclass(frozen=True, slots=True)
class AnnouncementVerifier:
    """A worker's or the controller's side: the trainer's public key and the run instance it expects."""

    public_key: Ed25519PublicKey
    run: str
    run_nonce: str

    @classmethod
    def from_nkey(cls, public_nkey: str, *, run: str, run_nonce: str) -> AnnouncementVerifier:
        try:
            key = decode_public(public_nkey, "account")
        except NkeyError as exc:
            raise SignatureError(f"invalid trainer signing key: {exc}") from None
        return cls(public_key=key, run=run, run_nonce=run_nonce)

    def verify(self, fields: Mapping[str, Any], signature: str | None = None) -> None:
        """Raise :class:`SignatureError` unless ``signature`` (default: ``fields["signature"]``) is the
        trainer's signature of exactly these fields for this run instance."""
        if signature is None:
            signature = fields.get("signature")
        if not signature:
            raise SignatureError(f"announcement of version {fields.get('version')} is not signed")
        if not isinstance(signature, str) or len(signature) != 2 * SIGNATURE_BYTES:
            raise SignatureError("announcement signature must be 128 hex characters")
        try:
            raw = bytes.fromhex(signature)
        except ValueError:
            raise SignatureError("announcement signature is not hex") from None
        message = canonical_bytes(fields, run=self.run, run_nonce=self.run_nonce)
        try:
            self.public_key.verify(raw, message)
        except InvalidSignature:
            raise SignatureError(
                f"announcement of version {fields.get('version')} has no valid signature by the trainer's key "
                f"for run {self.run!r} (forged, altered, or from another run instance)"
            ) from None


def sign_announcement(fields: Mapping[str, Any], *, key: KeyPair, run: str, run_nonce: str) -> str:
    """One-shot :meth:`AnnouncementSigner.sign`."""
    return AnnouncementSigner(key=key, run=run, run_nonce=run_nonce).sign(fields)


def verify_announcement(
    fields: Mapping[str, Any], signature: str | None = None, *, public_key: str, run: str, run_nonce: str
) -> None:
    """One-shot :meth:`AnnouncementVerifier.verify` with the trainer's public nkey (``A...``)."""
    AnnouncementVerifier.from_nkey(public_key, run=run, run_nonce=run_nonce).verify(fields, signature)


def verify_payload(payload: bytes | bytearray | memoryview, fields: Mapping[str, Any], *, required: bool) -> None:
    """Check a fetched payload against the signed ``payload_sha256`` of its (verified) announcement.

    With ``required`` an announcement without one is refused; otherwise it is accepted on the data
    plane's own digest alone (checked by :class:`miles.bus.dataplane.WeightStore`)."""
    expected = fields.get("payload_sha256") or ""
    if not expected:
        if required:
            raise SignatureError(f"announcement of version {fields.get('version')} carries no payload_sha256")
        return
    actual = payload_sha256(payload)
    if actual != expected:
        raise SignatureError(
            f"payload of version {fields.get('version')} has sha256 {actual}, the signed announcement says {expected}"
        )
