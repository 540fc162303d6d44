"""Errors of the bus layer.

One small hierarchy so that actors can catch ``BusError`` for "the message fabric let us down" and
tell it apart from bugs; the messages are one line because they end up in CLI output and logs.
"""

from __future__ import annotations


class BusError(Exception):
    """The NATS server could not be started or reached, or answered something unusable."""


class PayloadMissing(BusError):
    """A weight payload version is not (or no longer) in the data plane, e.g. purged as too old."""


class ChecksumMismatch(BusError):
    """A reassembled weight payload does not hash to the digest it was published with."""


class TransientBusError(BusError):
    """A failure that a retry can cure (a weight chunk whose ack was lost in a server restart)."""


class BusUnavailable(BusError):
    """The bus stayed unusable for longer than ``bus.outage_budget_s``; the message says what was waited for."""
