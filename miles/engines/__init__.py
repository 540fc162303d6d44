"""Generation engines: one interface (:class:`miles.engines.base.Engine`), a registry keyed by ``config.type``."""
