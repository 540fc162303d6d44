"""The permission table's invariants (the server-side proof is tests/integration/test_permissions*.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from miles.security.identities import account_name, generate_identities, render_account, render_accounts
from miles.security.permissions import ACTOR_ROLES, ROLES, RunNames, inbox_prefix, markdown_table, role_permissions

RUN = "r1"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def publishes(role: str, **kwargs: bool) -> tuple[str, ...]:
    return role_permissions(RUN, role, **kwargs).publish_allow  # type: ignore[arg-type]


@pytest.mark.parametrize("role", ACTOR_ROLES)
def test_no_actor_creates_changes_or_deletes_streams_and_consumers(role: str) -> None:
    forbidden = re.compile(r"\.(CREATE|UPDATE|DELETE)\b|DURABLE|STREAM\.NAMES|STREAM\.LIST|\$JS\.API\.>|^>$")
    assert [s for s in publishes(role) if forbidden.search(s)] == []


def test_only_the_trainer_publishes_weights_announcements_and_training_metrics() -> None:
    n = RunNames(RUN)
    trainer_only = {n.subjects.weights, n.weight_chunks, n.delta_chunks, n.subjects.step, n.subjects.done}
    for role in ROLES:
        granted = trainer_only & set(publishes(role))
        assert granted == (trainer_only if role == "trainer" else set()), role


def test_only_the_controller_issues_work_and_stop() -> None:
    n = RunNames(RUN)
    controller_only = {n.subjects.prompts, n.evalq, n.subjects.control, n.subjects.eval}
    for role in ROLES:
        granted = controller_only & set(publishes(role))
        assert granted == (controller_only if role == "controller" else set()), role


@pytest.mark.parametrize("role", ["controller", "trainer", "rollout", "teacher"])
def test_heartbeats_and_dead_letters_only_under_the_own_role(role: str) -> None:
    own = [s for s in publishes(role) if s.startswith((f"{RUN}.hb.", f"{RUN}.dlq."))]
    assert own == [f"{RUN}.hb.{role}.*", f"{RUN}.dlq.{role}.>"]


def test_the_monitor_sends_only_read_requests() -> None:
    read_only = re.compile(r"^\$JS\.API\.(STREAM\.INFO|CONSUMER\.INFO|DIRECT\.GET|STREAM\.MSG\.GET)\.")
    assert [s for s in publishes("monitor") if not read_only.match(s)] == []
    assert role_permissions(RUN, "monitor").publish_deny == ()


def test_each_role_receives_replies_only_in_its_own_inbox() -> None:
    for role in ROLES:
        inboxes = [s for s in role_permissions(RUN, role).subscribe_allow if s.startswith("_INBOX")]
        assert inboxes == [f"{inbox_prefix(RUN, role)}.>"]
        assert not any(s.startswith("_INBOX") for s in publishes(role))


def test_only_the_trainer_asks_the_teachers_and_only_teachers_answer_once() -> None:
    subject = RunNames(RUN).subjects.teacher_score
    assert [role for role in ROLES if subject in publishes(role)] == ["trainer"]
    assert [role for role in ROLES if subject in role_permissions(RUN, role).subscribe_allow] == ["teacher"]
    # a teacher's reply rides on the server's allow_responses (one per request received), not on an inbox grant
    assert [role for role in ROLES if role_permissions(RUN, role).allow_responses] == ["teacher"]
    assert role_permissions(RUN, "teacher").as_config()["allow_responses"] is True
    assert "allow_responses" not in role_permissions(RUN, "trainer").as_config()


def test_kv_keys_have_one_writer() -> None:
    controller = role_permissions(RUN, "controller")
    trainer_keys = [f"$KV.{RUN}_STATE.trainer_version", f"$KV.{RUN}_STATE.trainer_floor"]
    assert all(key in controller.publish_deny for key in trainer_keys)
    assert [s for s in publishes("trainer") if s.startswith("$KV.")] == trainer_keys
    assert not any(s.startswith("$KV.") for s in publishes("rollout") + publishes("monitor") + publishes("teacher"))


def test_ephemeral_consumers_only_add_grants() -> None:
    for role in ROLES:
        strict, compat = set(publishes(role)), set(publishes(role, ephemeral_consumers=True))
        assert strict <= compat
    assert any("CONSUMER.CREATE" in s for s in publishes("rollout", ephemeral_consumers=True))


def test_run_names_are_checked() -> None:
    for bad in ("", "a.b", "a b", "a>", "*"):
        with pytest.raises(ValueError):
            role_permissions(bad, "rollout")
    with pytest.raises(ValueError, match="unknown role"):
        role_permissions(RUN, "admin")  # type: ignore[arg-type]


def test_rendered_account_lists_every_role_once() -> None:
    identities = generate_identities(RUN)
    text = render_accounts(render_account(RUN, identities))
    assert text.startswith("accounts {") and f'"{account_name(RUN)}": {{' in text
    for role, identity in identities.items():
        assert text.count(identity.keys.public_key) == 1
        assert f"# {role}" in text
    assert "jetstream: enabled" in text


def test_docs_show_the_current_table() -> None:
    docs = DOCS.read_text()
    begin, end = "<!-- permissions:begin -->\n", "<!-- permissions:end -->"
    table = docs[docs.index(begin) + len(begin) : docs.index(end)]
    assert table == markdown_table(), "docs/security.md is stale: paste markdown_table() between the markers"
