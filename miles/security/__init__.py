"""Per-role NATS identities, TLS material and signed weight announcements of a run (docs/security.md).

``miles creds`` (:mod:`miles.security.cli`) writes a bundle (:mod:`miles.security.bundle`): one nkey
user per role with the permissions of :mod:`miles.security.permissions`, in one NATS account per run
(:mod:`miles.security.identities`), a CA with server and client certificates (:mod:`miles.security.tls`),
and the trainer's and the controller's signing keys (:mod:`miles.security.signing`). Actors load their role's part with
``miles.security.bundle.RoleCredentials`` and connect with its ``nats_options()``.

Nothing is imported here: ``miles.security.config`` is read by every entry point's config parsing,
and must not pull in ``cryptography``.
"""
