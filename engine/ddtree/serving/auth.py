"""API keys: `/v1/*` answers 401 unless the request carries `Authorization: Bearer KEY` with a known key.

Keys come from `serving.api_key_file` (`--api-key-file`: one key per line; blank lines and lines starting
with `#` are skipped) and from `$DDTREE_API_KEY` (comma-separated), never from a flag, which would show
them in every process listing. `/health`, `/ready` and `/metrics` stay open for probes and scrapers.
"""

from __future__ import annotations

import hmac
import os

from ..config import EngineConfig, UsageError

KEYS_ENV = "DDTREE_API_KEY"
OPEN_PREFIXES = ("/health", "/ready", "/metrics")


def load_api_keys(config: EngineConfig) -> tuple[bytes, ...]:
    """The configured keys (none: no authentication). UsageError for an unreadable or empty key file."""
    keys = [k.strip() for k in os.environ.get(KEYS_ENV, "").split(",") if k.strip()]
    path = config.serving.api_key_file
    if path:
        flag = config.name("serving.api_key_file")
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{flag}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
        from_file = [line for line in lines if line and not line.startswith("#")]
        if not from_file:
            raise UsageError(f"{flag}: {path} holds no key")
        keys += from_file
    bad = [k for k in keys if not k.isprintable() or " " in k]
    if bad:
        raise UsageError("an API key must be printable text without spaces")
    return tuple(dict.fromkeys(k.encode() for k in keys))


def authorized(keys: tuple[bytes, ...], header: str | None) -> bool:
    """Whether an Authorization header carries one of `keys` (compared in constant time)."""
    if header is None or not header[:7].lower() == "bearer ":
        return False
    given = header[7:].strip().encode("utf-8", "replace")
    return any([hmac.compare_digest(given, key) for key in keys])  # every key compared, whatever matches
