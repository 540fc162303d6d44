"""The ``bus`` config fields of the security layer (torch-free; merged into ``miles.config.BusConfig``).

Kept apart so the fields, their documentation and their one cross-field rule live with the code
that reads them. ``BusConfig`` takes them by inheritance (``class BusConfig(BusSecurityFields)``) or
by copying the fields; :func:`resolve_credentials` is what ``Bus.open`` calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from miles.security.permissions import ROLES, Role

if TYPE_CHECKING:  # the bundle loader pulls in cryptography; a config import stays light
    from miles.security.bundle import RoleCredentials

# BusConfig's fields that name login material directly; a bundle replaces all of them.
_DIRECT_LOGIN_FIELDS = ("creds", "tls_ca", "tls_cert", "tls_key")


class BusSecurityFields(BaseModel):
    """Per-role identities and signed weight announcements (docs/security.md)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    credentials_dir: str | None = Field(
        None,
        description="A `miles creds` bundle: its root (each actor takes its role's subdirectory) or one role's "
        "directory. The actor logs in with that role's nkey and client certificate, and verifies announcements "
        "with the trainer's public key in it. None: no identities (an open server, as without this field).",
    )
    role: Role | None = Field(
        None,
        description=f"Identity to take from credentials_dir ({', '.join(ROLES)}); None: the actor's own role "
        "(setup for the step that creates the run's streams).",
    )
    require_signatures: bool = Field(
        True,
        description="With credentials_dir: rollout workers and the controller ignore (and count) any weight "
        "announcement without a valid signature by the trainer's key for this run instance, so forged or "
        "altered weights are never applied or believed. Turn off only while a trainer that does not sign is "
        "still running. Without credentials_dir there is no key to check with, and nothing is checked.",
    )
    payload_sha256: bool = Field(
        False,
        description="The trainer adds the SHA-256 of every payload (full, delta, adapter) to its signed "
        "announcement, and workers refuse a payload that does not match it, or an announcement without it. "
        "Needed when someone other than the trainer can write the data plane (a third-party fleet mirroring the "
        "weight streams, a compromised server): the data plane's own xxh3-128 is not collision resistant. "
        "Costs about 0.5 s per GB on each side (SHA-NI), overlappable with the fetch.",
    )

    @model_validator(mode="after")
    def _one_way_to_log_in(self) -> BusSecurityFields:
        if self.credentials_dir is not None:
            direct = [name for name in _DIRECT_LOGIN_FIELDS if getattr(self, name, None)]
            if direct:
                raise ValueError(f"bus.credentials_dir replaces bus.{', bus.'.join(direct)}: set one or the other")
        return self


def resolve_credentials(bus: Any, actor_role: str) -> RoleCredentials | None:
    """The credentials an actor of ``actor_role`` logs in with under ``bus`` (a config with the fields
    above), or ``None`` without ``credentials_dir``. Raises ``CredentialsError`` for a missing or
    mismatched bundle."""
    directory = getattr(bus, "credentials_dir", None)
    if directory is None:
        return None
    role = getattr(bus, "role", None) or actor_role
    if role not in ROLES:
        raise ValueError(f"no identity for role {role!r}; expected one of {', '.join(ROLES)}")
    from miles.security.bundle import RoleCredentials

    return RoleCredentials.load(directory, role)
