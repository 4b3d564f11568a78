"""The store's remote-tier settings, as flags and environment: importable without the
``remote`` extra (``redis``), so ``kvtier``'s command line builds where that extra is not
installed and only ``--remote-url`` needs it."""

from __future__ import annotations

PASSWORD_ENV = "KVTIER_REMOTE_PASSWORD"

SETTINGS = ("remote_url", "remote_cluster", "remote_username", "remote_tls_ca_file",
            "remote_tls_cert_file", "remote_tls_key_file", "remote_key_prefix", "remote_size",
            "remote_timeout_ms", "remote_part_size", "remote_ttl_s", "remote_breaker_failures",
            "remote_breaker_cooldown_ms")
"""The engine's remote settings the store takes, each as ``--remote-...`` (``_`` -> ``-``)."""
