"""Signed bus messages: the trainer and the controller sign what the rest of the run must believe.

Why: NATS permissions stop a rollout identity from publishing an announcement or a stop, but not a party
between the publisher and a reader: a compromised hub or leaf server, a third-party fleet that mirrors the
run's streams into its own JetStream domain, a mis-configured permission. An ed25519 signature by a key only
the publisher's role holds makes a forged or altered message detectable wherever it was relayed.

What is signed: the exact bytes published, not a re-encoding of their fields. The signature travels in
the message's NATS headers (which JetStream stores, mirrors, sources and returns on a direct get), over

    TAG || str(run) || str(run_nonce) || str(subject) || u64(len(payload)) || payload

(``str(s)`` = u32 big-endian byte length of UTF-8(s), then the bytes). So a verifier in any language needs
no canonical encoding of fields: it checks the bytes it received, then decodes them. The run name and the
run instance's nonce stop a message of another run, or of an earlier run under the same name, from
verifying; the subject stops a signed message from being replayed onto another subject.

Who signs what (:data:`SIGNED_BY`): the trainer its announcements, step metrics, discards and
``trainer_done``; the controller its prompt groups, evaluation tasks, evaluation results and control
commands. Each with its own key (account-type nkeys, ``A...`` public, ``SA...`` seed), separate from
every login key: a NATS server asks a client to sign a nonce of its choosing at login, so a key that also
logs in could be made to sign message bytes by a malicious server.

The weight payload itself needs no signature: the signed announcement carries its size and xxh3-128
digest, the ``state_digest`` of the state it reconstructs, and (``bus.payload_sha256``) its SHA-256,
which :func:`verify_payload` checks (xxh3 is fast but not collision resistant).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from miles.security.nkey import KeyPair, NkeyError, decode_public

TAG = b"miles.signed.v1\x00"
SIGNATURE_BYTES = 64
SIGNATURE_HEADER = "Miles-Signature"
SIGNER_HEADER = "Miles-Signer"

Signer = Literal["trainer", "controller"]
SIGNERS: tuple[Signer, ...] = ("trainer", "controller")

# Message kind -> the role whose key signs it. A reader requires that signer's valid signature on these
# kinds (with ``bus.require_signatures``); every other kind is unsigned and relies on the server's permissions.
SIGNED_BY: dict[str, Signer] = {
    "weights_announced": "trainer",
    "step_metrics": "trainer",
    "groups_discarded": "trainer",
    "trainer_done": "trainer",
    "prompt_group": "controller",
    "eval_task": "controller",
    "eval_result": "controller",
    "groups_issued": "controller",
    "control": "controller",
    "controller_snapshot": "controller",
}


class SignatureError(ValueError):
    """A message whose signature is missing, malformed, made by another key, or over other bytes."""


def _str(value: str) -> bytes:
    data = value.encode("utf-8")
    return struct.pack(">I", len(data)) + data


def signed_bytes(subject: str, payload: bytes | bytearray | memoryview, *, run: str, run_nonce: str) -> bytes:
    """The bytes a signature covers (see the module docstring; docs/security.md has a test vector)."""
    body = bytes(payload)
    return b"".join((TAG, _str(run), _str(run_nonce), _str(subject), struct.pack(">Q", len(body)), body))


def payload_sha256(payload: bytes | bytearray | memoryview) -> str:
    """SHA-256 hex of a weight payload: the cryptographic digest for ``payload_sha256``.

    The data plane's own digest (xxh3-128) is fast but not collision resistant: someone who can write
    the data plane (a compromised server, a mirroring fleet) could prepare a different payload with
    the same xxh3. hashlib releases the GIL, so this can run in a worker thread during the fetch.
    """
    return hashlib.sha256(payload).hexdigest()


@dataclass(frozen=True, slots=True)
class MessageSigner:
    """One role's signing side (trainer or controller) for one run instance."""

    key: KeyPair
    signer: Signer
    run: str
    run_nonce: str
    # Built once: decoding the seed and loading the key cost more than the signature (the controller signs
    # every prompt group).
    _private: Ed25519PrivateKey = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.key.key_type != "account":
            raise ValueError("a signing key must be an account-type nkey (seed 'SA...')")
        object.__setattr__(self, "_private", self.key.private_key())

    @property
    def public_key(self) -> str:
        return self.key.public_key

    def sign(self, subject: str, payload: bytes | bytearray | memoryview) -> str:
        """The signature of ``payload`` on ``subject``: 64 bytes ed25519, as 128 lower-case hex characters."""
        message = signed_bytes(subject, payload, run=self.run, run_nonce=self.run_nonce)
        return self._private.sign(message).hex()

    def headers(self, subject: str, payload: bytes | bytearray | memoryview) -> dict[str, str]:
        """The NATS headers that carry the signature."""
        return {SIGNER_HEADER: self.signer, SIGNATURE_HEADER: self.sign(subject, payload)}


@dataclass(frozen=True, slots=True)
class MessageVerifier:
    """Every reader's side: the public keys of the signing roles and the run instance it belongs to."""

    keys: Mapping[Signer, Ed25519PublicKey]
    run: str
    run_nonce: str

    @classmethod
    def from_nkeys(cls, public_keys: Mapping[Signer, str], *, run: str, run_nonce: str) -> MessageVerifier:
        keys: dict[Signer, Ed25519PublicKey] = {}
        for signer, text in public_keys.items():
            try:
                keys[signer] = decode_public(text, "account")
            except NkeyError as exc:
                raise SignatureError(f"invalid {signer} signing key: {exc}") from None
        return cls(keys=keys, run=run, run_nonce=run_nonce)

    def verify(
        self, subject: str, payload: bytes | bytearray | memoryview, headers: Mapping[str, str] | None, signer: Signer
    ) -> None:
        """Raise :class:`SignatureError` unless ``headers`` carry ``signer``'s valid signature of exactly
        ``payload`` on ``subject`` for this run instance."""
        headers = headers or {}
        signature = headers.get(SIGNATURE_HEADER)
        if not signature:
            raise SignatureError(f"not signed (expected the {signer}'s signature)")
        if headers.get(SIGNER_HEADER) != signer:
            raise SignatureError(f"signed by {headers.get(SIGNER_HEADER)!r}, expected the {signer}")
        if len(signature) != 2 * SIGNATURE_BYTES:
            raise SignatureError(f"{SIGNATURE_HEADER} must be {2 * SIGNATURE_BYTES} hex characters")
        try:
            raw = bytes.fromhex(signature)
        except ValueError:
            raise SignatureError(f"{SIGNATURE_HEADER} is not hex") from None
        key = self.keys.get(signer)
        if key is None:
            raise SignatureError(f"no public key of the {signer} to verify with")
        try:
            key.verify(raw, signed_bytes(subject, payload, run=self.run, run_nonce=self.run_nonce))
        except InvalidSignature:
            raise SignatureError(
                f"no valid signature by the {signer}'s key for run {self.run!r} "
                "(forged, altered, or from another run instance)"
            ) from None


def verify_payload(payload: bytes | bytearray | memoryview, fields: Mapping[str, Any], *, required: bool) -> None:
    """Check a fetched payload against the signed ``payload_sha256`` of its (verified) announcement.

    With ``required`` an announcement without one is refused; otherwise it is accepted on the data
    plane's own digest alone (checked by :class:`miles.sync.transport.dataplane.WeightStore`)."""
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
