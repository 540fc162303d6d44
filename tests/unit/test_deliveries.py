"""A rollout worker recognises a prompt group delivered again while it plays it, or after it stored it."""

from __future__ import annotations

from typing import Any

from miles.actors.deliveries import GroupDeliveries


def test_a_redelivered_group_is_held_while_in_play_then_acked_when_stored() -> None:
    d = GroupDeliveries(keep=2)
    first, again, third = object(), object(), object()
    msg: Any = first
    assert d.claim("g1", msg) == "play"
    assert d.claim("g1", again) == "playing"  # type: ignore[arg-type]
    assert d.finish("g1", stored=True) == [again]  # the caller acks it with the first
    assert d.claim("g1", third) == "stored" and d.skipped == 2  # type: ignore[arg-type]


def test_a_group_given_back_is_played_again_and_only_the_newest_stored_ids_are_kept() -> None:
    d = GroupDeliveries(keep=2)
    assert d.claim("g1", object()) == "play"  # type: ignore[arg-type]
    held = object()
    assert d.claim("g1", held) == "playing"  # type: ignore[arg-type]
    assert d.finish("g1", stored=False) == [held]  # the worker stopped: both go back to the stream
    assert d.claim("g1", object()) == "play"  # type: ignore[arg-type]
    d.finish("g1", stored=False)
    for gid in ("g1", "g2", "g3"):
        d.claim(gid, object())  # type: ignore[arg-type]
        d.finish(gid, stored=True)
    assert list(d.stored) == ["g2", "g3"]
    assert d.claim("g1", object()) == "play"  # type: ignore[arg-type]  # forgotten: bounded memory


def test_the_trainer_remembers_the_newest_stream_sequences_only() -> None:
    from miles.training.intake import RecentSet

    seen = RecentSet(keep=2)
    for seq in (1, 2, 1, 3):  # 1 touched again: 2 is the oldest
        seen.add(seq)
    assert 1 in seen and 3 in seen and 2 not in seen
