"""NATS nkeys: ed25519 keys in the NATS text encoding (base32 of a type byte, the key and a CRC-16).

Why nkeys for everything (logins and the signing keys): every NATS client library already
reads them, the text says what a key is for (``U...`` a user, ``A...`` an account-type key, ``S...``
a seed), and the checksum catches a truncated copy-paste. Under the encoding they are plain RFC 8032
ed25519 keys, so a verifier in another language needs nothing NATS-specific beyond this decoding.

The ``nkeys`` package (which nats-py uses to answer the server's login challenge) encodes seeds; the
ed25519 arithmetic is done by ``cryptography``.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass, field
from typing import Literal

import nkeys
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

KeyType = Literal["user", "account"]
_PREFIX: dict[KeyType, int] = {"user": nkeys.PREFIX_BYTE_USER, "account": nkeys.PREFIX_BYTE_ACCOUNT}


class NkeyError(ValueError):
    """A string that is not a valid nkey of the expected type."""


def _b32decode(text: str) -> bytes:
    try:
        return base64.b32decode(text + "=" * (-len(text) % 8))
    except (binascii.Error, ValueError):
        raise NkeyError("not base32") from None


def _checked(raw: bytes) -> bytes:
    body, crc = raw[:-2], raw[-2:]
    if len(raw) < 3 or nkeys.crc16(bytearray(body)) != int.from_bytes(crc, "little"):
        raise NkeyError("checksum mismatch")
    return body


@dataclass(frozen=True, slots=True)
class KeyPair:
    """An nkey seed (secret) with its public key."""

    seed: str = field(repr=False)  # never in a log line or a traceback's locals
    public_key: str
    key_type: KeyType

    @classmethod
    def generate(cls, key_type: KeyType) -> KeyPair:
        seed = nkeys.encode_seed(os.urandom(32), _PREFIX[key_type]).decode()
        return cls.from_seed(seed, key_type)

    @classmethod
    def from_seed(cls, seed: str, key_type: KeyType) -> KeyPair:
        """Parse a seed (``SU...`` user, ``SA...`` account); ``NkeyError`` if it is not one of that type."""
        try:
            prefix, raw = nkeys.decode_seed(bytearray(seed.strip().encode()))
        except nkeys.NkeysError as exc:
            raise NkeyError(f"invalid nkey seed ({type(exc).__name__})") from None
        if prefix != _PREFIX[key_type]:
            raise NkeyError(f"nkey seed is not of type {key_type}")
        public = Ed25519PrivateKey.from_private_bytes(bytes(raw)).public_key()
        return cls(seed=seed.strip(), public_key=encode_public(public, key_type), key_type=key_type)

    def private_key(self) -> Ed25519PrivateKey:
        _, raw = nkeys.decode_seed(bytearray(self.seed.encode()))
        return Ed25519PrivateKey.from_private_bytes(bytes(raw))


def encode_public(key: Ed25519PublicKey, key_type: KeyType) -> str:
    """The nkey text of a public key: base32(type byte || 32 key bytes || CRC-16 little-endian), unpadded."""
    body = bytearray([_PREFIX[key_type]]) + key.public_bytes(Encoding.Raw, PublicFormat.Raw)
    crc = nkeys.crc16(body).to_bytes(2, "little")
    return base64.b32encode(bytes(body) + crc).decode().rstrip("=")


def decode_public(text: str, key_type: KeyType) -> Ed25519PublicKey:
    """The ed25519 public key of an nkey text; ``NkeyError`` for a wrong type, length or checksum."""
    body = _checked(_b32decode(text.strip()))
    if len(body) != 33:
        raise NkeyError("nkey public key must hold 32 key bytes")
    if body[0] != _PREFIX[key_type]:
        raise NkeyError(f"nkey public key is not of type {key_type}")
    return Ed25519PublicKey.from_public_bytes(body[1:])
