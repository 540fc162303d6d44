"""Signing a bus message: the signer's key loaded once against loaded for every signature (the old path).

    python benchmarks/signing.py --messages 5000

The controller signs every prompt group (32 per quickstart step) and the trainer every announcement. A py-spy
profile of the controller showed most of its signing time in decoding the nkey seed and loading the ed25519
key, once per message. This times ``MessageSigner.sign`` (key loaded once) and the old path (the seed decoded
and the key loaded, then the same signature) on a 300-byte message, interleaved, and prints the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from miles.security.nkey import KeyPair
from miles.security.signing import MessageSigner, signed_bytes

SUBJECT = "bench.prompts"
PAYLOAD = b"x" * 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=5000, help="signatures per method")
    args = parser.parse_args()
    key = KeyPair.generate("account")
    signer = MessageSigner(key=key, signer="controller", run="bench", run_nonce="0" * 32)

    def per_message_key() -> str:
        message = signed_bytes(SUBJECT, PAYLOAD, run="bench", run_nonce="0" * 32)
        return key.private_key().sign(message).hex()

    assert per_message_key() == signer.sign(SUBJECT, PAYLOAD)  # ed25519 is deterministic: the same bytes
    times: dict[str, list[float]] = {"key loaded once": [], "key loaded per message": []}
    for _ in range(args.messages):
        for name, sign in (
            ("key loaded once", lambda: signer.sign(SUBJECT, PAYLOAD)),
            ("key loaded per message", per_message_key),
        ):
            start = time.perf_counter()
            sign()
            times[name].append(time.perf_counter() - start)
    medians = {name: 1e6 * statistics.median(ts) for name, ts in times.items()}
    for name, us in medians.items():
        print(f"{name:<24} {us:7.1f} us per signature (median of {args.messages})")
    print(f"per message / once: {medians['key loaded per message'] / medians['key loaded once']:.2f}x")


if __name__ == "__main__":
    main()
